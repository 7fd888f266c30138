"""
``functional_call`` in practice: modes, buffers, optimisers and overhead
========================================================================

:func:`~torch.func.functional_call` runs an ordinary module with tensors you hand it. On a small
classifier with Dropout and BatchNorm, this page answers the questions users ask about it: does
it follow ``model.train()`` and ``model.eval()``, where do BatchNorm's running statistics go
(under ``grad`` and ``vjp`` too), how does a ``torch.optim`` optimiser take gradients from
:func:`~torch.func.grad`, and how does ``func.grad``'s time compare with ``loss.backward()``'s.
Each answer is checked; then the routes are timed, and the time ``func.grad`` adds over
``autograd.grad`` is split: the transform alone, ``functional_call``'s swap, a remainder. From
``make_functional``: :ref:`sphx_glr_auto_examples_guides_plot_functorch_migration.py`.
"""

# %%
# Setup
# -----
# Two linear layers with BatchNorm, ReLU and Dropout between them; named layers make readable keys.
import copy
from collections import OrderedDict

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vjp
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"module call": "#BB5566", "functional_call": "#009988",
                 "loss.backward()": "#4477AA", "autograd.grad": "#EE6677",
                 "func.grad": "#228833", "func.grad_and_value": "#CCBB44"}  # fmt: skip

FEATURES, WIDTH, CLASSES, DROP = 20, 64, 5, 0.25
model = nn.Sequential(OrderedDict(
    hidden=nn.Linear(FEATURES, WIDTH), norm=nn.BatchNorm1d(WIDTH), act=nn.ReLU(),
    drop=nn.Dropout(DROP), head=nn.Linear(WIDTH, CLASSES))).to(device)  # fmt: skip
inputs = torch.randn(32, FEATURES).to(device)
labels = torch.randint(0, CLASSES, (32,)).to(device)


def close_to(label, got, want, bound):
    error = ((got - want).norm() / want.norm()).item()
    margin = f"{bound / error:.0f}x margin" if error else "exact"
    print(f"{label}: relative error {error:.1e} (bound {bound:.0e}, {margin})")
    assert error < bound, f"{label}: relative error {error:.2e}"


# %%
# The recipe, checked against the module itself
# ----------------------------------------------
# ``functional_call(model, tensors, args, kwargs)`` runs ``model(*args, **kwargs)`` with the
# parameters and buffers named in ``tensors`` (one dict, or a tuple of dicts) standing in for the
# module's own, and puts the module's own back afterwards. Given the module's own tensors, it
# must reproduce ``model(inputs)``; given other tensors, the output of a copy that loaded them
# with ``load_state_dict``. Evaluation mode first, where the output is deterministic. (To train:
# ``grad_and_value``, then ``p.grad = g`` and ``optimiser.step()``, checked further down.)
model.eval()
own = {name: t.detach().clone() for name, t in model.state_dict().items()}  # a snapshot
by_dict = functional_call(model, own, (inputs,))
close_to("own tensors vs model(inputs)", by_dict, model(inputs).detach(), 1e-6)

other = {name: t + 0.3 * torch.randn_like(t) if name.endswith(("weight", "bias", "mean"))
         else t.clone() for name, t in own.items()}  # fmt: skip
other["norm.running_var"].uniform_(0.5, 2.0)
params = {name: other[name] for name, _ in model.named_parameters()}
loaded = copy.deepcopy(model)
loaded.load_state_dict(other)
by_dict = functional_call(model, other, (inputs,))
close_to("other tensors vs a loaded copy", by_dict, loaded(inputs).detach(), 1e-6)

# %%
# Modes: ``functional_call`` follows ``model.train()`` and ``model.eval()``
# -------------------------------------------------------------------------
# It has no mode argument: each layer reads its own ``training`` flag, which ``train()`` and
# ``eval()`` set, so one dict serves both modes. Forward hooks (they run under
# ``functional_call`` too) record what BatchNorm and Dropout received and returned, checked
# against closed forms: in evaluation mode BatchNorm normalises with the running statistics
# *passed in*, and Dropout returns its input.
seen = {}
hooks = [getattr(model, name).register_forward_hook(
    lambda layer, args, out, name=name: seen.update({name: (args[0], out)}))
    for name in ("norm", "drop")]  # fmt: skip


