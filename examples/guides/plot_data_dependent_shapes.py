"""
Data-dependent shapes under vmap: nonzero, unique, masks and sparse tensors
===========================================================================

``x[x > 0]``, ``torch.nonzero`` or ``torch.unique`` return as many entries as the values ask for:
each sample would get a result of its own size, which ``vmap`` cannot stack. This page triggers
each such error of torch 2.13, then rewrites each operator with a fixed shape (a mask beside the
values, indices padded by :func:`torch.nonzero_static` or a stable sort, counts over a known
range, top-k, index windows), checked against a loop that calls the original operator; last,
sparse matrices. Ragged results: :ref:`sphx_glr_auto_examples_start_here_plot_what_vmap_maps.py`;
other messages: :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py`.
"""

# %%
# Setup
# -----
# ``refused`` runs a call that must raise ``error_type``, its message starting ``first_words``.
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import grad, grad_and_value, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73", "vmap fallback": "#DDCC77"}


def refused(label, call, error_type, first_words):
    try:
        with warnings.catch_warnings(action="ignore"):  # "performance drop": see below
            call()
    except error_type as raised:
        message = str(raised)
        assert type(raised) is error_type and message.startswith(first_words), message
        print(f"{label}\n    {error_type.__name__}: {message.splitlines()[0]}")
        return
    raise AssertionError(f"{label} raised no {error_type.__name__}")


scores = torch.randn(6, 8, device=device)
scores[2] = -scores[2].abs()  # a sample with no positive entry
labels = torch.randint(0, 5, (6, 8), device=device)

# %%
# The errors, and their first lines
# ---------------------------------
# Each operator below sizes its output from the values. ``vmap`` runs the function body once
# for the whole batch, so it would need one size for all samples, and it raises. The messages
# are not all alike: a search for the words of yours should find its line below.
dynamic = "vmap: We do not support batching operators that can output dynamic shape. "
over = lambda op: f"{dynamic}Attempted to vmap over aten::{op}."  # noqa: E731
bools = ("vmap: We do not support batching operators that can support dynamic shape. "
         "Attempting to batch over indexing with a boolean mask.")  # fmt: skip
refused("vmap: x[x > 0]", lambda: vmap(lambda x: x[x > 0])(scores), RuntimeError, bools)


def zero_the_negatives(x):
    x = x.clone()
    x[x < 0] = 0  # the fix: x.masked_fill(x < 0, 0), or torch.where(x < 0, 0, x)
    return x


for label, op, batch, first_words in [
    ("x[x < 0] = 0", zero_the_negatives, scores, bools),
    ("torch.masked_select(x, x > 0)", lambda x: torch.masked_select(x, x > 0), scores,
     "vmap: Attempted to vmap over `mask` in torch.masked_select"),
    ("torch.nonzero(x > 0)", lambda x: torch.nonzero(x > 0), scores, over("nonzero")),
    ("torch.nonzero(x > 0, as_tuple=True)", lambda x: (x > 0).nonzero(as_tuple=True),
     scores, "Batching rule not implemented for aten::nonzero_numpy."),
    ("torch.where(x > 0)", lambda x: torch.where(x > 0), scores, over("where")),
    ("torch.unique(t)", torch.unique, labels, over("_unique2")),
    ("torch.unique_consecutive(t)", torch.unique_consecutive, labels, over("unique_consecutive")),
    ("F.one_hot(t)", F.one_hot, labels,
     "When vmap-ing torch.nn.functional.one_hot, please provide an explicit positive"),
]:  # fmt: skip
    refused(f"vmap: {label}", lambda: vmap(op)(batch), RuntimeError, first_words)  # noqa: B023


# %%
# Three that fail only on some batches
# ------------------------------------
# :func:`torch.argwhere`, :func:`torch.bincount`, :func:`torch.repeat_interleave` (tensor
# repeats) have no batching rule: ``vmap`` runs them per sample, warns of a "performance drop"
# and stacks the results. That works only while all sizes agree: tests on friendly data pass.
def fallback(call):
    with warnings.catch_warnings(record=True, action="always") as heard:
        result = call()
    assert all("performance drop" in str(w.message) for w in heard), heard
    looped = [str(w.message).split("rule for ")[1].split(".")[0] for w in heard]
    return result, looped


