"""
Troubleshooting, part 10: modules functional_call refuses, forward formulas by device, NaN Hessians
===================================================================================================

Three problems from users' reports: Hessians of ``torch.linalg.det`` that ``torch.func`` returns as
NaN, or silently wrong, where eager autograd does not; the ``RuntimeError`` ``functional_call``
raises for TorchScript and ``nn.DataParallel`` modules; and "Trying to use forward AD with ... that
does not support it" on one device or build only. Each is raised and asserted, its cause read in
torch's source or measured, its fix checked against an independent reference. Part 1:
:doc:`plot_troubleshooting`; part 8, attention on CUDA: :doc:`plot_troubleshooting_cuda_kernels`.
"""

import copy
import itertools
import os
import re
import tempfile
import textwrap
import warnings
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
d64 = {"dtype": torch.float64, "device": device}
quiet = partial(warnings.catch_warnings, action="ignore")  # for calls meant to warn
fixes_checked = []  # (label, error, bound): the figure at the end


def refused(kind, words, call, label):  # exactly kind, its message holding words
    try:
        with quiet():  # tracing, vmap's fallback
            call()
    except kind as err:  # other types propagate
        said = re.sub(r"\s+", " ", str(err))
        assert type(err) is kind and words in said, f"{label}: {err!r}"
        print(f"  {label}: {kind.__name__}: {textwrap.shorten(said, 90)}")
        return
    raise AssertionError(f"{label}: no {kind.__name__} in torch {torch.__version__}")


def agree(label, got, want, bound):  # per tensor: largest gap / largest reference entry
    worst = 0.0
    for mine, truth in zip(got, want, strict=True):
        assert mine.shape == truth.shape, f"{label}: {mine.shape}, not {truth.shape}"
        gap = ((mine - truth).abs().max() / truth.abs().max()).item()
        assert gap <= bound, f"{label}: error {gap:.1e} > {bound:.0e}"  # NaN fails too
        worst = max(worst, gap)
    under = f"{bound / worst:.0f}x under it" if worst else "exact"
    print(f"  {label}: error {worst:.1e} (bound {bound:.0e}, {under})")
    fixes_checked.append((label, worst, bound))


# %%
# hessian returns NaN through det at the identity or a rotation
# -------------------------------------------------------------
# pytorch#149694: ``torch.func.hessian`` of ``det(x @ A)`` returned NaN in every entry while
# ``torch.autograd.functional.hessian`` ("eager" below) was right. There ``x @ A`` is the
# identity: invertible, its singular values all equal. Why, as read in ``linalg_det_backward``
# (``torch/csrc/autograd/FunctionsManual.cpp``): when a second derivative may follow, det's
# backward picks, matrix by matrix, a linear solve, or an SVD where ``|det| < 100 eps``. That pick
# indexes with a mask, which the transforms' wrapped tensors ("subclass-like" in torch's
# ``TensorSubclassLikeUtils.h``) cannot, so under ``torch.func`` every matrix takes the SVD, even
# for ``grad(det)`` (the profiler's record, below). ``hessian`` differentiates it, and the SVD's
# derivative is finite only without repeated singular values (``torch.linalg.svd``'s documented
# warning).
det = torch.linalg.det
x_report = torch.tensor([[1.0, 0.0], [1.0, 1.0]], **d64)
a_report = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], **d64)
area = lambda x: det(x @ a_report)  # noqa: E731
nan_func = hessian(area)(x_report).isnan().sum().item()
nan_eager = torch.autograd.functional.hessian(area, x_report).isnan().sum().item()
print(f"x @ A = I: NaN in {nan_func} of 16 entries by hessian, {nan_eager} by eager")
assert nan_func == 16 and nan_eager == 0


def linalg_ops(call):  # the linear-algebra operators the profiler saw a call run
    with profile() as seen:
        call()
    names = {event.name.removeprefix("aten::") for event in seen.events()}
    return sorted(n for n in names if re.fullmatch(r"linalg_(svd|solve|lu_solve)", n))


