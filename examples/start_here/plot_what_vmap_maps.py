"""
What vmap maps: keyword arguments, several batch dimensions, all pairs, pytrees and ragged results
==================================================================================================

:func:`~torch.func.vmap` maps a function over one dimension of some of its positional
arguments, and stacks what it returns. This page answers six questions users asked about
where that rule bites: keyword arguments, two batch dimensions of one tensor, Jacobian-vector
products for every pair of a point and a tangent, nested dicts and lists, tensors built from
scalars inside a transform, and per-sample results of different lengths. Each recipe is
checked against a Python loop or a closed form, and each error it replaces is raised and its
message checked.
"""

# %%
# Setup
# -----
# ``refused(label, kind, needle, fn, *args)`` calls ``fn(*args)``, which must raise exactly
# ``kind`` with ``needle`` in its message, and prints the message's first sentences. ``same``
# prints a result's largest difference from its reference, over the reference's largest entry
# (at least 1), beside the bound it must stay under.
import dataclasses
import warnings
from collections import namedtuple
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch.func import grad, grad_and_value, jacfwd, jacrev, jvp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


def refused(label, kind, needle, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as err:
        assert type(err) is kind, f"{type(err).__name__}: {err}"
        assert needle in str(err), f"unexpected message: {err}"
        head = str(err).splitlines()[0][:250]
        if head != str(err):  # cut at the last full sentence
            head = head[: head.rfind(". ") + 1] or head
        print(f"{label}\n  raises {kind.__name__}: {head}")
        return
    raise AssertionError(f"{label}: no {kind.__name__} raised")


def same(label, got, want, bound):
    assert got.shape == want.shape, (label, got.shape, want.shape)
    want = want.to(got.device, torch.float64)
    scale = max(1.0, want.abs().max().item())  # float32 rounding grows with the values
    gap = (got.double() - want).abs().max().item() / scale
    print(f"{label}: largest relative difference {gap:.1e} (bound {bound:.0e})")
    assert gap <= bound, (label, gap)


# %%
# The recipe: ``in_dims`` names what is mapped, by position
# ---------------------------------------------------------
# ``in_dims`` holds one entry per *positional* argument: an axis to map, or ``None`` for an
# argument every sample shares. Keyword arguments are never mapped: vmap's docstring says the
# batched function "will not batch the kwargs but will accept kwargs", so they reach every
# sample whole. Here 5 samples each have their own input, weight and bias (functorch#70).
n_samples = 5
xs = torch.randn(n_samples, 3, device=device)
weights = torch.randn(n_samples, 4, 3, device=device)
biases = torch.randn(n_samples, 4, device=device)
w_shared, b_shared = weights[0], biases[0]

own_all = vmap(F.linear, in_dims=(0, 0, 0))(xs, weights, biases)
own_input = vmap(F.linear, in_dims=(0, None, None))(xs, w_shared, b_shared)
loop_all = torch.stack([F.linear(*args) for args in zip(xs, weights, biases)])
loop_input = torch.stack([F.linear(x, w_shared, b_shared) for x in xs])
same("every argument mapped", own_all, loop_all, 1e-6)
same("only the input mapped", own_input, loop_input, 1e-6)

# %%
# Passing the bias by keyword, as in the question, leaves two positional arguments against
# three entries of ``in_dims``, and a dict entry for it does not help: vmap compares
# ``in_dims`` with the positional arguments only. With two entries it runs, and is wrong
# without a word: each sample gets the whole (5, 4) bias added, so the result is (5, 5, 4).
mismatch = "in_dims is not compatible with the structure of `inputs`"
for dims in [(0, 0, 0), (0, 0, {"bias": 0})]:
    label = f"vmap(F.linear, in_dims={dims})(xs, weights, bias=biases)"
    refused(label, ValueError, mismatch, vmap(F.linear, dims), xs, weights, bias=biases)
silent = vmap(F.linear, in_dims=(0, 0))(xs, weights, bias=biases)
print(f"in_dims=(0, 0) with bias=biases runs and returns {tuple(silent.shape)}")
no_bias = torch.stack([F.linear(x, w) for x, w in zip(xs, weights)])
every_bias = no_bias[:, None] + biases  # sample i plus each sample's bias
same("what in_dims=(0, 0) computed", silent, every_bias, 1e-6)


# %%
# The fix is a wrapper that takes the keyword by position, so that ``in_dims`` can name it. A
# keyword that every sample shares may stay a keyword, bound by ``functools.partial`` or a
# closure.
def linear_by_position(x, weight, bias):
    return F.linear(x, weight, bias=bias)


by_position = vmap(linear_by_position, in_dims=(0, 0, 0))(xs, weights, biases)
same("keyword moved to a position", by_position, loop_all, 1e-6)
bound_bias = vmap(partial(F.linear, bias=b_shared), in_dims=(0, None))
same("shared keyword, bound", bound_bias(xs, w_shared), loop_input, 1e-6)


# %%
# Two batch dimensions of one tensor: one vmap per dimension
# ----------------------------------------------------------
# One ``vmap`` removes one dimension of each mapped argument, so two batch dimensions take two
# ``vmap`` calls, nested (functorch#184). The inner call sees the tensor with the outer dimension
# already gone, so its ``in_dims`` counts the axes of what is left. The function is written
# for one vector: a quadratic form ``v·Mv``. The other route is to flatten the batch
# dimensions into one, map once, and reshape the result.
def quadratic(v, matrix):
    return v @ matrix @ v


rows, cols, width = 3, 4, 5
cloud = torch.randn(rows, cols, width, device=device)
form = torch.randn(width, width, device=device)
by_loop = torch.tensor([[quadratic(cloud[r, c], form).item() for c in range(cols)]
                        for r in range(rows)], device=device)  # fmt: skip
over_one = vmap(quadratic, in_dims=(0, None))
nested = vmap(over_one, in_dims=(0, None))(cloud, form)
flat = over_one(cloud.reshape(rows * cols, width), form).reshape(rows, cols)
same("nested vmap, (3, 4) batch", nested, by_loop, 2e-6)
same("flattened, one vmap", flat, by_loop, 2e-6)

# %%
# The batch dimensions need not lead. With the vector along axis 1 of a (3, 5, 4) tensor, the
# outer call maps axis 0 and the inner one axis 1 of the (5, 4) slice it receives.
moved = cloud.permute(0, 2, 1)  # (rows, width, cols)
inner_last = vmap(vmap(quadratic, in_dims=(1, None)), in_dims=(0, None))(moved, form)
same("batch axes 0 and 2", inner_last, by_loop, 2e-6)

# %%
# A pair of axes in ``in_dims``, as in the question, is read as the structure of the
# argument: ``(0, 1)`` says "this argument is a tuple of two tensors". A tensor is not a
# tuple, so vmap reports a structure mismatch; the section on pytrees shows what such entries
# are for.
two_axes = vmap(quadratic, in_dims=((0, 1), None))
refused("in_dims=((0, 1), None)", ValueError, mismatch, two_axes, cloud, form)


# %%
# All pairs: J(x_i)·v_j for n points and m tangents
# -------------------------------------------------
# :func:`~torch.func.jvp` computes ``J(x)·v`` for one point and one tangent. The inner
# ``vmap`` maps the tangents with the point shared (``in_dims=(None, 0)``), the outer one maps
# the points with the tangents shared (``(0, None)``): the result holds every pair, points
# first (functorch#940). The map is a small network with fixed weights, so its Jacobian has a
# closed form, ``W2 · diag(1 - tanh²(W1 x)) · W1``, computed in float64 as one reference; the
# other is a double loop of :func:`torch.autograd.functional.jvp`.
inner_weight = torch.randn(8, 4, device=device)
outer_weight = torch.randn(3, 8, device=device)


def field(x):
    return outer_weight @ torch.tanh(inner_weight @ x)


def push(x, v):
    return jvp(field, (x,), (v,))[1]


n_points, n_tangents = 6, 5
points = torch.randn(n_points, 4, device=device)
tangents = torch.randn(n_tangents, 4, device=device)
all_pairs = vmap(vmap(push, in_dims=(None, 0)), in_dims=(0, None))
grid = all_pairs(points, tangents)  # (n_points, n_tangents, 3)

autograd_jvp = torch.autograd.functional.jvp
double_loop = torch.stack(
    [torch.stack([autograd_jvp(field, x, v)[1] for v in tangents]) for x in points]
)
w1, w2 = inner_weight.double(), outer_weight.double()
slopes = 1 - torch.tanh(points.double() @ w1.T) ** 2  # (n_points, 8)
jacobians = torch.einsum("ok,nk,ki->noi", w2, slopes, w1)  # one (3, 4) per point
closed = torch.einsum("noi,mi->nmo", jacobians, tangents.double())
same("all pairs vs a loop of autograd jvp", grid, double_loop, 2e-6)
same("all pairs vs the float64 closed form", grid, closed, 2e-6)

# %%
# Swapping the nesting swaps the two batch axes of the result, and nothing else. One Jacobian
# per point (by :func:`~torch.func.jacfwd`) times all the tangents gives the same grid.
swapped = vmap(vmap(push, in_dims=(0, None)), in_dims=(None, 0))(points, tangents)
same("other nesting, transposed", swapped.transpose(0, 1), grid, 1e-6)
via_jacobians = torch.einsum("noi,mi->nmo", vmap(jacfwd(field))(points), tangents)
same("Jacobians, then a product", via_jacobians, closed, 2e-6)


# %%
# Pytrees: dicts, lists and tuples in, out, and in ``in_dims``
# ------------------------------------------------------------
# Arguments and results may be nested dicts, lists, tuples and named tuples of tensors
# (pytorch#99310). An ``in_dims`` entry is an int or ``None`` for a whole sub-tree, or a
# container shaped like the argument, down to any depth: a *prefix* of its structure. Numbers
# and ``None`` may sit among the leaves, with ``None`` as their entry.
def summarise(sample, scale):
    x, (u, w) = sample["x"], sample["pair"]
    return {"dot": (x * u).sum() * scale, "moved": [x + w, x - w]}


us, ws = torch.randn_like(xs), torch.randn_like(xs)
per_sample = [summarise({"x": x, "pair": (u, w)}, 2.0) for x, u, w in zip(xs, us, ws)]
mapped = vmap(summarise, in_dims=(0, None))({"x": xs, "pair": (us, ws)}, 2.0)
same("dict in, 'dot'", mapped["dot"], torch.stack([s["dot"] for s in per_sample]), 1e-6)
for k in range(2):
    stacked = torch.stack([s["moved"][k] for s in per_sample])
    same(f"dict in, 'moved'[{k}]", mapped["moved"][k], stacked, 1e-6)

# %%
# A shared tensor deep inside the dict, and each result's batch axis placed apart: ``out_dims``
# may also be a prefix of the result's structure (a dict here, which vmap's docstring does not
# list but torch 2.13 accepts).
w0 = ws[0]
dims = ({"x": 0, "pair": (0, None)}, None)
mapped = vmap(summarise, dims, out_dims={"dot": 0, "moved": 1})
half_shared = mapped({"x": xs, "pair": (us, w0)}, 2.0)
loop = [summarise({"x": x, "pair": (u, w0)}, 2.0) for x, u in zip(xs, us)]
stacked = torch.stack([s["moved"][0] for s in loop], dim=1)
same("nested in_dims, 'moved'[0] at out_dims=1", half_shared["moved"][0], stacked, 1e-6)
dots = torch.stack([s["dot"] for s in loop])
same("nested in_dims, 'dot'", half_shared["dot"], dots, 1e-6)

# %%
# What raises: a non-tensor leaf under a mapped entry; a dataclass, which is not a pytree but
# one opaque leaf (a named tuple is a pytree, and comes back as the same named tuple); and a
# function that returns a non-tensor, unless its ``out_dims`` entry is ``None``.
no_tensor = "We cannot vmap over non-Tensor arguments, please use None"
batch = {"x": xs, "pair": (us, ws)}
refused("a float under in_dims 0", ValueError, no_tensor, vmap(summarise), batch, 2.0)
with_none = {"x": xs, "mask": None}
none_leaf = "the input is of type <class 'NoneType'>"
pick_x = vmap(lambda d: d["x"])
refused("a None leaf under in_dims 0", ValueError, none_leaf, pick_x, with_none)
no_mask = vmap(lambda d: d["x"], in_dims=({"x": 0, "mask": None},))(with_none)
same("a None leaf whose entry is None", no_mask, xs, 0.0)


@dataclasses.dataclass
class Sample:
    x: torch.Tensor


opaque = "Sample'>. We cannot vmap over non-Tensor"
refused("a dataclass argument", ValueError, opaque, vmap(lambda s: s.x), Sample(xs))
Pair = namedtuple("Pair", "x u")
flipped = vmap(lambda p: Pair(p.u, p.x))(Pair(xs, us))
assert type(flipped) is Pair, type(flipped)
same("a named tuple in and out", flipped.u, xs, 0.0)
not_out = "must only return Tensors, got type <class 'float'>"
with_float = vmap(lambda x: (x, 1.0))
refused("a function returning a float", ValueError, not_out, with_float, xs)
kept = vmap(lambda x: (x.sum(), None), out_dims=(0, None))(xs)
assert kept[1] is None, kept[1]
same("a None result with out_dims None", kept[0], xs.sum(1), 1e-6)


# %%
# :func:`~torch.func.grad` and :func:`~torch.func.grad_and_value` return gradients in the
# structure of the arguments that ``argnums`` names: here a nested dict and a list. Every leaf
# of a differentiated argument must be a floating-point tensor; a number belongs in an
# argument that ``argnums`` leaves out, like ``power`` here.
def energy(tree, coefficients, power):
    first, second = tree["inner"]["pair"]
    linear = (tree["w"] * coefficients[0]).sum()
    return linear**power + (first * second * coefficients[1]).sum()


tree = {"w": torch.randn(3, device=device),
        "inner": {"pair": [torch.randn(2, device=device) for _ in range(2)]}}  # fmt: skip
coefficients = [torch.randn(3, device=device), torch.randn(2, device=device)]
gradients, value = grad_and_value(energy, argnums=(0, 1))(tree, coefficients, 2)
leaves = [tree["w"], *tree["inner"]["pair"], *coefficients]
leaves = [leaf.detach().requires_grad_() for leaf in leaves]
tracked = {"w": leaves[0], "inner": {"pair": leaves[1:3]}}
reference = torch.autograd.grad(energy(tracked, leaves[3:], 2), leaves)
tree_grad, coef_grad = gradients
got = [tree_grad["w"], *tree_grad["inner"]["pair"], *coef_grad]
names = ["w", "inner.pair[0]", "inner.pair[1]", "coefficients[0]", "coefficients[1]"]
for name, mine, theirs in zip(names, got, reference):
    same(f"grad_and_value, leaf {name}", mine, theirs, 1e-6)
int_leaf = "Thing passed to transform API must be Tensor, got <class 'int'>"
scaled = grad(lambda d: d["w"].sum() * d["n"])
refused("grad over a dict with an int", ValueError, int_leaf, scaled, {"w": w0, "n": 3})


# %%
# Jacobians follow the same rule, on both sides: a function with several outputs gets one
# Jacobian per output, in the output's structure, and ``argnums=(0, 1)`` nests one per input
# inside each: ``jac[i][j]`` is output *i*'s Jacobian in input *j*, of shape output *i*'s shape
# followed by input *j*'s. The references, by hand: for ``(W x, sin x)``, ``W``, ``δ_ij x_k``,
# ``diag(cos x)`` and zeros.
def two_outputs(x, W):
    return W @ x, x.sin()


x1, W1 = torch.randn(3, device=device), torch.randn(2, 3, device=device)
by_hand = ((W1, torch.einsum("ij,k->ijk", torch.eye(2, device=device), x1)),
           (torch.diag(x1.cos()), torch.zeros(3, 2, 3, device=device)))  # fmt: skip
for jacobian in (jacrev, jacfwd):
    jac = jacobian(two_outputs, argnums=(0, 1))(x1, W1)
    for i, j in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        same(f"{jacobian.__name__}, jac[{i}][{j}]", jac[i][j], by_hand[i][j], 1e-6)


# %%
# Building a tensor inside a transform: ``torch.stack``, not ``torch.tensor``
# ---------------------------------------------------------------------------
# :func:`torch.tensor` and :class:`torch.Tensor` copy *values* out of the scalars in their
# list, which cuts them off from the transform (functorch#1107). Under ``vmap`` that copy is an
# ``.item()`` call, and raises. Under ``jacrev`` torch 2.13 raises nothing, which is worse:
# the matrix is a constant, so its Jacobian comes out as zeros. (The question reports an
# ``INTERNAL ASSERT`` failure from an older functorch.) :func:`torch.stack` keeps the entries
# tensors. The trap is shown on the CPU.
def rotation(angle, build="stack"):
    c, s = torch.cos(angle), torch.sin(angle)
    if build == "stack":
        return torch.stack([torch.stack([c, -s]), torch.stack([s, c])])
    return build([[c, -s], [s, c]])  # torch.tensor or torch.Tensor


def rotation_slope(angle):  # d/dθ of the rotation matrix, by hand, in float64
    c, s = np.cos(angle), np.sin(angle)
    return torch.tensor([[-s, -c], [c, -s]], dtype=torch.float64)


by_copy = partial(rotation, build=torch.tensor)
item_error = "calling .item() on a Tensor"
few = torch.linspace(-1.0, 1.0, 3)  # on the CPU
refused("vmap, built by torch.tensor", RuntimeError, item_error, vmap(by_copy), few)
cpu_angle = torch.tensor(0.7)
for maker in (torch.tensor, torch.Tensor):
    with warnings.catch_warnings(record=True, action="always") as heard:
        flat_zero = jacrev(partial(rotation, build=maker))(cpu_angle)
    said = [str(w.message).splitlines()[0] for w in heard] or ["no warning"]
    print(f"jacrev, built by torch.{maker.__name__}: largest entry {flat_zero.abs().max():.1f}; "
          f"{said[0]}")  # fmt: skip
    assert flat_zero.abs().max().item() == 0.0, "this Jacobian is not all zeros"

angles = torch.linspace(-2.0, 2.0, 7, device=device)
same("jacrev(rotation)", jacrev(rotation)(cpu_angle), rotation_slope(0.7), 2e-7)
batched_slopes = vmap(jacrev(rotation))(angles)
for k, a in enumerate(angles.tolist()):
    label = f"vmap(jacrev(rotation)), θ={a:+.2f}"
    same(label, batched_slopes[k], rotation_slope(a), 2e-7)

# %%
# Ragged results: pad to the longest, with a mask
# -----------------------------------------------
# Every sample's result must have the same shape, because ``vmap`` stacks them; the shape
# cannot depend on a value either, because the function body runs once for the whole batch
# (functorch#279). The question's loop builds ``T[b]`` copies of ``b``. Under ``vmap`` in
# torch 2.13, its body and one with an explicit ``.item()`` raise the same ``RuntimeError``
# (the question quotes a ``TypeError`` from an older version).
lengths = torch.tensor([3, 1, 4, 2], device=device)
labels = torch.arange(len(lengths), device=device)
sizes = lengths.tolist()
ragged = [torch.ones(sizes[b], dtype=torch.long, device=device) * b for b in range(4)]


def copies_by_size(label, length):  # the loop's body
    return torch.ones(length, dtype=torch.long) * label


def copies_by_item(label, length):
    return torch.ones(length.item(), dtype=torch.long) * label


for body in (copies_by_size, copies_by_item):
    label = f"vmap({body.__name__})(labels, lengths)"
    refused(label, RuntimeError, item_error, vmap(body), labels, lengths)

# %%
# The fix: read the longest length once, outside ``vmap``, give every sample that many slots,
# and return a mask ``arange(longest) < T[b]`` beside the values. Indexing with the mask
# outside ``vmap`` gives the concatenated loop result; when that is all you need,
# :func:`torch.repeat_interleave` builds it without ``vmap`` at all.
longest = int(lengths.max())


def padded_row(label, length):
    keep = torch.arange(longest, device=length.device) < length
    return torch.where(keep, label, -1), keep


values, mask = vmap(padded_row)(labels, lengths)
for b, row in enumerate(ragged):
    same(f"padded row {b}, its first T[b] slots", values[b, : len(row)], row, 0)
assert mask.sum().item() == lengths.sum().item(), "mask keeps the wrong number of slots"
assert bool((values[~mask] == -1).all()), "a padding slot holds a value"
same("padded[mask] vs the loop, concatenated", values[mask], torch.cat(ragged), 0)
repeated = torch.repeat_interleave(labels, lengths)
same("repeat_interleave vs the loop", repeated, torch.cat(ragged), 0)

# %%
# The two layouts this page builds: the all-pairs grid (its first output component; rows are
# points, columns tangents) and the padded result with its mask.
fig, (ax_grid, ax_pad) = plt.subplots(1, 2, figsize=(10, 3.8), width_ratios=[5, 4])
shown = grid[..., 0].cpu().numpy()
image = ax_grid.imshow(shown, cmap="cividis")
bright = shown.min() + 0.6 * (shown.max() - shown.min())  # dark text above this
for (i, j), entry in np.ndenumerate(shown):
    ink = "k" if entry > bright else "w"
    ax_grid.text(j, i, f"{entry:.1f}", ha="center", va="center", color=ink)
ax_grid.set(xlabel="tangent j", ylabel="point i", title="all pairs: [J(x_i)·v_j]₀")
fig.colorbar(image, ax=ax_grid, shrink=0.8)
keep, shown = mask.cpu().numpy(), values.cpu().numpy()
ax_pad.imshow(np.ma.masked_where(~keep, shown), cmap="cividis")
for (i, j), entry in np.ndenumerate(shown):
    text, ink = (str(entry), "k" if entry >= 2 else "w") if keep[i, j] else ("pad", "k")
    ax_pad.text(j, i, text, ha="center", va="center", color=ink)
ax_pad.set(xticks=range(longest), yticks=range(len(lengths)))
ax_pad.set(xlabel="slot (longest = max T)", ylabel="sample b",
           title="padded: T[b] copies of b, mask = arange < T[b]")  # fmt: skip
fig.tight_layout()
plt.show()

# %%
# What to remember
# ----------------
# * ``in_dims`` has one entry per positional argument, ``None`` for a shared one; keyword
#   arguments reach every sample unmapped, so move a per-sample keyword to a position.
# * One ``vmap`` maps one dimension: nest two for two batch dimensions (or flatten them), and
#   nest a map over points around a map over tangents to get every pair.
# * Arguments and results may be nested dicts, lists and tuples; ``in_dims`` and ``out_dims``
#   may be prefixes of their structure, with ``None`` for non-tensor leaves. Jacobians of several
#   outputs in several inputs come back nested: ``jac[output][input]``.
# * Build tensors from traced scalars with ``torch.stack``: ``torch.tensor([...])`` raises
#   under ``vmap`` and gives a zero Jacobian under ``jacrev``.
# * Results of different lengths: pad to the longest with an ``arange < length`` mask, or use
#   ``repeat_interleave`` outside ``vmap``.
