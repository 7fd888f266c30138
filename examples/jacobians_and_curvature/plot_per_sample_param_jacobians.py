"""
Per-sample Jacobians with respect to the parameters
===================================================

For a network with P parameters and Y outputs, the derivative of every output of every sample
with respect to every parameter is a (B, Y, P) tensor: one Y × P Jacobian per sample. It is the
building block of the empirical neural tangent kernel, of Gauss-Newton curvature and of
Fisher-information estimates. This page computes it with ``vmap(jacrev(...))`` over
``functional_call``, checks it parameter by parameter against a float64 loop, builds the NTK
from it, and then counts the extra work ``jacfwd`` does here, measures its memory, and shows
how ``chunk_size`` bounds it.
"""

# %%
# Setup
# -----
import copy
import ctypes
import gc
import json
import os
import platform
import tempfile

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, jacfwd, jacrev, vmap
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# A classifier and two samples
# ----------------------------
# An MLP for flattened 28×28 images, 784 → 10 → 10 with a ReLU. Like every classifier it has
# far more parameters than outputs (P ≫ Y), and that shape decides which transform to use.
model = nn.Sequential(nn.Linear(784, 10), nn.ReLU(), nn.Linear(10, 10)).to(device)
params = {name: p.detach() for name, p in model.named_parameters()}
num_params = sum(p.numel() for p in params.values())
num_outputs = 10
inputs = torch.randn(2, 784, device=device)
print(f"P = {num_params:,} parameters, Y = {num_outputs} outputs, B = {len(inputs)}")

# %%
# The recipe: ``vmap(jacrev(...))`` over ``functional_call``
# ----------------------------------------------------------
# Write the model's output for **one** sample as a pure function of a parameter dictionary
# with :func:`~torch.func.functional_call`. :func:`~torch.func.jacrev` differentiates it with
# respect to that dictionary, building the Jacobian row by row, one vector-Jacobian product
# per output (Y of them). :func:`~torch.func.vmap` maps it over the batch: the result equals
# stacking the Jacobians of ``x_i`` over ``inputs.unbind(0)``. You get one ``(B, Y, *shape)``
# tensor per parameter; flattening and concatenating them gives the (B, Y, P) tensor.


def sample_output(params, x):
    """The model's Y outputs for ONE sample, as a function of the parameters."""
    return functional_call(model, params, (x.unsqueeze(0),)).squeeze(0)


param_jacobians = vmap(jacrev(sample_output), in_dims=(None, 0))
jacobians = param_jacobians(params, inputs)
flat_jacobians = torch.cat([j.flatten(start_dim=2) for j in jacobians.values()], dim=2)
print({name: tuple(j.shape) for name, j in jacobians.items()})
print("flattened:", tuple(flat_jacobians.shape))

# %%
# Checked against a float64 double loop
# -------------------------------------
# The reference is the naive way: one ``autograd.grad`` of the scalar ``outputs[b, y]`` per
# sample *and* per output, on a float64 copy of the model. Each parameter's Jacobian is
# compared on its own, so a wrong small tensor (a bias) cannot hide behind a large one.
model64 = copy.deepcopy(model).double()


def loop_jacobians(net, batch):
    """{name: (B, Y, *shape)} from B·Y backward passes."""
    names, weights = zip(*net.named_parameters())
    outputs = net(batch)
    rows = [
        torch.autograd.grad(outputs[b, y], weights, retain_graph=True)
        for b in range(outputs.shape[0])
        for y in range(outputs.shape[1])
    ]
    return {
        name: torch.stack([row[i] for row in rows]).reshape(*outputs.shape, *w.shape)
        for i, (name, w) in enumerate(zip(names, weights))
    }


def check_each_parameter(result, reference, what):
    errors = {}
    for name, ref in reference.items():
        assert result[name].shape == ref.shape, (what, name)
        errors[name] = ((result[name].double() - ref).norm() / ref.norm()).item()
        assert errors[name] < 1e-5, f"{what}: {name}: error {errors[name]:.1e}"
    worst = max(errors, key=errors.get)
    print(f"{what}: worst parameter {worst}, relative error {errors[worst]:.1e}")


reference = loop_jacobians(model64, inputs.double())
check_each_parameter(jacobians, reference, "vmap(jacrev)")

