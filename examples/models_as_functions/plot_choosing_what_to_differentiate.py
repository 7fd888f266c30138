"""
Choosing what to differentiate: parameter subsets, inputs and mixed derivatives
===============================================================================

:func:`~torch.func.grad` differentiates the arguments you name, and nothing else. On a small
classifier: some layers' gradients alone, parameter and input gradients from one call, mixed
derivatives, training on an input-gradient penalty, per-sample gradients from a forward pass
that already ran and as one (B, P) matrix. Each recipe is checked against float64 autograd or
finite differences; costs are counted exactly: matrix-product FLOPs, operator calls, memory.
"""

# %%
# Setup: a classifier, and its float64 copy for the checks
# --------------------------------------------------------
# Two ``tanh`` layers and a linear head, 32 samples of 8 features; the GPU if there is one.
import collections
import copy
import gc
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, grad_and_value, jacfwd, jvp, vmap
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

D, H, C, B = 8, 64, 3, 32  # input features, hidden width, classes, batch
layers = [nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, C)]
net = nn.Sequential(*layers).to(device)
net64 = copy.deepcopy(net).double()
leaves64 = list(net64.parameters())
inputs = torch.randn(B, D, device=device)
labels = torch.randint(0, C, (B,), device=device)
everything = {name: p.detach() for name, p in net.named_parameters()}
names = list(everything)


# %%
# 1. Gradients of a subset of the parameters
# ------------------------------------------
# "How to get only the last few layers' gradient?" (functorch#1101); "Allow taking gradients
# with respect to a subset of the model's parameters" (MadryLab/trak#1). Pass the trained dict
# first, the argument ``grad`` differentiates; :func:`~torch.func.functional_call` merges a
# tuple of dicts (buffers too) and takes any name they lack from the module, so the frozen dict
# may be left empty. The loss takes a batch, or one sample under ``vmap``.
def loss(trained, frozen, x, y, model=net):
    buffers = dict(model.named_buffers())
    return F.cross_entropy(functional_call(model, (trained, frozen, buffers), (x,)), y)


trained = {name: p for name, p in everything.items() if name.startswith("4.")}  # head
frozen = {name: p for name, p in everything.items() if name not in trained}
per_sample = vmap(grad(loss), in_dims=(None, None, 0, 0))
head_grads = per_sample(trained, frozen, inputs, labels)  # {"4.weight", "4.bias"} only
# ``check`` asserts each tensor against a float64 reference (for per-sample gradients, a loop
# of ``autograd.grad``) and prints the worst.


def check(label, got, want, bound):
    got, want = (got, want) if isinstance(want, dict) else ({"": got}, {"": want})
    errors = {k: ((got[k] - w).norm() / w.norm()).item() for k, w in want.items()}
    worst = max(errors, key=errors.get)  # all within the bound if the worst is
    margin = f"{bound / errors[worst]:.0f}x margin" if errors[worst] else "exact"
    print(f"{f'{label} {worst}'.strip()}: worst relative error {errors[worst]:.1e} (bound "
          f"{bound:.0e}, {margin})")  # fmt: skip
    assert got.keys() == want.keys() and errors[worst] < bound, (label, worst)


def loop64(model, chosen, xs, ys):
    leaves = [model.get_parameter(name) for name in chosen]
    rows = [torch.autograd.grad(F.cross_entropy(model(x[None]), y[None]), leaves)
            for x, y in zip(xs.double() if xs.is_floating_point() else xs, ys)]  # fmt: skip
    return {name: torch.stack(column) for name, column in zip(chosen, zip(*rows))}


check("per-sample head", head_grads, loop64(net64, trained, inputs, labels), 3e-6)


# %%
# Keeping the head's part of every gradient (the first attempt in functorch#1101) pays for
# all. ``FlopCounterMode`` counts a batch gradient's matrix-product FLOPs, each equal to its
# closed form: the forward, then all weights' gradients and the gradients passed back through
# the last two layers; the head's weight gradient alone; or the first layer's, *and* the passes
# back through the frozen layers after it, which skip only their own weights' gradients.
def matmul_flops(fn, *args):
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


