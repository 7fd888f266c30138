"""
Per-sample gradients: memory, kept buffers and where each method stops fitting
==============================================================================

Per-sample gradients are B copies of every parameter, so memory decides the largest batch.
This page measures one call's peak memory (every allocation through PyTorch's allocator,
scratch tensors inside operations included) for each method on a wide MLP: a Python loop,
``vmap(grad(...))`` plain and chunked, expanded weights, Opacus and hand-written formulas. It
shows which methods keep their buffers, an upper estimate of the batch at which each stops
fitting in 16 or 24 GiB, and what ``vmap``'s ``chunk_size`` does to memory and time. The
same methods are checked and timed on the sibling page,
:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_at_the_limit.py`.
"""

# %%
# Setup
# -----
import copy
import ctypes
import gc
import json
import platform
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# A transform whose memory is hidden: per-sample gradient norms
# -------------------------------------------------------------
# Differentially private training needs each sample's gradient *norm*. ``vmap`` of a function
# that takes one sample's gradient and returns its norm returns only B numbers, but it
# computes all B gradients at once on the way: ``vmap(f)(x)`` equals stacking ``f(x_i)`` over
# ``x.unbind(0)``, done for the whole batch in each operation.


class WideMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(start_dim=1))))))


mlp = WideMLP().to(device)
params = {name: p.detach() for name, p in mlp.named_parameters()}
num_params = sum(t.numel() for t in params.values())
batch = 256
images = torch.randn(batch, 1, 28, 28, device=device)
targets = torch.randint(0, 10, (batch,), device=device)


def one_sample_loss(params, image, target):
    return F.cross_entropy(functional_call(mlp, params, (image[None],)), target[None])


def one_sample_grad_norm(params, image, target):
    grads = grad(one_sample_loss)(params, image, target)
    return torch.stack([g.norm() for g in grads.values()]).norm()


norms = vmap(one_sample_grad_norm, in_dims=(None, 0, 0))(params, images, targets)

# Checked against a float64 loop, each norm on its own. The error is not vmap's: the same
# function on one sample at a time (float32 too) is off by about as much (within 10x).
mlp64 = copy.deepcopy(mlp).double()
reference_norms = torch.stack([
    torch.cat([g.flatten() for g in torch.autograd.grad(
        F.cross_entropy(mlp64(x[None].double()), t[None]), list(mlp64.parameters())
    )]).norm()
    for x, t in zip(images, targets)
])  # fmt: skip


def norm_error(norms):
    return ((norms.double() - reference_norms).abs() / reference_norms).max().item()


looped = torch.stack([one_sample_grad_norm(params, *s) for s in zip(images, targets)])
print(f"worst relative error of a norm: {norm_error(norms):.1e} with vmap, "
      f"{norm_error(looped):.1e} one sample at a time")  # fmt: skip
assert norm_error(norms) < 1e-5
assert 0.1 < norm_error(looped) / norm_error(norms) < 10

# %%
# The recipe: measure one call's peak memory
# ------------------------------------------
# On a GPU, PyTorch's caching allocator records its own peak of the bytes requested from it
# (``requested_bytes``; ``max_memory_allocated`` counts whole cached blocks, so it depends on what
# ran before): reset it, call, and subtract what was requested before. On a CPU, torch's profiler
# with ``profile_memory=True`` logs every allocation and free made through PyTorch's allocator,
# scratch tensors inside an operation included; memory that a library allocates by itself, outside
# that allocator, is not. Each ``[memory]`` event of its trace carries ``Total Allocated``, a
# running count of live bytes, and ``Bytes``, that event's allocation (or, negative, its free). The
# count is kept across profiles, and a tensor allocated under one profile and freed after it stays
# in it; so the peak is taken above the count just before the call's first allocation.


