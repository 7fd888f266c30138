"""
Per-sample gradient norms without per-sample gradients
======================================================

Clipping each example's gradient, as differentially private training does, needs each
example's gradient *norm*, not the B·P floats of the per-sample gradients. This page computes
the norms from each layer's inputs and output gradients ("ghost norms"), also for sequences,
then the clipped mean gradient by a second backward pass or by "book-keeping", each checked
against ``vmap(grad(...))`` in float64, then timed and sized. The sibling page
:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_dp_sgd_training.py` trains privately.
"""

# %%
# Setup
# -----
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# The recipe: a norm from two vectors per layer
# ---------------------------------------------
# For a linear layer ``y = W a + b`` and one sample, the weight gradient is ``g aᵀ`` (output
# gradient times input), of squared norm ``‖g‖²·‖a‖²`` (Goodfellow, 2015, "Efficient
# per-example gradient computations"); the bias gradient is ``g``. Hooks
# capture ``a`` and ``y``; the gradient of the *summed* loss with respect to ``y`` gives each
# sample its own ``g``, as each sample's loss depends on its own outputs only. The formula
# holds for linear layers only, each called once per forward: ``ghost_norms`` asserts that the
# calls it hooked cover every parameter exactly once. Other layers need their own formulas
# (Opacus has them for ``nn.Embedding`` too, and forms per-sample gradients for the rest). The
# reference forms all B·P per-sample gradient floats with ``vmap(grad(...))`` (as on
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads.py`).
model = nn.Sequential(
    nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
).to(device)  # fmt: skip
inputs = torch.randn(256, 64, device=device)
targets = torch.randint(0, 10, (256,), device=device)


def per_sample_grads(net, x, y):
    params = {name: p.detach().to(x.dtype) for name, p in net.named_parameters()}

    def sample_loss(params, x, y):
        return F.cross_entropy(functional_call(net, params, (x[None],)), y[None])

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)


def norms_of(grads):  # vector_norm: no squared copy of the B·P floats
    norms = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()]
    return torch.linalg.vector_norm(torch.stack(norms), dim=0)


def ghost_norms(net, x, y, keep_graph=True):
    """Each sample's gradient norm; also its losses, layer inputs, output gradients."""
    seen = []  # (layer, input, output) of every Linear call, in forward order
    hooks = [
        layer.register_forward_hook(lambda *call: seen.append(call))
        for layer in net.modules()
        if isinstance(layer, nn.Linear)
    ]
    losses = F.cross_entropy(net(x), y, reduction="none")
    for hook in hooks:
        hook.remove()
    covered = [id(p) for layer, _, _ in seen for p in (layer.weight, layer.bias)]
    assert sorted(covered) == sorted(map(id, net.parameters())), "not all Linear, once"
    layer_ins = [ins[0].detach() for _, ins, _ in seen]
    outs = [out for _, _, out in seen]
    out_grads = torch.autograd.grad(losses.sum(), outs, retain_graph=keep_graph)
    per_layer = zip(layer_ins, out_grads)
    squared = sum(g.square().sum(1) * (a.square().sum(1) + 1) for a, g in per_layer)
    return squared.sqrt(), losses, layer_ins, out_grads


check_x, check_y = inputs[:64], targets[:64]  # the float64 reference on 64 samples
reference_norms = norms_of(per_sample_grads(model, check_x.double(), check_y))
norm_errors = ghost_norms(model, check_x, check_y)[0] / reference_norms - 1
norm_error = norm_errors.abs().max().item()
print(
    f"ghost norms vs float64 vmap(grad): largest relative error {norm_error:.1e} "
    f"(bound 1e-6, {1e-6 / norm_error:.0f}x it)"
)
assert norm_error < 1e-6, f"relative error {norm_error:.1e} above 1e-6"

# %%
# Sequences: two Gram matrices per sample
# ---------------------------------------
# When a linear layer sees ``T`` tokens per sample (a transformer's layers do), the weight
# gradient is a *sum* of outer products, ``Σₜ gₜ aₜᵀ``, and the product of norms no longer
# holds. Its squared norm is ``Σₜ Σₛ (aₜ·aₛ)(gₜ·gₛ)``: the element-wise product of the two
# ``T×T`` Gram matrices of inputs and output gradients, summed (Li et al., 2021, "ghost
# clipping"). The bias gradient is ``Σₜ gₜ``. We check both on one layer in float64.
batch, tokens, width_in, width_out = 8, 12, 64, 48
layer64 = nn.Linear(width_in, width_out).to(device, torch.float64)
seq_x = torch.randn(batch, tokens, width_in, device=device, dtype=torch.float64)
seq_target = torch.randn(batch, tokens, width_out, device=device, dtype=torch.float64)


def sequence_loss(params, x, target):
    return (functional_call(layer64, params, (x,)) - target).square().sum()


def gram_weight_norms(a, g):
    """Squared per-sample weight-gradient norms from (B, T, I) inputs, (B, T, O) grads."""
    return ((a @ a.mT) * (g @ g.mT)).sum((1, 2))


weights64 = {name: p.detach() for name, p in layer64.named_parameters()}
seq_grads = vmap(grad(sequence_loss), in_dims=(None, 0, 0))(
    weights64, seq_x, seq_target
)
seq_out = layer64(seq_x)
seq_g = torch.autograd.grad((seq_out - seq_target).square().sum(), seq_out)[0]
for name, ours in [
    ("weight", gram_weight_norms(seq_x, seq_g)),
    ("bias", seq_g.sum(1).square().sum(1)),
]:
    ref = seq_grads[name].flatten(1).square().sum(1)
    error = ((ours - ref).abs() / ref).max().item()
    print(
        f"{tokens} tokens, {name}: Gram-matrix norms vs vmap(grad), error {error:.1e}"
    )
    assert error < 1e-14

# %%
# What the Gram matrices cost
# ---------------------------
# Per sample, the two Gram matrices take ``T²·(I + O)`` multiply-adds and hold ``2T²``
# numbers; forming the gradient takes ``T·I·O`` and holds ``I·O``. Li et al.'s criterion,
# ``2T² < I·O``, is the memory one; in arithmetic the Gram way wins when ``T·(I + O) < I·O``.
# ``FlopCounterMode`` counts the matrix products of both ways (2 FLOPs per multiply-add) for a
# short and a long sequence, and each count must equal its formula; the bytes are counted from
# the tensors. The tool has no formula for element-wise operations, so the Gram way's
# element-wise product and sum (2T² more FLOPs per sample, 1/(I+O) of its count) are left out:
# were they counted, the first assert would fail.
from torch.utils.flop_counter import FlopCounterMode


def counted_flops(fn, *args):
    with FlopCounterMode(display=False) as flop_counter:
        result = fn(*args)
    return flop_counter.get_total_flops(), result


for length in (tokens, 256):
    a = torch.randn(batch, length, width_in, device=device, dtype=torch.float64)
    g = torch.randn(batch, length, width_out, device=device, dtype=torch.float64)
    gram_flops, _ = counted_flops(gram_weight_norms, a, g)
    grad_flops, grads = counted_flops(torch.einsum, "bto,bti->boi", g, a)
    assert gram_flops == 2 * batch * length**2 * (width_in + width_out)
    assert grad_flops == 2 * batch * length * width_in * width_out
    gram_bytes = 2 * (a @ a.mT).numel() * a.element_size()
    print(
        f"T = {length:3d}: Gram way {gram_flops / grad_flops:.2f}x the FLOPs and "
        f"{gram_bytes / (grads.numel() * grads.element_size()):.2f}x the bytes of "
        "forming the per-sample weight gradients"
    )

# %%
# The clipped mean gradient, two ways
# -----------------------------------
# Each sample's clipping factor is ``min(1, C / ‖∇ℓᵢ‖)``. The clipped mean gradient
# ``(1/B) Σᵢ factorᵢ ∇ℓᵢ`` is the ordinary gradient of the *weighted* loss
# ``(1/B) Σᵢ factorᵢ ℓᵢ`` with the factors held constant, so a second backward pass through
# the kept graph gives it ("ghost clipping"). The factors are constants already: the norms
# come from detached inputs and from output gradients that ``autograd.grad`` returns without
# history (no ``create_graph``). Book-keeping (Bu et al., 2023) skips that pass:
# the clipped weight gradient is ``Σᵢ factorᵢ gᵢ aᵢᵀ / B``, one matrix product per layer of
# the scaled output gradients and the inputs already held. In practice, Opacus ships ghost
# clipping: given a criterion, ``PrivacyEngine.make_private(..., grad_sample_mode="ghost")``
# returns the module, optimizer, a wrapped criterion and data loader; the loss that the wrapped
# criterion returns has a ``backward()`` that runs both passes, with these formulas for linear
# layers (``opacus/grad_sample/linear.py`` in Opacus 1.6).


def ghost_clipped_mean(net, x, y, clip_norm):
    norms, losses, _, _ = ghost_norms(net, x, y)
    factors = (clip_norm / norms).clamp(max=1.0)  # constants: the norms have no history
    return torch.autograd.grad(
        (factors * losses).sum() / len(x), list(net.parameters())
    )


def bookkeeping_clipped_mean(net, x, y, clip_norm):
    norms, _, layer_ins, out_grads = ghost_norms(net, x, y, keep_graph=False)
    factors = (clip_norm / norms).clamp(max=1.0) / len(x)
    result = []
    for a, g in zip(layer_ins, out_grads):
        scaled = g * factors[:, None]
        result += [scaled.T @ a, scaled.sum(0)]  # weight, bias
    return result


def materialised_clipped_mean(net, x, y, clip_norm):
    grads = per_sample_grads(net, x, y)
    factors = (clip_norm / norms_of(grads)).clamp(max=1.0)
    return [torch.einsum("b,b...->...", factors, g) / len(x) for g in grads.values()]


# %%
# The reference is the materialised way in float64. For this check only, the clipping norm is
# the batch's median norm, so that both branches of ``min`` are taken, by construction. In
# training, ``C`` is fixed in advance: a median of the private norms would itself be a release
# of private data.
clip_norm = reference_norms.median().item()
clipped = (reference_norms > clip_norm).sum().item()
print(f"C = the median norm: {clipped} of {len(reference_norms)} samples clipped")
reference = materialised_clipped_mean(model, check_x.double(), check_y, clip_norm)
for method, clipped_mean in [
    ("ghost clipping", ghost_clipped_mean),
    ("book-keeping", bookkeeping_clipped_mean),
]:
    result = clipped_mean(model, check_x, check_y, clip_norm)
    errors = {
        name: ((got.double() - ref).norm() / ref.norm()).item()
        for (name, _), got, ref in zip(model.named_parameters(), result, reference)
    }
    print(f"{method}: largest relative error per parameter {max(errors.values()):.1e}")
    for name, error in errors.items():
        assert error < 1e-5, f"{method}: {name} relative error {error:.1e}"

# %%
# How fast is it?
# ---------------
# Now on all 256 samples: one ordinary step (the mean gradient, no clipping), the two ghost
# methods, and the materialised way, ``vmap(grad)`` in float32. The materialised way allocates
# B·P floats per call, hundreds of MB, so first we ask glibc to keep freed memory for reuse
# instead of returning it to the kernel (:doc:`/reading-timings` says why); the timer's
# block-size estimate runs each step first, as a warm-up. Each time is a median over at least
# five blocks.
import ctypes
import platform

from torch.utils import benchmark

if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap for large blocks
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: never trim


def ordinary_step(net, x, y, clip_norm):
    return torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))


steps = {
    "batched": ordinary_step,
    "ghost clipping": ghost_clipped_mean,
    "book-keeping": bookkeeping_clipped_mean,
    "vmap": materialised_clipped_mean,
}
step_times = {}
for name, step in steps.items():
    timer = benchmark.Timer(
        stmt="step(model, inputs, targets, clip_norm)",
        globals={"step": step, "model": model, "inputs": inputs, "targets": targets,
                 "clip_norm": clip_norm},
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    measured = timer.blocked_autorange(min_run_time=1.0)
    while len(measured.times) < 5:  # few blocks on a busy machine: top up, ~50 ms each
        top_up = timer.timeit(max(1, round(0.05 / measured.median)))
        measured = benchmark.Measurement.merge([measured, top_up])[0]
    step_times[name] = measured
    spread = f"IQR {measured.iqr * 1e3:.3g} ms, {len(measured.times)} blocks"
    print(
        f"{name:15s} {measured.median * 1e3:7.2f} ms ({spread}), takes "
        f"{measured.median / step_times['batched'].median:.2f}x one ordinary step's time"
    )
vmap_vs_ghost = step_times["vmap"].median / step_times["ghost clipping"].median
if vmap_vs_ghost >= 1:
    print(f"vmap takes {vmap_vs_ghost:.2f}x the time of ghost clipping")
else:
    print(f"vmap is {1 / vmap_vs_ghost:.2f}x faster than ghost clipping")

# %%
# How much memory?
# ----------------
# On the CPU, torch's profiler records every allocation through PyTorch's allocator during one
# call of each method; the largest running total of bytes allocated since the call began is its
# peak (on a GPU, the allocator's peak of requested bytes). The materialised way must hold the B·P
# per-sample gradient floats, so its peak must be at least their bytes, counted; the ghost methods
# never form them: theirs must stay within twice an ordinary step's, far below even one layer's
# per-sample gradients. Ghost clipping runs two passes; its first, ``ghost_norms`` keeping the
# graph, is also measured alone, to see which pass sets the peak (the second forms the parameter
# gradients, as an ordinary step does).
import gc
import json
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_stats()["requested_bytes.all.current"]
        fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["requested_bytes.all.peak"] - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = [e["args"] for e in events if e["name"] == "[memory]"]
    # The running total carries what earlier profiles allocated and freed after they closed:
    # the peak is taken above its value just before this call's first allocation.
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - start


# A case with a known answer: ``x + 1`` holds two tensors of 2**20 floats, 8 MiB.
known = peak_bytes(lambda: torch.ones(2**20, device=device) + 1) / 2**20
print(f"peak of torch.ones(2**20) + 1: {known:.3f} MiB")
assert 8 <= known < 8.01
step_peaks = {
    name: peak_bytes(lambda step=step: step(model, inputs, targets, clip_norm))
    for name, step in steps.items()
}
num_params = sum(p.numel() for p in model.parameters())
per_sample_bytes = len(inputs) * num_params * 4
for name, peak in step_peaks.items():
    print(f"{name:15s} peak {peak / 2**20:7.2f} MiB")
print(f"B·P per-sample floats: {per_sample_bytes / 2**20:.1f} MiB")
assert step_peaks["vmap"] >= per_sample_bytes
assert (
    max(step_peaks["ghost clipping"], step_peaks["book-keeping"])
    < 2 * step_peaks["batched"]
)
first_pass = peak_bytes(lambda: ghost_norms(model, inputs, targets))
in_first = step_peaks["ghost clipping"] - first_pass < 0.01 * first_pass
print(
    f"ghost clipping's first pass alone peaks at {first_pass / 2**20:.2f} MiB: the "
    f"method's peak is reached in its {'first' if in_first else 'second'} pass"
)
print(
    "vmap's peak memory is "
    f"{step_peaks['vmap'] / step_peaks['ghost clipping']:.2f}x ghost clipping's"
)

# %%
# The figure shows both measurements side by side; memory on a logarithmic axis.
fig, (ax_time, ax_memory) = plt.subplots(
    1, 2, figsize=(8, 3.2), layout="constrained", sharey=True
)
METHOD_COLORS = {
    "batched": "#666666",
    "ghost clipping": "#CC6677",
    "book-keeping": "#6699CC",
    "vmap": "#009E73",
}
names = list(steps)
colors = [METHOD_COLORS[name] for name in names]
ax_time.barh(
    names,
    [step_times[name].median * 1e3 for name in names],
    xerr=[
        step_times[name].iqr * 1e3 / 2 for name in names
    ],  # a line as long as the IQR
    color=colors,
)
ax_time.set_xlabel("time per step (ms), median and IQR")
ax_memory.barh(names, [step_peaks[name] / 2**20 for name in names], color=colors)
ax_memory.axvline(per_sample_bytes / 2**20, color="black", linestyle=":")
ax_memory.text(per_sample_bytes / 2**20, -0.45, "B·P floats ", ha="right", va="top")
ax_memory.set(xlabel="peak memory (MiB, log scale)", xscale="log", xlim=(1, None))
ax_memory.tick_params(labelleft=False)
ax_time.invert_yaxis()
fig.suptitle(f"Clipped mean gradient of {num_params:,} parameters, B = {len(inputs)}")
plt.show()

# %%
# What to remember
# ----------------
# * A linear layer's per-sample gradient norm (weight and bias) is ``‖g‖·√(‖a‖² + 1)``: one
#   backward pass to the layer outputs gives every sample's norm.
# * For sequences, sum the element-wise product of the inputs' and output gradients' Gram
#   matrices; it pays in memory when ``2T² < I·O`` and in FLOPs when ``T·(I + O) < I·O``.
# * The clipped mean gradient is the gradient of the factor-weighted loss (a second backward
#   pass), or ``Σᵢ factorᵢ gᵢ aᵢᵀ / B`` per layer (book-keeping), and neither holds B·P floats.
# * Check ghost norms against ``vmap(grad(...))`` in float64, each sample's norm, and the
#   clipped mean gradient parameter by parameter.
