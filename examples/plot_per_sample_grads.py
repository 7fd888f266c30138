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
result against a float64 reference, what speedup to expect on the hardware you have, and which
code ``vmap`` refuses to run.
"""

# %%
# Where this page ran
# -------------------
# Every timing below depends on the hardware, so the page starts by saying what it ran on. A
# downloaded notebook prints your machine instead. We use the GPU when there is one, and seed
# the random number generator so that the data and the weights are the same on every run.
import os
import platform
import re
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
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
# Checking against a float64 reference
# ------------------------------------
# Two kinds of check, kept apart on purpose.
#
# *Is the transform exact?* In float64, rounding is too small to matter, so the loop and
# ``vmap`` must agree to about 1e-12, and the mean of the per-sample gradients must equal the
# batched gradient, because the batch loss is the mean of the per-sample losses. We compare
# whole gradients by their relative error ``‖g − g_ref‖ / ‖g_ref‖`` over all parameters, not
# element by element, where a mean that cancels to nearly zero makes relative tolerances
# meaningless.


def relative_error(grads, reference):
    diff = sum((grads[k].double() - reference[k]).square().sum() for k in reference)
    size = sum(reference[k].square().sum() for k in reference)
    return (diff / size).sqrt().item()


model64 = SmallCNN().to(device, torch.float64)
model64.load_state_dict(model.state_dict())
images64 = images.double()
reference_grads = loop_per_sample_grads(model64, images64, targets)
params64 = {name: p.detach() for name, p in model64.named_parameters()}
vmap_grads64 = per_sample_grad_fn(params64, {}, images64, targets)
batch_grads64 = torch.autograd.grad(
    F.cross_entropy(model64(images64), targets), list(model64.parameters())
)
mean_of_reference = {name: g.mean(dim=0) for name, g in reference_grads.items()}

exact_errors = {
    "vmap vs loop (float64)": relative_error(vmap_grads64, reference_grads),
    "mean of per-sample vs batched (float64)": relative_error(
        dict(zip(params64, batch_grads64)), mean_of_reference
    ),
}
for what, error in exact_errors.items():
    print(f"{what}: relative error {error:.1e}")
    assert error < 1e-10, what

# %%
# *How accurate is float32?* Now the float32 results from above against the float64 loop. Expect
# more than float32's 1e-7: ReLU and max-pooling have kinks, and an activation that lies within
# rounding distance of one can fall on the other side in float32, which moves a little gradient
# to a different weight. On GPUs, cuDNN may also compute convolutions in TF32 (10 bits of
# mantissa, the PyTorch default), which adds errors near 1e-3. A 1e-2 bound holds in both cases
# and still catches a wrong result, whose error is of order one.
float32_errors = {
    "vmap(grad), float32": relative_error(per_sample_grads, reference_grads),
    "loop, float32": relative_error(loop_grads, reference_grads),
}
for what, error in float32_errors.items():
    print(f"{what} vs float64 loop: relative error {error:.1e}")
    assert error < 1e-2, what

# %%
# Timing: loop, ``vmap`` and the batched floor
# --------------------------------------------
# We time with :mod:`torch.utils.benchmark`, which warms up, synchronises the GPU, and repeats
# each call in blocks until a minimum time has passed; we report the median block. The batched
# backward is the floor: a per-sample method does the same multiply-adds, and must also write
# ``B`` gradients instead of one, so it cannot be faster.


def median_ms(fn, min_run_time=1.0):
    """Median time of ``fn()`` in milliseconds, using all of torch's threads."""
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def batched_backward():
    loss = F.cross_entropy(model(images), targets)
    return torch.autograd.grad(loss, list(model.parameters()))


timings_ms = {
    "batched backward\n(one mean gradient)": median_ms(batched_backward),
    "loop over samples": median_ms(
        lambda: loop_per_sample_grads(model, images, targets)
    ),
    "vmap(grad)": median_ms(
        lambda: per_sample_grad_fn(detached_params, detached_buffers, images, targets)
    ),
}
batched_ms, loop_ms, vmap_ms = timings_ms.values()
print(f"batched backward {batched_ms:8.1f} ms")
print(f"loop             {loop_ms:8.1f} ms")
print(f"vmap(grad)       {vmap_ms:8.1f} ms")
print(
    f"vmap is {loop_ms / vmap_ms:.1f}x faster than the loop, "
    f"and {vmap_ms / batched_ms:.1f}x slower than the batched backward"
)

