"""
Jacobians and Hessians: ``jacrev``, ``jacfwd`` and ``hessian``
==============================================================

A Jacobian holds the derivative of every output of a function with respect to every input, and
a Hessian the second derivatives; you need them for sensitivity analysis, Newton steps and
curvature. On this page you compute the Jacobian of a small layer with ``jacrev`` and
``jacfwd``, check every entry against the formula, see how each engine builds it (``jacrev``
row by row, ``jacfwd`` column by column), compute Hessians by composing the two, and then
count and time the work to find which engine wins for tall and for wide Jacobians.
"""

# %%
# Setup
# -----
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.set_float32_matmul_precision("highest")  # no TF32 on GPUs: the checks see float32

# %%
# A layer and its exact Jacobian
# ------------------------------
# One dense layer, *f(x) = tanh(W x + b)*, with 12 outputs and 16 inputs: different sizes, so a
# transposed Jacobian has the wrong shape. Differentiating by hand gives
# ``∂f_i/∂x_k = (1 − f_i²) W_ik``, which we evaluate in float64 as the reference.
num_outputs, num_inputs = 12, 16
weight = torch.randn(num_outputs, num_inputs, device=device) / num_inputs**0.5
bias = torch.randn(num_outputs, device=device)
x = torch.randn(num_inputs, device=device)


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


def exact_jacobian64(weight, bias, x):
    outputs64 = layer(weight.double(), bias.double(), x.double())
    return (1 - outputs64**2)[:, None] * weight.double()


jacobian_reference = exact_jacobian64(weight, bias, x)

# %%
# Every check compares entry by entry, ``|error| ≤ atol + rtol·|ref|``, so one wrong entry
# fails it. The tolerances sit within about 100x of float32 rounding; each check prints its share.


def check_entries(name, result, reference64, rtol=1e-5, atol=1e-6, quiet=False):
    torch.testing.assert_close(result.double(), reference64, rtol=rtol, atol=atol)
    error = (result.double() - reference64).abs()
    used = (error / (atol + rtol * reference64.abs())).max().item()
    if not quiet:
        print(f"{name:>15}: largest error {error.max():.1e} ({used:.1%} of tolerance)")


# %%
# The recipe: ``jacrev`` and ``jacfwd``
# -------------------------------------
# :func:`~torch.func.jacrev` (reverse mode) and :func:`~torch.func.jacfwd` (forward mode) take a
# function and return a function that computes its Jacobian; ``argnums=2`` picks the argument to
# differentiate, here ``x``. The result has the output axis first, then the input axis. The
# mental model: ``jacrev`` builds the Jacobian row by row, one vector-Jacobian product per
# output; ``jacfwd`` column by column, one Jacobian-vector product per input.
jacobian_rev = jacrev(layer, argnums=2)(weight, bias, x)
jacobian_fwd = jacfwd(layer, argnums=2)(weight, bias, x)
print("Jacobian shape (outputs, inputs):", tuple(jacobian_rev.shape))
check_entries("jacrev", jacobian_rev, jacobian_reference)
check_entries("jacfwd", jacobian_fwd, jacobian_reference)

# %%
# How each engine builds it: rows or columns
# ------------------------------------------
# Row ``i`` of the Jacobian is the vector-Jacobian product (vjp) ``e_iᵀ J``, and column ``k``
# the Jacobian-vector product (jvp) ``J e_k``. ``jacrev`` and ``jacfwd`` hand the whole stack of
# unit vectors to :func:`~torch.func.vmap`, which runs the products as one batched call. Written
# out with :func:`~torch.func.vjp` and :func:`~torch.func.jvp`:
f_of_x = partial(layer, weight, bias)
_, vjp_of_f = vjp(f_of_x, x)
output_basis = torch.eye(num_outputs, device=device)  # the unit vectors e_i
(rows,) = vmap(vjp_of_f)(output_basis)
check_entries("vmap(vjp) rows", rows, jacobian_reference)


def jvp_of_f(tangent):
    return jvp(f_of_x, (x,), (tangent,))[1]


columns = vmap(jvp_of_f)(torch.eye(num_inputs, device=device))  # column k is columns[k]
check_entries("vmap(jvp) cols", columns.T, jacobian_reference)

# %%
# Before ``torch.func``, the row-by-row recipe was a Python loop of backward passes, one per
# output, keeping the graph alive between them. It gives the same rows, one call at a time.


def jacobian_row_by_row(weight, bias, x):
    x = x.detach().requires_grad_()
    y = layer(weight, bias, x)
    unit_vectors = torch.eye(y.numel(), device=y.device)
    return torch.stack(
        [torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in unit_vectors]
    )


check_entries("row by row", jacobian_row_by_row(weight, bias, x), jacobian_reference)

