"""
torch.func and JAX, side by side
================================

``torch.func`` modelled ``grad``, ``vmap``, ``jacfwd``, ``jacrev``, ``hessian`` and ``jvp`` on
JAX's. This page writes six recipes in both libraries for one classifier with the same weights,
checks each entry of both against a float64 reference, times each recipe four ways (PyTorch
eager, ``torch.compile``, JAX op by op and ``jax.jit``) and counts some of what each runs.
"""

# %%
# One model, two libraries
# ------------------------
# JAX's transforms act only on a function's arguments, so on both sides the classifier is a
# function of a dictionary of parameters: :func:`~torch.func.functional_call` runs the PyTorch
# module with one, and the JAX version is three lines of matrix algebra on the same numbers.
# Both run in float32 on one kind of device: if only PyTorch has a GPU, both run on the CPU.
import copy
import cProfile
import math
import os
import pstats
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Measurement, Timer
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if device.type == "cpu":
    jax.config.update("jax_platforms", "cpu")
elif jax.default_backend() == "cpu":
    print("torch sees a GPU and JAX does not: both run on the CPU")
    device = torch.device("cpu")
jax.config.update("jax_default_matmul_precision", "highest")  # torch's: no TF32
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
print(f"jax {jax.__version__} on {jax.devices()[0].platform}, float32")


def classifier():
    hidden = [nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh()]
    return nn.Sequential(*hidden, nn.Linear(128, 64))


model = classifier().to(device)
params = {n: p.detach() for n, p in model.named_parameters()}
inputs = torch.randn(64, 16, device=device)
labels = torch.randint(0, 64, (64,), device=device)


def logits(p, x):
    return functional_call(model, p, (x,))


def sample_loss(p, x, y):  # the cross-entropy of one example
    return F.cross_entropy(logits(p, x[None]), y[None])


def to_jax(tensors):  # the same numbers, copied into JAX arrays
    return {name: jnp.asarray(t.detach().cpu().numpy()) for name, t in tensors.items()}


def jax_logits(p, x):
    hidden = jnp.tanh(x @ p["0.weight"].T + p["0.bias"])
    hidden = jnp.tanh(hidden @ p["2.weight"].T + p["2.bias"])
    return hidden @ p["4.weight"].T + p["4.bias"]


def jax_sample_loss(p, x, y):
    return -jax.nn.log_softmax(jax_logits(p, x))[y]


jax_params, jax_data = to_jax(params), to_jax({"x": inputs, "y": labels})
jax_inputs, jax_labels = jax_data["x"], jax_data["y"]
x0, jax_x0, y0, jax_y0 = inputs[0], jax_inputs[0], labels[0], jax_labels[0]

# %%
# The reference
# -------------
# The reference uses neither library's recipes: a float64 copy of the module, differentiated by
# ``torch.autograd.grad`` in plain loops, one backward pass per entry of the result.
model64 = copy.deepcopy(model).double()
leaves64 = dict(model64.named_parameters())


def loop_jacobian(outputs, named):  # one float64 backward pass per entry of outputs
    wrt = list(named.values())
    rows = [torch.autograd.grad(o, wrt, retain_graph=True) for o in outputs.ravel()]
    grads = [torch.stack(row).reshape(*outputs.shape, *x.shape) for row, x in
             zip(zip(*rows), wrt)]  # fmt: skip
    return dict(zip(named, grads))


recipes, references = {}, {}  # name -> (torch fn, its arguments, JAX fn, its arguments)

# %%
# Per-sample gradients
# --------------------
# ``grad`` of one example's loss, mapped over the batch by ``vmap``: parameters shared (``None``),
# inputs and labels split along their first axis (``0``). The libraries differ by a word,
# ``in_dims`` against ``in_axes``. The reference loops over the batch, one backward pass each.


def per_sample_grads(p, x, y):
    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(p, x, y)


def jax_per_sample_grads(p, x, y):
    return jax.vmap(jax.grad(jax_sample_loss), in_axes=(None, 0, 0))(p, x, y)


loop = [torch.autograd.grad(F.cross_entropy(model64(x[None].double()), y[None]),
                            list(leaves64.values())) for x, y in zip(inputs, labels)]  # fmt: skip
