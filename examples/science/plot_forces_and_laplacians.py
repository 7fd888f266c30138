"""
Forces, Hessians and Laplacians: derivatives with respect to inputs
===================================================================

Scientific models differentiate with respect to their *inputs*: a force field needs forces
(minus the energy's gradient in the atoms' positions) and often the Hessian; a physics-informed
network puts derivatives in its input coordinates into its loss. Here you compute forces and
Hessians for a batch of Lennard-Jones clusters with ``vmap`` over ``grad`` and ``hessian``,
check them entry by entry against closed forms, then compute a Laplacian three ways (the
Hessian's trace, one Hessian-vector product per coordinate, Hutchinson's estimate), check each,
and measure what each costs as inputs grow.
"""

# %%
# Setup
# -----
# The molecules run in float64, as molecular simulations usually do; the Laplacians in float32,
# with TF32 off on GPUs so that their checks measure float32 rounding.
from functools import partial

import matplotlib.pyplot as plt
import torch
from torch.func import grad, grad_and_value, hessian, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.benchmark import Measurement, Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.set_float32_matmul_precision("highest")
METHOD_COLORS = {"hessian": "#56B4E9", "forward-over-reverse": "#EE3377",
                 "Hutchinson": "#AA3377"}  # fmt: skip

# %%
# A Lennard-Jones cluster
# -----------------------
# Thirteen atoms interact through the pair potential ``V(r) = 4(r⁻¹² − r⁻⁶)`` (in units where
# the well depth and the atom size are 1), summed over the 78 pairs. The function takes *one*
# cluster, positions (13, 3), and returns a scalar; it uses squared distances, so no square
# root. The batch: 16 icosahedra with an atom at the centre, each shaken at random.
num_atoms, num_configs = 13, 16


def lj_energy(positions):
    first, second = torch.triu_indices(num_atoms, num_atoms, 1, device=positions.device)
    squared = (positions[first] - positions[second]).square().sum(dim=-1)
    inverse_sixth = squared.pow(-3)
    return 4 * (inverse_sixth.square() - inverse_sixth).sum()


golden = (1 + 5**0.5) / 2
signs = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
face = torch.cat([torch.zeros(4, 1), signs[:, :1], golden * signs[:, 1:]], dim=1)
vertices = torch.cat([face.roll(shift, dims=1) for shift in range(3)])  # (0, ±1, ±φ)
icosahedron = torch.cat([torch.zeros(1, 3), 1.1 * vertices / vertices[0].norm()])
shaken = icosahedron + 0.04 * torch.randn(num_configs, num_atoms, 3)
configs = shaken.to(device, torch.float64)
print(f"{num_configs} clusters of {num_atoms} atoms, positions {tuple(configs.shape)}")

# %%
# Forces for a batch: ``vmap(grad_and_value(energy))``
# ----------------------------------------------------
# :func:`~torch.func.grad` differentiates the energy of one cluster with respect to its
# positions; :func:`~torch.func.grad_and_value` returns the energy beside the gradient, from the
# same forward pass; :func:`~torch.func.vmap` maps both over the batch. The force is minus the
# gradient. ``has_aux=True`` would pass more outputs (per-atom energies, say) through.
gradients, energies = vmap(grad_and_value(lj_energy))(configs)
forces = -gradients
print(f"forces {tuple(forces.shape)}, energies {tuple(energies.shape)}")


# %%
# The check: the closed-form pair force
# -------------------------------------
# By hand, ``V'(r) = −48 r⁻¹³ + 24 r⁻⁷`` and the force on atom ``i`` is
# ``F_i = −Σ_j V'(r_ij) u_ij``, with ``u_ij`` the unit vector from ``j`` to ``i``, evaluated over
# all ordered pairs at once in float64 without autograd (an atom's distance to itself is infinite,
# where ``V'`` is zero). Each entry must meet ``|error| ≤ atol + rtol·|reference|``; the share of
# that bound the worst entry uses is printed.
def pair_geometry(positions):
    """Separations x_i − x_j, distances and unit vectors for all ordered pairs of a batch."""
    separation = positions[:, :, None, :] - positions[:, None, :, :]
    distance = separation.norm(dim=-1)
    distance.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    return separation, distance, separation / distance[..., None]


