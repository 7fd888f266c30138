"""
Per-sample gradients at the limit: every method against the floor
=================================================================

There are at least seven ways to get one gradient per example out of PyTorch: a loop,
``vmap(grad(...))`` plain, chunked and compiled, PyTorch's expanded weights, Opacus'
``GradSampleModule``, and per-layer formulas written by hand. This page checks every one of
them, parameter by parameter, against a float64 loop, on a wide MLP and on a small CNN, and
times each as a multiple of a reference called *the floor*: the larger of one ordinary batched
forward and backward pass and writing the B·P floats of the result into memory the process
already holds. You would want this to pick a method for your model and batch size, and to see
how far each is from the work every method has to do. Memory is on the sibling page,
:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_memory.py`.
"""

# %%
# Setup
# -----
# Imports, the device, and a seed. Float32 convolutions are checked against float64 below, so
# cuDNN is asked not to use TF32 on a GPU (on a CPU the setting changes nothing).
import copy
import ctypes
import platform
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.backends.cudnn.allow_tf32 = False

# %%
# The recipe: vmap(grad) on an MLP, checked against a float64 loop
# ----------------------------------------------------------------
# ``grad(sample_loss)`` is the gradient of *one* sample's loss with respect to the parameters,
# and ``vmap`` maps it over the batch: ``vmap(f)(x)`` equals stacking ``f(x_i)`` over
# ``x.unbind(0)``. ``in_dims=(None, 0, 0)`` shares the parameters and maps images and targets.
# The reference is the plain definition: one backward pass per sample, in float64.


class WideMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 10)

    def forward(self, images):
        hidden = F.relu(self.fc1(images.flatten(start_dim=1)))
        return self.fc3(F.relu(self.fc2(hidden)))


def vmap_grad_fn(net, chunk_size=None):
    weights = {name: p.detach() for name, p in net.named_parameters()}

    def sample_loss(weights, image, target):
        logits = functional_call(net, weights, (image.unsqueeze(0),))
        return F.cross_entropy(logits, target.unsqueeze(0))

    mapped = vmap(grad(sample_loss), in_dims=(None, 0, 0), chunk_size=chunk_size)
    return lambda images, targets: mapped(weights, images, targets)


def loop_grads(net, images, targets):
    names, weights = zip(*net.named_parameters())
    rows = [
        torch.autograd.grad(F.cross_entropy(net(x[None]), t[None]), weights)
        for x, t in zip(images, targets)
    ]
    return {name: torch.stack(col) for name, col in zip(names, zip(*rows))}


def check(method, grads, reference, bound=2e-5):
    """Relative error of each parameter on its own; returns the worst one."""
    assert grads.keys() == reference.keys(), method
    worst = 0.0
    for name, expected in reference.items():
        assert grads[name].shape == expected.shape, (method, name)
        error = ((grads[name].double() - expected).norm() / expected.norm()).item()
        assert error < bound, f"{method}: {name} has relative error {error:.2e}"
        worst = max(worst, error)
    return worst


mlp = WideMLP().to(device)
images = torch.randn(64, 1, 28, 28, device=device)
targets = torch.randint(0, 10, (64,), device=device)
mlp_reference = loop_grads(copy.deepcopy(mlp).double(), images.double(), targets)
worst = check("vmap", vmap_grad_fn(mlp)(images, targets), mlp_reference)
print(f"MLP vmap(grad): worst parameter's relative error {worst:.1e}")

# %%
# The check can fail. Zero the first layer's bias gradients, a plausible bug in a hand-written
# method, and it names the parameter; a wrong or missing piece has an error of order one.
broken = vmap_grad_fn(mlp)(images, targets) | {
    "fc1.bias": torch.zeros(64, 256, device=device)
}
try:
    check("vmap with a zeroed bias", broken, mlp_reference)
except AssertionError as error:
    print("caught:", error)
    assert "fc1.bias has relative error 1.00e+00" in str(error)
else:
    raise AssertionError("a zeroed bias gradient passed the check")

# %%
# The other methods
# -----------------
# ``chunk_size=16`` maps 16 samples at a time and concatenates the pieces. ``torch.compile``
# with ``dynamic=True`` compiles one graph for every batch size; its first call compiles, and
# is timed on its own. **Expanded weights** (``call_for_per_sample_grads``) lives in
# ``torch.nn.utils._per_sample_grad``: the underscore marks a **private API**, which may change
# without notice. One ordinary backward pass leaves a ``grad_sample`` on every parameter;
# ``loss_reduction="mean"`` says the loss is a batch mean. **Opacus**' ``GradSampleModule``
# does the same with hooks. Each gets its own copy of the model, so that no hook runs inside
# another method's timing.


