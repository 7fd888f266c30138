"""
Meta-learning (MAML) on an ordinary ``nn.Module``
=================================================

Model-agnostic meta-learning (MAML, Finn et al. 2017) looks for starting weights from which a
few gradient steps on a handful of points fit a new task. This page writes MAML's inner loop
with ``grad`` and ``functional_call``, maps it over tasks with ``vmap``, differentiates through
it to second or first order, checks it against a float64 loop, trains on sine waves against a
baseline, adapts only the last layer, and measures time and memory.
"""

# %%
# Setup
# -----
import copy
import itertools
import json
import tempfile
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.profiler import ProfilerActivity, profile
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


params, meta_grads = dict(model.named_parameters()), {}
(check_tasks, _), CHECK_STEPS = sample_tasks(8), 3
for first_order in (False, True):
    loss = meta_loss(params, check_tasks, CHECK_STEPS, first_order)
    meta_grads[first_order] = dict(
        zip(params, torch.autograd.grad(loss, params.values()))
    )


# %%
# Check: every parameter's meta-gradient against a float64 loop
# --------------------------------------------------------------
# The reference shares no code path with the recipe: a float64 copy of the module, its layers
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


def flat(grads):
    return torch.cat([g.flatten() for g in grads.values()])


def rel_errs(got, want):
    """Each parameter's error, over the norm of the whole reference meta-gradient."""
    scale = flat(want).norm()
    return {n: ((got[n].double() - w).norm() / scale).item() for n, w in want.items()}


# %%
# Each parameter's error is measured against the whole meta-gradient's norm, not its own: the
# scalar ``4.bias``'s meta-gradient can be small (on some seeds), and rounding in the larger
# terms it sums is large next to it. The bound sits several times above the largest error we
# saw when repeating this check over many seeds.
BOUND = 1e-6  # about 8 float32 epsilons: float32 against float64, three inner steps
for first_order, order in [(False, "second order"), (True, "first order")]:
    reference = reference_meta_grads(check_tasks, CHECK_STEPS, not first_order)
    for name, error in rel_errs(meta_grads[first_order], reference).items():
        print(f"{order:12s} {name:8s} error {error:.1e} (bound {BOUND:.0e}, "
              f"margin {BOUND / error:.1f}x)")  # fmt: skip
        assert error < BOUND, f"{order} {name}: relative error {error:.1e}"

# %%
# The two orders must differ, or a recipe that silently drops the second-order terms would
# pass both checks. Compared as whole vectors (one parameter's share can be small), the
# first-order meta-gradient is this far from the second-order one:
second, first = flat(meta_grads[False]), flat(meta_grads[True])
apart = ((first - second).norm() / second.norm()).item()
print(f"first order vs second order: {apart:.2f} relative difference (bound 0.05)")
assert apart > 0.05, f"the two orders agree to {apart:.1e}"

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
step_counts, test_losses = list(range(11)), {method: [] for method in starts}
with torch.no_grad():  # evaluation; torch.func.grad still runs inside
    for (method, start), steps in itertools.product(starts.items(), step_counts):
        per_task = vmap(partial(task_loss, steps=steps), in_dims=(None, 0, 0, 0, 0))
        test_losses[method].append(per_task(start, *test_tasks))
for method, losses in test_losses.items():
    at_train = losses[TRAIN_STEPS]
    q1, q2, q3 = at_train.quantile(torch.tensor([0.25, 0.5, 0.75], device=device))
    print(f"{method:14s} query MSE after {TRAIN_STEPS} steps: mean {at_train.mean():.3f} "
          f"(std {at_train.std():.3f}), median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f}; "
          f"before adapting {losses[0].mean():.3f}")  # fmt: skip
gap = test_losses["joint training"][TRAIN_STEPS] - test_losses["MAML"][TRAIN_STEPS]
gap_before = test_losses["joint training"][0] - test_losses["MAML"][0]
for when, diff in [("before adapting", gap_before), ("after adapting", gap)]:
    stderr = diff.std() / len(diff) ** 0.5
    side = "above" if diff.mean() > 0 else "below"
    print(f"baseline minus MAML {when}, per task: mean {diff.mean():.3f}, standard error "
          f"{stderr:.3f} ({abs(diff.mean()) / stderr:.1f} standard errors {side} zero); "
          f"MAML lower on {(diff > 0).float().mean():.0%} of the tasks")  # fmt: skip
