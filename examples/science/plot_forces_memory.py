"""
Forces for large systems: the memory of one gradient, and how to bound it
=========================================================================

The forces on thousands of atoms are one gradient, ``-∇E``, and a gradient keeps what its
backward pass will read until that pass reads it: for a pair potential, entries for every pair
of atoms; for a message-passing network, every edge's features in every interaction block.
That, not the forces themselves (three numbers per atom), is what runs out of memory on large
systems (schnetpack#304). Here you compute the forces of a Lennard-Jones crystal in chunks of
atoms, checked against the closed form in float64; measure, with a memory tool checked on a
known case, what each route holds at its peak; and reduce a message-passing network's peak by
checkpointing its interaction blocks, checked against float64.
"""

# %%
# Setup
# -----
# Positions in float32, as force fields often run on GPUs; the references in float64.
import gc
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import grad, jvp
from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Timer
from torch.utils.checkpoint import checkpoint

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"func.grad": "#228833", "autograd.grad": "#EE6677",
                 "atom chunks": "#6A3D9A", "checkpointed": "#8C564B"}  # fmt: skip


def crystal(side, spacing=1.12, jitter=0.05):
    """side³ atoms on a cubic lattice near the pair potential's minimum, shaken; float64."""
    axis = torch.arange(side, dtype=torch.float64, device=device) * spacing
    sites = torch.cartesian_prod(axis, axis, axis)
    return sites + jitter * torch.randn_like(sites)


# %%
# The energy of some atoms against all
# ------------------------------------
# Lennard-Jones, ``V(r) = 4ε(r⁻¹² − r⁻⁶)`` in reduced units, over every pair (no cutoff). The
# total energy is half the sum over ordered pairs, so it splits by the first atom of each pair:
# ``E = Σ_chunks E(chunk)``, where ``E(chunk)`` sums the chunk's atoms against all atoms. Each
# ``E(chunk)`` depends on every position, and so does its gradient.
def energy_of(positions, rows, depth=1.0):
    """Half the pair energy of the atoms `rows` against every atom (itself excluded)."""
    gaps = positions[rows, None, :] - positions[None, :, :]  # (chunk, atoms, 3)
    squared = gaps.square().sum(dim=-1)
    itself = rows[:, None] == torch.arange(len(positions), device=positions.device)
    inverse_sixth = squared.masked_fill(itself, float("inf")).reciprocal() ** 3
    return 2 * depth * (inverse_sixth.square() - inverse_sixth).sum()


# %%
# The recipe: forces as a sum of chunk gradients
# ----------------------------------------------
# The gradient of each chunk's energy in all positions, summed, is the whole gradient; each
# chunk's forward and backward are done, and freed, before the next begins. With
# :func:`torch.func.grad`, and with :func:`torch.autograd.grad`, which the memory section
# below prefers. The chunk sizes leave a shorter last chunk, which a loop must not drop.
def chunked_forces(positions, chunk):  # torch.func
    rows_of = torch.arange(len(positions), device=positions.device).split(chunk)
    return -sum(grad(energy_of)(positions, rows) for rows in rows_of)


def autograd_forces(positions, chunk, depth=1.0):  # torch.autograd: no graph kept
    leaf = positions.detach().requires_grad_()
    rows_of = torch.arange(len(leaf), device=leaf.device).split(chunk)
    grads = (torch.autograd.grad(energy_of(leaf, r, depth), leaf)[0] for r in rows_of)
    return -sum(grads)  # a generator: one chunk's gradient at a time


def closed_form_forces(positions, rows_at_once=128):
    """F_i = Σ_j 24 (2 r⁻¹² − r⁻⁶) / r² (x_i − x_j), in float64, with no autograd."""
    positions = positions.double()
    forces = torch.zeros_like(positions)
    for rows in torch.arange(len(positions), device=device).split(rows_at_once):
        gaps = positions[rows, None, :] - positions[None, :, :]
        squared = gaps.square().sum(dim=-1)
        squared[torch.arange(len(rows)), rows] = float("inf")  # no force on itself
        inverse_sixth = squared.reciprocal() ** 3
        scale = 24 * (2 * inverse_sixth.square() - inverse_sixth) / squared
        forces[rows] = (scale[..., None] * gaps).sum(dim=1)
    return forces


