"""
Per-sample gradients at the limit: every method against the floor
=================================================================

There are at least seven ways to get one gradient per example out of PyTorch, and the
question every user of per-sample gradients asks is which one to use, and how far it is from
the best possible. This page answers both on the machine it ran on. Every method is checked,
parameter by parameter, against a float64 loop; every method is timed in the same run as
the *floor*, the least that any method could cost; and every method's peak memory is
measured, so you can see where each one stops fitting. You will learn what the floor is and
which of its two parts binds for a convolutional network and for a wide MLP, what a CPU
pays for fresh memory and which methods pay it, how the per-layer formulas that Opacus and
PyTorch's expanded weights implement work by hand, and what ``chunk_size`` and
``torch.compile`` change.

The methods: a Python loop, ``vmap(grad(...))`` (plain, chunked and compiled), PyTorch's
expanded weights, Opacus' ``GradSampleModule``, and hand-written per-layer formulas.
"""

# %%
# Where this page ran
# -------------------
# The hardware decides every number below, so the page says what it ran on. We use the GPU
# when there is one and seed the random number generator.
import copy
import ctypes
import gc
import mmap
import os
import platform
import re
import statistics
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
# On NVIDIA GPUs, cuDNN runs float32 convolutions in TF32 by default, with a 10-bit mantissa.
# The checks on this page compare float32 results with float64 ones, so we ask cuDNN for full
# float32; on a CPU the setting changes nothing.
torch.backends.cudnn.allow_tf32 = False


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
# As on the first per-sample page, we ask glibc to keep freed memory in the process and reuse
# it, so that a call's time does not depend on what the process did before. What fresh pages
# cost is measured below with memory mapped straight from the kernel, outside malloc. Without
# glibc the cell changes nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


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
# Times are medians over interleaved rounds of :class:`torch.utils.benchmark.Timer`, after
# two untimed calls, using all of torch's threads. Peak memory of one call: on a GPU from the
# CUDA allocator's record of the call; on a CPU with glibc from malloc's own count of the
# bytes it has handed out, read after every tensor operation of the call by a
# ``TorchDispatchMode`` (a hook that sees each operation; it lives in
# ``torch.utils._python_dispatch``, a private module). Resident memory would be the other
# choice, but it counts the heap pages a call touches, and where a freed block is reused
# depends on what the process did before, so the same call measured that way differs from
# one fresh process to the next. Matrix products and convolutions run in full float32 (no
# TF32).
torch.set_float32_matmul_precision("highest")


def median_times_ms(methods, rounds=5, min_run_time=0.05):
    """Median time of each method in ``{name: fn}``, in ms, round after round.

    Two untimed calls of each method first. Then the methods take turns, so that a slow
    spell of the machine hits all of them alike.
    """
    for fn in methods.values():
        fn()
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


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): the heap's counters, in bytes."""

    _fields_ = [
        (field, ctypes.c_size_t)
        for field in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                      "fsmblks", "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


class PeakLiveMemory(TorchDispatchMode):
    """Reads malloc's count of live bytes (heap chunks in use plus mmapped blocks) after
    every tensor operation run under it, and keeps the highest."""

    def __init__(self, mallinfo2):
        super().__init__()
        self.mallinfo2 = mallinfo2
        self.peak = self.live_bytes()

    def live_bytes(self):
        info = self.mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.live_bytes())
        return result


def cpu_peak_bytes(fn):
    """Peak of live malloc'd memory during fn(), above where it started; None without
    glibc 2.33's mallinfo2. It counts what is allocated, not which pages are touched, so it
    does not depend on where in the heap earlier cells left free space."""
    libc = glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = MallInfo2  # a struct returned by value
    tracker = PeakLiveMemory(mallinfo2)
    start = tracker.peak
    with tracker:
        fn()
    return tracker.peak - start


def peak_mib(fn):
    # Garbage from earlier cells, if collected during the call, would hide part of its peak.
    gc.collect()
    peak = cuda_peak_bytes(fn) if device.type == "cuda" else cpu_peak_bytes(fn)
    return None if peak is None else peak / 2**20