def batch_norm_by_hand(h, mean, var, state):
    scaled = (h - mean) / torch.sqrt(var + model.norm.eps)
    return scaled * state["norm.weight"] + state["norm.bias"]


functional_call(model, other, (inputs,))
h, normed = seen["norm"]
close_to("eval BatchNorm vs running statistics", normed, batch_norm_by_hand(
    h, other["norm.running_mean"], other["norm.running_var"], other), 1e-6)  # fmt: skip
assert torch.equal(*seen["drop"]), "eval-mode Dropout changed its input"

# %%
# In training mode BatchNorm normalises with the batch's own mean and *biased* variance, and
# Dropout zeroes each entry with probability ``p`` and scales the rest by ``1/(1-p)``. ReLU
# already zeroed about half its outputs, so the dropped fraction is counted among the others,
# on a larger batch, and compared with ``p`` within four binomial standard errors.
model.train()
functional_call(model, copy.deepcopy(other), (torch.randn(2048, FEATURES).to(device),))
h, normed = seen["norm"]
close_to("train BatchNorm vs batch statistics", normed, batch_norm_by_hand(
    h, h.mean(0), h.var(0, correction=0), other), 2e-6)  # fmt: skip
before, after = seen["drop"]
kept = after != 0
close_to("train Dropout, kept entries vs input/(1-p)", after[kept],
         before[kept] / (1 - DROP), 1e-6)  # fmt: skip
n = (before != 0).sum().item()
dropped = ((before != 0) & ~kept).sum().item() / n
bound = 4 * (DROP * (1 - DROP) / n) ** 0.5  # four binomial standard errors
print(f"Dropout zeroed {dropped:.2%} of {n} nonzero entries (p = {DROP} ± {bound:.2%})")
assert abs(dropped - DROP) < bound, dropped
for hook in hooks:
    hook.remove()


# %%
# Dropout draws from PyTorch's global generator: two calls draw the same mask only from the
# same generator state (the same seed, or a state restored: ``torch.random.fork_rng``,
# ``set_rng_state``). Same seed: ``functional_call`` and the module agree; another seed: not.
def seeded(seed, run):
    torch.manual_seed(seed)
    return run()


twin = copy.deepcopy(model)  # a plain call writes its own buffers: not model's
twin.load_state_dict(other)
by_dict = seeded(7, lambda: functional_call(model, copy.deepcopy(other), (inputs,)))
close_to("train mode, same seed: functional_call vs module", by_dict,
         seeded(7, lambda: twin(inputs)), 1e-6)  # fmt: skip
moved = (seeded(8, lambda: twin(inputs)) - by_dict).norm() / by_dict.norm()
print(f"another seed moves the output by {moved:.2f} (relative)")
assert moved > 0.05

# %%
# Buffers: BatchNorm writes into the tensors you pass
# ---------------------------------------------------
# In training mode BatchNorm updates its running statistics *in place*: with momentum ``m``,
# ``running_mean ← (1−m)·running_mean + m·batch mean`` and the same for ``running_var`` with
# the *unbiased* batch variance, and ``num_batches_tracked`` grows by one. Under
# ``functional_call`` the tensors written are the ones in your dict; the module's own stay.
state = copy.deepcopy(other)
functional_call(model, state, (inputs,))
m = model.norm.momentum
h = F.linear(inputs, other["hidden.weight"], other["hidden.bias"])  # BatchNorm's input
new_mean = (1 - m) * other["norm.running_mean"] + m * h.mean(0)
close_to("running_mean, (1-m)·old + m·mean", state["norm.running_mean"], new_mean, 1e-6)
close_to("running_var, (1-m)·old + m·unbiased var", state["norm.running_var"],
         (1 - m) * other["norm.running_var"] + m * h.var(0, correction=1), 1e-6)  # fmt: skip
