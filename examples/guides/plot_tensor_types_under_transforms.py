"""
Tensor subclasses, float64 tangents, sparse tensors and autocast under torch.func
=================================================================================

Why a subclass loses its type and its ``__torch_function__`` rules inside ``vmap``, ``grad`` and
``jacrev``; that ``jacfwd`` of ``x[0] + 1.0`` has float64 tangents ("expected m1 and m2 to have the
same dtype"), and of ``x ** (1 + 1j)`` no imaginary one; why a sparse tensor built in a function
raises "doesn't have storage"; that ``linearize`` under autocast can raise where ``jvp`` works.
Each symptom is asserted in torch 2.13, each fix checked.
"""

import math
import textwrap
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, linearize, vjp, vmap
from torch.utils._pytree import tree_map_only

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")  # linearize


# %%
# The recipe: a ``__torch_function__`` subclass under ``vmap(grad)``: tag inside
# ------------------------------------------------------------------------------
# ``Angle`` holds angles in radians; its ``__torch_function__`` folds ``a - b`` (``sub``, ``-``)
# into [-π, π), so 179° minus -179° is -2°, not 358°. Eager autograd differentiates that rule.
# Under ``vmap(grad)`` nothing raises, but the gradients are those of plain subtraction
# wherever a pair straddles ±π: the handler never sees the subtraction (as pytorch#149788
# reports for ``vmap``). The fix: tag the tensor *inside* the transformed function with
# :meth:`~torch.Tensor.as_subclass`.
def folded(difference):  # into [-π, π)
    return torch.remainder(difference + math.pi, 2 * math.pi) - math.pi


handled, dispatched, shapes = [], [], []  # what the handlers are asked to run


class Angle(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handled.append(getattr(func, "__name__", "?"))
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.sub, torch.Tensor.sub, torch.Tensor.__sub__):  # fold, re-tag
            result = folded(result.as_subclass(torch.Tensor)).as_subclass(cls)
        return result


def misfit(theta, target):
    return (theta - target).pow(2).sum()


def misfit_of_angles(theta, target):  # the transforms pass plain tensors: tag here
    return misfit(theta.as_subclass(Angle), target)


angles = (torch.rand(6, 3, device=device) * 2 - 1) * math.pi
goals = (torch.rand(6, 3, device=device) * 2 - 1) * math.pi
angles[:, 0], goals[:, 0] = math.pi - 0.2 * angles[:, 0].abs(), 0.1 - math.pi
tagged = angles.as_subclass(Angle)
naive = vmap(grad(misfit))(tagged, goals)
per_sample = vmap(grad(misfit_of_angles))(tagged, goals)  # plain: re-tag if needed


# The reference: eager autograd on the whole batch (it runs Angle's rule; samples do not mix),
# checked against a closed form that does not use ``folded``: 2·atan2(sin d, cos d), d = θ − t.
def check(label, got, want, bound):  # largest error / largest reference entry
    got, want = (t.as_subclass(torch.Tensor).double().cpu() for t in (got, want))
    error = ((got - want).abs().max() / want.abs().max()).item()
    margin = "exact" if error == 0 else f"{bound / error:.0f}x inside"
    print(f"  {label}: error {error:.1e}, bound {bound:.1e} ({margin})")
    assert error <= bound, label


leaf = tagged.detach().requires_grad_()
reference = torch.autograd.grad(misfit(leaf, goals), leaf)[0].as_subclass(torch.Tensor)
d = angles.double() - goals.double()
closed = 2 * torch.atan2(d.sin(), d.cos())  # 2 × the wrapped difference
check("eager autograd vs 2·atan2(sin d, cos d)", reference, closed, 1e-6)
check("vmap(grad(misfit_of_angles)) vs eager", per_sample, reference, 1e-6)
check("untagged vmap(grad) vs plain 2(θ − t)", naive, 2 * (angles - goals), 1e-6)
assert type(per_sample) is type(naive) is torch.Tensor  # the transforms return plain
gap = (naive - reference).abs()
print(f"untagged: {int((gap > 1).sum())} entries off, up to {gap.max() / math.pi:.2f}π")
assert torch.equal(gap > 1, (angles - goals).abs() > math.pi)


