"""
Troubleshooting, part 17: one sample's gradient, NumPy inside grad, integer inputs to jvp
=========================================================================================

Three reports in which the message is true but the way out is not in it, re-run on torch 2.13:
``torch.autograd.grad(y[0], x[0])``, "appears to not have been used in the graph"
(pytorch#95132); ``.detach().numpy()`` inside ``grad``, to send a sampled action to a NumPy
simulator or to log a value, "Cannot access data pointer" (pytorch#91810); and ``jvp`` of a
model that also takes integer inputs, whose answers seemed to disagree from one tangent to the
next (pytorch#154302), and which 2.13 refuses with "Expected primal to be floating point" when
those inputs are integer tensors. For each: the message asserted, its cause in a sentence, and
the fix checked against a reference computed another way (a derivative written by hand in
float64, or a value computed outside the transform). Part 1: :doc:`plot_troubleshooting`.
"""

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._functorch import is_gradtrackingtensor
from torch.distributions import Categorical
from torch.func import grad, jacrev, jvp, vjp, vmap
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cpu = torch.device("cpu")  # the NumPy section: NumPy arrays live in the CPU's memory
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
double = {"device": device, "dtype": torch.float64}
METHOD_COLORS = {"func.jvp": "#0077BB"}


def refuses(kind, first_words, call, *args):
    """Asserts that call(*args) raises exactly ``kind``, its message opening with first_words."""
    try:
        call(*args)
    except kind as what_raised:
        said = " ".join(str(what_raised).split())
        assert type(what_raised) is kind, f"{type(what_raised).__name__}: {said}"
        assert said.startswith(first_words), said
        print(f"  {kind.__name__}: {textwrap.shorten(said, 104)}")
        return
    raise AssertionError(f"torch {torch.__version__}: no {kind.__name__} raised")


def within(label, got, want, bound):
    """Asserts got matches want: shape, then the largest gap over the largest entry."""
    assert got.shape == want.shape, (label, tuple(got.shape), tuple(want.shape))
    gap = ((got.double() - want.double()).abs().max() / want.abs().max()).item()
    print(f"  {label}: largest error {gap:.1e}, bound {bound:.0e}")
    assert gap <= bound, f"{label}: {gap:.1e} > {bound:.0e}"


# %%
# The differentiated Tensor at index 0 appears to not have been used in the graph: y[0], x[0]
# --------------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``torch.autograd.grad(y[0], x[0], v)``, where ``y = net(x)`` ran on a
# batch and you want one sample's vector-Jacobian product vᵀJ (pytorch#95132). The cause:
# ``x[0]`` is not a name for a part of ``x``. Indexing runs when you write it and returns a new
# tensor (a view, with its own node in the graph), made after ``y``; ``y`` was computed from
# ``x``, never from it, nor from ``x.clone()[0]`` or ``x.narrow(0, 0, 1)``, which the report
# also tried. ``allow_unused=True`` silences the error and returns ``None``. Part 1, under the same
# message, has another cause: a parameter kept in a Python list.
net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3)).to(device)
batch = torch.randn(8, 4, device=device, requires_grad=True)
outputs, vectors = net(batch), torch.randn(8, 3, device=device)  # one v per sample
for part in (batch[0], batch.clone()[0], batch.narrow(0, 0, 1)):
    refuses(RuntimeError, "The differentiated Tensor at index 0 appears to not have been",
            torch.autograd.grad, outputs[0], part, vectors[0])  # fmt: skip

# %%
# The fixes, for one sample. Differentiate with respect to the tensor ``y`` was computed from,
# and keep that sample's row: correct, at the price of a backward pass through the whole batch,
# whose other rows come out as zeros. Or run the network on that sample alone under
# :func:`torch.func.vjp`, which needs no batch and no graph kept from before.
(through_batch,) = torch.autograd.grad(outputs[0], batch, vectors[0], retain_graph=True)
_, pull_back = vjp(net, batch[0].detach())
(sample_alone,) = pull_back(vectors[0])

# %%
# Or, in code you control, split the batch into rows before the forward and stack them:
# ``rows[0]`` is then in the graph (the backward still runs through the whole stacked batch).
# ``allow_unused=True`` is no fix: it returns ``None``. All
# three against each sample's Jacobian written by hand in float64,
# J = W₂ · diag(1 − tanh²(W₁x + b₁)) · W₁, and vᵀJ from it.
rows = batch.detach().requires_grad_().unbind(0)  # rows made before the forward
(before_forward,) = torch.autograd.grad(net(torch.stack(rows))[0], rows[0], vectors[0])
unused = torch.autograd.grad(outputs[0], batch[0], vectors[0], allow_unused=True)
assert unused == (None,), f"allow_unused=True gave {unused}, not None: no fix"
first, last = net[0].weight.detach().double(), net[2].weight.detach().double()
first_bias = net[0].bias.detach().double()


