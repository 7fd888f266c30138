"""
Your own data structures under vmap, grad and jacrev
====================================================

The transforms take and return tensors, and tuples, lists, dicts and named tuples of them:
*pytrees*. A dataclass or a class of your own is opaque to them until you register it. Here you
register a dataclass of particles, and the transforms map it, differentiate it and return it:
``vmap`` over a batch of them, ``grad`` with respect to every field, ``jacrev`` of a function
that returns one, each checked against a loop or plain autograd. Then you see the four errors
an unregistered class gives, why ``in_dims=None`` for one field fails with a registered
dataclass and how to register so that it works, what happens to metadata such as a batch size
stored beside the tensors, ``chunk_size`` with such a class, and what the registration costs.
"""

# %%
# Setup
# -----
import dataclasses

import matplotlib.pyplot as plt
import torch
import torch.utils._pytree as pytree
from torch.func import grad, jacrev, vmap
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


# %%
# The recipe: register the class, then transform as usual
# --------------------------------------------------------
# A system of charged particles: positions (N, 3) and charges (N,). Its energy sums
# ``q_i q_j / |r_i − r_j|`` over pairs. ``torch.utils._pytree.register_dataclass`` tells
# the transforms that the class is a node whose children are its fields (the module is private
# by name, but it is the registry that :mod:`torch.func` reads; ``torch.export.register_dataclass``
# is a public route to it). After
# that, ``vmap`` maps every field over its first dimension, and ``grad`` returns a
# ``Particles`` whose fields are the gradients with respect to each field.
@dataclasses.dataclass
class Particles:
    positions: torch.Tensor
    charges: torch.Tensor


pytree.register_dataclass(Particles)


def coulomb_energy(system):
    first, second = torch.triu_indices(len(system.charges), len(system.charges), 1)
    gaps = (system.positions[first] - system.positions[second]).norm(dim=-1)
    return (system.charges[first] * system.charges[second] / gaps).sum()


num_systems, num_particles = 6, 5
batch = Particles(positions=torch.randn(num_systems, num_particles, 3, device=device),
                  charges=torch.randn(num_systems, num_particles, device=device))  # fmt: skip
energies = vmap(coulomb_energy)(batch)
gradients = vmap(grad(coulomb_energy))(batch)
shapes = {field: tuple(value.shape) for field, value in vars(gradients).items()}
print(
    f"energies {tuple(energies.shape)}; gradients: {type(gradients).__name__}, {shapes}"
)

# %%
# The check: a loop of plain autograd, field by field, in float64, with one bound for all,
# a few times the largest float32 error measured.


def check_field(label, got, want, bound):
    error = ((got.double() - want).abs() / (1 + want.abs())).max().item()
    print(f"{label:40s} max error {error:.1e} (bound {bound:.0e})")
    assert error <= bound, (label, error)


for s in range(num_systems):
    positions = batch.positions[s].double().requires_grad_()
    charges = batch.charges[s].double().requires_grad_()
    energy = coulomb_energy(Particles(positions, charges))
    by_loop = torch.autograd.grad(energy, (positions, charges))
    check_field(f"system {s}: energy", energies[s], energy.detach(), 1e-6)
    check_field(
        f"system {s}: d energy / d positions", gradients.positions[s], by_loop[0], 1e-6
    )
    check_field(
        f"system {s}: d energy / d charges", gradients.charges[s], by_loop[1], 1e-6
    )

# %%
# A function may also *return* the class. ``jacrev`` of ``forces_and_potentials`` (the forces
# on each particle and the potential each one feels, one ``Particles``-shaped answer) gives a
# ``Particles`` of Jacobians, each field with the output's shape followed by the input's.


def forces_and_potentials(positions, charges):
    forces = -grad(lambda r: coulomb_energy(Particles(r, charges)))(positions)
    potentials = grad(lambda q: coulomb_energy(Particles(positions, q)))(charges)
    return Particles(forces, potentials)


one = Particles(batch.positions[0], batch.charges[0])
jacobians = jacrev(forces_and_potentials)(one.positions, one.charges)
shapes = {field: tuple(value.shape) for field, value in vars(jacobians).items()}
print(f"jacrev returns {type(jacobians).__name__}, {shapes}")
# %%
# The reference: both fields are second derivatives of the energy, which float64
# ``torch.autograd.functional.hessian`` gives blockwise: the positions field is ``−∂²E/∂r²``,
# the charges field ``∂²E/∂q∂r``.
positions64, charges64 = one.positions.double(), one.charges.double()
blocks = torch.autograd.functional.hessian(
    lambda r, q: coulomb_energy(Particles(r, q)), (positions64, charges64)
)
check_field(
    "jacrev, positions field vs −Hessian", jacobians.positions, -blocks[0][0], 1e-6
)
check_field(
    "jacrev, charges field vs mixed block", jacobians.charges, blocks[1][0], 1e-6
)