# %%
# What ``__torch_function__`` sees under each transform
# -----------------------------------------------------
# A probe records its argument's type and whether ``Angle``'s handler ran the subtraction.
# ``vmap``, ``grad``, ``vjp``, ``jacrev`` and ``hessian`` pass plain tensors (their wrappers
# are plain in Python). ``jvp`` and ``jacfwd`` pass the ``Angle``, so the rule runs, when every
# transform around the call is forward mode (``jacfwd(jacfwd)`` too; ``hessian``, which is
# ``jacfwd(jacrev)``, not). Every output is a plain tensor; ``linearize`` raises.
def probe(theta, target):
    seen[name] = type(theta).__name__
    return misfit(theta, target)


one, goal, seen, FORWARD = tagged[0], goals[0], {}, ("jvp", "jacfwd", "jacfwd(jacfwd)")
runs = {
    "vmap": lambda: vmap(probe)(tagged, goals),
    "grad": lambda: grad(probe)(one, goal),
    "vjp": lambda: vjp(probe, one, goal)[0],
    "jacrev": lambda: jacrev(probe)(one, goal),
    "hessian": lambda: hessian(probe)(one, goal),
    "jvp": lambda: jvp(probe, (one, goal), (goal, 0 * goal))[1],
    "jacfwd": lambda: jacfwd(probe)(one, goal),
    "jacfwd(jacfwd)": lambda: jacfwd(jacfwd(probe))(one, goal),
}
for name, run in runs.items():
    handled.clear()
    kind = type(run()).__name__
    ran = "sub" in handled or "__sub__" in handled
    print(f"{name:>14}: sees {seen[name]:6}, returns {kind}, rule ran: {ran}")
    assert kind == "Tensor" and ran == (seen[name] == "Angle") == (name in FORWARD)
# So one function has two Jacobians: jacfwd folds, jacrev does not.
forward, reverse = jacfwd(misfit)(one, goal), jacrev(misfit)(one, goal)
check("jacfwd vs eager autograd", forward, reference[0], 1e-6)
check("jacrev vs the untagged vmap(grad)", reverse, naive[0], 1e-6)
assert (forward - reverse).abs().max() > 1


def must_raise(call, kind, fragment, label=""):  # exactly `kind`, with `fragment`
    try:
        call()
    except kind as error:
        assert type(error) is kind and fragment in str(error), f"{type(error)}: {error}"
        print(f"  {label}{kind.__name__}: {textwrap.shorten(str(error), 150)}")
        return
    raise AssertionError(f"no {kind.__name__} raised")


must_raise(lambda: linearize(misfit, one, goal), TypeError, "dispatch", "linearize: ")


