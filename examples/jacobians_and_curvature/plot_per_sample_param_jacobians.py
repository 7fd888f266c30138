"""
Per-sample Jacobians with respect to the parameters
===================================================

A question that comes up again and again: *for a network with P parameters and Y outputs, how
do I get the derivative of every output of every sample with respect to every parameter?* The
answer is a (B, Y, P) tensor, one Y × P Jacobian per sample. It is the building block of the
empirical neural tangent kernel, of Gauss-Newton curvature, and of Fisher-information
estimates. This page computes it with a double loop, with ``vmap(jacrev(...))`` and with
``jacfwd``, checks them parameter by parameter, measures the time *and the memory* of each, and
shows why forward mode is so slow here, how ``chunk_size`` bounds the memory, and where the
full tensor stops fitting.
"""

# %%
# Where this page ran
# -------------------
# We print the hardware, because the timings depend on it, pick the GPU when there is one, and
# seed the generator.
import ctypes
import gc
import os
import platform
import re
import statistics
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, jacfwd, jacrev, vmap
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
# Forward mode below allocates gigabytes per call. On a CPU, glibc's ``malloc`` by default
# returns such blocks to the kernel when they are freed, and decides when to do so from the
# process's history, so the same call can be fast or slow depending on what ran before. We ask
# glibc (through ``mallopt``) to keep freed memory for reuse, which makes the timings
# reproducible; the per-sample-gradients page measures what fresh pages cost. Without glibc
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
# Checks in float64, timings, and peak memory
# -------------------------------------------
# Results are compared with a float64 reference by relative error, parameter by parameter.
# Matrix products run in full float32 precision (no TF32 on GPUs, set explicitly), so a bound of
# 1e-5 leaves room for float32 rounding while catching any misplaced entry.
#
# Memory matters as much as time on this page, so we measure each method's peak. On a GPU,
# PyTorch's allocator can record every allocation of one call, and the highest point of live
# memory in that record is the peak. On a CPU there is no such counter, so we ask the kernel:
# Linux keeps each process's peak resident memory (``VmHWM`` in ``/proc/self/status``) and lets
# the process reset it. For one call we switch glibc to return freed memory at once, so that
# resident memory follows the live tensors; we reset the peak, run the call, and read how far
# resident memory rose above where it started. On other systems the page skips these numbers.
torch.set_float32_matmul_precision("highest")
M_MMAP_THRESHOLD = -3  # from glibc's <malloc.h>, like the two above


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


def cuda_peak_bytes(fn):
    """Peak of live CUDA memory during fn(), above where it started, from the allocator's
    record of this call (the global peak counters are left alone)."""
    torch.cuda.synchronize()
    # Record allocations and frees only (no stack traces), starting from an empty history.
    torch.cuda.memory._record_memory_history(
        context=None, clear_history=True, max_entries=1_000_000
    )
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live = peak = 0
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live += event["size"]
            peak = max(peak, live)
        elif event["action"] == "free_completed":
            live -= event["size"]
    return peak


def cpu_peak_bytes(fn):
    """Rise of the process's resident memory during fn(), or None where Linux cannot say."""
    status, clear_refs = Path("/proc/self/status"), Path("/proc/self/clear_refs")
    if not (keep_freed_memory() and status.exists()):
        return None

    def resident(field):
        return (
            int(re.search(rf"{field}:\s+(\d+) kB", status.read_text()).group(1)) << 10
        )

    libc = ctypes.CDLL(None)
    libc.mallopt(
        M_MMAP_MAX, 65536
    )  # glibc's defaults, held fixed: freed memory goes back
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    libc.malloc_trim(0)
    try:
        clear_refs.write_text("5")  # reset the peak to the current resident size
        start = resident("VmRSS")
        fn()
        return resident("VmHWM") - start
    except OSError:
        return None
    finally:
        keep_freed_memory()


def peak_mib(fn):
    # Garbage from earlier cells, if collected during the call, would hide part of its peak.
    gc.collect()
    peak = cuda_peak_bytes(fn) if device.type == "cuda" else cpu_peak_bytes(fn)
    return None if peak is None else peak / 2**20


# %%
# The model
# ---------
# An MLP for flattened 28×28 images: 784 → 20 → 10 with a ReLU. Small, but with
# P = 784·20 + 20 + 20·10 + 10 parameters against Y = 10 outputs, it has the shape of every
# classifier: far more parameters than outputs.
model = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)).to(device)
param_sizes = {name: p.numel() for name, p in model.named_parameters()}
num_params = sum(param_sizes.values())
num_outputs = 10
print(f"P = {num_params:,} parameters, Y = {num_outputs} outputs")

# %%
# The naive double loop
# ---------------------
# One backward pass per sample *and* per output: ``autograd.grad`` of the scalar
# ``outputs[b, y]`` gives one row of the answer for every parameter. That is B·Y backward
# passes. We keep one ``(B, Y, *shape)`` tensor per parameter, so that every parameter can be
# checked on its own.


