"""
Meta-learning (MAML) on an ordinary ``nn.Module``
=================================================

Model-agnostic meta-learning (MAML, Finn et al. 2017) looks for starting weights from which a
few gradient steps on a handful of points fit a new task. This page writes MAML's inner loop
(any number of SGD steps on a dictionary of parameters) with ``grad`` and ``functional_call``,
maps it over a meta-batch of tasks with ``vmap``, and differentiates through it, to second or
to first order. It checks every parameter's meta-gradient against a float64 Python loop with
``torch.autograd.grad``, trains on sine waves against the same network trained on all tasks
jointly and then fine-tuned, adapts only the last layer, and times ``vmap`` over tasks against
a loop.
"""

# %%
# Setup
# -----
import copy
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"MAML": "#994455", "joint training": "#225555"}

# %%
# Tasks made on the fly
# ---------------------
# Each task is a sine wave ``a·sin(x − φ)`` with its own amplitude ``a`` in [0.1, 5] and phase
# ``φ`` in [0, π], sampled on [−5, 5]: the regression family of Finn et al. A task comes with
# ``K`` *support* points, the few the model may adapt on, and ``Q`` *query* points that score
# the adapted model. ``sample_tasks`` returns a meta-batch as four tensors with the tasks along
# the first dimension (support inputs and targets, query inputs and targets), and the waves. The
# network is an unmodified ``nn.Sequential`` with two hidden layers of 40 ReLU units; it and the
# sizes below (10 support points, inner step size 0.01) follow Finn et al.'s sine experiment.
K_SHOT, Q_POINTS, INNER_LR = 10, 10, 0.01


def sample_tasks(count, queries=Q_POINTS):
    amplitude = torch.empty(count, 1, 1, device=device).uniform_(0.1, 5.0)
    phase = torch.empty(count, 1, 1, device=device).uniform_(0.0, torch.pi)
    x = torch.empty(count, K_SHOT + queries, 1, device=device).uniform_(-5.0, 5.0)
    y = amplitude * torch.sin(x - phase)
    support, query = (x[:, :K_SHOT], y[:, :K_SHOT]), (x[:, K_SHOT:], y[:, K_SHOT:])
    return support + query, (amplitude, phase)


layers = [nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)]
model = nn.Sequential(*layers).to(device)


# %%
# The inner loop: any number of SGD steps on a dictionary
# -------------------------------------------------------
# (functorch#25 asks how to take a chosen number of inner steps.) :func:`~torch.func.grad` of a
# loss that runs the module through :func:`~torch.func.functional_call` returns the gradient as
# a dictionary shaped like the parameters. An SGD step builds a *new* dictionary, never writing
# into the module, so a Python ``for`` loop takes as many steps as asked, and every step stays
# differentiable. Detaching each inner gradient gives first-order MAML: the adapted weights
# still depend on the start (with an identity Jacobian), but the inner gradients count as
# constants, so no second derivative is taken.
def fit_loss(params, x, y):
    return F.mse_loss(functional_call(model, params, (x,)), y)


def adapt(params, x, y, steps, first_order=False):
    for _ in range(steps):
        grads = grad(fit_loss)(params, x, y)
        if first_order:
            grads = {name: g.detach() for name, g in grads.items()}
        params = {name: p - INNER_LR * grads[name] for name, p in params.items()}
    return params


def task_loss(params, x_s, y_s, x_q, y_q, steps, first_order=False):
    """Query loss of one task after ``steps`` SGD steps on its support points."""
    return fit_loss(adapt(params, x_s, y_s, steps, first_order), x_q, y_q)


# %%
# The meta-batch: ``vmap`` over tasks
# -----------------------------------
# (learn2learn#331 asks how to batch MAML's tasks.) One task's loss is a function of the
# weights and that task's four tensors; :func:`~torch.func.vmap` maps it over the tasks
# (``in_dims=0``) with the weights shared (``None``). The module's own parameters go in, so
# ordinary autograd, or an optimiser, differentiates the mean over the tasks: this is the
# meta-gradient. The step count and the order are Python values, bound with ``partial``.
def meta_loss(params, tasks, steps, first_order=False):
    one_task = partial(task_loss, steps=steps, first_order=first_order)
    return vmap(one_task, in_dims=(None, 0, 0, 0, 0))(params, *tasks).mean()


