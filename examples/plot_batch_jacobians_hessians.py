"""
Batch Jacobians and Hessians
============================

Models run on batches, and most of the time you want one Jacobian *per sample*: the derivative
of each sample's output with respect to that sample's input. This page computes a batch of
Jacobians and a batch of Hessians with ``vmap``, shows the older "sum over the batch" trick,
states the one condition under which that trick is valid, and shows a function for which it
silently returns the wrong answer. Then it times ``vmap``, the trick and a plain Python loop.
"""

# %%
# Where this page ran
# -------------------
# We print the hardware, because the timings depend on it, pick the GPU when there is one, and
# seed the generator.
import os
import platform
import re
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import hessian, jacrev, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


def describe_hardware():
    """One line naming the processor or GPU, torch's version and its thread count."""
    if device.type == "cuda":
        name = f"GPU: {torch.cuda.get_device_name(device)}"
    else:
        cpuinfo = Path("/proc/cpuinfo")  # Linux names the CPU model here
        model = (
            re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
            if cpuinfo.exists()
            else None
        )
        cpu = model.group(1) if model else (platform.processor() or platform.machine())
        name = f"CPU: {cpu}, {os.cpu_count()} cores"
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


print(describe_hardware())


def median_ms(fn, min_run_time=0.5):
    """Median time of ``fn()`` in milliseconds, using all of torch's threads."""
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


# %%
# A batch and a layer
# -------------------
# 64 inputs of 31 features go through *f(W, b, x) = tanh(W x + b)* to 33 outputs. The
# sizes differ on purpose: in a (64, 33, 31) result every axis has its own length, so a
# transposed or misplaced axis cannot hide.
batch_size, num_inputs, num_outputs = 64, 31, 33
weight = torch.randn(num_outputs, num_inputs, device=device) / num_inputs**0.5
bias = torch.randn(num_outputs, device=device)
inputs = torch.randn(batch_size, num_inputs, device=device)


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


# %%
# The reference: each sample's exact Jacobian
# -------------------------------------------
# For one sample, ``∂f_i/∂x_k = (1 − f_i²) W_ik``. Broadcasting that
# over the batch gives the reference for everything below.
outputs = layer(weight, bias, inputs)
reference_jacobians = (1 - outputs**2)[:, :, None] * weight
print("reference batch of Jacobians:", tuple(reference_jacobians.shape))

# %%
# ``vmap(jacrev(...))``: write it for one sample, map it over the batch
# ---------------------------------------------------------------------
# :func:`~torch.func.jacrev` differentiates the function of one sample with respect to its
# input (``argnums=2``); :func:`~torch.func.vmap` maps it over the first axis of the inputs while
# sharing the weights (``in_dims=(None, None, 0)``). The result has the batch first, then the
# output, then the input axis.
batch_jacobian = vmap(jacrev(layer, argnums=2), in_dims=(None, None, 0))
vmap_jacobians = batch_jacobian(weight, bias, inputs)
print("vmap(jacrev):", tuple(vmap_jacobians.shape))
torch.testing.assert_close(vmap_jacobians, reference_jacobians)

# %%
# The sum-over-batch trick
# ------------------------
# Before ``vmap`` existed, a common shortcut was to differentiate the *sum over the batch* of
# the outputs. That function maps the whole (64, 31) batch to 33 numbers, so ``jacrev`` gives a
# (33, 64, 31) tensor; moving the batch axis to the front gives (64, 33, 31).
#
# Entry ``(i, b, k)`` of that tensor is ``Σ_c ∂f_i(x_c)/∂x_bk``.
# It equals the per-sample Jacobian **only if each sample's output depends on its own input
# alone**, so that every term with ``c ≠ b`` vanishes. A per-sample layer satisfies that.


def sum_trick_jacobians(fn, weight, bias, inputs):
    summed = jacrev(lambda batch: fn(weight, bias, batch).sum(dim=0))(inputs)
    return summed.movedim(1, 0)


trick_jacobians = sum_trick_jacobians(layer, weight, bias, inputs)
print("sum trick:", tuple(trick_jacobians.shape))
torch.testing.assert_close(trick_jacobians, reference_jacobians)

# %%
# Where the trick silently fails
# ------------------------------
# Now make the samples interact: centre the batch (subtract its mean) before the layer, as batch
# normalisation does. Each output now depends on every input in the batch. The true per-sample
# Jacobian is the diagonal block ``∂f(x_b)/∂x_b`` of the full Jacobian of
# the batch function, which we compute in full as the reference. The trick runs without
# complaint, returns the right shape, and is wrong, because it adds in all the cross-sample
# terms.


def centred_layer(weight, bias, batch):
    return layer(weight, bias, batch - batch.mean(dim=0))


full_jacobian = jacrev(centred_layer, argnums=2)(
    weight, bias, inputs
)  # (64, 33, 64, 31)
samples = torch.arange(batch_size, device=device)
true_blocks = full_jacobian[
    samples, :, samples
]  # (64, 33, 31): each sample's own block
wrong_blocks = sum_trick_jacobians(centred_layer, weight, bias, inputs)
trick_error = ((wrong_blocks - true_blocks).norm() / true_blocks.norm()).item()
print(
    f"sum trick on a batch-coupled function: shape {tuple(wrong_blocks.shape)}, "
    f"relative error {trick_error:.2f}"
)
assert wrong_blocks.shape == true_blocks.shape and trick_error > 0.1

