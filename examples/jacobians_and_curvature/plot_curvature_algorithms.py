"""
Curvature algorithms from Hessian-vector products
=================================================

Many uses of a loss's curvature need only products with the Hessian, never the matrix: the
largest eigenvalue by power iteration, and Newton steps by conjugate gradients (CG). This page
runs both on a model small enough to form its dense Hessian, and checks every result against it.
It then shows why a Newton solver wants the Gauss-Newton matrix instead: CG needs a matrix that
is positive definite, the Hessian here is not, and the Gauss-Newton matrix, whose product is a
``jvp`` and a ``vjp`` of the model, is positive semi-definite by construction. All products are
taken at one θ, so a solver pays once what depends on θ alone. The product on a large model:
:ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_hessian_vector_products.py`.
"""

# %%
# The recipe: a product, as a function of a flat vector
# -----------------------------------------------------
# Curvature algorithms treat the parameters as one vector of length P. So we flatten the
# parameter dictionary, split a flat vector back into it, and wrap the forward-over-reverse
# product, ``jvp`` of ``grad``, as a function from a flat vector to a flat vector. The model is
# a small ``tanh`` MLP in float64, 8 → 16 → 3, on a batch of 32.
import math
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jvp, linearize, vjp
from torch.utils.benchmark import Timer
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double().to(device)
params = {name: tensor.detach() for name, tensor in model.named_parameters()}
inputs = torch.randn(32, 8, dtype=torch.float64, device=device)
targets = torch.randint(0, 3, (32,), device=device)
shapes = {name: p.shape for name, p in params.items()}


def unflatten(flat):
    pieces = flat.split([shape.numel() for shape in shapes.values()])
    return {name: piece.view(shapes[name]) for name, piece in zip(shapes, pieces)}


def flatten(tree):
    return torch.cat([tree[name].reshape(-1) for name in shapes])


def loss_fn(params):
    return F.cross_entropy(functional_call(model, params, (inputs,)), targets)


def hvp(vector):
    _, product = jvp(grad(loss_fn), (params,), (unflatten(vector),))
    return flatten(product)


theta = flatten(params)
num_params = len(theta)
vector = torch.randn(num_params, dtype=torch.float64, device=device)

# %%
# The check: the dense Hessian, two ways
# --------------------------------------
# :func:`~torch.func.hessian` of the flat loss is the dense (P, P) matrix (it is
# ``jacfwd(jacrev(f))``: one ``jvp`` through the gradient per parameter, all P of them
# vectorised into one call). The independent reference is
# :func:`torch.autograd.functional.hessian` of the same loss written out by hand from the flat
# vector: plain autograd, no ``torch.func``, no module. The product must equal ``H @ v``.


def reference_logits(flat):
    p = unflatten(flat)
    hidden = torch.tanh(inputs @ p["0.weight"].T + p["0.bias"])
    return hidden @ p["2.weight"].T + p["2.bias"]


dense_hessian = hessian(lambda flat: loss_fn(unflatten(flat)))(theta)
reference_hessian = torch.autograd.functional.hessian(
    lambda flat: F.cross_entropy(reference_logits(flat), targets), theta
)


def relative_error(result, reference, bound, what):
    error = ((result - reference).norm() / reference.norm()).item()
    print(f"{what}: relative error {error:.1e} (bound {bound:.0e})")
    assert error < bound, what


relative_error(dense_hessian, reference_hessian, 1e-14, "hessian against autograd's")
expected_product = reference_hessian @ vector
relative_error(hvp(vector), expected_product, 1e-14,
               f"P = {num_params}; H v against H @ v")  # fmt: skip

