"""
Per-sample gradients with ``vmap`` and ``grad``
===============================================

Ordinary training needs one gradient: the average over the batch. Differentially private
training, influence estimates, gradient-noise statistics and hunting for mislabelled data need
one gradient *for each example* instead. This page computes them for a small convolutional
network in three ways: a Python loop over samples, the ``torch.func`` composition
``vmap(grad(...))``, and (as the yardstick) the single batched backward pass that training
already does. You will learn how to turn a module into a pure function with
``functional_call``, why ``in_dims=(None, None, 0, 0)`` is the whole trick, how to check the
result parameter by parameter against a float64 reference, what speedup to expect on the
hardware you have and what fresh memory costs on a CPU, and how to clip per-sample gradients.
"""

# %%
# Where this page ran
# -------------------
# Every timing below depends on the hardware, so the page starts by saying what it ran on. A
# downloaded notebook prints your machine instead. We use the GPU when there is one, and seed
# the random number generator so that the data and the weights are the same on every run.
import ctypes
import mmap
import os
import platform
import re
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils import benchmark

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
# Per-sample gradients are large: 64 copies of every parameter. On a CPU, each call allocates
# hundreds of MB and frees them again, and how long that takes depends on the C library's
# ``malloc``. By default glibc serves large blocks straight from the kernel and returns them
# when they are freed, so the next call waits while the kernel maps and zeroes fresh pages.
# glibc also moves the size limit for this as a process runs, so the *same* code is fast or
# slow depending on what ran before it. Timings taken that way would not be reproducible.
#
# So this page (and every page on this site) asks glibc, through its documented ``mallopt``
# call, to keep freed memory in the process and reuse it: no blocks served straight from the
# kernel, and no trimming of the heap. It changes only this Python process. A later section
# measures what fresh pages cost. Without glibc (macOS, Windows) the cell changes nothing and
# says so; timings there may vary more from run to run.
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
# The model and the data
# ----------------------
# A small CNN for 28×28 grey images: two 3×3 convolutions, a 2×2 max-pool, and two linear
# layers. ``forward`` returns raw logits, and the loss is :func:`~torch.nn.functional.cross_entropy`
# on those logits. (A widely copied version of this tutorial computes ``log_softmax``, then
# overwrites it with the raw logits and applies ``nll_loss`` to them, which is not
# cross-entropy at all.)


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


batch_size = 64
model = SmallCNN().to(device)
images = torch.randn(batch_size, 1, 28, 28, device=device)
targets = torch.randint(0, 10, (batch_size,), device=device)
num_params = sum(p.numel() for p in model.parameters())
print(f"batch of {batch_size} images, {num_params:,} parameters")
print(f"per-sample gradients: {batch_size * num_params * 4 / 2**20:.0f} MiB in float32")

# %%
# The ordinary batched backward pass
# ----------------------------------
# One forward and one backward over the whole batch give the gradient of the *mean* loss: a
# single tensor per parameter with the parameter's own shape. The per-sample information is
# summed away inside the backward pass.
parameters = dict(model.named_parameters())
batch_loss = F.cross_entropy(model(images), targets)
mean_grads = dict(
    zip(parameters, torch.autograd.grad(batch_loss, list(parameters.values())))
)
print("mean gradient of conv1.weight:", tuple(mean_grads["conv1.weight"].shape))

# %%
# The naive way: a loop over samples
# -----------------------------------
# The obvious approach runs the model on each sample alone, one backward pass per sample, and
# stacks the results. It is correct and easy to read, but it launches B small forward and
# backward passes instead of one large one.


def loop_per_sample_grads(net, images, targets):
    weights = list(net.parameters())
    per_sample = []
    for image, target in zip(images, targets):
        loss = F.cross_entropy(net(image.unsqueeze(0)), target.unsqueeze(0))
        per_sample.append(torch.autograd.grad(loss, weights))
    names = [name for name, _ in net.named_parameters()]
    return {name: torch.stack(grads) for name, grads in zip(names, zip(*per_sample))}


loop_grads = loop_per_sample_grads(model, images, targets)
print("per-sample gradients of conv1.weight:", tuple(loop_grads["conv1.weight"].shape))