eye3 = torch.eye(3, **d64)
watched = eye3.clone().requires_grad_()
twice = partial(torch.autograd.grad, det(watched), watched, create_graph=True)
under_func, in_eager = linalg_ops(partial(grad(det), eye3)), linalg_ops(twice)
print(f"det's backward under grad runs {under_func}; eager (create_graph) {in_eager}")
assert under_func == ["linalg_svd"] and "linalg_svd" not in in_eager

# %%
# Which matrices, and which routes? A 3x3 survey against the exact Hessian: det is a cubic
# polynomial in the entries, d²det/dA_ij dA_kl = Σ ε_ikm ε_jln A_mn (ε: the Levi-Civita symbol),
# with no inverse, so singular matrices too. "wrong": finite, off by over 1e-8 (relative to the
# largest exact entry where it exceeds 1, else absolute).
levi = torch.zeros(3, 3, 3, **d64)
for i, j, k in itertools.permutations(range(3)):
    levi[i, j, k] = (j - i) * (k - i) * (k - j) / 2  # the permutation's sign
exact_3x3 = partial(torch.einsum, "ikm,jln,...mn->...ijkl", levi, levi)
diag = lambda *d: torch.diag(torch.tensor(d, **d64))  # noqa: E731
cases = {
    "random": torch.randn(3, 3, **d64),
    "identity": eye3,
    "a rotation": torch.tensor([[0.6, -0.8, 0], [0.8, 0.6, 0], [0, 0, 1]], **d64),
    "diag(1, 1, 2)": diag(1.0, 1.0, 2.0),
    "diag(1, 2, 0), rank 2": diag(1.0, 2.0, 0.0),
    "diag(1, 0, 0), rank 1": diag(1.0, 0.0, 0.0),
    "zero": torch.zeros(3, 3, **d64),
}
routes = {
    "hessian": lambda A: hessian(det)(A),
    "jacrev(jacrev)": lambda A: jacrev(jacrev(det))(A),
    "jacfwd(jacfwd)": lambda A: jacfwd(jacfwd(det))(A),
    "eager": lambda A: torch.autograd.functional.hessian(det, A),
}


def verdict(second, truth):  # NaN; wrong (finite, off by more than 1e-8); right
    if second.isnan().any():
        return "NaN"
    error = (second - truth).abs().max() / truth.abs().max().clamp_min(1)
    return "wrong" if error > 1e-8 else "right"


print(" " * 22 + "".join(f"{route:>16}" for route in routes))
table = []
for name, A in cases.items():
    table.append(" ".join(verdict(r(A), exact_3x3(A)) for r in routes.values()))
    print(f"{name:>22}" + "".join(f"{cell:>16}" for cell in table[-1].split()))
tie, fine, low = "NaN NaN wrong right", "right right wrong right", "NaN NaN wrong NaN"
assert table == [fine, tie, tie, tie, fine, low, "NaN NaN right NaN"], table
# So: tied singular values (the identity, a rotation, diag(1, 1, 2)) give NaN through
# ``torch.func`` and the right Hessian in eager autograd; rank n-2 and lower (two or more zero
# singular values; eager takes the SVD there too) give NaN in all but ``jacfwd(jacfwd(det))``,
# which is wrong at every matrix here but zero, with no NaN to warn: det's forward formula solves
# with the LU factors of the first pass, not differentiated again (pytorch#192540, on det, slogdet
# and solve; "we never differentiate over forward AD", says ``linalg_det_jvp``; PR #192667 of
# August 2026 closed it, and this run's torch still gives the table). A rotation computed in
# floating point has ties only to rounding: ``hessian`` was NaN or wrong at eight from QR
# (pytorch#192521; exact entries at most 1).
rotations = torch.linalg.qr(torch.randn(8, 3, 3, **d64))[0]
errors = [(hessian(det)(Q) - exact_3x3(Q)).abs().max().item() for Q in rotations]
print(f"hessian at 8 rotations from QR, largest errors: {[f'{e:.0e}' for e in errors]}")
assert not any(e <= 1e-8 for e in errors)  # a NaN compares False