# %%
# Four errors from an unregistered class
# --------------------------------------
# Without the registration the class is a leaf, and a leaf that a transform maps, differentiates
# or returns must be a tensor (with ``in_dims=None`` it passes through untouched). ``vmap`` says so
# about an input or an output, ``grad`` about its argument, and ``jacrev`` (through ``vjp``)
# about the output. Each message is checked by type and first words.
@dataclasses.dataclass
class Unregistered:
    positions: torch.Tensor
    charges: torch.Tensor


def energy_of_fields(system):
    return coulomb_energy(Particles(system.positions, system.charges))


def as_unregistered(positions):
    return Unregistered(positions, positions.sum(-1))


plain = Unregistered(batch.positions, batch.charges)
attempts = {
    "vmap, input": (ValueError, "vmap(energy_of_fields, in_dims=0, ...)(<inputs>): Got "
                    "in_dim=0 for an input but the input is of type", lambda: vmap(
                        energy_of_fields)(plain)),
    "vmap, output": (ValueError, "vmap(as_unregistered, ...): `as_unregistered` must only "
                     "return Tensors", lambda: vmap(as_unregistered)(batch.positions)),
    "grad, input": (ValueError, "Thing passed to transform API must be Tensor",
                    lambda: grad(energy_of_fields)(Unregistered(*(one.positions,
                                                                     one.charges)))),
    "jacrev, output": (RuntimeError, "vjp(f, *primals): expected f(*primals) to return only "
                       "tensors", lambda: jacrev(as_unregistered)(one.positions)),
}  # fmt: skip
for where, (kind, start, attempt) in attempts.items():
    try:
        attempt()
        raise AssertionError(f"{where}: no error")
    except kind as refused:
        assert str(refused).startswith(start), (where, str(refused))
        print(f"{where:15s} {kind.__name__}: {str(refused)[:70]}...")

# %%
# ``in_dims`` per field, and a registration that allows it
# --------------------------------------------------------
# ``in_dims`` may be a ``Particles`` itself, one entry per field: here the positions differ per
# system and the charges are shared. With ``register_dataclass``, a
# field whose value is ``None`` is kept out of the node's children (the class may have optional
# fields), so ``Particles(positions=0, charges=None)`` has one child while the input has two, and
# ``vmap`` refuses the mismatch. A registration with
# ``torch.utils._pytree.register_pytree_node`` that always lists both fields accepts it.
shared_charges = batch.charges[0]
try:
    vmap(coulomb_energy, in_dims=(Particles(0, None),))(Particles(batch.positions,
                                                                  shared_charges))  # fmt: skip
    raise AssertionError("vmap accepted a None field")
except ValueError as mismatch:
    assert "in_dims is not compatible with the structure of `inputs`" in str(mismatch)
    print("in_dims=Particles(0, None): ValueError: in_dims is not compatible with the "
          "structure of `inputs`")  # fmt: skip


@dataclasses.dataclass
class SharedParticles:  # the same fields, registered by hand
    positions: torch.Tensor
    charges: torch.Tensor


pytree.register_pytree_node(
    SharedParticles,
    lambda node: ([node.positions, node.charges], None),  # children, context
    lambda children, context: SharedParticles(*children),
)
mixed = vmap(energy_of_fields, in_dims=(SharedParticles(0, None),))(
    SharedParticles(batch.positions, shared_charges)
)
for s in range(num_systems):
    loop_energy = coulomb_energy(
        Particles(batch.positions[s].double(), shared_charges.double())
    )
    check_field(f"system {s}: shared charges vs loop", mixed[s], loop_energy, 1e-6)


# %%
# Metadata stays as it was, and ``chunk_size`` splits the children
# ----------------------------------------------------------------
# What ``flatten`` returns as *context* is not a child, so ``vmap`` does not map it: a batch
# size stored there still says 6 inside the function, where the function sees one system. Inside a
# transform, read sizes from the tensors. ``chunk_size=k`` flattens the input, splits each
# child into chunks of ``k``, and rebuilds the class per chunk with the same context: the
# results equal the unchunked ones. A dataclass with a name or a count in it needs the same:
# ``register_dataclass`` makes every field a child, and ``vmap`` refuses the string (asserted),
# so register it by hand with such fields in the context. TensorDict is another case: it is
# registered, but inside ``vmap`` its node is ignored and its own patch of ``vmap`` adds the
# batch dimension (pytorch/tensordict#501); pytorch/tensordict#1091 reports ``chunk_size``
# failing with a tensorclass (not run here), which a registered class of your own does not.
@dataclasses.dataclass
class Labelled:
    positions: torch.Tensor
    charges: torch.Tensor
    batch_size: int
    name: str


