"""
Per-sample gradients with ``vmap`` and ``grad``
===============================================

Ordinary training needs one gradient, the mean over the batch; differentially private
training, influence estimates and hunting for mislabelled examples need one gradient *per
example*. This page computes them for a small convolutional network with
``vmap(grad(loss))``, checks every parameter against a float64 Python loop, clips them as
DP-SGD does, and then times the recipe against the loop and the ordinary batched backward pass.
"""

# %%
# Setup
# -----
# The checks compare float32 convolutions with float64 ones, so cuDNN's TF32 mode (on by default
# on NVIDIA GPUs) is turned off; on a CPU the setting changes nothing.
import ctypes
import platform

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.profiler import profile
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.backends.cudnn.allow_tf32 = False
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73", "batched": "#666666"}


# %%
# The model and the data
# ----------------------
# A small CNN for 28×28 grey images. ``forward`` returns logits and the loss is
# :func:`~torch.nn.functional.cross_entropy` on them (``nll_loss`` on raw logits would not be
# cross-entropy). The data is drawn on the CPU, so that it is the same on every device.
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
images = torch.randn(batch_size, 1, 28, 28).to(device)
targets = torch.randint(0, 10, (batch_size,)).to(device)
num_params = sum(p.numel() for p in model.parameters())
print(f"{num_params:,} parameters, {batch_size} samples")


# %%
# The recipe: ``vmap(grad(loss of one sample))``
# ----------------------------------------------
# ``torch.func`` transforms functions, not modules. :func:`~torch.func.functional_call` runs the
# module with the tensors we pass instead of its own, so the loss of *one* sample becomes a pure
# function of the parameters. :func:`~torch.func.grad` differentiates it with respect to its
# first argument, a dictionary, and returns a dictionary of the same shape.
# :func:`~torch.func.vmap` maps that over the batch: ``in_dims=(None, None, 0, 0)`` shares the
# parameters and buffers and splits images and targets along their first dimension. The mental
# model: ``vmap(f)(x)`` equals stacking ``f(x_i)`` over ``x.unbind(0)``, here in one call.
def sample_loss(params, buffers, image, target):
    logits = functional_call(model, (params, buffers), (image.unsqueeze(0),))
    return F.cross_entropy(logits, target.unsqueeze(0))


per_sample_grad_fn = vmap(grad(sample_loss), in_dims=(None, None, 0, 0))
# detach() gives tensors that share the parameters' storage (no copy), outside autograd's
# record: grad tracks its own inputs.
model_params = {name: p.detach() for name, p in model.named_parameters()}
buffers = {name: b.detach() for name, b in model.named_buffers()}
assert model_params["fc1.weight"].data_ptr() == model.fc1.weight.data_ptr()
per_sample_grads = per_sample_grad_fn(model_params, buffers, images, targets)
print("conv1.weight:", tuple(model.conv1.weight.shape), "->", end=" ")
print(tuple(per_sample_grads["conv1.weight"].shape), "per-sample gradients")


# %%
# The reference: a Python loop in float64
# ---------------------------------------
# The independent reference runs the module on each sample alone, one
# :func:`torch.autograd.grad` per sample, in float64 where rounding is negligible. Each
# parameter is compared on its own, by the relative error ``‖g − g_ref‖ / ‖g_ref‖`` over the
# whole tensor. One error over all parameters would be dominated by ``fc1.weight``: a
# ``conv1.bias`` that is entirely wrong moves it only as far as printed below, and it names
# no parameter.
def loop_per_sample_grads(net, images, targets):
    per_sample = []
    for image, target in zip(images, targets):
        loss = F.cross_entropy(net(image.unsqueeze(0)), target.unsqueeze(0))
        per_sample.append(torch.autograd.grad(loss, list(net.parameters())))
    names = [name for name, _ in net.named_parameters()]
    return {name: torch.stack(grads) for name, grads in zip(names, zip(*per_sample))}


