"""
Implicit differentiation: derivatives of a solver's answer
==========================================================

Many models contain a solver (an inner optimisation, a root). Backpropagating through its
iterations keeps them all, and differentiates the last iterate; the implicit function theorem
gives the derivative from the answer alone, with one linear solve. A Newton solver goes in a
:class:`torch.autograd.Function` whose backward solves that system by conjugate gradients, and
runs under :func:`~torch.func.grad`, :func:`~torch.func.vmap`, :func:`~torch.func.jacrev` and
reverse-over-reverse second order, each checked against unrolled float64 autograd. Then: what a
transformable solver avoids, implicit against unrolled, and a penalty tuned for eight tasks.
"""

# %%
# Setup
# -----
# Everything runs in float64, as solvers in scientific code usually do; the checks are tight.
import contextlib
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacrev, jvp, vjp, vmap
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"implicit": "#66A61E", "unrolled": "#663333"}

# %%
# The inner problem: logistic regression with an L2 penalty
# ---------------------------------------------------------
# A task has ``n`` training points with ``d`` features and 0/1 labels. The weights that minimise
# the training objective, ``w*(λ)``, depend on the penalty ``λ = exp(log_lam)`` and on the data.
# The outer question is how a *validation* loss at ``w*`` changes with ``log_lam`` (the
# hypergradient) and with the training points. Newton's method finds ``w*``: each step solves
# ``H Δ = g`` with the objective's gradient ``g`` and Hessian ``H``. It runs a fixed number of
# steps unless asked to stop on a tolerance, which needs a Python number (why that matters:
# below).
num_points, num_features = 40, 6


def training_objective(weights, log_lam, features, labels):
    logits = features @ weights
    data_term = (F.softplus(logits) - labels * logits).mean()
    return data_term + 0.5 * log_lam.exp() * weights.square().sum()


def stationarity(weights, log_lam, features, labels):  # zero at the answer w*
    return grad(training_objective)(weights, log_lam, features, labels)


def newton_solve(log_lam, features, labels, steps=10, stop_below=None):
    weights = features.new_zeros(features.shape[-1])
    for _iteration in range(steps):
        step_grad = stationarity(weights, log_lam, features, labels)
        if stop_below is not None and step_grad.norm().item() < stop_below:  # see below
            break
        step_hess = hessian(training_objective)(weights, log_lam, features, labels)
        weights = weights - torch.linalg.solve(step_hess, step_grad)
    return weights


def make_task(seed):
    gen = torch.Generator().manual_seed(seed)
    truth = torch.randn(num_features, generator=gen)
    features = torch.randn(2 * num_points, num_features, generator=gen)
    chance = torch.sigmoid(features @ truth)
    labels = (torch.rand(2 * num_points, generator=gen) < chance).to(features.dtype)
    halves = [t.to(device).split(num_points) for t in (features, labels)]
    (train_x, val_x), (train_y, val_y) = halves
    return train_x, train_y, val_x, val_y


features, labels, val_features, val_labels = make_task(seed=0)
log_lam = torch.tensor(-2.0, device=device)
solved = newton_solve(log_lam, features, labels)
residual = stationarity(solved, log_lam, features, labels).norm()
print(f"w* after 10 Newton steps: gradient norm {residual:.1e}")
assert residual < 1e-14


# %%
# The recipe: a Function whose backward solves one linear system
# --------------------------------------------------------------
# At the answer, ``g(w*, θ) = 0`` for every ``θ`` (here ``θ`` is ``log_lam`` and the data).
# Differentiating that identity gives ``H dw* = −(∂g/∂θ) dθ``. So a backward that receives
# ``v = ∂loss/∂w*`` solves ``H u = v`` (``H`` is symmetric) and returns ``−uᵀ ∂g/∂θ``, which is a
# vector-Jacobian product of ``g`` in ``θ`` at fixed ``w*``. Conjugate gradients solve ``H u = v``
# from Hessian-vector products without storing ``H`` (for six weights ``linalg.solve`` on the
# Hessian is simpler), here a fixed ``2d`` iterations (``d`` in exact arithmetic; with many weights
# fewer may do: check the residual once) with guarded divisions. CG needs ``H`` symmetric positive
# definite, as at a minimum; for a general root or fixed point, solve ``Jᵀu = v`` with a ``vjp`` of
# ``g`` as the product and a non-symmetric solver. Every transform requires ``setup_context`` (and a
# ``ctx``-free ``forward``); ``generate_vmap_rule = True`` is what ``vmap`` needs (``jacrev`` runs
# without it).
def conjugate_gradient(matvec, rhs, iterations):
    tiny = torch.finfo(rhs.dtype).tiny  # a guard that is not 0 in float32 either
    solution, residual = torch.zeros_like(rhs), rhs
    direction, res_sq = rhs, rhs @ rhs
    for _ in range(iterations):
        product = matvec(direction)
        alpha = res_sq / (direction @ product).clamp_min(tiny)
        solution = solution + alpha * direction
        residual = residual - alpha * product
        new_res_sq = residual @ residual
        direction = residual + new_res_sq / res_sq.clamp_min(tiny) * direction
        res_sq = new_res_sq
    return solution