# %%
# Two models, two regimes
# -----------------------
# The convolutional network of PyTorch's per-sample-gradients tutorial (1.2 million
# parameters), and a wide MLP on the same flattened images. The CNN spends its time on
# convolutions; the MLP does little arithmetic per parameter, so for it the B·P floats of the
# result are what cost. Both return logits, and the loss is cross-entropy.


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, images):
        hidden = F.relu(self.conv1(images))
        hidden = F.max_pool2d(F.relu(self.conv2(hidden)), 2)
        hidden = F.relu(self.fc1(hidden.flatten(start_dim=1)))
        return self.fc2(hidden)


class WideMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 10)

    def forward(self, images):
        hidden = F.relu(self.fc1(images.flatten(start_dim=1)))
        return self.fc3(F.relu(self.fc2(hidden)))


models = {"CNN": SmallCNN().to(device), "MLP": WideMLP().to(device)}
for model_name, net in models.items():
    print(f"{model_name}: {sum(p.numel() for p in net.parameters()):,} parameters")


def make_batch(batch_size, dtype=torch.float32):
    generator = torch.Generator().manual_seed(batch_size)
    images = torch.randn(batch_size, 1, 28, 28, generator=generator, dtype=dtype)
    targets = torch.randint(0, 10, (batch_size,), generator=generator)
    return images.to(device), targets.to(device)


# %%
# The methods
# -----------
# Each method takes a model, images and targets, and returns a dictionary from parameter name
# to a tensor of shape ``(B, *parameter.shape)``: the gradient of each sample's own
# cross-entropy loss. First the two from the first per-sample page: the **loop**, one backward
# pass per sample, and **vmap(grad)**, with ``chunk_size`` as an option. ``chunk_size=16``
# maps 16 samples at a time and concatenates the pieces.


def loop_grads(net, images, targets):
    weights = list(net.parameters())
    per_sample = []
    for image, target in zip(images, targets):
        loss = F.cross_entropy(net(image.unsqueeze(0)), target.unsqueeze(0))
        per_sample.append(torch.autograd.grad(loss, weights))
    names = [name for name, _ in net.named_parameters()]
    return {name: torch.stack(grads) for name, grads in zip(names, zip(*per_sample))}


def vmap_grad_fn(net, chunk_size=None):
    params = {name: p.detach() for name, p in net.named_parameters()}

    def sample_loss(params, image, target):
        logits = functional_call(net, params, (image.unsqueeze(0),))
        return F.cross_entropy(logits, target.unsqueeze(0))

    mapped = vmap(grad(sample_loss), in_dims=(None, 0, 0), chunk_size=chunk_size)
    return lambda images, targets: mapped(params, images, targets)


# %%
# **Expanded weights** is PyTorch's own implementation of the per-layer formulas:
# ``call_for_per_sample_grads`` runs the module with parameters that know the batch, and one
# ordinary backward pass leaves a ``grad_sample`` on every parameter. It lives in
# ``torch.nn.utils._per_sample_grad``: the leading underscore marks a **private API**, which
# may change without notice. ``loss_reduction="mean"`` tells it that the loss is a batch mean,
# so that it scales the results back to per-sample losses.
#
# **Opacus** (Meta's differential-privacy library) wraps a module in ``GradSampleModule``,
# whose hooks compute the same per-layer formulas. Each method gets its own copy of the model,
# so that one method's hooks never run inside another's timing.


def expanded_weights_fn(net):
    net = copy.deepcopy(net)

    def per_sample(images, targets):
        for p in net.parameters():
            p.grad_sample = None
        logits = call_for_per_sample_grads(
            net, batch_size=len(images), loss_reduction="mean"
        )(images)
        F.cross_entropy(logits, targets).backward()
        return {name: p.grad_sample for name, p in net.named_parameters()}

    return per_sample