assert state["norm.num_batches_tracked"] == other["norm.num_batches_tracked"] + 1
assert all(torch.equal(t, own[name]) for name, t in model.state_dict().items())
print("the dict's statistics moved; the module's own did not")

# %%
# A name the dict lacks falls back to the module's own tensor, which is then written. To keep
# what a training run learnt, keep the dict, or ``load_state_dict`` it into the module when done.
functional_call(model, params, (inputs,))
assert model.norm.num_batches_tracked == own["norm.num_batches_tracked"] + 1
assert not torch.equal(model.norm.running_mean, own["norm.running_mean"])
print("parameters only: the module's own running statistics moved")
model.load_state_dict(own)  # back to where it was


# %%
# Under :func:`~torch.func.grad`, pass the buffers as an argument that is not differentiated:
# they are updated in place as above, once per call. Left to the module (captured), they fail:
# ``num_batches_tracked.add_(1)`` raises "would mutate a captured Tensor"
# (:ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py`). In the differentiated dict they
# fail otherwise: ``num_batches_tracked`` is an integer; only floating tensors require gradients.
def batch_loss(params, buffers, x, y):
    return F.cross_entropy(functional_call(model, (params, buffers), (x,)), y)


buffers = {name: t.clone() for name, t in other.items() if name not in params}
grad(batch_loss)(params, buffers, inputs, labels)
close_to("under grad: running_mean", buffers["norm.running_mean"], new_mean, 1e-6)
assert buffers["norm.num_batches_tracked"] == other["norm.num_batches_tracked"] + 1
transforms = {"grad": lambda f, given: grad(f)(given), "vjp": vjp}  # vjp: see below
for given, says in [(params, "(aten::add_.Tensor) that would mutate a captured Tensor"),
                    (params | buffers, "only Tensors of floating point dtype")]:  # fmt: skip
    how = "left to the module" if given is params else "differentiated"
    for name, transform in transforms.items():
        try:
            transform(lambda merged: batch_loss(merged, {}, inputs, labels), given)
            raise AssertionError(f"{name} ran, though expected to raise {says!r}")
        except RuntimeError as refusal:
            assert says in str(refusal), refusal
            print(f"{name}, buffers {how}: RuntimeError:", str(refusal).split(". ")[0])


# %%
# :func:`~torch.func.vjp` has no ``argnums`` and differentiates every primal: buffers fail as a
# primal (the second case) and in a closure (the first). Clone them inside, return the clones as
# ``aux``. Reference: ``backward()`` through a loaded copy of the module, same seed and cotangent.
def forward_and_state(params):
    state = {name: t.clone() for name, t in other.items() if name not in params}
    return functional_call(model, (params, state), (inputs,)), state


out, pull_back, state = seeded(9, lambda: vjp(forward_and_state, params, has_aux=True))
cotangent, module_copy = torch.randn_like(out), copy.deepcopy(loaded).train()
seeded(9, lambda: module_copy(inputs)).backward(cotangent)
(grads,) = pull_back(cotangent)
for name, weight in module_copy.named_parameters():
    close_to(f"vjp, {name}", grads[name], weight.grad, 1e-6)
close_to("vjp's aux, running_var", state["norm.running_var"],
         module_copy.norm.running_var, 1e-6)  # fmt: skip

# %%
# Names: ``strict=True``, and tied weights
# ----------------------------------------
# By default a name that matches nothing is ignored. A typo then runs the module with its own
# tensor, silently. ``strict=True`` asks for every parameter and buffer and nothing else, and
# raises a ``RuntimeError`` that names the missing and the unexpected keys.
typo = dict(other)
typo["head.weights"] = typo.pop("head.weight")
model.eval()
own_head = F.linear(loaded[:-1](inputs), own["head.weight"], other["head.bias"])
close_to("typo, not strict: the module's own head.weight",
         functional_call(model, typo, (inputs,)), own_head.detach(), 1e-6)  # fmt: skip
try:
    functional_call(model, typo, (inputs,), strict=True)
    raise AssertionError("strict=True accepted a typo")
