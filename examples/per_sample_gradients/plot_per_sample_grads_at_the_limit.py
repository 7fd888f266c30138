"""
Per-sample gradients at the limit: every method against the floor
=================================================================

Seven ways to get one gradient per example out of PyTorch: a loop, ``vmap(grad(...))`` plain,
chunked and compiled, PyTorch's expanded weights, Opacus' ``GradSampleModule``, and per-layer
formulas written by hand. This page checks each, parameter by parameter, against a float64
loop on a wide MLP and a small CNN, and times each as a multiple of a yardstick, *the floor*:
the larger of one ordinary batched forward and backward pass and writing the B·P floats of the
result into memory the process holds. Use it to pick a method for your model and batch size.
Memory is on :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_memory.py`.
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
from torch._dynamo.utils import counters
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
        self.fc1, self.fc2 = nn.Linear(784, 256), nn.Linear(256, 256)
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
broken = vmap_grad_fn(mlp)(images, targets)
broken["fc1.bias"] = torch.zeros_like(broken["fc1.bias"])
try:
    check("vmap with a zeroed bias", broken, mlp_reference)
    raise RuntimeError("a zeroed bias gradient passed the check")
except AssertionError as error:
    print("caught:", error)
    assert "fc1.bias has relative error 1.00e+00" in str(error)


# %%
# The other methods
# -----------------
# ``chunk_size=16`` maps 16 samples at a time and concatenates the pieces. ``torch.compile``
# compiles on its first call, timed on its own, and again for each new batch size: ``vmap``
# fixes the batch size in the graph even with ``dynamic=True`` (the graphs are counted below).
# **Expanded weights** (``call_for_per_sample_grads``) is a **private API** (the underscore in
# ``torch.nn.utils._per_sample_grad``) that may change without notice: one ordinary backward
# pass leaves a ``grad_sample`` on every parameter; ``loss_reduction="mean"`` says the loss is
# a batch mean. **Opacus**' ``GradSampleModule`` does the same with hooks. Each gets its own
# copy of the model, so that no hook runs inside another method's timing.
def expanded_weights_fn(net):
    net = copy.deepcopy(net)

    def per_sample(images, targets):
        kwargs = {"batch_size": len(images), "loss_reduction": "mean"}
        wrapped = call_for_per_sample_grads(net, **kwargs)
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
        named = wrapped.named_parameters()
        return {n.removeprefix("_module."): p.grad_sample for n, p in named}

    return per_sample


# %%
# Hand-written per-layer formulas
# -------------------------------
# For a linear layer ``y = W a + b``, sample ``i``'s weight gradient is the outer product of
# the gradient reaching the output, ``g_i``, with the input ``a_i``; the ordinary weight
# gradient is their *sum* over the batch. A 2-d convolution is a linear layer at every position
# of the unfolded input (:func:`~torch.nn.functional.unfold`): the same product, summed over
# positions. Forward hooks capture each layer's input and output; the gradient of the *summed*
# loss with respect to the outputs is each sample's own output gradient. The products are
# written with :func:`torch.bmm` into buffers kept from call to call.
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


graphs_before = counters["stats"]["unique_graphs"]
compile_start = time.perf_counter()
mlp_compiled = torch.compile(vmap_grad_fn(mlp), dynamic=True)
mlp_compiled(images, targets)
compile_seconds = time.perf_counter() - compile_start
print(f"torch.compile's first call, measured once: {compile_seconds:.1f} s")
for method, fn in method_fns(mlp, mlp_compiled).items():
    worst = check(method, fn(images, targets), mlp_reference)
    print(f"MLP {method:17s} worst parameter's relative error {worst:.1e}")


# %%
# The CNN, on samples away from kinks
# -----------------------------------
# The network of PyTorch's per-sample-gradients tutorial. Its ReLUs and max-pool have kinks,
# where the gradient jumps (an input near zero, two near-equal values in a pooling window);
# there float32 and float64 can take different sides, and their gradients differ by far more
# than rounding. So the check keeps samples on which both take the same side of every kink.
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def kink_sides(self, images):  # ReLU signs and max-pool picks, layer by layer
        z1 = self.conv1(images)
        z2 = self.conv2(F.relu(z1))
        pooled, picks = F.max_pool2d(F.relu(z2), 2, return_indices=True)
        return [z1 > 0, z2 > 0, picks, self.fc1(pooled.flatten(start_dim=1)) > 0]

    def forward(self, images):
        hidden = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(images)))), 2)
        return self.fc2(F.relu(self.fc1(hidden.flatten(start_dim=1))))


cnn = SmallCNN().to(device)
cnn64 = copy.deepcopy(cnn).double()
with torch.no_grad():
    sides = zip(cnn.kink_sides(images), cnn64.kink_sides(images.double()))
    same = torch.stack([(a == b).flatten(1).all(1) for a, b in sides]).all(0)
print(f"CNN: {int((~same).sum())} of 64 samples cross a kink in float64")
cnn_images, cnn_targets = images[same][:16], targets[same][:16]
assert len(cnn_images) == 16
cnn_reference = loop_grads(cnn64, cnn_images.double(), cnn_targets)
for method, fn in method_fns(cnn).items():
    worst = check(method, fn(cnn_images, cnn_targets), cnn_reference)
    print(f"CNN {method:17s} worst parameter's relative error {worst:.1e}")


# %%
# The floor: a yardstick, not a bound
# -----------------------------------
# Two costs every method seems to share. (a) **One ordinary batched forward and backward
# pass**: the per-sample formulas do the ordinary weight gradient's multiply-adds, without the
# sum over the batch. (b) **Writing B·P floats**, the result, into memory the process holds (a
# fill of a kept tensor). The floor is the larger of the two, measured in the same run.
# It is not a lower bound: compiled code fuses operations that the eager step runs one at a
# time, and noise moves both sides, so methods can land under it. What each method does is
# counted at batch 64: the aten operations it dispatches (nested ones and views included) with
# the profiler, and FLOPs with ``FlopCounterMode``, which has formulas for matrix products and
# convolutions only. Checked first: a matrix product counts ``2·m·k·n``, and outer products
# formed by a broadcast elementwise product count nothing.
def batched_step_fn(net):
    weights = list(net.parameters())
    return lambda images, targets: torch.autograd.grad(
        F.cross_entropy(net(images), targets), weights
    )


def counted_work(fn, *batch):
    with FlopCounterMode(display=False) as flops_seen:
        fn(*batch)
    with torch.profiler.profile() as prof:
        fn(*batch)
    aten_ops = sum(e.name.startswith("aten::") for e in prof.events())
    return flops_seen.get_total_flops(), aten_ops


a, b = torch.randn(64, 10, device=device), torch.randn(64, 256, device=device)
with FlopCounterMode(display=False) as known:
    torch.mm(a.T, b), a[:, :, None] * b[:, None]
assert known.get_total_flops() == 2 * 10 * 64 * 256  # the matrix product only
eager = {"batched": batched_step_fn(mlp)} | method_fns(mlp)
work = {m: counted_work(fn, images, targets) for m, fn in eager.items()}
print(f"MLP, batch 64: the batched step does {work['batched'][0] / 1e6:.1f} MFLOP")
for m, (flops, ops) in work.items():
    print(f"{m:17s} {flops / work['batched'][0]:.2f}x its FLOPs, "
          f"{ops:6d} aten operations")  # fmt: skip
assert work["loop"][0] == work["batched"][0]  # the same products, one sample at a time
assert work["loop"][1] > 32 * work["batched"][1]  # every operation once per sample
weight_grad_flops = sum(2 * 64 * m.weight.numel() for m in (mlp.fc1, mlp.fc2, mlp.fc3))
assert work["batched"][0] - work["expanded weights"][0] == weight_grad_flops

# %%
# Expanded weights' count lacks exactly the weight gradients' products (asserted): it forms
# them as broadcast elementwise products (its ``einsum`` runs as ``mul`` here), which the
# counter does not count. On the CNN it errs the other way: under ``vmap``, a convolution's
# per-sample weight gradient is one convolution with a group per sample, and the counter's
# formula for its backward ignores groups, so ``vmap`` shows ``B - 1`` extra copies (asserted).
cnn_flops = [counted_work(fn(cnn), cnn_images, cnn_targets)[0]
             for fn in (batched_step_fn, vmap_grad_fn)]  # fmt: skip
with torch.no_grad():  # each convolution's output positions, for one sample
    z1 = cnn.conv1(cnn_images[:1])
    positions = [z1[0, 0].numel(), cnn.conv2(z1)[0, 0].numel()]
B, convs = len(cnn_images), (cnn.conv1, cnn.conv2)
# a multiply-add (2 FLOPs) per weight and output position, for each sample:
weight_grads = B * sum(2 * c.weight.numel() * n for c, n in zip(convs, positions))
assert cnn_flops[1] - cnn_flops[0] == (B - 1) * weight_grads
print(f"CNN, batch {B}: FlopCounterMode counts {cnn_flops[1] / cnn_flops[0]:.1f}x the "
      "batched step's FLOPs for vmap; the arithmetic is the same")  # fmt: skip

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
# printed with its interquartile range (IQR) over at least five timed blocks.
def measure(stmt, context, blocks=5):
    timer = benchmark.Timer(stmt, globals=context, num_threads=torch.get_num_threads())
    first = timer.blocked_autorange(min_run_time=0.2)
    missing = blocks - len(first.times)  # a slow call: time more blocks, for a spread
    more = [timer.timeit(first.number_per_run) for _ in range(missing)]
    return benchmark.Measurement.merge([first, *more])[0]


batch_sizes = {"CNN": [64], "MLP": [16, 64, 256]}
if device.type != "cpu":  # a GPU: larger batches
    batch_sizes = {"CNN": [64, 256], "MLP": [64, 256, 1024]}
METHOD_COLORS = {
    "loop": "#D55E00", "vmap": "#009E73", "vmap chunked": "#44AA99", "compiled": "#117733",
    "expanded weights": "#332288", "opacus": "#AA4499", "hand-written": "#999933",
}  # fmt: skip
METHODS = list(METHOD_COLORS)  # the exact methods, in the order of the figure
breaks_before = sum(counters["graph_break"].values())
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
            name: measure(stmt, context) for name, stmt in timed.items()
        }
        del held, context
graphs = counters["stats"]["unique_graphs"] - graphs_before
assert graphs == len({64, *batch_sizes["MLP"]}), f"{graphs} compiled graphs"
assert sum(counters["graph_break"].values()) == breaks_before  # all of it compiled
print(f"torch.compile: {graphs} graphs, one per batch size, without a graph break")


# %%
# Each method's time as a multiple of the floor, which takes the spread of the part that sets it.
def floor_of(times):
    return max(times["batched"], times["write"], key=lambda t: t.median)


def over_floor(times, method):
    return times[method].median / floor_of(times).median


def in_ms(t):  # enough digits that a small spread does not read as zero
    iqr = f"{t.iqr * 1e3:.2f}" if t.iqr >= 1e-5 else f"{t.iqr * 1e3:.1g}"
    return f"{t.median * 1e3:8.2f} ms (IQR {iqr} ms, {len(t.times)} blocks)"


for (model_name, batch_size), times in results.items():
    print(f"{model_name} B={batch_size}: the floor is {in_ms(floor_of(times)).strip()}")
    for name, t in times.items():
        print(f"    {name:17s} {in_ms(t)} {over_floor(times, name):6.2f}x")
for batch_size in batch_sizes["MLP"]:
    times = results["MLP", batch_size]
    best = min((m for m in METHODS if m in times), key=lambda m: times[m].median)
    print(f"best exact method at batch {batch_size}: {best}, "
          f"{over_floor(times, best):.2f} x the floor")  # fmt: skip

# %%
# The figure plots the same ratios; the dashed line is the floor. A point under it is a
# method that beat this run's batched step or fill, not an impossible one.
fig, (ax_cnn, ax_mlp) = plt.subplots(
    1, 2, figsize=(9, 3.8), layout="constrained", width_ratios=[1, 2]
)
cnn_times = results["CNN", 64]
cnn_methods = [m for m in METHODS if m in cnn_times]
cnn_ratios = [over_floor(cnn_times, m) for m in cnn_methods]
ax_cnn.barh(cnn_methods, cnn_ratios, color=[METHOD_COLORS[m] for m in cnn_methods])
ax_cnn.invert_yaxis()
ax_cnn.axvline(1, color="black", linestyle="--", linewidth=1)
ax_cnn.set(title="CNN, batch 64", xlabel="time / floor")
for method in METHODS:
    sizes = [b for b in batch_sizes["MLP"] if method in results["MLP", b]]
    ratios = [over_floor(results["MLP", b], method) for b in sizes]
    ax_mlp.plot(sizes, ratios, marker="o", color=METHOD_COLORS[method], label=method)
ax_mlp.axhline(1, color="black", linestyle="--", linewidth=1)
ax_mlp.set(xscale="log", yscale="log", xlabel="batch size", ylabel="time / floor")
ax_mlp.set_xticks(batch_sizes["MLP"], [str(b) for b in batch_sizes["MLP"]])
ax_mlp.set_title(f"MLP on {device.type.upper()}")
ax_mlp.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %%
# What the counts say about the times
# -----------------------------------
# - **The loop** does the batched step's FLOPs but dispatches every operation once per sample;
#   its distance from the floor is probably that fixed cost (on a GPU, a kernel launch too).
# - **vmap(grad)**, **Opacus** and **expanded weights** do the batched step's products. Where
#   they are slower than the floor, extra passes over the B·P floats (copies, concatenations)
#   and many small products in place of one large one are both candidates; the counts do not
#   tell them apart. **Chunking** runs the work once per chunk and concatenates the chunks.
# - **torch.compile** fuses operations, so it can run below the eager batched step.
# - **The hand-written formulas** skip the parameter gradients and write into kept buffers.
#   The sibling page shows the catch: each call overwrites the result of the one before.

# %%
# What to remember
# ----------------
# - ``vmap(grad(sample_loss), in_dims=(None, 0, 0))`` over ``functional_call`` gives every
#   sample's gradient; check each parameter on its own against a float64 loop.
# - Near a ReLU or max-pool kink, float32 and float64 can differ by far more than rounding:
#   check on samples where both precisions take the same side of every kink.
# - The floor, max(batched step, writing B·P floats), is a yardstick, not a bound: compare
#   methods as multiples of it, measured in the same run.
# - Count what a method does before explaining its time, and check the counter on known cases:
#   ``FlopCounterMode`` misses elementwise products and over-counts a grouped convolution.
