"""
Per-sample gradients at the limit: every method against the floor
=================================================================

Seven ways to get one gradient per example: a loop, ``vmap(grad(...))`` plain, chunked and
compiled, PyTorch's expanded weights, Opacus' ``GradSampleModule``, and per-layer formulas by
hand, each checked per parameter against a float64 loop on a wide MLP and a small CNN, and
timed as a multiple of *the floor*: the larger of one ordinary batched forward and backward
pass and writing the B·P floats of the result into memory the process holds. Memory is on
:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_memory.py`.
"""

# %%
# Setup
# -----
# Float32 convolutions are checked against float64, so cuDNN's TF32 is off (a CPU ignores the
# setting); Opacus' warning that the images need no gradient is expected, and silenced. Under
# glibc, freed memory is kept for reuse, not handed back to the kernel: the timings need that.
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
warnings.filterwarnings("ignore", message="Full backward hook is firing")
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>
    assert libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1)


# %%
# The recipe: vmap(grad) on an MLP, checked against a float64 loop
# ----------------------------------------------------------------
# ``grad(sample_loss)`` is the gradient of *one* sample's loss with respect to the parameters;
# ``vmap`` maps it over the batch (``vmap(f)(x)`` stacks ``f(x_i)`` over ``x.unbind(0)``), with
# ``in_dims=(None, 0, 0)`` sharing the parameters. Reference: one float64 backward per sample.
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
    losses = (F.cross_entropy(net(x[None]), t[None]) for x, t in zip(images, targets))
    rows = [torch.autograd.grad(loss, weights) for loss in losses]
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
# The other methods
# -----------------
# ``chunk_size=16`` maps 16 samples at a time and concatenates. ``torch.compile`` compiles on
# its first call, timed apart. With ``dynamic=True`` one graph could serve every batch size,
# but class-index targets stop it: ``nll_loss`` gathers by them, which under ``vmap`` fixes the
# batch size, so each new size fails a guard and compiles again. One-hot targets (probabilities
# to ``cross_entropy``) need no gather; the compiled method takes them. Graphs of the loss:
def graphs_for(target_of):  # one call per batch size; returns the graphs compiled
    before = counters["stats"]["unique_graphs"]
    loss = vmap(lambda logits, t: F.cross_entropy(logits[None], t[None]))
    per_sample = torch.compile(loss, dynamic=True, backend="eager")
    for size in (64, 16, 256):
        labels = torch.randint(0, 10, (size,), device=device)
        per_sample(torch.randn(size, 10, device=device), target_of(labels))
    return counters["stats"]["unique_graphs"] - before


graph_counts = graphs_for(lambda t: t), graphs_for(lambda t: F.one_hot(t, 10).float())
print("graphs for batches 64, 16, 256, class indices vs one-hot:", *graph_counts)
assert graph_counts == (3, 1), graph_counts


# %%
# **Expanded weights** (``call_for_per_sample_grads``) is a **private API** that may change
# without notice: one ordinary backward pass leaves a ``grad_sample`` on every parameter
# (``loss_reduction="mean"``: the loss is a batch mean). **Opacus**' ``GradSampleModule`` does
# the same with hooks. Each gets its own copy of the model: no hook runs in another's timing.
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
# the output's gradient ``g_i`` with the input ``a_i``; the ordinary one is their batch *sum*. A
# 2-d convolution is a linear layer at every position of the unfolded input (``F.unfold``),
# summed over positions. Hooks capture each layer's input and output; the *summed* loss's
# gradient with respect to an output is each sample's own. ``bmm`` writes into kept buffers.
def hand_written_fn(net):
    layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    names = {p: name for name, p in net.named_parameters()}
    kept = {}

    def per_sample(images, targets):
        seen = []
        record = [m.register_forward_hook(lambda *io: seen.append(io)) for m in layers]
        logits = net(images)
        for hook in record:
            hook.remove()
        loss = F.cross_entropy(logits, targets, reduction="sum")
        out_grads = torch.autograd.grad(loss, [out for _, _, out in seen])
        for (layer, (layer_in,), _), g in zip(seen, out_grads):
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
compiled_vmap = torch.compile(vmap_grad_fn(mlp), dynamic=True)
mlp_compiled = lambda x, y: compiled_vmap(x, F.one_hot(y, 10).float())  # noqa: E731
mlp_compiled(images, targets)
compile_seconds = time.perf_counter() - compile_start
print(f"torch.compile's first call, measured once: {compile_seconds:.1f} s")
for method, fn in method_fns(mlp, mlp_compiled).items():
    worst = check(method, fn(images, targets), mlp_reference)
    print(f"MLP {method:17s} worst parameter's relative error {worst:.1e}")


