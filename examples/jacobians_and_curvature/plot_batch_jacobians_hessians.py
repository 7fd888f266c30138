"""
Batch Jacobians and Hessians
============================

Models run on batches, and most of the time you want one Jacobian *per sample*: the derivative
of each sample's output with respect to that sample's input. This page computes a batch of
Jacobians and a batch of Hessians with ``vmap``, shows the older "sum over the batch" trick and
the exact condition under which it is valid, and shows a function for which both the trick and
a careless ``vmap`` silently return the wrong answer. Then it times ``vmap``, the trick and a
plain Python loop.
"""

# %%
# Where this page ran
# -------------------
# We print the hardware, because the timings depend on it, pick the GPU when there is one, and
# seed the generator.
import ctypes
import os
import platform
import re
import statistics
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

# One colour per method, the same on every page of this site: colour-blind-safe hues from
# Okabe and Ito's palette and Tol's. Black is kept for guides: thresholds, fits, markers.
METHOD_COLORS = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "batched": "#666666",
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
    "sum trick": "#CC79A7",
    "vmap chunked": "#44AA99",
    "compiled": "#117733",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
    "ghost clipping": "#CC6677",
    "book-keeping": "#6699CC",
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
    "GGN": "#EE8866",
    "ntk-vector products": "#5D69B1",
    "linearize": "#CC3311",
}

# %%
# Pinning the memory allocator's policy
# -------------------------------------
# The full Jacobian of a batch below allocates tens of MB per call. On a CPU, glibc's
# ``malloc`` by default returns such blocks to the kernel when they are freed, and decides when
# to do so from the process's history, so the same call can be fast or slow depending on what
# ran before. We ask glibc (through ``mallopt``) to keep freed memory for reuse, which makes the
# timings reproducible; the per-sample-gradients page measures what fresh pages cost. Without glibc
# the cell changes nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