# %%
# A ``__torch_dispatch__`` subclass passes through, and keeps its type
# --------------------------------------------------------------------
# A wrapper subclass with the rule in ``__torch_dispatch__`` sits below the transforms. Its
# handler receives the ATen operators they produce: under ``vmap(grad)``, one subtraction and
# one ``sum`` for the whole batch, then the backward's operators (its ``pow`` takes the saved,
# folded difference). The outputs come back as the subclass. The catch: build it *outside*
# the transforms; wrapping a transformed tensor fails (compare pytorch#91437).
class DispatchAngle(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        meta = {"dtype": inner.dtype, "device": inner.device}
        self = torch.Tensor._make_wrapper_subclass(cls, inner.shape, **meta)
        self.inner = inner
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(cls, lambda t: t.inner, (args, kwargs or {}))
        result = func(*args, **kwargs)
        dispatched.append(func.__name__)
        if func is torch.ops.aten.sub.Tensor:
            shapes.append(tuple(result.shape))
            result = folded(result)
        return tree_map_only(torch.Tensor, cls, result)


kept = vmap(grad(misfit))(DispatchAngle(angles), goals)
print(f"returns {type(kept).__name__}; sub of shape {shapes[0]}; the handler saw:")
print(textwrap.fill(", ".join(dispatched), 88))
assert type(kept) is DispatchAngle and shapes == [tuple(angles.shape)]
check("DispatchAngle, vmap(grad), vs eager", kept.inner, reference, 1e-6)
jacobian = jacfwd(misfit)(DispatchAngle(angles[0]), goal)
assert type(jacobian) is DispatchAngle
check("DispatchAngle, jacfwd, vs eager", jacobian.inner, reference[0], 1e-6)
wrap_inside = grad(lambda t: misfit(DispatchAngle(t), goal))
must_raise(lambda: wrap_inside(angles[0]), RuntimeError, "doesn't have storage")

# %%
# ``0.5 * x[0]`` or ``x[0] + 1.0``: float64 tangents in ``jvp`` and ``jacfwd``
# ----------------------------------------------------------------------------
# (pytorch#160513, pytorch#90065, functorch#1073.) A function halves one coordinate of its
# input, then multiplies by a float32 matrix. ``jacrev`` works; ``jvp``, ``jacfwd`` and
# ``hessian`` fail in the matrix product, because the tangent of ``0.5 * x[0]`` is float64, as
# is that of ``x[0] + 1.0``, the older issues' case (in the table below).
mixing = torch.randn(3, 4, device=device)
halve_first = lambda x: torch.stack([0.5 * x[0], x[1], x[2]]) @ mixing  # noqa: E731
point, same = torch.randn(3, device=device), "to have the same dtype"
assert jacrev(halve_first)(point).dtype == torch.float32
must_raise(lambda: jacfwd(halve_first)(point), RuntimeError, same, "jacfwd: ")
must_raise(lambda: jvp(halve_first, (point,), (point,)), RuntimeError, same, "jvp: ")
summed_halves = hessian(lambda x: halve_first(x).sum())
must_raise(lambda: summed_halves(point), RuntimeError, same, "hessian: ")

# %%
# The rule, measured below in ``jvp`` and ``jacfwd`` (float16 and bfloat16 on ``0.5 * x[0]``
# only): a Python float with a 0-d tensor in ``*``, ``/``, ``+`` (either side) or after it in
# ``-`` gives a float64 tangent, as do ``x.sum() * 0.5`` and ``np.float32(0.5) * x[0]``; the
# value keeps the input's dtype. ``1.0 - x[0]``, an exponent (``x[0] ** 2.0``), a bound
# (``clamp``), a Python int or a tensor with a dimension (``0.5 * x``) keep the input's dtype,
# as do ``jacrev`` and ``linearize`` (it traces plain forward AD, see below) in every row.
# Columns: the value, then the dtype from ``jvp``, ``jacfwd``, ``jacrev`` and ``linearize``.
f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
short = {f32: "f32", f16: "f16", bf16: "bf16", f64: "f64"}
cases = {  # x's dtype, then expressions (split at ";"): the dtypes each gives
    "f32 0.5 * x[0]; x[0] + 1.0; 1.0 + x[0]; x[0] - 1.0": "f32 f64 f64 f32 f32",
    "f32 x[0] / 2.0; 1.0 / x[0]; x.sum() * 0.5": "f32 f64 f64 f32 f32",
    "f32 np.float32(0.5) * x[0]": "f32 f64 f64 f32 f32",
    "f32 1.0 - x[0]; x[0] ** 2.0; x[0].clamp(min=0.5)": "f32 f32 f32 f32 f32",
    "f32 2 * x[0]; 0.5 * x": "f32 f32 f32 f32 f32",
    "f16 0.5 * x[0]": "f16 f64 f64 f16 f16",
    "bf16 0.5 * x[0]": "bf16 f64 f64 bf16 bf16",
}
dtypes = {name: dtype for dtype, name in short.items()}
for case, want in cases.items():
    name, expressions = case.split(" ", 1)
    for expression in expressions.split("; "):
        fn = eval(f"lambda x: {expression}", {"np": np})
        x = torch.randn(3, device=device, dtype=dtypes[name])
        ones = torch.ones_like(x)
        kinds = [fn(x), jvp(fn, (x,), (ones,))[1], jacfwd(fn)(x), jacrev(fn)(x)]
        got = " ".join(short[k.dtype] for k in [*kinds, linearize(fn, x)[1](ones)])
        print(f"{name + ' ' + expression:26}: {got}")
        assert got == want, expression
# Fixes: make the scalar a tensor of the input's dtype (``x[0] + x.new_tensor(1.0)``); where
# the 0-d tensor is an element ``x[0]``, a one-element slice ``x[:1]`` also works; or use
# ``linearize``. The reference: entry (j, i) of the Jacobian is sᵢ · mixing[i, j], s = (0.5, 1, 1).
fixes = {
    "x.new_tensor(0.5)": lambda x: torch.stack([x.new_tensor(0.5) * x[0], *x[1:]]),
    "0.5 * x[:1]": lambda x: torch.cat([0.5 * x[:1], x[1:]]),
}
closed_form = (mixing.double() * mixing.new_tensor([[0.5], [1], [1]]).double()).T
for label, fixed in fixes.items():
    jacobian = jacfwd(lambda x: fixed(x) @ mixing)(point)  # noqa: B023
    assert jacobian.dtype == torch.float32
    check(f"jacfwd, {label}, vs closed form", jacobian, closed_form, 1e-6)
assert jvp(lambda x: x.sum() * x.new_tensor(0.5), (point,), (point,))[1].dtype == f32
halve_linear = linearize(halve_first, point)[1]  # the third fix
check("linearize(halve_first)", halve_linear(point), closed_form @ point.double(), 1e-6)

# %%
# ``x ** (1 + 1j)``, ``(1 + 1j) ** x``: ``jvp`` and ``jacfwd`` drop the imaginary tangent
# ---------------------------------------------------------------------------------------
# (pytorch#185639: ``abs(z) ** c``.) One side real, one complex: forward mode's tangent has no
# imaginary part, silently; ``jacrev`` (real pairs out) is right. References: d/dx x^(1+i) =
# (1+i)·x^i, d/dx (1+i)^x = log(1+i)·(1+i)^x. The fix: make the real side complex (``x + 0j``).
base, pairs = torch.rand(4, device=device, dtype=f64) + 0.5, torch.view_as_real
ones, log_1_plus_i = torch.ones_like(base), complex(math.log(2) / 2, math.pi / 4)
powers = {"x ** (1 + 1j)": (lambda x: x ** (1 + 1j), (1 + 1j) * base**1j),
          "(1 + 1j) ** x": (lambda x: (1 + 1j) ** x, log_1_plus_i * (1 + 1j) ** base)}  # fmt: skip
for label, (power, slope) in powers.items():
    on_pairs = lambda x: pairs(power(x))  # noqa: B023, E731
    tangent = jvp(power, (base,), (ones,))[1]
    by_jacfwd, by_jacrev = (
        j(on_pairs)(base).diagonal(0, 0, 2).T for j in (jacfwd, jacrev)
    )
    lost = max(tangent.imag.abs().max(), by_jacfwd[:, 1].abs().max())
    print(f"  {label}: the imaginary tangent by jvp and jacfwd, at most {lost:.1e}")
    assert lost == 0 < slope.imag.abs().min(), "pytorch#185639 fixed?"
    check(f"{label}, jacrev", by_jacrev, pairs(slope), 1e-14)
    fixed = jvp(lambda x: power(x + 0j), (base,), (ones,))[1]  # noqa: B023
    check(f"{label}, real side made complex", pairs(fixed), pairs(slope), 1e-14)

# %%
# A sparse tensor built inside the differentiated function
# --------------------------------------------------------
# (functorch#655.) Edge weights ``w`` of a graph mix a signal, ``tanh(A(w) @ x)``; edge ``(2, 5)``
# is listed twice, and a sparse tensor sums duplicates. In 2.13 ``grad`` and ``vjp`` accept
# :func:`torch.sparse_coo_tensor` built from ``w`` if given its size. Without it, or with
# ``check_invariants=True``, the constructor reads values computed from the *indices* (not ``w``)
# out of a transformed tensor, which has no memory (``.numpy()`` fails the same way in
# :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`). ``jacrev``, ``vmap``, ``jvp`` fail. A
# matrix built *outside*, closed over: ``grad`` takes it, ``jvp`` raises.
nodes = 6
heads = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 2], device=device)
tails = torch.tensor([1, 2, 3, 4, 5, 0, 3, 5, 5], device=device)
signal = torch.randn(nodes, device=device)
weights = torch.rand(len(heads), device=device)
weights[-2:] = torch.tensor([0.25, 0.5])  # the duplicate edge's two weights
edges = torch.stack([heads, tails])