def hessian_times(weights, log_lam, features, labels, vec):  # forward over the gradient
    return jvp(
        lambda w: stationarity(w, log_lam, features, labels), (weights,), (vec,)
    )[1]


class SolverArgmin(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(log_lam, features, labels):
        return newton_solve(log_lam, features, labels)

    @staticmethod
    def setup_context(ctx, solver_inputs, answer):
        ctx.save_for_backward(*solver_inputs, answer)

    @staticmethod
    def backward(ctx, grad_weights):
        log_lam, features, labels, weights = ctx.saved_tensors
        hess_vec = partial(hessian_times, weights, log_lam, features, labels)
        adjoint = conjugate_gradient(hess_vec, grad_weights, 2 * weights.shape[-1])
        _, pull_back = vjp(partial(stationarity, weights), log_lam, features, labels)
        return tuple(-part for part in pull_back(adjoint))


def loss_through(function):  # the validation loss at the answer that `function` returns
    def loss(log_lam, features, labels, val_features, val_labels):
        logits = val_features @ function.apply(log_lam, features, labels)
        return (F.softplus(logits) - val_labels * logits).mean()

    return loss


validation_loss = loss_through(SolverArgmin)


task = (features, labels, val_features, val_labels)
hypergrad = grad(validation_loss)(log_lam, *task)


# %%
# The check: backpropagation through a long solve, and finite differences
# ------------------------------------------------------------------------
# The first reference runs 30 Newton steps with ordinary autograd and backpropagates through all
# of them (no Function, no conjugate gradients). Once Newton has converged, the derivative of
# its last step *is* ``−H⁻¹ ∂g/∂θ`` by a dense solve, so this checks the Function and the CG
# against the theorem by another route, and can agree to the last bit. The second reference,
# independent of the theorem, is a central difference of the validation loss, each side solved
# afresh.
def unrolled_loss(log_lam, features, labels, val_features, val_labels, steps=30):
    logits = val_features @ newton_solve(log_lam, features, labels, steps)
    return (F.softplus(logits) - val_labels * logits).mean()


def unrolled_grads(log_lam, *data, argnums=(0,), steps=30, order=1):
    inputs = [
        x.detach().requires_grad_(i in argnums) for i, x in enumerate((log_lam, *data))
    ]
    leaves = [inputs[i] for i in argnums]
    loss = unrolled_loss(*inputs, steps=steps)
    outs = torch.autograd.grad(loss, leaves, create_graph=order > 1)
    return outs if order == 1 else torch.autograd.grad(outs[0], leaves[0])


def assert_close(name, got, want, bound):
    error = (got - want).abs().max().item()
    print(f"{name:44s} max error {error:.1e} (bound {bound:.0e})")
    assert error <= bound, (name, error)


def central_difference(fn, at, step=1e-5):
    return (fn(at + step) - fn(at - step)) / (2 * step)


(unrolled_hypergrad,) = unrolled_grads(log_lam, *task)
assert_close(f"hypergradient {hypergrad:.6f} vs unrolled", hypergrad, unrolled_hypergrad,
             1e-14)  # fmt: skip
by_difference = central_difference(lambda at: validation_loss(at, *task), log_lam)
assert_close("hypergradient vs central difference", hypergrad, by_difference, 1e-10)

# %%
# Under ``vmap``, ``jacrev`` and a second derivative
# --------------------------------------------------
# Eight tasks, each with its own data and its own ``log_lam``, take their hypergradients in one
# call: ``generate_vmap_rule`` runs ``forward`` and ``backward`` under ``vmap``, which is why the
# solver may not branch on its tensors. ``jacrev`` in the training features gives how the
# validation loss moves with every training entry, and ``jacrev`` of ``grad`` the second
# derivative in ``log_lam``, for which the outer transform differentiates the backward itself.
# Forward mode (``jvp``, ``jacfwd``, ``hessian``) needs a ``jvp`` staticmethod, not defined
# here (asserted; the :doc:`extending page <../guides/plot_extending_torch_func>` writes one).
num_tasks = 8
tasks = [torch.stack(parts) for parts in zip(*map(make_task, range(num_tasks)))]
log_lams = torch.linspace(-4.0, 0.0, num_tasks, device=device)
batched = vmap(grad(validation_loss))(log_lams, *tasks)
data_grads = jacrev(validation_loss, argnums=(1, 2))(log_lam, *task)  # features, labels
curvature = jacrev(grad(validation_loss))(log_lam, *task)
for t in range(num_tasks):
    (reference,) = unrolled_grads(log_lams[t], *(part[t] for part in tasks))
    assert_close(f"task {t}: vmap(grad) vs unrolled", batched[t], reference, 1e-14)
_, *unrolled_parts = unrolled_grads(log_lam, *task, argnums=(0, 1, 2))
for name, got, want in zip(
    ("features (40, 6)", "labels (40,)"), data_grads, unrolled_parts
):
    assert_close(f"jacrev in {name} vs unrolled", got, want, 1e-15)
(unrolled_curvature,) = unrolled_grads(log_lam, *task, order=2)
assert_close("second derivative vs unrolled", curvature, unrolled_curvature, 1e-13)
by_difference = central_difference(lambda at: grad(validation_loss)(at, *task), log_lam)
assert_close("second derivative vs central difference", curvature, by_difference, 1e-10)
both = jacrev(jacrev(lambda a: torch.stack([validation_loss(a, *task), a**2])))(log_lam)
twice = torch.stack([curvature, torch.ones_like(curvature) * 2])  # loss, log_lam²
assert_close("CG's guard: a zero cotangent, twice", both, twice, 1e-12)
tiny = grad(lambda a: 1e-8 * validation_loss(a, *task))(log_lam)
assert_close("hypergradient of 1e-8 × loss, × 1e8", 1e8 * tiny, hypergrad, 1e-14)
try:
    hessian(validation_loss)(log_lam, *task)
    raise AssertionError("forward mode ran without a jvp rule")
except NotImplementedError as no_jvp:
    assert str(no_jvp).startswith("You must implement the jvp function"), no_jvp


# %%
# What a transformable solver must avoid
# --------------------------------------
# A solver that stops when a residual is small asks a tensor for a Python number (``.item()``, an
# ``if``), and where it asks decides which transforms refuse. In ``forward`` (a Newton loop stopping
# on ``.item()``) it runs once per call, unbatched: ``grad`` and ``jacrev`` work, and ``vmap`` over
# tasks refuses. In ``backward`` (a CG stopping on ``.item()``, as in torchopt#223) it also runs
# under the ``vmap`` that ``jacrev`` puts around the backward, so ``jacrev`` refuses, unless given
# ``chunk_size=1``, which runs one row at a time without ``vmap`` (asserted). Run a fixed number of
# steps (or freeze converged entries with ``torch.where`` over a safe denominator).
def cg_until_converged(matvec, rhs, tol=1e-24, max_steps=100):
    solution, residual, direction = torch.zeros_like(rhs), rhs, rhs
    for _step in range(max_steps):
        if (residual @ residual).item() <= tol:
            break
        product = matvec(direction)
        alpha = (residual @ residual) / (direction @ product)
        solution = solution + alpha * direction
        new_residual = residual - alpha * product
        beta = (new_residual @ new_residual) / (residual @ residual)
        direction, residual = new_residual + beta * direction, new_residual
    return solution


class StoppingForward(SolverArgmin):
    @staticmethod
    def forward(log_lam, features, labels):
        return newton_solve(log_lam, features, labels, steps=50, stop_below=1e-12)


class StoppingBackward(SolverArgmin):
    @staticmethod
    def backward(ctx, grad_weights):
        log_lam, features, labels, weights = ctx.saved_tensors
        hess_vec = partial(hessian_times, weights, log_lam, features, labels)
        adjoint = cg_until_converged(hess_vec, grad_weights)
        _, pull_back = vjp(partial(stationarity, weights), log_lam, features, labels)
        return tuple(-part for part in pull_back(adjoint))


ITEM = "vmap: It looks like you're"  # then ".item()", in one of two wordings
for function, refused_by in ((StoppingForward, {"vmap(grad)"}),
                             (StoppingBackward, {"jacrev", "vmap(grad)"})):  # fmt: skip
    loss, outcome = loss_through(function), {}
    attempts = {"grad": (grad(loss), (log_lam, *task), hypergrad),
                "jacrev": (jacrev(loss), (log_lam, *task), hypergrad),
                "jacrev(chunk_size=1)": (jacrev(loss, chunk_size=1), (log_lam, *task), hypergrad),
                "vmap(grad)": (vmap(grad(loss)), (log_lams, *tasks), batched)}  # fmt: skip
    for name, (transformed, args, want) in attempts.items():
        try:
            assert_close(f"{function.__name__}, {name}", transformed(*args), want,
                         1e-14)  # fmt: skip
            outcome[name] = "works"
        except RuntimeError as item_refusal:
            said = str(item_refusal)
            assert said.startswith(ITEM) and "calling .item()" in said[:60], said
            outcome[name] = f"RuntimeError: {said[:52]}..."
    print(f"{function.__name__}: {outcome}")
    assert {name for name, said in outcome.items() if said != "works"} == refused_by


# %%
# Implicit or unrolled, for a solver that needs many steps
# --------------------------------------------------------
# Gradient descent (step ``1/L``, ``L`` a bound on the Hessian) needs tens of cheap steps where
# Newton needed a few: the kind of solver where unrolling keeps most. For ``k`` steps of it, both
# run under plain autograd, so that one tool measures what each keeps for the backward: a
# ``torch.autograd.graph.saved_tensors_hooks`` pack hook adding up the bytes of each distinct
# storage saved, checked on ``a * b`` (two), ``a * a`` and two halves of ``a`` (one). Times, without
# the hook, are medians of :class:`~torch.utils.benchmark.Timer` blocks after a warm-up.
def gradient_by_hand(weights, log_lam, features, labels):  # stationarity, written out
    residual = torch.sigmoid(features @ weights) - labels
    return features.T @ residual / len(features) + log_lam.exp() * weights


def descent_solve(log_lam, features, labels, steps):
    weights = features.new_zeros(features.shape[-1])
    spectral = torch.linalg.matrix_norm(features, 2)
    bound = spectral.square() / (4 * len(features)) + log_lam.exp()
    for _iteration in range(steps):
        weights = weights - gradient_by_hand(weights, log_lam, features, labels) / bound
    return weights


anywhere = torch.randn(num_features, device=device)  # not w*, where both are near zero
assert_close("gradient by hand vs stationarity", gradient_by_hand(anywhere, log_lam, *task[:2]),
             stationarity(anywhere, log_lam, *task[:2]), 1e-15)  # fmt: skip


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self):
        self.nbytes, self.storages = 0, set()
        super().__init__(self.pack, lambda kept: kept)

    def __enter__(self):
        super().__enter__()
        return self

    def pack(self, kept):
        storage = kept.untyped_storage()
        if storage.data_ptr() not in self.storages:
            self.storages.add(storage.data_ptr())
            self.nbytes += storage.nbytes()
        return kept


