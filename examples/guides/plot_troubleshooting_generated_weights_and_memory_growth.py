"""
Troubleshooting, part 20: weights made per sample, functionalize's inputs, memory that grows
============================================================================================

Four questions, re-run on torch 2.13: a hypernetwork whose batch of generated weights the target
network would not take (chrhenning/hypnettorch#4); a model evaluated at many interpolated weights
at once (pytorch/functorch#1094); ``functionalize(f)(x)`` that seemed to give another answer than
``f(x)`` (pytorch#110337); and a loop of Hessians whose process kept growing (grimme-lab/dxtb#231).
Each: what happens, why, and the fix checked against a loop, a closed form or ordinary autograd.
Part 1: :doc:`plot_troubleshooting`.
"""

import copy
import ctypes
import gc
import os
import sys
import textwrap

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, functionalize, hessian, vmap
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
in64 = {"dtype": torch.float64, "device": device}
cpu64 = {"dtype": torch.float64}  # the memory section measures glibc's heap: the CPU
METHOD_COLORS = {"hessian": "#56B4E9"}


def within(label, got, want, bound):
    """Asserts the largest gap over the largest entry of want is at most bound; prints it."""
    assert got.shape == want.shape, f"{label}: {got.shape} against {want.shape}"
    relative = ((got - want).abs().max() / want.abs().max()).item()
    print(f"  {label}: gap {relative:.1e} (bound {bound:.0e})")
    assert relative <= bound, f"{label}: {relative:.1e} is over {bound:.0e}"


# %%
# Error(s) in loading state_dict ... vmap: inplace arithmetic: weights made per sample
# ------------------------------------------------------------------------------------
# In chrhenning/hypnettorch#4 a hypernetwork produced one set of weights per sample, and the target
# network, which takes one set per call, would not take the batch (its check of the weights' count
# failed); the answer given was a loop. Under ``vmap`` each sample's weights are one set: a target
# that takes its weights as an argument, as that library's does, runs as it is; an ordinary
# ``nn.Module`` runs through ``functional_call`` with that sample's weights as a dict. No module is
# changed, and the gradient flows back into the hypernetwork. Loading them into the module instead
# (``load_state_dict``) copies a batched tensor into an unbatched parameter in place, which
# ``vmap`` refuses, with this message. The reference: the target written out by hand, one sample at
# a time, and ordinary autograd for the hypernetwork's gradient.
target = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(**in64)
shapes = {name: p.shape for name, p in target.named_parameters()}
sizes = [shape.numel() for shape in shapes.values()]
hypernet = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, sum(sizes)))
hypernet = hypernet.to(**in64)


def as_weights(flat):  # one flat vector -> the target's parameters, by name
    pieces = zip(shapes.items(), flat.split(sizes))
    return {name: piece.view(shape) for (name, shape), piece in pieces}


def with_weights(flat, inputs):  # the target with one sample's generated weights
    return functional_call(target, as_weights(flat), (inputs,))


def written_out(task, inputs):  # the reference: the same network, by hand
    w = as_weights(hypernet(task))
    hidden = torch.tanh(inputs @ w["0.weight"].T + w["0.bias"])
    return hidden @ w["2.weight"].T + w["2.bias"]


tasks, inputs = torch.randn(5, 2, **in64), torch.randn(5, 4, 3, **in64)
outputs = vmap(with_weights)(hypernet(tasks), inputs)  # (5 samples, 4 rows, 1)
by_hand = torch.stack([written_out(t, x) for t, x in zip(tasks, inputs)])
within("vmap(functional_call), against a loop", outputs, by_hand, 2e-15)
got = torch.autograd.grad(outputs.square().mean(), list(hypernet.parameters()))
want = torch.autograd.grad(by_hand.square().mean(), list(hypernet.parameters()))
for (name, _), g, w in zip(hypernet.named_parameters(), got, want):
    within(f"hypernetwork's {name} gradient", g, w, 2e-15)


def loading(task, inputs):  # the refused way
    target.load_state_dict(as_weights(hypernet(task)))
    return target(inputs)