# %%
# Jacobians with respect to the parameters
# ----------------------------------------
# ``argnums`` also takes a tuple. With respect to the weight, the Jacobian has shape
# ``(outputs, *weight.shape)``: ``∂f_i/∂W_jk = (1 − f_i²) δ_ij x_k``; with respect to the bias,
# ``∂f_i/∂b_j = (1 − f_i²) δ_ij``. Each is checked against its own formula.
jacobian_weight, jacobian_bias = jacrev(layer, argnums=(0, 1))(weight, bias, x)
slope64 = 1 - layer(weight.double(), bias.double(), x.double()) ** 2
identity64 = torch.eye(num_outputs, device=device, dtype=torch.float64)
weight_reference = torch.einsum("i,ij,k->ijk", slope64, identity64, x.double())
check_entries("d f / d weight", jacobian_weight, weight_reference)
check_entries("d f / d bias", jacobian_bias, torch.diag(slope64))

# %%
# Hessians: a Jacobian of a Jacobian
# ----------------------------------
# Any pair of engines computes a Hessian. :func:`~torch.func.hessian` is
# ``jacfwd(jacrev(f))``: reverse mode inside, where the function has many inputs and few
# outputs, forward mode outside, where the inner Jacobian is tall. We take a wider layer, 128
# inputs to 32 outputs, and check all four orders against the exact Hessian
# ``∂²f_i/∂x_k∂x_l = −2 f_i (1 − f_i²) W_ik W_il``, a (32, 128, 128) tensor.
hess_weight = torch.randn(32, 128, device=device) / 128**0.5
hess_bias, hess_x = torch.randn(32, device=device), torch.randn(128, device=device)
hess_outputs64 = layer(hess_weight.double(), hess_bias.double(), hess_x.double())
hessian_reference = torch.einsum(
    "i,ik,il->ikl",
    -2 * hess_outputs64 * (1 - hess_outputs64**2),
    hess_weight.double(),
    hess_weight.double(),
)
hessian_orders = {
    "hessian": hessian(layer, argnums=2),
    "jacfwd(jacfwd)": jacfwd(jacfwd(layer, argnums=2), argnums=2),
    "jacrev(jacrev)": jacrev(jacrev(layer, argnums=2), argnums=2),
    "jacrev(jacfwd)": jacrev(jacfwd(layer, argnums=2), argnums=2),
}
hessians = {
    order: fn(hess_weight, hess_bias, hess_x) for order, fn in hessian_orders.items()
}
for order, result in hessians.items():
    check_entries(order, result, hessian_reference)

# %%
# The entry-by-entry check is strict enough to see one wrong entry: scaling only the largest
# entry of the Hessian by 1.01 makes it fail, however many entries the tensor has and however
# small its relative norm error stays.
tampered = hessians["hessian"].clone()
largest = torch.unravel_index(hessian_reference.abs().argmax(), tampered.shape)
tampered[largest] *= 1.01
norm_error = (
    (tampered.double() - hessian_reference).norm() / hessian_reference.norm()
).item()
try:
    check_entries("tampered", tampered, hessian_reference)
except AssertionError as caught:
    assert "Mismatched elements: 1 /" in str(caught), caught
    print(
        f"one of {tampered.numel()} entries 1% off fails the check "
        f"(relative norm error only {norm_error:.1e})"
    )
else:
    raise AssertionError("a 1% change of one Hessian entry went unnoticed")

# %%
# How much work? Counting it
# --------------------------
# The mental model predicts the arithmetic: each vjp or jvp through the layer is one
# vector-matrix product with ``W``, ``2 · inputs · outputs`` FLOPs. We count the matrix-product
# FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` on a tall Jacobian (32 inputs,
# 1024 outputs) and a wide one (the reverse) and divide by that unit. On a GPU, both sides of
# every shape are scaled up, so that arithmetic rather than launch overhead can matter.
scale = 1 if device.type == "cpu" else 4
tall_inputs, tall_outputs = 32 * scale, 1024 * scale


def random_layer(inputs, outputs):
    return (
        torch.randn(outputs, inputs, device=device) / inputs**0.5,
        torch.randn(outputs, device=device),
        torch.randn(inputs, device=device),
    )


def matmul_flops(call):
    with FlopCounterMode(display=False) as flop_counter:
        call()
    return flop_counter.get_total_flops()


def products_through_weight(engine, args):
    """Matrix-product FLOPs of one Jacobian, in units of one vector through the weight."""
    outputs, inputs = args[0].shape
    flops = matmul_flops(partial(engine(layer, argnums=2), *args))
    return flops / (2 * inputs * outputs)