# %%
# ``jacfwd`` gives the same answer, column by column
# --------------------------------------------------
# :func:`~torch.func.jacfwd` builds the same Jacobian column by column: one Jacobian-vector
# product per **parameter**, P of them, each pushing one basis vector of parameter space
# through the network. Same answer, far more arithmetic, as the second half of this page
# counts.
forward_jacobians = vmap(jacfwd(sample_output), in_dims=(None, 0))
check_each_parameter(forward_jacobians(params, inputs), reference, "vmap(jacfwd)")

# %%
# The building block of the neural tangent kernel
# -----------------------------------------------
# The empirical NTK between two samples is the Y × Y matrix ``J(x_a) J(x_b)ᵀ``: how much a
# gradient step on one sample moves the outputs of the other. With the (B, Y, P) tensor in
# hand it is one ``einsum``. Each block is checked against the product of two Jacobians from
# the float64 loop, which shares no code with ``vmap``.
ntk = torch.einsum("ayp,bzp->abyz", flat_jacobians, flat_jacobians)
flat_reference = torch.cat([j.flatten(start_dim=2) for j in reference.values()], dim=2)
ntk_errors = []
for a in range(len(inputs)):
    for b in range(len(inputs)):
        block64 = flat_reference[a] @ flat_reference[b].T
        error = ((ntk[a, b].double() - block64).norm() / block64.norm()).item()
        ntk_errors.append(error)
        assert error < 1e-5, f"NTK block ({a}, {b}): error {error:.1e}"
print(f"NTK {tuple(ntk.shape)}: every block matches the float64 loop's J(x_a) J(x_b)ᵀ")
print(f"largest relative error of a block: {max(ntk_errors):.1e}")

# %%
# How fast is it?
# ---------------
# Forward mode allocates hundreds of MiB per call. On a CPU they come from glibc's ``malloc``,
# so before timing we ask glibc to keep freed memory for reuse; :doc:`/reading-timings`
# explains the allocator's share of the spread it removes (a busy machine's share remains). On
# a GPU, PyTorch's caching allocator keeps freed blocks for reuse.
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: serve large blocks from the heap
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: never hand freed memory back


def measure(fn, *args, min_blocks=5):
    """blocked_autorange of fn(*args), with at least min_blocks blocks for a spread."""
    threads = torch.get_num_threads()
    timer = benchmark.Timer(
        "fn(*args)", globals={"fn": fn, "args": args}, num_threads=threads
    )
    m = timer.blocked_autorange(min_run_time=0.3)
    extra = [timer.timeit(1) for _ in range(min_blocks - len(m.times))]  # slow calls
    return benchmark.Measurement.merge([m, *extra])[0]


def timing(m):
    return f"{m.median * 1e3:8.1f} ms (IQR {m.iqr * 1e3:.3g} ms, {len(m.times)} blocks)"


def versus(m, base, name):
    """How m compares with base, worded by the ratio."""
    if m.median <= base.median:
        return f"is {base.median / m.median:.2f}x faster than {name}"
    return f"takes {m.median / base.median:.2f}x the time of {name}"


b2_times = {
    "loop": measure(loop_jacobians, model, inputs),
    "jacrev": measure(param_jacobians, params, inputs),
    "jacfwd": measure(forward_jacobians, params, inputs),
}
for method, m in b2_times.items():
    print(f"B=2 {method:7s} {timing(m)}")
print(
    f"vmap(jacrev) {versus(b2_times['jacrev'], b2_times['loop'], 'the loop')} and "
    f"{versus(b2_times['jacrev'], b2_times['jacfwd'], 'vmap(jacfwd)')}"
)

# %%
# The loop and ``vmap(jacrev)`` do not do the same work. Each of the loop's B·Y backward passes
# differentiates one scalar ``outputs[b, y]`` through the whole batch: the weight gradients
# multiply its cotangent, zero except in row ``b``, by all B rows of each layer's input. So the
# loop's arithmetic should grow as B²·Y, and ``vmap(jacrev)``'s, one sample at a time, as B·Y.
# ``torch.utils.flop_counter.FlopCounterMode`` counts the matrix-product FLOPs of both at each
# batch size, after a check on a known answer: the model's forward pass on B samples,
# ``2·B·(784·10 + 10·10)``. The largest batch is checked against the float64 loop as well.


def count_flops(fn, *args):
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