# %%
# Two fixes. For 2x2 and 3x3 matrices, as in the report: det as its polynomial, ``a d - b c``, or
# row 0 dotted with the cross product of rows 1 and 2; no division, so singular matrices too.
# Checked against the exact Hessian, the seven cases in one ``vmap``, and the report's 2x2
# against ε_ik ε_jl (det(x A) = det(x) det(A), and det(A) = 1).


def det_small(A):  # 2x2 or 3x3, batched: det as a polynomial in the entries
    if A.shape[-1] == 2:
        a, b, c, d = A.flatten(-2).unbind(-1)
        return a * d - b * c
    top, middle, bottom = A.unbind(-2)
    return torch.linalg.vecdot(top, torch.linalg.cross(middle, bottom))


every = torch.stack(list(cases.values()))
by_polynomial = vmap(hessian(det_small))(every)
agree("polynomial det, the seven", [by_polynomial], [exact_3x3(every)], 1e-15)
swap = torch.tensor([[0.0, 1.0], [-1.0, 0.0]], **d64)  # ε with two indices
fixed = hessian(lambda x: det_small(x @ a_report))(x_report)
by_levi = torch.einsum("ik,jl->ijkl", swap, swap)
agree("polynomial det, the report's", [fixed], [by_levi], 0)
# For larger invertible matrices: ``jacrev`` of the known gradient, det(A) A^-T, so that det's SVD
# is not differentiated. The reference, written out: d²det/dA_ij dA_kl = det(A) (B_ji B_lk - B_jk
# B_li), B = A⁻¹; at the identity, a 4x4 rotation in two planes and a random 4x4. (One matrix at a
# time, eager ``torch.autograd.functional.hessian`` is right at ties too, but has no ``vmap``.)
inverse_t = lambda A: torch.linalg.inv(A).mT  # noqa: E731 (the gradient of log |det|)
gradient_of_det = lambda A: det(A)[..., None, None] * inverse_t(A)  # noqa: E731
plane = torch.tensor([[0.6, -0.8], [0.8, 0.6]], **d64)
q1, q2 = torch.linalg.qr(torch.randn(2, 4, 4, **d64))[0]  # random rotations
mixed = q1 @ torch.diag(torch.tensor([1.0, 1.5, 2.0, 3.0], **d64)) @ q2  # condition 3
fours = torch.stack([torch.eye(4, **d64), torch.block_diag(plane, plane), mixed])
B, eins = torch.linalg.inv(fours), torch.einsum  # the reference, written out
by_formula = eins("nji,nlk->nijkl", B, B) - eins("njk,nli->nijkl", B, B)
by_formula = det(fours)[:, None, None, None, None] * by_formula
by_reverse = vmap(jacrev(gradient_of_det))(fours)
agree("vmap(jacrev) of det(A) A^-T", [by_reverse], [by_formula], 1e-14)
# ``jacfwd(jacfwd(slogdet))`` is wrong as det's is; ``hessian``, -B_jk B_li, is right. Batched
# forward mode through det, slogdet or ``linalg.solve``, ``vmap(hessian(f))`` included, is another
# bug, silently wrong on the CPU in 2.13: :doc:`plot_troubleshooting_batched_linalg`.
logdet = lambda A: torch.linalg.slogdet(A).logabsdet  # noqa: E731
log_exact = -eins("jk,li->ijkl", B[2], B[2])  # at the random 4x4
agree("hessian(slogdet)", [hessian(logdet)(mixed)], [log_exact], 1e-14)
twice_forward = verdict(jacfwd(jacfwd(logdet))(mixed), log_exact)
print(f"  jacfwd(jacfwd(slogdet)): {twice_forward}")
assert twice_forward == "wrong"