pytree.register_pytree_node(
    Labelled,
    lambda node: ([node.positions, node.charges], (node.batch_size, node.name)),
    lambda children, context: Labelled(*children, *context),
)
seen = []


def labelled_energy(system):
    seen.append((system.batch_size, tuple(system.positions.shape)))
    return coulomb_energy(Particles(system.positions, system.charges))


labelled = Labelled(
    batch.positions, batch.charges, batch_size=num_systems, name="run 1"
)
whole = vmap(labelled_energy)(labelled)
assert seen == [(6, (num_particles, 3))], seen
print(f"inside vmap: batch_size says {seen[0][0]}, positions have shape {seen[0][1]}")
seen.clear()
chunked = vmap(labelled_energy, chunk_size=4)(labelled)
print(
    f"chunk_size=4: {len(seen)} calls, reading batch_size {[size for size, _ in seen]}"
)
assert seen == [(6, (num_particles, 3))] * 2 and torch.equal(chunked, whole)


@dataclasses.dataclass
class NamedRun:  # the same fields, every one a child
    positions: torch.Tensor
    charges: torch.Tensor
    name: str


pytree.register_dataclass(NamedRun)
try:
    vmap(energy_of_fields)(NamedRun(batch.positions, batch.charges, "run 1"))
    raise AssertionError("vmap mapped a string")
except ValueError as string_leaf:
    assert "Got in_dim=0 for an input but the input is of type <class 'str'>" in str(
        string_leaf
    ), string_leaf
    print("register_dataclass with a str field: ValueError: ... Got in_dim=0 for an input but "
          "the input is of type <class 'str'>")  # fmt: skip


# %%
# Measuring: what the registration costs
# --------------------------------------
# ``vmap`` flattens the class into its tensors on the way in and rebuilds it, batched, for the
# function. The same energies from the two tensors passed directly run the same operators, so
# what the class adds is Python work, once per call whatever the batch. Times are medians of
# :class:`~torch.utils.benchmark.Timer` blocks after a warm-up, on all threads, for the batch of
# 6 and for 600 systems; a ratio within the spread of the times means no measurable cost.
def energy_of_tensors(positions, charges):
    return coulomb_energy(Particles(positions, charges))


medians = {}
for size in (num_systems, 600):
    big = Particles(torch.randn(size, num_particles, 3, device=device),
                    torch.randn(size, num_particles, device=device))  # fmt: skip
    calls = {"registered class": lambda big=big: vmap(coulomb_energy)(big),
             "tensors": lambda big=big: vmap(energy_of_tensors)(*vars(big).values())}  # fmt: skip
    assert torch.equal(calls["registered class"](), calls["tensors"]())
    for label, call in calls.items():
        timer = Timer(
            "call()", globals={"call": call}, num_threads=torch.get_num_threads()
        )
        measured = timer.blocked_autorange(min_run_time=0.3)
        medians[label, size] = measured
        print(f"{size:4d} systems, {label:16s} {measured.median * 1e6:8.1f} µs "
              f"(IQR {measured.iqr * 1e6:.1f})")  # fmt: skip
    slow, fast = sorted(calls, key=lambda label: -medians[label, size].median)
    ratio = medians[slow, size].median / medians[fast, size].median
    print(f"  {slow} takes {ratio:.2f}x the time of {fast}")

fig, ax = plt.subplots(figsize=(6.5, 2.8), layout="constrained")
for row, (label, size) in enumerate(medians):
    measured = medians[label, size]
    ax.barh(row, measured.median * 1e6, xerr=measured.iqr * 1e6, color="0.55")
ax.set_yticks(
    range(len(medians)), [f"{label}, {size} systems" for label, size in medians]
)
ax.invert_yaxis()
ax.set(
    xscale="log",
    xlabel="median time (µs, log scale), bars ± the IQR",
    title=f"vmap of the energy, {device.type}",
)
plt.show()

# %%
# What to remember
# ----------------
# * Register a dataclass with ``torch.utils._pytree.register_dataclass`` (or any class with
#   ``register_pytree_node``); then ``vmap``, ``grad`` and ``jacrev`` take and return it.
# * Unregistered, it is a leaf, and the transforms ask for a tensor: "Got in_dim=0 for an input
#   but the input is of type", "must only return Tensors", "Thing passed to transform API".
# * ``in_dims`` can be an instance of the class; with ``register_dataclass`` a ``None`` field
#   drops out of the structure, so register by hand when one field is shared.
# * Context (a name, a batch size) is not mapped and not split by ``chunk_size``: read sizes
#   from the tensors inside a transform.