print(
    "allocator: glibc keeps freed memory for reuse"
    if keep_freed_memory()
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Checks in float64
# -----------------
# Every result is compared with a reference computed in float64 from the start, by its relative
# error ``‖J − J_ref‖ / ‖J_ref‖``. Matrix products run in full float32 precision (no TF32 on
# GPUs, set explicitly below), so a bound of 1e-5 leaves room for float32 rounding while still
# catching any wrong entry.
torch.set_float32_matmul_precision("highest")


def relative_error(result, reference64):
    return ((result.double() - reference64).norm() / reference64.norm()).item()


def check(result, reference64, what, bound=1e-5):
    """Assert the shape and the relative error of a result against a float64 reference."""
    assert result.shape == reference64.shape, (what, result.shape, reference64.shape)
    error = relative_error(result, reference64)
    assert error < bound, f"{what}: relative error {error:.2e}"
    return error


def median_times_ms(methods, rounds=9, min_run_time=0.1):
    """Median time of each method in ``{name: fn}``, in ms, using all of torch's threads.

    Each method is called three times untimed first, so that caches, lazy initialisation and
    the allocator's heap settle. Then the methods are timed in turn, round after round, and
    each one's median over the rounds is reported: a slow spell of the machine hits every
    method alike instead of whichever happened to run during it.
    """
    for fn in methods.values():
        for _ in range(3):
            fn()
    timers = {
        name: benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
        for name, fn in methods.items()
    }
    rounds_ms = {name: [] for name in methods}
    for _ in range(rounds):
        for name, timer in timers.items():
            blocks = timer.blocked_autorange(min_run_time=min_run_time)
            rounds_ms[name].append(blocks.median * 1e3)
    return {name: statistics.median(times) for name, times in rounds_ms.items()}


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
weight64, bias64, inputs64 = weight.double(), bias.double(), inputs.double()


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


# %%
# The reference: each sample's exact Jacobian
# -------------------------------------------
# For one sample, ``∂f_i/∂x_k = (1 − f_i²) W_ik``. Broadcasting that
# over the batch, in float64, gives the reference for everything below.
outputs64 = layer(weight64, bias64, inputs64)
reference_jacobians = (1 - outputs64**2)[:, :, None] * weight64
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
error = check(vmap_jacobians, reference_jacobians, "vmap(jacrev)")
print(f"vmap(jacrev): {tuple(vmap_jacobians.shape)}, relative error {error:.1e}")

# %%
# The sum-over-batch trick
# ------------------------
# Before ``vmap`` existed, a common shortcut was to differentiate the *sum over the batch* of
# the outputs. That function maps the whole (64, 31) batch to 33 numbers, so ``jacrev`` gives a
# (33, 64, 31) tensor; moving the batch axis to the front gives (64, 33, 31).
#
# Entry ``(b, i, k)`` of that tensor is ``Σ_c ∂f_i(x_c)/∂x_bk``: the sample's own term
# (``c = b``) plus the cross-sample terms (``c ≠ b``). The trick is exact precisely when the
# cross-sample terms *sum* to zero. Samples that do not interact (each output depends on its own
# input alone) are the usual way to get there, because then every cross term is zero. A
# per-sample layer is such a function.


def sum_trick_jacobians(fn, weight, bias, inputs):
    summed = jacrev(lambda batch: fn(weight, bias, batch).sum(dim=0))(inputs)
    return summed.movedim(1, 0)


trick_jacobians = sum_trick_jacobians(layer, weight, bias, inputs)
error = check(trick_jacobians, reference_jacobians, "sum trick")
print(f"sum trick: {tuple(trick_jacobians.shape)}, relative error {error:.1e}")

# %%
# Where the trick silently fails
# ------------------------------
# Now make the samples interact: centre the batch (subtract its mean) before the layer, as batch
# normalisation does. Each output now depends on every input in the batch. The true per-sample
# Jacobian is the diagonal block ``∂f(x_b)/∂x_b`` of the full Jacobian of the batch function,
# which we compute in full, in float64, as the reference. The trick runs without complaint,
# returns the right shape, and is wrong, because it adds in all the cross-sample terms.


def centred_layer(weight, bias, batch):
    return layer(weight, bias, batch - batch.mean(dim=0))


full_jacobian = jacrev(centred_layer, argnums=2)(weight64, bias64, inputs64)
samples = torch.arange(batch_size, device=device)
true_blocks = full_jacobian[
    samples, :, samples
]  # (64, 33, 31): each sample's own block
print("full Jacobian of the batch:", tuple(full_jacobian.shape))
wrong_blocks = sum_trick_jacobians(centred_layer, weight, bias, inputs)
trick_error = relative_error(wrong_blocks, true_blocks)
print(
    f"sum trick on a batch-coupled function: shape {tuple(wrong_blocks.shape)}, "
    f"relative error {trick_error:.2f}"
)
assert wrong_blocks.shape == true_blocks.shape and trick_error > 0.1

# %%
# Why the cross terms add up instead of cancelling: with ``z_c`` the centred input of sample
# ``c``, ``∂f_i(x_c)/∂x_bk = (1 − f_i(x_c)²) W_ik (δ_bc − 1/B)``. Every cross term
# (``c ≠ b``) is ``−(1 − f_i(x_c)²)/B`` times the same entry ``W_ik``: a positive multiple of
# one fixed pattern, so all B − 1 of them point the same way. Their sum is exactly the trick's
# error, which we check term by term:
centred_outputs64 = centred_layer(weight64, bias64, inputs64)
slopes = 1 - centred_outputs64**2  # (B, outputs): 1 − f_i(x_c)², all positive
cross_sum = -(slopes.sum(dim=0) - slopes) / batch_size  # Σ over c ≠ b, for each b
predicted_error = cross_sum[:, :, None] * weight64  # (B, outputs, inputs)
check(wrong_blocks - true_blocks.float(), predicted_error, "cross-term formula", 1e-4)
assert (slopes > 0).all()
print("the trick's error equals the sum of the cross-sample terms")

# %%
# ``vmap`` does not give the true blocks either, and it does not complain. Under ``vmap`` the
# function sees one sample of shape (31,), so ``batch.mean(dim=0)`` averages that sample's 31
# *features*: a different function, which centres each input vector on its own mean. The
# result has the right shape and is wrong. Its Jacobian is exactly the Jacobian of
# feature-centring, which we check against a float64 version written out that way.
vmap_centred = vmap(jacrev(centred_layer, argnums=2), in_dims=(None, None, 0))(
    weight, bias, inputs
)


def feature_centred_layer(weight, bias, x):
    return layer(weight, bias, x - x.mean())


feature_centred_reference = vmap(
    jacrev(feature_centred_layer, argnums=2), in_dims=(None, None, 0)
)(weight64, bias64, inputs64)
check(vmap_centred, feature_centred_reference, "vmap on the batch-coupled function")
vmap_error = relative_error(vmap_centred, true_blocks)
print(f"vmap(jacrev) on the batch-coupled function: relative error {vmap_error:.2f}")
assert vmap_error > 0.1

# %%
# The lesson: inside ``vmap``, a reduction over "dimension 0" means something else, silently.
# A function that couples samples has no per-sample Jacobian that a per-sample transform can
# see; take the diagonal blocks of the full Jacobian, as above.

# %%
# Batch Hessians
# --------------
# The same pattern gives one Hessian per sample: ``vmap(hessian(...))``. Each sample's Hessian of
# its 33 outputs with respect to its 31 inputs has shape (33, 31, 31), so the batch is
# (64, 33, 31, 31). The exact per-sample Hessian, ``−2 f_i (1 − f_i²) W_ik W_il``, computed in
# float64 from the start, is the reference.
batch_hessian = vmap(hessian(layer, argnums=2), in_dims=(None, None, 0))
vmap_hessians = batch_hessian(weight, bias, inputs)
reference_hessians = torch.einsum(
    "bi,ik,il->bikl", -2 * outputs64 * (1 - outputs64**2), weight64, weight64
)
hessian_error = check(vmap_hessians, reference_hessians, "vmap(hessian)")
print(
    f"vmap(hessian): {tuple(vmap_hessians.shape)}, relative error {hessian_error:.1e}"
)

# %%
# Timing: ``vmap``, the trick and a loop
# --------------------------------------
# The loop calls ``jacrev`` (or ``hessian``) once per sample and stacks the results; it is the
# natural code before ``vmap``. Both loops are checked against the references first. All
# timings are medians from :mod:`torch.utils.benchmark` in this run.


def loop_jacobians(weight, bias, inputs):
    return torch.stack([jacrev(layer, argnums=2)(weight, bias, x) for x in inputs])


def loop_hessians(weight, bias, inputs):
    return torch.stack([hessian(layer, argnums=2)(weight, bias, x) for x in inputs])


check(loop_jacobians(weight, bias, inputs), reference_jacobians, "loop of jacrev")
check(loop_hessians(weight, bias, inputs), reference_hessians, "loop of hessian")

jacobian_times_ms = median_times_ms(
    {
        "loop": lambda: loop_jacobians(weight, bias, inputs),
        "sum trick": lambda: sum_trick_jacobians(layer, weight, bias, inputs),
        "vmap": lambda: batch_jacobian(weight, bias, inputs),
    }
)
hessian_times_ms = median_times_ms(
    {
        "loop": lambda: loop_hessians(weight, bias, inputs),
        "vmap": lambda: batch_hessian(weight, bias, inputs),
    }
)
names = {"loop": "Python loop", "sum trick": "sum trick", "vmap": "vmap"}
for what, times in [("Jacobians", jacobian_times_ms), ("Hessians", hessian_times_ms)]:
    for method, ms in times.items():
        speedup = f"  ({times['loop'] / ms:.2f}x faster than the loop)"
        print(
            f"{what:9s} {names[method]:11s} {ms:7.2f} ms{speedup if method != 'loop' else ''}"
        )

# %%
# The time axis is logarithmic, so that a bar ten times shorter is clearly visible. The colours
# are the site's: the same method has the same colour on every page.
fig, (ax_jac, ax_hess) = plt.subplots(1, 2, figsize=(8, 3), layout="constrained")
for ax, times, title in [
    (ax_jac, jacobian_times_ms, f"{batch_size} Jacobians (33 × 31)"),
    (ax_hess, hessian_times_ms, f"{batch_size} Hessians (33 × 31 × 31)"),
]:
    bars = ax.bar(
        [names[m] for m in times],
        list(times.values()),
        color=[METHOD_COLORS[m] for m in times],
    )
    ax.bar_label(bars, labels=[f"{ms:.2f}" for ms in times.values()], padding=2)
    ax.set_yscale("log")
    ax.set_ylim(min(times.values()) / 2, max(times.values()) * 3)
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
# * The sum-over-batch trick is exact when the cross-sample terms sum to zero, which holds when
#   each output depends on its own sample alone. When samples interact, as through batch
#   statistics, it returns a plausible tensor that is wrong.
# * Inside ``vmap``, a reduction over dimension 0 reduces over the sample's own first axis. It
#   raises no error; check such functions against the full Jacobian.