# %%
# The stateless API can't be used with Jitted modules
# ---------------------------------------------------
# A ``RuntimeError`` from :func:`~torch.func.functional_call` given a scripted or traced module,
# or called while ``torch.jit.trace`` runs (titans-pytorch#19 met it from a layer inside a larger
# network). The cause: a type check at the top of ``_functional_call`` in
# ``torch/nn/utils/stateless.py`` refuses ``ScriptModule``\ s, script functions and a trace or
# script in progress, before it swaps in any weight.
head = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).to(**d64)
weights = {name: p.detach() for name, p in head.named_parameters()}
xs, ys = torch.randn(8, 4, **d64), torch.randn(8, 1, **d64)
scripted, traced = torch.jit.script(head), torch.jit.trace(head, xs)
jitted = "The stateless API can't be used with Jitted modules"
for label, module in [("scripted", scripted), ("traced", traced)]:
    refused(RuntimeError, jitted, partial(functional_call, module, weights, xs), label)
in_trace = partial(torch.jit.trace, lambda x: functional_call(head, weights, x), xs)
refused(RuntimeError, jitted, in_trace, "inside torch.jit.trace")
# The fix: the eager module, with the scripted one's weights. With the class at hand, build it
# and ``load_state_dict(scripted.state_dict())``. With only a saved file, ``torch.jit.load`` it:
# its ``.code`` prints the top forward, each submodule's ``original_name`` names its class, and
# ``state_dict()`` gives names and shapes. For torch.nn layers that sufficed (the copy's outputs
# equal the file's, checked); a class of your own would be rewritten from ``.code`` (not tried).
with tempfile.TemporaryDirectory() as saved_in:
    scripted.save(os.path.join(saved_in, "head.pt"))
    loaded = torch.jit.load(os.path.join(saved_in, "head.pt"), map_location=device)
shapes = {name: tuple(t.shape) for name, t in loaded.state_dict().items()}
print(f"classes {[m.original_name for m in loaded.children()]}, weights {shapes}")
print(textwrap.indent(loaded.code.strip(), "    "))
rebuilt = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).to(**d64)
rebuilt.load_state_dict(loaded.state_dict())  # strict: every name and shape must match
agree("outputs, the eager copy against the file", [rebuilt(xs)], [loaded(xs)], 1e-15)


def looped(module):  # autograd.grad, sample by sample, stacked per parameter
    params, rows = list(module.parameters()), []
    for x, y in zip(xs, ys):
        rows.append(torch.autograd.grad((module(x) - y).square().sum(), params))
    return [torch.stack(per_name) for per_name in zip(*rows)]


# Per-sample gradients through the copy, against autograd.grad through the loaded TorchScript
# module, one sample at a time. (For its inputs, the loaded module goes into the transforms
# itself: ``vmap(jacrev)``, against the Jacobian by hand, W₂ diag(1 - tanh²(W₁x + b₁)) W₁.)
copied = {name: p.detach() for name, p in rebuilt.named_parameters()}
sq_error = lambda p, x, y: (functional_call(rebuilt, p, x) - y).square().sum()  # noqa: E731
per_sample = vmap(grad(sq_error), in_dims=(None, 0, 0))(copied, xs, ys)
agree("per-sample gradients of the copy", per_sample.values(), looped(loaded), 2e-15)
slopes = 1 - torch.tanh(xs @ weights["0.weight"].T + weights["0.bias"]).square()
by_hand = (weights["2.weight"] * slopes)[:, None] @ weights["0.weight"]
agree("vmap(jacrev(loaded)), inputs", [vmap(jacrev(loaded))(xs)], [by_hand], 1e-15)