stack_error = "stack expects each tensor to be equal size"
cases = [  # operator, a batch whose samples agree in size, one where they do not
    (lambda x: torch.argwhere(x > 0), [[1.0, -1, 2], [-1, 3, 4]], [[1.0, 1, 2], [-1, 3, 4]]),
    (torch.bincount, [[0, 2, 2], [2, 1, 0]], [[0, 1, 1], [2, 1, 0]]),
    (lambda r: torch.repeat_interleave(r, r), [[1, 2], [2, 1]], [[1, 2], [2, 2]]),
]  # fmt: skip
for op, agree, differ in cases:
    agree, differ = (torch.tensor(b, device=device) for b in (agree, differ))
    got, looped = fallback(lambda: vmap(op)(agree))  # noqa: B023
    assert torch.equal(got, torch.stack([op(t) for t in agree])), looped
    said = f"sizes agree: runs, looping over {looped}; sizes differ:"
    refused(said, lambda: vmap(op)(differ), RuntimeError, stack_error)  # noqa: B023

# %%
# What runs
# ---------
# The shape is fixed by a mask shared by all samples (captured, not mapped), or by an argument:
# ``size=`` of :func:`torch.nonzero_static`, ``minlength=`` (values below it), ``num_classes=``,
# ``k`` of :func:`torch.topk`. Each is checked against a loop of itself; two loop inside.
shared = torch.tensor([True, False] * 4, device=device)
for label, op, batch in [
    ("x[shared_mask]", lambda x: x[shared], scores),
    ("nonzero_static(x > 0, size=8)", lambda x: torch.nonzero_static(x > 0, size=8), scores),
    ("torch.bincount(t, minlength=5)", lambda t: torch.bincount(t, minlength=5), labels),
    ("F.one_hot(t, num_classes=5)", lambda t: F.one_hot(t, num_classes=5), labels),
    ("torch.topk(x, 3).values", lambda x: torch.topk(x, 3).values, scores),
    ("torch.count_nonzero(x > 0)", lambda x: torch.count_nonzero(x > 0), scores),
]:  # fmt: skip
    got, looped = fallback(lambda: vmap(op)(batch))  # noqa: B023
    assert torch.equal(got, torch.stack([op(t) for t in batch])), label
    print(f"{label}: runs" + (f", looping over {looped}" if looped else ""))


# %%
# Keep the shape, carry the mask
# ------------------------------
# Most code selects entries only to reduce them. Then select nothing: fill the entries left out
# with the reduction's neutral value (0 for a sum, ``-inf`` for a max) and divide a mean by the
# mask's count, guarded for samples where nothing is selected. The reference loop indexes;
# ``check`` prints the largest difference from it, and its bound.
def check(label, got, want, bound):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape and torch.equal(got.isinf(), want.isinf()), label
    finite = want.isfinite()
    error = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    margin = f"margin {bound / error:.0f}x" if error else "exact"
    print(f"{label}: max error {error:.1e} (bound {bound:.0e}, {margin})")
    assert error <= bound, f"{label}: error {error:.2e}"


def positive_summary(x):
    keep = x > 0
    count = keep.sum()
    total = torch.where(keep, x, 0).sum()
    mean = torch.where(count > 0, total / count.clamp(min=1), 0)
    return count, total, mean, x.masked_fill(~keep, float("-inf")).amax()


summary = vmap(positive_summary)(scores)
kept = [x[x > 0] for x in scores]
inf = torch.tensor(float("-inf"), device=device)
for name, got, want, bound in zip(
    ("count", "sum", "mean", "max"),
    summary,
    ([len(s) for s in kept], [s.sum() for s in kept],
     [s.mean() if len(s) else 0 for s in kept], [s.max() if len(s) else inf for s in kept]),
    (0, 1e-6, 1e-6, 0),
):  # fmt: skip
    check(f"{name} of x[x > 0]", got, torch.tensor(want, device=device), bound)