references["per-sample gradients"] = dict(zip(leaves64, map(torch.stack, zip(*loop))))
recipes["per-sample gradients"] = (per_sample_grads, (params, inputs, labels),
    jax_per_sample_grads, (jax_params, jax_inputs, jax_labels))  # fmt: skip

# %%
# A tall and a wide Jacobian
# --------------------------
# The 64 logits with respect to one input of 16 numbers form a tall Jacobian: ``jacfwd`` builds
# it from 16 Jacobian-vector products, one per input. With respect to the parameters it is wide:
# ``jacrev`` builds it from 64 vector-Jacobian products, one per logit, and both libraries
# return a dictionary shaped like the parameters, each entry with the 64 rows first.


def tall_jacobian(p, x):
    return {"input": jacfwd(logits, argnums=1)(p, x)}


def jax_tall_jacobian(p, x):
    return {"input": jax.jacfwd(jax_logits, argnums=1)(p, x)}


def wide_jacobian(p, x):
    return jacrev(logits)(p, x)


def jax_wide_jacobian(p, x):
    return jax.jacrev(jax_logits)(p, x)


x64 = x0.double().requires_grad_()
references["tall Jacobian (jacfwd)"] = loop_jacobian(model64(x64), {"input": x64})
references["wide Jacobian (jacrev)"] = loop_jacobian(model64(x64), leaves64)
recipes["tall Jacobian (jacfwd)"] = (tall_jacobian, (params, x0),
    jax_tall_jacobian, (jax_params, jax_x0))  # fmt: skip
recipes["wide Jacobian (jacrev)"] = (wide_jacobian, (params, x0),
    jax_wide_jacobian, (jax_params, jax_x0))  # fmt: skip

# %%
# A Hessian, and a Hessian-vector product
# ---------------------------------------
# The Hessian of one example's loss with respect to its 16 inputs: ``hessian`` is ``jacfwd``
# of ``jacrev`` in both libraries. With respect to the parameters, too large to form cheaply,
# we take its product with a direction ``v``: ``jvp`` of ``grad``, forward over reverse. The
# reference differentiates the float64 gradient again: by rows, and its dot product with ``v``.


def input_hessian(p, x, y):
    return {"input": hessian(sample_loss, argnums=1)(p, x, y)}


def jax_input_hessian(p, x, y):
    return {"input": jax.hessian(jax_sample_loss, argnums=1)(p, x, y)}


def hvp(p, v, x, y):
    def loss(q):
        return F.cross_entropy(logits(q, x), y)

    return jvp(grad(loss), (p,), (v,))[1]


def jax_hvp(p, v, x, y):
    def loss(q):
        log_probs = jax.nn.log_softmax(jax_logits(q, x))
        return -jnp.take_along_axis(log_probs, y[:, None], axis=1).mean()

    return jax.jvp(jax.grad(loss), (p,), (v,))[1]


direction = {name: torch.randn_like(p) for name, p in params.items()}
sample_loss64 = F.cross_entropy(model64(x64[None]), y0[None])
(input_gradient,) = torch.autograd.grad(sample_loss64, x64, create_graph=True)
references["Hessian"] = loop_jacobian(input_gradient, {"input": x64})
batch_loss64 = F.cross_entropy(model64(inputs.double()), labels)
gradient = torch.autograd.grad(batch_loss64, [*leaves64.values()], create_graph=True)
along = sum((g * direction[name].double()).sum() for name, g in zip(leaves64, gradient))
hvp64 = torch.autograd.grad(along, [*leaves64.values()])
references["Hessian-vector product"] = dict(zip(leaves64, hvp64))
recipes["Hessian"] = (input_hessian, (params, x0, y0),
    jax_input_hessian, (jax_params, jax_x0, jax_y0))  # fmt: skip
recipes["Hessian-vector product"] = (hvp, (params, direction, inputs, labels),
    jax_hvp, (jax_params, to_jax(direction), jax_inputs, jax_labels))  # fmt: skip

# %%
# An ensemble
# -----------
# Eight classifiers, run on one batch in one call: :func:`~torch.func.stack_module_state`
# stacks each parameter of the eight along a new first axis, and ``vmap`` maps
# ``functional_call`` over it, with a module on the ``meta`` device for the structure alone. In
# JAX the stacked dictionary is a pytree like any other. The reference: each member in float64.
members = [classifier().to(device) for _ in range(8)]
stacked = {n: p.detach() for n, p in torch.func.stack_module_state(members)[0].items()}
template = classifier().to("meta")


