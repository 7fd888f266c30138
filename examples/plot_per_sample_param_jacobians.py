"""
Per-sample Jacobians with respect to the parameters
===================================================

A question that comes up again and again: *for a network with P parameters and Y outputs, how
do I get the derivative of every output of every sample with respect to every parameter?* The
answer is a (B, Y, P) tensor, one Y × P Jacobian per sample. It is the building block of the
empirical neural tangent kernel, of Gauss-Newton curvature, and of Fisher-information
estimates. This page computes it with a double loop, with ``vmap(jacrev(...))`` and with
``jacfwd``, checks them against each other, explains which is faster and why, and works out how
much memory the result needs and where it stops fitting.
"""

# %%
# Where this page ran
# -------------------
# We print the hardware, because the timings depend on it, pick the GPU when there is one, and
# seed the generator.
import os
import platform
import re
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


def median_ms(fn, min_run_time=0.5):
    """Median time of ``fn()`` in milliseconds, using all of torch's threads."""
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


# %%
# The model
# ---------
# An MLP for flattened 28×28 images: 784 → 20 → 10 with a ReLU. Small, but with
# P = 784·20 + 20 + 20·10 + 10 = 15,910 parameters against
# Y = 10 outputs, it has the shape of every classifier: far more parameters than
# outputs.
model = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)).to(device)
num_params = sum(p.numel() for p in model.parameters())
num_outputs = 10
print(f"P = {num_params:,} parameters, Y = {num_outputs} outputs")

# %%
# The naive double loop
# ---------------------
# One backward pass per sample *and* per output: ``autograd.grad`` of the scalar
# ``outputs[b, y]`` gives one row of the answer, which we flatten and concatenate over the
# parameters. That is B·Y backward passes.


def loop_param_jacobians(net, inputs):
    weights = list(net.parameters())
    outputs = net(inputs)
    rows = [
        torch.cat(
            [
                g.flatten()
                for g in torch.autograd.grad(outputs[b, y], weights, retain_graph=True)
            ]
        )
        for b in range(outputs.shape[0])
        for y in range(outputs.shape[1])
    ]
    return torch.stack(rows).reshape(outputs.shape[0], outputs.shape[1], -1)


inputs = torch.randn(2, 784, device=device)
loop_jacobians = loop_param_jacobians(model, inputs)
print("double loop:", tuple(loop_jacobians.shape), "= (B, Y, P)")

# %%
# ``vmap(jacrev(...))`` over ``functional_call``
# ----------------------------------------------
# As with per-sample gradients, we write the model's output for **one** sample as a pure
# function of a parameter dictionary, using :func:`~torch.func.functional_call`.
# :func:`~torch.func.jacrev` differentiates it with respect to that dictionary, returning one
# Jacobian of shape ``(Y, *param.shape)`` per parameter, and :func:`~torch.func.vmap` maps it
# over the batch. Flattening each parameter's trailing axes and concatenating gives
# (B, Y, P), with the parameters in the same order as ``model.parameters()``.
params = {name: p.detach() for name, p in model.named_parameters()}


def sample_output(params, x):
    return functional_call(model, params, (x.unsqueeze(0),)).squeeze(0)


def flatten_params(jacobians):
    """Dict of (B, Y, *param.shape) tensors -> one (B, Y, P) tensor."""
    return torch.cat([j.flatten(start_dim=2) for j in jacobians.values()], dim=2)


jacrev_fn = vmap(jacrev(sample_output), in_dims=(None, 0))
jacfwd_fn = vmap(jacfwd(sample_output), in_dims=(None, 0))
vmap_jacobians = flatten_params(jacrev_fn(params, inputs))
print("vmap(jacrev):", tuple(vmap_jacobians.shape))