assert count_flops(model, inputs) == 2 * len(inputs) * (784 * 10 + 10 * 10)
batch_sizes = [2, 16, 128]
loop_ms, jacrev_ms, extra_work = [], [], []
for batch_size in batch_sizes:
    batch = torch.randn(batch_size, 784, device=device)
    extra_work.append(
        count_flops(loop_jacobians, model, batch)
        / count_flops(param_jacobians, params, batch)
    )
    loop_time = measure(loop_jacobians, model, batch)
    jacrev_time = measure(param_jacobians, params, batch)
    loop_ms.append(loop_time.median * 1e3)
    jacrev_ms.append(jacrev_time.median * 1e3)
    print(
        f"B={batch_size:3d}: the loop does {extra_work[-1]:5.1f}x the FLOPs; "
        f"loop {timing(loop_time)}, vmap(jacrev) {timing(jacrev_time)}: "
        f"vmap(jacrev) {versus(jacrev_time, loop_time, 'the loop')}"
    )
# The FLOP ratio grows in proportion to B (each batch is eight times the last), within 10%.
for i in range(1, len(batch_sizes)):
    growth = extra_work[i] / extra_work[i - 1] / (batch_sizes[i] / batch_sizes[i - 1])
    assert abs(growth - 1) < 0.1, (batch_sizes[i], growth)
check_each_parameter(
    param_jacobians(params, batch),
    loop_jacobians(model64, batch.double()),
    f"B={len(batch)}",
)

METHOD_COLORS = {
    "loop": "#D55E00",
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "vmap chunked": "#44AA99",
}
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
ax.loglog(batch_sizes, loop_ms, "o-", color=METHOD_COLORS["loop"], label="loop")
ax.loglog(
    batch_sizes, jacrev_ms, "s-", color=METHOD_COLORS["jacrev"], label="jacrev (vmap)"
)
ax.set_xlabel("batch size B")
ax.set_ylabel("median time (ms)")
ax.set_title(f"(B, {num_outputs}, {num_params:,}) parameter Jacobians, {device.type}")
ax.legend()
plt.show()

# %%
# Forward mode does more work: count the arithmetic
# -------------------------------------------------
# Reverse mode runs Y backward passes per sample, forward mode P Jacobian-vector products, each
# about the cost of one forward pass, so the ratio of their counted FLOPs should be near P / Y.
# The time ratio is printed beside it, with the rate each call reaches (FLOPs over its median
# time): where the two ratios differ, arithmetic is not all that sets the time. On a GPU at
# this size both calls can take about the same time; the cost then shows as memory, which the
# next section measures, with one large item: a copy of hundreds of MiB per call.
flops = {
    "jacrev": count_flops(param_jacobians, params, inputs),
    "jacfwd": count_flops(forward_jacobians, params, inputs),
}
flop_ratio = flops["jacfwd"] / flops["jacrev"]
time_ratio = b2_times["jacfwd"].median / b2_times["jacrev"].median
for name in flops:
    rate = flops[name] / b2_times[name].median / 1e9
    print(f"B=2: {name} {flops[name]:,} FLOPs, {rate:.3g} GFLOP/s at its median time")
print(
    f"jacfwd / jacrev: {flop_ratio:.0f} times the FLOPs (P / Y = "
    f"{num_params / num_outputs:.0f}); jacfwd "
    f"{versus(b2_times['jacfwd'], b2_times['jacrev'], 'jacrev')}: the time ratio is "
    f"{'smaller' if time_ratio < flop_ratio else 'larger'}"
)
assert 0.8 < flop_ratio / (num_params / num_outputs) < 1.1

# %%
# What forward mode costs in memory
# ---------------------------------
# ``jacfwd`` pushes the P × P identity through the network: every parameter's basis vectors,
# ``4·P²`` bytes in float32. The peak of live memory above the start of each call comes, on a
# CPU, from :mod:`torch.profiler`, which records every allocation, and on a GPU from the
# caching allocator's statistics of requested bytes; on both, the profiler gives how many bytes
# each operator allocated, per input shape. We measure ``vmap(jacfwd)`` for B = 1, 2 and 3,
# a Python loop of ``jacfwd`` over 3 samples, and ``vmap(..., chunk_size=1)`` on the same 3.
MiB = 2**20
basis_mib = 4 * num_params**2 / MiB
weight_block_mib = 4 * num_params * params["0.weight"].numel() / MiB