left, right = (torch.randn(1000, device=device, requires_grad=True) for _ in range(2))
KNOWN = {lambda: left * right: 2, lambda: left * left: 1,
         lambda: left[:500] * left[500:]: 1}  # fmt: skip
for product, storages in KNOWN.items():  # storages saved: two halves of one share it
    with SavedBytes() as probe:
        product()
    assert probe.nbytes == storages * 1000 * 8, probe.nbytes


def implicit_with(steps):
    class DescentArgmin(SolverArgmin):
        @staticmethod
        def forward(log_lam, features, labels):
            return descent_solve(log_lam, features, labels, steps)

    return DescentArgmin.apply


def unrolled_with(steps):
    return lambda *inputs: descent_solve(*inputs, steps)


def hypergrad_autograd(solver, probe=None):
    leaf = log_lam.detach().requires_grad_()
    with probe or contextlib.nullcontext():  # forward only: torch.func refuses hooks
        logits = val_features @ solver(leaf, features, labels)
        loss = (F.softplus(logits) - val_labels * logits).mean()
    return torch.autograd.grad(loss, leaf)[0]


steps_grid = (10, 20, 40, 160, 640)
errors, timings, kept = ({name: [] for name in METHOD_COLORS} for _ in range(3))
for steps in steps_grid:
    for name, make in (("implicit", implicit_with), ("unrolled", unrolled_with)):
        solver = make(steps)
        slope = hypergrad_autograd(solver, probe := SavedBytes())  # also the warm-up
        kept[name].append(probe.nbytes)
        errors[name].append((slope - unrolled_hypergrad).abs().item())
        timer = Timer("run(solver)", num_threads=torch.get_num_threads(),
                      globals={"run": hypergrad_autograd, "solver": solver})  # fmt: skip
        timings[name].append(timer.blocked_autorange(min_run_time=0.3))
    print(f"k={steps:3d}: " + ", ".join(
        f"{name} error {errors[name][-1]:.1e}, {timings[name][-1].median * 1e3:.1f} ms "
        f"(IQR {timings[name][-1].iqr * 1e3:.2g}), {kept[name][-1]:,} bytes saved"
        for name in METHOD_COLORS))  # fmt: skip