# %%
# Dense Hessian, or products built once at fixed θ
# ------------------------------------------------
# The dense Hessian costs about P linearized products' matrix FLOPs (``FlopCounterMode``), in
# one vectorised call, and holds P² numbers against a product's P. The solvers below take many
# products at one θ, so what depends on θ alone can be paid once: ``linearize`` of the flat
# gradient traces its ``jvp`` and, on its first call, folds into constants all that does not
# depend on the tangent; a kept ``vjp`` of it keeps its graph (``H`` is symmetric, so ``vjp``
# gives ``Hᵀ v = H v``). One-off costs (building, first product) are measured once; the page's
# first ``linearize``, at another θ, is timed apart, as a process's first trace can pay
# one-time setup. Times come from rounds, one block of each call in turn, ratios taken within
# a round (median, IQR). A FLOP rate far below a 256×256 product's means time spent elsewhere.
POWER_STEPS, ROUNDS = 80, 9


def matmul_flops(fn):
    with FlopCounterMode(display=False) as flop_counter:
        fn()
    return flop_counter.get_total_flops()


def one_block(fn):  # seconds per call, from one block of calls sized by the timer
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.01).median


def quartiles(values):
    return torch.tensor(values).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()


def once(fn):  # seconds, measured once, and the result
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def flat_gradient(flat):
    return flatten(grad(loss_fn)(unflatten(flat)))


with warnings.catch_warnings():  # linearize's tracer warns about a folded constant
    warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")
    elsewhere = theta + 1e-2 * vector
    first_linearize = once(lambda: linearize(flat_gradient, elsewhere)[1](vector))[0]
    built = {"linearized": once(lambda: linearize(flat_gradient, theta)[1])}
    built["kept vjp"] = once(lambda: vjp(flat_gradient, theta)[1])
    ways = {"linearized": built["linearized"][1]}
    ways["kept vjp"] = lambda v: built["kept vjp"][1](v)[0]
    first = {way: once(lambda way=way: ways[way](vector)) for way in ways}
print(f"the page's first linearize, at another θ, trace and first product: "
      f"{first_linearize * 1e3:.1f} ms, measured once")  # fmt: skip
setup = {"jvp of grad": 0.0}  # one-off costs; the jvp rebuilt per call has none
for way, (first_call, first_product) in first.items():
    setup[way] = built[way][0] + first_call
    print(f"{way}: building and first product {setup[way] * 1e3:.2f} ms, measured once")
    relative_error(first_product, expected_product, 1e-14, f"{way} H v")


def dense_then_product():
    return hessian(lambda flat: loss_fn(unflatten(flat)))(theta) @ vector


square = torch.randn(256, 256, dtype=torch.float64, device=device)
calls = {"a 256x256 matrix product": lambda: square @ square,
         "dense Hessian, then times v": dense_then_product,
         "jvp of grad": lambda: hvp(vector)}  # fmt: skip
calls |= {way: lambda way=way: ways[way](vector) for way in ways}
times = {name: [] for name in calls}
for _ in range(ROUNDS):
    for name, fn in calls.items():
        times[name].append(one_block(fn))
flops = {name: matmul_flops(fn) for name, fn in calls.items()}
square_name, per_call = "a 256x256 matrix product", "jvp of grad"
assert flops[square_name] == 2 * 256**3  # the counter, on a known answer


def per_round(a, b):  # quartiles of a's time over b's, round by round
    return quartiles([s / t for s, t in zip(times[a], times[b])])


for name, seconds in times.items():
    low, mid, high = quartiles(seconds)
    rate = per_round(square_name, name)[1] * flops[name] / flops[square_name]
    print(f"{name}: {mid * 1e3:.3f} ms (IQR {(high - low) * 1e3:.4g} ms, {ROUNDS} "
          f"rounds); {flops[name]:,} matrix-product FLOPs, {100 * rate:.3g}% of the "
          "256x256 rate")  # fmt: skip
    if name not in (square_name, per_call):
        low, mid, high = per_round(name, per_call)
        words, low, high = ((f"{mid:.2f}x the time of", low, high) if mid >= 1 else
                            (f"{1 / mid:.2f}x faster than", 1 / high, 1 / low))  # fmt: skip
        words = f"no order on this run, median {words}" if low < 1 < high else words
        print(f"{name}: {words} one jvp of grad (ratio IQR {low:.3g} to {high:.3g})")
