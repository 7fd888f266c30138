"""
Troubleshooting, part 18: a vectorized Hessian's memory, a block mask per batch, old warnings
=============================================================================================

Four reports, re-run on torch 2.13: a dense Hessian whose vectorized computation asked for
thousands of GiB though the Hessian itself fits (rfeinman/pytorch-minimize#39); a FlexAttention
block mask with a per-batch offset that raised the ``vmap`` ``.item()`` error
(meta-pytorch/attention-gym#97); a slow-fallback warning for ``aten::mse_loss_backward`` under a
library that batches ``autograd.grad`` (pytorch#146697); and ``jacfwd`` that seemed slower after
moving from ``functorch`` to ``torch.func`` (pytorch/functorch#1126). For each: what 2.13 does,
the fix checked against a closed form or a loop, and a check to run on your release.
Part 1: :doc:`plot_troubleshooting`.
"""

import gc
import inspect
import json
import tempfile
import textwrap
import traceback
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch._C._functorch import is_batchedtensor
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
as64 = {"dtype": torch.float64, "device": device}
on_gpu = device.type == "cuda"
METHOD_COLORS = {"vmap chunked": "#44AA99", "hessian": "#56B4E9"}


def relative_gap(label, got, want, bound):
    """Asserts the largest entrywise gap over the largest entry of want is within bound."""
    assert got.shape == want.shape, (
        f"{label}: shapes {tuple(got.shape)}, {tuple(want.shape)}"
    )
    gap = (got - want).abs().max().item() / want.abs().max().item()
    print(f"  {label}: relative gap {gap:.1e} (bound {bound:.0e})")
    assert gap <= bound, f"{label}: gap {gap:.1e} over its bound {bound:.0e}"


# %%
# CUDA out of memory. Tried to allocate ... GiB: a vectorized Hessian
# -------------------------------------------------------------------
# In rfeinman/pytorch-minimize#39 a function of about 8,000 inputs, whose dense Hessian takes about
# 0.5 GB, made a vectorized Hessian ask for 3,732 GiB (on a CPU, a ``RuntimeError`` naming
# ``DefaultCPUAllocator``). A vectorized Hessian computes all its rows at once under ``vmap``:
# ``torch.autograd.functional.hessian(f, x, vectorize=True)`` runs every row's backward pass of the
# gradient (reverse over reverse; here one vector more per row, printed below),
# ``torch.func.hessian`` pushes every row's tangent through the gradient (``jacfwd(jacrev(f))``,
# forward over reverse). Either way each row in flight holds its own intermediate values, so memory
# grows with the number of rows times their size, not with the Hessian's size. The fix: rows in
# chunks, ``jacrev(jacrev(f), chunk_size=c)``; or, forward over reverse, ``vmap`` of a
# Hessian-vector product over the identity's rows with ``chunk_size=c`` (as ``jacfwd`` has no
# ``chunk_size``; this route's peak is the higher here, printed below); ``vectorize=False``, the
# reporter's working call, is a loop, one row at a time. Where a library builds the Hessian with
# its own ``vmap`` and no ``chunk_size`` (the reporter's, read in its source), its methods that use
# only Hessian-vector products avoid the dense Hessian. Here f(x) = Σ softplus(Ax) with A of 4,096
# × 512, whose Hessian is Aᵀ diag(σ(Ax)(1 − σ(Ax))) A, σ the sigmoid: the reference, in float64.
rows, inner = 512, 4096
A = torch.randn(inner, rows, **as64) / rows**0.5
x = torch.randn(rows, **as64)


def softplus_sum(x):
    return F.softplus(A @ x).sum()


slope = torch.sigmoid(A @ x)
closed_form = A.T @ ((slope * (1 - slope))[:, None] * A)
chunked = jacrev(jacrev(softplus_sum), chunk_size=16)(x)
relative_gap("jacrev(jacrev(f), chunk_size=16)", chunked, closed_form, 1e-14)
assert "chunk_size" not in inspect.signature(jacfwd).parameters

# %%
# The peak memory of each way: on a GPU from the allocator's statistics, on a CPU from the
# profiler's record of each allocation with the running total after it. The tool is first
# checked on cases whose answer is known: a new 8 MiB tensor, and a chain of 4 MiB tensors in
# which one is freed before the third is made (8 MiB at most).