# %%
# Gradients through a mask, and the NaN trap
# ------------------------------------------
# A per-sample loss over observed targets only, missing ones stored as NaN: the mean squared
# error of a linear model. Per-sample gradients and losses from
# :func:`~torch.func.grad_and_value` under ``vmap`` are checked against a float64 loop that
# indexes and calls :func:`torch.autograd.grad`.
inputs = torch.randn(6, 10, 3, device=device)
targets = inputs @ torch.tensor([1.0, -2.0, 0.5], device=device)
targets[torch.rand(6, 10, device=device) < 0.3] = float("nan")
targets[4] = float("nan")  # a sample with no observed target: its gradient is 0
targets[0] = inputs[0] @ torch.tensor([1.0, -2.0, 0.5], device=device)  # all observed
weights = torch.randn(3, device=device)


def observed_mse(w, x, y):
    seen = ~y.isnan()
    residual = x @ w - torch.where(seen, y, 0)  # fill first: see below
    return torch.where(seen, residual**2, 0).sum() / seen.sum().clamp(min=1)


mapped = lambda f: vmap(f, in_dims=(None, 0, 0))  # noqa: E731  (weights shared)
data = (weights, inputs, targets)
per_sample, losses = mapped(grad_and_value(observed_mse))(*data)
w64 = weights.double().requires_grad_()
for b, (x, y) in enumerate(zip(inputs.double(), targets.double())):
    seen = ~y.isnan()
    loss = ((x[seen] @ w64 - y[seen]) ** 2).mean() if seen.any() else 0 * w64.sum()
    (want,) = torch.autograd.grad(loss, w64)
    check(f"sample {b}: loss", losses[b], loss, 5e-6)
    check(f"sample {b}: per-sample gradient", per_sample[b], want, 5e-6)


# %%
# The trap: ``torch.where(seen, (x @ w - y) ** 2, 0)`` with ``y`` not filled gives the same
# loss, but NaN gradients. The backward pass of ``where`` sends zero to the branch not taken,
# and the square's backward multiplies that zero by a NaN residual: NaN.
def unfilled_mse(w, x, y):
    seen = ~y.isnan()
    return torch.where(seen, (x @ w - y) ** 2, 0).sum() / seen.sum().clamp(min=1)


assert torch.equal(mapped(unfilled_mse)(*data), mapped(observed_mse)(*data))
nan_grads = mapped(grad(unfilled_mse))(*data)
assert torch.equal(nan_grads.isnan().any(1), targets.isnan().any(1))
assert not targets[0].isnan().any() and targets[1:].isnan().any(1).all()
print("unfilled: NaN gradients exactly for the samples with a missing target")

# %%
# nonzero with a fixed length: nonzero_static, or a stable sort
# -------------------------------------------------------------
# :func:`torch.nonzero_static` takes the output length and a fill value, and runs under ``vmap``
# (through the per-sample loop above). Choose ``size`` at least the largest count, which you can
# check outside ``vmap``: a smaller size drops indices without a word.
most = int((scores > 0).sum(1).max())
static = vmap(lambda x: torch.nonzero_static(x > 0, size=most, fill_value=-1))
padded, looped = fallback(lambda: static(scores).squeeze(2))
assert looped == ["aten::nonzero_static"], looped
loop = torch.full((len(scores), most), -1, device=device)
for b, x in enumerate(scores):
    found = torch.nonzero(x > 0).squeeze(1)
    loop[b, : len(found)] = found
check("nonzero_static(size=most) vs nonzero, padded", padded, loop, 0)
too_short = vmap(lambda x: torch.nonzero_static(x > 0, size=2, fill_value=-1))
first_two, _ = fallback(lambda: too_short(scores).squeeze(2))
check("size=2: the first two only", first_two, loop[:, :2], 0)


# %%
# The batched rewrite: a stable sort of the negated mask puts the selected positions first, in
# order. Gather the values with the positions clamped to real indices (-1 is none)
# and zero them where the validity mask says so: ``x[x > 0]``, padded.
def first_positions(mask, length):
    """Positions of mask's first `length` True entries, padded with -1, and validity."""
    order = torch.sort((~mask).to(torch.uint8), stable=True).indices[:length]
    valid = torch.arange(length, device=mask.device) < mask.sum()
    return torch.where(valid, order, -1), valid


def selected_padded(x, length):
    positions, valid = first_positions(x > 0, length)
    return torch.where(valid, x.gather(0, positions.clamp(min=0)), 0), valid