except RuntimeError as refusal:
    assert "Missing key(s): 'head.weight'" in str(refusal), refusal
    assert "Unexpected key(s): 'head.weights'" in str(refusal), refusal
    print("strict=True: RuntimeError:", " ".join(str(refusal).split()))

# %%
# With ``tie_weights=True`` (the default) a tensor passed under one name of a tied parameter
# serves all of them: here two layers share one weight, listed once, as ``0.weight``.
first, second = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
second.weight = first.weight
tied = nn.Sequential(first, nn.Tanh(), second).to(device)
w, v = torch.randn(3, 3, device=device), torch.randn(4, 3, device=device)
close_to("tied: one tensor for both names", functional_call(tied, {"0.weight": w}, (v,)),
         torch.tanh(v @ w.T) @ w.T, 1e-6)  # fmt: skip

# %%
# Training with ``grad_and_value`` and a ``torch.optim`` optimiser
# ----------------------------------------------------------------
# An optimiser takes any leaf tensors, here the dict's own (they need not require grad). Each
# step writes the gradients into their ``.grad`` and calls ``step()``, which updates them in
# place. Reference: a copy trained with ``loss.backward()``, same optimiser, batches and seeds,
# each tensor after each step. Training a subset: :doc:`plot_choosing_what_to_differentiate`.
batches = [(torch.randn(32, FEATURES).to(device), torch.randint(0, CLASSES, (32,)).to(device))
           for _ in range(6)]  # fmt: skip


def ordinary_training(make_optimiser):
    reference = copy.deepcopy(model).train()
    reference.load_state_dict(other)
    optimiser = make_optimiser(reference.parameters())
    states = []
    for step, (x, y) in enumerate(batches):
        torch.manual_seed(100 + step)
        optimiser.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimiser.step()
        states.append(copy.deepcopy(reference.state_dict()))
    return states


def each_within(label, got, expected, bound):
    errors = {name: ((got[name] - want).norm() / want.norm()).item()
              for name, want in expected.items() if want.is_floating_point()}  # fmt: skip
    top = max(errors, key=errors.get)
    print(f"{label}: worst {top}, error {errors[top]:.1e} (bound {bound:.0e})")
    for name, off in errors.items():
        assert off < bound, f"{label}: {name} off by {off:.1e}"


def worst_after_each_step(label, states, reference_states, bound):
    for step, (state, expected) in enumerate(zip(states, reference_states)):
        each_within(f"{label}, step {step + 1}", state, expected, bound)
        tracked = state["norm.num_batches_tracked"]
        assert tracked == expected["norm.num_batches_tracked"] == step + 1, tracked
    print(f"{label}: every tensor within {bound:.0e} after each of {len(states)} steps")


model.train()
trained = {name: t.clone() for name, t in params.items()}
running = {name: t.clone() for name, t in other.items() if name not in params}
adam = torch.optim.Adam(trained.values(), lr=1e-2)
states = []
for step, (x, y) in enumerate(batches):
    torch.manual_seed(100 + step)
    grads, loss = grad_and_value(batch_loss)(trained, running, x, y)
    for name, t in trained.items():
        t.grad = grads[name]
    adam.step()
    states.append({name: t.clone() for name, t in (trained | running).items()})
worst_after_each_step("Adam on the dict", states,
                      ordinary_training(lambda p: torch.optim.Adam(p, lr=1e-2)), 1e-6)  # fmt: skip

# %%
# How fast is it?
# ---------------
# Eight routes, in training mode. Forward only: the module's own call, and ``functional_call``
# with its own parameters. One gradient of the batch loss: ``loss.backward()`` (after clearing
# ``.grad``), :func:`torch.autograd.grad`, ``func.grad``, ``func.grad_and_value``. To split
# ``func.grad``'s extra time, the model in ``torch.nn.functional`` alone ("plain", its gradients
# checked against the module's, same seed) is differentiated by both ``grad`` functions.
weights = dict(model.named_parameters())
detached = {name: t.detach() for name, t in weights.items()}  # or grad builds a graph
SIZES, ROUNDS = [4, 64, 512, 4096], 9
ENDS = SIZES[0], SIZES[-1]  # the smallest and the largest batch