def ensemble(p, x):
    return {"logits": vmap(functional_call, in_dims=(None, 0, None))(template, p, (x,))}


def jax_ensemble(p, x):
    return {"logits": jax.vmap(jax_logits, in_axes=(0, None))(p, x)}


outputs64 = [copy.deepcopy(m).double()(inputs.double()) for m in members]
references["ensemble of 8"] = {"logits": torch.stack(outputs64).detach()}
recipes["ensemble of 8"] = (ensemble, (stacked, inputs),
    jax_ensemble, (to_jax(stacked), jax_inputs))  # fmt: skip

# %%
# Other names that carry over
# ---------------------------
# ``jax.lax.stop_gradient(x)`` is ``x.detach()``; ``has_aux`` is spelled alike in ``grad``,
# ``jacrev``, ``jacfwd`` and ``vjp``; ``jax.custom_jvp`` and ``custom_vjp`` become a
# :class:`torch.autograd.Function`. JAX takes random keys where ``vmap`` takes ``randomness=``;
# ``chunk_size`` is nearest to ``jax.lax.map``'s ``batch_size``. ``jax.lax.scan`` has no public
# counterpart (``torch._higher_order_ops.scan`` is private): write the loop in Python.
stop = jax.lax.stop_gradient  # with one factor stopped, the gradient of x·x is x
assert torch.equal(grad(lambda x: (x.detach() * x).sum())(x0), x0)
assert np.array_equal(jax.grad(lambda x: (stop(x) * x).sum())(jax_x0), jax_x0)
assert not hasattr(torch.func, "scan") and not hasattr(torch, "scan")

# %%
# Every recipe, checked
# ---------------------
# An error is the largest distance from the reference over its largest entry. The libraries
# must agree entry by entry within ``BOUND``, a small multiple of the largest error printed, and
# each lie within ``BOUND`` of float64: a recipe wrong on one side fails, not widens the bound.
BOUND = 2e-6


def check(recipe, torch_result, jax_result, reference):
    errors = {"torch.func": 0.0, "JAX": 0.0}
    assert torch_result.keys() == jax_result.keys() == reference.keys(), recipe
    for name, exact in reference.items():
        scale = float(exact.abs().max())
        ours = torch_result[name].detach().cpu().double()
        theirs = torch.from_numpy(np.array(jax_result[name])).double()
        for side, got in (("torch.func", ours), ("JAX", theirs)):
            errors[side] = max(errors[side], float((got - exact).abs().max()) / scale)
        gap = float((theirs - ours).abs().max()) / scale  # the largest entry's
        assert gap < BOUND, f"{recipe}, {name}: JAX and torch.func differ by {gap:.1e}"
    print(f"{recipe}: float32 error against float64, torch.func {errors['torch.func']:.1e},"
          f" JAX {errors['JAX']:.1e}; bound {BOUND:.0e}, "
          f"{BOUND / max(errors.values()):.1f} times the larger")  # fmt: skip
    assert max(errors.values()) < BOUND, (recipe, errors)


for recipe, (torch_fn, torch_args, jax_fn, jax_args) in recipes.items():
    check(recipe, torch_fn(*torch_args), jax_fn(*jax_args), references[recipe])

# %%
# How fast is each?
# -----------------
# Four ways to run each recipe: PyTorch eager, :func:`torch.compile` of it, JAX op by op, and
# ``jax.jit``, given every array as an argument (one captured from the enclosing scope would be
# a constant of the program, which XLA may fold). A compiled function's first call compiles it
# (timed once), checked against the uncompiled one. :class:`torch.utils.benchmark.Timer` times
# every call, the JAX ones with ``jax.block_until_ready`` (JAX returns early; the extra call may
# weigh in the ``x + 1`` row alone); ``num_threads`` sets torch's threads, not XLA's pool. Above a
# load average of one per core, other processes shared the cores: the page then warns.
METHOD_COLORS = {"torch eager": "#004488", "compiled": "#117733",
                 "JAX": "#EE7733", "JAX jit": "#DDAA33"}  # fmt: skip
LABELS = {**{m: m for m in METHOD_COLORS}, "compiled": "torch compiled"}


def add_one(x):  # one operation, in either library
    return x + 1


