"""
Troubleshooting, part 7: batched autograd.grad, cdist, escaping pullbacks, indices, lstsq
=========================================================================================

Jacobian rows from ``torch.autograd.grad`` over a batch of cotangents, a ``vjp_fn`` out of compiled
code, ``jacrev`` with an integer argument, ``lstsq`` under ``vmap``, a per-sample index under
``grad``, ``torch.cdist``'s wrong Jacobian. Titles: the message's first words (PyTorch 2.13), A to
Z, a silent problem last; each problem and fix is asserted. Part 1: :doc:`plot_troubleshooting`.
"""

import subprocess
import sys
import textwrap
import traceback
import warnings
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch._C import _functorch as functorch_c
from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError, Unsupported
from torch._dynamo.utils import counters
from torch.func import grad, hessian, jacfwd, jacrev, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64, cpu64 = {"device": device, "dtype": torch.float64}, {"dtype": torch.float64}
errors = {}  # check -> (measured error, bound), for the figure


def fails_with(kind, words, call, label=""):  # exactly kind, with words
    try:
        call()
    except kind as err:
        said = " ".join(str(err).split())
        assert type(err) is kind and words in said, f"{type(err).__name__}: {said}"
        shown = textwrap.shorten(said[said.find(words) :], 90)
        print(f"  {label}{kind.__name__}: ...{shown}")
        return err
    raise AssertionError(f"no {kind.__name__} raised")


def within(label, got, want, bound):  # largest gap / reference's largest entry <= bound
    assert got.shape == want.shape, (label, got.shape, want.shape)
    error = (got - want).abs().max().item() / want.abs().max().item()
    assert error <= bound, f"{label}: error {error:.1e} > bound {bound:.0e}"
    margin = f"{bound / error:.0f}x under it" if error else "exact"
    print(f"  {label}: error {error:.1e} (bound {bound:.0e}, {margin})")
    errors[label] = (error, bound)


# %%
# Batching rule not implemented for aten::detach: is_grads_batched through a NumPy backward
# -----------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``torch.autograd.grad(..., is_grads_batched=True)`` (Jacobian rows from
# one-hot cotangents in one call) when a backward leaves torch, here an ``autograd.Function`` in
# NumPy: ``.numpy()`` calls ``detach``, for which is_grads_batched's legacy vmap has no rule (shown
# with ``.numpy()`` alone). ``torch.vmap`` over ``autograd.grad``, as TorchJD and MACE call it,
# fails on the storage a batched tensor lacks: "Cannot access data pointer of Tensor that doesn't
# have storage". A loop of calls works. The fixes: the op in torch or, for an extension's kernel,
# an operator made with ``torch.library.custom_op``, which ``vmap`` runs sample by sample or
# batches by its ``register_vmap`` rule (:doc:`plot_extending_torch_func`, part 4's `vendor::gate
# section <plot_troubleshooting_custom_and_compiled.html#batching-rule-not-implemented-for-vendor-
# gate-we-could-not-generate-a-fallback>`__).


def batched(out, cotangents):  # one call, the cotangents stacked along dim 0
    return torch.autograd.grad(out, leaf, cotangents, True, is_grads_batched=True)[0]


def by_vmap(out, cotangents):  # torch.vmap over autograd.grad
    return vmap(lambda c: torch.autograd.grad(out, leaf, c, True)[0])(cotangents)


# tanh computed in NumPy: a stand-in for an op from an extension
class NumpyTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.y = np.tanh(x.detach().numpy())
        return torch.from_numpy(ctx.y)

    @staticmethod
    def backward(ctx, cotangent):
        return torch.from_numpy(cotangent.numpy() * (1 - ctx.y**2))