for inputs, outputs in [(tall_inputs, tall_outputs), (tall_outputs, tall_inputs)]:
    args = random_layer(inputs, outputs)
    rev_products = products_through_weight(jacrev, args)
    fwd_products = products_through_weight(jacfwd, args)
    print(
        f"{inputs} in, {outputs} out: jacrev {rev_products:.0f} products, "
        f"jacfwd {fwd_products:.0f} products"
    )
    # jacrev: one vjp per output row, plus one product (the forward pass). jacfwd: one jvp
    # per input column, plus two products, as many as two forward passes.
    assert rev_products == outputs + 1 and fwd_products == inputs + 2

# %%
# So in arithmetic, ``jacrev`` costs in proportion to the outputs and ``jacfwd`` to the inputs:
# a tall Jacobian should favour ``jacfwd`` and a wide one ``jacrev``. Whether the time follows
# the arithmetic is measured next.

# %%
# How fast is it?
# ---------------
# Times are medians of :class:`torch.utils.benchmark.Timer` runs in this build, each with its
# interquartile range (IQR). First the small layer: the Python loop of backward passes against
# one batched call.


def median_and_iqr_ms(call, min_run_time=0.3):
    threads = torch.get_num_threads()
    timer = benchmark.Timer("call()", globals={"call": call}, num_threads=threads)
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return measurement.median * 1e3, measurement.iqr * 1e3


small_times = {
    "row by row": median_and_iqr_ms(lambda: jacobian_row_by_row(weight, bias, x)),
    "vmap(vjp)": median_and_iqr_ms(lambda: vmap(vjp(f_of_x, x)[1])(output_basis)),
    "jacrev": median_and_iqr_ms(lambda: jacrev(layer, argnums=2)(weight, bias, x)),
}
for method, (ms, iqr) in small_times.items():
    speedup = small_times["row by row"][0] / ms
    print(f"{method:>10}: {ms:6.3f} ms (IQR {iqr:.3f} ms), {speedup:.2f}x row by row")