exact = crystal(10)
positions, reference, num_atoms = exact.float(), closed_form_forces(exact), len(exact)
everything = torch.arange(num_atoms, device=device)
print(f"{num_atoms} atoms, {reference.numel()} force components")


def check(label, forces, bound=3e-5):
    gap = ((forces.double() - reference).abs().max() / reference.abs().max()).item()
    assert forces.shape == reference.shape and gap <= bound, f"{label}: {gap:.1e}"
    print(f"  {label}: off by {gap:.1e} of the largest force (bound {bound:.0e})")


for chunk in (num_atoms, 300, 128, 30):
    check(f"func.grad, chunks of {chunk:4d}", chunked_forces(positions, chunk))
    check(f"autograd.grad, chunks of {chunk:4d}", autograd_forces(positions, chunk))


# %%
# Measuring a call's peak memory
# ------------------------------
# ``peak_mib`` runs a call and reports the most memory it held at once beyond what was held
# before: on a GPU from the caching allocator's count of requested bytes (an out-of-memory error
# counts the larger *reserved* memory); on a CPU from the ``[memory]`` events of torch's
# profiler (``profile_memory=True``), a running count of the bytes allocated and freed while it
# records, from which the count it starts with (blocks recorded before and freed since) is
# taken off. Checked on a case with a known answer, after such a block:
# ``torch.ones(n).exp().exp()`` allocates three tensors of ``n`` floats but holds two at most.
def peak_mib(call):
    gc.collect()
    if torch.cuda.is_available():  # the page's device is the GPU
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_stats()["requested_bytes.all.current"]
        torch.cuda.memory.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return (torch.cuda.memory_stats()["requested_bytes.all.peak"] - held) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recording:
        call()
    with tempfile.TemporaryDirectory() as trace_folder:
        recording.export_chrome_trace(f"{trace_folder}/trace.json")
        events = json.loads(Path(trace_folder, "trace.json").read_text())["traceEvents"]
    totals = [e["args"] for e in events if e["name"] == "[memory]"]
    before = (
        totals[0]["Total Allocated"] - totals[0]["Bytes"]
    )  # held when recording began
    return (max(t["Total Allocated"] for t in totals) - before) / 2**20


leftover = []  # a block that outlives its recording, freed before the next one
peak_mib(lambda: leftover.append(torch.ones(2**18, device=device)))
leftover.clear()
known = peak_mib(lambda: torch.ones(2**18, device=device).exp().exp())
print(f"ones(2**18).exp().exp(): {known:.3f} MiB at the peak (two tensors of 1 MiB)")
assert abs(known - 2.0) < 1e-9

# %%
# What one gradient holds: every pair
# -----------------------------------
# The whole gradient's peak grows with the square of the number of atoms: the backward pass
# reads tensors with one entry per pair (the gaps, the self mask, powers of the distances). A
# chunk's gradient holds the pairs of ``chunk × atoms``. :func:`torch.func.grad` holds more than
# :func:`torch.autograd.grad`: it runs its backward pass with ``create_graph=True``
# (``torch/_functorch/eager_transforms.py``), so that its result can be differentiated again,
# and that graph of the backward is memory. For forces alone, ``autograd.grad`` is the lighter
# call. Below, each call's peak, and the bytes per pair it covered at once.
peaks = {}
ROUTES = {"func.grad": chunked_forces, "autograd.grad": autograd_forces}
for side in (10, 14):  # 1000 and 2744 atoms
    atoms = crystal(side).float()
    for name, route in ROUTES.items():
        per_pair = {}
        for chunk in (len(atoms), 128, 30):  # the whole gradient, then chunks
            peak = peak_mib(lambda r=route, a=atoms, c=chunk: r(a, c))
            peaks[name, len(atoms), chunk] = peak
            per_pair[chunk] = peak * 2**20 / (chunk * len(atoms))
            print(f"{name:13s} {len(atoms):5d} atoms, {chunk:5d} at once: {peak:7.1f} MiB, "
                  f"{per_pair[chunk]:5.1f} bytes per pair")  # fmt: skip
        assert peaks[name, len(atoms), 128] < peaks[name, len(atoms), len(atoms)] / 4
        assert per_pair[30] < 1.1 * per_pair[len(atoms)], per_pair  # one chunk at once
    func_peak, autograd_peak = (peaks[n, len(atoms), len(atoms)] for n in ROUTES)
    assert func_peak > 1.2 * autograd_peak  # func.grad's graph of its backward