def plain_loss(p, b, x, y):  # the model in torch.nn.functional, training mode
    h = F.batch_norm(F.linear(x, p["hidden.weight"], p["hidden.bias"]), b["norm.running_mean"],
                     b["norm.running_var"], p["norm.weight"], p["norm.bias"], training=True,
                     momentum=model.norm.momentum, eps=model.norm.eps)  # fmt: skip
    h = F.dropout(F.relu(h), DROP, training=True)
    return F.cross_entropy(F.linear(h, p["head.weight"], p["head.bias"]), y)


def routes_for(x, y):
    def by_autograd(loss):  # a dict of gradients, as func.grad returns
        return dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))

    return {
        "module call": lambda: model(x),
        "functional_call": lambda: functional_call(model, weights, (x,)),
        "loss.backward()": lambda: (model.zero_grad(), F.cross_entropy(model(x), y).backward()),
        "autograd.grad": lambda: by_autograd(F.cross_entropy(model(x), y)),
        "func.grad": lambda: grad(batch_loss)(detached, buffers, x, y),
        "func.grad_and_value": lambda: grad_and_value(batch_loss)(detached, buffers, x, y),
        "plain autograd.grad": lambda: by_autograd(plain_loss(weights, buffers, x, y)),
        "plain func.grad": lambda: grad(plain_loss)(detached, buffers, x, y),
    }  # fmt: skip


checked = routes_for(inputs, labels)
reference = seeded(11, checked["plain autograd.grad"])
for name in ["autograd.grad", "func.grad", "plain func.grad"]:
    each_within(f"{name} vs plain autograd", seeded(11, checked[name]), reference, 1e-6)


# Nine rounds per size, each route one ``Timer.blocked_autorange`` per round on all threads, in
# an order rotated by one each round; a route's median and IQR are over all its blocks.
def us(seconds):  # enough digits that a small spread does not print as zero
    return f"{seconds * 1e6:.1f}" if abs(seconds) >= 1e-6 else f"{seconds * 1e6:.2g}"


rounds, times, threads = {}, {}, torch.get_num_threads()
for size in SIZES:
    routes = routes_for(torch.randn(size, FEATURES).to(device),
                        torch.randint(0, CLASSES, (size,)).to(device))  # fmt: skip
    for fn in routes.values():
        fn(), fn()  # warm-up
    order = list(routes.items())
    for _round in range(ROUNDS):
        for name, fn in order:
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
            rounds.setdefault(name, {}).setdefault(size, []).append(
                timer.blocked_autorange(min_run_time=0.01))  # fmt: skip
        order = order[1:] + order[:1]  # the next round starts one route later
    for name in routes:
        merged = benchmark.Measurement.merge(rounds[name][size])[0]
        times.setdefault(name, {})[size] = merged
        spread = f"IQR {us(merged.iqr)} µs, {len(merged.times)} blocks"
        print(f"batch {size:4d}  {name:19s} {us(merged.median):>8s} µs ({spread})")


# %%
# A fixed cost per call, or a cost that grows with the batch?
# -----------------------------------------------------------
# Per size: ``func.grad``'s time minus that of ``autograd.grad`` and of ``loss.backward()``, in
# each round, then its median and quartiles over the rounds; the ratio of the routes' medians.
# The difference is called larger or smaller at the largest batch than at the smallest only
# where their ranges from first to third quartile do not overlap.
def per_round(a, b, size):  # a's median minus b's, in each round (seconds)
    pairs = zip(rounds[a][size], rounds[b][size])
    return np.array([x.median - y.median for x, y in pairs])


def summary(values):  # median and quartiles over the rounds
    q1, mid, q3 = np.percentile(values, [25, 50, 75]) * 1e6
    return f"{mid:+7.1f} µs (IQR {us((q3 - q1) / 1e6)} µs, {q1:+.1f} to {q3:+.1f} µs)"