def jacobian_by_hand(x):
    slope = 1 - torch.tanh(first @ x.double() + first_bias).square()
    return last @ (slope[:, None] * first)


exact_jacobians = torch.stack([jacobian_by_hand(x) for x in batch.detach()])  # fmt: skip
exact_vjps = torch.einsum("bo,boi->bi", vectors.double(), exact_jacobians)
within("row 0 of autograd.grad(y[0], x, v)", through_batch[0], exact_vjps[0], 1e-6)
assert not through_batch[1:].any(), "y[0] should depend on x[0] alone"
within("vjp(net, x[0]), then v", sample_alone, exact_vjps[0], 1e-6)
within("rows taken before the forward", before_forward, exact_vjps[0], 1e-6)

# %%
# For every sample at once, each with its own ``v``: ``vmap`` of the one-sample ``vjp``, or one
# ``torch.autograd.grad(y, x, v)`` on the graph you have. Row b of ``y`` depends on row b of
# ``x`` alone, so the gradient of Σ_b v_bᵀ y_b has vᵀJ of sample b in row b: the sum trick of
# :doc:`../jacobians_and_curvature/plot_batch_jacobians_hessians`, wrong as soon as one sample's
# output depends on another's input (that page centres a batch by its mean; ``BatchNorm`` in
# training mode does the same). For each sample's whole Jacobian: ``vmap(jacrev(net))``.


def one_sample_vjp(x, v):
    return vjp(net, x)[1](v)[0]


every = vmap(one_sample_vjp)(batch.detach(), vectors)
within("vmap(vjp), each sample", every, exact_vjps, 1e-6)
(summed,) = torch.autograd.grad(outputs, batch, vectors)
within("autograd.grad(y, x, v), each row", summed, exact_vjps, 1e-6)
within("vmap(jacrev(net)), each Jacobian", vmap(jacrev(net))(batch.detach()), exact_jacobians,
       1e-6)  # fmt: skip

# %%
# Cannot access data pointer of Tensor that doesn't have storage: .numpy() inside grad
# -------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``.detach().numpy()`` inside a function under ``grad``: to log a value,
# or, in pytorch#91810, to send a sampled action to a simulator (below). Inside ``grad``, the
# tensors the function makes, from the input or not, are wrappers that carry the derivative, and
# ``.detach()`` returns another wrapper; ``.numpy()`` asks for a plain tensor's memory, which a
# wrapper has none of (a tensor closed over from outside is plain). ``np.asarray`` of a tensor that
# requires grad stops one step earlier, asking for the ``.detach()`` that then fails. ``.item()``
# and ``.tolist()`` run under ``grad``, but not under ``vmap``.
features = torch.randn(16, 5, dtype=torch.float64, device=cpu)
targets = torch.randn(16, dtype=torch.float64, device=cpu)
weights = torch.randn(5, dtype=torch.float64, device=cpu)
logged = []


def mse(w, log):  # log: what the function does with its predictions, to log them
    predictions = features @ w
    logged.append(log(predictions))
    return (predictions - targets).square().mean()


refuses(RuntimeError, "Cannot access data pointer of Tensor that doesn't have storage",
        grad(mse), weights, lambda predictions: predictions.detach().numpy())  # fmt: skip
refuses(RuntimeError, "Can't call numpy() on Tensor that requires grad",
        grad(mse), weights, np.asarray)  # fmt: skip
wrapped = (
    lambda p: p,
    lambda p: p.detach(),
    lambda p: torch.zeros(3),
    lambda p: targets,
)
grad(mse)(weights, lambda p: [is_gradtrackingtensor(make(p)) for make in wrapped])
assert logged[-1] == [True, True, True, False], logged[-1]
grad(mse)(weights, lambda predictions: predictions.tolist())
assert logged[-1] == (features @ weights).tolist(), "tolist() under grad: other values"
print(
    f"  .tolist() under grad: {len(logged[-1])} floats, equal to the predictions outside"
)