print(f"forces themselves, 2744 atoms: {2744 * 3 * 4 / 2**20:.3f} MiB")


# %%
# Checkpointing: one backward pass, each chunk recomputed
# -------------------------------------------------------
# Where one energy and one backward call are wanted (a simulation code that asks a model for
# ``E`` and then for ``dE/dR``), ``torch.utils.checkpoint.checkpoint`` around each chunk keeps
# only the chunk's inputs during the forward pass and runs its forward again inside the
# backward pass, one chunk at a time. It works with ``autograd.grad``; under ``torch.func.grad``
# it raises (asserted).
def checkpointed_forces(positions, chunk):
    leaf = positions.detach().requires_grad_()
    rows_of = torch.arange(len(leaf), device=leaf.device).split(chunk)
    parts = [checkpoint(energy_of, leaf, rows, use_reentrant=False) for rows in rows_of]
    return -torch.autograd.grad(sum(parts), leaf)[0]


check("checkpointed chunks of 128", checkpointed_forces(positions, 128))
peaks["checkpointed"] = peak_mib(lambda: checkpointed_forces(positions, 128))
print(f"checkpointed, {num_atoms} atoms, 128 at once: {peaks['checkpointed']:.1f} MiB")
assert peaks["checkpointed"] < peaks["autograd.grad", num_atoms, num_atoms] / 4
try:
    grad(lambda p: checkpoint(energy_of, p, everything, use_reentrant=False))(positions)
    raise AssertionError("torch.func.grad ran through checkpoint")
except RuntimeError as checkpoint_refusal:
    assert "don't yet support saved tensor hooks" in str(checkpoint_refusal)
    print(f"  under torch.func.grad: {str(checkpoint_refusal)[:78]}")

# %%
# Training on forces: two passes keep the chunks bounded
# ------------------------------------------------------
# A force loss differentiates the forces again. Summing chunk forces made with
# ``autograd.grad(..., create_graph=True)`` keeps every chunk's graph until the loss's backward
# reads them all. Two passes keep one chunk at a time: first the forces, with no graph, and the
# loss's gradient in them, ``g = ∂L/∂F``; then, chunk by chunk, the chunk's forces again with a
# graph and the backward of ``g · F(chunk)``, which adds the chunk's share of ``∂L/∂θ``. Here
# the parameter ``θ`` is ``ε``, at 1.5, and the loss the squared forces; the forces are ``ε F₁``
# (``F₁`` the closed form's, at ``ε = 1``), so ``∂L/∂ε = 2 ε Σ F₁²``.
depth = torch.tensor(1.5, device=device, requires_grad=True)


def chunk_forces_with_graph(leaf, rows):
    energy = energy_of(leaf, rows, depth)
    return -torch.autograd.grad(energy, leaf, create_graph=True)[0]


def one_pass_step(chunk):  # every chunk's graph alive at once
    leaf = positions.detach().requires_grad_()
    rows_of = torch.arange(num_atoms, device=device).split(chunk)
    forces = sum(chunk_forces_with_graph(leaf, rows) for rows in rows_of)
    return torch.autograd.grad(forces.square().sum(), depth)[0]