# %%
# The cross terms here are each small (1/64 of a sample's weight), but there are 63 of them,
# and they add up. ``vmap`` would not give the true blocks either: applied to one sample at a
# time, ``centred_layer`` centres a batch of one and sees only zeros. A function that couples
# samples has no per-sample Jacobian that a per-sample transform can see; take the blocks of
# the full Jacobian, as above.

# %%
# Batch Hessians
# --------------
# The same pattern gives one Hessian per sample: ``vmap(hessian(...))``. Each sample's Hessian of
# its 33 outputs with respect to its 31 inputs has shape (33, 31, 31), so the batch is
# (64, 33, 31, 31). The exact per-sample Hessian,
# ``−2 f_i (1 − f_i²) W_ik W_il``, evaluated in float64, is the reference; the
# relative error of float32 should sit near 1e-7, and 1e-5 leaves room for accumulation.
batch_hessian = vmap(hessian(layer, argnums=2), in_dims=(None, None, 0))
vmap_hessians = batch_hessian(weight, bias, inputs)
outputs64 = outputs.double()
weight64 = weight.double()
reference_hessians = torch.einsum(
    "bi,ik,il->bikl", -2 * outputs64 * (1 - outputs64**2), weight64, weight64
)
hessian_error = (
    (vmap_hessians.double() - reference_hessians).norm() / reference_hessians.norm()
).item()
print(
    f"vmap(hessian): {tuple(vmap_hessians.shape)}, relative error {hessian_error:.1e}"
)
assert (
    vmap_hessians.shape == (batch_size, num_outputs, num_inputs, num_inputs)
    and hessian_error < 1e-5
)

# %%
# Timing: ``vmap``, the trick and a loop
# --------------------------------------
# The loop calls ``jacrev`` (or ``hessian``) once per sample and stacks the results; it is the
# natural code before ``vmap``. All timings are medians from :mod:`torch.utils.benchmark` in
# this run.


def loop_jacobians(weight, bias, inputs):
    return torch.stack([jacrev(layer, argnums=2)(weight, bias, x) for x in inputs])


def loop_hessians(weight, bias, inputs):
    return torch.stack([hessian(layer, argnums=2)(weight, bias, x) for x in inputs])


torch.testing.assert_close(loop_jacobians(weight, bias, inputs), reference_jacobians)
torch.testing.assert_close(loop_hessians(weight, bias, inputs), vmap_hessians)

jacobian_times_ms = {
    "Python loop": median_ms(lambda: loop_jacobians(weight, bias, inputs)),
    "sum trick": median_ms(lambda: sum_trick_jacobians(layer, weight, bias, inputs)),
    "vmap(jacrev)": median_ms(lambda: batch_jacobian(weight, bias, inputs)),
}
hessian_times_ms = {
    "Python loop": median_ms(lambda: loop_hessians(weight, bias, inputs)),
    "vmap(hessian)": median_ms(lambda: batch_hessian(weight, bias, inputs)),
}
loop_ms = jacobian_times_ms["Python loop"]
for method, ms in jacobian_times_ms.items():
    print(f"Jacobians {method:13s} {ms:7.2f} ms  ({loop_ms / ms:.1f}x vs the loop)")
hessian_loop_ms = hessian_times_ms["Python loop"]
for method, ms in hessian_times_ms.items():
    print(
        f"Hessians  {method:13s} {ms:7.2f} ms  ({hessian_loop_ms / ms:.1f}x vs the loop)"
    )

# %%
fig, (ax_jac, ax_hess) = plt.subplots(1, 2, figsize=(8, 3), layout="constrained")
for ax, times, title in [
    (ax_jac, jacobian_times_ms, "64 Jacobians (33 × 31)"),
    (ax_hess, hessian_times_ms, "64 Hessians (33 × 31 × 31)"),
]:
    colors = ["#d95f02", "#7570b3", "#1b9e77"][-len(times) :]
    bars = ax.bar(list(times), list(times.values()), color=colors)
    ax.bar_label(bars, labels=[f"{ms:.1f}" for ms in times.values()], padding=2)
    ax.set_ylim(0, max(times.values()) * 1.2)
    ax.set_ylabel("median time (ms)")
    ax.set_title(title)
fig.suptitle(
    f"Batch derivatives on {device.type.upper()}: a Python loop vs one vectorised call"
)
plt.show()

# %%
# What to remember
# ----------------
# * ``vmap(jacrev(f, argnums=...), in_dims=(None, ..., 0))`` gives a (batch, outputs, inputs)
#   tensor, and ``vmap(hessian(...))`` a (batch, outputs, inputs, inputs) one.
# * The sum-over-batch trick is correct only when each output depends on its own sample alone.
#   When samples interact, as through batch statistics, it returns a plausible tensor that is
#   wrong.