dense_over_product = flops["dense Hessian, then times v"] / flops["linearized"]
print(f"dense Hessian: {dense_over_product:.1f} linearized products' FLOPs, P = "
      f"{num_params}; {dense_hessian.numel() * dense_hessian.element_size():,} bytes "
      f"against a product's {vector.numel() * vector.element_size():,}")  # fmt: skip
assert num_params <= dense_over_product < 1.1 * num_params

# %%
# ``n`` products cost a way's one-off and ``n − 1`` more (``n`` for the ``jvp`` rebuilt per call).
# From this run's medians and one-offs (each measured once), the page finds the rough count beyond
# which one way costs less than another, and the way (or tie) with the lowest ``POWER_STEPS`` total.
median = {way: quartiles(times[way])[1] for way in setup}
c = {way: setup[way] - median[way] * (way != per_call) for way in setup}
for a, b in [("kept vjp", per_call), ("linearized", per_call),
             ("linearized", "kept vjp")]:  # fmt: skip
    n = (c[b] - c[a]) / ((median[a] - median[b]) or 1e-30)  # where the totals cross
    lower = min((a, b), key=median.get)  # the cheaper beyond the crossing
    where = (f"beyond {math.floor(n)} product{'s' * (n >= 2)}" if n > 1
             else "from the first product")  # fmt: skip
    print(f"{a} against {b}: on this run, {lower} costs less in all {where}")
totals = {way: quartiles([setup[way] + (POWER_STEPS - (way != per_call)) * t
                          for t in times[way]]) for way in setup}  # fmt: skip
for way, (low, mid, high) in totals.items():
    print(f"{POWER_STEPS} products by {way}: {mid:.3g} s in all (IQR {high - low:.3g} s, "
          "from the products alone: the one-off is measured once)")  # fmt: skip
best, *rest = sorted(totals, key=lambda way: totals[way][1])
ties = [way for way in rest if totals[way][0] <= totals[best][2]]
verdict = f"tying with {', '.join(ties)}" if ties else "the cheapest here"
print(f"the solvers below use {best}, {verdict} on this run's one-offs")
hvp_at_theta = ways.get(best, hvp)

# %%
# The top eigenvalue by power iteration
# -------------------------------------
# Repeated products ``v ← H v / ‖H v‖`` turn ``v`` towards the eigenvector whose eigenvalue
# has the largest magnitude, and the Rayleigh quotient ``vᵀ H v`` converges to that eigenvalue.
# Studies of training dynamics track the largest eigenvalue (the "sharpness"); here the two
# coincide, as it is positive (asserted). The error shrinks by about ``(λ₂/λ₁)²`` per product,
# λ₂ being the next eigenvalue in magnitude, so a small gap takes many products. We check the
# eigenvalue against :func:`torch.linalg.eigh` of the dense reference, the direction against
# its eigenvector, and the rate against the eigenvalues.
eigenvalues, eigenvectors = torch.linalg.eigh(reference_hessian)
by_magnitude = eigenvalues.abs().argsort(descending=True)
top, top_value = by_magnitude[0], eigenvalues[by_magnitude[0]].item()
rate = (eigenvalues[by_magnitude[1]] / top_value).item() ** 2
assert top_value == eigenvalues.max().item() > 0  # also the largest eigenvalue


def power_iteration(product, steps):
    generator = torch.Generator().manual_seed(3)
    current = torch.randn(num_params, generator=generator, dtype=torch.float64)
    current = (current / current.norm()).to(device)
    estimates = []
    for _ in range(steps):
        image = product(current)
        estimates.append(torch.dot(current, image).item())
        current = image / image.norm()
    return estimates, current


