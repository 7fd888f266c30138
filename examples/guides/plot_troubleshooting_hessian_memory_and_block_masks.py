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
import traceback
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch._C._functorch import is_batchedtensor
from torch.func import hessian, jacfwd, jacrev, vmap
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
# In rfeinman/pytorch-minimize#39 a function of about 8,000 inputs, whose dense Hessian takes
# about 0.5 GB, made ``torch.autograd.functional.hessian(f, x, vectorize=True)`` ask for
# 3,732 GiB (on a CPU the message starts "DefaultCPUAllocator"). A vectorized Hessian runs the
# backward pass of the gradient for every row at once, under ``vmap``: each row in flight holds
# its own copy of the intermediate values of that pass, so memory grows with the number of rows
# times the size of those values, not with the Hessian's size. ``torch.func.hessian`` does the
# same. The fix: rows in chunks, ``jacrev(jacrev(f), chunk_size=c)``, which keeps c rows in flight
# (``jacfwd`` has no ``chunk_size``). Here f(x) = Σ softplus(Ax) with A of 4,096 × 512, whose
# Hessian is Aᵀ diag(σ(Ax)(1 − σ(Ax))) A, σ the sigmoid: the reference, in float64.
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
relative_gap("peak of one 8 MiB tensor", torch.tensor(known), torch.tensor(8.0), 1e-3)
_, known = with_peak_mib(lambda: (torch.ones(1024, 512, **as64) * 2) + 1)
relative_gap(
    "peak of a chain of 4 MiB tensors", torch.tensor(known), torch.tensor(8.0), 1e-3
)
ways = {
    "autograd.functional.hessian(vectorize=True)": lambda: torch.autograd.functional.hessian(
        softplus_sum, x, vectorize=True),
    "torch.func.hessian": lambda: hessian(softplus_sum)(x),
    **{f"jacrev(jacrev(f), chunk_size={c})": lambda c=c: jacrev(
        jacrev(softplus_sum), chunk_size=c)(x) for c in (16, 64, 256)},
}  # fmt: skip
peaks = {}
for way, call in ways.items():
    result, peaks[way] = with_peak_mib(call)
    relative_gap(f"{way}, {peaks[way]:.1f} MiB", result, closed_form, 1e-14)
size = closed_form.numel() * closed_form.element_size() / 2**20
print(f"  the Hessian itself: {size:.1f} MiB")

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
ax.plot(
    [16, rows], [fixed + 16 * per_row, predicted], ":", color="black", label="the line"
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
# ``mask_mod`` that shifts each batch element's causal mask by its own offset,
# ``q_idx + pos[b, 0] <= kv_idx``, raised this ``RuntimeError`` from ``create_block_mask``, which
# calls ``mask_mod`` under nested ``vmap`` with ``b``, ``h``, ``q_idx`` and ``kv_idx`` as batched
# 0-d tensors. On 2.13 the report's ``mask_mod`` runs (which release changed this, the thread does
# not say). Reference: the same comparison broadcast by hand over all four indices.
batch_size, length = 2, 256
pos = torch.tensor([[3], [100]], device=device)  # one offset per batch element, (B, 1)


def shifted_causal(b, h, q_idx, kv_idx):  # the report's
    seen.append((is_batchedtensor(b), is_batchedtensor(q_idx), q_idx.dim()))
    return q_idx + pos[b, 0] <= kv_idx


seen = []


positions = torch.arange(length, device=device)
by_hand = positions[None, None, :, None] + pos[:, :, None, None] <= positions
dense = create_mask(shifted_causal, batch_size, 1, length, length, device=device)
assert torch.equal(dense, by_hand), (
    "the dense mask differs from the broadcast comparison"
)
assert seen and all(s == (True, True, 0) for s in seen), seen
blocks = create_block_mask(shifted_causal, batch_size, 1, length, length, device=device)
print(
    f"  {blocks.shape}: equal to the broadcast comparison; {blocks.sparsity():.1f}% sparse"
)

# %%
# What still raises: turning a batched index's value into a Python number (``.item()``,
# ``int()``) or branching on it with ``if``. Keep it a tensor, and ``torch.where`` for a branch.
# To find the line, read the traceback: its last frame in your file is the call that asked for
# the value (here found by the function's name).


def offset_as_int(b, h, q_idx, kv_idx):
    return q_idx + int(pos[b, 0]) <= kv_idx


def offset_capped(b, h, q_idx, kv_idx):  # the fix for "if pos[b, 0] > 50: use 50"
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
# of several losses with respect to the parameters. One way to do that, used here, batches
# ``autograd.grad`` over the rows of an identity (``is_grads_batched=True``, which runs ``vmap``
# inside). The warning means ``vmap`` ran that backward operator one row at a time: correct, but
# slow. On 2.13 the same call warns nothing.
# The check for your release: record the warnings and look for this one (the check itself is
# tried on ``torch.bincount``, which 2.13 still runs one sample at a time under ``vmap``). On a
# release that warns, the loss written out, ``((pred - target) ** 2).mean()``, has no such op.
features, weight = (
    torch.randn(32, 8, **as64),
    torch.randn(8, 3, **as64, requires_grad=True),
)
targets = torch.randn(2, 32, 3, **as64)  # two tasks, one loss each
SLOW = (
    "There is a performance drop because we have not yet implemented the batching rule"
)


def slow_fallbacks(call):
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", category=Warning)
        result = call()
    return result, [str(w.message).split(" for ")[1].split(".")[0] for w in warned
                    if str(w.message).startswith(SLOW)]  # fmt: skip


def task_jacobian(loss):
    losses = torch.stack([loss(features @ weight, target) for target in targets])
    return torch.autograd.grad(
        losses, weight, torch.eye(2, **as64), is_grads_batched=True
    )[0]


def written_out(pred, target):
    return (pred - target).square().mean()


labels = torch.tensor([[0, 2, 2], [1, 2, 0]], device=device)  # the same largest label
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always", category=Warning)
    vmap(torch.bincount)(labels)
print(
    f"  {type(warned[0].message).__name__}: {str(warned[0].message).split(' (Trig')[0]}"
)
_, named = slow_fallbacks(lambda: vmap(torch.bincount)(labels))
assert named == ["aten::bincount"], named
for loss in (F.mse_loss, written_out):
    rows_of_jacobian, named = slow_fallbacks(lambda loss=loss: task_jacobian(loss))
    print(f"  {loss.__name__}: slow fallbacks {named}")
    assert named == [], named
    residuals = (features @ weight).detach() - targets  # d mean(r²)/dW = 2 Xᵀ r / (n·k)
    by_hand = 2 * features.T @ residuals / residuals[0].numel()
    relative_gap(
        f"Jacobian of two losses, {loss.__name__}", rows_of_jacobian, by_hand, 1e-14
    )

# %%
# How fast: functorch.jacfwd against torch.func.jacfwd
# ----------------------------------------------------
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
#   ``torch.func.hessian``) holds every row's backward pass at once: its peak is rows × one
#   pass's intermediates, far above the Hessian's size. ``jacrev(jacrev(f), chunk_size=c)``
#   bounds it; two chunk sizes give the memory per row, and your budget gives c.
# - Under ``create_block_mask`` the indices are batched tensors: index with them (``pos[b, 0]``
#   runs on 2.13) but never ``.item()``, ``int()`` or ``if``; ``torch.where`` for branches.
# - A "performance drop" warning means a correct, slow loop; record warnings to check your
#   release (2.13 has none for ``mse_loss_backward``), or write the loss out.
# - ``functorch.jacfwd`` is ``torch.func.jacfwd`` behind a warning: compare releases, not names.