forward = 2 * B * (D * H + H * H + H * C)
full_flops = matmul_flops(grad(loss), everything, {}, inputs, labels)
head_flops = matmul_flops(grad(loss), trained, frozen, inputs, labels)
first = {name: p for name, p in everything.items() if name.startswith("0.")}
first_flops = matmul_flops(grad(loss), first, {}, inputs, labels)
assert full_flops == 2 * forward + 2 * B * (H * C + H * H)
assert head_flops == forward + 2 * B * H * C
assert first_flops == forward + 2 * B * (H * C + H * H) + 2 * B * D * H
P, P_head = (sum(p.numel() for p in d.values()) for d in (everything, trained))
print(f"matmul FLOPs of a batch gradient: all {full_flops:,}, head {head_flops:,} "
      f"({full_flops / head_flops:.2f}x fewer), first layer {first_flops:,} "
      f"({full_flops / first_flops:.2f}x fewer); {P:,} vs {P_head:,} floats a sample")  # fmt: skip

# %%
# One embedding table alone
# -------------------------
# TRAK's case, an :class:`~torch.nn.Embedding`'s weight alone in a classifier over 6 tokens: a
# sample's gradient is the whole (100, 8) table, non-zero in its distinct tokens' rows only.
bag = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(-2), nn.Linear(48, C)).to(device)
tokens = torch.randint(0, 100, (B, 6), device=device)
table = {"0.weight": bag[0].weight.detach()}
table_grads = per_sample(table, {}, tokens, labels, model=bag)  # the rest from ``bag``
check("embedding table", table_grads, loop64(bag.double(), table, tokens, labels), 3e-6)
rows_touched = (table_grads["0.weight"] != 0).any(dim=-1).sum(dim=-1).cpu()
assert torch.equal(rows_touched, torch.tensor([t.unique().numel() for t in tokens]))
print(f"non-zero rows per sample: {rows_touched.float().mean():.2f} of 100 on average")


# %%
# 2. Parameters and the input together: ``argnums`` and ``has_aux``
# -----------------------------------------------------------------
# ``argnums=(0, 1)`` differentiates the first two arguments and returns a tuple. With
# ``has_aux=True`` the function returns ``(loss, extra)`` and the extra (the logits) comes back
# as it is; :func:`~torch.func.grad_and_value` adds the loss. One forward and one backward.
def loss_and_logits(params, x, y):
    logits = functional_call(net, (params, dict(net.named_buffers())), (x,))
    return F.cross_entropy(logits, y), logits


both = grad_and_value(loss_and_logits, argnums=(0, 1), has_aux=True)
(param_grads, input_grad), (value, logits) = both(everything, inputs, labels)
inputs64 = inputs.double().requires_grad_()
logits64 = net64(inputs64)
loss64 = F.cross_entropy(logits64, labels)
*grads64, input_grad64 = torch.autograd.grad(loss64, [*net64.parameters(), inputs64])
check("parameter gradients", param_grads, dict(zip(names, grads64)), 3e-6)
check("input gradient", input_grad, input_grad64, 3e-6)
check("loss", value, loss64.detach(), 1e-6)
check("logits (aux)", logits, logits64.detach(), 3e-6)

# %%
# 3. Mixed derivatives: how the parameter gradient moves with the input
# ---------------------------------------------------------------------
# Input-gradient regularisers and losses built from a Jacobian (functorch#1056 trains weights
# ``W`` on a loss of ``J = ∂f/∂x``) need ``∂/∂x ∇θ L``: for 4 inputs of 8 features, a P × 32
# block, tall, so :func:`~torch.func.jacfwd` of the gradient (32 tangents; ``jacrev`` would pull
# P cotangents). Its product with one direction is :func:`~torch.func.jvp`, without the block.
few_x, few_y = inputs[:4], labels[:4]
params_grad = lambda x: grad(loss)(everything, {}, x, few_y)  # noqa: E731
block = jacfwd(params_grad)(few_x)  # {name: shape + (4, 8)}
direction = torch.randn_like(few_x)
_, product = jvp(params_grad, (few_x,), (direction,))