# %%
# The ``torch.func`` way: ``vmap(grad(...))``
# -------------------------------------------
# ``torch.func`` transforms *functions*, not modules, so first we write the loss of one sample
# as a pure function of the parameters. :func:`~torch.func.functional_call` runs the module
# with the tensors we pass in place of its own. We pass detached copies: ``grad`` tracks its
# own inputs and needs nothing from the module's autograd state.
#
# Inside ``sample_loss`` the sample has no batch dimension, so we add one for the module, which
# expects batches.
detached_params = {name: p.detach() for name, p in model.named_parameters()}
detached_buffers = {name: b.detach() for name, b in model.named_buffers()}


def sample_loss(params, buffers, image, target):
    logits = functional_call(model, (params, buffers), (image.unsqueeze(0),))
    return F.cross_entropy(logits, target.unsqueeze(0))


# %%
# :func:`~torch.func.grad` differentiates with respect to the first argument, the parameter
# dictionary, and returns a dictionary of the same structure. :func:`~torch.func.vmap` then maps
# that over the batch: ``in_dims=(None, None, 0, 0)`` says that parameters and buffers are
# shared by all samples, while images and targets are split along their first dimension.
per_sample_grad_fn = vmap(grad(sample_loss), in_dims=(None, None, 0, 0))
per_sample_grads = per_sample_grad_fn(
    detached_params, detached_buffers, images, targets
)
print(
    "vmap per-sample gradients of conv1.weight:",
    tuple(per_sample_grads["conv1.weight"].shape),
)

# %%
# Checking against a float64 reference, parameter by parameter
# ------------------------------------------------------------
# Two kinds of check, kept apart on purpose, and both made for **each parameter on its own**.
# A single error over all parameters would be dominated by the large ones: a small tensor such
# as ``conv1.bias`` could be entirely wrong and still pass.
#
# *Is the transform exact?* In float64, rounding is far too small to matter, so the loop and
# ``vmap`` must agree to within 1e-10, and the mean of the per-sample gradients must equal the
# batched gradient, because the batch loss is the mean of the per-sample losses. Each
# parameter's error is ``‖g − g_ref‖ / ‖g_ref‖``, taken over the whole tensor rather than
# element by element, where entries that cancel to nearly zero make relative errors
# meaningless.


def relative_errors(grads, reference):
    """Relative error of each parameter's gradient, in float64: {name: error}."""
    return {
        name: ((grads[name].double() - ref).norm() / ref.norm()).item()
        for name, ref in reference.items()
    }


def check_each_parameter(grads, reference, bound, what):
    errors = relative_errors(grads, reference)
    worst = max(errors, key=errors.get)
    print(f"{what}: worst parameter {worst}, relative error {errors[worst]:.1e}")
    for name, error in errors.items():
        assert error < bound, f"{what}: {name} has relative error {error:.2e}"
    return errors


model64 = SmallCNN().to(device, torch.float64)
model64.load_state_dict(model.state_dict())
images64 = images.double()
reference_grads = loop_per_sample_grads(model64, images64, targets)
params64 = {name: p.detach() for name, p in model64.named_parameters()}
vmap_grads64 = per_sample_grad_fn(params64, {}, images64, targets)
batch_grads64 = dict(
    zip(
        params64,
        torch.autograd.grad(
            F.cross_entropy(model64(images64), targets), list(model64.parameters())
        ),
    )
)
mean_of_reference = {name: g.mean(dim=0) for name, g in reference_grads.items()}
check_each_parameter(vmap_grads64, reference_grads, 1e-10, "vmap vs loop, float64")
check_each_parameter(
    batch_grads64, mean_of_reference, 1e-10, "batched vs mean of per-sample, float64"
)

# %%
# *How accurate is float32?* Now the float32 results from above against the float64 loop.
# The printout shows where the error sits: in the convolutions, not the linear layers. ReLU
# and max-pooling have kinks, and an activation within rounding distance of one can fall on
# the other side in float32, which moves a little gradient to a different weight; the
# convolutions collect those moves from every position in the image. (TF32 would add more on a
# GPU: it is turned off above, because with it the convolutions' errors can exceed this bound.) A
# bound of 1e-2 per parameter holds and still catches a wrong result, whose error is of order
# one.
float32_errors = check_each_parameter(
    per_sample_grads, reference_grads, 1e-2, "vmap(grad), float32"
)
for name, error in float32_errors.items():
    print(f"    {name:13s} {error:.1e}")
check_each_parameter(loop_grads, reference_grads, 1e-2, "loop, float32")