def expanded_weights_fn(net):
    net = copy.deepcopy(net)

    def per_sample(images, targets):
        wrapped = call_for_per_sample_grads(
            net, batch_size=len(images), loss_reduction="mean"
        )
        F.cross_entropy(wrapped(images), targets).backward()
        grads = {name: p.grad_sample for name, p in net.named_parameters()}
        for p in net.parameters():
            p.grad_sample = None
        return grads

    return per_sample


# Opacus' hooks warn that the images require no gradient: expected here, so silenced.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def opacus_fn(net):
    wrapped = GradSampleModule(copy.deepcopy(net), loss_reduction="mean")

    def per_sample(images, targets):
        wrapped.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(images), targets).backward()
        return {
            n.removeprefix("_module."): p.grad_sample
            for n, p in wrapped.named_parameters()
        }

    return per_sample


# %%
# Hand-written per-layer formulas
# -------------------------------
# Why are per-sample gradients cheap at all? For a linear layer ``y = W a + b``, sample ``i``'s
# weight gradient is the outer product of the gradient reaching the output, ``g_i``, with the
# input ``a_i``; the ordinary weight gradient is their *sum* over the batch. A 2-d convolution
# is a linear layer applied at every position of the unfolded input
# (:func:`~torch.nn.functional.unfold`), so its per-sample weight gradient is the same product,
# summed over positions. Forward hooks capture each layer's input and output; the gradient of
# the *summed* loss with respect to the outputs is each sample's own output gradient (a
# sample's loss depends on its own outputs only). The products are written with
# :func:`torch.bmm` into buffers kept from call to call; no parameter gradient is computed.


def hand_written_fn(net):
    layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    names = {p: name for name, p in net.named_parameters()}
    kept = {}

    def per_sample(images, targets):
        seen = []
        hooks = [
            m.register_forward_hook(lambda m, i, o: seen.append((m, i[0], o)))
            for m in layers
        ]
        logits = net(images)
        for hook in hooks:
            hook.remove()
        loss = F.cross_entropy(logits, targets, reduction="sum")
        out_grads = torch.autograd.grad(loss, [out for _, _, out in seen])
        for (layer, layer_in, _), g in zip(seen, out_grads):
            w, b = names[layer.weight], names[layer.bias]
            if w not in kept or len(kept[w]) != len(images):
                kept[w] = g.new_empty(len(images), *layer.weight.shape)
                kept[b] = g.new_empty(len(images), *layer.bias.shape)
            if isinstance(layer, nn.Linear):  # (B, out, 1) @ (B, 1, in)
                torch.bmm(g[:, :, None], layer_in.detach()[:, None], out=kept[w])
                kept[b].copy_(g)
            else:  # (B, out, positions) @ (B, positions, in·kh·kw)
                patches = F.unfold(layer_in.detach(), layer.kernel_size)  # stride 1
                g = g.flatten(start_dim=2)
                torch.bmm(g, patches.mT, out=kept[w].flatten(start_dim=2))
                torch.sum(g, dim=2, out=kept[b])
        return dict(kept)

    return per_sample


def method_fns(net, compiled=None):
    fns = {
        "loop": lambda images, targets: loop_grads(net, images, targets),
        "vmap": vmap_grad_fn(net),
        "vmap chunked": vmap_grad_fn(net, chunk_size=16),
        "expanded weights": expanded_weights_fn(net),
        "opacus": opacus_fn(net),
        "hand-written": hand_written_fn(net),
    }
    return fns | ({"compiled": compiled} if compiled is not None else {})


compile_start = time.perf_counter()
mlp_compiled = torch.compile(vmap_grad_fn(mlp), dynamic=True)
mlp_compiled(images, targets)
compile_seconds = time.perf_counter() - compile_start
print(
    f"torch.compile's first call (it compiles), measured once: {compile_seconds:.1f} s"
)
for method, fn in method_fns(mlp, mlp_compiled).items():
    worst = check(method, fn(images, targets), mlp_reference)
    print(f"MLP {method:17s} worst parameter's relative error {worst:.1e}")

# %%
# The CNN, on a batch without max-pool ties
# -----------------------------------------
# The convolutional network of PyTorch's per-sample-gradients tutorial. Its max-pool passes the
# gradient to the largest of four values; where two of them are nearly equal, float32 and
# float64 can pick different ones, and the two gradients then differ by far more than
# rounding. So the check uses samples on which both precisions pick the same element in every
# window: the reference follows the same path as the method checked.


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def pool_input(self, images):
        return F.relu(self.conv2(F.relu(self.conv1(images))))

    def forward(self, images):
        hidden = F.max_pool2d(self.pool_input(images), 2).flatten(start_dim=1)
        return self.fc2(F.relu(self.fc1(hidden)))