one = torch.ones(1, device=device)
timed = {"x + 1": (add_one, (one,), add_one, (to_jax({"x": one})["x"],)), **recipes}


def four_calls(torch_fn, torch_args, jax_fn, jax_args):
    """Compile both sides (timed once), check them, and return the four calls."""
    compiled, jitted = torch.compile(torch_fn), jax.jit(jax_fn)
    eager_result, jax_result = torch_fn(*torch_args), jax_fn(*jax_args)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*_prims_common.check")
        compiled_result = compiled(*torch_args)  # the compiler warns about its own code
    middle = time.perf_counter()
    jit_result = jax.block_until_ready(jitted(*jax_args))
    seconds = (middle - started, time.perf_counter() - middle)
    torch.testing.assert_close(compiled_result, eager_result)
    torch.testing.assert_close(*jax.tree.map(np.array, (jit_result, jax_result)))
    calls = {"torch eager": lambda: torch_fn(*torch_args),
             "compiled": lambda: compiled(*torch_args),
             "JAX": lambda: jax.block_until_ready(jax_fn(*jax_args)),
             "JAX jit": lambda: jax.block_until_ready(jitted(*jax_args))}  # fmt: skip
    for call in calls.values():
        call()  # warm-up: JAX compiles each primitive on its first use
    return calls, seconds


def three(value):  # three significant digits, never an exponent
    return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}"


def measure(call):  # blocks of calls for 0.1 s, and at least 5 blocks
    timer = Timer("call()", globals={"call": call}, num_threads=torch.get_num_threads())
    blocks = [timer.blocked_autorange(min_run_time=0.1)]
    while sum(len(m.times) for m in blocks) < 5:
        blocks.append(timer.blocked_autorange(min_run_time=0.1))
    return Measurement.merge(blocks)[0]


torch._dynamo.reset()  # compile afresh; below, one graph per recipe: no break, no recompiling
runs, timings, loads = {}, {}, []
for recipe, recipe_args in timed.items():
    graphs = counters["stats"]["unique_graphs"]
    calls, _ = runs[recipe] = four_calls(*recipe_args)
    t = timings[recipe] = {method: measure(call) for method, call in calls.items()}
    assert counters["stats"]["unique_graphs"] == graphs + 1, f"{recipe}: not one graph"
    loads.append(getattr(os, "getloadavg", lambda: [0.0])()[0])  # 1 min; Windows: 0
    print(f"{recipe}: " + ", ".join(f"{LABELS[m]} {three(t[m].median * 1e3)} ms"
          for m in t) + f" (IQR {', '.join(three(t[m].iqr * 1e3) for m in t)} ms)")  # fmt: skip
blocks = min(len(m.times) for t in timings.values() for m in t.values())
print(f"each time above is the median of {blocks} or more blocks of calls; load average "
      f"up to {max(loads):.2f} on {os.cpu_count()} cores")  # fmt: skip
if max(loads) > os.cpu_count():  # the page itself keeps about one thread per core busy
    print("unreliable comparison: other processes shared the cores while these times were "
          "taken, and torch's and JAX's calls need not slow down alike")  # fmt: skip
for (recipe, t), (_, (torch_s, jax_s)) in zip(timings.items(), runs.values()):
    print(f"{recipe}: first call (compiles, or loads a cached compile), measured once: "
          f"torch.compile {torch_s:.2f} s, jax.jit {jax_s:.2f} s")  # fmt: skip
    eager = t["JAX"].median / t["torch eager"].median
    fused = t["JAX jit"].median / t["compiled"].median
    print(f"{recipe}: JAX op by op takes {three(eager)}x the time of torch eager, "
          f"JAX jit {three(fused)}x the time of torch compiled")  # fmt: skip

# %%
# The figure sets the four times of each recipe side by side, on a logarithmic axis.
fig, ax = plt.subplots(figsize=(10, 4.2), layout="constrained")
for i, (method, colour) in enumerate(METHOD_COLORS.items()):
    ax.bar([r + (i - 1.5) * 0.2 for r in range(len(timings))],
           [t[method].median * 1e3 for t in timings.values()], 0.2, color=colour,
           edgecolor="black", linewidth=0.5, label=LABELS[method], log=True,
           hatch="//" if method in ("compiled", "JAX jit") else "")  # fmt: skip