# %%
# Checking against the loop
# -------------------------
# ReLU networks are piecewise linear, and in float64 no activation sits close enough to zero to
# flip, so the loop and both transforms must agree to rounding error. We compare float32 results
# with a float64 loop by relative error: float32 rounding keeps it near 1e-7, and the bound of
# 1e-5 still catches any misplaced entry, whose error would be of order one.
model64 = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)).to(
    device, torch.float64
)
model64.load_state_dict(model.state_dict())
reference = loop_param_jacobians(model64, inputs.double())
jacfwd_jacobians = flatten_params(jacfwd_fn(params, inputs))
for method, result in [
    ("loop", loop_jacobians),
    ("vmap(jacrev)", vmap_jacobians),
    ("vmap(jacfwd)", jacfwd_jacobians),
]:
    error = ((result.double() - reference).norm() / reference.norm()).item()
    print(f"{method:13s} relative error vs float64 loop: {error:.1e}")
    assert result.shape == reference.shape and error < 1e-5, method

# %%
# ``jacrev`` or ``jacfwd``?
# -------------------------
# Reverse mode needs one backward pass per **output** (Y = 10 per sample); forward mode needs
# one forward pass per **parameter** (P = 15,910 per sample). Both are vectorised, but forward
# mode has to push a batch of 15,910 tangent vectors through the network, the identity matrix
# over all parameters, so it does far more arithmetic. The Jacobian here is very wide
# (Y ≪ P), the case where reverse mode wins.
times_b2_ms = {
    "double loop": median_ms(lambda: loop_param_jacobians(model, inputs)),
    "vmap(jacfwd)": median_ms(lambda: jacfwd_fn(params, inputs)),
    "vmap(jacrev)": median_ms(lambda: jacrev_fn(params, inputs)),
}
for method, ms in times_b2_ms.items():
    print(f"B=2  {method:13s} {ms:8.2f} ms")
jacrev_b2_ms = times_b2_ms["vmap(jacrev)"]
print(
    f"vmap(jacrev) is {times_b2_ms['double loop'] / jacrev_b2_ms:.1f}x faster than the "
    f"loop and {times_b2_ms['vmap(jacfwd)'] / jacrev_b2_ms:.0f}x faster than vmap(jacfwd)"
)

# %%
# Forward mode pays in memory too: its batch of tangents is a P × P identity, 15,910² numbers
# (about 1 GB in float32) per sample, where reverse mode's cotangents are Y × Y. On a GPU we
# measure each method's peak memory with ``torch.cuda.max_memory_allocated``; on a CPU, PyTorch
# has no such counter, so this check runs on GPU builds only.
if device.type == "cuda":
    peak_mib = {}
    for method, jacobian_fn in [
        ("vmap(jacrev)", jacrev_fn),
        ("vmap(jacfwd)", jacfwd_fn),
    ]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        jacobian_fn(params, inputs)
        torch.cuda.synchronize()
        peak_mib[method] = torch.cuda.max_memory_allocated() / 2**20
        print(f"{method:13s} CUDA peak memory {peak_mib[method]:9.1f} MiB")
    assert peak_mib["vmap(jacfwd)"] > 10 * peak_mib["vmap(jacrev)"]
else:
    print("peak memory is measured on CUDA builds only")

# %%
# Scaling the batch
# -----------------
# The loop's cost grows with B·Y backward passes, each too small to keep the hardware busy;
# ``vmap(jacrev)`` grows with B too, but in one batched call. We time both over a range of batch
# sizes (a GPU gets larger batches) and check the largest batch against the loop once more.
batch_sizes = [2, 8, 32, 128] if device.type == "cpu" else [2, 8, 32, 128, 512]
loop_ms, vmap_ms = [], []
for batch_size in batch_sizes:
    batch = torch.randn(batch_size, 784, device=device)
    loop_ms.append(median_ms(partial(loop_param_jacobians, model, batch), 0.3))
    vmap_ms.append(median_ms(partial(jacrev_fn, params, batch), 0.3))
    print(
        f"B={batch_size:4d}: loop {loop_ms[-1]:8.2f} ms, vmap(jacrev) {vmap_ms[-1]:7.2f} ms "
        f"-> {loop_ms[-1] / vmap_ms[-1]:.1f}x"
    )