cnn = SmallCNN().to(device)
cnn64 = copy.deepcopy(cnn).double()
with torch.no_grad():
    picks32 = F.max_pool2d(cnn.pool_input(images), 2, return_indices=True)[1]
    picks64 = F.max_pool2d(cnn64.pool_input(images.double()), 2, return_indices=True)[1]
same_picks = (picks32 == picks64).flatten(start_dim=1).all(dim=1)
print(f"CNN: {int((~same_picks).sum())} of 64 samples pool differently in float64")
cnn_images, cnn_targets = images[same_picks][:16], targets[same_picks][:16]
assert len(cnn_images) == 16
cnn_reference = loop_grads(cnn64, cnn_images.double(), cnn_targets)
for method, fn in method_fns(cnn).items():
    worst = check(method, fn(cnn_images, cnn_targets), cnn_reference)
    print(f"CNN {method:17s} worst parameter's relative error {worst:.1e}")

# %%
# The floor: a reference, not a bound
# -----------------------------------
# Two costs that every method seems to share. (a) **One ordinary batched forward and backward
# pass**: the per-sample formulas do the multiply-adds of the ordinary weight gradient, only
# without the sum over the batch. (b) **Writing B·P floats**, the result, into memory the
# process holds (a fill of a kept tensor). The floor is the larger of the two, measured in the
# same run. It is not a lower bound: compiled code fuses operations that the eager batched
# step runs one at a time, and timing noise moves both sides, so methods can land under it;
# the page asserts nothing about timings. What each method does, counted at batch 64: FLOPs
# with ``torch.utils.flop_counter.FlopCounterMode``, and the operations it dispatches (each
# with a fixed cost: Python, the dispatcher, on a GPU a kernel launch) with the profiler.


def batched_step_fn(net):
    weights = list(net.parameters())
    return lambda images, targets: torch.autograd.grad(
        F.cross_entropy(net(images), targets), weights
    )


def counted_work(fn):
    """FLOPs of products and convolutions, and aten operations (nested ones included)."""
    with FlopCounterMode(display=False) as flops_seen:
        fn(images, targets)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        fn(images, targets)
    return flops_seen.get_total_flops(), sum(
        e.name.startswith("aten::") for e in prof.events()
    )


eager = {"batched": batched_step_fn(mlp)} | method_fns(mlp)
work = {m: counted_work(fn) for m, fn in eager.items()}
print(f"MLP, batch 64: the batched step does {work['batched'][0] / 1e6:.1f} MFLOP")
for m, (flops, ops) in work.items():
    print(
        f"{m:17s} {flops / work['batched'][0]:.2f}x its FLOPs, {ops:6d} aten operations"
    )
assert 0.9 < work["loop"][0] / work["batched"][0] < 1.1  # the same products, one by one
assert work["loop"][1] > 32 * work["batched"][1]  # every operation once per sample

# %%
# How fast is each method?
# ------------------------
# Each call below allocates up to hundreds of MiB. glibc would return such blocks to the kernel
# and fault in fresh pages on the next call, so that a call's time depends on what ran before
# it; this cell asks glibc to keep freed memory (why: :doc:`/reading-timings`).
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>
    assert libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1)

# %%
# Each method and each part of the floor is timed with :class:`torch.utils.benchmark.Timer`
# for the CNN at the tutorial's batch of 64, and for the MLP over batch sizes. Every time is
# printed with its interquartile range (IQR), the spread of its timed blocks.
batch_sizes = {"CNN": [64], "MLP": [16, 64, 256]}
if device.type != "cpu":  # a GPU: larger batches
    batch_sizes = {"CNN": [64, 256], "MLP": [64, 256, 1024]}
METHODS = ["loop", "vmap", "vmap chunked", "compiled", "expanded weights", "opacus",
           "hand-written"]  # fmt: skip