# Opacus' hooks make PyTorch warn that the first layer's input (the images) requires no
# gradient. That is expected here, so we silence that one message.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def opacus_fn(net):
    wrapped = GradSampleModule(copy.deepcopy(net), loss_reduction="mean")

    def per_sample(images, targets):
        wrapped.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(images), targets).backward()
        return {
            name.removeprefix("_module."): p.grad_sample
            for name, p in wrapped.named_parameters()
        }

    return per_sample


# %%
# Hand-written per-layer formulas
# -------------------------------
# Why are per-sample gradients cheap at all? For a linear layer ``y = W a + b``, the gradient
# of sample ``i``'s loss with respect to ``W`` is the outer product of the gradient that
# reaches the layer's output, ``g_i``, and the layer's input, ``a_i``. The ordinary weight
# gradient is the *sum* of these outer products over the batch; the per-sample method keeps
# them apart. A 2-d convolution is a linear layer applied at every position of the unfolded
# input (:func:`~torch.nn.functional.unfold`), so its per-sample weight gradient is the same
# product, summed over positions.
#
# We capture each layer's input and output with forward hooks, take the gradient of the
# *summed* loss with respect to the outputs (each sample's loss depends only on its own
# outputs, so this is each sample's own output gradient), and write the products with
# :func:`torch.bmm` into buffers that the method allocates once and reuses. That last choice
# matters on a CPU, as the section on fresh pages shows. Note that no parameter gradient is
# computed at all.


@contextmanager
def capture_layers(net):
    """Record the (layer, input, output) of every Linear and Conv2d during a forward pass."""
    records = []
    handles = [
        layer.register_forward_hook(
            lambda layer, inputs, output: records.append((layer, inputs[0], output))
        )
        for layer in net.modules()
        if isinstance(layer, (nn.Linear, nn.Conv2d))
    ]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def hand_written_fn(net):
    names = {p: name for name, p in net.named_parameters()}
    buffers = {}

    def per_sample(images, targets):
        batch_size = len(images)
        with capture_layers(net) as records:
            logits = net(images)
        loss = F.cross_entropy(logits, targets, reduction="sum")
        output_grads = torch.autograd.grad(loss, [out for _, _, out in records])
        result = {}
        for (layer, layer_in, _), g in zip(records, output_grads):
            layer_in = layer_in.detach()
            w_name, b_name = names[layer.weight], names[layer.bias]
            if w_name not in buffers or len(buffers[w_name]) != batch_size:
                buffers[w_name] = layer_in.new_empty(batch_size, *layer.weight.shape)
                buffers[b_name] = layer_in.new_empty(batch_size, *layer.bias.shape)
            weight_out, bias_out = buffers[w_name], buffers[b_name]
            if isinstance(layer, nn.Linear):
                # (B, out, 1) @ (B, 1, in): one outer product per sample
                torch.bmm(g.unsqueeze(2), layer_in.unsqueeze(1), out=weight_out)
                bias_out.copy_(g)
            else:
                patches = F.unfold(
                    layer_in,
                    layer.kernel_size,
                    dilation=layer.dilation,
                    padding=layer.padding,
                    stride=layer.stride,
                )  # (B, in·kh·kw, positions)
                g = g.flatten(start_dim=2)  # (B, out, positions)
                torch.bmm(
                    g,
                    patches.transpose(1, 2),
                    out=weight_out.view(batch_size, g.shape[1], -1),
                )
                torch.sum(g, dim=2, out=bias_out)
            result[w_name], result[b_name] = weight_out, bias_out
        return result

    return per_sample


# %%
# Checking every method against a float64 loop
# --------------------------------------------
# Every method runs in float32 on the same batch (64 images for the MLP; the first 16 of them
# for the CNN, whose float64 loop is slow), and each parameter's result is compared on its own
# with the loop in float64: relative error ``‖g − g_ref‖ / ‖g_ref‖`` per
# parameter. A bound of 1e-3 allows for float32 rounding (which the ReLU kinks amplify a
# little in the convolutions) and still catches any wrong or missing piece, whose error is of
# order one. ``torch.compile`` is checked on the MLP, where this page uses it (see below). It
# compiles with ``dynamic=True``: one graph for any batch size, so the graph checked here is
# the very one timed at every batch size below, and it is compiled once.