def central_difference(step, eps=1e-5):
    moved = [net64(few_x.double() + sign * eps * step) for sign in (1, -1)]
    up, down = (torch.autograd.grad(F.cross_entropy(m, few_y), leaves64) for m in moved)
    return {name: (u - d) / (2 * eps) for name, u, d in zip(names, up, down)}


columns = [central_difference(e.view_as(few_x)) for e in
           torch.eye(few_x.numel(), dtype=torch.float64, device=device)]  # fmt: skip
block_fd = {n: torch.stack([c[n] for c in columns], -1).unflatten(-1, few_x.shape)
            for n in names}  # fmt: skip
check("mixed block", block, block_fd, 3e-6)  # both against central differences
check("mixed product", product, central_difference(direction.double()), 3e-6)
block_floats = sum(t.numel() for t in block.values())
assert block_floats == P * few_x.numel()
print(f"mixed block: {block_floats:,} floats (P x {few_x.numel()}), its product {P:,}; for"
      f" all {B} inputs, {P * B * D * 4 / 2**20:.1f} MiB vs {P * 4 / 2**10:.1f} KiB")  # fmt: skip

# %%
# A training step on a loss built from an input gradient
# ------------------------------------------------------
# ``L + λ ||∇x L||²`` penalises the input gradient. ``grad`` of a function that calls ``grad``
# is a double backward, checked against float64 autograd with ``create_graph=True``.
# functorch#1056's loss of ``J·1`` has the same shape, with ``jvp`` in the inner call.
strength, lr = 0.5, 0.1


def regularised(params, x, y):
    input_grad = grad(loss, argnums=2)(params, {}, x, y)
    return loss(params, {}, x, y) + strength * input_grad.pow(2).sum()


step_grads = grad(regularised)(everything, few_x, few_y)
x64 = few_x.double().requires_grad_()
plain64 = F.cross_entropy(net64(x64), few_y)
(few_input_grad64,) = torch.autograd.grad(plain64, x64, create_graph=True)
objective64 = plain64 + strength * few_input_grad64.pow(2).sum()
step64 = dict(zip(names, torch.autograd.grad(objective64, leaves64)))
check("double backward", step_grads, step64, 3e-6)
stepped = {name: p - lr * step_grads[name] for name, p in everything.items()}
before, after = (regularised(p, few_x, few_y).item() for p in (everything, stepped))
print(f"regularised objective: {before:.4f} before one step, {after:.4f} after")
assert after < before

# %%
# 4. Per-sample gradients from a forward pass that already ran
# ------------------------------------------------------------
# When the batch's graph is alive (pytorch#156616 asks for this), :func:`torch.autograd.grad`
# with ``is_grads_batched=True`` maps the backward over the rows of ``grad_outputs``. With the
# losses unreduced and the rows of the identity, row ``b`` is sample ``b``'s gradient.
leaves = list(net.parameters())
losses = F.cross_entropy(net(inputs), labels, reduction="none")  # the forward that ran
one_hot_rows = torch.eye(B, device=device)
batched_backward = lambda: torch.autograd.grad(  # noqa: E731
    losses, leaves, grad_outputs=one_hot_rows, is_grads_batched=True, retain_graph=True
)
all_reference = loop64(net64, names, inputs, labels)
check("is_grads_batched", dict(zip(names, batched_backward())), all_reference, 3e-6)
# ``grad_outputs`` without the batch axis (pytorch#76290): the first axis of each tensor counts
# the vector-Jacobian products, so one shaped like the output is read as a batch and refused.
try:
    torch.autograd.grad(losses, leaves, torch.ones_like(losses), is_grads_batched=True)
    raise AssertionError("is_grads_batched accepted grad_outputs without a batch axis")
except RuntimeError as refusal:
    message = str(refusal)
assert "we interpret the first dimension of each grad_output as the batch" in message
print("RuntimeError:", message[:200], "...")