# %%
# The stateless API can't be used with nn.DataParallel module
# -----------------------------------------------------------
# A ``RuntimeError`` from :func:`~torch.func.functional_call` given an ``nn.DataParallel``, also
# without a GPU, where DataParallel's forward would only call its module (its ``device_ids``,
# printed, are then empty). The cause: the same type check, a few lines on, added (PR #107403)
# after pytorch#77576 failed on two GPUs with tensors on two devices: DataParallel's forward
# copies the module's parameters to each GPU (``replicate.py`` reads ``module._parameters``).
parallel = nn.DataParallel(head)
renamed = {f"module.{name}": w for name, w in weights.items()}
said = "The stateless API can't be used with nn.DataParallel module"
call = partial(functional_call, parallel, renamed, xs)
refused(RuntimeError, said, call, f"DataParallel, device_ids {parallel.device_ids}")
# The fix: transform ``parallel.module``. For several GPUs, split the batch yourself: a shard
# and a copy of the weights per device, ``vmap(grad)`` on each, the results gathered on the
# first. CUDA launches kernels without waiting, so the devices' work may overlap (not measured;
# one process per GPU, with ``torch.distributed``, is the usual route). With fewer than two GPUs
# the devices are this one twice, so that the split and the gathering run. Reference: plain
# autograd, sample by sample.
gpus = [torch.device(f"cuda:{n}") for n in range(torch.cuda.device_count())]
shard_devices = gpus if len(gpus) > 1 else [device, device]


def per_sample_spread(module, params, x, y, devices):  # a shard of the batch per device
    def loss(p, a, b):
        return (functional_call(module, p, a) - b).square().sum()

    step, parts, n = vmap(grad(loss), in_dims=(None, 0, 0)), [], len(devices)
    for where, a, b in zip(devices, x.tensor_split(n), y.tensor_split(n)):
        local = {name: w.to(where) for name, w in params.items()}
        parts.append(step(local, a.to(where), b.to(where)))
    return [torch.cat([p[name].to(devices[0]) for p in parts]) for name in params]


spread = per_sample_spread(parallel.module, weights, xs, ys, shard_devices)
agree(f"parallel.module, shards on {shard_devices}", spread, looped(head), 2e-15)


# %%
# Trying to use forward AD with <op> that does not support it, on one device only
# -------------------------------------------------------------------------------
# A ``NotImplementedError`` from ``jvp``, ``jacfwd`` or ``hessian`` on one device, GPU or build
# only (an operator with no forward formula anywhere, like ``igamma``: part 3,
# :doc:`plot_troubleshooting_libraries`). Forward formulas belong to operators, and some
# functions pick a device-specific kernel, an operator of its own: attention that ran on a K40
# failed on newer GPUs (pytorch#117629, the memory-efficient kernel), ``linear`` on Apple's MPS
# (pytorch#137720). (One build lacked formulas: ``hessian`` of ``nn.Softmax`` in torch 1.13's
# Python 3.11 wheel, pytorch#91100.) Here ``F.scaled_dot_product_attention`` with 4-D inputs picks
# ``_scaled_dot_product_flash_attention_for_cpu`` on the CPU (pytorch#128971). A checker: the
# forward-mode transforms on each device present, in the user's dtype, the operator that stops
# each named, and each ``jvp`` that runs checked against ``jacrev``.
class TwoHeads(nn.Module):  # self-attention over (length, width): two heads
    def __init__(self, attend=F.scaled_dot_product_attention, width=8):
        super().__init__()
        self.qkv, self.attend = nn.Linear(width, 3 * width), attend

    def forward(self, x):  # (L, 8) -> q, k, v of (1, 2, L, 4) -> (L, 8)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(1, 2, 0, 3)[:, None]
        return self.attend(q, k, v)[0].transpose(0, 1).flatten(-2)


FORWARD_MODE = {
    "jvp": lambda f, x, t: jvp(f, (x,), (t,))[1],
    "jacfwd": lambda f, x, t: jacfwd(f)(x),
    "hessian": lambda f, x, t: hessian(lambda z: f(z).square().sum())(x),
}
PRESENT = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}