def mix_sparse(w, **how):
    return torch.tanh(torch.sparse_coo_tensor(edges, w, **how) @ signal)


sized = {"size": (nodes, nodes), "check_invariants": False}
for how in ({"check_invariants": False}, {**sized, "check_invariants": True}):
    summed = grad(lambda w, how=how: mix_sparse(w, **how).sum())
    must_raise(lambda: summed(weights), RuntimeError, "storage", f"grad {how}: ")  # noqa: B023
sized_sparse = lambda w: mix_sparse(w, **sized)  # noqa: E731
no_view = "'aten::view' with arguments from the 'Sparse"
with warnings.catch_warnings(action="ignore", category=UserWarning):  # performance drop
    mapped, by_rows = vmap(sized_sparse), jacrev(sized_sparse)
    must_raise(lambda: mapped(weights[None]), NotImplementedError, no_view, "vmap: ")
    must_raise(lambda: by_rows(weights), NotImplementedError, no_view, "jacrev: ")
no_fw, pair = "forward AD with _sparse_coo_tensor", (weights,)
must_raise(lambda: jvp(sized_sparse, pair, pair), NotImplementedError, no_fw, "jvp: ")
outside = torch.sparse_coo_tensor(edges, weights, **sized)  # closed over
dense, sig = outside.to_dense().double().cpu(), (signal,)
slope = 1 - torch.tanh(dense @ signal.double().cpu()) ** 2
by_outside = grad(lambda x: torch.tanh(outside @ x).sum())(signal)
check("grad, A built outside, vs Aᵀ(1 - tanh²(Ax))", by_outside, dense.T @ slope, 1e-6)
zeros, on_outside = "'aten::_efficientzerotensor' with", lambda x: outside @ x
must_raise(lambda: jvp(on_outside, sig, sig), NotImplementedError, zeros, "jvp: ")