estimates, top_vector = power_iteration(hvp_at_theta, steps=POWER_STEPS)
errors = [abs(estimate - top_value) / abs(top_value) for estimate in estimates]
alignment = torch.dot(top_vector, eigenvectors[:, top]).abs().item()
half = len(errors) // 2
measured_rate = (errors[-1] / errors[half]) ** (1 / max(len(errors) - 1 - half, 1))
print(f"the error shrinks by {measured_rate:.3f} per product over the last half; "
      f"(λ₂/λ₁)² = {rate:.3f}")  # fmt: skip
print(f"power iteration, {len(estimates)} products: {estimates[-1]:.10f}; eigh: "
      f"{top_value:.10f} (relative error {errors[-1]:.1e}); "
      f"|cos| with its eigenvector 1 - {1 - alignment:.1e}")  # fmt: skip
assert errors[-1] < 1e-4 and 1 - alignment < 1e-3
assert abs(measured_rate / rate - 1) < 0.05

METHOD_COLORS = {"hessian": "#56B4E9", "GGN": "#EE8866"}
fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
steps = range(1, len(errors) + 1)
ax.semilogy(steps, errors, color=METHOD_COLORS["hessian"], label="power iteration")
ax.semilogy(steps, [errors[0] * rate**k for k in steps], "--", color="black",
            label="(λ₂/λ₁)² per product")  # fmt: skip
ax.set_xlabel("Hessian-vector products")
ax.set_ylabel("relative error of the top eigenvalue")
ax.set_title(f"Power iteration against eigh, P = {num_params}")
ax.legend()
plt.show()

# %%
# Newton steps by conjugate gradients
# -----------------------------------
# A damped Newton step solves ``(H + λI) d = −g``. CG solves it with one product per step
# and never forms ``H``, but it assumes ``H + λI`` is positive definite: each step divides by
# the curvature ``pᵀ(H + λI)p`` along its search direction. This Hessian has negative
# eigenvalues, and a damping small enough to keep the step close to Newton's can leave some of
# them negative. Here λ is a hundredth of the largest eigenvalue; we count the eigenvalues of
# ``H + λI`` that remain negative, and run CG until it meets a non-positive curvature, where a
# Newton-CG solver must stop.
gradient = flatten(grad(loss_fn)(params))
damping = 1e-2 * eigenvalues.max().item()
identity = torch.eye(num_params, dtype=torch.float64, device=device)
damped_eigenvalues = torch.linalg.eigvalsh(reference_hessian + damping * identity)
negative = int((damped_eigenvalues < 0).sum())
print(f"λ = {damping:.2e}: H + λI has {negative} negative eigenvalues of {num_params}")
assert negative > 0


def conjugate_gradients(product, steps=150, tolerance=1e-13):
    """CG on (A + λI) d = −g from d = 0, until the relative residual is below the
    tolerance; stops early at non-positive curvature."""
    solution, residual = torch.zeros_like(gradient), -gradient
    search, residual_norms = residual.clone(), []
    for _ in range(steps):
        curved = product(search) + damping * search
        curvature = torch.dot(search, curved)
        if curvature <= 0:
            return solution, residual_norms, True
        step = torch.dot(residual, residual) / curvature
        solution = solution + step * search
        new_residual = residual - step * curved
        ratio = torch.dot(new_residual, new_residual) / torch.dot(residual, residual)
        search, residual = new_residual + ratio * search, new_residual
        residual_norms.append((residual.norm() / gradient.norm()).item())
        if residual_norms[-1] < tolerance:
            break
    return solution, residual_norms, False


_, hessian_residuals, hessian_stopped = conjugate_gradients(hvp_at_theta)
met = "met" if hessian_stopped else "did not meet"
print(f"CG on H + λI: {met} non-positive curvature after {len(hessian_residuals)} "
      f"step{'s' * (len(hessian_residuals) != 1)}")  # fmt: skip
assert hessian_stopped