def two_pass_step(chunk):  # one chunk's graph at a time
    leaf = positions.detach().requires_grad_()
    rows_of = torch.arange(num_atoms, device=device).split(chunk)
    forces = autograd_forces(positions, chunk, depth.detach())  # first pass: no graph
    slope = torch.zeros((), device=device)
    for rows in rows_of:
        share = (2 * forces * chunk_forces_with_graph(leaf, rows)).sum()  # g = 2F
        slope = slope + torch.autograd.grad(share, depth)[0]
    return slope


closed = 2 * 1.5 * reference.square().sum().item()
training = {}
for name, step in (("one pass", one_pass_step), ("two passes", two_pass_step)):
    training[name] = peak_mib(lambda s=step: s(128))
    off = abs(step(128).item() / closed - 1)
    print(f"a force-loss step, chunks of 128, {name:10s}: {training[name]:5.1f} MiB, "
          f"∂L/∂ε off by {off:.1e} from the closed form")  # fmt: skip
    assert off < 1e-5
assert training["two passes"] < training["one pass"] / 2


# %%
# A message-passing network with a cutoff
# ---------------------------------------
# Networks such as SchNet sum over neighbours within a cutoff, so memory grows with the edges,
# about linearly with the atoms, and with the interaction blocks: each block keeps its edges'
# features for the backward pass. A chunk of atoms' energy would need the chunk's neighbours'
# neighbours, block after block; checkpointing each block needs no such bookkeeping, and keeps
# one block's edge features at a time, for forces alone (a force loss, which keeps graphs, is
# measured here only for the pair potential, above). The edges' share remains: the peak still
# grows with the edges. Below, a small network of that shape (random weights: only the
# derivatives matter), its forces plain and with each block checkpointed, both against a
# float64 copy, and the float64 forces against a central difference of the energy.
class Interaction(nn.Module):
    def __init__(self, width, basis):
        super().__init__()
        self.filter = nn.Sequential(
            nn.Linear(basis, width), nn.Tanh(), nn.Linear(width, width)
        )
        self.mix = nn.Linear(width, width)

    def forward(self, h, expanded, src, dst):  # edge messages, summed at each source
        messages = self.filter(expanded) * h[dst]
        return h + torch.tanh(self.mix(torch.zeros_like(h).index_add(0, src, messages)))


class Network(nn.Module):
    def __init__(self, width=32, basis=16, blocks=3, cutoff=2.5):
        super().__init__()
        self.start = nn.Parameter(0.5 * torch.randn(width))
        self.blocks = nn.ModuleList(Interaction(width, basis) for _ in range(blocks))
        self.readout = nn.Sequential(
            nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
        )
        self.register_buffer("centres", torch.linspace(0.8, cutoff, basis))
        self.cutoff, self.by_block = cutoff, False

    def forward(self, positions, src, dst):
        r = (positions[src] - positions[dst]).norm(dim=-1, keepdim=True)
        fade = 0.5 * (torch.cos(torch.pi * r / self.cutoff) + 1)  # zero at the cutoff
        expanded = torch.exp(-4 * (r - self.centres) ** 2) * fade
        h = self.start.expand(len(positions), -1)
        for block in self.blocks:
            if self.by_block:  # keep the block's inputs; run it again in backward
                h = checkpoint(block, h, expanded, src, dst, use_reentrant=False)
            else:
                h = block(h, expanded, src, dst)
        return self.readout(h).sum()


def edges_within(positions, cutoff, rows_at_once=512):
    pairs = []
    for rows in torch.arange(len(positions), device=device).split(rows_at_once):
        near = (positions[rows, None] - positions[None]).square().sum(-1) < cutoff**2
        i, j = near.nonzero(as_tuple=True)
        pairs.append(torch.stack([rows[i], j])[:, rows[i] != j])
    return torch.cat(pairs, dim=1)


network = Network().to(device)
wide_network = Network().double().to(device)
wide_network.load_state_dict(network.state_dict())


def network_forces(model, positions, src, dst, by_block):
    model.by_block = by_block
    leaf = positions.detach().requires_grad_()
    return -torch.autograd.grad(model(leaf, src, dst), leaf)[0]