# %%
# The CNN, on samples away from kinks
# -----------------------------------
# The network of PyTorch's per-sample-gradients tutorial. At its ReLUs' and max-pool's kinks
# (an input near zero, two near-equal values in a pooling window) float32 and float64 can take
# different sides, and their gradients differ by far more than rounding. So the check keeps
# samples on which both take the same side of every kink (the count says if this run needed it).
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
crossing = int((~same).sum())
print(f"CNN: {crossing} of 64 samples cross a kink in float64"
      + ("; the guard removes none here" if crossing == 0 else ""))  # fmt: skip
cnn_images, cnn_targets = images[same][:16], targets[same][:16]
assert len(cnn_images) == 16
cnn_reference = loop_grads(cnn64, cnn_images.double(), cnn_targets)
for method, fn in method_fns(cnn).items():
    worst = check(method, fn(cnn_images, cnn_targets), cnn_reference)
    print(f"CNN {method:17s} worst parameter's relative error {worst:.1e}")


# %%
# The floor: a yardstick, not a bound
# -----------------------------------
# Two costs every method seems to share: (a) **one ordinary batched forward and backward
# pass**, whose weight gradients' multiply-adds the per-sample formulas do without the batch
# sum, and (b) **writing B·P floats**, a fill of a kept tensor. The floor is the larger, from
# the same run: not a lower bound, as a method can skip work the batched step does. Counted at
# batch 64: aten operations (nested ones and views included) by the profiler; FLOPs by
# ``FlopCounterMode`` (none for elementwise ops); and, from the profiler's recorded shapes,
# elements of elementwise products shaped like per-sample weights, ``(B, out, in)``. Both checked:
def batched_step_fn(net):
    weights = list(net.parameters())
    return lambda x, y: torch.autograd.grad(F.cross_entropy(net(x), y), weights)


def counted_work(fn, *batch):  # FLOPs, operations, elements of outer products
    with FlopCounterMode(display=False) as flops:
        fn(*batch)
    with torch.profiler.profile(record_shapes=True) as prof:
        fn(*batch)
    aten_ops = sum(e.name.startswith("aten::") for e in prof.events())
    muls = [e.input_shapes[:2] for e in prof.events() if e.name == "aten::mul"]
    shapes = [torch.broadcast_shapes(*inputs) for inputs in muls]
    outer = sum(s.numel() for s in shapes if tuple(s) in weight_shapes)
    return flops.get_total_flops(), aten_ops, outer


weight_shapes = {(64, *m.weight.shape) for m in (mlp.fc1, mlp.fc2, mlp.fc3)}
a, b = torch.randn(64, 10, device=device), torch.randn(64, 256, device=device)
known = counted_work(lambda: (torch.mm(a.T, b), a[:, :, None] * b[:, None]))
assert known[0] == 2 * 10 * 64 * 256 and known[2] == 64 * 10 * 256  # (B, 10, 256)
eager = {"batched": batched_step_fn(mlp)} | method_fns(mlp)
work = {m: counted_work(fn, images, targets) for m, fn in eager.items()}
print(f"MLP, batch 64: the batched step does {work['batched'][0] / 1e6:.1f} MFLOP")
for m, (flops, ops, outer) in work.items():
    print(f"{m:17s} {flops / work['batched'][0]:.2f}x its FLOPs, {ops:5d} aten operations, "
          f"{outer / 1e6:4.1f}M elements in (B, out, in) products")  # fmt: skip
same_flops = {work[m][0] for m in ("batched", "loop", "vmap", "hand-written", "opacus")}
assert len(same_flops) == 1, work  # the batched step's products, in each
assert work["loop"][1] > 32 * work["batched"][1]  # every operation once per sample
weight_elements = 64 * sum(m.weight.numel() for m in (mlp.fc1, mlp.fc2, mlp.fc3))
assert work["batched"][0] - work["expanded weights"][0] == 2 * weight_elements
assert work["expanded weights"][2] == 2 * weight_elements
outer = work["opacus"][2], work["vmap"][2], work["hand-written"][2]
assert outer == (weight_elements, 0, 0), outer