# %%
# The fix: return the value beside the loss, with ``has_aux=True``. ``grad`` then returns
# ``(gradient, value)``, and the value comes out of the transform as an ordinary tensor, ready
# for ``.detach().cpu().numpy()``. Under ``vmap(grad(..., has_aux=True))`` it comes out with one
# row per sample. References: the gradient of the mean squared error, 2Xᵀ(Xw − t)/n, and per
# sample 2(xᵀw − t)x, by hand; the predictions computed outside.


def mse_and_predictions(w):
    predictions = features @ w
    return (predictions - targets).square().mean(), predictions


gradient, predictions = grad(mse_and_predictions, has_aux=True)(weights)
as_array = predictions.detach().cpu().numpy()
assert isinstance(as_array, np.ndarray) and np.array_equal(as_array, features @ weights)
by_hand = 2 * features.T @ (features @ weights - targets) / len(targets)
within("gradient beside the logged array", gradient, by_hand, 1e-15)


def squared_error(w, x, t):  # one sample; its residual logged
    residual = x @ w - t
    return residual.square(), residual


per_sample_grad = vmap(grad(squared_error, has_aux=True), in_dims=(None, 0, 0))
gradients, residuals = per_sample_grad(weights, features, targets)
print(f"  under vmap: residuals {tuple(residuals.shape)}, one per sample")
assert np.array_equal(residuals.numpy(), (features @ weights - targets).numpy())
within("per-sample gradients", gradients, 2 * residuals[:, None] * features, 1e-15)


def squared_error_logged(w, x, t):  # one sample; the residual logged with .item()
    residual = x @ w - t
    logged.append(residual.item())
    return residual.square()


grad(squared_error_logged)(weights, features[0], targets[0])
assert logged[-1] == (features[0] @ weights - targets[0]).item(), logged[-1]
refuses(RuntimeError, "vmap: It looks like you're either (1) calling .item() on a",
        vmap(grad(squared_error_logged), in_dims=(None, 0, 0)),
        weights, features, targets)  # fmt: skip
refuses(RuntimeError, "Cannot access data pointer of Tensor that doesn't have storage",
        vmap(lambda x: x.tolist()), features)  # fmt: skip

# %%
# When the NumPy value is needed inside the function, as in the report (a sampled action sent
# to a simulator written in NumPy, whose reward then scales the loss), ``has_aux`` comes too
# late. Two ways out: ``np.array(action.tolist())`` inside ``grad``; or sample and step outside
# ``grad`` and pass the action and reward in, the usual shape of a policy-gradient step (neither
# is differentiated). Both against the closed form of −R ∇ log π(a), −R (onehot(a) − π) sᵀ, for a
# linear softmax policy π = softmax(W s) in state s.
policy, state = torch.randn(3, 5, dtype=torch.float64), features[0]


def simulator(action):  # NumPy, as an environment's step would be
    return float(np.cos(action) + 2.0)


def sampled_inside(w, to_numpy):
    dist = Categorical(logits=w @ state)
    action = dist.sample()
    return -simulator(to_numpy(action)) * dist.log_prob(action), action


refuses(RuntimeError, "Cannot access data pointer of Tensor that doesn't have storage",
        grad(sampled_inside, has_aux=True), policy, lambda a: a.detach().numpy())  # fmt: skip
torch.manual_seed(7)
inside, action = grad(sampled_inside, has_aux=True)(
    policy, lambda a: np.array(a.tolist())
)
torch.manual_seed(7)  # the same draw, outside
action_outside = Categorical(logits=policy @ state).sample()
reward = simulator(action_outside.numpy())
outside = grad(
    lambda w: -reward * Categorical(logits=w @ state).log_prob(action_outside)
)
assert action == action_outside, (action, action_outside)
hot = F.one_hot(action_outside, 3).double()
closed_form = -reward * torch.outer(hot - (policy @ state).softmax(0), state)
within("sampled inside grad, np.array(a.tolist())", inside, closed_form, 1e-15)
within("sampled and stepped outside grad", outside(policy), closed_form, 1e-15)