params = dict(model.named_parameters())
check_tasks, _ = sample_tasks(8)
CHECK_STEPS = 3
meta_grads = {}
for first_order in (False, True):
    loss = meta_loss(params, check_tasks, CHECK_STEPS, first_order)
    meta_grads[first_order] = dict(
        zip(params, torch.autograd.grad(loss, params.values()))
    )
print({name: tuple(g.shape) for name, g in meta_grads[False].items()})


# %%
# Check: every parameter's meta-gradient against a float64 loop
# --------------------------------------------------------------
# The reference shares no code with the recipe: a float64 copy of the module, its layers
# applied by hand with ``F.linear``, one task at a time in a Python loop, each inner step taken
# with ``torch.autograd.grad`` on the copy's own parameters. ``create_graph=True`` keeps the
# inner gradients differentiable (second order); ``create_graph=False`` returns them as
# constants (first order). ``adapted`` names the parameters the inner loop may change.
def by_hand(weights, x):
    for i in range(0, len(weights), 2):
        x = F.linear(x, weights[i], weights[i + 1])
        x = torch.relu(x) if i + 2 < len(weights) else x
    return x


def reference_meta_grads(tasks, steps, second_order, adapted=None):
    copy64 = copy.deepcopy(model).double()
    names, weights = zip(*copy64.named_parameters())
    moves = [adapted is None or name in adapted for name in names]
    total, count = 0.0, len(tasks[0])
    for x_s, y_s, x_q, y_q in zip(*(t.double() for t in tasks)):
        fast = list(weights)
        for _ in range(steps):
            loss = ((by_hand(fast, x_s) - y_s) ** 2).mean()
            chosen = [w for w, m in zip(fast, moves) if m]
            g = iter(torch.autograd.grad(loss, chosen, create_graph=second_order))
            fast = [w - INNER_LR * next(g) if m else w for w, m in zip(fast, moves)]
        total = total + ((by_hand(fast, x_q) - y_q) ** 2).mean() / count
    return dict(zip(names, torch.autograd.grad(total, weights)))


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


BOUND = 1e-6  # about 8 float32 epsilons: float32 against float64, three inner steps
for first_order, order in [(False, "second order"), (True, "first order")]:
    reference = reference_meta_grads(check_tasks, CHECK_STEPS, not first_order)
    for name, want in reference.items():
        error = rel_err(meta_grads[first_order][name], want)
        print(f"{order:12s} {name:8s} error {error:.1e} (bound {BOUND:.0e}, "
              f"margin {BOUND / error:.1f}x)")  # fmt: skip
        assert error < BOUND, f"{order} {name}: relative error {error:.1e}"

# %%
# The two orders must differ, or a recipe that silently drops the second-order terms would
# pass both checks. Per parameter, the first-order meta-gradient is this far from the
# second-order one:
for name, second in meta_grads[False].items():
    apart = rel_err(meta_grads[True][name], second.double())
    print(f"first order vs second order, {name:8s}: {apart:.2f} relative difference")
    assert apart > 0.05, f"{name}: the two orders agree to {apart:.1e}"