try:
    vmap(loading)(tasks, inputs)
    raise AssertionError("load_state_dict under vmap raised nothing")
except RuntimeError as loading_refused:
    said = str(loading_refused)
    print(f"  RuntimeError: {textwrap.shorten(said, 70)}")
    print(f"  ... {textwrap.shorten(said[said.index('vmap:') :], 110)}")
    assert said.startswith("Error(s) in loading state_dict"), said
    assert "inplace arithmetic" in said, said

# %%
# Assigning each sample's weights as a new ``nn.Parameter`` inside the function raises nothing,
# and is wrong twice: a new ``Parameter`` is a leaf, cut from the hypernetwork (here the result
# is not connected to any graph at all), and the module keeps it: a batched tensor from inside
# ``vmap``, which breaks the module's next call. (A ``vmap`` that seems to work after assigning
# a new ``nn.Parameter`` in the function, as in pytorch/functorch#1094 below, is this case.)
# Done on a copy of the target here.
assigned = copy.deepcopy(target)


def assigning(task, inputs):
    for name, value in as_weights(hypernet(task)).items():
        layer, attribute = name.split(".")
        setattr(assigned[int(layer)], attribute, nn.Parameter(value))
    return assigned(inputs)


silent = vmap(assigning)(tasks, inputs)
within("assigned Parameters: the outputs", silent.detach(), by_hand.detach(), 2e-15)
assert not silent.requires_grad, "the result is connected to a graph"
print(f"  assigned Parameters: the result requires grad: {silent.requires_grad}")
try:
    assigned(inputs[0])
    raise AssertionError("the module's next call raised nothing")
except RuntimeError as next_call_refused:
    print(f"  its next call: {textwrap.shorten(str(next_call_refused), 100)}")
    assert "escaped from inside a function being vmapped" in str(next_call_refused)

# %%
# (No error) one model at many interpolated weights, at once
# -----------------------------------------------------------
# In pytorch/functorch#1094 a user evaluated a network at weights θ₀ + α·d for many α, one α at a
# time, and could not ``vmap`` it past one layer. The same recipe: build each α's weights inside the
# function and call ``functional_call``, with θ₀, d and the images left unbatched; the module's own
# buffers are used. Here the model belongs in evaluation mode: in training mode its BatchNorm would
# update its running statistics in place, and ``vmap`` raises part 1's "Batch norm got a batched
# tensor" error (asserted below; part 19 shows the other way out). ``chunk_size`` runs the α's a few
# at a time, to bound memory, with the same result. The reference: a copy of the model per α, loaded
# with ``load_state_dict`` outside ``vmap``.
model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(4 * 6 * 6, 3)).to(**in64)  # fmt: skip
model(torch.randn(16, 1, 8, 8, **in64))  # training mode: running statistics
start = {name: p.detach() for name, p in model.named_parameters()}
direction = {name: torch.randn_like(p) for name, p in start.items()}
images, alphas = torch.randn(10, 1, 8, 8, **in64), torch.linspace(0, 1, 7, **in64)


def at(alpha):
    weights = {name: start[name] + alpha * direction[name] for name in start}
    return functional_call(model, weights, (images,))


try:
    vmap(at)(alphas)
    raise AssertionError("vmap of a model in training mode raised nothing")
except RuntimeError as training_refused:
    print(f"  in training mode: {textwrap.shorten(str(training_refused), 80)}")
    assert str(training_refused).startswith("Batch norm got a batched tensor"), (
        training_refused
    )
model.eval()
along = vmap(at)(alphas)  # (7 alphas, 10 images, 3)
looped = []
for alpha in alphas:
    copied = copy.deepcopy(model)
    interpolated = {name: start[name] + alpha * direction[name] for name in start}
    copied.load_state_dict(interpolated, strict=False)  # the buffers: the model's own
    looped.append(copied(images).detach())
within("vmap over alpha, against a loop of loaded copies", along, torch.stack(looped),
         2e-15)  # fmt: skip