# %%
# The fix needs no matrix: each edge adds ``w_e · x[tail]`` into its head's entry, which is
# :meth:`~torch.Tensor.index_add` (duplicates add up, as in the sparse tensor). Dense and out
# of place, it works under every transform. References: the mixing in float64, edge by edge in
# Python, and its Jacobian by central finite differences.
def mix_dense(w):
    return torch.tanh(signal.new_zeros(nodes).index_add(0, heads, w * signal[tails]))


def mix_loop(w):  # float64, edge by edge
    total = [0.0] * nodes
    for head, tail, weight in zip(heads.tolist(), tails.tolist(), w.double().tolist()):
        total[head] += weight * signal[tail].item()
    return torch.tensor(total, dtype=f64).tanh()


def finite_jacobian(w, step=1e-6):  # central differences of the float64 loop
    shifts = step * torch.eye(len(w), dtype=f64)
    w = w.double().cpu()
    columns = [(mix_loop(w + e) - mix_loop(w - e)) / (2 * step) for e in shifts]
    return torch.stack(columns, dim=1)


finite = finite_jacobian(weights)
check("mix_dense vs the float64 loop", mix_dense(weights), mix_loop(weights), 3e-7)
for transform in (jacrev, jacfwd):
    jacobian = transform(mix_dense)(weights)
    check(f"{transform.__name__}(mix_dense) vs differences", jacobian, finite, 3e-7)