# %%
# Timing: loop, ``vmap`` and the batched floor
# --------------------------------------------
# We time with :mod:`torch.utils.benchmark`, which synchronises the GPU and repeats each call in
# blocks until a minimum time has passed. After a warm-up, the three methods take turns for
# six rounds, and each one's median is reported. The batched backward is the floor: a
# per-sample method does the same multiply-adds, and must also write ``B`` gradients instead of
# one, so it cannot be faster.


def median_times_ms(methods, rounds=6, min_run_time=0.2):
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


def batched_backward():
    loss = F.cross_entropy(model(images), targets)
    return torch.autograd.grad(loss, list(model.parameters()))


def run_loop():
    return loop_per_sample_grads(model, images, targets)


def run_vmap():
    return per_sample_grad_fn(detached_params, detached_buffers, images, targets)


methods = {"batched": batched_backward, "loop": run_loop, "vmap": run_vmap}
labels = {
    "batched": "batched backward (one mean gradient)",
    "loop": "loop over samples",
    "vmap": "vmap(grad)",
}
timings_ms = median_times_ms(methods)
for method, ms in timings_ms.items():
    print(f"{labels[method]:38s} {ms:8.1f} ms")
vmap_speedup = timings_ms["loop"] / timings_ms["vmap"]
print(
    f"vmap is {vmap_speedup:.2f}x faster than the loop, "
    f"and takes {timings_ms['vmap'] / timings_ms['batched']:.2f}x the time of the "
    "batched backward"
)

# %%
# What fresh memory costs on a CPU
# --------------------------------
# Now the same three calls once more, but before each call we hand every free page of the
# heap back to the kernel with glibc's ``malloc_trim``. Each call then starts as it would in a
# process whose freed memory went back to the kernel, and pays for a page fault and for zeroing
# every page it touches: what a program pays whenever glibc's defaults hand out fresh pages.
# Switching glibc's policy back for a moment would not do this reliably: once freed memory sits
# inside the heap, malloc reuses it whatever the policy, and only the first call would pay.
# The operating system's count of page faults checks that each call really gets fresh pages:
# ``vmap`` must fault in at least as many pages as its result fills. How much fresh pages cost
# depends on the machine and the operating system. On a GPU, PyTorch's caching allocator keeps
# freed blocks itself, so there is nothing to compare.


def with_fresh_pages(fn):
    """``fn``, with every free page of the heap handed back to the kernel before each call."""
    libc = glibc()

    def call():
        libc.malloc_trim(0)
        return fn()

    return call