# %%
# Its limits, counted. Each one-hot row drives a backward through the *whole* batch's graph:
# one vectorised backward doing B times one backward's matrix-product FLOPs, in the same
# number of (larger) matrix products, where ``vmap(grad)`` costs one forward and backward. Ops
# the legacy ``vmap`` has no batching rule for (``_debug_only_display_vmap_fallback_warnings``
# names them) run once per row: a dispatch mode (views left out) counts ``tanh``'s backward.
class OpCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, operator, types, args=(), kwargs=None):
        out = operator(*args, **(kwargs or {}))
        if not operator.is_view and "view" not in operator.name():
            self.calls.append((operator.name(), getattr(out, "numel", lambda: 0)()))
        return out


batched_flops = matmul_flops(batched_backward)
backward_flops = matmul_flops(torch.autograd.grad, losses.sum(), leaves, None, True)
vmap_flops = matmul_flops(per_sample, everything, {}, inputs, labels)
assert batched_flops == B * backward_flops and vmap_flops == forward + backward_flops
calls = []
for fn in [batched_backward, lambda: per_sample(everything, {}, inputs, labels)]:
    with OpCalls() as seen:
        fn()
    calls.append(collections.Counter(op for op, _ in seen.calls))
tanh_calls = [counts["aten::tanh_backward"] for counts in calls]
products = calls[0]["aten::mm"] + calls[0]["aten::bmm"]
assert tanh_calls == [2 * B, 2] and products == 3 + 2  # 3 weights', 2 passed back
print(f"matmul FLOPs: is_grads_batched's backward {batched_flops:,} ({B} x one backward, "
      f"{products} matrix products), {batched_flops / vmap_flops:.1f}x those of vmap(grad)'s "
      f"forward and backward; tanh_backward calls: {tanh_calls[0]} vs {tanh_calls[1]}")  # fmt: skip


# %%
# ``Linear`` layers need no ``is_grads_batched``: with the losses summed, one ordinary backward
# gives row ``b`` of a layer's output gradient for sample ``b`` alone; hooks keep it and the
# layer's input, whose outer product is sample ``b``'s weight gradient. torch.func cannot reuse
# autograd's graph: its transforms take a function, and ``vmap(grad)`` reruns the forward (the
# ``forward`` in its FLOP count above). Per-sample formulas for other layers, by hand:
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_at_the_limit.py`.
def keep(layer, args, out):  # forward hook: the input now, its output's gradient later
    saved[layer].append(args[0])
    out.register_hook(saved[layer].append)


saved = collections.defaultdict(list)
hooks = [layer.register_forward_hook(keep) for layer in net[::2]]
hooked = F.cross_entropy(net(inputs), labels, reduction="none")  # a training forward
assert matmul_flops(torch.autograd.grad, hooked.sum(), leaves) == backward_flops
hook_grads = {}
for layer, weight, bias in zip(net[::2], names[::2], names[1::2]):
    x_in, g_out = saved[layer]
    hook_grads |= {weight: torch.einsum("bo,bi->boi", g_out, x_in), bias: g_out}
check("hooks", hook_grads, all_reference, 3e-6)
for hook in hooks:
    hook.remove()

# %%
# BatchNorm in training mode couples the rows: each loss depends on every sample through the
# batch statistics, so row ``b`` is ``∂ loss_b / ∂θ`` through the whole batch, not sample ``b``'s
# own gradient. Checked: moving sample 1 changes row 0 with :class:`~torch.nn.BatchNorm1d` (after
# a layer without bias, which it would cancel), and leaves it bit for bit as it was without.
normed = nn.Sequential(nn.Linear(D, H, bias=False), nn.BatchNorm1d(H), nn.Linear(H, C))
shifted = torch.cat([inputs[:1], inputs[1:2] + 3, inputs[2:]])
change = {}
for label, model in [("BatchNorm", normed.to(device)), ("no BatchNorm", net)]:
    here, there = (torch.autograd.grad(
        F.cross_entropy(model(x), labels, reduction="none"), list(model.parameters()),
        one_hot_rows, is_grads_batched=True) for x in (inputs, shifted))  # fmt: skip
    pairs = zip(here, there)
    change[label] = max(((a[0] - b[0]).norm() / a[0].norm()).item() for a, b in pairs)
print(f"row 0's relative change when sample 1 moves: {change}")
assert change["BatchNorm"] > 0.05 and change["no BatchNorm"] == 0
# ``vmap(grad)`` over samples (batches of one) refuses training-mode BatchNorm, which updates
# its buffers in place. Use eval mode (running statistics) or GroupNorm. In section 6 of
# :ref:`pitfalls <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, "what each remedy computes",
# ``replace_all_batch_norm_modules_`` refuses these features, or computes another model.
bn_params = {name: p.detach() for name, p in normed.named_parameters()}
try:  # B batches of one sample each
    per_sample(bn_params, {}, inputs[:, None], labels[:, None], model=normed)
    raise AssertionError("vmap(grad) ran BatchNorm in training mode")