def check_each_parameter(grads, reference, bound, what, samples=slice(None)):
    errors = {}
    for name, expected in reference.items():
        diff = grads[name][samples].double() - expected[samples]
        errors[name] = (diff.norm() / expected[samples].norm()).item()
    worst_name = max(errors, key=errors.get)
    worst = errors[worst_name]
    print(f"{what}: worst {worst_name}, relative error {worst:.1e} (bound {bound:.0e})")
    for name, error in errors.items():
        assert error < bound, f"{what}: {name} has relative error {error:.2e}"
    return errors


model64 = SmallCNN().to(device, torch.float64)
model64.load_state_dict(model.state_dict())
images64 = images.double()
reference_grads = loop_per_sample_grads(model64, images64, targets)
params64 = {name: p.detach() for name, p in model64.named_parameters()}
vmap_grads64 = per_sample_grad_fn(params64, {}, images64, targets)
float64_errors = check_each_parameter(
    vmap_grads64, reference_grads, 1e-13, "vmap(grad) vs loop, float64"
)
zeroed = vmap_grads64 | {"conv1.bias": torch.zeros_like(vmap_grads64["conv1.bias"])}
wrong, right = (
    torch.cat([g.flatten(1) for g in d.values()], 1) for d in (zeroed, reference_grads)
)
whole_error = ((wrong - right).norm() / right.norm()).item()
print(f"conv1.bias zeroed: its own relative error 1, all parameters' {whole_error:.1e}")

# %%
# The batch loss is the mean of the per-sample losses, so the ordinary batched gradient must
# equal the mean of the per-sample gradients.
batch_loss64 = F.cross_entropy(model64(images64), targets)
batch_grads64 = torch.autograd.grad(batch_loss64, list(model64.parameters()))
mean_errors = check_each_parameter(
    {name: g.unsqueeze(0) for name, g in zip(params64, batch_grads64)},
    {name: g.mean(dim=0, keepdim=True) for name, g in reference_grads.items()},
    1e-13,
    "batched vs mean of per-sample, float64",
)


# %%
# How accurate is float32? Mind the kinks
# ---------------------------------------
# ReLU and max-pooling have kinks, where the gradient jumps. When an activation sits within
# rounding distance of one (a ReLU input near zero, or two nearly equal inputs of a max-pool
# window), float32 and float64 can take different sides, and that one sample's gradient moves
# by far more than rounding. So we first find the samples whose float32 forward pass takes a
# different side of some kink than the float64 one, by comparing ReLU signs and max-pool winners.
@torch.no_grad()
def kink_sides(net, x):
    z1 = net.conv1(x)
    z2 = net.conv2(z1.relu())
    pooled, winners = F.max_pool2d(z2.relu(), 2, return_indices=True)
    return [z1 > 0, z2 > 0, winners, net.fc1(pooled.flatten(1)) > 0]


sides = zip(kink_sides(model, images), kink_sides(model64, images64))
crossed = torch.stack([(a != b).flatten(1).any(1) for a, b in sides]).any(0)
crossed_samples = crossed.nonzero().flatten().tolist()
print(
    "samples whose float32 forward crosses a kink:",
    crossed_samples or "none on this run",
)

# %%
# Every other sample must match the float64 loop to within float32 rounding, parameter by
# parameter. The crossed samples' error against float64 is real and is printed, not bounded;
# that it comes from the kink and not from ``vmap`` is checked against a float32 loop, which
# meets the kink in the same precision as ``vmap``.
float32_errors = check_each_parameter(
    per_sample_grads, reference_grads, 3e-5, "vmap(grad), float32", samples=~crossed
)
for name, error in float32_errors.items():
    print(f"    {name:13s} {error:.1e}")
for i in crossed_samples:
    errors = {name: ((per_sample_grads[name][i].double() - ref[i]).norm() / ref[i].norm())
              .item() for name, ref in reference_grads.items()}  # fmt: skip
    worst = max(errors, key=errors.get)
    print(f"    sample {i}: worst {worst}, relative error {errors[worst]:.1e}")