positions, valid = vmap(first_positions, in_dims=(0, None))(scores > 0, most)
check("sorted positions vs nonzero, padded", positions, loop, 0)
values, valid = vmap(selected_padded, in_dims=(0, None))(scores, most)
for b, want in enumerate(kept):
    check(f"sample {b}: x[x > 0], padded", values[b, : len(want)], want, 0)
assert not values[~valid].any() and valid.sum() == sum(len(s) for s in kept)

# %%
# unique: counts over a known range, or a first-occurrence mask
# --------------------------------------------------------------
# When the values are labels below a known ``classes``, counts per label have a fixed length,
# and "which labels occur" is ``counts > 0``. ``scatter_add`` into zeros counts without the
# per-sample loop of ``bincount``. The reference: ``torch.unique(return_counts=True)``.
classes = 5


def label_counts(t):
    return t.new_zeros(classes).scatter_add(0, t, torch.ones_like(t))


counts = vmap(label_counts)(labels)
for b, t in enumerate(labels):
    occurring, how_many = torch.unique(t, return_counts=True)
    check(f"sample {b}: label counts", counts[b, occurring], how_many, 0)
    assert (counts[b] > 0).sum() == len(occurring), "an absent label counted"


# %%
# For values of any range, sort and keep the entries that differ from their left neighbour:
# with ``first_positions`` above, that gives ``unique`` padded to the sample's length.
# Without the sort, the same mask gives :func:`torch.unique_consecutive`.
def distinct_padded(t, sort=True):
    s = torch.sort(t).values if sort else t
    first = torch.cat([torch.ones_like(s[:1], dtype=torch.bool), s[1:] != s[:-1]])
    positions, valid = first_positions(first, len(t))
    return torch.where(valid, s.gather(0, positions.clamp(min=0)), torch.nan), valid


halves = torch.randint(0, 6, (6, 8), device=device) / 2
for name, sort, op in (("unique", True, torch.unique),
                       ("unique_consecutive", False, torch.unique_consecutive)):  # fmt: skip
    values, valid = vmap(distinct_padded, in_dims=(0, None))(halves, sort)
    for b, t in enumerate(halves):
        want = op(t)
        check(f"sample {b}: {name}, padded", values[b, : len(want)], want, 0)
        assert valid[b].sum() == len(want) and values[b, len(want) :].isnan().all()


# %%
# A window at a per-sample offset: build the indices
# ---------------------------------------------------
# ``x[i : i + n]`` with a per-sample start ``i`` turns ``i`` into a Python int, which ``vmap``
# cannot do, and ``torch.narrow`` with a tensor start fails too. The window's length is fixed,
# so index with ``i + arange(n)`` (or ``torch.gather``): one gather for the whole batch.
starts = torch.tensor([0, 3, 1, 5, 2, 4], device=device)
sliced = vmap(lambda x, i: x[i : i + 3])
refused("x[i : i + 3]", lambda: sliced(scores, starts), RuntimeError,
        "vmap: It looks like you're calling .item() on a Tensor")  # fmt: skip
narrowed = vmap(lambda x, i: torch.narrow(x, 0, i, 3))
refused("torch.narrow(x, 0, i, 3)", lambda: narrowed(scores, starts), RuntimeError,
        "Batching rule not implemented for aten::narrow.Tensor")  # fmt: skip
windows = vmap(lambda x, i: x[i + torch.arange(3, device=x.device)])(scores, starts)
by_slicing = torch.stack([x[i : i + 3] for x, i in zip(scores, starts.tolist())])
check("windows from i + arange(3), every sample", windows, by_slicing, 0)


# %%
# The k largest, not a threshold
# ------------------------------
# When "the entries above ``t``" really means "the strongest few", :func:`torch.topk` gives
# them with a fixed ``k``; a mask then drops those below ``t``. The gradient of the sum of their
# squares, per sample, is checked against ``autograd.grad`` of the indexing version.
def strongest_energy(x, k=3, t=0.5):
    top = torch.topk(x, k).values
    return torch.where(top > t, top, 0).pow(2).sum()