assert gap.mean() > 5 * stderr, f"MAML not clearly ahead: {gap.mean():.3f}"
assert gap_before.mean() < 0.2 * gap.mean(), "MAML's start was already far ahead"
assert test_losses["MAML"][1].mean() < test_losses["MAML"][0].mean(), "no step ran"

# %%
# Before adapting, MAML's start is at most a little ahead of the baseline's (printed above;
# the assertion bounds that lead at a fifth of MAML's lead after adapting): it is a
# start from which a few small steps go further. The left panel shows the held-out task on
# which MAML's loss is the median: its support points, the truth, and each network before
# (dashed) and after (solid) its inner steps. The right panel shows the mean query loss
# against the number of inner steps; MAML trained with the number at the dotted line.
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
ax_task.set(title="MAML's median held-out task (dashed: before adapting)", xlabel="x")
fig.legend(*ax_task.get_legend_handles_labels(), loc="outside lower left", ncols=4)
ax_steps.axvline(TRAIN_STEPS, color="black", linestyle=":", linewidth=1)
ax_steps.set(title="1000 held-out tasks", xlabel="inner SGD steps on the support points",
             ylabel="mean query MSE after adapting")  # fmt: skip
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
# step only the head. At the trained weights, where this check runs, the errors came out
# larger than at the start, so its bound is looser.
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
for name, error in rel_errs(head_grads, reference).items():
    print(f"head-only inner loop, {name:8s}: error {error:.1e} (bound {HEAD_BOUND:.0e}, "
          f"margin {HEAD_BOUND / error:.1f}x)")  # fmt: skip
    assert error < HEAD_BOUND, f"head only, {name}: relative error {error:.1e}"


# %%
# What does not compose: BatchNorm's running statistics, ``torch.autograd.grad``
# -------------------------------------------------------------------------------
# In training mode a BatchNorm layer updates its running statistics in place, which the
# transforms refuse (:ref:`pitfalls <sphx_glr_auto_examples_guides_plot_pitfalls.py>` shows the
# errors and compares the remedies). Drop the running statistics
# (:func:`~torch.func.replace_all_batch_norm_modules_`, or ``track_running_stats=False``), so
# that each task is normalised by its own support points' batch statistics, or use
# ``GroupNorm``. Checked: each task's inner gradient against plain autograd on that task alone.
norm_net = nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
torch.func.replace_all_batch_norm_modules_(norm_net.to(device))
norm_params, (xs, ys), errors = dict(norm_net.named_parameters()), check_tasks[:2], []
fit_norm = grad(lambda w, x, y: F.mse_loss(functional_call(norm_net, w, (x,)), y))
batched = vmap(fit_norm, in_dims=(None, 0, 0))(norm_params, xs, ys)
for i, (x, y) in enumerate(zip(xs, ys)):
    want = torch.autograd.grad(F.mse_loss(norm_net(x), y), norm_params.values())
    got = {name: g[i] for name, g in batched.items()}
    errors += rel_errs(got, dict(zip(norm_params, want))).values()
print(f"BatchNorm without running statistics, {len(xs)} tasks: largest error "
      f"{max(errors):.1e} (bound 1e-06, margin {1e-6 / max(errors):.1f}x)")  # fmt: skip
assert max(errors) < 1e-6, errors


# %%
# Written with ``torch.autograd.grad`` on the module's own parameters, as the reference above,
# the inner step runs on one task but not under ``vmap``: there the loss reports no autograd
# history (printed) and ``torch.autograd.grad`` raises the error below. ``torch.func.grad`` is
# a transform that composes with ``vmap``; ``torch.autograd.grad`` is not. (pytorch#47378's
# internal assert in 2020 was traced by a maintainer to advanced indexing, a separate problem.)
def autograd_step(x_s, y_s, label):
    weights = list(model.parameters())
    loss = F.mse_loss(by_hand(weights, x_s), y_s)
    history = loss.grad_fn and loss.grad_fn.name()
    print(f"{label}: loss.requires_grad={loss.requires_grad}, grad_fn={history}")
    return torch.autograd.grad(loss, weights, create_graph=True)


autograd_step(check_tasks[0][0], check_tasks[1][0], "one task")
try:
    vmap(autograd_step, in_dims=(0, 0, None))(*check_tasks[:2], "under vmap")
    raise AssertionError("torch.autograd.grad ran under vmap")
except RuntimeError as raised:
    assert "does not require grad and does not have a grad_fn" in str(raised), raised
    print(f"RuntimeError: {raised}")