def loop_param_jacobians(net, inputs):
    names, weights = zip(*net.named_parameters())
    outputs = net(inputs)
    rows = [
        torch.autograd.grad(outputs[b, y], weights, retain_graph=True)
        for b in range(outputs.shape[0])
        for y in range(outputs.shape[1])
    ]
    return {
        name: torch.stack([row[i] for row in rows]).reshape(
            *outputs.shape, *weights[i].shape
        )
        for i, name in enumerate(names)
    }


inputs = torch.randn(2, 784, device=device)
loop_jacobians = loop_param_jacobians(model, inputs)
print("double loop, first layer's weight:", tuple(loop_jacobians["0.weight"].shape))

# %%
# ``vmap(jacrev(...))`` over ``functional_call``
# ----------------------------------------------
# As with per-sample gradients, we write the model's output for **one** sample as a pure
# function of a parameter dictionary, using :func:`~torch.func.functional_call`.
# :func:`~torch.func.jacrev` differentiates it with respect to that dictionary, returning one
# Jacobian of shape ``(Y, *param.shape)`` per parameter, and :func:`~torch.func.vmap` maps it
# over the batch. Flattening each parameter's trailing axes and concatenating gives the
# (B, Y, P) tensor, with the parameters in the order of ``model.named_parameters()``.
params = {name: p.detach() for name, p in model.named_parameters()}


def sample_output(params, x):
    return functional_call(model, params, (x.unsqueeze(0),)).squeeze(0)


def flatten_params(jacobians):
    """Dict of (B, Y, *param.shape) tensors -> one (B, Y, P) tensor."""
    return torch.cat([j.flatten(start_dim=2) for j in jacobians.values()], dim=2)


jacrev_fn = vmap(jacrev(sample_output), in_dims=(None, 0))
jacfwd_fn = vmap(jacfwd(sample_output), in_dims=(None, 0))
vmap_jacobians = jacrev_fn(params, inputs)
print("vmap(jacrev), flattened:", tuple(flatten_params(vmap_jacobians).shape))

# %%
# Checking each parameter against a float64 loop
# ----------------------------------------------
# ReLU networks are piecewise linear, and in float64 no activation sits close enough to zero to
# flip, so the loop and both transforms must agree up to float32 rounding. Each parameter's
# Jacobian is compared on its own with the float64 loop.
model64 = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)).to(
    device, torch.float64
)
model64.load_state_dict(model.state_dict())
reference = loop_param_jacobians(model64, inputs.double())


def check_each_parameter(jacobians, reference, what, bound=1e-5):
    errors = {}
    for name, ref in reference.items():
        assert jacobians[name].shape == ref.shape, (what, name)
        errors[name] = ((jacobians[name].double() - ref).norm() / ref.norm()).item()
        assert errors[name] < bound, (
            f"{what}: {name} has relative error {errors[name]:.2e}"
        )
    worst = max(errors, key=errors.get)
    print(f"{what:13s} worst parameter {worst}: relative error {errors[worst]:.1e}")


check_each_parameter(loop_jacobians, reference, "loop")
check_each_parameter(vmap_jacobians, reference, "vmap(jacrev)")
check_each_parameter(jacfwd_fn(params, inputs), reference, "vmap(jacfwd)")

# %%
# ``jacrev`` or ``jacfwd``?
# -------------------------
# Reverse mode needs one backward pass per **output** (Y per sample); forward mode needs one
# forward pass per **parameter** (P per sample). Both are vectorised, and the Jacobian here is
# very wide (Y ≪ P), the case where reverse mode wins.
times_b2_ms = median_times_ms(
    {
        "loop": lambda: loop_param_jacobians(model, inputs),
        "jacfwd": lambda: jacfwd_fn(params, inputs),
        "jacrev": lambda: jacrev_fn(params, inputs),
    },
    rounds=5,  # vmap(jacfwd) takes about half a second a call on a small CPU
)
labels = {"loop": "double loop", "jacfwd": "vmap(jacfwd)", "jacrev": "vmap(jacrev)"}
for method, ms in times_b2_ms.items():
    print(f"B=2  {labels[method]:13s} {ms:9.2f} ms")
print(
    f"vmap(jacrev) is {times_b2_ms['loop'] / times_b2_ms['jacrev']:.2f}x faster than the "
    f"loop and {times_b2_ms['jacfwd'] / times_b2_ms['jacrev']:.2f}x faster than vmap(jacfwd)"
)

