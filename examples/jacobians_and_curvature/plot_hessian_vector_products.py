"""
Hessian-vector products of a loss
=================================

The Hessian of a loss with respect to a model's P parameters has P² entries, far too many to
form for a real network; Newton-type optimisers, sharpness measures and influence functions use
the Hessian *times a vector*, ``H v``, which never forms ``H``. This page builds that product
for an MLP's loss three ways, from :func:`~torch.func.grad`, :func:`~torch.func.jvp` and
:func:`~torch.func.vjp`, checks each tensor against float64 autograd, and measures what each
costs against one gradient, in matrix-product FLOPs and in time: eager, compiled, and at fixed
parameters, where a solver's products share one linearisation (:func:`~torch.func.linearize`).
The sibling page,
:ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_curvature_algorithms.py`, puts the
product to work: power iteration, Newton steps by conjugate gradients, and Gauss-Newton.
"""

# %%
# The recipe: the derivative of the gradient along ``v``
# ------------------------------------------------------
# The gradient ``g(θ) = ∇L(θ)`` is itself a function of the parameters, and ``H v`` is its
# derivative in the direction ``v``: ``H v = d/dε g(θ + εv)`` at ε = 0. So take ``grad`` of
# the loss, and push the tangent ``v`` through it with ``jvp``: *forward-over-reverse*. The
# parameters are a dictionary, run by :func:`~torch.func.functional_call`; the direction and
# the product are dictionaries of the same shapes.
import collections
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.func import functional_call, grad, grad_and_value, jvp, linearize, vjp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Timer
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# A smooth MLP (``tanh``, so that the Hessian exists everywhere) on flattened 28×28 inputs, a
# batch of 128, mean cross-entropy.
model = nn.Sequential(
    nn.Linear(784, 1024), nn.Tanh(), nn.Linear(1024, 256), nn.Tanh(), nn.Linear(256, 10)
).to(device)
params = {name: p.detach() for name, p in model.named_parameters()}
inputs = torch.randn(128, 784, device=device)
targets = torch.randint(0, 10, (128,), device=device)
num_params = sum(p.numel() for p in params.values())
print(
    f"{num_params:,} parameters: a float32 Hessian would take {num_params**2 * 4:.2e} bytes"
)


def loss_fn(params, inputs, targets):
    return F.cross_entropy(functional_call(model, params, (inputs,)), targets)


def hvp_forward_over_reverse(params, vector, inputs, targets):
    def gradient_fn(p):
        return grad(loss_fn)(p, inputs, targets)

    _, product = jvp(gradient_fn, (params,), (vector,))  # (gradient, H v)
    return product


direction = {name: torch.randn_like(p) for name, p in params.items()}
norm = sum((d**2).sum() for d in direction.values()).sqrt()
direction = {name: d / norm for name, d in direction.items()}  # unit norm
product = hvp_forward_over_reverse(params, direction, inputs, targets)

# %%
# The check: float64 autograd, itself checked by a finite difference
# ------------------------------------------------------------------
# The reference is :func:`torch.autograd.functional.hvp` in float64, on the loss written out
# by hand: plain autograd, no ``torch.func``, no module. It is itself checked against a central
# difference of float64 gradients, ``(g(θ + εv) − g(θ − εv)) / 2ε``, to the difference's own
# accuracy (of order ε², ε = 1e-4). Each tensor of a product is compared on its own.


def reference_loss(*leaves):
    hidden = inputs.double()
    for layer in range(0, len(leaves), 2):
        hidden = torch.tanh(hidden) if layer else hidden
        hidden = hidden @ leaves[layer].T + leaves[layer + 1]
    return F.cross_entropy(hidden, targets)


def reference_gradient(leaves):
    leaves = [p.detach().requires_grad_() for p in leaves]
    return dict(zip(params, torch.autograd.grad(reference_loss(*leaves), leaves)))


def check_each_tensor(what, result, reference, bound):
    assert result.keys() == reference.keys(), what
    errors = {}
    for name, ref in reference.items():
        assert result[name].shape == ref.shape, (what, name)
        difference = (result[name].double() - ref).norm() / ref.norm()
        errors[name] = error = difference.item()
        assert error < bound, f"{what}: {name} has relative error {error:.2e}"
    top = max(errors, key=errors.get)
    print(f"{what:38s} worst tensor {top}: relative error {errors[top]:.1e}", end=" ")
    print(f"(bound {bound:.0e})")