def assert_each_entry(what, got, reference, rtol, atol):
    error = (got.double() - reference).abs()
    share = (error / (atol + rtol * reference.abs())).max().item()
    print(f"{what:42s} worst error {error.max().item():.1e}, {share:.0%} of its bound")
    assert share <= 1, f"{what}: an entry is at {share:.2f}x its bound"


separation, distance, unit = pair_geometry(configs.cpu())
slope = -48 * distance.pow(-13) + 24 * distance.pow(-7)  # V'(r)
reference_forces = -(slope[..., None] * unit).sum(dim=2)
reference_energies = 2 * (distance.pow(-12) - distance.pow(-6)).sum(dim=(1, 2))
assert_each_entry("forces vs the closed form", forces.cpu(), reference_forces, 0, 3e-13)
assert_each_entry("energies vs the closed form", energies.cpu(), reference_energies,
                  1e-15, 0)  # fmt: skip
# Newton's third law: the forces add to 0, within 16 float64 epsilons of Σ |pair force|.
pair_sizes = (slope[..., None] * unit).abs().sum(dim=(1, 2))  # (clusters, 3)
assert_each_entry("total force on each cluster", forces.sum(dim=1).cpu(), 0 * pair_sizes,
                  0, 16 * torch.finfo(torch.float64).eps * pair_sizes)  # fmt: skip

# %%
# The other route, and training on forces
# ---------------------------------------
# Machine-learned force fields (SchNetPack, NequIP and MACE among them) differentiate the *sum* of
# a batch's energies with respect to all positions. As a cluster's energy depends on its own
# positions only, the sum's gradient holds each cluster's (checked); once one configuration's
# energy depends on another's (a normalisation over the batch, say), it mixes their forces.
batch = configs.clone().requires_grad_()
(summed,) = torch.autograd.grad(vmap(lj_energy)(batch).sum(), batch)
assert_each_entry("forces by autograd.grad of the sum", -summed.cpu(), reference_forces,
                  0, 3e-13)  # fmt: skip


# %%
# Training on forces differentiates through the gradient: those codes pass ``create_graph=True``; in
# ``torch.func``, ``grad`` of a loss that calls ``grad`` suffices, as on the PINN page. Here the
# atoms' size ``σ`` (energy ``lj_energy(x / σ)``) is fitted to the forces; a float64 central
# difference checks the loss's derivative at σ = 1.05.
def force_matching_loss(size):
    predicted = -vmap(grad(lambda x: lj_energy(x / size)))(configs)
    return (predicted - forces).square().mean()


size, step = torch.tensor(1.05, dtype=torch.float64, device=device), 1e-6
plus, minus = force_matching_loss(size + step), force_matching_loss(size - step)
difference = (plus - minus) / (2 * step)
assert_each_entry("force-matching loss, d/dσ vs a difference",
                  grad(force_matching_loss)(size).cpu(), difference.cpu(), 1e-9, 0)  # fmt: skip

# %%
# The Hessian with respect to positions
# -------------------------------------
# :func:`~torch.func.hessian` of one cluster's energy has shape (13, 3, 13, 3), atom and axis twice;
# ``vmap`` maps it over the batch, a reshape gives a 39 × 39 matrix per cluster. By hand: the block
# of ``V(|x_i − x_j|)`` with respect to the separation is ``K = V''(r) u uᵀ + V'(r)/r (I − u uᵀ)``,
# ``V''(r) = 624 r⁻¹⁴ − 168 r⁻⁸``; the off-diagonal block (i, j) of the Hessian is ``−K_ij``, the
# diagonal block ``Σ_j K_ij``. How ``hessian`` composes ``jacfwd`` and ``jacrev``:
# :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_jacobians_hessians.py`.
hessians = vmap(hessian(lj_energy))(configs).reshape(num_configs, 3 * num_atoms, -1)
print(f"Hessians {tuple(hessians.shape)}")
bend = 624 * distance.pow(-14) - 168 * distance.pow(-8)  # V''(r)
along = unit[..., :, None] * unit[..., None, :]  # u uᵀ, (B, N, N, 3, 3)
across = torch.eye(3, dtype=torch.float64) - along
blocks = bend[..., None, None] * along + (slope / distance)[..., None, None] * across
reference_hessians = -blocks
atoms = torch.arange(num_atoms)
reference_hessians[:, atoms, atoms] += blocks.sum(dim=2)
reference_hessians = reference_hessians.transpose(2, 3).reshape(num_configs, 39, 39)
assert_each_entry("Hessians vs the closed form", hessians.cpu(), reference_hessians,
                  0, 5e-12)  # fmt: skip