def method_fns(net, compiled=None):
    fns = {
        "loop": lambda images, targets: loop_grads(net, images, targets),
        "vmap": vmap_grad_fn(net),
        "vmap chunked": vmap_grad_fn(net, chunk_size=16),
        "expanded weights": expanded_weights_fn(net),
        "opacus": opacus_fn(net),
        "hand-written": hand_written_fn(net),
    }
    if compiled is not None:
        fns["compiled"] = compiled
    return fns


def check_method(name, grads, reference, bound=1e-3):
    errors = {
        param: ((grads[param].double() - ref).norm() / ref.norm()).item()
        for param, ref in reference.items()
    }
    for param, error in errors.items():
        assert grads[param].shape == reference[param].shape, (name, param)
        assert error < bound, f"{name}: {param} has relative error {error:.2e}"
    return max(errors.values())


def float64_reference(net, images, targets):
    net64 = copy.deepcopy(net).double()
    return loop_grads(net64, images.double(), targets)


check_images, check_targets = make_batch(64)
mlp_compiled = torch.compile(vmap_grad_fn(models["MLP"]), dynamic=True)
start = time.perf_counter()
mlp_compiled(check_images, check_targets)  # the first call compiles
compile_seconds = time.perf_counter() - start
check_sizes = {"CNN": 16, "MLP": len(check_images)}
for model_name, net in models.items():
    images, targets = (
        check_images[: check_sizes[model_name]],
        check_targets[: check_sizes[model_name]],
    )
    reference = float64_reference(net, images, targets)
    fns = method_fns(net, mlp_compiled if model_name == "MLP" else None)
    for method, fn in fns.items():
        worst = check_method(method, fn(images, targets), reference)
        print(f"{model_name} {method:17s} worst parameter's relative error {worst:.1e}")

# %%
# The check can fail: drop the bias term from the hand-written method's result and the bias
# is wrong in every layer, while the weights stay right.
broken = hand_written_fn(models["MLP"])(check_images, check_targets)
broken = {
    name: torch.zeros_like(g) if "bias" in name else g for name, g in broken.items()
}
try:
    check_method("hand-written without biases", broken, reference)
except AssertionError as error:
    print("caught:", error)
    assert "bias has relative error 1.00e+00" in str(error)
else:
    raise AssertionError("a zeroed bias gradient passed the check")

# %%
# The floor
# ---------
# No method can cost less than the larger of two things, both measured here:
#
# (a) **one ordinary batched forward and backward pass** on the same batch. The per-sample
#     formulas do the same multiply-adds as the ordinary weight gradient, only without the sum
#     over the batch;
#
# (b) **writing B·P floats**, the size of the result. On a CPU this has two prices. Into
#     memory the process already holds, it is a memory-bandwidth cost: we fill a preallocated
#     tensor. Into fresh pages, the kernel must also fault in and zero every 4 KiB page first:
#     we map fresh anonymous memory with Python's ``mmap`` and fill it.
#
# So there are two floors: ``max(a, b held)`` for code whose memory is reused, and
# ``max(a, b fresh)`` for code that gets its result from fresh pages. On a GPU the caching
# allocator reuses memory, and only the first applies.


def batched_step_fn(net):
    weights = list(net.parameters())

    def batched(images, targets):
        return torch.autograd.grad(F.cross_entropy(net(images), targets), weights)

    return batched


def write_held_fn(num_floats):
    target = torch.empty(num_floats, device=device)
    return lambda: target.fill_(1.0)


def write_fresh():
    # Fresh anonymous pages from the kernel, filled: page faults and zeroing included.
    pages = mmap.mmap(-1, fresh_bytes)
    tensor = torch.frombuffer(pages, dtype=torch.float32)
    tensor.fill_(1.0)
    del tensor
    pages.close()