# %%
# Expected primal to be floating point or complex, but got: torch.int64
# ----------------------------------------------------------------------
# A ``ValueError`` from ``jvp`` when a primal is an integer tensor, whatever the tangent's dtype.
# pytorch#154302 passed atom types, atom counts and each atom's graph with ``zeros_like`` tangents;
# as integer tensors, 2.13 refuses them. Forward mode pairs each input with a tangent, a direction
# in which it changes, and ``jvp`` accepts that only for floating-point and complex inputs. ``jvp``
# has no ``argnums``: close over the integer inputs, and pass primals and tangents for the
# floating-point inputs only. A stand-in for the report's model: per graph, the sum over its atoms
# of a weight for the atom's species times ‖Cp‖², C the graph's cell, p the position.
GRAPHS, ATOMS = 3, 10
species_weight = torch.tensor([1.0, 0.5, 2.0], **double)


def graph_energies(cells, positions, species, graph_of_atom):
    scaled = torch.einsum("aij,aj->ai", cells[graph_of_atom], positions)
    per_atom = species_weight[species] * scaled.square().sum(-1)
    return per_atom.new_zeros(GRAPHS).index_add(0, graph_of_atom, per_atom)


cells = torch.eye(3, **double) + 0.2 * torch.randn(GRAPHS, 3, 3, **double)
positions = torch.randn(ATOMS, 3, **double)
species = torch.randint(3, (ATOMS,), device=device)
graph_of_atom = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2], device=device)
cell_direction, no_move = torch.randn_like(cells), torch.zeros_like(positions)
integers = (species, graph_of_atom)
for make_tangent in (torch.zeros_like, lambda t: torch.zeros(t.shape, **double)):
    refuses(ValueError, "Expected primal to be floating point or complex, but got: torch",
            jvp, graph_energies, (cells, positions, *integers),
            (cell_direction, no_move, *map(make_tangent, integers)))  # fmt: skip


def energies_of(cells, positions):  # the integer inputs closed over
    return graph_energies(cells, positions, species, graph_of_atom)


energies, along_cells = jvp(energies_of, (cells, positions), (cell_direction, no_move))

# %%
# The reference, by hand: along C + tD and p + tq, the derivative of ‖Cp‖² at t = 0 is
# 2 (Cp)·(Dp + Cq), weighted by species and summed by graph, one atom at a time.


def derivative_by_hand(cell_tangent, position_tangent):
    want = torch.zeros(GRAPHS, **double)
    for atom in range(ATOMS):
        g, p, q = graph_of_atom[atom], positions[atom], position_tangent[atom]
        move = cell_tangent[g] @ p + cells[g] @ q
        want[g] += species_weight[species[atom]] * 2 * (cells[g] @ p) @ move
    return want


within("jvp along the cells, integers closed over", along_cells,
       derivative_by_hand(cell_direction, no_move), 2e-15)  # fmt: skip
position_direction = torch.randn_like(positions)
_, along_both = jvp(
    energies_of, (cells, positions), (cell_direction, position_direction)
)
within("jvp along cells and positions", along_both,
       derivative_by_hand(cell_direction, position_direction), 2e-15)  # fmt: skip

# %%
# (No error) jvp's answer changes with the tangent: it is J·v, linear in v
# ------------------------------------------------------------------------
# The second thing ``jvp`` returns is the derivative along the tangent you pass, J·v, J the
# Jacobian at the primals: another tangent gives another answer. ``ones_like`` is not "the
# gradient" but the derivative along the all-ones direction, the sum of J's columns. The answer
# is linear in the tangent, and a zero tangent for an input holds that input fixed; the first
# thing returned, f at the primals, does not depend on the tangent. References: the derivative
# by hand, and J from :func:`torch.func.jacrev` (reverse mode, another route) times the tangent.
ones = torch.ones_like(cells)
value_again, along_ones = jvp(energies_of, (cells, positions), (ones, no_move))
within("f(primals) from jvp, against a direct call", energies,
       energies_of(cells, positions), 1e-15)  # fmt: skip
within("f(primals), another tangent", value_again, energies, 1e-15)
within("jvp along ones_like", along_ones, derivative_by_hand(ones, no_move), 5e-16)
full_jacobian = jacrev(energies_of)(cells, positions).reshape(GRAPHS, -1)  # (3, 27)
within("J·(all ones) from jacrev: the sum of J's columns", along_ones, full_jacobian.sum(1),
       1e-15)  # fmt: skip
within("J·D from jacrev", along_cells, full_jacobian @ cell_direction.flatten(), 1e-15)
mixed = 2.0 * cell_direction - 3.0 * ones
_, along_mixed = jvp(energies_of, (cells, positions), (mixed, no_move))
within("linear: jvp(2D − 3·ones) = 2 jvp(D) − 3 jvp(ones)", along_mixed,
       2.0 * along_cells - 3.0 * along_ones, 1e-15)  # fmt: skip