# %%
# Shifting all atoms by one vector changes nothing: each Hessian row sums to zero over atoms.
row_sums = hessians.reshape(num_configs, 39, num_atoms, 3).sum(dim=2).cpu()
assert_each_entry("Hessian rows summed over atoms", row_sums,
                  torch.zeros_like(row_sums), 0, 1e-12)  # fmt: skip

# %%
# At a minimum: six zero modes
# ----------------------------
# Newton's method, with one cluster's gradient and Hessian, finds a stationary point, a saddle as
# well as a minimum; from the unshaken icosahedron six steps, each solved with the pseudo-inverse of
# the singular Hessian, reach the minimum tabulated as −44.326801 (Wales and Doye, 1997). Geometry
# optimisers use L-BFGS or trust regions.
positions = icosahedron.to(device, torch.float64)
for _ in range(6):
    gradient = grad(lj_energy)(positions).flatten()
    curvature = hessian(lj_energy)(positions).reshape(39, 39)
    newton = torch.linalg.pinv(curvature, hermitian=True, rtol=1e-10) @ gradient
    positions = positions - newton.reshape(num_atoms, 3)
gradient, energy = grad_and_value(lj_energy)(positions)
print(f"minimum: energy {energy.item():.6f}, |gradient| {gradient.norm().item():.1e}")
assert abs(energy.item() + 44.326801) < 1e-6 and gradient.norm() < 1e-12

# %%
# At a minimum, the Hessian's eigenvalues are its vibrational stiffnesses: zero for the three
# translations, as above, and for the three rotations, as rotating a cluster changes nothing
# (at a stationary point, a direction of zero curvature); the other 33 must be positive.
stiffness = torch.linalg.eigvalsh(hessian(lj_energy)(positions).reshape(39, 39)).cpu()
is_zero = stiffness.abs() < 1e-10 * stiffness.abs().max()
print(f"{int(is_zero.sum())} zero eigenvalues (largest {stiffness[is_zero].abs().max():.1e});"
      f" the rest from {stiffness[~is_zero].min():.2f} to {stiffness.max():.2f}")  # fmt: skip
assert is_zero.sum() == 6 and (stiffness[~is_zero] > 0).all()


# %%
# The Laplacian, three ways
# -------------------------
# A physics-informed network ``u(x)`` may be trained so that its Laplacian ``Δu = Σ_i ∂²u/∂x_i²``,
# the trace of its Hessian in ``x``, matches a source term at many points (:ref:`the PINN page
# <sphx_glr_auto_examples_science_plot_physics_informed_network.py>` trains one). Our ``u`` is one
# tanh layer, ``wᵀ tanh(A x + b)``, whose Hessian ``Aᵀ diag(w ⊙ tanh'') A`` couples all inputs; with
# ``t = tanh(A x + b)``, ``tanh'' = −2t(1 − t²)``, ``Δu = Σ_k w_k tanh''_k |A_k|²`` (float64
# references). ``torch.func`` has no Taylor mode (JAX's ``jax.experimental.jet``).
def make_field(dim, width=64, points=16):
    """u(x) for one point x of length dim, its parameters, and a batch of points."""
    gen = torch.Generator().manual_seed(dim)
    layer = torch.randn(width, dim, generator=gen) / dim**0.5
    shift, mix = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
    xs = torch.randn(points, dim, generator=gen)
    weights = tuple(t.to(device) for t in (layer, shift, mix / width**0.5))

    def u(x):
        a, b, w = weights
        return torch.tanh(a @ x + b) @ w

    return u, weights, xs.to(device)


def closed_form(weights, xs):
    """Laplacians and Hessians of u at each point, in float64, by hand."""
    a, b, w = (t.cpu().double() for t in weights)
    t = torch.tanh(xs.cpu().double() @ a.T + b)
    bend = w * (-2 * t * (1 - t**2))  # (points, width)
    return bend @ a.square().sum(dim=1), torch.einsum("kd,pk,ke->pde", a, bend, a)