# %%
# The figure shows the same three medians. The ratios are from this run, on this page's
# hardware.
fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
bars = ax.barh(
    list(timings_ms), list(timings_ms.values()), color=["#888888", "#d95f02", "#1b9e77"]
)
ax.bar_label(bars, labels=[f"{t:.1f} ms" for t in timings_ms.values()], padding=4)
ax.invert_yaxis()
ax.set_xlabel("median time per batch of 64 (ms)")
ax.set_title(
    f"Per-sample gradients on {device.type.upper()}: "
    f"vmap is {loop_ms / vmap_ms:.1f}x faster than the loop"
)
ax.set_xlim(0, max(timings_ms.values()) * 1.25)
plt.show()

# %%
# Why the speedup depends on the hardware
# ---------------------------------------
# On a CPU, the loop's 64 small passes and ``vmap``'s one large pass perform the same
# arithmetic, and arithmetic is what a CPU spends its time on, so ``vmap`` wins by a modest
# factor: it saves Python and dispatcher overhead and uses larger matrix products. On a GPU each
# small pass costs roughly the same fixed price (Python, dispatch and kernel launches of a few
# microseconds each) however little it computes, and that fixed price dominates the loop, while
# ``vmap`` pays it once for the whole batch. So the gap is far wider on a GPU than on a CPU. The
# ratio printed above belongs to this page's hardware; run the notebook to measure yours rather
# than trust a number from another machine.

# %%
# Per-sample gradient norms
# -------------------------
# One common use: differentially private SGD clips each sample's gradient to a maximum norm
# before averaging. The norms below come straight from the per-sample gradients.
per_sample_norms = (
    torch.stack(
        [g.flatten(start_dim=1).square().sum(dim=1) for g in per_sample_grads.values()]
    )
    .sum(dim=0)
    .sqrt()
)
reference_norms = (
    torch.stack(
        [g.flatten(start_dim=1).square().sum(dim=1) for g in reference_grads.values()]
    )
    .sum(dim=0)
    .sqrt()
)
torch.testing.assert_close(
    per_sample_norms.double(), reference_norms, rtol=1e-2, atol=0
)

fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
ax.hist(per_sample_norms.cpu().numpy(), bins=16, color="#1b9e77", edgecolor="black")
ax.set_xlabel("per-sample gradient norm ‖∇θ loss(x_i)‖")
ax.set_ylabel("samples")
ax.set_title("One gradient norm per sample, from a single vmap call")
plt.show()

# %%
# What ``vmap`` cannot do
# -----------------------
# ``vmap`` runs your function once with batched tensors standing in for single samples. Code
# that only makes sense for one concrete sample breaks that illusion, and ``vmap`` raises an
# error rather than return something wrong. Each case below is run, and we assert that it fails.


def error_message(fn):
    """Run fn, which must fail, and return the first line of its error message."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - we want whichever error vmap raises
        return str(error).splitlines()[0][:110]
    raise AssertionError("expected an error")


samples = torch.randn(4, 3, device=device)

# %%
# **In-place writes into an unbatched tensor.** The buffer below has one slot per feature, but
# under ``vmap`` every sample would write into it. Allocate per-sample results with an
# out-of-place operation instead.
scratch = torch.zeros(3, device=device)
print(error_message(lambda: vmap(lambda x: scratch.add_(x))(samples)))
torch.testing.assert_close(vmap(lambda x: scratch + x)(samples), samples)

# %%
# **Python control flow on values.** ``.item()`` and ``if tensor:`` need one concrete number,
# but a batched tensor has many. Use :func:`torch.where` to choose element-wise.
print(error_message(lambda: vmap(lambda x: x if x.sum() > 0 else -x)(samples)))
absolute_rows = vmap(lambda x: torch.where(x.sum() > 0, x, -x))(samples)
assert (absolute_rows.sum(dim=1) >= 0).all()

# %%
# **Randomness.** By default ``vmap`` refuses random operations such as dropout, because it
# cannot know whether you want the same mask for every sample or a different one. Say which
# with ``randomness="different"`` or ``"same"``.
print(error_message(lambda: vmap(lambda x: F.dropout(x, 0.5))(samples)))
masks = vmap(lambda x: F.dropout(torch.ones_like(x), 0.5), randomness="same")(samples)
assert (masks == masks[0]).all()

# %%
# **BatchNorm in training mode.** Training-mode batch norm normalises with statistics of the
# whole batch, so a per-sample gradient is not well defined, and updating the running
# statistics is an in-place write. Evaluate in ``eval()`` mode, build the layer with
# ``track_running_stats=False``, call :func:`torch.func.replace_all_batch_norm_modules_`, or use
# ``GroupNorm``, which normalises each sample on its own.
batch_norm = nn.BatchNorm1d(3).to(device)
groups_of_samples = torch.randn(
    4, 2, 3, device=device
)  # vmap over 4 groups of 2 samples
print(error_message(lambda: vmap(batch_norm)(groups_of_samples)))
batch_norm.eval()
assert vmap(batch_norm)(groups_of_samples).shape == (4, 2, 3)