# %%
# Every method against the floor, over batch sizes
# ------------------------------------------------
# For each model and batch size, the floor's parts and every method take turns in the same
# timing rounds. The CNN runs at the tutorial's batch of 64; the MLP over a range of batch
# sizes. ``torch.compile`` runs on the MLP only, and at the batch sizes of this page's target,
# 64 and up: compiling the CNN's ``vmap(grad)`` as well would take longer than this page's
# one-minute budget on a small CPU. Its compile, in the first call above, is timed on its own
# and left out of the medians. (Inductor caches compiled code on disk, so a second run of
# this page compiles faster than the first.)
batch_sizes = {"CNN": [64], "MLP": [16, 64, 256]}
if device.type == "cuda":
    batch_sizes = {"CNN": [64, 256], "MLP": [64, 256, 1024]}
compiled_batch_sizes = [b for b in batch_sizes["MLP"] if b >= 64]

results = {}  # (model, batch size) -> {method or floor part: median ms}
for model_name, net in models.items():
    num_params = sum(p.numel() for p in net.parameters())
    batched_step = batched_step_fn(net)
    for batch_size in batch_sizes[model_name]:
        use_compiled = model_name == "MLP" and batch_size in compiled_batch_sizes
        fns = method_fns(net, mlp_compiled if use_compiled else None)
        images, targets = make_batch(batch_size)
        fresh_bytes = batch_size * num_params * 4
        timed = {
            "batched": partial(batched_step, images, targets),
            "write held": write_held_fn(batch_size * num_params),
        }
        if device.type == "cpu" and model_name == "MLP":
            timed["write fresh"] = write_fresh
        for method, fn in fns.items():
            timed[method] = partial(fn, images, targets)
        # Sub-millisecond calls get longer measurements, so that noise averages out.
        small = device.type == "cpu" and batch_size < 64
        results[model_name, batch_size] = median_times_ms(
            timed,
            rounds=3
            if model_name == "CNN"
            else 5,  # the CNN's calls are long and steady
            min_run_time=0.1 if small else 0.05,
        )
        del timed, fns
print(
    f"torch.compile, MLP, first call (batch {len(check_images)}, compiles for any batch "
    f"size): {compile_seconds:.1f} s"
)

# %%
# The table gives each method's time as a multiple of the floor with reused memory, and the
# floor's parts in milliseconds. The last lines are printed in a fixed form, so that they can
# be read mechanically.
METHODS = ["loop", "vmap", "vmap chunked", "compiled", "expanded weights", "opacus",
           "hand-written"]  # fmt: skip


def floor_ms(times, fresh=False):
    return max(times["batched"], times["write fresh" if fresh else "write held"])


for (model_name, batch_size), times in results.items():
    floor = floor_ms(times)
    binding = "(a) batched" if times["batched"] >= times["write held"] else "(b) write"
    print(
        f"{model_name} B={batch_size:<4d} floor {floor:7.2f} ms, set by {binding}: "
        f"batched {times['batched']:.2f} ms, write held {times['write held']:.2f} ms"
        + (
            f", write fresh {times['write fresh']:.2f} ms"
            if "write fresh" in times
            else ""
        )
    )
    print(
        "    "
        + "  ".join(f"{m} {times[m] / floor:.2f}x" for m in METHODS if m in times)
    )

best = {}
for (model_name, batch_size), times in results.items():
    if model_name == "MLP":
        method = min((m for m in METHODS if m in times), key=times.get)
        best[batch_size] = method, times[method] / floor_ms(times)
for batch_size, (method, ratio) in best.items():
    print(f"best exact method at batch {batch_size}: {method}, {ratio:.2f} x the floor")
for batch_size in compiled_batch_sizes:
    verdict = "met" if best[batch_size][1] <= 2 else "missed"
    print(f"target (within 2x of the floor at batch {batch_size}): {verdict}")