# %%
# Why forward mode costs so much here: memory, not arithmetic
# -----------------------------------------------------------
# It is tempting to blame forward mode's extra arithmetic. Count it: each of the P tangents
# costs about one forward pass, about P multiply-adds (2·P operations) for this MLP, so one
# sample costs about 2·P² operations. Compare the rate that makes with what this machine's
# matrix products achieve: forward mode runs far below it.
flops_per_sample = 2 * num_params**2
square = torch.randn(1024, 1024, device=device)
matmul_ms = median_times_ms({"matmul": lambda: square @ square})["matmul"]
matmul_gflops = 2 * 1024**3 / matmul_ms / 1e6
jacfwd_gflops = 2 * flops_per_sample / times_b2_ms["jacfwd"] / 1e6
print(
    f"vmap(jacfwd) at B=2: about {2 * flops_per_sample / 1e9:.1f} GFLOP in "
    f"{times_b2_ms['jacfwd']:.0f} ms = {jacfwd_gflops:.1f} GFLOP/s; a 1024² matrix "
    f"product runs at {matmul_gflops:.0f} GFLOP/s here"
)
assert jacfwd_gflops < matmul_gflops / 10, (
    "forward mode is not far below the matrix rate"
)

# %%
# What forward mode does pay for is memory. Its tangents are the P × P identity over all
# parameters, one basis vector per parameter, and every intermediate activation carries all P
# of them. So each sample needs about P² floats, ``4·P²`` bytes, far more than the (Y, P)
# Jacobian it produces. We measure the peak memory of ``vmap(jacfwd)`` for batches of 2 and 3
# samples: the difference is what one more sample costs. Writing and reading those gigabytes,
# not the multiply-adds, is where its time goes.
identity_mib = 4 * num_params**2 / 2**20
jacfwd_batches = [2, 3]
jacfwd_inputs = [inputs, torch.randn(3, 784, device=device)]
jacfwd_peaks = [peak_mib(partial(jacfwd_fn, params, x)) for x in jacfwd_inputs]
if None in jacfwd_peaks:
    print("peak memory is not measured on this system")
else:
    for batch, peak in zip(jacfwd_batches, jacfwd_peaks):
        print(f"vmap(jacfwd), B={batch}: peak {peak:,.0f} MiB")
    mib_per_sample = jacfwd_peaks[1] - jacfwd_peaks[0]
    print(
        f"the extra sample adds {mib_per_sample:,.0f} MiB of peak memory: "
        f"{mib_per_sample / identity_mib:.2f}x the P × P identity ({identity_mib:,.0f} MiB)"
    )
    assert mib_per_sample > 0.9 * identity_mib, "forward mode should hold P² per sample"

# %%
# ``chunk_size`` bounds that memory. ``vmap(..., chunk_size=1)`` runs the samples one at a
# time, so only one sample's tangents are alive at once; the result is the same.
chunked_jacfwd_fn = vmap(jacfwd(sample_output), in_dims=(None, 0), chunk_size=1)
batch_inputs = jacfwd_inputs[-1]
batch = len(batch_inputs)
unchunked = jacfwd_fn(params, batch_inputs)
for name, jacobian in chunked_jacfwd_fn(params, batch_inputs).items():
    torch.testing.assert_close(jacobian, unchunked[name])
del unchunked
chunked_peak = peak_mib(partial(chunked_jacfwd_fn, params, batch_inputs))
if chunked_peak is not None:
    print(
        f"B={batch}, chunk_size=1: peak {chunked_peak:,.0f} MiB "
        f"({chunked_peak / jacfwd_peaks[-1]:.2f}x the peak without chunks)"
    )
    assert chunked_peak < 0.6 * jacfwd_peaks[-1]

# %%
# The figure shows the measured peaks against what the P × P identity alone would take.
if None not in jacfwd_peaks:
    fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
    ax.plot(
        jacfwd_batches,
        jacfwd_peaks,
        "o-",
        color=METHOD_COLORS["jacfwd"],
        label="vmap(jacfwd), measured peak",
    )
    ax.plot(
        [0, *jacfwd_batches],
        [0, *(identity_mib * b for b in jacfwd_batches)],
        "--",
        color="black",
        label="B × the P × P identity",
    )
    if chunked_peak is not None:
        ax.plot(
            [batch],
            [chunked_peak],
            "s",
            color="black",
            label=f"chunk_size=1, B={batch}",
        )
    ax.set_xlim(0, jacfwd_batches[-1] + 0.5)
    ax.set_ylim(0, max(jacfwd_peaks) * 1.2)
    ax.set_xticks([0, *jacfwd_batches])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"Forward mode's memory, P = {num_params:,} ({device.type.upper()})")
    ax.legend(fontsize="small", loc="upper left")
    plt.show()