ax.set_xticks(range(len(timings)), [textwrap.fill(r, 14) for r in timings])
ax.set_ylabel(f"median time on {device.type.upper()} (ms, log scale)")
ax.set_title("The same recipes in torch.func and JAX")
fig.legend(ncols=4, loc="outside lower center")
plt.show()

# %%
# Why: what each one runs
# -----------------------
# Two counts, by tools first checked on a call whose answer is known: the *Python calls* of one
# call, built-ins included, by ``cProfile``; the eager call's *matrix products*, recorded by a
# ``TorchDispatchMode`` and run alone under the same timer (``FlopCounterMode`` must find all
# the call's FLOPs in them, and no other matrix operation, some without a FLOP formula, may
# run). Not all operations: a dispatch mode sees views too, and JAX compiles each operation.
PRODUCTS = {getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm")}
OTHERS = {getattr(torch.ops.aten, n) for n in ("mv", "dot", "addmv", "baddbmm")}


class Record(TorchDispatchMode):  # every ATen operation dispatched, with its arguments
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def products_alone(fn, *args):
    """The matrix products a call runs, as one call; how many, and their FLOPs."""
    with FlopCounterMode(display=False) as whole, Record() as record:
        fn(*args)
    products = [op for op in record.ops if op[0] in PRODUCTS]
    others = {str(op[0]) for op in record.ops if op[0].overloadpacket in OTHERS}
    assert not others, f"matrix operations other than the products ran: {others}"

    def replay():
        return [f(*a, **k) for f, a, k in products]

    with FlopCounterMode(display=False) as alone:
        replay()
    assert alone.get_total_flops() == whole.get_total_flops(), "a product was missed"
    return replay, len(products), whole.get_total_flops()


def python_calls(call):  # less an empty call's two: itself, the profiler's stop
    profiler = cProfile.Profile()
    profiler.runcall(call)
    return pstats.Stats(profiler).total_calls - 2


assert products_alone(lambda m: m.T @ m, torch.randn(3, 4))[1:] == (1, 2 * 4 * 3 * 4)
assert python_calls(lambda: len("one")) == 1
for recipe, (calls, _) in runs.items():
    calls = {m: python_calls(call) for m, call in calls.items()}
    print(f"{recipe}, Python calls: " + ", ".join(f"{LABELS[m]} {n}"
          for m, n in calls.items()))  # fmt: skip
    assert calls["torch eager"] < calls["JAX"], recipe
    assert calls["JAX jit"] < calls["compiled"], recipe
for recipe, (torch_fn, torch_args, *_) in recipes.items():
    replay, products, flops = products_alone(torch_fn, *torch_args)
    eager = runs[recipe][0]["torch eager"]  # timed again, beside the products alone
    share = measure(replay).median / measure(eager).median
    print(f"{recipe}: the eager call's {products} matrix products ({flops / 1e6:.2f} MFLOP)"
          f" alone take {three(100 * share)}% of torch eager's time, timed beside it")  # fmt: skip

# %%
# Reading the counts. *Eager against op by op*: JAX runs ``vmap``, ``grad`` and ``jvp`` as
# interpreters in Python, so op by op it makes more Python calls than PyTorch (asserted), whose
# ``torch.func`` does that work in C++ for most operations: probably much of the first ratio, not
# timed apart here. *Compiled against jit*: a ``jax.jit`` call makes a handful of Python calls, a
# compiled torch function many more (asserted), a cost the ``x + 1`` row times.

# %%
# What to remember
# ----------------
# - The same transforms: ``vmap(grad(f), in_dims=...)`` is ``jax.vmap(jax.grad(f), in_axes=...)``;
#   ``jacfwd``, ``jacrev``, ``hessian`` and ``jvp`` of ``grad`` carry over as they are, and
#   ``stack_module_state`` with ``vmap`` is ``jax.vmap`` over a stacked pytree.
# - Copy weights with ``jnp.asarray(t.detach().cpu().numpy())``; ``nn.Linear`` keeps ``W`` as
#   (out, in), so JAX computes ``x @ W.T + b``.
# - Check both libraries against a float64 reference that uses neither, and bound their
#   difference by a small multiple of the errors measured there.
# - Op by op, JAX makes more Python calls than eager PyTorch, and a ``jax.jit`` call fewer
#   than a ``torch.compile`` one. Count with a tool checked on a known case, and pass
#   ``jax.jit`` every array.