# The floor is itself a measurement: a method that writes its B·P floats as fast as the plain
# fill does lands on it, and the noise of timing two calls can put it a little below. Further
# below can mean that the batched step is not the fastest way to do its own work. It runs
# eagerly, kernel by kernel, and where its time hardly grows with the batch (as on a GPU at
# these sizes), it pays for launches and Python rather than arithmetic or memory, which
# compiled code fuses away. The page prints which case each result below the floor is in,
# from this run's measurements. It asserts nothing about timings: a slow spell of the machine
# during the floor's rounds can also put a method below it, and must not fail the page.
mlp_sizes = batch_sizes["MLP"]
batched_growth = (
    results["MLP", mlp_sizes[-1]]["batched"] / results["MLP", mlp_sizes[0]]["batched"]
)
print(
    f"MLP batched step from batch {mlp_sizes[0]} to {mlp_sizes[-1]}: "
    f"{batched_growth:.2f} x the time"
)
launch_bound = batched_growth < 2
for (model_name, batch_size), times in results.items():
    for method in METHODS:
        if method in times and times[method] < floor_ms(times):
            ratio = times[method] / floor_ms(times)
            if ratio >= 0.9:
                why = "on the floor within the noise of timing two calls"
            elif launch_bound:
                why = "below an eager batched step whose time is launch overhead, not work"
            else:
                why = (
                    "below the floor by more than usual timing noise, with a batched step "
                    "that is not launch-bound: a fresh run shows whether it repeats"
                )
            print(f"{model_name} {method} at batch {batch_size}: {ratio:.2f} x, {why}")

# %%
# The figure plots the same ratios for the MLP, and the CNN's at its one batch size. The
# dashed line is the floor; the dotted one is twice the floor, the target for the best method.
fig, axes = plt.subplots(
    1, 2, figsize=(9, 3.8), layout="constrained", width_ratios=[1, 2]
)
cnn_times = results["CNN", batch_sizes["CNN"][0]]
cnn_methods = [m for m in METHODS if m in cnn_times]
axes[0].barh(
    cnn_methods,
    [cnn_times[m] / floor_ms(cnn_times) for m in cnn_methods],
    color=[METHOD_COLORS[m] for m in cnn_methods],
)
axes[0].invert_yaxis()
axes[0].set_title(f"CNN, batch {batch_sizes['CNN'][0]}")
axes[0].set_xlabel("time / floor")
for method in METHODS:
    points = [
        (b, results["MLP", b][method] / floor_ms(results["MLP", b]))
        for b in batch_sizes["MLP"]
        if method in results["MLP", b]
    ]
    axes[1].plot(*zip(*points), marker="o", color=METHOD_COLORS[method], label=method)
axes[1].set_xscale("log", base=2)
axes[1].set_yscale("log")
axes[1].set_xticks(batch_sizes["MLP"], [str(b) for b in batch_sizes["MLP"]])
axes[1].set_xlabel("batch size")
axes[1].set_ylabel("time / floor (memory reused)")
axes[1].set_title(f"MLP on {device.type.upper()}")
axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
axes[0].axvline(1, color="black", linestyle="--", linewidth=1)
axes[1].axhline(1, color="black", linestyle="--", linewidth=1)
axes[1].axhline(2, color="black", linestyle=":", linewidth=1)
axes[0].axvline(2, color="black", linestyle=":", linewidth=1)
plt.show()

# %%
# Which price of memory each method pays
# --------------------------------------
# Everything above ran with freed memory reused, so every method paid the first price of
# writing its result. Which price a method pays in general depends on one thing: whether it
# allocates its result anew on every call. Such a method gets whatever memory the allocator
# hands it: reused memory under this page's policy, but fresh pages whenever glibc's default
# policy serves a large block from the kernel, and then its floor is ``max(a, b fresh)``. A
# method that writes into buffers it keeps pays the first price under any policy.
#
# We check which methods keep their buffers by calling each one twice, keeping both results,
# and asking whether the two results share memory. (Counting page faults per call would
# measure the same thing, but glibc sometimes serves a block from memory it still holds even
# under its default policy, so the counts depend on the process's history.)


def reuses_its_buffers(fn, images, targets):
    first = fn(images, targets)
    first_address = {name: g.data_ptr() for name, g in first.items()}
    second = fn(images, targets)
    return all(second[name].data_ptr() == first_address[name] for name in second)