def worded(r):  # a ratio worded by its value
    return f"takes {r:.2f}x the time of" if r >= 1 else f"is {1 / r:.2f}x faster than"


for b in ("autograd.grad", "loss.backward()"):
    print(f"func.grad minus {b}, over {ROUNDS} rounds:")
    for size in SIZES:
        words = worded(times["func.grad"][size].median / times[b][size].median)
        print(f"  batch {size:4d}: {summary(per_round('func.grad', b, size))}; "
              f"func.grad {words} {b}")  # fmt: skip
    lo, hi = (np.percentile(per_round("func.grad", b, s), [25, 75]) for s in ENDS)
    trend = "larger" if hi[0] > lo[1] else "smaller" if hi[1] < lo[0] else ""
    said = f"{trend} (IQRs apart)" if trend else "not told apart (IQRs overlap)"
    print(f"  this run, the difference at batch {ENDS[1]} against {ENDS[0]}: {said}")

# %%
# ``func.grad`` minus ``autograd.grad``, split per round at the size where it varies least: the
# transform alone (the two on the plain function); ``functional_call``'s swap (minus the module
# call, timed *outside* the transform, though in ``func.grad`` it runs under it); the remainder.
# Each is summarised over rounds on its own, so medians need not add up.
whole = {size: per_round("func.grad", "autograd.grad", size) for size in SIZES}
at = min(SIZES, key=lambda size: np.subtract(*np.percentile(whole[size], [75, 25])))
alone = per_round("plain func.grad", "plain autograd.grad", at)
swap = per_round("functional_call", "module call", at)
print(f"split at batch {at}, where func.grad minus autograd.grad has its smallest IQR:")
for label, part in [("whole: func.grad minus autograd.grad", whole[at]),
                    ("the transform alone (plain function)", alone),
                    ("functional_call's swap, timed outside", swap),
                    ("remainder: whole minus the two", whole[at] - alone - swap)]:  # fmt: skip
    print(f"  {label:38s} {summary(part)}")

# %%
# The figure: each route's median time per call against the batch size (log axes), whiskers
# from the first to the third quartile of the blocks' times over all rounds.
fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True, layout="constrained")
for name in METHOD_COLORS:
    panel = axes[0] if name in ("module call", "functional_call") else axes[1]
    medians = np.array([times[name][s].median * 1e6 for s in SIZES])
    q = np.array([np.percentile(times[name][s].times, [25, 75]) for s in SIZES]).T * 1e6
    dashed = name in ("autograd.grad", "func.grad_and_value")  # over its twin
    panel.errorbar(SIZES, medians, yerr=[medians - q[0], q[1] - medians], marker="o", capsize=3,
                   color=METHOD_COLORS[name], label=name, ls="--" if dashed else "-")  # fmt: skip
for panel, what in zip(axes, ["the forward pass only", "one gradient of a batch loss"]):
    panel.set(xscale="log", yscale="log", xlabel="batch size", title=what)
    panel.legend(fontsize="small")
axes[0].set_ylabel("median time per call (µs)")
fig.suptitle(f"{device.type.upper()}: time per call against batch size")
plt.show()

# %%
# What to remember
# ----------------
# * ``functional_call(model, tensors, (x,))`` runs the module with your tensors and follows the
#   module's own ``train()``/``eval()`` flag; seed the global generator to repeat Dropout.
# * In training mode BatchNorm writes its running statistics in place into the tensors you
#   passed; names you did not pass fall back to the module's own, which are then written.
# * Pass buffers as a dict that ``grad`` does not differentiate; under ``vjp`` (no ``argnums``)
#   clone them inside and return them as ``aux``. ``strict=True`` catches a misspelt name.
# * ``grad_and_value`` plus ``.grad = g`` and ``optimiser.step()`` on the dict's tensors trains
#   as ``loss.backward()`` does, step for step (same seeds for Dropout).
# * What ``func.grad`` adds on your model: time it against ``autograd.grad`` in rounds, read the
#   per-round differences with their quartiles, at your model's size.