W1, W2 = torch.randn(6, 5, **cpu64), torch.randn(4, 6, **cpu64)
x, one_hots = torch.randn(5, **cpu64), torch.eye(4, **cpu64)
leaf = x.clone().requires_grad_(True)
out = NumpyTanh.apply(W1 @ leaf) @ W2.T
loop = torch.stack([torch.autograd.grad(out, leaf, c, True)[0] for c in one_hots])
detach = "Batching rule not implemented for aten::detach"
err = fails_with(RuntimeError, detach, partial(batched, out, one_hots))
nowhere = "Cannot access data pointer of Tensor"
fails_with(RuntimeError, nowhere, partial(by_vmap, out, one_hots))
legacy = torch._vmap_internals._vmap(lambda c: c.numpy())  # is_grads_batched's vmap
fails_with(RuntimeError, detach, partial(legacy, one_hots), "legacy vmap, .numpy(): ")
last = traceback.extract_tb(err.__traceback__)[-1].line.strip()  # which op? its line
print(f"  the traceback's last frame, the failing line: {last}")
assert traceback.extract_tb(err.__traceback__)[-1].name == "backward"
# Fix 1, the op in torch: then all run, and so does torch.func's jacrev (vmap over vjp), chunk_size
# capping how many rows run at once. Reference: the loop over the NumPy op.
model = lambda v: torch.tanh(W1 @ v) @ W2.T  # noqa: E731
out = model(leaf)
within("is_grads_batched, torch.tanh", batched(out, one_hots), loop, 1e-14)
within("vmap over autograd.grad", by_vmap(out, one_hots), loop, 1e-14)
within("jacrev(chunk_size=2)", jacrev(model, chunk_size=2)(x), loop, 1e-14)
# Fix 2: the backward as an operator (the whole op works too, with register_autograd: checked
# apart). is_grads_batched loops over the samples, with a vmap rule or without (checked apart).


