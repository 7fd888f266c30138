"""
Hessian-vector products of a loss
=================================

The Hessian of a loss with respect to a model's P parameters has P² entries, far too many to
form for a real network, yet Newton-type optimisers, sharpness measures and influence functions
all need curvature. What they use is the Hessian *times a vector*, ``H v``, which never forms
``H``. This page builds that product for an MLP's loss three ways, from
:func:`~torch.func.grad`, :func:`~torch.func.jvp` and :func:`~torch.func.vjp`, checks each one
tensor by tensor against a float64 finite difference of ordinary gradients, and measures what
each costs against one gradient: in time, eager and compiled, and in matrix-product FLOPs,
counted and set beside the time. The sibling page,
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
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, grad_and_value, jvp, vjp
from torch.utils.benchmark import Timer
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# A smooth MLP (``tanh``, so that the Hessian exists everywhere and a finite difference of
# gradients is a fair reference) on flattened 28×28 inputs, a batch of 128, mean
# cross-entropy.
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
print({name: tuple(t.shape) for name, t in product.items()})

# %%
# The check: a central difference of ordinary gradients, in float64
# -----------------------------------------------------------------
# ``(g(θ + εv) − g(θ − εv)) / 2ε`` tends to ``H v`` as ε → 0. The gradients come from plain
# autograd in float64 through a forward written out by hand: no ``torch.func``, no module.
# Each tensor of the product is compared with the reference on its own. A product computed in
# float64 must agree to the finite difference's own accuracy; in float32, to float32's.


def reference_gradient(params, inputs, targets):
    leaves = [p.detach().double().requires_grad_() for p in params.values()]
    hidden = inputs.double()
    for layer in range(0, len(leaves), 2):
        hidden = torch.tanh(hidden) if layer else hidden
        hidden = hidden @ leaves[layer].T + leaves[layer + 1]
    loss = F.cross_entropy(hidden, targets)
    return dict(zip(params, torch.autograd.grad(loss, leaves)))


def finite_difference_hvp(params, vector, inputs, targets, step=1e-4):
    up, down = (
        reference_gradient(
            {
                n: p.double() + sign * step * vector[n].double()
                for n, p in params.items()
            },
            inputs,
            targets,
        )
        for sign in (1, -1)
    )
    return {name: (up[name] - down[name]) / (2 * step) for name in params}


def check_each_tensor(what, result, reference, bound):
    assert result.keys() == reference.keys(), what
    errors = {}
    for name, ref in reference.items():
        assert result[name].shape == ref.shape, (what, name)
        errors[name] = ((result[name].double() - ref).norm() / ref.norm()).item()
        assert errors[name] < bound, (
            f"{what}: {name} has relative error {errors[name]:.2e}"
        )
    worst_name = max(errors, key=errors.get)
    print(
        f"{what:34s} worst tensor {worst_name}: relative error {errors[worst_name]:.1e}"
    )


reference_hvp = finite_difference_hvp(params, direction, inputs, targets)
check_each_tensor("forward-over-reverse", product, reference_hvp, bound=1e-5)

# %%
# Two more ways to build the product
# ----------------------------------
# * **reverse-over-reverse**: ``H`` is symmetric, so ``H v = Hᵀ v`` is a vector-Jacobian
#   product of the gradient: ``vjp(grad(L), θ)`` applied to ``v``. This is what
#   ``torch.autograd.grad(g, θ, v)`` with ``create_graph=True`` does.
# * **reverse-over-forward**: the directional derivative ``θ ↦ ∇L(θ)·v`` is a scalar, one
#   ``jvp`` of the loss; its gradient is ``H v``.
#
# All three are checked in float64 first, where they must match the finite difference to its
# own accuracy (its error is of order ε², here ε = 1e-4, plus rounding), and then in float32.


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
params64 = {name: p.double() for name, p in params.items()}
direction64 = {name: d.double() for name, d in direction.items()}
for method, hvp_fn in hvp_methods.items():
    result = hvp_fn(params64, direction64, inputs.double(), targets)
    check_each_tensor(f"{method} (float64)", result, reference_hvp, bound=1e-8)
for method, hvp_fn in hvp_methods.items():
    result = hvp_fn(params, direction, inputs, targets)
    check_each_tensor(f"{method} (float32)", result, reference_hvp, bound=1e-5)

# %%
# The check can fail. ``jvp`` returns the pair (value, tangent); keeping the value gives the
# gradient, not ``H v``, and the check says so.
mistaken = jvp(lambda p: grad(loss_fn)(p, inputs, targets), (params,), (direction,))[0]
try:
    check_each_tensor("the gradient, taken for H v", mistaken, reference_hvp, 1e-5)
except AssertionError as error:
    print("caught:", error)
    assert "has relative error" in str(error)
else:
    raise AssertionError("the gradient passed for a Hessian-vector product")

# %%
# The gradient, the product and the logits from one call
# ------------------------------------------------------
# A training step that also wants curvature should not run the model twice. With
# ``has_aux=True``, :func:`~torch.func.grad` lets the loss return extra outputs (here the
# logits) and passes them through; ``jvp`` with ``has_aux=True`` passes them on again. So one
# forward-over-reverse call returns the gradient (the ``jvp``'s primal), ``H v`` (its tangent)
# and the logits. :func:`~torch.func.grad_and_value` returns the loss beside the gradient.


def loss_and_logits(params, inputs, targets):
    logits = functional_call(model, params, (inputs,))
    return F.cross_entropy(logits, targets), logits


gradient_and_logits = grad(loss_and_logits, has_aux=True)
gradient, hvp, logits = jvp(
    lambda p: gradient_and_logits(p, inputs, targets),
    (params,),
    (direction,),
    has_aux=True,
)
(gradient_again, (loss, logits_again)) = grad_and_value(loss_and_logits, has_aux=True)(
    params, inputs, targets
)
reference = reference_gradient(params, inputs, targets)
check_each_tensor("gradient from the jvp's primal", gradient, reference, bound=1e-5)
check_each_tensor("gradient from grad_and_value", gradient_again, reference, bound=1e-5)
check_each_tensor("H v from the same call", hvp, reference_hvp, bound=1e-5)
torch.testing.assert_close(logits, model(inputs))
torch.testing.assert_close(logits_again, logits)
torch.testing.assert_close(loss, F.cross_entropy(model(inputs), targets))
print(f"loss {loss.item():.4f} and logits {tuple(logits.shape)} came back with them")

# %%
# What does a product cost? Count the matrix products
# ---------------------------------------------------
# ``FlopCounterMode`` counts the FLOPs of every matrix product a call runs (the element-wise
# work it leaves out is probably a small share in an MLP this wide). A gradient is a forward pass
# (``2·B·n_in·n_out`` per layer) and a backward pass that takes two products per layer (the
# weight's gradient and the input's), except that nothing needs the first layer's input
# gradient: we check the count against that closed form. Forward-over-reverse must then count
# exactly three gradients: the tangent of a product ``A B`` is ``dA B + A dB``, two products
# for each one of the gradient's.


def matmul_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


layers = [m for m in model if isinstance(m, nn.Linear)]
forward_flops = sum(2 * len(inputs) * m.in_features * m.out_features for m in layers)
first_input_gradient = 2 * len(inputs) * layers[0].in_features * layers[0].out_features
gradient_flops = matmul_flops(lambda: grad(loss_fn)(params, inputs, targets))
assert gradient_flops == 3 * forward_flops - first_input_gradient, gradient_flops
flop_ratios = {
    method: matmul_flops(lambda fn=fn: fn(params, direction, inputs, targets))
    / gradient_flops
    for method, fn in hvp_methods.items()
}
assert flop_ratios["forward-over-reverse"] == 3.0
print(f"one gradient: {gradient_flops / 1e9:.3f} GFLOP in matrix products")
for method, ratio in flop_ratios.items():
    print(f"{method}: matrix-product FLOPs {ratio:.2f}x one gradient's")


# %%
# How fast is it?
# ---------------
# Each product against one gradient, timed with :class:`torch.utils.benchmark.Timer` in the
# same run. Then under :func:`torch.compile`, which may fuse element-wise work (``tanh``, its
# derivatives, the tangent updates); the counter shows whether it changes the matrix products.
# Compiling takes time of its own (printed below), so the page compiles only the gradient and
# the product with the fewest counted FLOPs, checks that product, and compares it with the
# compiled gradient. Each ratio is printed as ``hvp NAME: R.RR x one gradient``.


def time_call(fn):
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.3)


def call_with(fn, *arguments):
    return lambda: fn(*arguments)


arguments = (params, direction, inputs, targets)
calls = {"gradient": call_with(grad(loss_fn), params, inputs, targets)}
calls.update({method: call_with(fn, *arguments) for method, fn in hvp_methods.items()})
cheapest = min(flop_ratios, key=flop_ratios.get)
compiled_gradient = call_with(torch.compile(grad(loss_fn)), params, inputs, targets)
compiled_product = call_with(torch.compile(hvp_methods[cheapest]), *arguments)
compile_start = time.perf_counter()
compiled_gradient()
check_each_tensor(f"{cheapest} (compiled)", compiled_product(), reference_hvp, 1e-5)
print(
    f"torch.compile: first calls of both, measured once: "
    f"{time.perf_counter() - compile_start:.1f} s"
)
calls["gradient (compiled)"] = compiled_gradient
calls[f"{cheapest} (compiled)"] = compiled_product
compiled_ratio = matmul_flops(compiled_product) / matmul_flops(compiled_gradient)
print(
    f"{cheapest} (compiled): matrix-product FLOPs {compiled_ratio:.2f}x one gradient's"
)
assert compiled_ratio == flop_ratios[cheapest]  # the same products, compiled or not
flop_ratios[f"{cheapest} (compiled)"] = compiled_ratio

measurements = {name: time_call(fn) for name, fn in calls.items()}
time_ratios = {}
for name, m in measurements.items():
    print(f"{name:34s} {m.median * 1e3:7.2f} ms (IQR {m.iqr * 1e3:.2f} ms)")
for name, m in measurements.items():
    if not name.startswith("gradient"):
        baseline = "gradient (compiled)" if "compiled" in name else "gradient"
        time_ratios[name] = m.median / measurements[baseline].median
        print(f"hvp {name}: {time_ratios[name]:.2f} x one gradient")

# %%
# The figure sets each product's time (bars) beside its counted matrix-product FLOPs
# (diamonds), both in units of one gradient. Where a bar ends near its diamond, the ratio of
# times is the ratio of matrix-product work; a gap is everything else (element-wise passes,
# the transforms' overhead), which compiling can shrink and which the FLOPs do not count.
METHOD_COLORS = {
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
}
fig, ax = plt.subplots(figsize=(7.5, 3.2), layout="constrained")
rows = range(len(time_ratios))
names = list(time_ratios)
ax.barh(
    rows,
    [time_ratios[name] for name in names],
    color=[METHOD_COLORS[name.removesuffix(" (compiled)")] for name in names],
    hatch=["//" if "compiled" in name else "" for name in names],
)
ax.scatter(
    [flop_ratios[name] for name in names],
    rows,
    marker="D",
    color="black",
    zorder=3,
    label="matrix-product FLOPs / one gradient's",
)
ax.axvline(1, color="black", linewidth=1)
ax.set_yticks(rows, names)
ax.invert_yaxis()
ax.set_xlabel("time / one gradient's (bars; hatched: both compiled)")
ax.set_title(
    f"Hessian-vector products, {num_params:,} parameters, {device.type.upper()}"
)
fig.legend(loc="outside lower center")
plt.show()

# %%
# Reading the numbers: a gradient is one forward and one backward pass, and each product adds a
# second differentiation on top of it. Forward-over-reverse doubles every matrix product of the
# gradient (exactly 3x, as checked); reverse-over-reverse runs the gradient once, recording it,
# then a backward pass through that record; the product that counts the fewest FLOPs is the one
# compiled (named above). How close each bar comes to its diamond varies with the hardware and the
# load, which is why the times are printed rather than a ranking asserted.

# %%
# What to remember
# ----------------
# * ``jvp(grad(L), (θ,), (v,))`` returns the gradient and ``H v``; ``vjp`` of ``grad`` and
#   ``grad`` of a ``jvp`` give the same product, checked per tensor against a float64 central
#   difference of ordinary gradients.
# * Check a float32 product against that float64 difference; check it in float64 too, where
#   the bound can be tight.
# * Count a product's matrix-product FLOPs with ``FlopCounterMode`` and print them beside its
#   time, both in units of one gradient: the count says which multiple to expect, and why.
# * ``has_aux=True`` on ``grad`` and ``jvp`` brings the logits back with the gradient and
#   ``H v`` from one call.