batch_size = batch_sizes["MLP"][-1]
images, targets = make_batch(batch_size)
net = models["MLP"]
num_params = sum(p.numel() for p in net.parameters())
times = results["MLP", batch_size]
print(
    f"MLP, batch {batch_size}: the result is {batch_size * num_params * 4 / 2**20:.0f} MiB."
    f" Floor with memory reused {floor_ms(times):.1f} ms"
    + (
        f", with fresh pages {floor_ms(times, True):.1f} ms"
        if "write fresh" in times
        else ""
    )
)
fns = method_fns(net, mlp_compiled)
keeps_buffers = {m: reuses_its_buffers(fns[m], images, targets) for m in METHODS}
for method in METHODS:
    price = (
        "reused memory, always" if keeps_buffers[method] else "whatever malloc gives"
    )
    print(f"{method:17s} result written into {price}")
assert keeps_buffers["hand-written"]
assert not any(keeps_buffers[m] for m in METHODS if m != "hand-written")
del fns

# %%
# Peak memory, and where each method stops fitting
# ------------------------------------------------
# Each method's peak memory is measured for the CNN at two batch sizes. The difference,
# divided by the difference in batch size, is the memory each extra sample costs; with the
# intercept, it says at which batch size a method runs out of a 16 GB GPU or a 24 GB machine.
# Nothing is run at those sizes: the limits are computed from the two measurements (on a CPU
# build, the GPU's limit assumes the same bytes per sample, which PyTorch's allocator rounds
# up a little).
memory_batches = [16, 64]
peaks = {}
net = models["CNN"]
fns = method_fns(net)
for batch_size in memory_batches:
    images, targets = make_batch(batch_size)
    for method, fn in fns.items():
        peaks[method, batch_size] = peak_mib(partial(fn, images, targets))
    peaks["batched", batch_size] = peak_mib(
        partial(batched_step_fn(net), images, targets)
    )

limits = {}
if peaks["vmap", memory_batches[0]] is not None:
    small, large = memory_batches
    per_sample_result_mib = sum(p.numel() for p in net.parameters()) * 4 / 2**20
    print(f"CNN: each sample's gradients are {per_sample_result_mib:.2f} MiB")
    for method in ["batched", *fns]:
        slope = (peaks[method, large] - peaks[method, small]) / (large - small)
        intercept = peaks[method, small] - slope * small
        limits[method] = {
            capacity: int((capacity * 1024 - intercept) / slope)
            for capacity in (16, 24)
        }
        print(
            f"{method:17s} peak {peaks[method, large]:7.0f} MiB at batch {large}, "
            f"{slope:5.2f} MiB per sample ({slope / per_sample_result_mib:.2f}x the "
            f"result); out of memory above batch {limits[method][16]:,} (16 GiB), "
            f"{limits[method][24]:,} (24 GiB)"
        )
    for method in fns:
        assert (
            limits[method][16] < limits["batched"][16]
        )  # every method stores B·P floats
else:
    print("peak memory is measured on CUDA, and on CPUs with glibc 2.33 or later")

# %%
# ``chunk_size``: time against memory
# -------------------------------------
# ``vmap``'s ``chunk_size`` maps a few samples at a time, which bounds the memory of the
# *intermediate* tensors. For per-sample gradients, though, the result itself is B·P floats,
# and the chunks are concatenated into it at the end: so chunking cannot bring the peak below
# the result, and the concatenation adds one more copy. The measurement shows how much of that
# is left here.
chunk_sizes = [4, 16, 64]
images, targets = make_batch(64)
chunked = {c: vmap_grad_fn(net, chunk_size=c) for c in chunk_sizes}
chunk_times = median_times_ms(
    {c: partial(fn, images, targets) for c, fn in chunked.items()}, rounds=3
)
chunk_peaks = {c: peak_mib(partial(fn, images, targets)) for c, fn in chunked.items()}
for c in chunk_sizes:
    peak = "n/a" if chunk_peaks[c] is None else f"{chunk_peaks[c]:.0f} MiB"
    print(f"chunk_size={c:<3d} {chunk_times[c]:7.1f} ms, peak {peak}")