within("the same, chunk_size=2", vmap(at, chunk_size=2)(alphas), along, 1e-15)

# %%
# How much faster than the loop: the hypernetwork recipe, timed
# --------------------------------------------------------------
# Both users asked for something faster than a loop; the hypernetwork's case is timed here. One
# training step for 64 samples (the outputs, and the gradient into the hypernetwork), in float64
# as above, the hypernetwork run once on the batch: ``vmap`` of the target against a Python loop
# over the samples, each checked against the other first, then timed with
# ``torch.utils.benchmark`` after a warm-up, on all threads.
many_tasks, many_inputs = torch.randn(64, 2, **in64), torch.randn(64, 4, 3, **in64)


def step_by_vmap():
    loss = vmap(with_weights)(hypernet(many_tasks), many_inputs).square().mean()
    return torch.autograd.grad(loss, list(hypernet.parameters()))


def step_by_loop():
    samples = zip(hypernet(many_tasks), many_inputs)
    loss = torch.stack([with_weights(flat, x) for flat, x in samples]).square().mean()
    return torch.autograd.grad(loss, list(hypernet.parameters()))


pairs = zip(hypernet.named_parameters(), step_by_vmap(), step_by_loop())
for (name, _), by_vmap, by_loop in pairs:
    within(f"64 samples, {name} gradient, vmap vs loop", by_vmap, by_loop, 2e-15)
step_times = {}
for name, step in {"vmap": step_by_vmap, "loop": step_by_loop}.items():
    step()  # warm-up
    timer = Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    took = step_times[name] = timer.blocked_autorange(min_run_time=0.3)
    print(f"  {name}: median {took.median * 1e3:.2f} ms, IQR {took.iqr * 1e3:.2f} ms, "
          f"{len(took.times)} blocks")  # fmt: skip
ratio = step_times["loop"].median / step_times["vmap"].median
print(f"  the loop takes {ratio:.1f}x the time of vmap")

# %%
# (No error) functionalize(f)(x) gives another answer than f(x): the first call changed x
# ----------------------------------------------------------------------------------------
# In pytorch#110337, ``f(x)`` with ``f`` adding 1 to ``x`` and doubling it in place gave 8 for
# ``x = 3``, and ``functionalize(f)(x)`` right after it gave 18. ``functionalize`` rewrites the
# in-place operations *inside* ``f`` as out-of-place ones, but keeps what ``f`` does to its
# inputs: at the end it copies the new value back into ``x``, as ``f`` would. The first call had
# already made ``x`` 8, and (8 + 1) · 2 = 18: the traced graph shows ``add``, ``mul``, then one
# ``copy_`` into the input. The fix, to compare the two: give each its own copy of the input.
# The reference: (3 + 1) · 2 = 8, by hand.


def add_then_double(x):
    x.add_(1)
    x.mul_(2)
    return x


x = torch.tensor([3.0], device=device)
first, second = add_then_double(x).item(), functionalize(add_then_double)(x).item()
print(f"  f(x) = {first:g}, then functionalize(f)(x) = {second:g}; "
      f"x is now {x.item():g}")  # fmt: skip
assert (first, second, x.item()) == (8.0, 18.0, 18.0)
x = torch.tensor([3.0], device=device)
plain = add_then_double(x.clone())
functional = functionalize(add_then_double)(x.clone())
assert plain.item() == functional.item() == (3 + 1) * 2 and x.item() == 3.0
print(f"  on copies: f gives {plain.item():g}, functionalize(f) {functional.item():g}")
traced = make_fx(functionalize(add_then_double))(torch.tensor([3.0], device=device))
called = [str(node.target) for node in traced.graph.nodes if node.op == "call_function"]
print(f"  functionalize's graph: {called}")
assert called == ["aten.add.Tensor", "aten.mul.Tensor", "aten.copy_.default"], called