# %%
# (a) **The trace of the Hessian**: form it with ``hessian``, keep its diagonal. (b)
# **Forward-over-reverse, one coordinate at a time**: ``e_iᵀ H e_i`` is the *i*-th diagonal
# entry, ``H e_i`` a Hessian-vector product (:func:`~torch.func.jvp` of ``grad(u)`` along
# ``e_i``; ``vmap`` runs all ``d`` at once), on its own in
# :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_hessian_vector_products.py`. (c)
# **Hutchinson's estimator** (1990): for ``v`` with entries ±1 at random (a Rademacher probe),
# ``E[vᵀ H v] = trace H``; the mean over ``S`` probes estimates it with ``S`` products, not ``d``.
def quadratic_form(u, x, v):  # vᵀ H v at x, from one forward-over-reverse product H v
    return v @ jvp(grad(u), (x,), (v,))[1]


def laplacian_by_trace(u, x):
    return hessian(u)(x).diagonal().sum()


def laplacian_by_basis(u, x, chunk_size=None):
    basis = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    return vmap(lambda e: quadratic_form(u, x, e), chunk_size=chunk_size)(basis).sum()


def hutchinson_samples(u, x, probes):
    """vᵀ H v for each probe v (a row of probes); their mean estimates the Laplacian."""
    return vmap(lambda v: quadratic_form(u, x, v))(probes)


def over_points(route, u):  # the route, given u, mapped over points (and probes)
    return vmap(partial(route, u))


def rademacher(shape, seed):
    signs = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed))
    return (2.0 * signs - 1).to(device)


def rademacher_variance(hessians):
    """Variance of vᵀ H v for ±1 probes: 2 Σ_{i≠j} H_ij², for each Hessian of a batch."""
    diagonal = hessians.diagonal(dim1=-2, dim2=-1)
    return 2 * (hessians.square().sum(dim=(-2, -1)) - diagonal.square().sum(dim=-1))


# %%
# Each route is mapped over 16 points, for ``d`` = 8 and 256, and checked entry by entry;
# Hutchinson's probe by probe, within 8 float32 epsilons of ``|v|² ‖H‖`` (``‖H‖`` the largest
# singular value), which bounds the terms ``v · (H v)`` adds. Their mean is random, with standard
# error ``√(Var/16)``, ``Var(vᵀ H v) = 2 Σ_{i≠j} H_ij²`` for ±1 probes (as ``v_i² = 1``). Each
# estimate lies within 4 standard errors of the exact Laplacian: a demonstration, not a check.
num_probes = 16
for dim in (8, 256):
    u, weights, xs = make_field(dim)
    exact, exact_hessians = closed_form(weights, xs)
    by_trace = over_points(laplacian_by_trace, u)(xs)
    by_basis = over_points(laplacian_by_basis, u)(xs)
    assert_each_entry(f"d={dim:3d} (a) trace of the Hessian", by_trace.cpu(), exact,
                      0, 2e-6)  # fmt: skip
    assert_each_entry(f"d={dim:3d} (b) one product per coordinate", by_basis.cpu(), exact,
                      0, 2e-6)  # fmt: skip
    probes = rademacher((len(xs), num_probes, dim), seed=dim)
    samples = over_points(hutchinson_samples, u)(xs, probes)
    v = probes.cpu().double()  # (points, probes, d)
    by_hand = torch.einsum("psi,pij,psj->ps", v, exact_hessians, v)  # each vᵀ H v
    norm = torch.linalg.matrix_norm(exact_hessians, ord=2)[:, None]  # ‖H‖ at each point
    rounding = 8 * torch.finfo(torch.float32).eps * v.square().sum(-1) * norm
    assert_each_entry(f"d={dim:3d} (c) each probe's vᵀ H v", samples.cpu(), by_hand,
                      0, rounding)  # fmt: skip
    standard_error = (rademacher_variance(exact_hessians) / num_probes).sqrt()
    in_errors = (samples.mean(dim=1).cpu().double() - exact).abs() / standard_error
    print(f"d={dim:3d} (c) Hutchinson, {num_probes} probes: worst point "
          f"{in_errors.max().item():.2f} standard errors off (bound 4); a standard error is "
          f"{(standard_error / exact.abs()).median().item():.0%} of |Δu| (median)")  # fmt: skip
    assert (in_errors <= 4).all(), f"d={dim}: {in_errors.max():.1f} SE off"

