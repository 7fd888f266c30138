"""
Per-sample Jacobians with respect to the parameters
===================================================

For a network with P parameters and Y outputs, the derivative of every output of every sample
with respect to every parameter is a (B, Y, P) tensor: one Y × P Jacobian per sample. It is the
building block of the empirical neural tangent kernel, of Gauss-Newton curvature and of
Fisher-information estimates. This page computes it with ``vmap(jacrev(...))`` over
``functional_call``, checks it parameter by parameter against a float64 loop, builds the NTK
from it, and then measures why ``jacfwd`` is the wrong tool here and how ``chunk_size`` bounds
its memory.
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
        assert errors[name] < 1e-5, (
            f"{what}: {name} has relative error {errors[name]:.1e}"
        )
    worst = max(errors, key=errors.get)
    print(f"{what}: worst parameter {worst}, relative error {errors[worst]:.1e}")


reference = loop_jacobians(model64, inputs.double())
check_each_parameter(jacobians, reference, "vmap(jacrev)")

# %%
# ``jacfwd`` gives the same answer, column by column
# --------------------------------------------------
# :func:`~torch.func.jacfwd` builds the same Jacobian column by column: one Jacobian-vector
# product per **parameter**, P of them, each pushing one basis vector of parameter space
# through the network. Same answer, very different cost, as the second half of this page
# measures.
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
        ntk_errors.append(
            ((ntk[a, b].double() - block64).norm() / block64.norm()).item()
        )
        assert ntk_errors[-1] < 1e-5, (
            f"NTK block ({a}, {b}): error {ntk_errors[-1]:.1e}"
        )
print(f"NTK {tuple(ntk.shape)}: every block matches the float64 loop's J(x_a) J(x_b)ᵀ")
print(f"largest relative error of a block: {max(ntk_errors):.1e}")

# %%
# How fast is it?
# ---------------
# Forward mode allocates hundreds of MB per call, so before timing we ask glibc to keep freed
# memory for reuse; :doc:`/reading-timings` explains why that makes CPU timings repeatable.
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: serve large blocks from the heap
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: never hand freed memory back


def measure(fn, *args, min_run_time=0.3):
    """blocked_autorange of fn(*args); its block-size estimate is the warm-up."""
    threads = torch.get_num_threads()
    timer = benchmark.Timer(
        "fn(*args)", globals={"fn": fn, "args": args}, num_threads=threads
    )
    return timer.blocked_autorange(min_run_time=min_run_time)


b2_times = {
    "loop": measure(loop_jacobians, model, inputs),
    "jacrev": measure(param_jacobians, params, inputs),
    "jacfwd": measure(forward_jacobians, params, inputs),
}
for method, m in b2_times.items():
    print(f"B=2 {method:7s} {m.median * 1e3:8.1f} ms (IQR {m.iqr * 1e3:.1f} ms)")
print(
    f"vmap(jacrev) is {b2_times['loop'].median / b2_times['jacrev'].median:.2f}x faster "
    f"than the loop and {b2_times['jacfwd'].median / b2_times['jacrev'].median:.2f}x "
    "faster than vmap(jacfwd)"
)

# %%
# The loop's cost grows with B·Y backward passes, each probably too small to keep the processor
# busy; ``vmap(jacrev)`` does the same work in one batched call. The largest batch is checked
# against the float64 loop as well.
batch_sizes = [2, 16, 128]
loop_ms, jacrev_ms = [], []
for batch_size in batch_sizes:
    batch = torch.randn(batch_size, 784, device=device)
    loop_time = measure(loop_jacobians, model, batch)
    jacrev_time = measure(param_jacobians, params, batch)
    loop_ms.append(loop_time.median * 1e3)
    jacrev_ms.append(jacrev_time.median * 1e3)
    print(
        f"B={batch_size:3d}: loop {loop_ms[-1]:8.1f} ms (IQR {loop_time.iqr * 1e3:.1f}), "
        f"vmap(jacrev) {jacrev_ms[-1]:6.1f} ms (IQR {jacrev_time.iqr * 1e3:.1f}) "
        f"-> {loop_ms[-1] / jacrev_ms[-1]:.2f}x faster than the loop"
    )
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
# Why forward mode is slow here: count the arithmetic
# ---------------------------------------------------
# Reverse mode runs Y backward passes per sample, forward mode P Jacobian-vector products, each
# about the cost of one forward pass. ``torch.utils.flop_counter.FlopCounterMode`` counts the
# floating-point operations of each call, and the ratio should be near P / Y. The time ratio
# printed beside it is smaller: reverse mode's few operations probably do not keep the
# processor busy, so its time is probably mostly per-operation overhead.


def count_flops(fn, *args):
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


flops = {
    "jacrev": count_flops(param_jacobians, params, inputs),
    "jacfwd": count_flops(forward_jacobians, params, inputs),
}
flop_ratio = flops["jacfwd"] / flops["jacrev"]
time_ratio = b2_times["jacfwd"].median / b2_times["jacrev"].median
print(f"B=2: jacrev {flops['jacrev']:,} FLOPs, jacfwd {flops['jacfwd']:,} FLOPs")
print(
    f"jacfwd / jacrev: {flop_ratio:.0f} times the FLOPs (P / Y = "
    f"{num_params / num_outputs:.0f}), {time_ratio:.1f} times the time"
)
assert 0.5 < flop_ratio / (num_params / num_outputs) < 2

# %%
# What forward mode costs in memory
# ---------------------------------
# ``jacfwd`` pushes the P × P identity through the network: every parameter's basis vectors,
# ``4·P²`` bytes in float32. We run each call under :mod:`torch.profiler`, which records every
# allocation: the peak of live memory above the start of the call, and how many bytes each
# operator allocated, per input shape. We measure ``vmap(jacfwd)`` for B = 1, 2 and 3 samples,
# a Python loop of ``jacfwd`` over 3 samples, and ``vmap(..., chunk_size=1)`` on the same 3.
MiB = 2**20
basis_mib = 4 * num_params**2 / MiB
weight_block_mib = 4 * num_params * params["0.weight"].numel() / MiB


def peak_mib(fn, *args):
    """Peak of live memory during fn(*args), above where it started."""
    gc.collect()
    if device.type == "cuda":  # the caching allocator keeps its own peak
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(*args)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / MiB
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
    """(MiB, input shape) of the largest ``aten::clone`` in fn(*args), per input shape."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities, profile_memory=True, record_shapes=True
    ) as prof:
        fn(*args)
    by_shape = prof.key_averages(group_by_input_shape=True)
    field = "device_memory_usage" if device.type == "cuda" else "cpu_memory_usage"
    clones = [e for e in by_shape if e.key == "aten::clone"]
    top = max(clones, key=lambda e: getattr(e, field))
    return getattr(top, field) / MiB, top.input_shapes[0]


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
for b, (copied, shape) in copies.items():
    print(
        f"vmap(jacfwd), B={b}: largest copy {copied:,.0f} MiB, of shape {shape}, "
        f"{copied / weight_block_mib:.2f}x the first weight's block"
    )

