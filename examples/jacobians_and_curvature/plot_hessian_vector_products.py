"""
Hessian-vector products of a loss
=================================

The Hessian of a loss in a model's P parameters has P² entries, too many to form for a real
network; Newton-type optimisers, sharpness measures and influence functions work from ``H v``.
This page builds it for an MLP's loss three ways from :func:`~torch.func.grad`,
:func:`~torch.func.jvp` and ``vjp``, checks it against float64 autograd, and costs it against
one gradient: eager, compiled, and built once at fixed parameters (:func:`~torch.func.linearize`
or a kept :func:`~torch.func.vjp`, with the memory each keeps), in matrix-product FLOPs and time.
:ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_curvature_algorithms.py` uses it, and
:ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_diagonals_and_higher_orders.py` batches.
"""

# %%
# The recipe: the derivative of the gradient along ``v``
# ------------------------------------------------------
# The gradient ``g(θ) = ∇L(θ)`` is a function of the parameters, and ``H v = d/dε g(θ + εv)``
# at ε = 0 is its derivative along ``v``: push the tangent ``v`` through ``grad`` of the loss
# with ``jvp``, *forward-over-reverse*. The parameters, the direction and the product are
# dictionaries of the same shapes; :func:`~torch.func.functional_call` runs the model on them.
import collections
import gc
import re
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
print(f"{num_params:,} parameters; a float32 Hessian: {num_params**2 * 4:.2e} bytes")


def loss_fn(params, inputs, targets):
    return F.cross_entropy(functional_call(model, params, (inputs,)), targets)


def hvp_forward_over_reverse(params, vector, inputs, targets):
    gradient_fn = grad(lambda p: loss_fn(p, inputs, targets))  # of the parameters alone
    _, product = jvp(gradient_fn, (params,), (vector,))  # (gradient, H v)
    return product


direction = {name: torch.randn_like(p) for name, p in params.items()}
norm = sum((d**2).sum() for d in direction.values()).sqrt()
direction = {name: d / norm for name, d in direction.items()}  # unit norm
product = hvp_forward_over_reverse(params, direction, inputs, targets)

# %%
# The check: float64 autograd, itself checked by a finite difference
# ------------------------------------------------------------------
# The reference is :func:`torch.autograd.functional.hvp` in float64 on the loss written out by
# hand (plain autograd, no ``torch.func``, no module), itself checked against a central difference
# of float64 gradients, ``(g(θ + εv) − g(θ − εv)) / 2ε``, to its accuracy (order ε², ε = 1e-4).


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
up, down = (reference_gradient([p + s * v for p, v in zip(theta64, v64)])
            for s in (1e-4, -1e-4))  # fmt: skip
finite_difference = {name: (up[name] - down[name]) / 2e-4 for name in params}
_, reference = torch.autograd.functional.hvp(reference_loss, theta64, v64)
reference_hvp = dict(zip(params, reference))
check_each_tensor("autograd's hvp, against the difference", reference_hvp,
                  finite_difference, bound=1e-8)  # fmt: skip
check_each_tensor("forward-over-reverse", product, reference_hvp, bound=1e-5)

# %%
# Two more ways to build the product
# ----------------------------------
# **Reverse-over-reverse**: ``H`` is symmetric, so ``H v = Hᵀ v``, a vector-Jacobian product of
# the gradient: ``vjp(grad(L), θ)`` applied to ``v`` (plain autograd: ``torch.autograd.grad`` of
# a gradient taken with ``create_graph=True``). **Reverse-over-forward**: ``grad`` of the scalar
# ``θ ↦ ∇L(θ)·v``, one ``jvp`` of the loss. Each must match the reference to its dtype's rounding.


def hvp_reverse_over_reverse(params, vector, inputs, targets):
    _, vjp_fn = vjp(lambda p: grad(loss_fn)(p, inputs, targets), params)
    (product,) = vjp_fn(vector)
    return product


def hvp_reverse_over_forward(params, vector, inputs, targets):
    def directional_derivative(p):
        return jvp(lambda q: loss_fn(q, inputs, targets), (p,), (vector,))[1]

    return grad(directional_derivative)(params)