theta64 = tuple(p.double() for p in params.values())
v64 = tuple(d.double() for d in direction.values())
step = 1e-4
up, down = (
    reference_gradient([p + s * v for p, v in zip(theta64, v64)]) for s in (step, -step)
)
finite_difference = {name: (up[name] - down[name]) / (2 * step) for name in params}
_, reference = torch.autograd.functional.hvp(reference_loss, theta64, v64)
reference_hvp = dict(zip(params, reference))
check_each_tensor("autograd's hvp, against the difference", reference_hvp,
                  finite_difference, bound=1e-8)  # fmt: skip
check_each_tensor("forward-over-reverse", product, reference_hvp, bound=1e-5)

# %%
# Two more ways to build the product
# ----------------------------------
# * **reverse-over-reverse**: ``H`` is symmetric, so ``H v = Hᵀ v`` is a vector-Jacobian
#   product of the gradient: ``vjp(grad(L), θ)`` applied to ``v``. In plain autograd, that is
#   ``g = torch.autograd.grad(L, θ, create_graph=True)`` followed by
#   ``torch.autograd.grad(g, θ, v)``.
# * **reverse-over-forward**: the directional derivative ``θ ↦ ∇L(θ)·v`` is a scalar, one
#   ``jvp`` of the loss; its gradient is ``H v``.
#
# In float64 each must match the reference to rounding; in float32, to float32's.


def hvp_reverse_over_reverse(params, vector, inputs, targets):
    _, vjp_fn = vjp(lambda p: grad(loss_fn)(p, inputs, targets), params)
    (product,) = vjp_fn(vector)
    return product


def hvp_reverse_over_forward(params, vector, inputs, targets):
    def directional_derivative(p):
        return jvp(lambda q: loss_fn(q, inputs, targets), (p,), (vector,))[1]

    return grad(directional_derivative)(params)


hvp_methods = {
    "forward-over-reverse": hvp_forward_over_reverse,
    "reverse-over-reverse": hvp_reverse_over_reverse,
    "reverse-over-forward": hvp_reverse_over_forward,
}
for dtype, bound in [(torch.float64, 1e-14), (torch.float32, 1e-5)]:
    for method, hvp_fn in hvp_methods.items():
        cast = [{n: t.to(dtype) for n, t in d.items()} for d in (params, direction)]
        result = hvp_fn(*cast, inputs.to(dtype), targets)
        check_each_tensor(f"{method} ({str(dtype)[6:]})", result, reference_hvp, bound)

# %%
# The check can fail. ``jvp`` returns the pair (value, tangent); keeping the value gives the
# gradient, not ``H v``, and the check says so.
mistaken = jvp(lambda p: grad(loss_fn)(p, inputs, targets), (params,), (direction,))[0]
try:
    check_each_tensor("the gradient, taken for H v", mistaken, reference_hvp, 1e-5)
    raise RuntimeError("the gradient passed for a Hessian-vector product")
except AssertionError as error:
    print("caught:", error)
    assert "has relative error" in str(error)

# %%
# The gradient, the product, the loss and the logits from one call
# ----------------------------------------------------------------
# A training step that also wants curvature should not run the model twice.
# :func:`~torch.func.grad_and_value` with ``has_aux=True`` returns the loss and the logits
# beside the gradient; ``jvp`` with ``has_aux=True`` passes them through. One call returns the
# gradient (the ``jvp``'s primal), ``H v``, the loss and the logits: one forward (a hook counts).


def loss_and_logits(params, inputs, targets):
    logits = functional_call(model, params, (inputs,))
    return F.cross_entropy(logits, targets), logits


forward_calls = []
hook = model.register_forward_hook(lambda *_: forward_calls.append(1))
gradient, hvp, (loss, logits) = jvp(
    lambda p: grad_and_value(loss_and_logits, has_aux=True)(p, inputs, targets),
    (params,),
    (direction,),
    has_aux=True,
)
hook.remove()
assert len(forward_calls) == 1, forward_calls
check_each_tensor("gradient from the jvp's primal", gradient,
                  reference_gradient(theta64), bound=1e-5)  # fmt: skip
check_each_tensor("H v from the same call", hvp, reference_hvp, bound=1e-5)
torch.testing.assert_close(logits, model(inputs))
torch.testing.assert_close(loss, F.cross_entropy(model(inputs), targets))
print(f"loss {loss.item():.4f} and logits {tuple(logits.shape)}: one forward call")