except RuntimeError as refusal:
    message = str(refusal)
assert "would mutate a captured Tensor" in message
print("RuntimeError:", message[:160], "...")

# %%
# 5. Per-sample gradients as one (B, P) matrix
# --------------------------------------------
# Clipping, projecting or comparing per-sample gradients wants one row per sample. Joining
# ``vmap(grad)``'s per-parameter results with :func:`torch.cat` holds them and the matrix at
# once. Or differentiate one flat vector of all P parameters, whose pieces (``split``, then
# ``view_as``) feed ``functional_call``: ``grad`` then returns the (B, P) matrix itself.
sizes = [p.numel() for p in everything.values()]
flat_params = torch.cat([p.flatten() for p in everything.values()])


def flat_loss(flat, x, y, cut=lambda flat: flat.split(sizes)):
    parts = dict(zip(names, cut(flat)))
    return loss({n: parts[n].view_as(p) for n, p in everything.items()}, {}, x, y)


joined_with_cat = lambda: torch.cat(  # noqa: E731
    [g.flatten(1) for g in per_sample(everything, {}, inputs, labels).values()], dim=1
)
per_sample_flat = vmap(grad(flat_loss), in_dims=(None, 0, 0))
flat_grads = per_sample_flat(flat_params, inputs, labels)  # (B, P); checked below
torch.testing.assert_close(flat_grads, joined_with_cat())  # as with torch.cat