# %%
# Gauss-Newton products
# ---------------------
# The generalised Gauss-Newton matrix ``G = Jᵀ H_L J`` keeps the curvature that comes through
# the loss (``J``: the Jacobian of the logits with respect to the parameters; ``H_L``: the
# Hessian of the loss with respect to the logits) and drops the model's own second
# derivatives. For cross-entropy ``H_L`` is positive semi-definite, so ``G`` is too, and
# ``G + λI`` is positive definite for any λ > 0. Its product needs no second derivative of the
# model: ``J v`` is a ``jvp`` of the logits; for softmax cross-entropy averaged over B
# samples, ``H_L`` acts per sample as ``(diag(p) − p pᵀ) / B``; a ``vjp`` applies ``Jᵀ``. At
# fixed θ both are built once: ``linearize`` for ``J v``, one ``vjp`` call kept for ``Jᵀ``.


def logits_of(flat):
    return functional_call(model, unflatten(flat), (inputs,))


with warnings.catch_warnings():  # the same warning
    warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")
    logits_at_theta, jacobian_times = linearize(logits_of, theta)  # v ↦ J v
_, transposed_jacobian_times = vjp(logits_of, theta)  # u ↦ Jᵀ u
probs = logits_at_theta.softmax(dim=-1)


def ggn_product(vector):
    weighted = probs * jacobian_times(vector)
    loss_curvature = (weighted - probs * weighted.sum(-1, keepdim=True)) / len(inputs)
    return transposed_jacobian_times(loss_curvature)[0]


# %%
# The check is the explicit matrix, from plain autograd on the hand-written forward:
# :func:`torch.autograd.functional.jacobian` of the logits for ``J``, and
# :func:`torch.autograd.functional.hessian` of the loss as a function of the logits for
# ``H_L``. The product is applied to every column of the identity, which assembles ``G`` from
# the product alone; that matrix must equal the explicit one. Its symmetry and its spectrum
# (no eigenvalue below zero beyond rounding) follow from that equality, so they are only shown.
jacobian = torch.autograd.functional.jacobian(reference_logits, theta)
jacobian = jacobian.reshape(-1, num_params)
logits = reference_logits(theta)
loss_hessian = torch.autograd.functional.hessian(
    lambda z: F.cross_entropy(z.view_as(logits), targets), logits.reshape(-1)
)
explicit_ggn = jacobian.T @ loss_hessian @ jacobian
assembled = torch.stack([ggn_product(column) for column in identity], dim=1)
relative_error(
    assembled, explicit_ggn, 1e-14, f"G from {num_params} products against Jᵀ H_L J"
)
asymmetry = ((assembled - assembled.T).norm() / assembled.norm()).item()
ggn_spectrum = torch.linalg.eigvalsh(assembled)
lowest, highest = ggn_spectrum.min().item(), ggn_spectrum.max().item()
print(f"G: asymmetry {asymmetry:.1e}; eigenvalues from {lowest:.1e} to {highest:.1e}")
ggn_eigenvalues = ggn_spectrum + damping

# %%
# CG on ``G + λI`` runs to the end, and its solution must match a dense solve of the same
# system. It must also be a descent direction, ``gᵀd < 0``, which a positive-definite
# system guarantees.
ggn_step, ggn_residuals, ggn_stopped = conjugate_gradients(ggn_product)
dense_step = torch.linalg.solve(explicit_ggn + damping * identity, -gradient)
step_error = ((ggn_step - dense_step).norm() / dense_step.norm()).item()
print(
    f"CG on G + λI: {len(ggn_residuals)} steps, residual {ggn_residuals[-1]:.1e}, "
    f"relative error against the dense solve {step_error:.1e}"
)
assert not ggn_stopped and step_error < 1e-11
assert torch.dot(gradient, ggn_step) < 0