torch.testing.assert_close(
    flatten_params(jacrev_fn(params, batch)), loop_param_jacobians(model, batch)
)

# %%
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
ax.loglog(
    batch_sizes,
    loop_ms,
    "o-",
    color="#d95f02",
    label="double loop (B·Y backward passes)",
)
ax.loglog(batch_sizes, vmap_ms, "s-", color="#1b9e77", label="vmap(jacrev)")
ax.set_xlabel("batch size B")
ax.set_ylabel("median time (ms)")
ax.set_title(
    f"(B, 10, 15910) parameter Jacobians on {device.type.upper()}: "
    f"{loop_ms[-1] / vmap_ms[-1]:.0f}x faster at B={batch_sizes[-1]}"
)
ax.legend()
plt.show()

# %%
# How much memory?
# ----------------
# The result alone holds B·Y·P numbers: for this MLP in float32 that is
# 4 · B · 10 · 15,910 bytes, about 0.64 MB per sample. It grows with all three factors, and P is
# the one that explodes. The figure below puts the same formula next to the memory of the
# device this page ran on, for this MLP and for two well-known image classifiers (ResNet-18,
# 11.7 M parameters, and ResNet-50, 25.6 M, each with 1,000 outputs).
if device.type == "cuda":
    device_bytes = torch.cuda.get_device_properties(device).total_memory
else:
    device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
per_sample_bytes = {
    f"this MLP (Y=10, P={num_params:,})": 4 * num_outputs * num_params,
    "ResNet-18 (Y=1000, P=11.7M)": 4 * 1000 * 11_689_512,
    "ResNet-50 (Y=1000, P=25.6M)": 4 * 1000 * 25_557_032,
}
assert (
    vmap_jacobians.element_size() * vmap_jacobians[0].numel()
    == per_sample_bytes[next(iter(per_sample_bytes))]
)
print(f"this {device.type.upper()} has {device_bytes / 2**30:.0f} GiB")
for name, size in per_sample_bytes.items():
    fits = device_bytes // size
    verdict = f"at most {fits:,} samples fit" if fits else "not even one sample fits"
    print(f"{name:32s} {size / 2**20:12,.2f} MiB per sample: {verdict}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
all_batches = torch.logspace(0, 4, 50)
for (name, size), color in zip(
    per_sample_bytes.items(), ["#1b9e77", "#7570b3", "#d95f02"]
):
    ax.loglog(all_batches, all_batches * size / 2**30, color=color, label=name)
ax.axhline(
    device_bytes / 2**30,
    color="#888888",
    linestyle="--",
    label=f"this {device.type.upper()}'s memory",
)
ax.set_xlabel("batch size B")
ax.set_ylabel("(B, Y, P) float32 Jacobian (GiB)")
ax.set_title("Memory of the full per-sample parameter Jacobian")
ax.legend(fontsize="small")
plt.show()

# %%
# For large models nobody materialises this tensor. Methods built on it contract it on the fly:
# Jacobian-vector and vector-Jacobian products, per-sample gradient *norms*, or the kernel
# below, with ``chunk_size`` in ``vmap`` and ``jacrev`` to bound the memory of each step.
#
# The building block of the neural tangent kernel
# -----------------------------------------------
# The empirical neural tangent kernel between two samples is the Y × Y matrix
# ``J(x_a) J(x_b)ᵀ``: how much a gradient step on one sample moves the outputs of the
# other. With the (B, Y, P) tensor it is one ``einsum``, and its diagonal blocks are positive
# semi-definite, which we check.
ntk = torch.einsum("ayp,bzp->abyz", vmap_jacobians, vmap_jacobians)
print("empirical NTK for the 2-sample batch:", tuple(ntk.shape))
assert torch.linalg.eigvalsh(ntk[0, 0].double()).min() > -1e-6 * ntk[0, 0].abs().max()