from_sparse = grad(lambda w: sized_sparse(w).sum())(weights)  # the spelling that works
check("grad, sized sparse tensor, vs the same", from_sparse, finite.sum(0), 3e-7)
cotangent = torch.randn(nodes, dtype=f64)
pulled = vjp(sized_sparse, weights)[1](cotangent.to(device, torch.float32))[0]
check("vjp, sized sparse tensor, vs the same", pulled, cotangent @ finite, 1e-6)
several = torch.rand(4, len(heads), device=device)  # four graphs' weights, mapped
per_graph = vmap(jacrev(mix_dense))(several)
want_graphs = torch.stack([finite_jacobian(w) for w in several])
check("vmap(jacrev(mix_dense)), 4 graphs", per_graph, want_graphs, 3e-7)
# To build the matrix itself, index_put needs accumulate=True: without it the duplicate
# edge keeps one of its weights, not their sum, and nothing raises.
put = weights.new_zeros(nodes, nodes).index_put  # `dense`: the sparse tensor, densified
summed = put((heads, tails), weights, accumulate=True)
check("index_put(accumulate=True) vs the sparse tensor", summed, dense, 1e-7)
last = put((heads, tails), weights)[2, 5].item()
print(f"  without accumulate, entry (2, 5) is {last:.3f}, not {dense[2, 5]:.3f}")
assert last in (0.25, 0.5) and dense[2, 5] == 0.75


# %%
# ``linearize`` under autocast raises where ``jvp`` works
# -------------------------------------------------------
# (pytorch#172383 reports NaN, from a float16 reproduction on the CPU; here, in 2.13, it is an
# error.) Differentiate ``tanh(F.linear(layer_norm(h; g), W))`` under :class:`torch.autocast`
# (bfloat16, CPU) with respect to the LayerNorm weight ``g``, or to ``h`` (the same error): ``h`` is
# bfloat16, as an earlier autocast layer gives; LayerNorm's parameters are float32. ``jvp`` works;
# ``linearize`` raises while it traces. It runs plain forward AD (``torch.autograd.forward_ad``),
# not ``jvp``, and plain forward AD raises the same: LayerNorm's value is bfloat16, its tangent
# float32 (printed), and the matrix product meets that tangent and a bfloat16 weight (how ``jvp``
# gets past it, we did not trace). With a float32 input ``linearize`` works, and keeps the casts:
# called with autocast off, bfloat16.
amp, mixed = torch.bfloat16, "same dtype, but got: float != c10::BFloat16"
w_lin = torch.randn(4, 8) / 8**0.5  # this section runs on the CPU
gain, shift = 1 + 0.1 * torch.randn(8), 0.1 * torch.randn(8)
h16, tangents = torch.randn(32, 8).to(amp), torch.randn(16, 8)


def layer(g, h=h16):
    return torch.tanh(F.linear(F.layer_norm(h, (8,), g, shift), w_lin))


layer32 = lambda g: layer(g, h16.float())  # noqa: E731  (a fix: LayerNorm gets float32)
with torch.autocast("cpu", dtype=amp):
    assert jvp(layer, (gain,), (tangents[0],))[1].dtype == amp
    for wrt, f, at in ("g", layer, gain), ("h", lambda h: layer(gain, h), h16):
        must_raise(lambda: linearize(f, at), RuntimeError, mixed, f"in {wrt}: ")  # noqa: B023
    with fwAD.dual_level():
        normed = F.layer_norm(h16, (8,), fwAD.make_dual(gain, tangents[0]), shift)
        kinds = [t.dtype for t in fwAD.unpack_dual(normed)]
        print("plain forward AD: LayerNorm's value {}, its tangent {}".format(*kinds))
        assert kinds == [amp, f32]
        plain = lambda: layer(fwAD.make_dual(gain, tangents[0]))  # noqa: E731
        must_raise(plain, RuntimeError, mixed, "plain forward AD: ")
    _, linear_amp = linearize(layer32, gain)