hvp_methods = {"forward-over-reverse": hvp_forward_over_reverse,
               "reverse-over-reverse": hvp_reverse_over_reverse,
               "reverse-over-forward": hvp_reverse_over_forward}  # fmt: skip
for dtype, bound in [(torch.float64, 1e-14), (torch.float32, 1e-5)]:
    for method, hvp_fn in hvp_methods.items():
        cast = [{n: t.to(dtype) for n, t in d.items()} for d in (params, direction)]
        result = hvp_fn(*cast, inputs.to(dtype), targets)
        check_each_tensor(f"{method} ({str(dtype)[6:]})", result, reference_hvp, bound)

# %%
# The gradient, the product, the loss and the logits from one call
# ----------------------------------------------------------------
# A training step that also wants curvature need not run the model twice: ``jvp`` with
# ``has_aux=True`` passes through the loss and logits that :func:`~torch.func.grad_and_value`
# returns beside the gradient. One call, one forward (a hook counts), returns all four.


def loss_and_logits(params, inputs, targets):
    logits = functional_call(model, params, (inputs,))
    return F.cross_entropy(logits, targets), logits


forward_calls = []
hook = model.register_forward_hook(lambda *_: forward_calls.append(1))
gradient, hvp, (loss, logits) = jvp(
    lambda p: grad_and_value(loss_and_logits, has_aux=True)(p, inputs, targets),
    (params,), (direction,), has_aux=True,
)  # fmt: skip
hook.remove()
assert len(forward_calls) == 1, forward_calls
check_each_tensor("gradient from the jvp's primal", gradient,
                  reference_gradient(theta64), bound=1e-5)  # fmt: skip
check_each_tensor("H v from the same call", hvp, reference_hvp, bound=1e-5)
torch.testing.assert_close((loss, logits), (F.cross_entropy(model(inputs), targets),
                                            model(inputs)))  # fmt: skip
print(f"loss {loss.item():.4f} and logits {tuple(logits.shape)}: one forward call")

# %%
# What does a product cost? Count the matrix products
# ---------------------------------------------------
# A dispatch mode of our own adds up the FLOPs of the matrix products a call runs, noting those
# with an all-zero operand (element-wise work is left out). It must agree with ``FlopCounterMode``
# and, for a gradient, with the closed form: a forward pass (``2·B·n_in·n_out`` per layer), then
# a weight and an input gradient per layer, less the first layer's input gradient.


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
flop_ratios = {m: c.total / gradient_flops for m, c in counted.items()}
for method, c in counted.items():
    print(f"{method}: matrix-product FLOPs {flop_ratios[method]:.2f}x one gradient's, "
          f"{c.zero / c.total:.0%} with an all-zero operand {sorted(c.zero_shapes)}")  # fmt: skip

# %%
# The tangent of ``A B`` is ``dA B + A dB``: two products for each of the gradient's, three
# gradients in all. But part of that multiplies an all-zero tensor the shape of the input batch:
# the inputs are not differentiated, yet eager forward mode gives them a zero tangent and runs
# two first-layer products with it. Without them, it counts exactly reverse-over-reverse's.
fr = counted["forward-over-reverse"]
assert (fr.zero, fr.zero_shapes) == (2 * first_layer, {tuple(inputs.shape)})
assert fr.flops[0] == counted["reverse-over-reverse"].total


# %%
# How fast is it?
# ---------------
# A machine's load drifts, so each of several rounds times one block of gradient calls, then one
# of the product's (``torch.utils.benchmark``); printed: the per-round ratios' median and IQR.
ROUNDS, ratios = 7, {}  # ratios: name -> quartiles of the per-round ratio


def one_block(fn):  # seconds per call, from one block of calls sized by the timer
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=1e-3).median


def quartiles(values):
    return torch.tensor(values).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()


def time_rounds(products, baseline):  # {name: [(baseline's s, product's s) per round]}
    pairs = {name: [] for name in products}
    for _ in range(ROUNDS):
        for name, fn in products.items():
            pairs[name].append((one_block(baseline), one_block(fn)))
    return pairs