# %%
# The peak memory of each route
# -----------------------------
# ``peak_bytes``: one call's peak above what was live before it, from the caching allocator on
# a GPU, and on a CPU from the ``[memory]`` events of torch's profiler (``profile_memory=True``),
# running totals of the bytes live in PyTorch's allocator, scratch inside operations included.
# Checked on ``torch.ones(n).exp()``: two tensors of n floats. Six routes, each checked: the two
# above; the flat vector cut with slices instead of ``split``; a (B, P) buffer made first, filled
# 4 samples at a time under ``vmap``, or one at a time; ``vmap(..., chunk_size=4)``, which joins
# its chunks at the end (more on ``chunk_size``:
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_memory.py`).
def peak_bytes(fn):
    gc.collect()
    if torch.cuda.is_available():  # the caching allocator's peak of requested bytes
        torch.cuda.current_stream().synchronize()
        live = torch.cuda.memory_stats()["requested_bytes.all.current"]
        torch.cuda.memory.reset_peak_memory_stats()
        result = fn()
        torch.cuda.current_stream().synchronize()
        return torch.cuda.memory_stats()["requested_bytes.all.peak"] - live, result
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorder:
        result = fn()
    with tempfile.TemporaryDirectory() as workdir:
        recorder.export_chrome_trace(f"{workdir}/memory.json")
        trace = json.loads(Path(workdir, "memory.json").read_text())["traceEvents"]
    totals = [e["args"] for e in trace if e["name"] == "[memory]"]
    live = totals[0]["Total Allocated"] - totals[0]["Bytes"]
    return max(t["Total Allocated"] for t in totals) - live, result


known, _ = peak_bytes(lambda: torch.ones(2**16, device=device).exp())
print(f"peak of torch.ones(2**16).exp(): {known:,} bytes")
assert known == 2 * 2**18


def into_buffer(rows_at_once):
    out = torch.empty(B, P, device=device)
    for part in torch.arange(B, device=device).split(rows_at_once):
        out[part] = per_sample_flat(flat_params, inputs[part], labels[part])
    return out


ends = torch.tensor(sizes).cumsum(0).tolist()
slices = lambda flat: [flat[end - n : end] for n, end in zip(sizes, ends)]  # noqa: E731
sliced = vmap(grad(lambda *args: flat_loss(*args, cut=slices)), in_dims=(None, 0, 0))
chunked = vmap(grad(flat_loss), in_dims=(None, 0, 0), chunk_size=4)
routes = {
    "loop": lambda: into_buffer(1),
    "vmap chunked": lambda: into_buffer(4),
    "vmap": joined_with_cat,
    "vmap, chunk_size=4": lambda: chunked(flat_params, inputs, labels),
    "flat vector": lambda: per_sample_flat(flat_params, inputs, labels),
    "flat vector, sliced": lambda: sliced(flat_params, inputs, labels),
}
reference_columns = {name: g.flatten(start_dim=1) for name, g in all_reference.items()}
peaks = {}
for route, fn in routes.items():
    peak, result = peak_bytes(fn)
    columns = dict(zip(names, result.split(sizes, dim=1)))
    check(f"route {route}", columns, reference_columns, 3e-6)
    peaks[route] = peak / (B * P * 4)
    print(f"{route}: peak {peaks[route]:.2f} x the (B, P) result ({B * P * 4:,} bytes)")
assert 2 <= peaks["vmap"] < 2.1 and 2 <= peaks["vmap, chunk_size=4"] < 2.1
assert 2 <= peaks["flat vector"] < 2.2 and 4 <= peaks["flat vector, sliced"] < 4.2
assert peaks["vmap chunked"] < 1 + 2 * 4 / B + 0.05 and peaks["loop"] < 1.1

# %%
# Why the flat vector saves nothing: the backward of ``split`` is one ``cat``, the join done for
# you; each slice's backward pads its piece with zeros to all P columns, and the copies are added
# up. The operators returning at least B·P/2 floats, by the dispatch mode; then the figure.
large = {}
for route in ["vmap", "vmap, chunk_size=4", "flat vector", "flat vector, sliced"]:
    with OpCalls() as seen:
        routes[route]()
    large[route] = collections.Counter(op for op, n in seen.calls if n >= B * P // 2)
    print(f"{route}: {dict(large[route])}")
assert large["flat vector"] == large["vmap"] and large["vmap"]["aten::cat"] == 1
assert large["flat vector, sliced"]["aten::slice_backward"] == len(names)
assert large["vmap, chunk_size=4"] == {"aten::cat": 1}  # the chunks joined
METHOD_COLORS = {"loop": "#D55E00", "vmap chunked": "#44AA99",
                 "vmap": "#009E73", "flat vector": "#88CCEE"}  # fmt: skip
fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
bars = ax.barh(list(peaks), list(peaks.values()),
               color=[METHOD_COLORS[route.split(",")[0]] for route in peaks])  # fmt: skip
bars[-1].set_hatch("//")
ax.axvline(1, color="black", linestyle="--", linewidth=1)
ax.invert_yaxis()
ax.set(xlabel="peak memory / size of the result (dashed)",
       title=f"Per-sample gradients as one ({B}, {P:,}) matrix")  # fmt: skip
plt.show()

# %%
# What to remember
# ----------------
# * ``grad`` differentiates only the dict passed first; give
#   ``functional_call(model, (trained, frozen, buffers), x)`` a tuple, the frozen dict optional.
#   Frozen layers skip their weights' gradients, yet pass the gradient back after a trained one.
# * ``argnums=(0, 1)`` gives parameter and input gradients from one call, ``has_aux`` and
#   ``grad_and_value`` the loss and logits too; ``jvp`` of ``grad`` the mixed derivative times a
#   direction without the P × inputs block; ``grad`` of ``grad`` trains on an input gradient.
# * After a forward: ``is_grads_batched`` does B times a backward's matrix-product work, some
#   ops once per row; for ``Linear`` layers, hooks and one ordinary backward suffice. BatchNorm
#   in training mode couples the rows, and ``vmap(grad)`` refuses it: eval mode or GroupNorm.
# * A flat parameter vector returns (B, P) directly but peaks as high as ``torch.cat``, as does
#   ``chunk_size`` here (slices: twice that); fill a buffer made first, a chunk at a time.