def peak_mib(fn, *args):
    gc.disable()  # a collection during the call, freeing older garbage, would hide its peak
    try:
        if device.type != "cpu":
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()["requested_bytes.all.current"]
            torch.cuda.reset_peak_memory_stats(device)
            fn(*args)
            torch.cuda.synchronize()
            peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
            return (peak - before) / 2**20
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as log:
            fn(*args)
    finally:
        gc.enable()
    with tempfile.TemporaryDirectory() as trace_dir:
        log.export_chrome_trace(f"{trace_dir}/trace.json")
        events = json.loads(Path(trace_dir, "trace.json").read_text())["traceEvents"]
    memory = [e["args"] for e in events if e["name"] == "[memory]"]
    before = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return (max(m["Total Allocated"] for m in memory) - before) / 2**20


# A closed form: x + 1 holds two tensors of 2**20 floats (4 MiB each) at once. Before it, a
# tensor allocated under a profile outlives it, as a per-sample result kept between calls would.
kept_past_profile = []
peak_mib(lambda: kept_past_profile.append(torch.ones(2**18, device=device)))
kept_past_profile.clear()
two_tensors = peak_mib(lambda: torch.ones(2**20, device=device) + 1)
print(f"peak of torch.ones(2**20) + 1: {two_tensors:.4f} MiB")
assert 8 <= two_tensors < 8.01