fig, (ax_spectrum, ax_cg) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
for name, values in [("hessian", damped_eigenvalues), ("GGN", ggn_eigenvalues)]:
    ax_spectrum.plot(values.cpu(), color=METHOD_COLORS[name], label=f"{name} + λI")
ax_spectrum.axhline(0, color="black", linewidth=1)
ax_spectrum.set_xlabel("eigenvalue index (ascending)")
ax_spectrum.set_ylabel("eigenvalue")
ax_spectrum.set_title("Spectra of the damped matrices")
ax_spectrum.legend()
for name, residuals in [("hessian", hessian_residuals), ("GGN", ggn_residuals)]:
    steps = range(1, len(residuals) + 1)
    ax_cg.semilogy(steps, residuals, marker=".", color=METHOD_COLORS[name], label=name)
ax_cg.set_xlabel("CG steps")
ax_cg.set_ylabel("relative residual")
ax_cg.set_title("CG stops on the Hessian, converges on GGN")
ax_cg.legend()
plt.show()

# %%
# What a Gauss-Newton product costs
# ---------------------------------
# Counted in matrix-product FLOPs, per product at fixed θ, against one gradient of this model,
# and each checked against a closed form in the two layers' forward products, ``f₁`` and
# ``f₂`` (``2·B·n_in·n_out`` each):
#
# * the gradient: the forward pass, ``f₁ + f₂``, then the second layer's weight and input
#   gradients and the first layer's weight gradient, ``f₂ + f₂ + f₁``;
# * the Hessian product built once, by ``linearize`` or a kept ``vjp``: two products for each
#   of those (``dA B + A dB``, or the cotangents of ``A`` and ``B``), except those that would
#   reach the inputs, which are not differentiated: ``2f₁ + 6f₂``;
# * the GGN product: ``J v``, ``f₁ + 2f₂``, and ``Jᵀ u``, ``f₁ + 2f₂``. It lacks the two
#   products of the Hessian's that multiply the loss's gradient at the logits, ``δ``, by a
#   tangent (``δᵀ dh`` and ``δ dW₂``): terms of the model's own second derivatives.
#
# The ``jvp`` of ``grad`` rebuilt per call is counted beside them.
layers = [m for m in model if isinstance(m, nn.Linear)]
f1, f2 = (2 * len(inputs) * m.in_features * m.out_features for m in layers)
counted = {"gradient": matmul_flops(lambda: grad(loss_fn)(params)),
           "jvp of grad, per call": flops["jvp of grad"],
           "linearized Hessian product": flops["linearized"],
           "kept vjp Hessian product": flops["kept vjp"],
           "GGN product": matmul_flops(lambda: ggn_product(vector))}  # fmt: skip
for name, count in counted.items():
    print(f"{name}: {count / counted['gradient']:.2f} gradients' matrix-product FLOPs")
assert counted["gradient"] == 2 * f1 + 3 * f2
assert flops["linearized"] == flops["kept vjp"] == 2 * f1 + 6 * f2
assert counted["GGN product"] == 2 * f1 + 4 * f2

# %%
# What to remember
# ----------------
# * With only ``H v`` (``jvp`` of ``grad``, on a flat vector), power iteration finds the top
#   eigenvalue, its error shrinking by ``(λ₂/λ₁)²`` per product; check it against ``eigh`` of a
#   small model's dense Hessian.
# * At a fixed θ, build the product once (``linearize`` the gradient, or keep one ``vjp`` of
#   it): each product then runs only what depends on ``v``. Which way costs less depends on
#   its one-off cost and the number of products: measure both, as here.
# * Before CG on ``H + λI``, count its negative eigenvalues on a small model: with some left,
#   CG meets non-positive curvature and must stop.
# * The Gauss-Newton product ``Jᵀ H_L J v`` is a ``jvp`` and a ``vjp`` of the logits around
#   ``H_L``; assemble it from products on a small model and check it against the explicit
#   matrix. Damped CG on it reaches the dense solve.