# %%
# Scaling the batch
# -----------------
# The loop's cost grows with B·Y backward passes, each too small to keep the hardware busy;
# ``vmap(jacrev)`` grows with B too, but in one batched call. We time both over a range of batch
# sizes (a GPU gets larger batches) and check the largest batch against the loop, parameter by
# parameter.
batch_sizes = [2, 8, 32, 128] if device.type == "cpu" else [2, 8, 32, 128, 512]
loop_ms, vmap_ms = [], []
for batch_size in batch_sizes:
    batch = torch.randn(batch_size, 784, device=device)
    times = median_times_ms(
        {
            "loop": partial(loop_param_jacobians, model, batch),
            "vmap": partial(jacrev_fn, params, batch),
        },
        rounds=5,
    )
    loop_ms.append(times["loop"])
    vmap_ms.append(times["vmap"])
    print(
        f"B={batch_size:4d}: loop {loop_ms[-1]:8.2f} ms, vmap(jacrev) {vmap_ms[-1]:7.2f} ms "
        f"-> {loop_ms[-1] / vmap_ms[-1]:.2f}x faster"
    )
batch64 = loop_param_jacobians(model64, batch.double())
check_each_parameter(jacrev_fn(params, batch), batch64, f"B={batch_size}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
ax.loglog(
    batch_sizes,
    loop_ms,
    "o-",
    color=METHOD_COLORS["loop"],
    label="double loop (B·Y backward passes)",
)
ax.loglog(batch_sizes, vmap_ms, "s-", color=METHOD_COLORS["vmap"], label="vmap(jacrev)")
ax.set_xlabel("batch size B")
ax.set_ylabel("median time (ms)")
ax.set_title(
    f"(B, {num_outputs}, {num_params:,}) parameter Jacobians on {device.type.upper()}: "
    f"{loop_ms[-1] / vmap_ms[-1]:.0f}x faster at B={batch_sizes[-1]}"
)
ax.legend()
plt.show()

# %%
# How much memory does the result take?
# -------------------------------------
# The result alone holds B·Y·P numbers, 4·Y·P bytes per sample in float32. We measure the peak
# of ``vmap(jacrev)`` on the largest batch above: it cannot be below the result's own size.
result_mib = 4 * batch_size * num_outputs * num_params / 2**20
jacrev_peak = peak_mib(partial(jacrev_fn, params, batch))
if jacrev_peak is not None:
    print(
        f"B={batch_size}: result {result_mib:,.1f} MiB, measured peak of vmap(jacrev) "
        f"{jacrev_peak:,.1f} MiB ({jacrev_peak / result_mib:.2f}x the result)"
    )
    assert jacrev_peak >= 0.95 * result_mib

# %%
# The result grows with all three factors, and P is the one that explodes. Here is the same
# count for this MLP and for two well-known image classifiers (ResNet-18, 11.7 M parameters,
# and ResNet-50, 25.6 M, each with 1,000 outputs), against the memory of the device this page
# ran on.
if device.type == "cuda":
    device_bytes = torch.cuda.get_device_properties(device).total_memory
else:
    device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
per_sample_bytes = {
    f"this MLP (Y={num_outputs}, P={num_params:,})": 4 * num_outputs * num_params,
    "ResNet-18 (Y=1000, P=11.7M)": 4 * 1000 * 11_689_512,
    "ResNet-50 (Y=1000, P=25.6M)": 4 * 1000 * 25_557_032,
}
print(f"this {device.type.upper()} has {device_bytes / 2**30:.0f} GiB")
for name, size in per_sample_bytes.items():
    fits = device_bytes // size
    plural = "samples fit" if fits > 1 else "sample fits"
    verdict = f"at most {fits:,} {plural}" if fits else "not even one sample fits"
    print(f"{name:32s} {size / 2**20:12,.2f} MiB per sample: {verdict}")

# %%
# The building block of the neural tangent kernel
# -----------------------------------------------
# The empirical neural tangent kernel between two samples is the Y × Y matrix
# ``J(x_a) J(x_b)ᵀ``: how much a gradient step on one sample moves the outputs of the
# other. At this model's size the (B, Y, P) tensor fits easily (the printout above gives its
# size), so we build it and contract it with one ``einsum``. For a model whose tensor does not
# fit, the same contraction runs over chunks of samples, or through Jacobian-vector products
# without forming J at all.
#
# The check is independent of ``vmap``: every block of the kernel is compared with the product
# of two Jacobians from the float64 double loop.
flat_jacobians = flatten_params(vmap_jacobians)
ntk = torch.einsum("ayp,bzp->abyz", flat_jacobians, flat_jacobians)
print("empirical NTK for the 2-sample batch:", tuple(ntk.shape))
reference_flat = flatten_params(reference)
for a in range(2):
    for b in range(2):
        block64 = reference_flat[a] @ reference_flat[b].T
        error = ((ntk[a, b].double() - block64).norm() / block64.norm()).item()
        assert error < 1e-5, f"NTK block ({a}, {b}): relative error {error:.2e}"
print("every NTK block matches the float64 loop's J(x_a) J(x_b)ᵀ")