# %%
# Bound the peak with ``chunk_size``
# ----------------------------------
# ``chunk_size=c`` runs ``c`` samples at a time, so only ``c`` gradients are alive at once.
# The chunked norms are checked against the same float64 loop. For linear layers the norms
# need no per-sample gradient at all:
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_dp_sgd_ghost_norms.py`.
grad_norms = {
    chunk: vmap(one_sample_grad_norm, in_dims=(None, 0, 0), chunk_size=chunk)
    for chunk in [None, 32]
}
norm_peak = {c: peak_mib(fn, params, images, targets) for c, fn in grad_norms.items()}
all_grads_mib = batch * num_params * 4 / 2**20
print(f"all {batch} per-sample gradients: {all_grads_mib:.0f} MiB")
for chunk, peak in norm_peak.items():
    print(f"peak of vmap over the norms with chunk_size={chunk}: {peak:.1f} MiB")
assert norm_peak[None] > all_grads_mib  # every gradient is alive at once
assert norm_peak[32] < norm_peak[None] / 4  # at most 32 of them, and their scratch
assert norm_error(grad_norms[32](params, images, targets)) < 1e-5

# %%
# Per-sample gradients themselves: the result is the memory
# ---------------------------------------------------------
# When the B·P floats *are* the result, no chunking can go below them. The methods, each
# returning ``{parameter name: (B, *shape)}`` (the sibling page explains each one). The
# hand-written method keeps its output buffers from call to call. Expanded weights lives in the
# private module ``torch.nn.utils._per_sample_grad`` and may change without notice.
# ``torch.compile`` is left out to keep this page short (the sibling page times its compile).
warnings.filterwarnings("ignore", message="Full backward hook is firing")  # from Opacus


def method_fns(net):
    names, leaves = zip(*net.named_parameters())
    name_of = {p: name for name, p in net.named_parameters()}
    own = {name: p.detach() for name, p in net.named_parameters()}
    ew_net = copy.deepcopy(net)
    opacus_net = GradSampleModule(copy.deepcopy(net), loss_reduction="sum")
    kept = {}

    def loop(x, y):
        rows = [
            torch.autograd.grad(F.cross_entropy(net(xi[None]), yi[None]), leaves)
            for xi, yi in zip(x, y)
        ]
        return {name: torch.stack(col) for name, col in zip(names, zip(*rows))}

    def sample_loss(own, xi, yi):
        return F.cross_entropy(functional_call(net, own, (xi[None],)), yi[None])

    def expanded_weights(x, y):
        logits = call_for_per_sample_grads(
            ew_net, batch_size=len(x), loss_reduction="sum"
        )(x)
        F.cross_entropy(logits, y, reduction="sum").backward()
        grads = {n: p.grad_sample for n, p in ew_net.named_parameters()}
        for p in ew_net.parameters():
            p.grad_sample = None
        return grads

    def opacus(x, y):
        opacus_net.zero_grad(set_to_none=True)
        F.cross_entropy(opacus_net(x), y, reduction="sum").backward()
        return {
            n.removeprefix("_module."): p.grad_sample
            for n, p in opacus_net.named_parameters()
        }

    # Linear layers only: g_i a_iᵀ per sample, written into buffers kept between calls
    def hand_written(x, y):
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, i[0], o)))
                 for m in net.modules() if isinstance(m, nn.Linear)]  # fmt: skip
        loss = F.cross_entropy(net(x), y, reduction="sum")
        for hook in hooks:
            hook.remove()
        for (layer, a, _), g in zip(
            seen, torch.autograd.grad(loss, [o for *_, o in seen])
        ):
            w, b = name_of[layer.weight], name_of[layer.bias]
            if w not in kept or len(kept[w]) != len(x):
                kept[w], kept[b] = (
                    g.new_empty(len(x), *layer.weight.shape),
                    g.new_empty(g.shape),
                )
            torch.bmm(g[:, :, None], a.detach()[:, None], out=kept[w])
            kept[b].copy_(g)
        return dict(kept)

    chunked = vmap(grad(sample_loss), in_dims=(None, 0, 0), chunk_size=32)
    mapped = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    return {
        "loop": loop,
        "vmap": lambda x, y: mapped(own, x, y),
        "vmap chunked": lambda x, y: chunked(own, x, y),
        "expanded weights": expanded_weights,
        "opacus": opacus,
        "hand-written": hand_written,
    }


# %%
# Each method is checked on 40 samples (chunked vmap: chunks of 32 and 8, joined) against the
# float64 loop, parameter by parameter; the loss is a sum, so each gradient is its sample's own.
loop64 = method_fns(mlp64)["loop"]


def errors(grads, reference):
    """Each parameter's relative error against a float64 loop's per-sample gradients."""
    assert grads.keys() == reference.keys()
    return {
        name: ((grads[name].double() - ref).norm() / ref.norm()).item()
        for name, ref in reference.items()
    }


x40, y40 = images[:40], targets[:40]
reference40 = loop64(x40.double(), y40)  # computed once, for every method
for method, fn in method_fns(mlp).items():
    per_parameter = errors(fn(x40, y40), reference40)
    for name, error in per_parameter.items():
        assert error < 1e-5, f"{method} {name}: relative error {error:.1e}"
    worst = max(per_parameter.values())
    print(f"{method:17s} worst parameter's relative error {worst:.1e}")

# %%
# Which methods keep their buffers, and what that costs you
# ---------------------------------------------------------
# A method that writes into buffers it keeps allocates nothing for its result after the first
# call at a batch size. We call each method twice on the 40 samples, keep both results, and
# ask whether they share memory.
fns = method_fns(mlp)
keeps = {}
for method, fn in fns.items():
    first, second = fn(x40, y40), fn(x40, y40)
    keeps[method] = all(first[n].data_ptr() == second[n].data_ptr() for n in first)
    print(f"{method:17s} {'reuses its buffers' if keeps[method] else 'fresh result'}")
assert [m for m, kept in keeps.items() if kept] == ["hand-written"]

# %%
# The catch: the tensors returned are the buffers. A second call on other data overwrites the
# first result in place. Keep a result past the next call with ``.clone()`` (which costs the
# B·P floats again), or consume it (clip, sum) before calling again. Each result is checked
# against the float64 loop on the samples it should hold.
hand_written = fns["hand-written"]
first = hand_written(x40, y40)
first_saved = {name: g.clone() for name, g in first.items()}
hand_written(images[40:80], targets[40:80])
now_holds = max(errors(first, loop64(images[40:80].double(), targets[40:80])).values())
clone_holds = max(errors(first_saved, reference40).values())
print(f"the first result vs the second call's samples: worst error {now_holds:.1e}; "
      f"its clone vs the first call's samples: {clone_holds:.1e}")  # fmt: skip
assert now_holds < 1e-5, "the first result was not overwritten"
assert clone_holds < 1e-5, "the clone did not keep the first result"

# %%
# Peak memory, and where each method stops fitting
# ------------------------------------------------
# Each method's peak is measured at two batch sizes, with new buffers each time, so that the
# hand-written method's buffers count. The difference divided by the difference in batch size
# is the memory per extra sample; each method stores B·P floats, so it must be at least one
# sample's gradients, and the assert checks it. With the intercept, it says where a method runs
# out of 16 or 24 GiB, rounded to hundreds. Read these as upper estimates: the extrapolation
# leaves out the process's own memory (libraries, weights, data); on a GPU the CUDA context
# is measured and subtracted, but the caching allocator rounds blocks up and keeps freed ones,
# so it can reserve more than the requested peak measured here.
memory_batches = [64, 256]
peaks = {}
for size in memory_batches:
    for method, fn in method_fns(mlp).items():
        peaks[method, size] = peak_mib(fn, images[:size], targets[:size])
per_sample_mib = num_params * 4 / 2**20
outside_mib = 0.0
if device.type != "cpu":
    free, total = torch.cuda.mem_get_info()
    outside_mib = (total - free - torch.cuda.memory_reserved()) / 2**20
    print(f"outside PyTorch's allocator (CUDA context, more): {outside_mib:.0f} MiB")
limits, ratio = {}, {}
small, large = memory_batches
fc1_share = mlp.fc1.weight.numel() / num_params
print(f"one sample's gradients: {per_sample_mib:.2f} MiB, {fc1_share:.2f} fc1.weight")
for method in fns:
    slope = (peaks[method, large] - peaks[method, small]) / (large - small)
    intercept = peaks[method, small] - slope * small
    ratio[method] = slope / per_sample_mib
    limits[method] = {
        gib: int((gib * 1024 - outside_mib - intercept) / slope) for gib in (16, 24)
    }
    print(
        f"{method:17s} peak {peaks[method, large]:6.0f} MiB at batch {large}, "
        f"{slope:.2f} MiB per sample ({ratio[method]:.2f}x the result); "
        f"out of memory above about {round(limits[method][16], -2):,} (16 GiB), "
        f"{round(limits[method][24], -2):,} (24 GiB)"
    )
    assert slope > 0.99 * per_sample_mib, method  # it holds every sample's gradients

# %%
# Reading the ratios, from the sources of torch 2.13 and Opacus 1.6: the loop keeps each
# sample's gradients in a list, then stacks them, so it holds the result twice. Chunked vmap
# and Opacus hold one extra copy of ``fc1.weight``'s per-sample gradients (share above).
# Chunked vmap joins each output's chunks with ``torch.cat``, and the pieces of
# ``fc1.weight`` live until they are joined. Opacus copies each layer's per-sample gradients
# into a zero-filled buffer of its own while the tensor it computed them in is still alive.
# Plain vmap, expanded weights and the hand-written method hold little beyond the result.
assert abs(ratio["loop"] - 2) < 0.05
assert abs(ratio["vmap chunked"] - 1 - fc1_share) < 0.05
assert abs(ratio["opacus"] - 1 - fc1_share) < 0.05
for method in ["vmap", "expanded weights", "hand-written"]:
    assert abs(ratio[method] - 1) < 0.05, method

# %%
# Keeping freed memory for the timings
# ------------------------------------
# The calls timed next allocate hundreds of MiB; glibc would return them to the kernel and fault
# in fresh pages at the next call, so a call's time would depend on what ran before. This cell
# asks glibc to keep freed memory (why: :doc:`/reading-timings`); warm up first all the same.
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>
    assert libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1)

# %%
# ``chunk_size``: memory and time
# -------------------------------
# The norms and the full per-sample gradients, at batch 256, for several chunk sizes: each
# point is one call's peak and its median time over at least five blocks (IQR and the number
# of blocks beside it; the timer's block-size estimate runs the call first, as a warm-up).
# ``None`` (the default) maps the whole batch at once.
chunk_sizes = [32, 128, None]
curves = {}
for label, fn in {
    "norms": one_sample_grad_norm,
    "gradients": grad(one_sample_loss),
}.items():
    for chunk in chunk_sizes:
        mapped = vmap(fn, in_dims=(None, 0, 0), chunk_size=chunk)
        clock = benchmark.Timer(
            stmt="mapped(*args)",
            globals={"mapped": mapped, "args": (params, images, targets)},
            num_threads=torch.get_num_threads(),
        )
        timing = clock.blocked_autorange(min_run_time=0.2)
        while len(timing.times) < 5:  # slow calls, few blocks: more of about 50 ms each
            extra = clock.timeit(max(1, round(0.05 / timing.median)))
            timing = benchmark.Measurement.merge([timing, extra])[0]
        peak = peak_mib(mapped, params, images, targets)
        curves[label, chunk] = peak, timing.median * 1e3
        print(
            f"{label:9s} chunk_size={chunk!s:4s} peak {peak:6.1f} MiB, "
            f"{timing.median * 1e3:7.1f} ms (IQR {timing.iqr * 1e3:.3g} ms over "
            f"{len(timing.times)} blocks)"
        )
slowdown = curves["norms", 32][1] / curves["norms", None][1]
pace = "takes {:.2f}x the time of" if slowdown >= 1 else "is {:.2f}x faster than"
print("norms: chunk_size=32", pace.format(max(slowdown, 1 / slowdown)), "no chunks")
assert curves["norms", 32][0] < curves["norms", None][0] / 4
assert curves["gradients", 32][0] > curves["gradients", None][0]  # it raised the peak

# %%
# The figure: on the left, the largest batch that fits (an upper estimate) from the measured
# memory per sample; on the right, what ``chunk_size`` buys for the norms and the gradients.
METHOD_COLORS = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "vmap chunked": "#44AA99",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
}
fig, (ax_fit, ax_chunk) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
rows = range(len(fns))
colors = [METHOD_COLORS[m] for m in fns]
ax_fit.barh(
    rows, [limits[m][24] for m in fns], color=colors, alpha=0.45, label="24 GiB"
)
ax_fit.barh(rows, [limits[m][16] for m in fns], color=colors, label="16 GiB")
ax_fit.set_yticks(rows, list(fns))
ax_fit.invert_yaxis()
ax_fit.set_xlabel("largest MLP batch that fits (upper estimate)")
ax_fit.legend(fontsize=8, loc="lower right")
for label, marker in [("norms", "o"), ("gradients", "s")]:
    points = [curves[label, c] for c in chunk_sizes]
    ax_chunk.plot(
        *zip(*points), marker=marker, color=METHOD_COLORS["vmap chunked"], label=label
    )
    for chunk, point in zip(chunk_sizes, points):
        ax_chunk.annotate(f"{chunk}", point, textcoords="offset points", xytext=(4, 4))
ax_chunk.axvline(all_grads_mib, color="black", linestyle="--", linewidth=1)
ax_chunk.set(xlabel="peak memory (MiB); dashed: all 256 gradients", ylabel="time (ms)")
ax_chunk.set_title("vmap over 256 samples, labelled by chunk_size")
ax_chunk.legend(fontsize=8)
plt.show()

# %%
# What to remember
# ----------------
# - Measure one call's peak with the profiler's ``[memory]`` events on a CPU, or the CUDA
#   allocator's peak of requested bytes on a GPU; both count what goes through PyTorch's
#   allocator, scratch tensors inside operations included.
# - ``chunk_size`` bounds what a transform holds per chunk: it shrank the peak for per-sample
#   norms and raised it for per-sample gradients (chunks and joined result live together).
# - Buffers a method keeps are returned as its result: the next call overwrites them, so
#   ``.clone()`` what you keep.
# - Size a batch from the peak per sample measured at two batch sizes, plus what the
#   measurement leaves out (the process, the CUDA context).