@torch.library.custom_op("part7::numpy_tanh_backward", mutates_args=())
def tanh_backward(cotangent: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(cotangent.numpy() * (1 - y.numpy() ** 2))


class OpTanh(NumpyTanh):  # NumpyTanh's forward; its backward calls the operator
    backward = staticmethod(lambda ctx, c: tanh_backward(c, torch.from_numpy(ctx.y)))


out = OpTanh.apply(W1 @ leaf) @ W2.T
with warnings.catch_warnings(record=True, action="always") as said:
    within("custom_op, no rule, vmap", by_vmap(out, one_hots), loop, 1e-14)
assert any("performance drop" in str(w.message) for w in said)
rule = lambda info, dims, c, y: (tanh_backward(c.movedim(dims[0], 0), y), 0)  # noqa: E731
tanh_backward.register_vmap(rule)  # y, saved in the forward, is never batched here
within("custom_op, register_vmap, vmap", by_vmap(out, one_hots), loop, 1e-14)
within("custom_op, is_grads_batched", batched(out, one_hots), loop, 1e-14)
# A hook computing with .data: torch.vmap refuses it (2.0 crashed, pytorch#97161); with
# is_grads_batched the process dies of a segmentation fault (in a child process here).
CRASH = """import torch
x = torch.randn(2, 4, requires_grad=True); y = 3 * x
y.register_hook(lambda g: g.data * 2)
torch.autograd.grad(y.tanh(), x, torch.eye(8).view(8, 2, 4), is_grads_batched=True)"""
child = subprocess.Popen([sys.executable, "-c", CRASH], stderr=subprocess.DEVNULL)
watched = W1 @ leaf  # 6 outputs; W1.T below: 5 cotangents for them
watched.register_hook(lambda g: g.data * 2)
hooked = vmap(lambda c: torch.autograd.grad(watched, leaf, c, retain_graph=True)[0])
fails_with(RuntimeError, "accessing `data` under vmap", partial(hooked, W1.T))
code = child.wait(timeout=120)
print(f"  the child, is_grads_batched through that hook: exit code {code}")
assert code == -11, code  # killed by signal 11, SIGSEGV

# %%
# Cannot access storage of TensorWrapper: a vjp_fn returned from torch.compile
# ----------------------------------------------------------------------------
# A ``BackendCompilerFailed``, "backend='inductor' raised: NotImplementedError: Cannot access
# storage of TensorWrapper" (or another backend's name), from ``torch.compile(lambda x: vjp(f, x))``
# whose caller keeps the pullback, with or without ``fullgraph`` or a random op in ``f``. Why, shown
# by a backend that runs the graph as it is (and raises nothing): ``vjp_fn`` closes over tensors of
# ``vjp``'s level, wrappers the graph must return, and AOTAutograd cannot read their storage.
W, z, v = torch.randn(3, 4, **f64), torch.randn(4, **f64), torch.randn(3, **f64)
smooth = lambda p: torch.tanh(W @ p)  # noqa: E731
noisy = lambda p: F.dropout(torch.tanh(W @ p), 0.5)  # noqa: E731 (a random op)
# compiled: returns f(p) and the pullback, vjp_fn
returning_vjp_fn = lambda f, **options: torch.compile(lambda p: vjp(f, p), **options)  # noqa: E731
torch.compiler.reset()  # a fresh start, whatever ran before in this process
tries = [(smooth, False, "aot_eager"), (smooth, True, "aot_eager"),
         (noisy, True, "aot_eager"), (smooth, True, "inductor")]  # fmt: skip
for f, full, backend in tries:
    escaping = returning_vjp_fn(f, backend=backend, fullgraph=full)
    label = f"{'dropout' if f is noisy else 'tanh'}, {backend}, fullgraph={full}: "
    err = fails_with(BackendCompilerFailed, "Cannot access storage of TensorWrapper",
                     partial(escaping, z), label)  # fmt: skip
    assert str(err).startswith(f"backend='{backend}' raised:\nNotImplementedError"), err
wrapped, is_wrapped = [], functorch_c.is_functorch_wrapped_tensor


def as_is(gm, example_inputs):  # a backend: runs the graph, notes the wrapped outputs
    note = lambda out: wrapped.append([is_wrapped(t) for t in out]) or out  # noqa: E731
    return lambda *args: note(gm(*args))


_, kept = returning_vjp_fn(smooth, backend=as_is, fullgraph=True)(z)
print(f"  graph outputs that are wrappers: {wrapped[0]}")
assert wrapped[0][0] is False and any(wrapped[0][1:])
pullback_by_hand = W.T @ ((1 - smooth(z) ** 2) * v)  # the pullback of tanh(Wz), by hand
within("vjp_fn from the graph run as is", kept(v)[0], pullback_by_hand, 1e-14)
# Fix 1: compile a function that takes the cotangent too and applies the pullback inside (one
# graph). Fix 2: compile f alone, then use torch.autograd; vjp of a compiled f raises Unsupported
# (without fullgraph f runs uncompiled: checked apart). Reference: Wᵀ((1 − tanh²(Wz)) ⊙ m ⊙ v), m
# dropout's mask times 2, read from the output.


@torch.compile(backend="aot_eager", fullgraph=True)
def output_and_pullback(p, cotangent):
    output, pullback = vjp(noisy, p)
    return output, pullback(cotangent)[0]


# dropout's mask and scale, from its output (tanh is never 0 here)
by_hand = lambda output: W.T @ ((1 - smooth(z) ** 2) * 2 * (output != 0) * v)  # noqa: E731
graphs_before = counters["stats"]["unique_graphs"]
output, pulled = output_and_pullback(z, v)
assert counters["stats"]["unique_graphs"] == graphs_before + 1  # one graph, no break
within("vjp and its pullback compiled together", pulled, by_hand(output), 1e-14)
compiled_f = torch.compile(noisy, backend="aot_eager", fullgraph=True)
point = z.clone().requires_grad_()
output = compiled_f(point)
pulled = torch.autograd.grad(output, point, v)[0]
within("compiled f, then autograd.grad", pulled, by_hand(output), 1e-14)
fails_with(Unsupported, "functorch tracing", lambda: vjp(compiled_f, z))

# %%
# Thing passed to transform API must be Tensor, got <class 'int'>: argnums at an integer
# --------------------------------------------------------------------------------------
# A ``ValueError`` from ``jacrev`` or ``grad`` when ``argnums`` points at a Python number (from
# ``jacfwd`` and ``hessian``, an ``AttributeError``: "'int' object has no attribute 'numel'"). Other
# non-tensor arguments work in 2.13 (``jacrev(f)(x, 3)`` below); torch 2.0.0 raised "'int' object
# has no attribute 'dtype'" (pytorch#99405; fixed in 2.0.1). References: closed forms.
x = torch.randn(5, **f64)
scaled = lambda x, n: x.sin() * n  # noqa: E731
within("jacrev(f)(x, 3)", jacrev(scaled)(x, 3), torch.diag(3 * x.cos()), 1e-15)
thing = "Thing passed to transform API must be Tensor, got <class 'int'>"
fails_with(ValueError, thing, lambda: jacrev(scaled, argnums=1)(x, 3))
numel = "'int' object has no attribute 'numel'"
fails_with(AttributeError, numel, lambda: jacfwd(scaled, argnums=1)(x, 3))
# The fixes: bind the number with functools.partial; for a derivative in it, pass a tensor.
bound = jacrev(partial(scaled, n=3))(x)
within("jacrev(partial(f, n=3))", bound, torch.diag(3 * x.cos()), 1e-15)
n = torch.tensor(3.0, **f64)
within("d/dn, n a tensor", jacrev(scaled, argnums=1)(x, n), x.sin(), 1e-15)

# %%
# torch.linalg.lstsq: input.size(-2) should match other.size(-2): a vector right-hand side
# ----------------------------------------------------------------------------------------
# A ``RuntimeError`` from :func:`torch.linalg.lstsq` under ``vmap`` when each sample's right-hand
# side is a vector, whatever ``in_dims`` says; outside ``vmap`` a vector works. Under ``vmap`` lstsq
# takes the vector as a matrix of one row (as read in its batching rule). The fix: pass an m × 1
# matrix, take its column; :func:`torch.linalg.solve` takes the vector. References: lstsq per sample
# in a loop, and the normal equations AᵀA x = Aᵀy.
design = torch.randn(8, 3, 6, **f64)  # (m, n, batch): the samples last
target = torch.randn(8, 6, **f64)  # (m, batch)
fit = lambda A, y: torch.linalg.lstsq(A, y).solution  # noqa: E731
per_sample = torch.stack([fit(design[..., k], target[:, k]) for k in range(6)])
mismatch = "input.size(-2) should match other.size(-2)"
fails_with(RuntimeError, mismatch, lambda: vmap(fit, in_dims=(-1, -1))(design, target))
front = design.movedim(-1, 0), target.movedim(-1, 0)
fails_with(RuntimeError, mismatch, lambda: vmap(fit)(*front))
columns = vmap(lambda A, y: fit(A, y[:, None])[:, 0], in_dims=(-1, -1))(design, target)
within("lstsq, b as an m x 1 matrix", columns, per_sample, 1e-14)
normal = torch.einsum("mib,mjb,bj->bi", design, design, columns)  # AᵀA x per sample
within("lstsq: AᵀA x = Aᵀy", normal, torch.einsum("mib,mb->bi", design, target), 1e-14)
square = design[:3] + 3 * torch.eye(3, **f64)[..., None]  # (3, 3, batch)
solved = vmap(torch.linalg.solve, in_dims=(-1, -1))(square, target[:3])
residual = torch.einsum("ijb,bj->bi", square, solved)  # A x per sample, against b
within("vmap(torch.linalg.solve), b a vector", residual, target[:3].T, 1e-14)

# %%
# vmap: It looks like you're either (1) calling .item() on a Tensor ...: t[i] under grad
# --------------------------------------------------------------------------------------
# A ``RuntimeError`` from a per-sample 0-d integer index, ``t[i]``, inside ``grad``, ``jacrev`` or
# ``jacfwd`` under ``vmap``, or under ``torch.compile`` of that (``TorchRuntimeError``). Under
# ``vmap`` alone it works in 2.13, compiled too (checked apart); older releases raised there
# (pytorch#124423; #124291 on 2.4.0a0; both open when checked). Indexing reads a 0-d index as a
# number, with ``.item()``, unless it is one of ``vmap``'s batched tensors
# (``ATen/TensorIndexing.h``); inside ``grad`` it is ``grad``'s wrapper of one (printed).
# ``grad(vmap(...))`` with ``s[i]`` works (checked below). Other causes of the message, ``.item()``,
# ``float()`` or an ``if`` on a value: part 1's `.item() section
# <plot_troubleshooting.html#vmap-it-looks-like-you-re-calling-item-on-a-tensor>`__ and the one
# before it. A slice at a per-sample start: :doc:`plot_data_dependent_shapes`.
logits = torch.randn(6, 5, **f64)
labels = torch.tensor([0, 4, 1, 3, 3, 2], device=device)
picked = vmap(lambda s, i: s[i])(logits, labels)
within("vmap: s[i]", picked, torch.stack([s[i] for s, i in zip(logits, labels)]), 0)
log_prob = lambda s, i: s.log_softmax(0)[i]  # noqa: E731
item = "calling .item() on a Tensor"
for transform in (grad, jacrev, jacfwd):
    by = partial(vmap(transform(log_prob)), logits, labels)
    fails_with(RuntimeError, item, by, f"vmap({transform.__name__}): ")
seen = []  # what the index is, inside grad under vmap: batched? grad's wrapper?
kinds = functorch_c.is_batchedtensor, functorch_c.is_gradtrackingtensor
peek = lambda s, i: seen.append([kind(i) for kind in kinds]) or s.sum()  # noqa: E731
vmap(grad(peek))(logits, labels)
print(f"  inside grad, i is batched: {seen[0][0]}, grad's wrapper: {seen[0][1]}")
assert seen[0] == [False, True]
compiled = torch.compile(vmap(grad(log_prob)), backend="aot_eager", fullgraph=True)
fails_with(TorchRuntimeError, item, lambda: compiled(logits, labels))
# Rewrites that batch: a 1-element index (t[a[None], b[None]] for two), gather, take_along_dim or a
# one-hot mask, then [0] or .sum() for the scalar grad wants; or the index kept outside grad, in a
# closure (checked apart; i - 1 inside grad fails again). Reference: d log softmax(s)_i / ds =
# onehot(i) − softmax(s).
classes = torch.arange(5, device=device)
picks = {  # each takes row[i], i a batched 0-d index, as a scalar, in a way that batches
    "row[i[None]][0]": lambda row, i: row[i[None]][0],
    "index_select(0, i[None])[0]": lambda row, i: row.index_select(0, i[None])[0],
    "gather(0, i[None])[0]": lambda row, i: row.gather(0, i[None])[0],
    "take_along_dim(i[None])[0]": lambda row, i: row.take_along_dim(i[None])[0],
    "where(classes == i, 0).sum()": lambda row, i: row.where(classes == i, 0).sum(),
}
log_prob_by = lambda pick, s, i: pick(s.log_softmax(0), i)  # noqa: E731
want = F.one_hot(labels, 5) - logits.softmax(1)
for name, pick in picks.items():
    within(name, vmap(grad(partial(log_prob_by, pick)))(logits, labels), want, 1e-15)
swapped = grad(lambda s: vmap(log_prob)(s, labels).sum())(logits)
within("grad(vmap(...)), s[i]", swapped, want, 1e-15)
tables, rows = torch.randn(6, 4, 5, **f64), torch.tensor([0, 3, 1, 2, 2, 0]).to(device)
two = vmap(grad(lambda t, a, b: t[a[None], b[None]][0]))(tables, rows, labels)
one_entry = F.one_hot(rows * 5 + labels, 20).view(6, 4, 5).to(tables)  # d t[a, b] / dt
within("two indices, t[a[None], b[None]][0]", two, one_entry, 0)
# Not index_select with the 0-d index: it runs, and fills a whole row with s[i] (pytorch#115347).
repeated = vmap(lambda s, i: s.index_select(0, i))(logits, labels)
print(f"  index_select, 0-d index: {tuple(repeated.shape)}; a loop gives (6, 1)")
assert repeated.shape == (6, 5) and torch.equal(repeated, picked[:, None].expand(6, 5))

# %%
# (No error) torch.cdist's backward under jacrev or vmap: one row, repeated
# -------------------------------------------------------------------------
# ``jacrev`` of :func:`torch.cdist` or of a function that calls it (an RBF kernel
# exp(−cdist(XW, Y)²) in W: checked apart), ``vmap`` over its ``autograd.grad`` or ``vjp_fn``, and
# ``vmap(grad(loss), in_dims=(None, None, 0))`` with shared points and batched weights (or targets:
# checked apart) repeat the first cotangent's row, with no error (asserted). ``vmap`` of cdist
# itself is right (checked apart), and so is ``vmap(grad)`` with per-sample points, but not
# ``vmap(jacrev(cdist))``: sample k repeats its row k (asserted). Affected: ``_cdist_backward``,
# taken by any p but 2 (tried: 0.5, 1, 1.5, 3, ∞) and by p = 2 with at most 25 rows in each set or
# ``compute_mode="donot_use_mm_for_euclid_dist"``; p = 2 above 25 rows takes a matrix product (as
# documented), with no repeated row. Why, as read in vmap's rule for that backward
# (``cdist_backward_batch_rule``, ATen's ``functorch/BatchRulesBinaryOps.cpp``): it passes the
# stacked cotangents and, if no points are batched at its level, marks the result unbatched, and
# ``_cdist_backward`` given a stack returns its first slice's result (checked apart). Nothing is
# raised for a fallback to catch; ``torch.compile`` does not fix it (checked apart, on the CPU);
# a search of PyTorch's issues found no report. References: a loop of ``autograd.grad``;
# ∂‖aᵢ − bⱼ‖/∂aᵢ = (aᵢ − bⱼ)/‖aᵢ − bⱼ‖, zero for the other points.


def jacobian_of(a, b):  # of cdist(a, b) in a, by the formula: (len a, len b, len a, 3)
    units = (a[:, None] - b) / (a[:, None] - b).norm(dim=-1, keepdim=True)
    return units[:, :, None] * torch.eye(len(a), **cpu64)[:, None, :, None]


def repeats_row(label, got, want, n=1):  # n samples; each row of sample k is its row k
    got, want = (t.reshape(n, -1, *t.shape[-2:]) for t in (got, want))
    k, gap = torch.arange(n), lambda g, w: ((g - w).abs().max() / w.abs().max()).item()
    off, kept = gap(got, want), gap(got[k, k], want[k, k])
    row = "row 0" if n == 1 else "row k in sample k"
    print(f"  {label}: error {off:.2f}; every row is {row}, whose error is {kept:.0e}")
    assert off > 0.1 and (got == got[:, :1]).all() and kept <= 1e-15, label


# On spheres of radius 1 and 3 every pair is 2 apart or more: use_mm's bounds hold for any draw.
shell = lambda *n, r=1: r * F.normalize(torch.randn(*n, 3, **cpu64), dim=-1)  # noqa: E731
a, b = shell(5), shell(4, r=3)
truth = jacobian_of(a, b)  # (5, 4, 5, 3)
repeats_row("jacrev(torch.cdist)", jacrev(torch.cdist)(a, b), truth)
point = a.clone().requires_grad_()
distances, one_hots = torch.cdist(point, b), torch.eye(20, **cpu64).view(20, 5, 4)
pull = lambda c: torch.autograd.grad(distances, point, c, retain_graph=True)[0]  # noqa: E731
repeats_row("vmap over autograd.grad", vmap(pull)(one_hots), truth)
weights = torch.randn(6, 5, 4, **cpu64)  # per sample
auto, donot = "use_mm_for_euclid_dist_if_necessary", "donot_use_mm_for_euclid_dist"
weighted = lambda a, b, w, mode=auto: (torch.cdist(a, b, compute_mode=mode) * w).sum()  # noqa: E731
exact = torch.einsum("ijkl,nij->nkl", truth, weights)  # Σᵢⱼ wᵢⱼ ∂dᵢⱼ/∂a, per sample
shared = vmap(grad(weighted), in_dims=(None, None, 0))(a, b, weights)  # a, b shared
repeats_row("vmap(grad), weights batched", shared, exact)
clouds = shell(6, 5)  # per-sample points in place of a; b shared
truths = torch.stack([jacobian_of(cloud, b) for cloud in clouds])
by_cloud = vmap(grad(weighted), in_dims=(0, None, 0))(clouds, b, weights)
per_cloud = torch.einsum("sijkl,sij->skl", truths, weights)
within("vmap(grad), points batched", by_cloud, per_cloud, 1e-15)
jacobians = lambda f, **options: vmap(jacrev(f, **options), (0, None))(clouds, b)  # noqa: E731
repeats_row("vmap(jacrev), points batched", jacobians(torch.cdist), truths, n=6)
cases = [(p, 26) for p in (0.5, 1, 1.5, 3, torch.inf)]
cases += [(2, 25), (2, 26, donot), (2, 26)]  # p, rows of the first set, compute_mode
for p, rows, *mode in cases:  # jacrev against a loop of autograd.grad, row by row
    cdist = partial(torch.cdist, p=p, compute_mode=mode[0] if mode else auto)
    pa, pb = torch.randn(rows, 3, **cpu64), torch.randn(2, 3, **cpu64)
    got = jacrev(cdist)(pa, pb)
    loop = torch.autograd.functional.jacobian(cdist, (pa, pb))[0]
    label = f"jacrev(cdist), p={p}, {rows} rows{', ' + mode[0] if mode else ''}"
    if p == 2 and rows > 25 and not mode:  # the matrix-product formula
        within(label, got, loop, 1e-15)
    else:
        repeats_row(label, got, loop)

# %%
# The fixes, for any p and dtype: the distances written out, ``chunk_size=1`` (inside ``vmap`` too),
# or ``is_grads_batched``, whose prototype vmap falls back, having no rule for ``_cdist_backward``
# (checked apart). ``compute_mode="use_mm_for_euclid_dist"`` (p = 2) batches right too, but its
# formula, ‖a‖² + ‖b‖² − 2a·b, loses the digits of pairs close for their size, in float32 already
# for unit-size points moved a little (printed), as does the default mode above 25 rows (checked
# apart): keep it for points well apart. No mode has forward AD: ``jacfwd`` and ``hessian`` name
# ``_cdist_forward``, or ``_euclidean_dist`` for the matrix product; written out, ``hessian`` is
# right (checked apart). For self-distances ``torch.pdist`` is right under ``jacrev``, as vmap loops
# over its backward (asserted); ``cdist(x, x)`` repeats a row (checked apart).
written = lambda a, b: (a[:, None] - b).norm(dim=-1)  # noqa: E731
within("jacrev, distances written out", jacrev(written)(a, b), truth, 1e-15)
one_by_one = jacobians(torch.cdist, chunk_size=1)
within("vmap(jacrev(cdist, chunk_size=1))", one_by_one, truths, 1e-15)
by_rows = torch.autograd.grad(distances, point, one_hots, True, is_grads_batched=True)
within("cdist, is_grads_batched", by_rows[0].view(5, 4, 5, 3), truth, 1e-15)
mm = "use_mm_for_euclid_dist"
by_mm = vmap(grad(partial(weighted, mode=mm)), in_dims=(None, None, 0))(a, b, weights)
within("vmap(grad), use_mm_for_euclid_dist", by_mm, exact, 1e-15)
use_mm = partial(torch.cdist, compute_mode=mm)
within("vmap(jacrev), use_mm_for_euclid_dist", jacobians(use_mm), truths, 1e-15)
step, unit = 1e-3, F.normalize(torch.randn(5, 3), dim=-1)  # float32, on the unit sphere
moved = unit + step * F.normalize(torch.randn(5, 3), dim=-1)  # each moved by step
close = jacobian_of(moved.double(), unit.double())  # the reference: float64 copies
lost = ((jacrev(use_mm)(moved, unit) - close).abs().max() / close.abs().max()).item()
print(f"  use_mm, float32, unit-size points moved by {step:.0e}: error {lost:.2f}")
assert lost > 5e-3, lost  # 3998 of 4000 draws gave more (checked apart)
within("f32, chunk_size=1", jacrev(torch.cdist, chunk_size=1)(moved, unit), close, 1e-6)
no_forward = [(jacfwd(torch.cdist), "_cdist_forward"), (jacfwd(use_mm), "_euclidean_dist"),
              (hessian(lambda a, b: torch.cdist(a, b).sum()), "_cdist_forward")]  # fmt: skip
for transform, op in no_forward:
    fails_with(NotImplementedError, f"AD with {op}", partial(transform, a, b))
with warnings.catch_warnings(record=True, action="always") as said:
    by_pairs = jacrev(torch.pdist)(a)
assert any("aten::_pdist_backward" in str(w.message) for w in said)  # vmap's fallback
i, j = torch.triu_indices(5, 5, 1)  # the pairs pdist takes, i < j
pairs = jacrev(lambda a: (a[i] - a[j]).norm(dim=-1))(a)
within("jacrev(torch.pdist)", by_pairs, pairs, 1e-15)

# %%
# Every fix against its reference
# -------------------------------
# Each check's relative error (dot; an exact match is drawn at 1e-18) and its bound (bar).
measured, bounds = ([max(x, 1e-18) for x in column] for column in zip(*errors.values()))
fig, ax = plt.subplots(figsize=(7.5, 7.5), layout="constrained")
ax.hlines(list(errors), 1e-19, bounds, color="0.75", linewidth=6)
ax.plot(measured, list(errors), "o", color="black")
ax.set(xscale="log", xlim=(1e-19, 1e-5), xlabel="largest error / largest true entry",
       title=f"{len(errors)} checks: error (dot) within bound (bar)")  # fmt: skip
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# * Index with a per-sample index as ``t[i[None]][0]``, or ``gather`` then ``[0]``: ``t[i]`` works
#   under ``vmap`` alone, not inside ``grad``; ``index_select`` wants ``i[None]`` too.
# * For Jacobian rows prefer ``jacrev`` (``chunk_size`` for memory) to ``is_grads_batched``, an
#   experimental prototype that can crash; compare once with a loop of ``autograd.grad``. With
#   ``torch.cdist`` inside, ``jacrev`` and ``vmap(grad)`` can repeat one row silently: write the
#   distances out, or use ``chunk_size=1`` or ``is_grads_batched``, rather than
#   ``use_mm_for_euclid_dist``, which in float32 loses pairs close for their size.
# * A backward that leaves torch (NumPy, ``.item()``, ``.data``) does not batch as it is: find it
#   from the traceback's last frame, then write it in torch or make it a ``custom_op``, which
#   ``vmap`` runs sample by sample, or batches by its ``register_vmap`` rule.
# * Do not return a ``vjp_fn`` from compiled code: apply it inside, or compile ``f`` alone and
#   differentiate with ``torch.autograd``. Under ``vmap`` give ``lstsq`` an m × 1 right-hand
#   side; keep integer arguments of ``jacrev`` out of ``argnums``, or bind them with ``partial``.
