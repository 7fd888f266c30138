"""
Differentially private SGD with ghost norms, on real digits
===========================================================

Differentially private SGD (DP-SGD) needs one number per example before it can take a step:
the norm of that example's gradient, so that it can clip every example's influence to a
bound ``C`` before adding noise. The first per-sample page computed the norms from the
per-sample gradients themselves, B·P floats. This page computes them without ever forming
those gradients ("ghost norms"), then takes the clipped mean gradient with a second backward
pass, checks both against the materialised per-sample gradients, and measures what that
saves in time and memory. Then it trains a classifier with a complete DP-SGD loop on
scikit-learn's 8×8 digits (shipped with the package, so nothing is downloaded), compares it
with plain SGD, reports the privacy budget ε from Opacus' accountant, and checks one
hand-written DP-SGD step against Opacus' own on the same batch and noise.
"""

# %%
# Where this page ran
# -------------------
# The hardware decides every timing below, so the page says what it ran on. We use the GPU
# when there is one and seed the random number generator.
import copy
import ctypes
import gc
import os
import platform
import re
import statistics
import warnings
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap
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
# As on the other pages, we ask glibc to keep freed memory in the process and reuse it, so
# that a call's time does not depend on what the process did before. Without glibc the cell
# changes nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # from glibc's <malloc.h>


def glibc():
    """The C library, if it is glibc (whose mallopt we call), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


allocator_pinned = keep_freed_memory()
print(
    "allocator: glibc keeps freed memory for reuse"
    if allocator_pinned
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Timing and memory helpers
# -------------------------
# Medians over interleaved rounds of :class:`torch.utils.benchmark.Timer`, after untimed
# calls; peak memory from the allocator's record of one call on a GPU, and on a Linux CPU
# from the rise of the process's peak resident memory during one call, with freed memory
# returned to the kernel meanwhile so that resident memory follows the live tensors.
torch.set_float32_matmul_precision("highest")


def median_times_ms(methods, rounds=7, min_run_time=0.05):
    """Median time of each method in ``{name: fn}``, in ms, round after round."""
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
    """Peak of live CUDA memory during fn(), from the allocator's record of this call."""
    torch.cuda.synchronize()
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
    if not (allocator_pinned and status.exists()):
        return None

    def resident(field):
        text = status.read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) << 10

    libc = glibc()
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
# The data: scikit-learn's digits
# -------------------------------
# 1,797 grey images of handwritten digits, 8×8 pixels, ten classes. They ship inside
# scikit-learn, so loading them needs no network. We hold out a fifth of them for testing,
# and scale the pixels (0 to 16) to zero mean and unit variance using the training set only.
digits = load_digits()
features = torch.tensor(digits.data, dtype=torch.float32)
labels = torch.tensor(digits.target)
order = torch.randperm(len(features), generator=torch.Generator().manual_seed(0))
num_test = len(features) // 5
test_idx, train_idx = order[:num_test], order[num_test:]
mean, std = features[train_idx].mean(0), features[train_idx].std(0).clamp(min=1e-3)
features = ((features - mean) / std).to(device)
labels = labels.to(device)
x_train, y_train = features[train_idx], labels[train_idx]
x_test, y_test = features[test_idx], labels[test_idx]
print(
    f"{len(x_train)} training and {len(x_test)} test images, {features.shape[1]} pixels"
)

# %%
# The model: an MLP of linear layers
# ----------------------------------
# Ghost norms work layer by layer, and the linear layer is where they are simplest, so the
# model is made of linear layers with ReLUs between them.


def make_mlp(width=512):
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 10),
    ).to(device)  # fmt: skip


model = make_mlp()
num_params = sum(p.numel() for p in model.parameters())
print(f"{num_params:,} parameters")

# %%
# Per-sample norms from the layer's input and output gradient
# -----------------------------------------------------------
# For a linear layer ``y = W a + b`` and one sample, the gradient with respect to ``W`` is the
# outer product ``g aᵀ`` of the output gradient ``g`` and the input ``a``, and the squared
# Frobenius norm of an outer product is ``‖g‖²·‖a‖²``. The bias gradient is ``g`` itself. So
# each sample's squared gradient norm, summed over layers, needs only the vectors that the
# forward and backward passes already produce: B numbers per layer instead of B·P floats.
# (Goodfellow noted this in 2015.)
#
# We capture each layer's input and output with forward hooks and take the gradient of the
# *summed* loss with respect to the outputs: each sample's loss depends only on its own
# outputs, so that is every sample's own output gradient, from one backward pass that
# computes no parameter gradient at all.