def report(name, pairs, baseline, per_product=lambda t: t, shown=None):
    ratios[name] = q = quartiles([per_product(t) / g for g, t in pairs])
    (g1, g, g3), (t1, t, t3) = (quartiles([pair[i] for pair in pairs]) for i in (0, 1))
    shown = shown or (f"{t * 1e3:.1f} ms (IQR {(t3 - t1) * 1e3:.4g} ms) against "
                      f"{baseline} {g * 1e3:.1f} ms (IQR {(g3 - g1) * 1e3:.4g} ms)")  # fmt: skip
    pace = ("no order against the gradient on this run" if q[0] < 1 < q[2] else
            f"takes {q[1]:.2f}x the gradient's time" if q[1] >= 1 else
            f"is {1 / q[1]:.2f}x faster than the gradient")  # fmt: skip
    print(f"{name}: {shown}; {pace} (ratio IQR {q[0]:.2f} to {q[2]:.2f}, "
          f"{len(pairs)} rounds)")  # fmt: skip
    print(f"hvp {name} against {baseline}: {q[1]:.2f} x one gradient")  # a fixed form


arguments = (params, direction, inputs, targets)
calls = {"gradient": lambda: grad(loss_fn)(params, inputs, targets)}
calls |= {method: lambda fn=fn: fn(*arguments) for method, fn in hvp_methods.items()}
eager = time_rounds({m: calls[m] for m in hvp_methods}, calls["gradient"])
for method, pairs in eager.items():
    report(method, pairs, "the eager gradient")

# %%
# Compiled
# --------
# The gradient and reverse-over-reverse, the product with the fewest counted FLOPs, compiled
# (compile time apart); the product is set against the compiled gradient. Dynamo runs a frame
# eager under a Python dispatch mode such as ``FlopCounterMode`` (bar some), and it can stay
# eager afterwards: nothing compiled runs under a counter. The profiler shows compiled code ran
# (a compiled region, no ``aten::tanh``: fused) and lists the ``mm`` and ``addmm`` (no other
# product op): compiled reverse-over-reverse leaves out the weight gradients ``δᵀ h``, the
# gradient's value, which eager ``vjp`` returns as its primal.
PRODUCTS = {"aten::mm": slice(0, 2), "aten::addmm": slice(1, 3)}
MATRIX_OPS = re.compile(r"^\w+::\w*(mm|matmul|linear|dot|mv|gemm|conv|einsum)")


def profiled_products(fn):  # the mm and addmm shapes, event names, other product ops
    with torch.profiler.profile(record_shapes=True) as profile:
        fn()
    events = [e for e in profile.events() if e.name in PRODUCTS]
    shapes = [tuple(map(tuple, e.input_shapes[PRODUCTS[e.name]])) for e in events]
    names = {e.name for e in profile.events()}
    others = {n for n in names if MATRIX_OPS.search(n)} - set(PRODUCTS)
    return collections.Counter(shapes), names, others


def flops_of(shapes):
    return sum(n * 2 * a[0] * a[1] * b[1] for (a, b), n in shapes.items())


cheapest = min(flop_ratios, key=flop_ratios.get)
assert cheapest == "reverse-over-reverse"
compiled = {n: torch.compile(calls[n]) for n in ("gradient", cheapest)}
counters.clear()
start = time.perf_counter()
_, result = compiled["gradient"](), compiled[cheapest]()
compile_s, hits = time.perf_counter() - start, counters["inductor"]["fxgraph_cache_hit"]
graphs, breaks = counters["stats"]["unique_graphs"], counters["graph_break"]
print(f"torch.compile, first calls of both: {compile_s:.1f} s, measured once; {graphs} "
      f"graphs, {sum(breaks.values())} graph breaks, {hits} from Inductor's cache")  # fmt: skip
assert graphs == 2 and not breaks
check_each_tensor("reverse-over-reverse (compiled)", result, reference_hvp, 1e-5)
assert torch._C._len_torch_dispatch_stack() == 0  # no dispatch mode: compiled code runs
name = f"{cheapest} (compiled)"
report(name, time_rounds({name: compiled[cheapest]}, compiled["gradient"])[name],
       "the compiled gradient")  # fmt: skip
weight_gradients = collections.Counter(((m.out_features, len(inputs)),
                                        (len(inputs), m.in_features)) for m in layers)  # fmt: skip