strongest_grads = vmap(grad(strongest_energy))(scores)
for b, x in enumerate(scores.double()):
    leaf = x.clone().requires_grad_()
    above = leaf[leaf > 0.5].sort(descending=True).values[:3]
    (want,) = torch.autograd.grad(above.pow(2).sum() + 0 * leaf.sum(), leaf)
    check(f"sample {b}: gradient through top-k", strongest_grads[b], want, 1e-6)

# %%
# Sparse matrices: capture them, map the dense input
# --------------------------------------------------
# A graph Laplacian shared by all samples (a ring of ``n`` nodes) in the ``torch.sparse_coo``
# layout. Captured, not mapped, it works under ``vmap`` and ``grad``: the per-sample gradient of
# a smoothing energy ``xᵀLx + ‖x − y‖²`` is checked against its closed form ``2Lx + 2(x − y)``,
# with ``L`` written out dense in float64.
n = 12
ring = torch.arange(n, device=device)
edges = torch.stack([ring, (ring + 1) % n])
laplacian = torch.sparse_coo_tensor(
    torch.cat([torch.stack([ring, ring]), edges, edges.flip(0)], 1),
    torch.cat([torch.full((n,), 2.0), -torch.ones(2 * n)]).to(device),
    (n, n),
    check_invariants=True,
).coalesce()
eye = torch.eye(n, dtype=torch.float64, device=device)
dense_laplacian = 2 * eye - eye.roll(1, 0) - eye.roll(-1, 0)
signals, noisy = torch.randn(2, 6, n, device=device)


def smoothing_energy(x, y):
    return x @ (laplacian @ x) + (x - y).pow(2).sum()


smoothing_grads = vmap(grad(smoothing_energy))(signals, noisy)
closed_form = 2 * signals.double() @ dense_laplacian + 2 * (signals - noisy).double()
check("vmap(grad(xᵀLx + ‖x − y‖²)), sparse L", smoothing_grads, closed_form, 5e-6)
batched = torch.sparse.mm(laplacian, signals.T).T  # outside vmap: one sparse product
dense_product = signals.double() @ dense_laplacian
check("sparse.mm(L, X.T).T, whole batch", batched, dense_product, 2e-6)

# %%
# Write the product as ``L @ x`` with ``x`` one sample (a vector). ``torch.sparse.mm`` of a
# column runs under ``vmap`` through the per-sample loop, but not under ``vmap(grad)``;
# ``torch.mm`` not even under ``vmap``. A CSR matrix maps, but ``grad`` refuses it, though
# ``autograd`` takes it: call ``to_sparse_coo()`` outside the function. A batch of sparse
# matrices (a mapped sparse input) maps, but ``matmul`` on it raises; ``torch.sparse.mm`` runs,
# through the per-sample loop.
with warnings.catch_warnings(action="ignore"):  # "Sparse CSR tensor support is in beta"
    csr = laplacian.to_sparse_csr()
column = vmap(lambda x: torch.sparse.mm(laplacian, x[:, None]).squeeze(1))
by_column, looped = fallback(lambda: column(signals))
check(f"vmap: sparse.mm, looping over {looped}", by_column, batched, 2e-6)
check("vmap: CSR @ x", vmap(lambda x: csr @ x)(signals), batched, 2e-6)
sparse_energy = lambda x: torch.sparse.mm(laplacian, x[:, None]).pow(2).sum()  # noqa: E731
expand = "expand is unsupported for Sparse"
refused("vmap(grad(sparse.mm(L, x[:, None]) ...))", lambda: vmap(grad(sparse_energy))(signals),
        RuntimeError, expand)  # fmt: skip
refused("vmap: torch.mm(L, x[:, None])", lambda: vmap(lambda x: torch.mm(laplacian, x[:, None]))(
        signals), RuntimeError, expand)  # fmt: skip
no_strides = "Sparse CSR tensors do not have strides"
refused("grad: CSR @ x", lambda: grad(lambda x: (csr @ x).sum())(signals[0]), RuntimeError,
        no_strides)  # fmt: skip
refused("grad: CSR converted inside", lambda: grad(lambda x: (csr.to_sparse_coo() @ x).sum())(
        signals[0]), RuntimeError, no_strides)  # fmt: skip