# %%
# Why ±1 probes: the variance, measured
# -------------------------------------
# For Gaussian probes the variance of ``vᵀ H v`` is ``2 Σ_ij H_ij²``: the diagonal, which ±1 probes
# skip, adds ``2 Σ_i H_ii²``. At one point with ``d = 8``, 32,768 probes of each kind measure it,
# within 4 standard errors (from the samples' fourth moment) of its formula.
u, weights, xs = make_field(8)
h = closed_form(weights, xs[:1])[1][0]
many, gen = 2**15, torch.Generator().manual_seed(1)
gaussian = torch.randn(many, 8, generator=gen).to(device)
probe_kinds = {
    "Rademacher": (rademacher((many, 8), seed=1), rademacher_variance(h).item()),
    "Gaussian": (gaussian, 2 * h.square().sum().item()),
}
for kind, (probes, formula) in probe_kinds.items():
    samples = hutchinson_samples(u, xs[0], probes).cpu().double()
    variance = samples.var(correction=0).item()
    spread = ((samples - samples.mean()).pow(4).mean().item() - variance**2) / many
    apart = abs(variance - formula) / spread**0.5  # in standard errors of the variance
    print(f"{kind:10s} probes: variance {variance:.3f}, formula {formula:.3f} "
          f"({apart:.1f} of its standard errors apart, bound 4)")  # fmt: skip
    assert apart <= 4, f"{kind}: the variance is {apart:.1f} standard errors off"
ratio = probe_kinds["Gaussian"][1] / probe_kinds["Rademacher"][1]
print(f"Gaussian probes need {ratio:.3g}x the probes of ±1 ones for the same precision")


# %%
# Cost as the dimension grows
# ---------------------------
# Memory first. A ``TorchDispatchMode`` sees every operation's result; we record the largest
# storage among them in bytes, a lower limit on a route's peak memory. Storage, not shape, so a
# view (an ``expand``, say) counts no bigger than what it views. Checked on two known cases.
class LargestTensor(TorchDispatchMode):
    nbytes = 0  # the largest storage seen so far, per instance once it is set

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


row = torch.randn(4, 100, device=device)
with LargestTensor() as probe:
    vmap(torch.outer)(row, row)
assert probe.nbytes == 4 * 100 * 100 * 4, probe.nbytes
with LargestTensor() as probe:
    row.expand(1000, 4, 100).sum()
assert probe.nbytes == 4 * 100 * 4, probe.nbytes
print("largest tensor: 160,000 bytes for 4 outer products of 100, 1,600 for an expand")

# %%
# Each route runs on 16 points, with 16 probes for Hutchinson, for ``d`` = 8, 64 and 256. Times are
# medians of :class:`torch.utils.benchmark.Timer` blocks after a warm-up, on all CPU threads.
routes = {
    "hessian": lambda u, xs, v: over_points(laplacian_by_trace, u)(xs),
    "forward-over-reverse": lambda u, xs, v: over_points(laplacian_by_basis, u)(xs),
    "Hutchinson": lambda u, xs, v: over_points(hutchinson_samples, u)(xs, v).mean(1),
}
dims = (8, 64, 256)


def timed(run):  # blocks for 0.2 s, and at least 5 blocks, so that they have a spread
    timer = Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    blocks = [timer.blocked_autorange(min_run_time=0.2)]
    while sum(len(m.times) for m in blocks) < 5:  # a slow call fills few blocks
        blocks.append(timer.timeit(1))
    return Measurement.merge(blocks)[0]


times, sizes = {name: [] for name in routes}, {name: [] for name in routes}
for dim in dims:
    u, _, xs = make_field(dim)
    probes = rademacher((len(xs), num_probes, dim), seed=0)
    for name, route in routes.items():
        run = partial(route, u, xs, probes)
        with LargestTensor() as probe:
            run()  # also the warm-up
        sizes[name].append(probe.nbytes)
        times[name].append(measured := timed(run))
        print(f"d={dim:3d} {name:21s} {measured.median * 1e3:7.2f} ms (IQR "
              f"{measured.iqr * 1e3:.3g} ms, {len(measured.times)} blocks), "
              f"largest tensor {probe.nbytes:>9,} bytes")  # fmt: skip
    for exact_route in ("hessian", "forward-over-reverse"):
        assert sizes[exact_route][-1] >= len(xs) * dim * dim * 4  # B·d² floats