# %%
# (No error) memory grows from one Hessian to the next: a leak, or memory kept for reuse?
# ---------------------------------------------------------------------------------------
# In grimme-lab/dxtb#231 a loop computed a molecule's Hessian with respect to its atoms' positions
# for larger and larger systems, on a CPU, and the process's memory kept rising. (With
# ``use_functorch=True`` the library calls ``torch.func.jacrev`` of its forces, as read in its
# source: all 3N rows at once, each with its own intermediates, a peak that part 18 measures and
# lowers with ``chunk_size``: :doc:`plot_troubleshooting_hessian_memory_and_block_masks`.) Two
# causes look the same from outside. A leak: something still refers to tensors, so the memory *in
# use* grows with every call. Or reuse: the C library's ``malloc`` keeps freed blocks to hand out
# again, so the memory the process *holds* (its resident size, what ``top`` shows) can stay high
# while the memory in use falls back. The recipe: after each call (and ``gc.collect()``), read the
# memory in use; if it comes back to the same value, no tensor leaks. With glibc's own ``malloc``
# (not a preloaded jemalloc or tcmalloc), ``mallinfo2`` gives it (blocks handed out and not freed,
# and the free bytes malloc keeps, whether resident or handed back by page); on a GPU,
# ``torch.cuda.memory_allocated`` (in use) and ``memory_reserved`` (all that PyTorch's caching
# allocator holds, in use or not) tell the same apart. Python's own small objects (dicts, floats
# kept in a list) are not taken from ``malloc``: for those, ``tracemalloc``. Here the energy is a
# Lennard-Jones cluster's, 4(r⁻¹² − r⁻⁶) per pair, whose Hessian has a closed form: per pair,
# φ''(r) along the line between the atoms, φ'(r)/r across.
def energy(positions):  # (N, 3) -> the cluster's energy, in reduced units
    gaps = positions[:, None] - positions[None]
    apart = 1 - torch.eye(len(positions), **cpu64)  # 0 for an atom with itself
    inv_r6 = ((gaps**2).sum(-1) + (1 - apart)).pow(-3)  # r² + 1 on the diagonal, not 0
    return 2 * (apart * (inv_r6**2 - inv_r6)).sum()  # each pair counted twice, halved


def cluster(side):  # side³ atoms near a cubic grid's points
    axis = torch.arange(side, **cpu64)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1)
    return 1.12 * grid.reshape(-1, 3) + 0.02 * torch.randn(side**3, 3, **cpu64)


def closed_form_hessian(positions):  # (3N, 3N), from the pair potential's derivatives
    atoms = len(positions)
    gaps = positions[:, None] - positions[None]
    r = gaps.norm(dim=-1) + torch.eye(atoms, **cpu64)
    slope, curvature = 4 * (-12 * r**-13 + 6 * r**-7), 4 * (156 * r**-14 - 42 * r**-8)
    along = (gaps / r[..., None])[..., :, None] * (gaps / r[..., None])[..., None, :]
    across = torch.eye(3, **cpu64) - along
    pair = -(curvature[..., None, None] * along + (slope / r)[..., None, None] * across)
    pair = pair * (1 - torch.eye(atoms, **cpu64))[..., None, None]  # (N, N, 3, 3)
    each = torch.arange(atoms)
    pair[each, each] = -pair.sum(1)  # an atom's own block: minus its pairs' blocks
    return pair.transpose(1, 2).reshape(3 * atoms, 3 * atoms)


positions = cluster(3)
by_hessian = hessian(energy)(positions).reshape(81, 81)
within("torch.func.hessian, 27 atoms, against the closed form", by_hessian,
         closed_form_hessian(positions), 1e-14)  # fmt: skip

# %%
# The memory in use, the free memory malloc keeps, and the memory held, after each call. The
# tool is first checked on known cases: a 64 MiB tensor (mapped apart; held once written),
# and 4096 blocks of 2000 B from ``malloc``, from the heap (too large for its per-thread cache),
# each 2000 B and its 8 B header rounded up to 16 B. Then Hessians of 27, 64 and 125 atoms, and
# four more of 125 atoms. Kept free counts pages handed back too, so in a long-lived process it
# can exceed what is held; ``malloc_trim(0)`` at the end shows how much held memory was free.
c_library = ctypes.CDLL(None) if sys.platform == "linux" else None
glibc = hasattr(c_library, "mallinfo2")  # glibc 2.33 or later
print(f"glibc 2.33's mallinfo2: {'found' if glibc else 'missing: not measured here'}")