results = {}  # (model, batch size) -> {method or floor part: Measurement}
for model_name, net in {"CNN": cnn, "MLP": mlp}.items():
    fns = method_fns(net, mlp_compiled if net is mlp else None)
    num_params = sum(p.numel() for p in net.parameters())
    for batch_size in batch_sizes[model_name]:
        x = torch.randn(batch_size, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        held = torch.empty(batch_size * num_params, device=device)
        timed = {"batched": "batched(x, y)", "write": "held.fill_(1.0)"}
        timed |= {m: f"fns[{m!r}](x, y)" for m in fns}
        context = {"fns": fns, "batched": batched_step_fn(net), "held": held}
        context |= {"x": x, "y": y}
        results[model_name, batch_size] = {
            name: benchmark.Timer(
                stmt=stmt, globals=context, num_threads=torch.get_num_threads()
            ).blocked_autorange(min_run_time=0.2)
            for name, stmt in timed.items()
        }
        del held, context


# %%
# Each method's time as a multiple of the floor, which takes the spread of the part that sets it.
def floor_of(times):
    return max(times["batched"], times["write"], key=lambda t: t.median)


def over_floor(times, method):
    return times[method].median / floor_of(times).median


for (model_name, batch_size), times in results.items():
    floor = floor_of(times)
    print(f"{model_name} B={batch_size}: the floor is {floor.median * 1e3:.2f} ms "
          f"(IQR {floor.iqr * 1e3:.2f} ms)")  # fmt: skip
    for name, t in times.items():
        ms, iqr = t.median * 1e3, t.iqr * 1e3
        print(f"    {name:17s} {ms:8.2f} ms (IQR {iqr:.2f} ms) "
              f"{over_floor(times, name):6.2f}x")  # fmt: skip
for batch_size in batch_sizes["MLP"]:
    times = results["MLP", batch_size]
    best = min((m for m in METHODS if m in times), key=lambda m: times[m].median)
    ratio = over_floor(times, best)
    print(f"best exact method at batch {batch_size}: {best}, {ratio:.2f} x the floor")

# %%
# The figure plots the same ratios; the dashed line is the floor. A point under it is a
# method that beat this run's batched step or fill, not an impossible one.
METHOD_COLORS = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "vmap chunked": "#44AA99",
    "compiled": "#117733",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
}
fig, (ax_cnn, ax_mlp) = plt.subplots(
    1, 2, figsize=(9, 3.8), layout="constrained", width_ratios=[1, 2]
)
cnn_times = results["CNN", 64]
cnn_methods = [m for m in METHODS if m in cnn_times]
ax_cnn.barh(
    cnn_methods,
    [over_floor(cnn_times, m) for m in cnn_methods],
    color=[METHOD_COLORS[m] for m in cnn_methods],
)
ax_cnn.invert_yaxis()
ax_cnn.axvline(1, color="black", linestyle="--", linewidth=1)
ax_cnn.set(title="CNN, batch 64", xlabel="time / floor")
for method in METHODS:
    sizes = [b for b in batch_sizes["MLP"] if method in results["MLP", b]]
    ratios = [over_floor(results["MLP", b], method) for b in sizes]
    ax_mlp.plot(sizes, ratios, marker="o", color=METHOD_COLORS[method], label=method)
ax_mlp.axhline(1, color="black", linestyle="--", linewidth=1)
ax_mlp.set_xscale("log", base=2)
ax_mlp.set_yscale("log")
ax_mlp.set_xticks(batch_sizes["MLP"], [str(b) for b in batch_sizes["MLP"]])
ax_mlp.set(
    xlabel="batch size", ylabel="time / floor", title=f"MLP on {device.type.upper()}"
)
ax_mlp.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %%
# What the counts say about the times
# -----------------------------------
#
# - **The loop** does the batched step's FLOPs (counted above) but dispatches every
#   operation once per sample, many times the batched step's count. Its
#   distance from the floor is probably that fixed cost per operation, which on a GPU also
#   includes a kernel launch; run this page there to see how much that moves the ratios.
# - **vmap(grad)** and **Opacus** do the batched step's FLOPs; expanded weights' count is
#   lower, probably because FlopCounterMode does not see the products inside its backward.
#   Where these methods are slower than the floor, the likely cause is extra passes over the
#   B·P floats of the result (copies, concatenations), which the sibling page measures in
#   bytes. **Chunking** dispatches the work once per chunk and concatenates the chunks.
# - **torch.compile** fuses operations, so it can run below the eager batched step that sets
#   the floor. Its compile time is printed above; ``dynamic=True`` pays it once for every batch
#   size.
# - **The hand-written formulas** skip the parameter gradients and write into kept buffers.
#   The sibling page shows the catch: each call overwrites the result of the one before.

# %%
# What to remember
# ----------------
# - ``vmap(grad(sample_loss), in_dims=(None, 0, 0))`` over ``functional_call`` gives every
#   sample's gradient; check each parameter on its own against a float64 loop.
# - Through a max-pool, check float32 against float64 on samples whose pooling picks agree in
#   both precisions, so that the reference follows the same path.
# - The floor, max(batched step, writing B·P floats), is a reference, not a bound: compare
#   methods as multiples of it, measured in the same run.
# - Count what a method does (FLOPs with ``FlopCounterMode``, operations with the profiler)
#   before explaining its time.