for name, fn in compiled.items():
    eager_shapes = profiled_products(calls[name])[0]
    assert flops_of(eager_shapes) == counted.get(name, on_gradient).total, name
    shapes, events, others = profiled_products(fn)
    assert any("Torch-Compiled Region" in e for e in events), f"{name}: not compiled"
    assert "aten::tanh" not in events and not others, (name, others)
    left_out = weight_gradients if name == cheapest else collections.Counter()
    assert shapes == eager_shapes - left_out, name  # none missing, none added
    flop_ratios[f"{name} (compiled)"] = ratio = flops_of(shapes) / gradient_flops
    print(f"{name} (compiled) ran compiled code: matrix-product FLOPs {ratio:.2f}x one "
          f"gradient's (profiler), leaving out {dict(left_out)}")  # fmt: skip
assert counters["stats"]["unique_graphs"] == 2  # timing compiled nothing new

# %%
# At fixed parameters: pay the first differentiation once
# --------------------------------------------------------
# Power iteration and conjugate gradients take many products at one θ. Two ways pay once what
# depends on θ alone: ``linearize(grad(L), θ)`` traces the ``jvp`` of the gradient and, on its
# first call, folds into constants all that does not depend on the tangent; a kept
# ``vjp(grad(L), θ)`` runs the gradient once and keeps its graph. Each must count the products of
# reverse-over-reverse less a gradient's, none with a zero operand. A first build and call of
# each, at another θ and untimed, pays any one-time setup and measures what it keeps alive (CPU:
# the profiler's bytes allocated less freed; GPU: the change in ``requested_bytes``; checked on
# ``torch.ones(2**20) + 1``, which keeps one of two 4 MiB tensors). At θ, the one-off (building,
# first product) is measured once; amortised: it and ``n − 1`` products, over the sibling's ``n``.
n = SIBLING_POWER_STEPS = 80  # a constant copied from the sibling page
gradient_at = grad(lambda p: loss_fn(p, inputs, targets))


def kept_vjp(p):
    vjp_fn = vjp(gradient_at, p)[1]
    return lambda v: vjp_fn(v)[0]


def once(fn):  # seconds, measured once, and the result
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def kept_mib(fn):  # MiB of the tensors that fn allocates and leaves alive; fn's result
    gc.collect()
    requested = "requested_bytes.all.current"  # on a GPU, the caching allocator's count
    first = torch.cuda.memory_stats()[requested] if device.type == "cuda" else 0
    with torch.profiler.profile(profile_memory=True) as profile:  # on a CPU, logs each
        result = fn()  # allocation and free
        gc.collect()  # cyclic garbage that fn left is not kept
    if device.type == "cuda":
        return (torch.cuda.memory_stats()[requested] - first) / 2**20, result
    return sum(e.self_cpu_memory_usage for e in profile.events()) / 2**20, result


builders = {"linearize": lambda p: linearize(gradient_at, p)[1]}
builders["vjp built once"] = kept_vjp
elsewhere = {name: p + 1e-2 * direction[name] for name, p in params.items()}
built, first_call, product_at, first_product, kept = {}, {}, {}, {}, {}
four_mib = kept_mib(lambda: torch.ones(2**20, device=device) + 1)[0]
print(f"kept by torch.ones(2**20) + 1: {four_mib:.4f} MiB (closed form: 4 MiB)")
assert 4 <= four_mib < 4.01, four_mib
with warnings.catch_warnings():  # the tracer warns about a constant that it folds
    warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")
    for way, build in builders.items():
        kept[way], again = kept_mib(lambda build=build: build(elsewhere))
        kept[way] += kept_mib(lambda f=again: f(direction).clear())[0]  # drops H v
        built[way], product_at[way] = once(lambda build=build: build(params))
        fn = product_at[way]
        first_call[way], first_product[way] = once(lambda fn=fn: fn(direction))