class Mallinfo2(ctypes.Structure):  # glibc's struct mallinfo2, field by field
    _fields_ = [(field, ctypes.c_size_t) for field in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def memory_mib():
    """(in use, free but kept by malloc, held by the process), in MiB, after gc.collect()."""
    gc.collect()
    info = c_library.mallinfo2()
    with open("/proc/self/statm") as pages:  # the second field: resident pages
        resident = int(pages.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    in_use = info.uordblks + info.hblkhd  # heap blocks and mapped blocks handed out
    return in_use / 2**20, info.fordblks / 2**20, resident / 2**20


def changes(after, before):  # the three, after against before
    return "in use {:+.2f}, kept free {:+.2f}, held {:+.2f} MiB".format(
        *[a - b for a, b in zip(after, before)])  # fmt: skip


if glibc:
    c_library.mallinfo2.restype = Mallinfo2
    c_library.malloc.restype = ctypes.c_void_p
    before = memory_mib()
    known = torch.empty(8 * 2**20, **cpu64)  # 64 MiB, a mapped block, not yet written
    unwritten = memory_mib()
    known.fill_(1.0)  # now its pages are resident
    during = memory_mib()
    del known
    print(f"  a 64 MiB tensor: {changes(unwritten, before)}; written: "
          f"{changes(during, before)}; freed: {changes(memory_mib(), before)}")  # fmt: skip
    assert abs(during[0] - before[0] - 64) < 0.01, "a 64 MiB tensor, not counted in use"
    assert abs(unwritten[2] - before[2]) < 4, "unwritten pages counted as held"
    assert abs(during[2] - before[2] - 64) < 4, "a 64 MiB tensor, not counted as held"
    blocks = (ctypes.c_void_p * 4096)()  # their addresses, made before the count starts
    before = memory_mib()
    for i in range(4096):
        blocks[i] = c_library.malloc(2000)
    during = memory_mib()
    for block in blocks:
        c_library.free(ctypes.c_void_p(block))
    chunk = (2000 + 8 + 15) // 16 * 16
    expected = 4096 * chunk / 2**20
    print(f"  4096 mallocs of 2000 B, {chunk} B each ({expected:.2f} MiB): "
          f"{changes(during, before)}; freed: {changes(memory_mib(), before)}")  # fmt: skip
    gap = round((during[0] - before[0]) * 2**20 - 4096 * chunk)
    print(f"  the count, less 4096 blocks of {chunk} B: {gap} B")
    assert abs(gap) < 1024, "mallinfo2 missed blocks, or counted others"
    sides = (3, 4, 5, 5, 5, 5, 5)
    clean = []
    for side in sides:
        hessian(energy)(cluster(side))  # computed, and let go
        clean.append(memory_mib())
    in_use, _, held = zip(*clean)  # the middle one, kept free, is printed below
    print("  after each Hessian (MiB): in use, free but kept by malloc, held")
    for side, (used, free, resident) in zip(sides, clean):
        print(f"  {side**3:4} atoms: {used:6.1f} {free:6.1f} {resident:6.1f}")
    assert max(in_use) - min(in_use) < 8 / 1024, "memory in use grew: a leak"
    c_library.malloc_trim(0)  # glibc: hand free pages back to the system now
    trimmed = memory_mib()
    print(f"  after malloc_trim(0): {trimmed[0]:.1f} {trimmed[1]:.1f} {trimmed[2]:.1f}")
    assert abs(trimmed[0] - in_use[-1]) < 0.1 and trimmed[2] <= held[-1]

# %%
# A real leak, for comparison: a loop that keeps each step's energy *with its graph*, as a
# list of losses kept for logging does. Each kept value holds every tensor its backward pass
# needs, so the memory in use grows by that much per call. The reference: the bytes the
# autograd graph saved, counted apart with ``torch.autograd.graph.saved_tensors_hooks``. The fix:
# keep ``energy.detach()`` (or ``.item()``), and the memory in use stays flat again.
saved = {}  # storage address -> bytes, each storage once


def count_saved(tensor):
    storage = tensor.untyped_storage()
    saved[storage.data_ptr()] = storage.nbytes()
    return tensor


with torch.autograd.graph.saved_tensors_hooks(count_saved, lambda tensor: tensor):
    energy(cluster(4).requires_grad_(True))
graph_mib = sum(saved.values()) / 2**20
print(f"  one energy's graph saves {len(saved)} tensors, {graph_mib:.3f} MiB")
if glibc:

    def hessians_keeping(keep, calls=6):  # memory in use after each call
        kept, in_use = [], []
        for _ in range(calls):
            positions = cluster(4).requires_grad_(True)
            kept.append(keep(energy(positions)))
            hessian(energy)(positions.detach())  # computed, and let go
            in_use.append(memory_mib()[0])
        return in_use

    leaky = hessians_keeping(lambda value: value)  # the leak: each graph stays alive
    fixed = hessians_keeping(lambda value: value.detach())  # the fix
    per_call = (leaky[-1] - leaky[0]) / (len(leaky) - 1)
    print(f"  keeping the graph: in use grows {per_call:.3f} MiB per call")
    within("growth per call, against the saved tensors", torch.tensor(per_call),
             torch.tensor(graph_mib), 0.1)  # fmt: skip
    detached = (fixed[-1] - fixed[0]) / (len(fixed) - 1)
    print(f"  keeping energy.detach(): in use grows {detached * 1024:.1f} KiB per call")
    assert detached < 0.05 * graph_mib, "the detached values grow like a graph"

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    calls = range(1, len(sides) + 1)
    colour = METHOD_COLORS["hessian"]
    left.plot(calls, held, "o--", color=colour, label="held (resident)")
    left.plot(calls, in_use, "o-", color=colour, label="in use")
    left.set_xticks(list(calls), [f"{side**3}" for side in sides])
    left.set(xlabel="atoms, one Hessian per call", ylabel="MiB after the call", ylim=(0, None),
             title="torch.func.hessian in a loop: no tensor leak")  # fmt: skip
    left.legend(fontsize=8, loc="center right")
    steps = range(1, len(leaky) + 1)
    right.plot(steps, [m - leaky[0] for m in leaky], "o-", color="black",
               label="energy kept")  # fmt: skip
    right.plot(steps, [m - fixed[0] for m in fixed], "s-", color="0.5",
               label="energy.detach() kept")  # fmt: skip
    right.plot(steps, [graph_mib * (s - 1) for s in steps], ":", color="black",
               label="saved tensors, counted")  # fmt: skip
    right.set(xlabel="call", ylabel="MiB in use, beyond the first call",
              title="A kept graph: a leak")  # fmt: skip
    right.legend(fontsize=8)
    plt.show()

# %%
# What to remember
# ----------------
# - Weights made per sample (by a hypernetwork, or θ₀ + α·d): build them inside the function and
#   call ``functional_call`` under ``vmap`` (a BatchNorm model in evaluation mode); gradients
#   reach whatever made them. ``load_state_dict`` or a new ``nn.Parameter`` inside fails, or
#   cuts the graph and leaves an escaped tensor in the module.
# - ``functionalize`` keeps a function's writes to its inputs: compare it with the original on
#   separate copies of the inputs.
# - Memory that grows from call to call: read the memory in use (``mallinfo2`` on glibc,
#   ``torch.cuda.memory_allocated`` on a GPU), not the process's size. Flat in use: no tensor leaks,
#   though the process can still hold freed memory for reuse (``malloc_trim(0)`` hands some
#   back). Growth in use is a leak, often a kept tensor
#   with its graph: keep ``.detach()`` or ``.item()``. Python objects: ``tracemalloc``.