def forward_capturing(net, inputs):
    """Logits, and (layer, input, output) for every Linear layer of net."""
    records = []
    handles = [
        layer.register_forward_hook(
            lambda layer, ins, out: records.append((layer, ins[0], out))
        )
        for layer in net.modules()
        if isinstance(layer, nn.Linear)
    ]
    try:
        logits = net(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return logits, records


def ghost_norms(net, inputs, targets):
    """Each sample's gradient norm over all parameters, and what the second pass needs."""
    logits, records = forward_capturing(net, inputs)
    losses = F.cross_entropy(logits, targets, reduction="none")
    output_grads = torch.autograd.grad(
        losses.sum(), [out for _, _, out in records], retain_graph=True
    )
    squared = torch.zeros(len(inputs), device=inputs.device)
    for (_, layer_in, _), g in zip(records, output_grads):
        squared += g.square().sum(1) * (
            layer_in.detach().square().sum(1) + 1
        )  # W and b
    return squared.sqrt(), losses, records, output_grads


# %%
# The reference: materialised per-sample gradients in float64, with ``vmap(grad)`` as on the
# first per-sample page, and their norms. Each norm must agree to float32 rounding.


def per_sample_grads(net, inputs, targets):
    params = {name: p.detach() for name, p in net.named_parameters()}

    def sample_loss(params, x, y):
        logits = functional_call(net, params, (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, targets)


def norms_of(grads):
    return (
        torch.stack([g.flatten(1).square().sum(1) for g in grads.values()])
        .sum(0)
        .sqrt()
    )


batch_x, batch_y = x_train[:256], y_train[:256]
model64 = copy.deepcopy(model).double()
reference_norms = norms_of(per_sample_grads(model64, batch_x.double(), batch_y))
norms = ghost_norms(model, batch_x, batch_y)[0]
norm_error = ((norms.double() - reference_norms).abs() / reference_norms).max().item()
print(
    f"ghost norms vs float64 per-sample gradients: largest relative error {norm_error:.1e}"
)
assert norm_error < 1e-4

# %%
# Sequences: the general formula
# ------------------------------
# When a linear layer sees a sequence of ``T`` tokens per sample (a transformer's layers do),
# its per-sample weight gradient is a *sum* of ``T`` outer products, ``Σₜ gₜ aₜᵀ``, and the
# product of norms no longer applies. Its squared norm is ``Σₜ Σₛ (aₜ·aₛ)(gₜ·gₛ)``: the
# element-wise product of the two ``T×T`` Gram matrices, summed. That costs about ``2T²`` per
# sample against ``I·O`` for forming the gradient, so it pays when ``2T² < I·O`` (Li et al.,
# 2021, "ghost clipping"). We check it on one layer against ``vmap(grad)`` in float64.
tokens, width_in, width_out = 12, 64, 48
layer64 = nn.Linear(width_in, width_out).to(device, torch.float64)
sequence = torch.randn(8, tokens, width_in, device=device, dtype=torch.float64)
target_out = torch.randn(8, tokens, width_out, device=device, dtype=torch.float64)


def sequence_loss(params, x, t):
    return (functional_call(layer64, params, (x,)) - t).square().sum()


weights64 = {name: p.detach() for name, p in layer64.named_parameters()}
seq_grads = vmap(grad(sequence_loss), in_dims=(None, 0, 0))(
    weights64, sequence, target_out
)
out = layer64(sequence)
g = torch.autograd.grad((out - target_out).square().sum(), out)[
    0
]  # every token's gradient
a = sequence
weight_sq = ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
bias_sq = g.sum(1).square().sum(1)
torch.testing.assert_close(weight_sq, seq_grads["weight"].flatten(1).square().sum(1))
torch.testing.assert_close(bias_sq, seq_grads["bias"].flatten(1).square().sum(1))
print(
    f"sequence of {tokens} tokens, layer {width_in}→{width_out}: Gram-matrix norms agree; "
    f"2T² = {2 * tokens**2} vs I·O = {width_in * width_out}"
)

# %%
# The clipped mean gradient, from a second backward pass
# ------------------------------------------------------
# With the norms in hand, each sample's clipping factor is ``min(1, C / ‖gᵢ‖)``. The clipped
# mean gradient is ``(1/B) Σᵢ factorᵢ · ∇ lossᵢ``, which is the ordinary gradient of a
# *weighted* loss, ``(1/B) Σᵢ factorᵢ · lossᵢ``, with the factors held constant. So one more
# backward pass through the graph we kept gives it, and the per-sample gradients never exist.
#
# A second way needs no second pass ("book-keeping", Bu et al., 2023): the clipped weight
# gradient is ``Σᵢ factorᵢ gᵢ aᵢᵀ``, a single matrix product of the output gradients, scaled
# per sample, with the inputs we already hold.


def ghost_clipped_mean(net, inputs, targets, clip_norm):
    norms, losses, _, _ = ghost_norms(net, inputs, targets)
    factors = (clip_norm / norms).clamp(max=1.0).detach()
    weighted = (factors * losses).sum() / len(inputs)
    return torch.autograd.grad(weighted, list(net.parameters())), norms


def bookkeeping_clipped_mean(net, inputs, targets, clip_norm):
    norms, _, records, output_grads = ghost_norms(net, inputs, targets)
    factors = (clip_norm / norms).clamp(max=1.0) / len(inputs)
    result = []
    for (_, layer_in, _), g in zip(records, output_grads):
        scaled = g * factors.unsqueeze(1)
        result += [scaled.T @ layer_in.detach(), scaled.sum(0)]
    return result, norms


def materialised_clipped_mean(net, inputs, targets, clip_norm):
    grads = per_sample_grads(net, inputs, targets)
    norms = norms_of(grads)
    factors = (clip_norm / norms).clamp(max=1.0)
    return [
        (g * factors.view(-1, *[1] * (g.dim() - 1))).mean(0) for g in grads.values()
    ]


clip_norm = norms.median().item()  # half of this batch is clipped
reference64 = materialised_clipped_mean(model64, batch_x.double(), batch_y, clip_norm)
names = [name for name, _ in model.named_parameters()]
for method, fn in [
    ("ghost clipping", ghost_clipped_mean),
    ("book-keeping", bookkeeping_clipped_mean),
]:
    clipped = fn(model, batch_x, batch_y, clip_norm)[0]
    for name, got, ref in zip(names, clipped, reference64):
        error = ((got.double() - ref).norm() / ref.norm()).item()
        assert error < 1e-4, f"{method}: {name} relative error {error:.1e}"
    print(f"{method}: every parameter's clipped mean gradient agrees with float64")

# %%
# Speed and memory
# ----------------
# Now the cost, on a batch of 256: one ordinary training step (forward and backward, the
# mean gradient), the two ghost methods, and the materialised way through ``vmap(grad)``.
# The materialised way must hold B·P floats; the ghost methods hold B numbers per layer.
batch_x, batch_y = x_train[:256], y_train[:256]


def ordinary_step(net, inputs, targets):
    return torch.autograd.grad(
        F.cross_entropy(net(inputs), targets), list(net.parameters())
    )


steps = {
    "batched": ordinary_step,
    "ghost clipping": ghost_clipped_mean,
    "book-keeping": bookkeeping_clipped_mean,
    "vmap": materialised_clipped_mean,
}
step_calls = {
    name: partial(fn, model, batch_x, batch_y)
    if name == "batched"
    else partial(fn, model, batch_x, batch_y, clip_norm)
    for name, fn in steps.items()
}
step_ms = median_times_ms(step_calls)
step_peaks = {name: peak_mib(call) for name, call in step_calls.items()}
labels_for = {
    "batched": "ordinary step (no clipping)",
    "ghost clipping": "ghost norms + second backward",
    "book-keeping": "ghost norms + book-keeping",
    "vmap": "materialised (vmap) + clip",
}
for name in steps:
    peak = step_peaks[name]
    print(
        f"{labels_for[name]:30s} {step_ms[name]:7.2f} ms = "
        f"{step_ms[name] / step_ms['batched']:.2f}x one ordinary step"
        + ("" if peak is None else f", peak {peak:6.1f} MiB")
    )
print(
    f"ghost clipping is {step_ms['vmap'] / step_ms['ghost clipping']:.2f}x faster than "
    "the materialised way"
)
best_ghost = (
    min(step_ms["ghost clipping"], step_ms["book-keeping"]) / step_ms["batched"]
)
print(
    f"target (ghost clipping within 1.5x of one step): {'met' if best_ghost <= 1.5 else 'missed'}"
)
if step_peaks["vmap"] is not None:
    assert step_peaks["vmap"] > 5 * step_peaks["ghost clipping"]

# %%
# Where the target is missed, the extra passes are the place to look: ghost clipping runs the
# backward pass twice, and book-keeping adds products per layer. With a model this small on a
# GPU, each pass is a few short kernels whose launches can cost more than their arithmetic;
# ``torch.compile`` fuses such kernels, and a CUDA graph replays them without the launches.

# %%
# A complete DP-SGD training loop
# -------------------------------
# Each step samples every training example independently with probability ``q`` (Poisson
# sampling, which the privacy accounting below assumes), clips each sample's gradient to norm
# ``C`` with ghost clipping, adds Gaussian noise of standard deviation ``σ·C`` to the sum, and
# divides by the expected batch size ``q·N``. Plain SGD, with the same model, learning rate
# and number of steps, is the comparison. Each full training run is timed once, as a whole;
# both are seeded.
noise_multiplier, dp_clip_norm, learning_rate = 1.0, 1.0, 0.5
expected_batch, epochs = 64, 15
sample_rate = expected_batch / len(x_train)
num_steps = epochs * len(x_train) // expected_batch


def accuracy(net):
    with torch.no_grad():
        return (net(x_test).argmax(1) == y_test).float().mean().item()


def train(private, curves, seed=0, steps=num_steps):
    """Train a fresh model; store its test accuracy after each epoch in curves."""
    torch.manual_seed(seed)
    net = make_mlp()
    sampler = torch.Generator(device=device).manual_seed(seed)
    curve = []
    for step in range(steps):
        chosen = (
            torch.rand(len(x_train), generator=sampler, device=device) < sample_rate
        )
        inputs, targets = x_train[chosen], y_train[chosen]
        if private:
            grads, _ = ghost_clipped_mean(net, inputs, targets, dp_clip_norm)
            grads = [
                (g * len(inputs) + torch.randn(g.shape, generator=sampler, device=device)
                 * noise_multiplier * dp_clip_norm) / expected_batch
                for g in grads
            ]  # fmt: skip
        else:
            grads = ordinary_step(net, inputs, targets)
        with torch.no_grad():
            for p, g in zip(net.parameters(), grads):
                p -= learning_rate * g
        if (step + 1) % (num_steps // epochs) == 0:
            curve.append(accuracy(net))
    curves["ghost clipping" if private else "batched"] = curve


train_ms = {}
curves = {}
for name, private in [("batched", False), ("ghost clipping", True)]:
    timer = benchmark.Timer(
        stmt="train(private, curves)",
        globals={"train": train, "private": private, "curves": curves},
        num_threads=torch.get_num_threads(),
    )
    train_ms[name] = timer.timeit(1).median * 1e3
accountant = RDPAccountant()
accountant.history = [(noise_multiplier, sample_rate, num_steps)]
delta = 1e-5
epsilon = accountant.get_epsilon(delta=delta)
print(
    f"{num_steps} steps, sampling rate {sample_rate:.3f}, noise multiplier "
    f"{noise_multiplier}, clipping norm {dp_clip_norm}"
)
print(
    f"plain SGD: test accuracy {curves['batched'][-1]:.3f}, "
    f"{train_ms['batched'] / 1e3:.1f} s"
)
print(
    f"DP-SGD:    test accuracy {curves['ghost clipping'][-1]:.3f}, "
    f"{train_ms['ghost clipping'] / 1e3:.1f} s"
)
print(f"privacy budget: ε = {epsilon:.2f} at δ = {delta:g} (Opacus' RDP accountant)")
assert (
    curves["ghost clipping"][-1] > 0.8
)  # far above chance (0.1): private training works
assert curves["batched"][-1] > curves["ghost clipping"][-1]  # the noise costs accuracy

# %%
# What privacy costs in time
# --------------------------
# Two whole runs, timed once each, say little about their ratio: a slow second on a shared
# machine lands on one of them only. So the price of privacy in time is measured on one epoch
# of each, the two taking turns for several rounds, as every other timing on this page.
epoch_steps = num_steps // epochs
epoch_ms = median_times_ms(
    {
        "batched": lambda: train(False, {}, steps=epoch_steps),
        "ghost clipping": lambda: train(True, {}, steps=epoch_steps),
    },
    rounds=5,
)
print(
    f"one epoch ({epoch_steps} steps): plain SGD {epoch_ms['batched']:.0f} ms, "
    f"DP-SGD {epoch_ms['ghost clipping']:.0f} ms, "
    f"{epoch_ms['ghost clipping'] / epoch_ms['batched']:.2f}x the time of plain SGD"
)

# %%
# The figure shows test accuracy after each epoch's worth of steps.
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
epochs_axis = range(1, epochs + 1)
ax.plot(epochs_axis, curves["batched"], marker="o", color=METHOD_COLORS["batched"],
        label="plain SGD")  # fmt: skip
ax.plot(epochs_axis, curves["ghost clipping"], marker="o",
        color=METHOD_COLORS["ghost clipping"],
        label=f"DP-SGD (ε = {epsilon:.1f}, δ = {delta:g})")  # fmt: skip
ax.axhline(0.1, color="black", linestyle=":", linewidth=1, label="chance")
ax.set_xlabel("epoch")
ax.set_ylabel("test accuracy")
ax.set_ylim(0, 1)
ax.set_title("Digits: plain SGD against DP-SGD with ghost clipping")
ax.legend(loc="lower right")
plt.show()

# %%
# One step against Opacus
# -----------------------
# Opacus implements DP-SGD as an optimiser (``DPOptimizer``) around a module whose hooks
# compute per-sample gradients (``GradSampleModule``). Given the same batch, the same clipping
# norm, and a noise generator in the same state, one of its steps and one hand-written step
# must land on the same parameters: clipping and averaging are deterministic, and both draw
# the noise for each parameter in the same order from the same generator. (Opacus adds 1e-6
# to each norm before dividing, a difference far below the tolerance.)
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing"
)  # expected here
net_ours = make_mlp()
net_opacus = GradSampleModule(copy.deepcopy(net_ours), loss_reduction="mean")
optimizer = DPOptimizer(
    torch.optim.SGD(net_opacus.parameters(), lr=learning_rate),
    noise_multiplier=noise_multiplier,
    max_grad_norm=dp_clip_norm,
    expected_batch_size=expected_batch,
    generator=torch.Generator(device=device).manual_seed(1),
)
inputs, targets = x_train[:expected_batch], y_train[:expected_batch]
optimizer.zero_grad()
F.cross_entropy(net_opacus(inputs), targets).backward()
optimizer.step()

noise_source = torch.Generator(device=device).manual_seed(1)
grads, _ = ghost_clipped_mean(net_ours, inputs, targets, dp_clip_norm)
with torch.no_grad():
    for p, g in zip(net_ours.parameters(), grads):
        noise = torch.normal(0.0, noise_multiplier * dp_clip_norm, size=g.shape,
                             generator=noise_source, device=device)  # fmt: skip
        p -= learning_rate * (g * len(inputs) + noise) / expected_batch
for (name, ours), theirs in zip(net_ours.named_parameters(), net_opacus.parameters()):
    torch.testing.assert_close(
        ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
    )
print("one hand-written DP-SGD step matches Opacus' step, parameter by parameter")

# %%
# What to take away
# -----------------
# * Per-sample gradient *norms* of linear layers come from the activations and output
#   gradients that backpropagation already computes; for sequences, from two small Gram
#   matrices per sample. Clipping then needs a second backward pass of a weighted loss, or a
#   scaled matrix product per layer.
# * The timings above say what that saves against forming B·P floats, and how close the
#   ghost step comes to an ordinary step on this machine.
# * DP-SGD's price is accuracy as well as time: the noise that buys ε costs test accuracy
#   against plain SGD, as the training run above measured. Compare the epoch's time ratio
#   with the per-step one: an epoch's batches are small, so the fixed Python cost of the
#   hooks and of drawing noise for every parameter weighs more there than in a full batch.