def with_peak_mib(call):
    """(result of call(), the peak memory it allocated above what was live, in MiB)."""
    gc.collect()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device=device)
        before = torch.cuda.memory_allocated(device)
        result = call()
        return result, (torch.cuda.max_memory_allocated(device) - before) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as allocations:
        result = call()
    with tempfile.TemporaryDirectory() as scratch_dir:
        trace = Path(scratch_dir) / "trace.json"
        allocations.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    steps = [event["args"] for event in events if event.get("name") == "[memory]"]
    live_before = steps[0]["Total Allocated"] - steps[0]["Bytes"]
    return result, max(s["Total Allocated"] - live_before for s in steps) / 2**20


_, known = with_peak_mib(lambda: torch.empty(1024, 1024, **as64))
relative_gap("peak of one 8 MiB tensor", torch.tensor(known), torch.tensor(8.0), 1e-5)
_, known = with_peak_mib(lambda: (torch.ones(1024, 512, **as64) * 2) + 1)
relative_gap(
    "peak of a chain of 4 MiB tensors", torch.tensor(known), torch.tensor(8.0), 1e-5
)
ways = {
    "autograd.functional.hessian(vectorize=True)": lambda: torch.autograd.functional.hessian(
        softplus_sum, x, vectorize=True),
    "torch.func.hessian": lambda: hessian(softplus_sum)(x),
    **{f"jacrev(jacrev(f), chunk_size={c})": lambda c=c: jacrev(
        jacrev(softplus_sum), chunk_size=c)(x) for c in (16, 64, 256)},
    "vmap(Hessian-vector product, chunk_size=64)": lambda: vmap(
        hessian_vector_product, chunk_size=64)(torch.eye(rows, **as64)),
    "autograd.functional.hessian(vectorize=False)": lambda: torch.autograd.functional.hessian(
        softplus_sum, x),
}  # fmt: skip
peaks = {}


def hessian_vector_product(v):  # forward over reverse, one row of the Hessian
    return jvp(grad(softplus_sum), (x,), (v,))[1]


for way, call in ways.items():
    result, peaks[way] = with_peak_mib(call)
    relative_gap(f"{way}, {peaks[way]:.1f} MiB", result, closed_form, 1e-14)
size = closed_form.numel() * closed_form.element_size() / 2**20
print(f"  the Hessian itself: {size:.1f} MiB")
unchunked = peaks["torch.func.hessian"]
smallest = peaks["jacrev(jacrev(f), chunk_size=16)"]
print(
    f"  chunk_size=16 peaks at {smallest / unchunked:.2f} of torch.func.hessian's peak"
)
assert smallest < 0.2 * unchunked, "chunk_size did not lower the peak"
by_hvp = peaks["vmap(Hessian-vector product, chunk_size=64)"]
assert by_hvp > peaks["jacrev(jacrev(f), chunk_size=64)"], (
    "the HVP route's peak is lower"
)
extra = (
    (peaks["autograd.functional.hessian(vectorize=True)"] - unchunked) * 2**20 / rows
)
print(f"  reverse over reverse holds {extra / 1024:.0f} KiB more per row: "
      f"{extra / 8 / inner:.2f} vectors of {inner} floats")  # fmt: skip
assert 0.9 < extra / 8 / inner < 1.1, extra

# %%
# A straight line through the chunked peaks gives the memory of one row in flight, and the
# peak it predicts for all 512 rows at once, beside what the unchunked calls measured. The
# reader's own budget gives the chunk size: (budget − fixed part) / (memory per row).
sizes = torch.tensor([16.0, 64.0, 256.0])
measured = torch.tensor(
    [peaks[f"jacrev(jacrev(f), chunk_size={int(c)})"] for c in sizes]
)
per_row = ((measured[2] - measured[0]) / (sizes[2] - sizes[0])).item()
fixed = measured[0].item() - 16 * per_row
print(f"  each row in flight: {per_row * 1024:.0f} KiB, {per_row * 2**20 / 8 / inner:.1f} "
      f"vectors of {inner} floats; fixed part {fixed:.1f} MiB")  # fmt: skip
predicted = fixed + rows * per_row
print(f"  predicted for {rows} rows at once: {predicted:.1f} MiB")
relative_gap("prediction, against torch.func.hessian's peak",
             torch.tensor(predicted), torch.tensor(peaks["torch.func.hessian"]), 0.02)  # fmt: skip