for at in (0, -1):
    slow, fast = sorted(METHOD_COLORS, key=lambda name: -timings[name][at].median)
    ratio = timings[slow][at].median / timings[fast][at].median
    print(f"at k={steps_grid[at]}: {slow} takes {ratio:.2g}x the time of {fast}")
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in task}
added = {name: kept[name][-1] - sum(storages.values()) for name in METHOD_COLORS}
print(f"at k={steps_grid[-1]}, beyond the task's data ({sum(storages.values()):,} bytes): "
      f"unrolled saves {added['unrolled']:,} bytes, implicit {added['implicit']:,}")  # fmt: skip
assert errors["implicit"][-1] < 1e-14 and errors["unrolled"][-1] < 1e-14
implicit_kept, unrolled_kept = kept["implicit"], kept["unrolled"]
assert implicit_kept[0] == implicit_kept[-1] < unrolled_kept[0] < unrolled_kept[-1]
assert 0 < added["implicit"] < added["unrolled"], added

fig, axes = plt.subplots(1, 3, figsize=(11, 3.3), layout="constrained")
panels = (errors, {k: [m.median * 1e3 for m in v] for k, v in timings.items()}, kept)
labels_y = ("|error| of the hypergradient", "median time (ms)", "bytes saved, distinct")
for ax, values, label in zip(axes, panels, labels_y):
    for name, colour in METHOD_COLORS.items():
        floored = [max(value, 1e-18) for value in values[name]]  # no zero on a log axis
        ax.plot(steps_grid, floored, "o-", color=colour, label=name)
    ax.set(xscale="log", yscale="log", xlabel="gradient-descent steps k", ylabel=label)