# %%
# All asserted. **Expanded weights** lacks exactly the weight gradients' matrix products: it
# forms the per-sample ones by broadcasting (its ``einsum`` runs as ``mul``), then scales them
# by the batch size for ``"mean"`` (``maybe_scale_by_batch_size`` in its source). **Opacus**
# has the batched step's FLOPs: it fills ``.grad`` too, with the per-sample products on top,
# uncounted. ``vmap`` and the hand-written formulas use ``bmm``, counted. On the CNN the counter
# errs the other way: ``vmap`` forms a convolution's per-sample weight gradients as one grouped
# convolution (a group per sample), whose backward formula ignores groups: ``B - 1`` extra copies.
cnn_flops = [counted_work(fn(cnn), cnn_images, cnn_targets)[0]
             for fn in (batched_step_fn, vmap_grad_fn)]  # fmt: skip
positions = [26 * 26, 24 * 24]  # output positions of each 3x3 convolution, 28x28 input
B, convs = len(cnn_images), (cnn.conv1, cnn.conv2)  # 2 FLOPs per weight and position:
weight_grads = B * sum(2 * c.weight.numel() * n for c, n in zip(convs, positions))
assert cnn_flops[1] - cnn_flops[0] == (B - 1) * weight_grads
print(f"CNN, batch {B}: FlopCounterMode counts {cnn_flops[1] / cnn_flops[0]:.1f}x the "
      "batched step's FLOPs for vmap; the arithmetic is the same")  # fmt: skip

# %%
# How fast is each method?
# ------------------------
# On a CPU, calls allocate up to hundreds of MiB, which glibc keeps for the next call (setup;
# :doc:`/reading-timings` says why). :class:`torch.utils.benchmark.Timer` times each method and
# part of the floor (the CNN at the tutorial's batch of 64, the MLP over batch sizes), with the
# interquartile range (IQR) over blocks that make its overhead negligible (on a GPU, a sync):
# 0.05 s of them, then more until there are five, each run warmed up; over 0.25 s: "one block".