# %%
# Tall, wide, and the shapes between
# ----------------------------------
# Now a sweep: the Jacobian keeps ``32 · 1024`` entries while its shape runs from wide
# (1024 inputs, 32 outputs) to tall (32 inputs, 1024 outputs). For each shape both engines are
# checked against the formula, their products counted and their times measured.
sweep_inputs = [tall_outputs // 2**step for step in range(6)]  # 1024, 512, ..., 32
aspect_ratios = []
counted, timed = {"jacrev": [], "jacfwd": []}, {"jacrev": [], "jacfwd": []}
for inputs in sweep_inputs:
    outputs = tall_inputs * tall_outputs // inputs
    args = random_layer(inputs, outputs)
    aspect_ratios.append(outputs / inputs)
    line = f"{inputs:5d} in, {outputs:5d} out:"
    for name, engine in [("jacrev", jacrev), ("jacfwd", jacfwd)]:
        jacobian = engine(layer, argnums=2)(*args)
        check_entries(name, jacobian, exact_jacobian64(*args), quiet=True)
        counted[name].append(products_through_weight(engine, args))
        timed[name].append(median_and_iqr_ms(partial(engine(layer, argnums=2), *args)))
        ms, iqr = timed[name][-1]
        line += f"  {name} {ms:7.2f} ms (IQR {iqr:.2f})"
    time_ratio = timed["jacfwd"][-1][0] / timed["jacrev"][-1][0]
    flop_ratio = counted["jacfwd"][-1] / counted["jacrev"][-1]
    print(f"{line}  jacfwd/jacrev: time {time_ratio:.2f}x, FLOPs {flop_ratio:.2f}x")

# %%
# Where do they cross?
# --------------------
# Counted in FLOPs, the engines tie at a square Jacobian. For the time, we fit a straight line
# to ``log(time(jacfwd) / time(jacrev))`` against ``log(outputs / inputs)`` over the whole
# sweep, rather than look for a sign change between two neighbours, which noise could place
# anywhere, and take the shape where the line crosses 1. A slope near −1 means the time follows
# the FLOPs; a shallower slope means a cost that does not grow with the products dominates
# (probably per-call overhead and how well each engine's matrix shapes suit the kernels; this
# page does not measure those).
log_aspect = torch.tensor(aspect_ratios, dtype=torch.float64).log()
log_time_ratio = torch.tensor(
    [fwd[0] / rev[0] for fwd, rev in zip(timed["jacfwd"], timed["jacrev"])],
    dtype=torch.float64,
).log()
design = torch.stack([log_aspect, torch.ones_like(log_aspect)], dim=1)
solution = torch.linalg.lstsq(design, log_time_ratio[:, None]).solution
fit_slope, fit_intercept = solution[:, 0]
print(
    f"slope of log(time ratio) against log(aspect ratio): {fit_slope:.2f} (FLOPs: -1)"
)
crossover = torch.exp(-fit_intercept / fit_slope).item() if fit_slope < 0 else None
if crossover is None or not min(aspect_ratios) <= crossover <= max(aspect_ratios):
    crossover = None
    print("no crossover inside the sweep: one engine wins at every shape here")
else:
    print(
        f"jacfwd and jacrev take the same time at about {crossover:.2g} outputs per input"
    )

# %%
# On the left, the counted products; on the right, the measured times with their IQR. Where
# the right panel's lines cross is the crossover on this hardware.
METHOD_COLORS = {
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
}
fig, (ax_flops, ax_time) = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
for name in ("jacrev", "jacfwd"):
    medians = [ms for ms, _ in timed[name]]
    iqrs = [iqr / 2 for _, iqr in timed[name]]
    ax_flops.plot(
        aspect_ratios, counted[name], "o-", color=METHOD_COLORS[name], label=name
    )
    ax_time.errorbar(
        aspect_ratios,
        medians,
        yerr=iqrs,
        fmt="o-",
        color=METHOD_COLORS[name],
        label=name,
    )
for ax in (ax_flops, ax_time):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("Jacobian shape: outputs / inputs")
    ax.axvline(1, color="black", linewidth=0.8, linestyle=":")
if crossover is not None:
    ax_time.axvline(crossover, color="black", linestyle="--", label="crossover (fit)")
ax_flops.legend()
ax_time.legend()
ax_flops.set_ylabel("products through W (counted)")
ax_time.set_ylabel(f"median time (ms), {device.type.upper()}")
ax_flops.set_title("Arithmetic: rows vs columns")
ax_time.set_title("Time")
plt.show()

# %%
# Which order for a Hessian?
# --------------------------
# The four orders checked above, timed on the 128-input, 32-output layer, with their counted
# matrix-product FLOPs, both as multiples of ``hessian``'s.
hessian_flops, hessian_times = {}, {}
for order, fn in hessian_orders.items():
    hessian_flops[order] = matmul_flops(partial(fn, hess_weight, hess_bias, hess_x))
    hessian_times[order] = median_and_iqr_ms(
        partial(fn, hess_weight, hess_bias, hess_x), min_run_time=0.5
    )
for order, (ms, iqr) in hessian_times.items():
    time_ratio = ms / hessian_times["hessian"][0]
    flop_ratio = hessian_flops[order] / hessian_flops["hessian"]
    print(
        f"{order:>14}: {ms:8.2f} ms (IQR {iqr:.2f} ms), {time_ratio:.2f}x the time "
        f"and {flop_ratio:.2f}x the FLOPs of hessian"
    )

# %%
# Are the orders ranked the same way by time and by counted FLOPs? Where they are not, the
# matrix products are not what sets the time at this size; the rest probably goes to elementwise
# work and to moving large intermediate tensors, which this page does not measure. The bars
# below have a logarithmic axis.
by_time = sorted(hessian_times, key=lambda order: hessian_times[order][0])
print("fastest to slowest:", ", ".join(by_time))
print("fewest to most FLOPs:", ", ".join(sorted(hessian_flops, key=hessian_flops.get)))
fig, ax = plt.subplots(figsize=(7, 2.8), layout="constrained")
time_ratios = [ms / hessian_times["hessian"][0] for ms, _ in hessian_times.values()]
# jacfwd(jacfwd) and jacrev(jacrev) take the colour of their single engine.
order_colors = [
    METHOD_COLORS[colour]
    for colour in ("hessian", "jacfwd", "jacrev", "jacrev(jacfwd)")
]
bars = ax.barh(list(hessian_times), time_ratios, color=order_colors)
ax.bar_label(
    bars,
    labels=[
        f"{t:.2f}x time, {hessian_flops[o] / hessian_flops['hessian']:.2f}x FLOPs"
        for o, t in zip(hessian_times, time_ratios)
    ],
    padding=4,
)
ax.set_xscale("log")
ax.set_xlim(min(time_ratios) / 2, max(time_ratios) * 30)
ax.invert_yaxis()
ax.set_xlabel("median time, as a multiple of hessian's")
ax.set_title("Hessian of a 128 → 32 layer: (32, 128, 128) entries")
plt.show()

# %%
# What to remember
# ----------------
# * ``jacrev(f, argnums=i)`` and ``jacfwd(f, argnums=i)`` give the (outputs, inputs) Jacobian;
#   check it entry by entry (``torch.testing.assert_close``) against a float64 reference.
# * ``jacrev`` runs one vjp per output (row), ``jacfwd`` one jvp per input (column), batched by
#   ``vmap``: the counted FLOPs follow outputs and inputs exactly.
# * Counted in FLOPs, tall Jacobians favour ``jacfwd`` and wide ones ``jacrev``; the time sets
#   the crossover, so time both engines on your own shapes, as the sweep does.
# * ``hessian`` is ``jacfwd(jacrev(f))``. All four orders agree entry by entry, but their
#   counted FLOPs differ widely and need not rank them as the time does: time the orders on
#   your own function.