# %%
# What does a product cost? Count the matrix products
# ---------------------------------------------------
# A dispatch mode of our own adds up the FLOPs of the matrix products a call runs, noting
# those with an all-zero operand (the element-wise work it leaves out is probably a small share
# in an MLP this wide). It must agree with ``FlopCounterMode``, and for a gradient with the
# closed form: a forward pass (``2·B·n_in·n_out`` per layer) and a backward pass with two
# products per layer (weight and input gradients), less the first layer's input gradient.


class MatmulCounter(TorchDispatchMode):  # FLOPs, with and without a zero operand
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # each aten op
        operands = {aten.mm.default: args[:2], aten.addmm.default: args[1:3]}
        if func in operands:
            a, b = operands[func]
            zeros = {tuple(t.shape) for t in (a, b) if not t.any()}
            self.flops[bool(zeros)] += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.zero_shapes |= zeros
        return func(*args, **kwargs) if kwargs else func(*args)


def count(fn):
    with FlopCounterMode(display=False) as reference, MatmulCounter() as counter:
        counter.flops, counter.zero_shapes = [0, 0], set()  # [nonzero, zero]
        fn()
    counter.total, counter.zero = sum(counter.flops), counter.flops[1]
    assert counter.total == reference.get_total_flops()
    return counter


aten = torch.ops.aten
layers = [m for m in model if isinstance(m, nn.Linear)]
forward_flops = sum(2 * len(inputs) * m.in_features * m.out_features for m in layers)
first_layer = 2 * len(inputs) * layers[0].in_features * layers[0].out_features
on_gradient = count(lambda: grad(loss_fn)(params, inputs, targets))
gradient_flops = on_gradient.total
assert (gradient_flops, on_gradient.zero) == (3 * forward_flops - first_layer, 0)
print(f"one gradient: {gradient_flops / 1e9:.3f} GFLOP in matrix products")
counted = {m: count(lambda f=f: f(params, direction, inputs, targets))
           for m, f in hvp_methods.items()}  # fmt: skip
for method, c in counted.items():
    print(
        f"{method}: matrix-product FLOPs {c.total / gradient_flops:.2f}x one gradient's, "
        f"{c.zero / c.total:.0%} of them with an all-zero operand {sorted(c.zero_shapes)}"
    )
flop_ratios = {m: c.total / gradient_flops for m, c in counted.items()}

# %%
# The tangent of a product ``A B`` is ``dA B + A dB``, two products for each one of the
# gradient's, so forward-over-reverse could be expected at three gradients. But part of that
# count multiplies an all-zero tensor the shape of the input batch: the inputs are not
# differentiated, yet eager forward mode gives them a zero tangent and runs two products the
# size of the first layer's with it. Without them, forward-over-reverse counts exactly what
# reverse-over-reverse does (both asserted).
forward_over_reverse = counted["forward-over-reverse"]
assert forward_over_reverse.zero == 2 * first_layer
assert forward_over_reverse.zero_shapes == {tuple(inputs.shape)}
assert forward_over_reverse.flops[0] == counted["reverse-over-reverse"].total


# %%
# How fast is it?
# ---------------
# Each product is timed right after one gradient, so that both meet the same load on the
# machine; printed as ``hvp NAME: R x one gradient``.
def time_call(fn):
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=0.3)
    k = len(m.times)
    spread = f"{m.iqr * 1e3:.2f} ms over {k} blocks" if k > 1 else "n/a: one block"
    return m.median, f"{m.median * 1e3:.2f} ms (IQR {spread})"


time_ratios = {}


def report(name, fn, gradient_fn):
    """Times a product right after the gradient it is set against: both see one load."""
    (gradient_time, gradient_shown), (time_, shown) = map(time_call, (gradient_fn, fn))
    time_ratios[name] = time_ / gradient_time
    print(f"{name}: {shown}; the gradient beside it: {gradient_shown}")
    print(f"hvp {name}: {time_ratios[name]:.2f} x one gradient")
    return time_, gradient_time


arguments = (params, direction, inputs, targets)
calls = {"gradient": lambda: grad(loss_fn)(params, inputs, targets)}
calls |= {method: lambda fn=fn: fn(*arguments) for method, fn in hvp_methods.items()}
for method in hvp_methods:
    report(method, calls[method], calls["gradient"])