def measure(stmt, context):
    timer = benchmark.Timer(stmt, globals=context, num_threads=torch.get_num_threads())
    got = timer.blocked_autorange(min_run_time=0.05)
    while len(got.times) < 5 and min(got.times) <= 0.25:  # slower calls: one block
        more = timer.blocked_autorange(min_run_time=(5 - len(got.times)) * got.median)
        got = benchmark.Measurement.merge([got, more])[0]
    return got


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
for model, net in {"CNN": cnn, "MLP": mlp}.items():
    fns = method_fns(net, mlp_compiled if net is mlp else None)
    num_params = sum(p.numel() for p in net.parameters())
    for batch_size in batch_sizes[model]:
        x = torch.randn(batch_size, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        held = torch.empty(batch_size * num_params, device=device)
        timed = {"batched": "batched(x, y)", "write": "held.fill_(1.0)"}
        timed |= {m: f"fns[{m!r}](x, y)" for m in fns}
        context = {"fns": fns, "batched": batched_step_fn(net), "held": held}
        context |= {"x": x, "y": y}
        results[model, batch_size] = {k: measure(v, context) for k, v in timed.items()}
        del held, context
graphs = counters["stats"]["unique_graphs"] - graphs_before
assert graphs == 1, f"{graphs} compiled graphs"  # one for every batch size
assert sum(counters["graph_break"].values()) == breaks_before  # all of it compiled
print(f"torch.compile: {graphs} graph for all batch sizes, without a graph break")


def over_floor(times, method):  # the floor has the spread of the part that sets it
    floor = max(times["batched"], times["write"], key=lambda t: t.median)
    return times[method].median / floor.median


def in_ms(t):  # enough digits that a small spread does not read as zero
    if len(t.times) == 1:
        return f"{t.median * 1e3:8.2f} ms (one block: measured once)"
    iqr = f"{t.iqr * 1e3:.2f}" if t.iqr >= 1e-5 else f"{t.iqr * 1e3:.1g}"
    return f"{t.median * 1e3:8.2f} ms (IQR {iqr} ms, {len(t.times)} blocks)"


for (model_name, batch_size), times in results.items():
    floor = max(times["batched"], times["write"], key=lambda t: t.median)
    print(f"{model_name} B={batch_size}: the floor is {in_ms(floor).strip()}")
    for name, t in times.items():
        print(f"    {name:17s} {in_ms(t)} {over_floor(times, name):6.2f}x")
for batch_size in batch_sizes["MLP"]:
    times = results["MLP", batch_size]
    best = min((m for m in METHODS if m in times), key=lambda m: times[m].median)
    ratio = over_floor(times, best)
    print(f"best exact method at batch {batch_size}: {best}, {ratio:.2f} x the floor")
    if ratio < 1:
        print(f"    {best} is {1 / ratio:.2f}x faster than the floor")
lo, hi = batch_sizes["MLP"][0], batch_sizes["MLP"][-1]
growth = [f"{m} {results['MLP', hi][m].median / results['MLP', lo][m].median:.2f}x"
          for m in ("batched", "vmap")]  # fmt: skip
print(f"MLP at batch {hi}, in multiples of the time at batch {lo}:", ", ".join(growth))

# %%
# The same ratios; dashed, the floor: a point under it beat this run's batched step or fill.
fig, (ax_cnn, ax_mlp) = plt.subplots(
    1, 2, figsize=(9, 3.8), layout="constrained", width_ratios=[1, 2]
)
cnn_methods = [m for m in METHODS if m in results["CNN", 64]]
cnn_ratios = [over_floor(results["CNN", 64], m) for m in cnn_methods]
ax_cnn.barh(cnn_methods, cnn_ratios, color=[METHOD_COLORS[m] for m in cnn_methods])
ax_cnn.invert_yaxis()
ax_cnn.axvline(1, color="black", linestyle="--", linewidth=1)
ax_cnn.set(title="CNN, batch 64", xlabel="time / floor")
for method in METHODS:
    sizes = [b for b in batch_sizes["MLP"] if method in results["MLP", b]]
    ratios = [over_floor(results["MLP", b], method) for b in sizes]
    ax_mlp.plot(sizes, ratios, marker="o", color=METHOD_COLORS[method], label=method)
ax_mlp.axhline(1, color="black", linestyle="--", linewidth=1)
ax_mlp.set(xscale="log", yscale="log", xlabel="batch size", ylabel="time / floor",
           title=f"MLP on {device.type.upper()}")  # fmt: skip
ax_mlp.set_xticks(batch_sizes["MLP"], [str(b) for b in batch_sizes["MLP"]])
ax_mlp.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %%
# What the counts say about the times
# -----------------------------------
# - **The loop** does the batched step's FLOPs but dispatches every operation once per sample;
#   its distance from the floor is probably that fixed cost (on a GPU, a kernel launch too).
# - **vmap(grad)** does the batched step's products, the per-sample ones as ``bmm``. Above the
#   floor, extra passes over the B·P floats (copies, concatenations) and many small products
#   for one large one are candidates the counts do not tell apart; both grow with B. Where the
#   times barely grow with B (the last line printed; on a GPU at these sizes they can stay
#   flat), a fixed cost per operation sets them instead, and the operation counts are the guide.
#   **Chunking** repeats the work per chunk and concatenates; **expanded weights** writes the
#   per-sample weight gradients twice; **Opacus** computes the ordinary ones too.
# - **The hand-written formulas** skip the ordinary weight gradients and write into kept
#   buffers. The sibling page shows the catch: each call overwrites the result of the one before.

# %%
# What to remember
# ----------------
# - ``vmap(grad(sample_loss), in_dims=(None, 0, 0))`` over ``functional_call`` gives every
#   sample's gradient; check each parameter on its own against a float64 loop.
# - Near a ReLU or max-pool kink, float32 and float64 can differ by far more than rounding:
#   check on samples where both precisions take the same side of every kink.
# - With class-index targets, ``torch.compile(..., dynamic=True)`` of ``vmap(grad)`` compiles
#   once per batch size; one-hot targets compile one graph for all.
# - The floor, max(batched step, writing B·P floats), is a yardstick, not a bound: compare
#   methods as multiples of it, measured in the same run.
# - Count what a method does before explaining its time, and check the counter on known cases:
#   ``FlopCounterMode`` misses elementwise products and over-counts a grouped convolution.