# %%
# Three fixes, checked against float64 in closed form: LayerNorm is linear in ``g``, so along
# ``v`` the layer's tangent is ``(1 − tanh²(y)) · ((n·v) Wᵀ)``, ``n`` the normalized input and
# ``y = (n·g + b) Wᵀ``. Map ``jvp`` over the tangents (``vmap(jvp)``); or give LayerNorm a
# float32 input, ``h.float()``, and keep ``linearize`` under autocast (the matrix product stays
# bfloat16); or linearize with autocast off and float32 input. Off alone fails here, as ``h``
# comes in bfloat16 from outside: ``F.linear`` then mixes the two dtypes in eager code.
def exact_tangents(h, vs):  # float64, no autograd
    h, g, b, w = (t.double() for t in (h, gain, shift, w_lin))
    centred = h - h.mean(-1, keepdim=True)
    n = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    slope = 1 - torch.tanh((n * g + b) @ w.T) ** 2
    return torch.stack([slope * ((n * v) @ w.T) for v in vs.double()])


with torch.autocast("cpu", dtype=amp):
    mapped_jvp = vmap(lambda v: jvp(layer, (gain,), (v,))[1])(tangents)
    with torch.autocast("cpu", enabled=False):
        must_raise(lambda: layer(gain), RuntimeError, same, "autocast off: ")
        _, linear_off = linearize(layer32, gain)
        routes = {
            "vmap(jvp), bfloat16 input": (mapped_jvp, 1.2e-2),
            "linearize, float32 input, autocast": (vmap(linear_amp)(tangents), 1.2e-2),
            "linearize, float32, autocast off": (vmap(linear_off)(tangents), 1e-6),
        }
want = exact_tangents(h16, tangents)
# Each route's error, tangent by tangent (16 random tangents):
METHOD_COLORS = {"vmap": "#009E73", "linearize": "#CC3311"}
fig, ax = plt.subplots(figsize=(8, 2.6), layout="constrained")
for row, (route, (got, bound)) in enumerate(routes.items()):
    check(f"{route} ({short[got.dtype]}) vs float64", got, want, bound)
    assert got.dtype == (f32 if "off" in route else amp)
    miss = (got.double() - want).abs().amax((1, 2)) / want.abs().amax((1, 2))
    method, marker = ("vmap", "o") if "vmap" in route else ("linearize", "s^"[row - 1])
    ax.plot(miss, [row] * len(miss), marker, color=METHOD_COLORS[method], alpha=0.6)
ax.set(yticks=range(4), yticklabels=[*routes, "linearize, bfloat16 input: raises"])
ax.set(xlabel="relative error vs float64", xscale="log", ylim=(-0.5, 3.5))
ax.set_title("Tangents of the layer under bfloat16 autocast, CPU")
plt.show()

# %%
# What to remember
# ----------------
# * Transforms skip a subclass's ``__torch_function__`` rules unless every transform around
#   the call is ``jvp`` or ``jacfwd``: tag inside with ``as_subclass``. A ``__torch_dispatch__``
#   wrapper built outside keeps its type and its rules under ``vmap(grad)`` and ``jacfwd``.
# * In ``jvp`` and ``jacfwd``, a Python float in ``x[0] + 1.0``, ``0.5 * x[0]`` or ``loss * 0.5``
#   gives a float64 tangent (not in ``x[0] ** 2.0``): use ``x.new_tensor(0.5)``, or ``jacrev``.
#   A power with one side real, one complex, loses its imaginary tangent: use ``x + 0j``.
# * A sparse tensor built inside needs ``size=``, then works under ``grad`` and ``vjp``, not
#   ``vmap``, ``jacrev``, ``jvp``; one closed over fails under ``jvp``. ``index_add`` works.
# * ``linearize`` runs plain forward AD, not ``jvp``: under autocast it can raise where ``jvp``
#   works. Use ``vmap(jvp)``, give LayerNorm a float32 input, or autocast off and float32.