fig, ax = plt.subplots(figsize=(6.5, 3.6), layout="constrained")
ax.plot(
    sizes, measured, "o-", color=METHOD_COLORS["vmap chunked"], label="chunk_size=c"
)
in_flight = torch.logspace(torch.log10(sizes[0]), torch.log10(torch.tensor(rows)), 50)
ax.plot(
    in_flight,
    fixed + in_flight * per_row,
    ":",
    color="black",
    label="fixed + c · per row",
)
ax.plot([rows], [peaks["torch.func.hessian"]], "s", color=METHOD_COLORS["hessian"],
        label="torch.func.hessian (all rows)")  # fmt: skip
ax.axhline(size, color="0.5", linestyle="--", label="the Hessian's own size")
ax.set(
    xscale="log", yscale="log", xlabel="rows in flight (chunk_size)", ylabel="peak MiB"
)
ax.minorticks_off()
ax.set_xticks([16, 64, 256, rows], [16, 64, 256, rows])
ax.set_yticks([2, 5, 10, 20, 50, 100], [2, 5, 10, 20, 50, 100])
ax.set_title(f"Peak memory of a {rows} × {rows} Hessian, {device.type}")
ax.legend(fontsize=8)
plt.show()

# %%
# vmap: It looks like you're calling .item() on a Tensor: a block mask per batch
# ------------------------------------------------------------------------------
# In meta-pytorch/attention-gym#97 (January 2025, on a nightly of that time) a FlexAttention
# ``mask_mod`` that moves each batch element's mask by its own offset, the report's
# ``q_idx + pos[b, 0] <= kv_idx`` (keys at or after the query plus the offset), raised this
# ``RuntimeError`` from ``create_block_mask``, which calls ``mask_mod`` under nested ``vmap``
# with ``b``, ``h``, ``q_idx`` and ``kv_idx`` as batched 0-d tensors. On 2.13 it runs. The report
# passed ``B=None``: then ``b`` takes the value 0 alone, and the one mask made is applied to every
# batch element. For a mask per batch element, pass ``B``. References: the comparison broadcast
# by hand over all four indices, and for the block mask the same, reduced to 128 × 128 tiles.
batch_size, length = 2, 512
pos = torch.tensor([[3], [200]], device=device)  # one offset per batch element, (B, 1)
seen = []


def shifted(b, h, q_idx, kv_idx):  # the report's
    seen.append((is_batchedtensor(b), is_batchedtensor(q_idx), q_idx.dim()))
    return q_idx + pos[b, 0] <= kv_idx