# %%
# Compiled
# --------
# The page compiles the gradient and reverse-over-reverse, the product with the fewest counted
# FLOPs (compile time apart), and sets one against the other. While any Python dispatch mode
# is active, ``torch.compile`` runs eager code, so no compiled function is called under our
# counter. The profiler lists their matrix products instead (its ``mm`` and ``addmm`` events,
# checked first on eager code), and shows that compiled code ran: a compiled region, and no
# ``aten::tanh``, which compiled code fuses into its own kernels. Compiled reverse-over-reverse
# leaves out one product per layer, the shape of its weight gradient ``δᵀ h`` (asserted): the
# gradient's own value, which eager ``vjp`` computes as its primal output and compiled code,
# whose only output is the product, need not compute.


def profiled_products(fn):
    """Shapes of the matrix products a call runs, and every event name, from the profiler."""
    names = {"aten::mm": slice(0, 2), "aten::addmm": slice(1, 3)}
    with torch.profiler.profile(record_shapes=True) as profile:
        fn()
    events = [e for e in profile.events() if e.name in names]
    shapes = [tuple(map(tuple, e.input_shapes[names[e.name]])) for e in events]
    return collections.Counter(shapes), {e.name for e in profile.events()}


def flops_of(shapes):
    return sum(n * 2 * a[0] * a[1] * b[1] for (a, b), n in shapes.items())


cheapest = min(flop_ratios, key=flop_ratios.get)
assert cheapest == "reverse-over-reverse"
compiled = {n: torch.compile(calls[n]) for n in ("gradient", cheapest)}
counters.clear()
start = time.perf_counter()
compiled["gradient"]()
result = compiled[cheapest]()
print(
    f"torch.compile, first calls of both: {time.perf_counter() - start:.1f} s, measured "
    f"once; {counters['stats']['unique_graphs']} graphs, "
    f"{sum(counters['graph_break'].values())} graph breaks, "
    f"{counters['inductor']['fxgraph_cache_hit']} from Inductor's on-disk cache"
)
assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
check_each_tensor("reverse-over-reverse (compiled)", result, reference_hvp, 1e-5)
assert torch._C._len_torch_dispatch_stack() == 0  # no dispatch mode: compiled code runs
report(f"{cheapest} (compiled)", compiled[cheapest], compiled["gradient"])
left_out = {}
for name, fn in compiled.items():
    eager, _ = profiled_products(calls[name])
    assert flops_of(eager) == counted.get(name, on_gradient).total, name
    shapes, events = profiled_products(fn)
    assert any("Torch-Compiled Region" in e for e in events), f"{name}: not compiled"
    assert "aten::tanh" not in events and not shapes - eager, name
    left_out[name] = eager - shapes
    flop_ratios[f"{name} (compiled)"] = ratio = flops_of(shapes) / gradient_flops
    print(
        f"{name} (compiled) ran compiled code: matrix-product FLOPs {ratio:.2f}x one "
        f"gradient's (profiler), leaving out {dict(left_out[name])}"
    )
assert counters["stats"]["unique_graphs"] == 2  # timing compiled nothing new
weight_gradients = collections.Counter(
    ((m.out_features, len(inputs)), (len(inputs), m.in_features)) for m in layers
)
assert not left_out["gradient"] and left_out["reverse-over-reverse"] == weight_gradients

# %%
# At fixed parameters: pay the first differentiation once
# --------------------------------------------------------
# Power iteration and conjugate gradients take many products at one θ. Two ways pay the part
# that depends on θ alone once:
#
# * ``linearize(grad(L), θ)`` traces the ``jvp`` of the gradient and, on its first call, folds
#   into constants all that does not depend on the tangent, zero-tangent products included.
# * ``vjp(grad(L), θ)`` runs the gradient once and keeps its graph for the backward passes.
#
# Each must count reverse-over-reverse's products less one gradient's, none with a zero operand
# (asserted). Each is timed per product, and amortised with its one-off cost (measured once)
# over as many products as the sibling page's CG and power iteration take.
solver_products = {"CG": 48, "power iteration": 80}
print(f"products a solver takes on the sibling page: {solver_products}")
start = time.perf_counter()
with warnings.catch_warnings():  # the tracer warns about a constant that it folds
    warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")
    _, linearized = linearize(lambda p: grad(loss_fn)(p, inputs, targets), params)
    check_each_tensor("linearize", linearized(direction), reference_hvp, bound=1e-5)