def survey(model, x, dtype, label):  # {(device, transform): "runs", or the op named}
    found = print(label) or {}
    for where in ["cpu"] + [name for name, here in PRESENT.items() if here]:
        twin, point = copy.deepcopy(model).to(where, dtype), x.to(where, dtype)
        tangent = torch.randn_like(point)
        for how, transform in FORWARD_MODE.items():
            try:
                result = transform(twin, point, tangent)
            except NotImplementedError as err:
                named = re.search(r"forward AD with (\S+) that", str(err))
                found[where, how] = named.group(1) if named else str(err)[:60]
                continue
            found[where, how] = "runs"
            if how == "jvp":  # against J t, J from reverse mode
                with quiet():
                    along = torch.einsum("ijkl,kl->ij", jacrev(twin)(point), tangent)
                agree(f"{where}, jvp against jacrev", [result], [along], 1e-6)
        said = sorted({found[where, how] for how in FORWARD_MODE})
        print(f"  {where}, jvp / jacfwd / hessian: {' or '.join(said)}")
    return found


model = TwoHeads().double()  # on the CPU, whatever the page's device
tokens = torch.randn(5, 8, dtype=torch.float64)
written = survey(model, tokens, torch.float32, "as written, in float32:")
fused = "_scaled_dot_product_flash_attention_for_cpu"
assert all(written["cpu", how] == fused for how in FORWARD_MODE), written
math_attention = partial(sdpa_kernel, SDPBackend.MATH)  # matmul and softmax
with math_attention():
    inside = survey(model, tokens, torch.float32, "with SDPBackend.MATH, in float32:")
    assert set(inside.values()) == {"runs"}
message = f"Trying to use forward AD with {fused} that does not support it"
refused(NotImplementedError, message, partial(jvp, model, (tokens,), (tokens,)), "jvp")
# Each kernel that attention can pick is an operator, and autograd checks for its forward formula
# before it looks for the device's kernel: plain forward AD asks each here, the CUDA and MPS ones
# too (each raised; none ran). Listed from the dispatcher (``dir(torch.ops.aten)`` lists only
# operators used so far), less ``..._attention_math``: the MATH route above, made of primitives.
every = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()}
kernels = sorted(n for n in every if n.startswith("_scaled_dot_product"))
kernels.remove("_scaled_dot_product_attention_math")
with fwAD.dual_level():
    dual = fwAD.make_dual(torch.randn(1, 2, 5, 4), torch.ones(1, 2, 5, 4))
    for name in (n for n in kernels if not n.endswith("backward")):
        bias = (None, False) if re.search("efficient|cudnn", name) else ()  # lse too
        call = partial(getattr(torch.ops.aten, name), dual, dual, dual, *bias)
        refused(NotImplementedError, f"{name} that does not support", call, name[20:])

# %%
# Workarounds when forward mode fails, checked in float64 against reverse mode through the fused
# kernel: J t for a ``jvp``; for Hessians, central differences of its gradient. ``jacrev`` for
# ``jacfwd`` runs (checked against differences of values); ``jacrev(jacrev)`` for ``hessian``
# does not: the fused kernel's backward has no derivative.
score = lambda m: lambda x: m(x).square().sum()  # noqa: E731 (each model's scalar)
bumps = 1e-5 * torch.eye(40, dtype=torch.float64).view(40, 5, 8)  # one per entry
slope = grad(score(model))
with quiet():  # vmap's fallback, fused backward
    rows = jacrev(model)(tokens)