assert sizes["Hutchinson"][-1] < sizes["forward-over-reverse"][-1]

# %%
# ``vmap`` runs all ``d`` products of route (b) at once, their ``d`` columns in memory together;
# ``chunk_size=16`` runs 16 at a time: the result must not change, the largest tensor shrink.
u, weights, xs = make_field(256)  # the field and points of d = 256, made afresh
in_chunks = partial(over_points(partial(laplacian_by_basis, chunk_size=16), u), xs)
with LargestTensor() as probe:
    chunked = in_chunks()
assert_each_entry("d=256 (b) in chunks of 16", chunked.cpu(), closed_form(weights, xs)[0],
                  0, 2e-6)  # fmt: skip
chunked_time = timed(in_chunks)
print(f"d=256 forward-over-reverse, chunk_size=16: {chunked_time.median * 1e3:.2f} ms (IQR "
      f"{chunked_time.iqr * 1e3:.3g} ms, {len(chunked_time.times)} blocks), largest tensor "
      f"{probe.nbytes:,} bytes, {sizes['forward-over-reverse'][-1] / probe.nbytes:.3g}x"
      " less than unchunked")  # fmt: skip
assert probe.nbytes == len(xs) * 16 * 256 * 4  # B points × 16 columns of d floats


# %%
def time_ratio(slow, fast, at):
    if times[slow][at].median < times[fast][at].median:
        slow, fast = fast, slow
    ratio = times[slow][at].median / times[fast][at].median
    return f"{slow} takes {ratio:.3g}x the time of {fast} at d={dims[at]}"


for name in routes:
    growth = times[name][-1].median / times[name][0].median
    print(f"{name:21s} from d=8 to d=256: time x{growth:.3g}, "
          f"largest tensor x{sizes[name][-1] / sizes[name][0]:.3g}")  # fmt: skip
print(time_ratio("hessian", "Hutchinson", -1))
print(time_ratio("forward-over-reverse", "Hutchinson", -1))
print(time_ratio("hessian", "forward-over-reverse", -1))

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
levels = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)  # the quartiles
for (name, colour), marker, width in zip(METHOD_COLORS.items(), "osD", (4, 2, 2)):
    style = dict(color=colour, marker=marker, lw=width, ms=4 + width, label=name)
    low, mid, high = torch.stack([torch.tensor(t.times, dtype=torch.float64).quantile(levels)
                                  for t in times[name]]).T * 1e3  # fmt: skip
    left.errorbar(dims, mid, yerr=(mid - low, high - mid), capsize=3, **style)
    right.plot(dims, sizes[name], **style)
for ax, label in ((left, "median time (ms)"), (right, "largest tensor (bytes)")):
    ax.set(xscale="log", yscale="log", xlabel="input dimension d", ylabel=label)
    ax.set_xticks(dims, [str(d) for d in dims])
left.legend(loc="upper left")
left.set_title(f"{device.type.upper()}: median time, bars to the quartiles")
right.set_title(f"Hutchinson uses {num_probes} probes at every d")
plt.show()

# %%
# **Reading the numbers.** The exact routes run ``d`` Hessian-vector products per point and hold
# each point's ``d × d`` Hessian (asserted) unless chunked; Hutchinson's runs ``S`` whatever ``d``
# is, and pays in noise: its standard error falls as ``1/√S``. Chunking (one run per chunk) can cost
# time, and on a GPU at these sizes time can stay flat as ``d`` grows: see the printed numbers.

# %%
# What to remember
# ----------------
# * Forces for a batch: ``vmap(grad_and_value(energy))``, or ``autograd.grad`` of the summed
#   energies while no configuration's energy depends on another's; check a closed-form force.
# * ``vmap(hessian(energy))`` gives one (N, 3, N, 3) Hessian per configuration; its rows sum to
#   zero over atoms, and at a minimum of a free cluster it has six zero eigenvalues, not three.
# * In torch.func an exact Laplacian costs ``d`` products, ``jvp`` of ``grad`` (it lacks the
#   forward Laplacian); ``vmap`` holds all ``d × d`` entries at once unless given ``chunk_size``.
# * Hutchinson's estimator costs ``S`` products whatever ``d`` is, and is noisy; use ±1 probes,
#   whose variance ``2 Σ_{i≠j} H_ij²`` leaves out the diagonal, and report its standard error.