def page_faults_per_call(fn):
    """Pages the kernel had to fault in (and zero) during one call of ``fn``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


fresh_timings_ms = {}
if device.type == "cpu" and allocator_pinned:
    import resource  # Unix only, like glibc

    fresh_methods = {name: with_fresh_pages(fn) for name, fn in methods.items()}
    result_pages = batch_size * num_params * 4 // mmap.PAGESIZE
    vmap_faults = min(page_faults_per_call(fresh_methods["vmap"]) for _ in range(3))
    print(f"vmap(grad) with fresh pages: at least {vmap_faults} page faults per call")
    assert vmap_faults >= result_pages, (vmap_faults, result_pages)
    fresh_timings_ms = median_times_ms(fresh_methods)
    for method, ms in fresh_timings_ms.items():
        print(
            f"{labels[method]:38s} fresh pages {ms:8.1f} ms: "
            f"{ms / timings_ms[method]:.2f}x the time with reused memory"
        )
else:
    print("fresh pages are compared on a Linux CPU only (glibc's malloc)")

# %%
# The figure shows the medians from this run. On a CPU the hatched bars are the same calls
# with fresh pages.
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
rows = range(len(methods))
ax.barh(
    rows,
    list(timings_ms.values()),
    height=0.38,
    color=[METHOD_COLORS[m] for m in methods],
    label="memory reused",
)
if fresh_timings_ms:
    ax.barh(
        [row + 0.4 for row in rows],
        list(fresh_timings_ms.values()),
        height=0.38,
        color="white",
        edgecolor=[METHOD_COLORS[m] for m in methods],
        hatch="///",
        label="fresh pages from the kernel",
    )
    ax.legend(loc="lower right")
ax.set_yticks([row + (0.2 if fresh_timings_ms else 0) for row in rows])
ax.set_yticklabels([labels[m].replace(" (", "\n(") for m in methods])
ax.invert_yaxis()
ax.set_xlabel(f"median time per batch of {batch_size} (ms)")
ax.set_title(
    f"Per-sample gradients on {device.type.upper()}: "
    f"vmap is {vmap_speedup:.2f}x faster than the loop"
)
plt.show()

# %%
# What the numbers mean
# ---------------------
# **Why the speedup depends on the hardware.** The loop and ``vmap`` do the same arithmetic.
# What the loop adds is a fixed price per operation (Python, PyTorch's dispatcher, and on a GPU
# a kernel launch) paid once per sample instead of once per batch. A GPU finishes each small
# operation so fast that this fixed price is nearly all of the loop's time, so ``vmap`` wins by
# a wide margin there. On a CPU, each small convolution over one image takes long enough to
# hide much of the fixed price, so the margin is smaller for this network; for tiny functions,
# where the work per call is small, the CPU gains far more (see the batch-Jacobian page).
#
# **Why vmap is not at the floor.** The batched backward writes one gradient; ``vmap`` writes
# 64 of them, and the fully connected layer's alone is most of the memory printed above. That
# extra memory traffic is the gap to the floor.
#
# **What fresh pages mean for your code.** The comparison above is what a CPU program pays when
# its large temporary tensors come back from the kernel on every call. With glibc's defaults
# that happens for some calls and not others, depending on the program's history, so the
# same code can run at either speed. If you time or run such code on a CPU, reuse buffers, set
# the policy as this page does, or use an allocator such as jemalloc or tcmalloc, which PyTorch's
# CPU performance guide recommends.

# %%
# Per-sample gradient norms and clipping
# --------------------------------------
# Differentially private SGD bounds each sample's influence: it scales every per-sample
# gradient whose norm exceeds a threshold ``C`` down to norm ``C``, then averages. Here ``C`` is
# the median norm of this batch, so half of the gradients are clipped. The norm of a sample's
# gradient is taken over all parameters together.


def per_sample_norms(grads):
    squares = [g.flatten(start_dim=1).square().sum(dim=1) for g in grads.values()]
    return torch.stack(squares).sum(dim=0).sqrt()


norms = per_sample_norms(per_sample_grads)
torch.testing.assert_close(
    norms.double(), per_sample_norms(reference_grads), rtol=1e-2, atol=0
)
clip_norm = norms.median()
scale = (clip_norm / norms).clamp(max=1.0)
clipped_grads = {
    name: g * scale.view(-1, *[1] * (g.dim() - 1))
    for name, g in per_sample_grads.items()
}
clipped_norms = per_sample_norms(clipped_grads)
was_clipped = norms > clip_norm
assert torch.all(clipped_norms <= clip_norm * (1 + 1e-5))
torch.testing.assert_close(
    clipped_norms[was_clipped], clip_norm.expand(int(was_clipped.sum()))
)
torch.testing.assert_close(clipped_norms[~was_clipped], norms[~was_clipped])
print(
    f"clipping at C = {clip_norm.item():.3f}: {int(was_clipped.sum())} of {batch_size} "
    f"gradients scaled down, the largest by {(norms.max() / clip_norm).item():.2f}x"
)

# %%
fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
bins = torch.linspace(0, norms.max().item() * 1.05, 25).numpy()
ax.hist(
    norms.cpu().numpy(),
    bins=bins,
    color=METHOD_COLORS["vmap"],
    alpha=0.6,
    label="before clipping",
)
ax.hist(
    clipped_norms.cpu().numpy(),
    bins=bins,
    histtype="step",
    linewidth=2,
    color="black",
    label="after clipping",
)
ax.axvline(clip_norm.item(), color="black", linestyle="--", label="threshold C")
ax.set_xlabel("per-sample gradient norm ‖∇θ loss(x_i)‖")
ax.set_ylabel("samples")
ax.set_title("Clipping moves every norm above C onto C; the rest stay")
ax.legend()
plt.show()

# %%
# What ``vmap`` cannot do
# -----------------------
# ``vmap`` runs your function once, with batched tensors standing in for single samples. Some
# code cannot work that way and raises an error (in-place writes into new tensors, ``.item()``,
# control flow on values, random operations); other code runs and silently computes something
# else (reductions over "the batch", Python side effects, BatchNorm in training mode). The
# :doc:`pitfalls page <plot_pitfalls>` runs each case, with the error or the wrong result and
# the fix.