if limits:  # the smallest chunk saves no memory: the result dominates
    assert min(chunk_peaks.values()) > 0.9 * peaks["vmap", 64]

# %%
# The second figure: on the left, the batch size at which each method runs out of memory
# (computed from its measured memory per sample); on the right, what ``chunk_size`` buys.
if limits:
    fig, (ax_fit, ax_chunk) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
    shown = ["batched", *fns]
    colors = [METHOD_COLORS[m] for m in shown]
    rows = range(len(shown))
    ax_fit.barh(rows, [limits[m][24] for m in shown], color=colors, alpha=0.45,
                label="24 GiB machine")  # fmt: skip
    ax_fit.barh(rows, [limits[m][16] for m in shown], color=colors, label="16 GiB GPU")
    ax_fit.set_yticks(rows, shown)
    ax_fit.invert_yaxis()
    ax_fit.set_xscale("log")
    ax_fit.set_xlabel("largest CNN batch that fits")
    ax_fit.legend(fontsize=8, loc="lower right")
    ax_chunk.plot(
        [chunk_peaks[c] for c in chunk_sizes],
        [chunk_times[c] for c in chunk_sizes],
        marker="o",
        color=METHOD_COLORS["vmap chunked"],
    )
    for c in chunk_sizes:
        ax_chunk.annotate(f"chunk_size={c}", (chunk_peaks[c], chunk_times[c]),
                          textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
    ax_chunk.axvline(
        per_sample_result_mib * 64, color="black", linestyle="--", linewidth=1
    )
    ax_chunk.set_xlabel("peak memory (MiB); dashed: the result itself")
    ax_chunk.set_ylabel("time (ms)")
    ax_chunk.set_title("CNN, batch 64: vmap's chunk_size")
    plt.show()

# %%
# What dominates each method's time
# ---------------------------------
# **The loop** pays a fixed price per operation (Python, the dispatcher, and on a GPU a kernel
# launch) once per sample, and works on tiny tensors that use the hardware badly. On a GPU
# that fixed price is nearly the whole cost of a small network's pass, which is why vmap beats
# the loop by more than an order of magnitude there (PyTorch's tutorial reports up to 25x). On
# a CPU, one sample's convolutions take long enough to hide much of it, so the gap is smaller
# for the CNN; the MLP's per-sample work is tiny, and the loop is further from the floor.
#
# **vmap(grad)** does the batched arithmetic, but in eager mode each operation writes a fresh
# intermediate, and the per-sample weight gradients go through a batched matrix product whose
# result is then copied into place. For the MLP, where the result *is* the cost, those extra
# passes over B·P floats show up directly. **Chunking** adds the concatenation of the chunks:
# one more pass over the whole result, and, as measured above, no saving of memory here,
# because the result dominates.
#
# **torch.compile** fuses that sequence of operations into a few loops, so it writes each
# per-sample gradient fewer times. The price is the compile time printed above, paid once
# here because the graph takes any batch size; a graph specialised to one batch size (the
# default, until a second size is seen) would be compiled again for each new one. On a GPU at
# this page's sizes it also launches fewer kernels, which is how it can run below the eager
# batched step that the floor is measured with.
#
# **Expanded weights and Opacus** compute the same per-layer outer products as the
# hand-written code, through hooks and Python per layer, inside an ordinary backward pass
# that also computes the summed gradient. **The hand-written formulas** skip the parameter
# gradients entirely and write into kept buffers; what remains is one batched product per
# layer. On the CNN the unfolded input (nine positions of a 3×3 kernel per input value) is
# their extra traffic.
#
# What would close the remaining gaps: compiling (as shown), writing per-sample results into
# reused buffers, and on a CPU keeping freed memory (as this page does) or using an allocator
# such as jemalloc, so that the B·P floats land in memory the process already holds.