positions = torch.arange(length, device=device)
by_hand = positions[None, None, :, None] + pos[:, :, None, None] <= positions
dense = create_mask(shifted, batch_size, 1, length, length, device=device)
assert torch.equal(dense, by_hand), (
    "the dense mask differs from the broadcast comparison"
)
blocks = create_block_mask(shifted, batch_size, 1, length, length, device=device)
assert seen and all(record == (True, True, 0) for record in seen), seen
tiles = (
    by_hand.view(batch_size, 1, length // 128, 128, length // 128, 128).any(5).any(3)
)
assert torch.equal(blocks.to_dense().bool(), tiles), (
    "the block mask differs, tile by tile"
)
shared = create_block_mask(shifted, None, None, length, length, device=device)
assert shared.shape == (1, 1, length, length), shared.shape
assert torch.equal(shared.to_dense().bool()[0], tiles[0]), "B=None: not batch 0's mask"
assert not torch.equal(tiles[0], tiles[1]), (
    "the offsets should differ by a tile or more"
)
print(f"  B=2: {tuple(blocks.shape)}, equal to the comparison tile by tile; "
      f"B=None: {tuple(shared.shape)}, one mask for every batch element")  # fmt: skip

# %%
# What still raises: turning a batched index's value into a Python number (``.item()``,
# ``int()``: this message) or branching on it with ``if`` (the "data-dependent control flow"
# message). Keep it a tensor, and ``torch.where`` for a branch.
# To find the line, read the traceback: its last frame in your file is the call that asked for
# the value (here found by the function's name).


def offset_as_int(b, h, q_idx, kv_idx):
    return q_idx + int(pos[b, 0]) <= kv_idx


def offset_branched(b, h, q_idx, kv_idx):
    if pos[b, 0] > 50:
        return q_idx + 50 <= kv_idx
    return q_idx + pos[b, 0] <= kv_idx


def offset_capped(b, h, q_idx, kv_idx):  # the fix for the branch: torch.where
    return q_idx + torch.where(pos[b, 0] > 50, 50, pos[b, 0]) <= kv_idx


try:
    create_block_mask(offset_as_int, batch_size, 1, length, length, device=device)
    raise AssertionError(f"torch {torch.__version__}: int() of a batched index ran")
except RuntimeError as refused:
    said = str(refused)
    assert said.startswith("vmap: It looks like you're calling .item() on a Tensor"), (
        said
    )
    frames = traceback.extract_tb(refused.__traceback__)
    yours = [f for f in frames if f.name == offset_as_int.__name__]
    assert yours, [f.name for f in frames]
    print(
        f"  RuntimeError: {said[:54]}...; raised in {yours[-1].name}: {yours[-1].line}"
    )
try:
    create_block_mask(offset_branched, batch_size, 1, length, length, device=device)
    raise AssertionError(f"torch {torch.__version__}: if on a batched index ran")
except RuntimeError as refused:
    said = str(refused)
    assert said.startswith(
        "vmap: It looks like you're attempting to use a Tensor in"
    ), said
    print(f"  RuntimeError: {textwrap.shorten(said, 100)}")
capped = create_mask(offset_capped, batch_size, 1, length, length, device=device)
by_hand = (
    positions[None, None, :, None] + pos.clamp(max=50)[:, :, None, None] <= positions
)
assert torch.equal(capped, by_hand), "torch.where in the mask_mod: another mask"
print("  torch.where in the mask_mod: equal to the broadcast comparison with the cap")

# %%
# There is a performance drop because we have not yet implemented ... aten::mse_loss_backward
# -------------------------------------------------------------------------------------------
# A ``UserWarning`` that pytorch#146697 met through TorchJD, a library that computes the Jacobian
# of several losses with respect to the parameters by batching ``autograd.grad`` over the rows of
# an identity. It means ``vmap`` ran that backward operator one row at a time: correct, but slow.
# Two routes batch it. ``torch.vmap`` over ``autograd.grad``, the report's: on 2.13 it warns
# nothing. ``autograd.grad(..., is_grads_batched=True)``, which runs an older prototype of
# ``vmap`` whose slow-path warnings are off unless a debug switch turns them on
# (``torch._C._debug_only_display_vmap_fallback_warnings``): with it on, 2.13 still runs
# ``mse_loss_backward`` row by row there. The fix on either route: the loss written out,
# ``((pred - target) ** 2).mean()``, which has no such operator. The check for your release:
# record the warnings, debug switch on. It is first tried on ``torch.bincount``, which 2.13
# still runs one sample at a time under ``torch.vmap``. Reference: 2 Xᵀ(XW − T)/(n·k) per loss.
features = torch.randn(32, 8, **as64)
weight = torch.randn(8, 3, **as64, requires_grad=True)
targets = torch.randn(2, 32, 3, **as64)  # two tasks, one loss each
identity = torch.eye(2, **as64)
SLOW = (
    "There is a performance drop because we have not yet implemented the batching rule"
)


def slow_fallbacks(call, *args):
    """call(*args), the slow-fallback warnings it raised, and the operators they name."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", category=Warning)
        result = call(*args)
    slow = [str(w.message) for w in warned if str(w.message).startswith(SLOW)]
    return result, slow, sorted({text.split(" for ")[1].split(".")[0] for text in slow})


def written_out(pred, target):
    return (pred - target).square().mean()


def by_torch_vmap(losses):
    return vmap(lambda row: torch.autograd.grad(losses, weight, row, retain_graph=True)[0])(
        identity)  # fmt: skip


def by_flag(losses):
    return torch.autograd.grad(losses, weight, identity, is_grads_batched=True)[0]


labels = torch.tensor([[0, 2, 2], [1, 2, 0]], device=device)  # the same largest label
_, heard, named = slow_fallbacks(vmap(torch.bincount), labels)
print(f"  UserWarning: {heard[0].split(' (Trig')[0]}")
assert named == ["aten::bincount"], named
residuals = (features @ weight).detach() - targets  # d mean(r²)/dW = 2 Xᵀ r / (n·k)
by_hand = 2 * features.T @ residuals / residuals[0].numel()
was_on = torch._C._debug_only_are_vmap_fallback_warnings_enabled()
torch._C._debug_only_display_vmap_fallback_warnings(True)
try:
    slow = {}
    for loss in (F.mse_loss, written_out):
        for route in (by_torch_vmap, by_flag):
            losses = torch.stack([loss(features @ weight, t) for t in targets])
            jacobian, _, names = slow_fallbacks(route, losses)
            slow[loss.__name__, route.__name__] = names
            relative_gap(f"{loss.__name__}, {route.__name__}", jacobian, by_hand, 1e-14)
finally:
    torch._C._debug_only_display_vmap_fallback_warnings(was_on)
for (loss_name, route_name), names in slow.items():
    print(f"  {loss_name}, {route_name}: slow fallbacks {names}")
assert slow == {
    ("mse_loss", "by_torch_vmap"): [],
    ("mse_loss", "by_flag"): ["aten::mse_loss_backward"],
    ("written_out", "by_torch_vmap"): [],
    ("written_out", "by_flag"): [],
}, slow

# %%
# (No error) jacfwd slower after moving from functorch? How fast is each
# ----------------------------------------------------------------------
# ``functorch.jacfwd`` on 2.13 warns that it is deprecated, then calls ``torch.func.jacfwd``
# (``torch/_functorch/deprecated.py``): the same work. So a slowdown seen after the move
# (pytorch/functorch#1126) comes from something else that changed with it, such as the torch
# release or what was timed. Both timed in one process with ``torch.utils.benchmark`` on all
# threads after a warm-up (median and interquartile range, IQR); ``jacrev`` beside them, the
# choice that does change the work (here 512 outputs from 64 inputs: ``jacfwd`` pushes 64
# tangents, ``jacrev`` pulls back 512 rows).
with warnings.catch_warnings(action="ignore", category=FutureWarning):
    import functorch  # noqa: E402 (the old package, on purpose)

tall = torch.randn(512, 64, **as64)
tall_map, point = (lambda v: torch.tanh(tall @ v)), torch.randn(64, **as64)
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always", category=Warning)
    old = functorch.jacfwd(tall_map)(point)
print(f"  functorch.jacfwd: {[type(w.message).__name__ for w in warned]}")
assert [type(w.message) for w in warned] == [FutureWarning], warned
assert "_impl.jacfwd(" in inspect.getsource(functorch.jacfwd), (
    "not torch.func's jacfwd?"
)
assert torch.equal(old, jacfwd(tall_map)(point)), (
    "functorch.jacfwd computed something else"
)
relative_gap("jacfwd, against (1 − tanh²) A", old,
             (1 - torch.tanh(tall @ point) ** 2)[:, None] * tall, 1e-15)  # fmt: skip
calls = {
    "functorch.jacfwd": lambda: functorch.jacfwd(tall_map)(point),
    "torch.func.jacfwd": lambda: jacfwd(tall_map)(point),
    "torch.func.jacrev": lambda: jacrev(tall_map)(point),
}
medians = {}
with warnings.catch_warnings(action="ignore", category=FutureWarning):
    for name, call in calls.items():
        call()  # a warm-up
        timer = Timer(
            "call()", globals={"call": call}, num_threads=torch.get_num_threads()
        )
        took = timer.blocked_autorange(min_run_time=0.2)
        medians[name] = took.median
        spread = f"IQR {took.iqr * 1e3:.3f} ms, {len(took.times)} blocks"
        print(f"  {name}: {took.median * 1e3:.3f} ms ({spread})")
old_over_new = medians["functorch.jacfwd"] / medians["torch.func.jacfwd"]
print(f"  functorch.jacfwd takes {old_over_new:.2f}x the time of torch.func.jacfwd")
slow, fast = sorted(
    ["torch.func.jacfwd", "torch.func.jacrev"], key=medians.get, reverse=True
)
print(f"  {slow} takes {medians[slow] / medians[fast]:.2f}x the time of {fast} here")

# %%
# What to remember
# ----------------
# - A vectorized Hessian (``autograd.functional.hessian(vectorize=True)``,
#   ``torch.func.hessian``) keeps every row in flight at once: its peak is rows × one row's
#   intermediates, far above the Hessian's size. ``jacrev(jacrev(f), chunk_size=c)`` or a
#   chunked ``vmap`` of Hessian-vector products bounds it; two chunk sizes give the memory per
#   row, and your budget gives c.
# - Under ``create_block_mask`` the indices are batched tensors: index with them (``pos[b, 0]``
#   runs on 2.13), pass ``B`` for a mask per batch element, and never ``.item()``, ``int()`` or
#   ``if``: ``torch.where`` for branches.
# - A "performance drop" warning means a correct, slow loop. ``is_grads_batched=True`` hides
#   its warnings unless the debug switch is on (2.13 still falls back for ``mse_loss_backward``
#   there, not under ``torch.vmap``); the loss written out avoids it.
# - ``functorch.jacfwd`` is ``torch.func.jacfwd`` behind a warning: compare releases, not names.