by_values = [(model(tokens + b) - model(tokens - b)) / 2e-5 for b in bumps]
by_slopes = [(slope(tokens + b) - slope(tokens - b)) / 2e-5 for b in bumps]
hessian_ref = torch.stack(by_slopes, -1).view(5, 8, 5, 8)
agree("jacrev", [rows], [torch.stack(by_values, -1).view(5, 8, 5, 8)], 1e-9)
again = f"derivative for aten::{fused}_backward is not implemented"
twice_reverse = partial(jacrev(jacrev(score(model))), tokens)
refused(RuntimeError, again, twice_reverse, "jacrev(jacrev)")
tangent = torch.randn(5, 8, dtype=torch.float64)
jvp_ref = torch.einsum("ijkl,kl->ij", rows, tangent)
with math_attention():
    agree("MATH backend, hessian", [hessian(score(model))(tokens)], [hessian_ref], 1e-9)
    agree("MATH backend, jvp", [jvp(model, (tokens,), (tangent,))[1]], [jvp_ref], 2e-15)
rewritten = copy.deepcopy(model)  # the same, in operators with forward formulas
rewritten.attend = lambda q, k, v: (q @ k.mT * q.shape[-1] ** -0.5).softmax(-1) @ v
agree("primitives, hessian", [hessian(score(rewritten))(tokens)], [hessian_ref], 1e-9)


# An autograd.Function keeps the fused kernel in the forward and supplies the tangent:
# P = softmax(S), S = q kᵀ/√d; dS = (dq kᵀ + q dkᵀ)/√d, dP = P ⊙ (dS - Σ_j P ⊙ dS),
# d out = dP v + P dv. For ``jvp`` and ``jacfwd``; ``hessian`` needs a backward too.
class FusedWithTangent(torch.autograd.Function):
    generate_vmap_rule = True  # so that jacfwd (vmap over jvp) runs too

    @staticmethod
    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, dq, dk, dv):
        (q, k, v), scale = ctx.saved_tensors, ctx.saved_tensors[0].shape[-1] ** -0.5
        p = (q @ k.mT * scale).softmax(-1)
        ds = (dq @ k.mT + q @ dk.mT) * scale
        return p * (ds - (p * ds).sum(-1, keepdim=True)) @ v + p @ dv


with_tangent = copy.deepcopy(model)
with_tangent.attend = FusedWithTangent.apply
by_function = jvp(with_tangent, (tokens,), (tangent,))[1]
agree("autograd.Function, jvp", [by_function], [jvp_ref], 2e-15)
agree("autograd.Function, jacfwd", [jacfwd(with_tangent)(tokens)], [rows], 1e-15)

# %%
# Every fix against its reference
# -------------------------------
# Each check's error (dot) and its bound (tick); an exact result is drawn at 1e-19. Where the
# reference is a finite difference (``jacrev`` and two Hessians), the dot is mostly its error.
names, worst_errors, error_bounds = zip(*fixes_checked)
fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
ax.plot([max(e, 1e-19) for e in worst_errors], names, "o", color="black")
ax.scatter(error_bounds, names, marker="|", s=300, color="0.4")
ax.set(xscale="log", xlabel="gap / largest reference entry", ylim=(len(names), -1))
ax.set_title(f"{len(names)} checks on {device.type}: error (dot), bound (tick)")
plt.show()

# %%
# What to remember
# ----------------
# * ``torch.func`` second derivatives of ``det`` are NaN at tied singular values (identity,
#   rotations), silently wrong near them and through ``jacfwd(jacfwd)`` (``slogdet`` too). Use
#   det's polynomial (2x2, 3x3) or ``jacrev`` of det(A) A^-T; batched, read part 11 first.
# * ``functional_call`` refuses scripted, traced and ``DataParallel`` modules by type: transform
#   the eager module (``.module``; the eager class with a loaded ``state_dict``); split batches
#   over GPUs yourself.
# * Forward formulas belong to operators, and a function may pick another operator per device:
#   run the checker on each device; plain forward AD shows which kernels lack a formula.
# * When forward mode fails: ``jacrev`` for Jacobians; for Hessians a path whose backward has a
#   derivative (``SDPBackend.MATH``, primitives); for ``jvp``, an ``autograd.Function``.