for side in (10, 14):
    exact_here = crystal(side)
    here = exact_here.float()
    src, dst = edges_within(exact_here, network.cutoff)
    wide = network_forces(wide_network, exact_here, src, dst, False)
    for by_block in (False, True):

        def call(b=by_block, p=here, s=src, d=dst):
            return network_forces(network, p, s, d, b)

        gap = ((call().double() - wide).abs().max() / wide.abs().max()).item()
        assert gap < 1e-5, gap
        peaks["network", len(exact_here), by_block] = peak = peak_mib(call)
        print(f"{len(exact_here):5d} atoms, {src.numel():6d} edges, "
              f"{'each block checkpointed' if by_block else 'plain':24s}: {peak:6.1f} MiB, "
              f"off by {gap:.1e} from float64")  # fmt: skip
    plain, by_blocks = (peaks["network", len(exact_here), b] for b in (False, True))
    assert by_blocks < 0.75 * plain
    step, along = 1e-5, torch.randn_like(exact_here)
    ends = [wide_network(exact_here + k * step * along, src, dst) for k in (1, -1)]
    difference = -(ends[0] - ends[1]).item() / (2 * step)  # -dE/dt along the direction
    scale = (wide.abs() * along.abs()).sum()
    off = abs((wide * along).sum().item() - difference) / scale
    print(f"      along a random direction, against a central difference: {off:.1e}")
    assert off < 1e-9

# %%
# Forward mode: no graph kept, one number per pass
# ------------------------------------------------
# :func:`torch.func.jvp` carries a tangent beside each value and keeps nothing for later, but
# while it runs it holds every pair's value and tangent: its peak is no lower than the gradient's
# here. And each pass gives one directional derivative, ``-F·v``: all ``3N`` force components
# would take ``3N`` passes. Checked against the closed form along a random direction.
direction = torch.randn_like(positions)
_, slope = jvp(lambda p: energy_of(p, everything), (positions,), (direction,))
terms = -reference * direction.double()  # the closed form's F·v, term by term
gap = ((slope.double() - terms.sum()).abs() / terms.abs().sum()).item()
print(f"jvp along a random direction: {slope.item():.4f}, closed form {terms.sum():.4f}, "
      f"off by {gap:.1e} of the sum of its terms' sizes")  # fmt: skip
assert gap < 1e-6, gap
one_jvp = lambda: jvp(lambda p: energy_of(p, everything), (positions,), (direction,))  # noqa: E731
jvp_peak = peak_mib(one_jvp)
print(f"one jvp over all pairs: {jvp_peak:.1f} MiB at the peak, against "
      f"{peaks['autograd.grad', num_atoms, num_atoms]:.1f} MiB for autograd.grad")  # fmt: skip
assert jvp_peak >= peaks["autograd.grad", num_atoms, num_atoms]


# %%
# What each route costs in time
# -----------------------------
# Medians of :class:`torch.utils.benchmark.Timer` blocks after a warm-up, on all threads, for
# the 1000 atoms above. Every route computes the same pairs; the chunks and the checkpoint's
# second forward pass cost what they cost on this machine:
def median_ms(call):
    """Median, IQR (ms) and the number of blocks they come from."""
    all_threads = torch.get_num_threads()
    timer = Timer(stmt="call()", globals=dict(call=call), num_threads=all_threads)
    timer.timeit(1)  # warm-up
    measured = timer.blocked_autorange(min_run_time=1.0)
    levels = torch.tensor([0.25, 0.75])
    low, high = torch.tensor(measured.times).quantile(levels).tolist()
    return measured.median * 1e3, (high - low) * 1e3, len(measured.times)


routes = {("func.grad", num_atoms): lambda: chunked_forces(positions, num_atoms),
          ("autograd.grad", num_atoms): lambda: autograd_forces(positions, num_atoms)}  # fmt: skip
for chunk in (300, 128, 30):
    routes["atom chunks", chunk] = lambda c=chunk: autograd_forces(positions, c)