axes[0].set_title("against 30 Newton steps (0 drawn at 1e-18)")
axes[1].set(title=f"one hypergradient, {device.type.upper()}"), axes[0].legend()
plt.show()

# %%
# **Reading the numbers.** Before convergence neither is right (implicit was the closer). Then the
# implicit backward costs 12 products and a ``vjp`` at any ``k``; the unrolled one grows with it.

# %%
# Use it: tune the penalty of eight tasks at once
# -----------------------------------------------
# Newton's method on each task's ``log_lam``, with the first and second derivatives through the
# Function, all tasks in one ``vmap`` call each; where the curvature is not positive it takes a
# gradient step instead, and every step is clipped to ±1. The reference uses no derivative: the
# validation loss on a grid of 121 values of ``log_lam`` in [−8, 4] per task.
slope, bend = vmap(grad(validation_loss)), vmap(jacrev(grad(validation_loss)))
tuned = torch.full((num_tasks,), -2.0, device=device)
for _ in range(12):
    first, second = slope(tuned, *tasks), bend(tuned, *tasks)
    step = torch.where(second > 0, -first / second, -20 * first).clamp(-1.0, 1.0)
    tuned = (tuned + step).clamp(-8.0, 4.0)
final, first = vmap(validation_loss)(tuned, *tasks), slope(tuned, *tasks)
grid = torch.linspace(-8.0, 4.0, 121, device=device)
over_grid = vmap(validation_loss, in_dims=(0, None, None, None, None))
best = vmap(over_grid, in_dims=(None, 0, 0, 0, 0))(grid, *tasks).min(dim=1).values
for t in range(num_tasks):
    print(f"task {t}: log_lam {tuned[t]:+.2f}, loss {final[t]:.5f} (grid's best "
          f"{best[t]:.5f}), slope {first[t]:.1e}")  # fmt: skip
    assert final[t] <= best[t] + 1e-12, t
    assert first[t].abs() < 1e-10 or tuned[t] in (-8.0, 4.0), t

# %%
# What to remember
# ----------------
# * Differentiate a solver's answer with the implicit function theorem: save the answer, solve
#   ``H u = v`` in ``backward`` and return ``−uᵀ ∂g/∂θ`` with :func:`~torch.func.vjp`.
# * For ``grad``, ``vmap``, ``jacrev`` and reverse-mode second order, write the Function with a
#   ``ctx``-free ``forward``, a ``setup_context`` and ``generate_vmap_rule = True``, and build
#   ``backward`` from differentiable torch operations; forward mode also needs a ``jvp``.
# * Solvers inside run fixed step counts: no ``.item()``, ``if`` or ``while`` on a tensor (guard
#   divisions); ``vmap`` refuses them, and ``jacrev`` in ``backward`` unless ``chunk_size=1``.
# * The implicit derivative is only as good as the answer; check the residual, and check the
#   derivative once against unrolled autograd in float64 and a finite difference.