if crossed_samples:
    loop32 = loop_per_sample_grads(model, images[crossed], targets[crossed])
    crossed_grads = {name: g[crossed] for name, g in per_sample_grads.items()}
    check_each_parameter(crossed_grads, loop32, 1e-5, "crossed samples vs float32 loop")

# %%
# Per-sample gradient norms and clipping
# --------------------------------------
# DP-SGD bounds each sample's influence: it scales every per-sample gradient whose norm (over
# all parameters together) exceeds a threshold ``C`` down to norm ``C``, averages, and adds
# noise. ``C`` is a hyperparameter fixed in advance: the privacy guarantee assumes that it does
# not depend on the data, so a threshold taken from the batch (its median norm, say) would
# leak information about that batch. The value below was picked, for this demonstration
# only, by looking at this batch's norms, so that the check sees both cases; it asserts that.
clip_norm = 11.0


def per_sample_norms(grads):
    squares = [g.flatten(start_dim=1).square().sum(dim=1) for g in grads.values()]
    return torch.stack(squares).sum(dim=0).sqrt()


norms = per_sample_norms(per_sample_grads)
reference_norms = torch.stack([torch.cat([g[i].flatten() for g in reference_grads.values()])
                               .norm() for i in range(batch_size)])  # fmt: skip
norm_errors = (norms.double() - reference_norms).abs() / reference_norms
norm_error = norm_errors[~crossed].max().item()  # a crossed sample's norm moves with it
print(f"per-sample norms vs float64 loop, samples away from kinks: worst relative error "
      f"{norm_error:.1e} (bound 1e-05, {1e-5 / norm_error:.0f}x)")  # fmt: skip
assert norm_error < 1e-5, f"per-sample norms: relative error {norm_error:.1e}"

scale = (clip_norm / norms).clamp(max=1.0)
clipped_grads = {
    name: g * scale.view(-1, *[1] * (g.dim() - 1))
    for name, g in per_sample_grads.items()
}
clipped_norms = per_sample_norms(clipped_grads)
was_clipped = norms > clip_norm
expected_norms = torch.where(was_clipped, clip_norm, norms)  # closed form
clip_error = ((clipped_norms - expected_norms).abs() / expected_norms).max().item()
print(f"clipped norms vs min(norm, C): worst relative error {clip_error:.1e}")
assert clip_error < 1e-5, f"clipped norms: relative error {clip_error:.1e}"
assert 0 < was_clipped.sum() < batch_size, (
    "the check must see clipped and unclipped samples"
)
print(
    f"C = {clip_norm}: {int(was_clipped.sum())} of {batch_size} gradients scaled down"
)

# %%
fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
bins = torch.linspace(norms.min().item() * 0.95, norms.max().item() * 1.05, 25).numpy()
ax.hist(norms.cpu().numpy(), bins=bins, color=METHOD_COLORS["vmap"], alpha=0.6,
        label="vmap(grad), before clipping")  # fmt: skip
ax.hist(clipped_norms.cpu().numpy(), bins=bins, histtype="step", linewidth=2,
        color="black", label="after clipping")  # fmt: skip
ax.axvline(clip_norm, color="black", linestyle="--", label="threshold C")
ax.set_xlabel("per-sample gradient norm ‖∇θ loss(x_i)‖")
ax.set_ylabel("samples")
ax.set_title("Clipping moves every norm above C onto C; the rest stay")
ax.legend(loc="upper left")
plt.show()

# %%
# What ``vmap`` cannot do
# -----------------------
# ``vmap`` runs the function once, with batched tensors standing in for single samples. Code that
# writes in place into an unbatched tensor, calls ``.item()`` or branches on values raises an
# error, and so does BatchNorm in training mode: its running statistics would be updated in
# place with per-sample values. Code that reduces over "the batch" or has Python side effects
# runs and silently computes something else. The
# :ref:`pitfalls page <sphx_glr_auto_examples_guides_plot_pitfalls.py>` runs each case with its fix.
with_batch_norm = nn.Sequential(
    nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 26 * 26, 10)
).to(device)