# %%
# The picture: the first graph's energy along the line C + tD, and the straight line whose
# slope ``jvp`` returned at t = 0, for the two tangents above: two directions, two slopes.
steps = torch.linspace(-0.6, 0.6, 41, **double)
fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), layout="constrained", sharey=True)
for ax, (name, direction, slopes) in zip(
    axes, [("a random D", cell_direction, along_cells), ("ones_like", ones, along_ones)]
):
    moved = vmap(lambda t, d=direction: energies_of(cells + t * d, positions)[0])(steps)
    ax.plot(steps.cpu(), moved.cpu(), color="0.55", label="energy along the line")
    ax.plot(steps.cpu(), (energies[0] + steps * slopes[0]).cpu(), linestyle="--",
            color=METHOD_COLORS["func.jvp"], label="slope from jvp at t = 0")  # fmt: skip
    ax.plot([0], [energies[0].item()], "o", color="black")
    ax.set(title=f"tangent: {name}; jvp = {slopes[0].item():.2f}", xlabel="t")
axes[0].set_ylabel("energy of graph 0 at C + t·tangent")
axes[1].legend(loc="upper left", fontsize=8)
plt.show()

# %%
# What one sample costs
# ---------------------
# The first section's routes, on a larger batch through a wider network of the same shape,
# timed with ``torch.utils.benchmark`` on all threads after a warm-up: the median and the
# interquartile range (IQR). For one sample, the batch's forward has run already (you have
# ``y``), so only its backward is timed, keeping its graph (``retain_graph=True``) to run again;
# ``vjp`` on the sample runs its own forward. For every sample, both routes run the forward.
wide = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 16)).to(device)
big = torch.randn(2048, 64, device=device, requires_grad=True)
big_outputs, big_vectors = wide(big), torch.randn(2048, 16, device=device)
sizes = (
    "-".join(str(layer.in_features) for layer in wide[::2]) + f"-{wide[2].out_features}"
)
print(f"  batch {big.shape[0]}, network {sizes}, {torch.get_num_threads()} threads")


def one_wide_vjp(x, v):
    return vjp(wide, x)[1](v)[0]


routes = {
    "one sample, the batch's backward": lambda: torch.autograd.grad(
        big_outputs[0], big, big_vectors[0], retain_graph=True),
    "one sample, vjp on it alone": lambda: vjp(wide, big[0].detach())[1](big_vectors[0]),
    "every sample, forward then autograd.grad(y, x, v)": lambda: torch.autograd.grad(
        wide(big), big, big_vectors),
    "every sample, vmap(vjp)": lambda: vmap(one_wide_vjp)(big.detach(), big_vectors),
}  # fmt: skip
timings = {}
for label, run in routes.items():
    run()  # warm-up
    timer = Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    t = timings[label] = timer.blocked_autorange(min_run_time=0.3)
    spread = f"IQR {t.iqr * 1e3:.3f} ms, {len(t.times)} blocks"
    print(f"  {label}: {t.median * 1e3:.3f} ms ({spread})")
one, alone, every_row, every_vmap = (timings[label].median for label in routes)
print(f"  one sample: the batch's backward takes {one / alone:.1f}x the time of vjp")
print(
    f"  every sample: vmap(vjp) takes {every_vmap / every_row:.1f}x the time of forward + grad"
)

# %%
# What to remember
# ----------------
# - ``x[0]`` is a new tensor, made after ``y``: "not used in the graph". Differentiate with
#   respect to ``x`` and keep row 0, or run ``vjp`` on the sample alone; for every sample,
#   ``vmap`` of the one-sample ``vjp``, or ``torch.autograd.grad(y, x, v)`` while no layer mixes
#   samples.
# - Inside ``grad`` tensors are wrappers with no memory of their own: no ``.numpy()``, even
#   after ``.detach()``. To log a value, return it with ``has_aux=True`` and convert it outside;
#   for a value needed inside (a simulator's input), ``np.array(t.tolist())``, or sample and
#   step outside ``grad``. ``.item()`` and ``.tolist()`` run under ``grad``, not under ``vmap``.
# - ``jvp`` takes floating-point or complex primals only: close over integer inputs (atom types,
#   indices) and pass tangents for the rest.
# - ``jvp`` returns f and J·v for *your* v: linear in v, so another tangent gives another answer;
#   for all of J, ``jacrev`` or ``jacfwd``.