# %%
# Meta-training, and a baseline trained on all tasks jointly
# ----------------------------------------------------------
# MAML trains with Adam on the meta-loss of a fresh meta-batch per step, the inner loop taking
# ``TRAIN_STEPS`` SGD steps. ``params`` holds the module's own tensors, which Adam updates in
# place, so each meta-step sees the last one's weights. The baseline is the same network from
# the same start, trained by Adam for as many steps (each far cheaper) on the same kind of
# batches, as one regression over all their points: it learns the average task. At test time
# both get the same treatment: a few SGD steps on a new task's support points, at the same
# inner learning rate. Both train far fewer steps than in the paper, to keep this page fast.
META_STEPS, META_BATCH, TRAIN_STEPS = 300, 25, 3
baseline = copy.deepcopy(model)
maml_opt = torch.optim.Adam(model.parameters(), lr=3e-3)
joint_opt = torch.optim.Adam(baseline.parameters(), lr=3e-3)
for _ in range(META_STEPS):
    tasks, _ = sample_tasks(META_BATCH)
    maml_opt.zero_grad()
    meta_loss(params, tasks, TRAIN_STEPS).backward()
    maml_opt.step()
    x_all, y_all = torch.cat(tasks[0::2], 1), torch.cat(tasks[1::2], 1)
    joint_opt.zero_grad()
    F.mse_loss(baseline(x_all), y_all).backward()
    joint_opt.step()

# %%
# Held-out tasks
# --------------
# A thousand new tasks, each with its ten support points and fifty query points, are adapted
# from both starts with 0 to 10 inner steps. This runs under ``torch.no_grad``: nothing outside
# the inner loop needs gradients, and :func:`~torch.func.grad` computes its own even there (the
# loss falling with the steps shows it). The two methods see the same tasks, so the comparison
# is paired: per task, the baseline's query loss minus MAML's. The assertion asks that
# difference's mean to stand well clear of its standard error.
test_tasks, (test_amp, test_phase) = sample_tasks(1000, queries=50)
starts = {"MAML": params, "joint training": dict(baseline.named_parameters())}
step_counts = list(range(11))


@torch.no_grad()
def held_out_losses(start, steps):
    per_task = vmap(partial(task_loss, steps=steps), in_dims=(None, 0, 0, 0, 0))
    return per_task(start, *test_tasks)


test_losses = {
    method: [held_out_losses(start, steps) for steps in step_counts]
    for method, start in starts.items()
}
for method, losses in test_losses.items():
    at_train = losses[TRAIN_STEPS]
    q1, q2, q3 = at_train.quantile(torch.tensor([0.25, 0.5, 0.75], device=device))
    print(f"{method:14s} query MSE after {TRAIN_STEPS} steps: mean {at_train.mean():.3f} "
          f"(std {at_train.std():.3f}), median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f}; "
          f"before adapting {losses[0].mean():.3f}")  # fmt: skip
gap = test_losses["joint training"][TRAIN_STEPS] - test_losses["MAML"][TRAIN_STEPS]
stderr = gap.std() / len(gap) ** 0.5
print(f"baseline minus MAML, per task: mean {gap.mean():.3f}, standard error {stderr:.3f}, "
      f"{gap.mean() / stderr:.0f} standard errors above zero; MAML lower on "
      f"{(gap > 0).float().mean():.0%} of the tasks")  # fmt: skip
assert gap.mean() > 5 * stderr, (
    f"MAML is not clearly better: {gap.mean():.3f} ± {stderr:.3f}"
)
gap_before = test_losses["joint training"][0] - test_losses["MAML"][0]
print(f"the same difference before adapting: mean {gap_before.mean():.3f}")
assert gap_before.mean() < 0.2 * gap.mean(), "MAML's start was already far ahead"
assert test_losses["MAML"][1].mean() < test_losses["MAML"][0].mean(), (
    "no inner step ran"
)

