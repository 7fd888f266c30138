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
hardware you have and what fresh memory costs on a CPU, how to clip per-sample gradients, and
which mistakes ``vmap`` catches for you and which it lets through silently.
"""

# %%
# Where this page ran
# -------------------
# Every timing below depends on the hardware, so the page starts by saying what it ran on. A
# downloaded notebook prints your machine instead. We use the GPU when there is one, and seed
# the random number generator so that the data and the weights are the same on every run.
import ctypes
import os
import platform
import re
import statistics
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap
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
# convolutions collect those moves from every position in the image. On GPUs, cuDNN may also
# compute convolutions in TF32, with a 10-bit mantissa (PyTorch's default), which adds more. A
# bound of 1e-2 per parameter holds in both cases and still catches a wrong result, whose error
# is of order one.
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
# nine rounds, and each one's median is reported. The batched backward is the floor: a
# per-sample method does the same multiply-adds, and must also write ``B`` gradients instead of
# one, so it cannot be faster.


def median_times_ms(methods, rounds=9, min_run_time=0.2):
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
# Now the same three calls once more, with glibc switched for a moment to the opposite policy:
# every block above 128 KiB comes fresh from the kernel and goes back when it is freed. Each
# call then pays for page faults and for zeroing every page it touches, which is what a
# program pays whenever glibc's defaults happen to hand out fresh pages. Afterwards we switch
# back. How much fresh pages cost depends on the machine and the operating system, and on a
# virtual machine also on whether the host has backed that memory before, so expect these
# ratios to move between runs more than the others on this page. On a GPU, PyTorch's caching
# allocator keeps freed blocks itself, so there is nothing to compare.


def use_fresh_pages():
    libc = glibc()
    libc.mallopt(M_MMAP_MAX, 65536)  # glibc's default number of kernel-served blocks
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's initial threshold, held fixed
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    libc.malloc_trim(0)


fresh_timings_ms = {}
if device.type == "cpu" and allocator_pinned:
    use_fresh_pages()
    fresh_timings_ms = median_times_ms(methods)
    keep_freed_memory()
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
# Which mistakes ``vmap`` catches, and which it does not
# -------------------------------------------------------
# ``vmap`` runs your function once, with batched tensors standing in for single samples. Some
# code cannot work that way, and ``vmap`` raises an error for it. Other code runs without
# complaint and computes something you did not mean. Each case below is run: where ``vmap``
# raises, we check the type of the error and a stable part of its message, and print the
# message in full.


def expect_error(fn, error_type, fragment):
    """Run fn, which must raise error_type with fragment in its message; print the message."""
    try:
        fn()
    except error_type as error:
        message = str(error)
        assert fragment in message, f"unexpected message: {message}"
        print(f"{type(error).__name__}:")
        print(textwrap.fill(" ".join(message.split()), width=88))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


samples = torch.randn(4, 3, device=device)

# %%
# **Caught: in-place writes into an unbatched tensor.** ``torch.zeros(shape)`` inside the
# function makes one tensor, not one per sample, so copying a batched sample into it cannot
# work. ``x.new_zeros(...)`` or ``torch.zeros_like(x)`` makes a batched tensor, and out-of-place
# code never has the problem.
expect_error(
    lambda: vmap(lambda x: torch.zeros(x.shape, device=x.device).copy_(x))(samples),
    RuntimeError,
    "inplace arithmetic",
)
torch.testing.assert_close(
    vmap(lambda x: torch.zeros_like(x).copy_(x))(samples), samples
)

# %%
# **Caught: Python control flow on values.** ``if tensor:`` and ``.item()`` need one concrete
# number, but a batched tensor holds one per sample. :func:`torch.where` chooses element-wise.
expect_error(
    lambda: vmap(lambda x: x if x.sum() > 0 else -x)(samples),
    RuntimeError,
    "data-dependent control flow",
)
expect_error(lambda: vmap(lambda x: x.sum().item())(samples), RuntimeError, ".item()")
flipped = vmap(lambda x: torch.where(x.sum() > 0, x, -x))(samples)
assert (flipped.sum(dim=1) >= 0).all()

# %%
# **Caught: randomness.** By default ``vmap`` refuses random operations such as dropout,
# because it cannot know whether you want the same mask for every sample or a different one.
# Say which with ``randomness="same"`` or ``"different"``.
expect_error(
    lambda: vmap(lambda x: F.dropout(x, 0.5))(samples), RuntimeError, "randomness"
)
same_masks = vmap(lambda x: F.dropout(torch.ones_like(x), 0.5), randomness="same")(
    samples
)
assert (same_masks == same_masks[0]).all()

# %%
# **Not caught: Python side effects run once.** The function body runs once for the whole
# batch, so a counter, a print or an append to a list happens once, not once per sample.
calls = []
vmap(lambda x: calls.append(x.shape) or x * 2)(samples)
print(f"vmap over {len(samples)} samples ran the Python body {len(calls)} time(s)")
assert len(calls) == 1

# %%
# **Not caught: reductions over "the batch dimension".** Inside ``vmap`` each sample has lost
# its batch axis, so ``x.mean(dim=0)`` averages over the sample's own first axis (here its 3
# features) instead of over the batch. The result has the right shape and is silently a
# different computation.
centred = vmap(lambda x: x - x.mean(dim=0))(samples)
torch.testing.assert_close(centred, samples - samples.mean(dim=1, keepdim=True))
assert not torch.allclose(centred, samples - samples.mean(dim=0))

# %%
# BatchNorm: what each remedy computes
# ------------------------------------
# Training-mode batch norm normalises each sample with statistics of the *whole batch*, so a
# per-sample gradient of it is not well defined, and updating the running statistics is an
# in-place write. The usual remedies are not equivalent: each one computes a different
# function. We map over single images of shape (3, 5, 5) and compare with the layer applied to
# the batch.
images_for_bn = torch.randn(8, 3, 5, 5, device=device)
batch_norm = nn.BatchNorm2d(3).to(device)
expect_error(
    lambda: vmap(lambda x: batch_norm(x.unsqueeze(0)))(images_for_bn),
    RuntimeError,
    "running_mean or running_var",
)

# %%
# **eval() mode** normalises with the running statistics, which do not depend on the batch.
# Per-sample and batched results agree: this is the model as it runs at inference time.
batch_norm.eval()
per_sample_eval = vmap(lambda x: batch_norm(x.unsqueeze(0)).squeeze(0))(images_for_bn)
torch.testing.assert_close(per_sample_eval, batch_norm(images_for_bn))

# %%
# **track_running_stats=False** (or :func:`~torch.func.replace_all_batch_norm_modules_`, which
# switches it off in place) lets training mode run under ``vmap``. But each call now sees one
# sample, so ``BatchNorm2d`` normalises every image by its *own* mean and variance per channel:
# that is instance normalisation, a different model from the batch-mode layer. For
# ``BatchNorm1d`` a single sample has one value per channel, and it refuses outright.
per_sample_bn = nn.BatchNorm2d(3).to(device)
replace_all_batch_norm_modules_(per_sample_bn)
per_sample_train = vmap(lambda x: per_sample_bn(x.unsqueeze(0)).squeeze(0))(
    images_for_bn
)
torch.testing.assert_close(
    per_sample_train, F.instance_norm(images_for_bn, eps=per_sample_bn.eps)
)
batch_mode = per_sample_bn(images_for_bn)  # the same layer, given the whole batch
difference = ((per_sample_train - batch_mode).norm() / batch_mode.norm()).item()
print(f"per-sample vs batch-mode normalisation: relative difference {difference:.2f}")
assert difference > 0.05

features_bn = nn.BatchNorm1d(3, track_running_stats=False).to(device)
expect_error(
    lambda: vmap(lambda x: features_bn(x.unsqueeze(0)))(samples),
    ValueError,
    "Expected more than 1 value per channel",
)

# %%
# **GroupNorm** normalises each sample on its own by design, so per-sample and batched results
# are the same function.
group_norm = nn.GroupNorm(num_groups=1, num_channels=3).to(device)
per_sample_group = vmap(lambda x: group_norm(x.unsqueeze(0)).squeeze(0))(images_for_bn)
torch.testing.assert_close(per_sample_group, group_norm(images_for_bn))
print("eval(), instance-style and GroupNorm behave as described")