expected = counted["reverse-over-reverse"].total - gradient_flops
for way, fn in product_at.items():
    print(f"{way} at θ: building {built[way] * 1e3:.1f} ms, first product "
          f"{first_call[way] * 1e3:.1f} ms, measured once; keeps {kept[way]:.1f} MiB")  # fmt: skip
    check_each_tensor(way, first_product[way], reference_hvp, bound=1e-5)
    c = count(lambda fn=fn: fn(direction))
    assert (c.total, c.zero) == (expected, 0), (way, c.total, c.zero)
    flop_ratios[f"{way} (per product)"] = c.total / gradient_flops
big, small = sorted(kept, key=kept.get, reverse=True)
print(f"{big} keeps {kept[big] / kept[small]:.1f}x the tensor memory of {small}")
fixed = time_rounds({w: lambda fn=fn: fn(direction) for w, fn in product_at.items()},
                    calls["gradient"])  # fmt: skip
for way, pairs in fixed.items():
    report(f"{way} (per product)", pairs, "the eager gradient")
    one_off = built[way] + first_call[way]
    report(f"{way} (amortised over {n})", pairs, "the eager gradient",
           per_product=lambda t, c=one_off: (c + (n - 1) * t) / n,
           shown=f"one-off {one_off * 1e3:.0f} ms, measured once, + {n - 1} products")  # fmt: skip

# %%
# The fastest of the eager and amortised products (against the eager gradient) is named only
# when its ratio's IQR lies below every other's; if they overlap, they tie. The figure: times
# (bars, median and IQR of the per-round ratio; hatched, one-off included) and counted
# matrix-product FLOPs (diamonds), in gradients. A gap either way means uncounted work sets the
# time, in the product or in its baseline (element-wise passes, the transforms' overhead).
left_out_here = ("per product", "compiled")
contenders = {n: q for n, q in ratios.items() if not any(w in n for w in left_out_here)}
best, *rest = sorted(contenders, key=lambda n: contenders[n][1])
low, mid, high = contenders[best]
ties = [n for n in rest if contenders[n][0] <= high]  # IQRs that overlap the best's
verdict = f"overlapping {', '.join(ties)}: they tie" if ties else "below all others"
print(f"{best}: ratio IQR {low:.2f} to {high:.2f}, {verdict}")
label = "lowest median" if ties else "fastest"
print(f"hvp {label} against the eager gradient ({best}): {mid:.2f} x one gradient")
METHOD_COLORS = {"forward-over-reverse": "#EE3377", "reverse-over-reverse": "#997700",
                 "reverse-over-forward": "#BBCC33", "compiled": "#117733",
                 "linearize": "#CC3311"}  # fmt: skip
names = list(ratios)
keys = [[m for m in METHOD_COLORS if m in n] or ["reverse-over-reverse"] for n in names]
colours = [METHOD_COLORS[k[-1]] for k in keys]  # a kept vjp is reverse-over-reverse
q1, median, q3 = (torch.tensor([ratios[n][i] for n in names]) for i in range(3))
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
hatches = ["//" if "amortised" in name else "" for name in names]
ax.barh(names, median, xerr=[median - q1, q3 - median], color=colours, hatch=hatches)
ax.scatter([flop_ratios.get(n, float("nan")) for n in names], names, marker="D",
           color="black", zorder=3, label="matrix-product FLOPs / one gradient's")  # fmt: skip
ax.axvline(1, color="black", linewidth=1)
ax.invert_yaxis()
ax.set_xlabel("time in gradients, median and IQR (compiled: in compiled gradients)")
ax.set_title(f"Hessian-vector products, {num_params:,} parameters")
fig.legend(loc="outside lower center")
plt.show()

# %%
# What to remember
# ----------------
# * ``jvp(grad(L), (θ,), (v,))`` returns the gradient and ``H v``; ``vjp`` of ``grad`` and
#   ``grad`` of a ``jvp`` give the same product. Check it against float64 autograd.
# * Count matrix products before explaining a cost, and look at what is multiplied: here eager
#   forward mode multiplies an all-zero tangent of the inputs.
# * Call nothing compiled under a dispatch mode (it runs eager, and may stay eager), and check
#   that a timed compiled call ran compiled code.
# * Time a product beside a gradient, over rounds; name a winner only when spreads separate.
#   At fixed θ, build the product once (``linearize`` or a kept ``vjp`` of ``grad``): which
#   to use depends on its one-off cost, the number of products and the memory it keeps.