# %%
# Before adapting, MAML's start predicts a new task little better, or no better, than the
# baseline's (the last line above; the assertion bounds it at a fifth of the advantage after
# adapting): it is a start from which a few small steps go further. The left panel shows the
# held-out task on which MAML's loss is the median: its support points, the truth, and each
# network before (dashed) and after (solid) its inner steps. The right panel shows the mean
# query loss against the number of inner steps; MAML trained with the number at the dotted line.
grid = torch.linspace(-5, 5, 200, device=device).view(-1, 1)
shown = test_losses["MAML"][TRAIN_STEPS].argsort()[len(gap) // 2]
x_s, y_s = test_tasks[0][shown], test_tasks[1][shown]
fig, (ax_task, ax_steps) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
truth = test_amp[shown, 0] * torch.sin(grid - test_phase[shown, 0])
ax_task.plot(grid.cpu(), truth.cpu(), color="black", label="truth")
ax_task.plot(x_s.cpu(), y_s.cpu(), "o", color="black", label="support points")
for method, start in starts.items():
    adapted = adapt(start, x_s, y_s, TRAIN_STEPS)
    for weights, style in [(start, "--"), (adapted, "-")]:
        curve = functional_call(model, weights, (grid,)).detach().cpu()
        label = f"{method}, {TRAIN_STEPS} steps" if style == "-" else None
        ax_task.plot(grid.cpu(), curve, style, color=METHOD_COLORS[method], label=label)
    means = [losses.mean().item() for losses in test_losses[method]]
    ax_steps.plot(step_counts, means, "o-", color=METHOD_COLORS[method], label=method)
ax_task.set_title("MAML's median held-out task (dashed: before adapting)")
ax_task.set_xlabel("x")
fig.legend(*ax_task.get_legend_handles_labels(), loc="outside lower left", ncols=4)
ax_steps.axvline(TRAIN_STEPS, color="black", linestyle=":", linewidth=1)
ax_steps.set_title("1000 held-out tasks")
ax_steps.set_xlabel("inner SGD steps on the support points")
ax_steps.set_ylabel("mean query MSE after adapting")
ax_steps.legend()
plt.show()

# %%
# Adapting only the last layer
# ----------------------------
# (functorch#64 asks how to run the inner loop on a subset of the parameters.) Split the
# dictionary: :func:`~torch.func.grad` differentiates its first argument only, so the inner
# loop steps the head, while the body rides along as a second argument. The outer gradient
# still reaches every parameter, the body's through the forward passes. Adapting only the head
# is the ANIL variant of Raghu et al. (2020). The reference is the same float64 loop, told to
# step only the head. The check runs at the trained weights, where the float32 errors came out
# a few times larger than at the start, so its bound is looser.
HEAD_BOUND = 3e-6
HEAD = ("4.weight", "4.bias")


def fit_split(head, body, x, y):
    return fit_loss({**body, **head}, x, y)


def head_task_loss(params, x_s, y_s, x_q, y_q, steps):
    head = {name: params[name] for name in HEAD}
    body = {name: p for name, p in params.items() if name not in HEAD}
    for _ in range(steps):
        grads = grad(fit_split)(head, body, x_s, y_s)
        head = {name: h - INNER_LR * grads[name] for name, h in head.items()}
    return fit_split(head, body, x_q, y_q)


head_only = vmap(partial(head_task_loss, steps=CHECK_STEPS), in_dims=(None, 0, 0, 0, 0))
loss = head_only(params, *check_tasks).mean()
head_grads = dict(zip(params, torch.autograd.grad(loss, params.values())))
reference = reference_meta_grads(check_tasks, CHECK_STEPS, True, adapted=HEAD)
for name, want in reference.items():
    error = rel_err(head_grads[name], want)
    print(f"head-only inner loop, {name:8s}: error {error:.1e} (bound {HEAD_BOUND:.0e}, "
          f"margin {HEAD_BOUND / error:.1f}x)")  # fmt: skip
    assert error < HEAD_BOUND, f"head only, {name}: relative error {error:.1e}"


# %%
# ``torch.autograd.grad`` inside ``vmap``
# ---------------------------------------
# (pytorch#47378.) Written with ``torch.autograd.grad`` on the module's own parameters, as the
# reference above, the inner step runs on one task but not under ``vmap``. In 2020 it failed
# with an internal assert; on this version it raises the error below, because inside ``vmap``
# the loss reports no autograd history (printed). ``torch.func.grad`` is a transform that
# composes with ``vmap``; ``torch.autograd.grad`` is not.
def autograd_step(x_s, y_s):
    weights = list(model.parameters())
    loss = F.mse_loss(by_hand(weights, x_s), y_s)
    history = loss.grad_fn.name() if loss.grad_fn else None
    print(f"  loss.requires_grad={loss.requires_grad}, grad_fn={history}")
    grads = torch.autograd.grad(loss, weights, create_graph=True)
    return by_hand([w - INNER_LR * g for w, g in zip(weights, grads)], x_s)


print("one task:")
autograd_step(check_tasks[0][0], check_tasks[1][0])
print("under vmap:")
try:
    vmap(autograd_step)(check_tasks[0], check_tasks[1])
    raise AssertionError("torch.autograd.grad ran under vmap")
except RuntimeError as raised:
    assert "does not require grad and does not have a grad_fn" in str(raised), raised
    print(f"RuntimeError: {raised}")

# %%
# Cost: ``vmap`` over tasks against a loop
# ----------------------------------------
# One meta-gradient at the training settings, three ways: a Python loop over the tasks calling
# the same ``task_loss``, and ``vmap`` over them, to second and to first order.
# :class:`torch.utils.benchmark.Timer` repeats each in blocks and reports the median and the
# interquartile range (IQR) over the blocks.
timing_tasks, _ = sample_tasks(META_BATCH)


def loop_meta_grad():
    one = partial(task_loss, steps=TRAIN_STEPS)
    loss = sum(one(params, *task) for task in zip(*timing_tasks)) / META_BATCH
    return torch.autograd.grad(loss, params.values())


def vmap_meta_grad(first_order=False):
    loss = meta_loss(params, timing_tasks, TRAIN_STEPS, first_order)
    return torch.autograd.grad(loss, params.values())


def timed(fn):
    fn()  # warm-up
    clock = benchmark.Timer(
        "fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    found = clock.blocked_autorange(min_run_time=0.4)
    while len(found.times) < 5:  # a busy machine fills fewer blocks
        found = benchmark.Measurement.merge([found, clock.timeit(1)])[0]
    return found


runs = {
    "loop, second order": timed(loop_meta_grad),
    "vmap, second order": timed(vmap_meta_grad),
    "vmap, first order": timed(partial(vmap_meta_grad, first_order=True)),
}
for name, m in runs.items():
    print(f"{name:18s} {m.median * 1e3:7.2f} ms (IQR {m.iqr * 1e3:.2f} ms, "
          f"{len(m.times)} blocks)")  # fmt: skip


def compare(slow, fast):
    ratio = runs[slow].median / runs[fast].median
    if ratio >= 1:
        return f"{slow} takes {ratio:.2f}x the time of {fast}"
    return f"{slow} is {1 / ratio:.2f}x faster than {fast}"


print(compare("loop, second order", "vmap, second order"))
print(compare("vmap, second order", "vmap, first order"))

# %%
# The loop runs every operation once per task; ``vmap`` runs it once for all tasks, on bigger
# tensors, so the gap probably grows with the meta-batch and on a GPU, where each operation also
# pays a kernel launch. First order skips the backward through the inner gradients, which is
# where the second-order terms come from. Memory is the other side (learn2learn#331 worries
# about it): like this loop, which sums the losses before one backward, ``vmap`` keeps every
# task's graph alive until the backward. A loop that calls ``backward`` per slice of tasks, each
# slice mapped with ``vmap``, keeps one slice's graph at a time and accumulates the gradients.

# %%
# What to remember
# ----------------
# * An inner loop is a Python ``for`` over SGD steps on a *dictionary* of parameters:
#   ``grad(loss)(params, x, y)`` of a loss that uses ``functional_call``, and a new dictionary
#   per step. The module's own parameters go in, so ordinary autograd and Adam do the outer loop.
# * Batch the tasks with ``vmap(task_loss, in_dims=(None, 0, 0, 0, 0))``; ``torch.autograd.grad``
#   cannot stand in for ``torch.func.grad`` under ``vmap``.
# * Second order differentiates through the inner gradients; detaching them gives first order.
#   Check both against a float64 loop with ``create_graph=True`` and ``False``, and check that
#   they differ.
# * To adapt a subset, pass it as ``grad``'s first argument and the rest as a second.
# * Compare against a baseline fine-tuned the same way, on many held-out tasks, with the spread:
#   MAML's start is for adapting, not for predicting before adapting.