def peak_mib(fn, *args):
    """Peak of live memory during fn(*args), above where it started."""
    gc.collect()
    if device.type == "cuda":  # the caching allocator's peak of requested bytes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()["requested_bytes.all.current"]
        fn(*args)
        torch.cuda.synchronize()
        return (torch.cuda.memory_stats()["requested_bytes.all.peak"] - before) / MiB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    records = sorted(
        (e for e in events if e["name"] == "[memory]"), key=lambda e: e["ts"]
    )
    # The counter does not start at zero: subtract its value before the first record.
    start = records[0]["args"]["Total Allocated"] - records[0]["args"]["Bytes"]
    return (max(r["args"]["Total Allocated"] for r in records) - start) / MiB


def largest_copy(fn, *args):
    """(MiB, input shape, share of the time on a CPU) of the largest ``aten::clone``."""
    gpu = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    activities = [ProfilerActivity.CPU, *gpu]
    with profile(
        activities=activities, profile_memory=True, record_shapes=True
    ) as prof:
        fn(*args)
    by_shape = prof.key_averages(group_by_input_shape=True)
    field = "device_memory_usage" if device.type == "cuda" else "cpu_memory_usage"
    clones = [e for e in by_shape if e.key == "aten::clone"]
    top = max(clones, key=lambda e: getattr(e, field))
    share = top.cpu_time_total / sum(e.self_cpu_time_total for e in by_shape)
    return getattr(top, field) / MiB, top.input_shapes[0], share


samples3 = torch.randn(3, 784, device=device)
chunked_jacobians = vmap(jacfwd(sample_output), in_dims=(None, 0), chunk_size=1)
peaks = {b: peak_mib(forward_jacobians, params, samples3[:b]) for b in (1, 2, 3)}
loop_peak = peak_mib(lambda: [jacfwd(sample_output)(params, x) for x in samples3])
chunked_peak = peak_mib(chunked_jacobians, params, samples3)
copies = {b: largest_copy(forward_jacobians, params, samples3[:b]) for b in (2, 3)}
print(
    f"the P × P basis: {basis_mib:,.0f} MiB; the first weight's block of it: "
    f"{weight_block_mib:,.0f} MiB"
)
for b, peak in peaks.items():
    print(
        f"vmap(jacfwd), B={b}: peak {peak:6,.0f} MiB ({peak / basis_mib:.2f}x the basis)"
    )
print(f"loop of jacfwd, B=3: peak {loop_peak:6,.0f} MiB ({loop_peak / basis_mib:.2f}x)")
print(
    f"chunk_size=1,   B=3: peak {chunked_peak:6,.0f} MiB ({chunked_peak / basis_mib:.2f}x)"
)
for b, (copied, shape, share) in copies.items():
    cpu_time = f"; {share:.0%} of the call's CPU time (one profiled call)"
    print(
        f"vmap(jacfwd), B={b}: largest copy {copied:,.0f} MiB, of shape {shape}, "
        f"{copied / weight_block_mib:.2f}x the first weight's block"
        + (cpu_time if device.type == "cpu" else "")
    )

# %%
# One sample needs about one basis, and so does a loop over samples. With two or more samples,
# ``vmap`` also copies the first weight's block of the basis once per sample, B copies in all
# (one sample makes none: its peak is one basis): the largest copy has the shape
# (B, P, 784, 10). The linear layer's Jacobian-vector product multiplies the sample (batched
# over samples) by the weight's tangents (batched over the P basis vectors), and ``matmul``
# expands the tangents over the samples to make one batched product. On a CPU the copy takes
# time as well as memory: its share of one profiled call's CPU time is printed beside it (on a
# GPU the profiler's CPU time is the host's, which launches the copy, so none is printed).
# With ``chunk_size=1``, ``vmap`` runs one sample at a time and its memory is the loop's. The
# chunked result is checked against the float64 loop too.
for b, (copied, _, _) in copies.items():
    assert abs(copied / (b * weight_block_mib) - 1) < 0.01, (b, copied)
for peak in [peaks[1], loop_peak, chunked_peak]:
    assert abs(peak / basis_mib - 1) < 0.05, peak
assert peaks[3] > 3.5 * basis_mib, peaks[3]
check_each_parameter(
    chunked_jacobians(params, samples3),
    loop_jacobians(model64, samples3.double()),
    "chunk_size=1",
)

fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
vmap_peaks = list(peaks.values())
for name, label, sizes, peak_list, marker in [
    ("jacfwd", "jacfwd (vmap)", [1, 2, 3], vmap_peaks, "o-"),
    ("loop", "loop of jacfwd", [3], [loop_peak], "D"),
    ("vmap chunked", "vmap chunked (chunk_size=1)", [3], [chunked_peak], "s"),
]:
    ax.plot(sizes, peak_list, marker, color=METHOD_COLORS[name], label=label)
ax.axhline(basis_mib, color="black", linestyle="--", label="the P × P basis")
ax.set_xticks([1, 2, 3])
ax.set_ylim(0, max(vmap_peaks) * 1.15)
ax.set_xlabel("batch size B")
ax.set_ylabel("peak memory (MiB)")
ax.set_title(f"Forward mode's peak memory, P = {num_params:,}")
ax.legend(fontsize="small", loc="upper left")
plt.show()

# %%
# Reverse mode's memory is its result
# -----------------------------------
# ``jacrev``'s basis is the Y × Y identity of the outputs, so its memory should be the (B, Y, P)
# result plus little else. We measure its peak on the largest batch above against the bytes of
# the result, counted: if it held a P × P basis, or a copy of the result, this would fail.
result_mib = len(batch) * num_outputs * num_params * 4 / MiB
jacrev_peak = peak_mib(param_jacobians, params, batch)
print(
    f"B={len(batch)}: result {result_mib:,.1f} MiB, peak of vmap(jacrev) "
    f"{jacrev_peak:,.1f} MiB ({jacrev_peak / result_mib:.2f}x the result)"
)
assert 0.99 * result_mib < jacrev_peak < 1.25 * result_mib  # the result, little more

# %%
# Where the full tensor stops fitting
# -----------------------------------
# The result holds ``4·Y·P`` bytes per sample in float32, and P is the factor that explodes.
# The same count for two image classifiers with 1,000 outputs (ResNet-18, 11,689,512
# parameters; ResNet-50, 25,557,032), against this device's memory:
device_bytes = (
    torch.cuda.get_device_properties(device).total_memory
    if device.type == "cuda"
    else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
)
per_sample_bytes = {
    f"this MLP (Y={num_outputs}, P={num_params:,})": 4 * num_outputs * num_params,
    "ResNet-18 (Y=1000, P=11.7M)": 4 * 1000 * 11_689_512,
    "ResNet-50 (Y=1000, P=25.6M)": 4 * 1000 * 25_557_032,
}
holder = "this GPU" if device.type == "cuda" else "this machine"
print(f"{holder} has {device_bytes / 2**30:.0f} GiB")
for name, size in per_sample_bytes.items():
    fits = device_bytes // size
    verdict = f"at most {fits:,} samples fit" if fits else "not even one sample fits"
    verdict = "at most 1 sample fits" if fits == 1 else verdict
    print(f"{name:30s} {size / MiB:10,.2f} MiB per sample: {verdict}")


# %%
# For such models, contract J chunk by chunk (``chunk_size`` on ``vmap`` or ``jacrev``), or
# never form it: NTK-vector products with ``vjp`` and ``jvp`` on the page
# :ref:`sphx_glr_auto_examples_models_as_functions_plot_neural_tangent_kernel.py`.

# %%
# What to remember
# ----------------
# * Per-sample parameter Jacobians: ``vmap(jacrev(f), in_dims=(None, 0))`` with ``f`` built
#   on ``functional_call``; check each parameter against a float64 loop.
# * With P ≫ Y use ``jacrev``: ``jacfwd`` does about P / Y times the FLOPs (counted above),
#   which on a GPU at this size need not show in the time; its P × P basis shows in memory.
# * This loop of scalar backward passes through one batched forward does about B times
#   ``vmap(jacrev)``'s arithmetic; a loop that runs each sample's forward alone does not.
# * ``vmap(jacfwd)`` copies the first weight's block of the P × P basis once per sample (for
#   B ≥ 2); ``chunk_size=1`` brings its peak back to one basis, like a loop.
# * ``vmap(jacrev)``'s peak memory is the (B, Y, P) result itself: count ``4·B·Y·P`` bytes
#   before you ask for it.