def batch_norm_sample_loss(params, buffers, image, target):
    logits = functional_call(with_batch_norm, (params, buffers), (image.unsqueeze(0),))
    return F.cross_entropy(logits, target.unsqueeze(0))


bn_params = dict(with_batch_norm.named_parameters())
bn_buffers = dict(with_batch_norm.named_buffers())
try:
    vmap(grad(batch_norm_sample_loss), in_dims=(None, None, 0, 0))(
        bn_params, bn_buffers, images, targets
    )
    raise AssertionError("BatchNorm in training mode ran under vmap")
except RuntimeError as error:
    assert "Batch norm got a batched tensor" in str(error), error
    print(f"RuntimeError: {str(error).splitlines()[0]}")

# %%
# How fast is it?
# ---------------
# Each call allocates hundreds of MB and frees them. On a CPU, under Linux with glibc, we ask
# ``malloc`` to keep freed memory in the process for reuse rather than map fresh pages for every
# call (why: :doc:`/reading-timings`); the process's memory then grows over the first calls until
# freed blocks fit the next ones, one more reason each method runs once before it is timed. On
# a GPU the tensors live in device memory, which PyTorch's caching allocator keeps already.
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>
    assert libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1)


# %%
# Three methods, and one more reference. The loop runs B small forward and backward passes;
# ``vmap(grad)`` runs one batched pass that keeps the batch dimension in the weight gradients;
# the ``batched`` backward computes only the mean gradient. Neither the batched pass nor writing
# B·P floats (``fill_`` of a preallocated tensor the size of the result) is a lower limit on
# every method; the page
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_at_the_limit.py`
# shows faster ones. They are yardsticks: the same multiply-adds, and the size of the answer.
def batched_backward():
    loss = F.cross_entropy(model(images), targets)
    return torch.autograd.grad(loss, list(model.parameters()))


result_sized = torch.empty(batch_size * num_params, device=device)
methods = {
    "batched": batched_backward,
    "loop": lambda: loop_per_sample_grads(model, images, targets),
    "vmap": lambda: per_sample_grad_fn(model_params, buffers, images, targets),
    "write B·P floats": lambda: result_sized.fill_(1.0),
}


def spread_ms(seconds):  # enough digits that a small spread does not print as zero
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 0.1 else f"{ms:.2g}"


times, threads = {}, torch.get_num_threads()
for name, fn in methods.items():
    fn()  # warm-up
    timer = benchmark.Timer("run()", globals={"run": fn}, num_threads=threads)
    measured = [timer.blocked_autorange(min_run_time=0.3)]
    if len(measured[0].times) < 4:  # a slow call: up to four more blocks, for a spread
        block = measured[0].median * measured[0].number_per_run
        measured.append(timer.blocked_autorange(min_run_time=4 * block))
    times[name] = benchmark.Measurement.merge(measured)[0]
    median_ms, iqr_ms = times[name].median * 1e3, spread_ms(times[name].iqr)
    blocks = len(times[name].times)
    print(f"{name:17s} {median_ms:8.1f} ms (IQR {iqr_ms} ms, {blocks} blocks)")


def compare(a, b, b_name):  # worded by the ratio, so that it reads right either way
    speedup = times[b].median / times[a].median
    if speedup >= 1:
        return f"{a} is {speedup:.2f}x faster than {b_name}"
    return f"{a} takes {1 / speedup:.2f}x {b_name}'s time"


vmap_vs_loop = compare("vmap", "loop", "the loop")
print(vmap_vs_loop, compare("vmap", "batched", "the batched pass"), sep="\n")


# %%
# Which operations form ``vmap``'s per-sample weight gradients? :mod:`torch.profiler`, with
# input shapes recorded, finds them: for each linear layer a ``bmm`` of B outer products, and
# for each convolution a ``convolution_backward`` with one group per sample (its weight has
# ``B × out`` channels). The batched pass runs none of them (both asserted). Their times are
# from one profiled call, and vary from call to call.
def per_sample_ops(fn):  # (operation, input shapes, self time in ms), one call
    with profile(record_shapes=True) as prof:
        fn()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    grouped = {batch_size * conv.out_channels for conv in (model.conv1, model.conv2)}
    found = []
    for e in prof.key_averages(group_by_input_shape=True):
        bmm = e.key == "aten::bmm" and e.input_shapes[0][0] == batch_size
        conv = e.key == "aten::convolution_backward" and e.input_shapes[2][0] in grouped
        if bmm or conv:
            found.append((e.key, e.input_shapes, getattr(e, key) / 1e3))
    return found


vmap_ops = per_sample_ops(methods["vmap"])
names = sorted(op for op, _, _ in vmap_ops)
assert names == ["aten::bmm"] * 2 + ["aten::convolution_backward"] * 2, names
assert per_sample_ops(batched_backward) == []
for op, shapes, ms in vmap_ops:
    print(f"{op:27s} one profiled call: {ms:6.1f} ms, inputs {shapes[:3]}")
gap = times["vmap"].median - times["batched"].median
print(
    f"vmap minus batched: {gap * 1e3:.1f} ms (IQRs {spread_ms(times['vmap'].iqr)} and "
    f"{spread_ms(times['batched'].iqr)} ms)",
    end="",
)
if gap > 0:
    write_share = times["write B·P floats"].median / gap
    print(f", of which writing B·P floats would be {write_share:.0%}")
else:
    print(": vmap was not slower than the batched pass in this run")

# %%
# The figure shows the medians, each whisker one interquartile range long on either side; the
# dashed line is the time to write B·P floats.
fig, ax = plt.subplots(figsize=(7, 2.8), layout="constrained")
drawn = ["batched", "loop", "vmap"]
ax.barh(drawn, [times[m].median * 1e3 for m in drawn],
        xerr=[times[m].iqr * 1e3 for m in drawn],
        color=[METHOD_COLORS[m] for m in drawn])  # fmt: skip
ax.axvline(times["write B·P floats"].median * 1e3, color="black", linestyle="--",
           label="write B·P floats")  # fmt: skip
ax.invert_yaxis()
ax.set_xlabel(f"median time per batch of {batch_size} (ms)")
ax.set_title(f"{device.type.upper()}: {vmap_vs_loop}")
ax.legend(loc="lower right")
plt.show()

# %%
# **Reading the numbers.** The loop and ``vmap`` do in principle the same multiply-adds; the
# loop pays the fixed price of each operation (Python, PyTorch's dispatcher, on a GPU a kernel
# launch) once per sample instead of once per batch. That price is probably a larger share of
# a GPU's loop time than of a CPU's, where a single-image convolution takes longer; on a
# shared CPU, other processes move both times too (:doc:`/reading-timings`). Where the batched
# pass forms each weight gradient with one large product summed over the batch, ``vmap`` runs
# the operations listed above, which keep the batch: B outer products in a ``bmm``, B groups in
# a convolution. Writing the B·P floats of the answer would explain the printed share of the
# gap. On a CPU, that those operations use the hardware less well than one large product is a
# likely rest, which the page does not measure. On a GPU, where their printed device times can
# be a small part of the gap, the rest is probably on the host: the fixed price per operation
# again, as ``vmap`` runs more operations than the batched pass (the page linked above counts
# them for an MLP).

# %%
# What to remember
# ----------------
# - Per-sample gradients: ``vmap(grad(loss_of_one_sample), in_dims=(None, None, 0, 0))`` over a
#   ``functional_call`` of the module; the result is a dictionary of (B, …) tensors.
# - Check each parameter on its own against a float64 loop: a single global error dilutes a
#   small tensor's error and names no parameter.
# - In float32, a sample whose activations sit at a ReLU or max-pool kink can differ from float64
#   by far more than rounding; find such samples before setting a bound.
# - Clip with a threshold fixed in advance, never one computed from the batch.
# - Time per-sample methods against two yardsticks, one batched backward and writing B·P
#   floats; profile with shapes recorded to see which operations keep the batch dimension.