# %%
# One sample needs about one basis, and so does a loop over samples. Under ``vmap`` each extra
# sample adds a copy of the first weight's block of the basis: the largest copy has the
# shape (B, P, 784, 10). The linear layer's Jacobian-vector product multiplies the sample
# (batched over samples) by the weight's tangents (batched over the P basis vectors), and
# ``matmul`` copies the tangents once per sample to make one batched product. With
# ``chunk_size=1``, ``vmap`` runs one sample at a time and its memory is the loop's. The chunked
# result is checked against the float64 loop too.
for b, (copied, _) in copies.items():
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
ax.plot(
    [1, 2, 3], vmap_peaks, "o-", color=METHOD_COLORS["jacfwd"], label="jacfwd (vmap)"
)
ax.plot(
    [3],
    [loop_peak],
    "D",
    color=METHOD_COLORS["loop"],
    label="loop of jacfwd",
    markersize=9,
)
ax.plot(
    [3],
    [chunked_peak],
    "s",
    color=METHOD_COLORS["vmap chunked"],
    label="vmap chunked (chunk_size=1)",
)
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
assert jacrev_peak < 1.25 * result_mib

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
print(f"this {device.type} has {device_bytes / 2**30:.0f} GiB")
for name, size in per_sample_bytes.items():
    fits = device_bytes // size
    verdict = f"at most {fits:,} samples fit" if fits else "not even one sample fits"
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
# * With P ≫ Y use ``jacrev``: ``jacfwd`` does about P / Y times the FLOPs (counted above).
# * ``vmap(jacfwd)`` copies the first weight's block of the P × P basis once per sample;
#   ``chunk_size=1`` brings its peak back to one basis, like a loop.
# * ``vmap(jacrev)``'s peak memory is the (B, Y, P) result itself: count ``4·B·Y·P`` bytes
#   before you ask for it.