# %%
# Cost: ``vmap`` over tasks against a loop
# ----------------------------------------
# One meta-gradient at the training settings, three ways: a Python loop over the tasks calling
# the same ``task_loss``, and ``vmap`` over them, to second and first order. The
# :class:`~torch.utils.benchmark.Timer` reports the median and IQR over blocks.
timing_tasks, _ = sample_tasks(META_BATCH)


def loop_meta_grad():
    one = partial(task_loss, steps=TRAIN_STEPS)
    loss = sum(one(params, *task) for task in zip(*timing_tasks)) / META_BATCH
    return torch.autograd.grad(loss, params.values())


def vmap_meta_grad(first_order=False, tasks=timing_tasks, steps=TRAIN_STEPS):
    loss = meta_loss(params, tasks, steps, first_order)
    return torch.autograd.grad(loss, params.values())


def timed(fn):
    fn()  # warm-up
    cores = torch.get_num_threads()
    clock = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=cores)
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
# tensors. First order skips the backward through the inner gradients, which is where the
# second-order terms come from.
#
# Memory is the other cost (learn2learn#331 worries about it). Second order keeps every inner
# step's graph for the outer backward; first order keeps little beyond the adapted weights. Like
# the loop above, ``vmap`` keeps every task's graph until the backward; a loop calling
# ``backward`` per slice of tasks keeps one slice's. The peak of one meta-gradient above what
# was live before comes on a GPU from the CUDA allocator's requested bytes, on a CPU from
# :class:`torch.profiler.profile`, which records every allocation with the running total.
# First the tool on a known answer, a 1 MiB tensor:
def peak_mib(fn):
    if torch.cuda.is_available():  # the GPU's allocator: its peak of requested bytes
        torch.cuda.reset_peak_memory_stats()
        live = torch.cuda.memory_stats()["requested_bytes.all.current"]
        fn()
        return (torch.cuda.memory_stats()["requested_bytes.all.peak"] - live) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        fn()
    with tempfile.TemporaryDirectory() as scratch:
        recorded.export_chrome_trace(str(Path(scratch, "trace.json")))
        events = json.loads(Path(scratch, "trace.json").read_text())["traceEvents"]
    totals = [e["args"] for e in events if e.get("name") == "[memory]"]
    start = totals[0]["Total Allocated"] - totals[0]["Bytes"]  # what was live before
    return max(t["Total Allocated"] - start for t in totals) / 2**20


known = peak_mib(lambda: torch.empty(2**18, device=device))  # 2**18 float32s: 1 MiB
print(f"peak of allocating a 1 MiB tensor: {known:.3f} MiB")
assert known == 1.0, known
memory_tasks, peaks = sample_tasks(200)[0], {}
for steps, first_order in itertools.product((1, 4, 8), (False, True)):
    call = partial(vmap_meta_grad, first_order, memory_tasks, steps)
    peaks[steps, first_order] = peak = peak_mib(call)
    order = "first" if first_order else "second"
    print(f"200 tasks, {steps} inner steps, {order} order: peak {peak:.2f} MiB")
grows = {first: peaks[8, first] - peaks[1, first] for first in (False, True)}
print(f"from 1 to 8 inner steps the peak grows by {grows[False]:.2f} MiB (second order), "
      f"{grows[True]:.2f} MiB (first order)")  # fmt: skip
assert grows[False] > grows[True], grows

# %%
# What to remember
# ----------------
# * An inner loop is a Python ``for`` over SGD steps on a *dictionary* of parameters:
#   ``grad(loss)(params, x, y)`` of a loss that uses ``functional_call``, and a new dictionary
#   per step. The module's own parameters go in, so ordinary autograd and Adam do the outer loop.
# * Batch the tasks with ``vmap(task_loss, in_dims=(None, 0, 0, 0, 0))``; ``torch.autograd.grad``
#   cannot stand in for ``torch.func.grad`` there. Remove BatchNorm's running statistics.
# * Second order differentiates through the inner gradients; detaching them gives first order.
#   Check both against a float64 loop with ``create_graph=True`` and ``False``, and check that
#   they differ. Second order's peak memory grows with the inner steps; first order's far less.
# * To adapt a subset, pass it as ``grad``'s first argument and the rest as a second.
# * Compare against a baseline fine-tuned the same way, on many held-out tasks, with the spread:
#   MAML's start is for adapting, not for predicting before adapting.