leaf = signals[0].clone().requires_grad_()
(by_autograd,) = torch.autograd.grad((csr @ leaf).pow(2).sum(), leaf)
by_hand = 2 * dense_laplacian @ (dense_laplacian @ leaf.double())
check("autograd: CSR", by_autograd, by_hand, 5e-6)
stacked = torch.stack([(b + 1) * laplacian.to_dense() for b in range(6)]).to_sparse()
refused("vmap over sparse matrices: A @ x", lambda: vmap(torch.matmul)(stacked, signals),
        RuntimeError, expand)  # fmt: skip
stack_mm = vmap(lambda A, x: torch.sparse.mm(A, x[:, None]).squeeze(1))
by_sparse_stack, looped = fallback(lambda: stack_mm(stacked, signals))
scaled = batched * torch.arange(1, 7, device=device)[:, None]  # sample b: (b + 1) L x
check(f"sparse.mm on a sparse stack, looping: {looped}", by_sparse_stack, scaled, 1e-5)

# %%
# Measuring: nonzero_static or the sort, against a loop
# -----------------------------------------------------
# Both padded-``nonzero`` recipes are right; which is faster? Under ``vmap``, ``nonzero_static``
# runs a per-sample loop inside torch, the sort recipe batched operators; the loop calls
# ``nonzero`` per sample in Python, and does not even pad. A bigger batch, on all threads.
wide = torch.randn(256, 64, device=device)
static_wide = vmap(lambda x: torch.nonzero_static(x > 0, size=64).squeeze(1))
recipes = {
    "loop": lambda: [torch.nonzero(x > 0).squeeze(1) for x in wide],
    "vmap fallback": lambda: static_wide(wide),
    "vmap": lambda: vmap(first_positions, in_dims=(0, None))(wide > 0, 64)[0],
}
with warnings.catch_warnings(action="ignore"):
    check("sort vs nonzero_static", recipes["vmap"](), recipes["vmap fallback"](), 0)
    timings, threads = {}, torch.get_num_threads()
    for name, run in recipes.items():
        run()  # warm-up
        timer = benchmark.Timer("run()", globals={"run": run}, num_threads=threads)
        timings[name] = timer.blocked_autorange(min_run_time=0.3)
for name, timing in timings.items():
    line = f"{name}: {timing.median * 1e6:.1f} µs (IQR {timing.iqr * 1e6:.3g} µs)"
    ratio = timing.median / timings["vmap"].median
    words = f"takes {ratio:.1f}x the time of", f"is {1 / ratio:.1f}x faster than"
    print(line + ("" if name == "vmap" else f", {words[ratio < 1]} vmap"))
fig, ax = plt.subplots(figsize=(6.4, 2.8))
names = list(timings)
medians, spreads = zip(*[(t.median * 1e3, t.iqr * 500) for t in timings.values()])
ax.barh(names, medians, xerr=spreads, color=[METHOD_COLORS[m] for m in names])
ax.set_xlabel(f"ms for {len(wide)} samples of {wide.shape[1]} values (median, IQR)")
ax.set_title(f"Padded nonzero on {device}\nvmap: sort; vmap fallback: nonzero_static")
fig.tight_layout()
plt.show()

# %%
# What to remember
# ----------------
# * With a per-sample mask, boolean indexing, ``masked_select``, ``nonzero``, one-argument
#   ``where`` and ``unique`` raise under ``vmap``; ``x[mask] = v`` is ``x.masked_fill(mask, v)``.
#   ``argwhere``, ``bincount`` and tensor ``repeat_interleave`` raise when sizes differ.
# * To reduce the selected entries, do not select: fill the rest with the neutral value, divide
#   by the mask's count (guarded), and fill NaNs before the arithmetic, not after.
# * For indices, ``torch.nonzero_static(mask, size=k, fill_value=-1)`` runs, through a loop; a
#   stable sort of the mask is batched. Check that ``k`` is at least the largest count.
# * ``unique`` becomes counts over a known range (``scatter_add``), or a sort with a
#   first-occurrence mask; "the strongest few" is ``topk``.
# * Capture a shared sparse matrix (``to_sparse_coo()`` for ``grad``) and map the dense input:
#   ``L @ x``.