routes["checkpointed", 128] = lambda: checkpointed_forces(positions, 128)
times = {route: median_ms(call) for route, call in routes.items()}
whole = times["autograd.grad", num_atoms][0]
for (name, chunk), (median, spread, blocks) in times.items():
    print(f"{name:13s} {chunk:5d} at once: {median:8.2f} ms (IQR {spread:.2f} ms, {blocks} "
          f"blocks), {median / whole:5.2f}x autograd.grad's time on the whole")  # fmt: skip
jvp_ms = median_ms(one_jvp)
print(f"{3 * num_atoms} jvps, one per force component: {3 * num_atoms * jvp_ms[0] / whole:.0f}x "
      "autograd.grad's time (the measured jvp, times the count)")  # fmt: skip

# %%
# The figure: memory against time
# -------------------------------
# Left: each route for the 1000 atoms, its peak against its time; autograd.grad's chunks of 300,
# 128 and 30 atoms joined by a line. Right: the network's peak, plain and checkpointed by block.
chunk_sizes = (300, 128, 30)
chunk_peaks = [peak_mib(lambda c=c: autograd_forces(positions, c)) for c in chunk_sizes]
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4), layout="constrained")
left.plot([times["atom chunks", c][0] for c in chunk_sizes], chunk_peaks, "o-",
          color=METHOD_COLORS["atom chunks"], label="autograd.grad, atom chunks")  # fmt: skip
single = {("func.grad", num_atoms): peaks["func.grad", num_atoms, num_atoms],
          ("autograd.grad", num_atoms): peaks["autograd.grad", num_atoms, num_atoms],
          ("checkpointed", 128): peaks["checkpointed"]}  # fmt: skip
for (name, chunk), peak in single.items():
    colour = METHOD_COLORS[name]
    label = f"{name}, " + ("whole" if chunk == num_atoms else f"chunks of {chunk}")
    left.plot(times[name, chunk][0], peak, "s", color=colour, label=label, ms=9)
left.set(yscale="log", xlabel="time per call (ms)", ylabel="peak (MiB)",
         title=f"Lennard-Jones, 1000 atoms, {device.type.upper()}")  # fmt: skip
ticks = [2, 5, 10, 20, 50, 100]
left.set_yticks(ticks, [str(t) for t in ticks], minor=False)
left.yaxis.set_minor_formatter("")
left.legend(fontsize=8)
for offset, by_block in ((-0.2, False), (0.2, True)):
    right.bar([0 + offset, 1 + offset], [peaks["network", n, by_block] for n in (1000, 2744)],
              width=0.4, label="checkpointed blocks" if by_block else "plain",
              color=METHOD_COLORS["checkpointed" if by_block else "autograd.grad"])  # fmt: skip
right.set_xticks([0, 1], ["1000 atoms", "2744 atoms"])
right.set(ylabel="peak (MiB)", title="Message passing, three blocks")
right.legend(fontsize=8)
plt.show()

# %%
# What to remember
# ----------------
# - A gradient's memory is what its backward pass reads: for a pair potential, every pair at
#   once. The forces are small; the graph behind them is not.
# - Split the energy into parts (atoms against all atoms) and add the parts' gradients: the same
#   forces, each part's pairs freed before the next. For forces alone, use
#   ``torch.autograd.grad``: ``torch.func.grad`` also keeps a graph of its backward pass.
# - One backward call: ``torch.utils.checkpoint.checkpoint`` around each part, or around each
#   interaction block of a message-passing network, recomputes instead of keeping.
# - A force loss (``create_graph=True``): compute the forces first, then each part's share of
#   the loss's gradient, one part at a time; summing parts made with a graph keeps them all.
# - ``jvp`` keeps no graph but gives one directional derivative per pass: ``3N`` passes for all
#   forces. Measure a call's peak with a tool checked on a known case. ``chunk_size`` bounds the
#   rows of a Jacobian or Hessian, not one gradient of a scalar energy
#   (:ref:`sphx_glr_auto_examples_models_as_functions_plot_memory_control.py`).