one_off = {"linearize": time.perf_counter() - start}  # the trace and the first call
start = time.perf_counter()
vjp_once = vjp(lambda p: grad(loss_fn)(p, inputs, targets), params)[1]
one_off["vjp built once"] = time.perf_counter() - start
check_each_tensor("vjp built once", vjp_once(direction)[0], reference_hvp, bound=1e-5)
per_product = {"linearize": linearized, "vjp built once": lambda v: vjp_once(v)[0]}
expected = counted["reverse-over-reverse"].total - gradient_flops
for way, fn in per_product.items():
    print(f"{way}: one-off cost {one_off[way] * 1e3:.1f} ms, measured once")
    c = count(lambda fn=fn: fn(direction))
    assert (c.total, c.zero) == (expected, 0), (way, c.total, c.zero)
    flop_ratios[f"{way} (per product)"] = c.total / gradient_flops
    call = lambda fn=fn: fn(direction)  # noqa: E731
    product_time, gradient_time = report(
        f"{way} (per product)", call, calls["gradient"]
    )
    for n in solver_products.values():
        name = f"{way} (amortised over {n})"
        time_ratios[name] = (one_off[way] / n + product_time) / gradient_time
        print(f"hvp {name}: {time_ratios[name]:.2f} x one gradient")

# %%
# The fastest product here, of the eager, compiled and amortised ones (a per-product time
# leaves the one-off cost out, so it does not compete):
contenders = {n: r for n, r in time_ratios.items() if "per product" not in n}
best = min(contenders, key=contenders.get)
kind = next((k for k in ("compiled", "amortised") if k in best), "eager")
print(f"hvp fastest here: {contenders[best]:.2f} x one gradient")
goal = "within" if contenders[best] <= 2 else "beyond"
print(f"the fastest is {best}, {kind}; {goal} the goal of 2x one gradient")

# %%
# The figure sets each product's time (bars; hatched: a one-off cost included) beside its
# counted matrix-product FLOPs (diamonds), in units of one gradient. A gap between them is
# work the FLOPs do not count (element-wise passes, the transforms' overhead); it varies with
# the hardware and the load, so the times are printed, not a ranking asserted. In matrix
# products, compiled code drops the gradient's value that eager reverse-over-reverse computes
# and discards; ``linearize`` also drops the zero-tangent products of forward mode.
METHOD_COLORS = {
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
    "compiled": "#117733",
    "linearize": "#CC3311",
}
names = list(time_ratios)
keys = [[m for m in METHOD_COLORS if m in n] or ["reverse-over-reverse"] for n in names]
colours = [METHOD_COLORS[k[-1]] for k in keys]  # a kept vjp is reverse-over-reverse
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
hatches = ["//" if "amortised" in name else "" for name in names]
ax.barh(names, [time_ratios[n] for n in names], color=colours, hatch=hatches)
ax.scatter([flop_ratios.get(n, float("nan")) for n in names], names, marker="D",
           color="black", zorder=3, label="matrix-product FLOPs / one gradient's")  # fmt: skip
ax.axvline(1, color="black", linewidth=1)
ax.invert_yaxis()
ax.set_xlabel("time in gradients (a compiled row: in compiled gradients)")
ax.set_title(f"Hessian-vector products, {num_params:,} parameters")
fig.legend(loc="outside lower center")
plt.show()

# %%
# What to remember
# ----------------
# * ``jvp(grad(L), (θ,), (v,))`` returns the gradient and ``H v`` (``has_aux`` brings the
#   loss and logits too); ``vjp`` of ``grad`` and ``grad`` of a ``jvp`` give the same product.
#   Check each tensor against float64 autograd, itself checked by a finite difference.
# * Count matrix products before explaining a cost, and look at what is multiplied: here eager
#   forward mode multiplies an all-zero tangent of the inputs.
# * Never call a compiled function under ``FlopCounterMode`` or another dispatch mode: it runs
#   eager code. Check that a timed compiled call ran compiled (the profiler, Dynamo counters).
# * At fixed θ, ``linearize(grad(L), θ)`` or a kept ``vjp(grad(L), θ)`` pays the first
#   differentiation once: judge it amortised over the products a solver takes.
