"""
Curvature algorithms from Hessian-vector products
=================================================

Many uses of a loss's curvature need only products with the Hessian, never the matrix: the
largest eigenvalue by power iteration, and Newton steps by conjugate gradients (CG). This page
runs both on a model small enough that its dense Hessian can be formed, so that every result is
checked against the dense matrix. It then shows why a Newton solver wants the Gauss-Newton
matrix instead of the Hessian: CG needs a positive-definite matrix, the Hessian here is not
one, and the Gauss-Newton matrix, whose product is a ``jvp`` and a ``vjp`` of the model, is
positive semi-definite by construction. How to build the Hessian-vector product, and what it
costs on a large model, is the sibling page,
:ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_hessian_vector_products.py`.
"""

# %%
# The recipe: a product, as a function of a flat vector
# -----------------------------------------------------
# Curvature algorithms treat the parameters as one vector of length P. So we flatten the
# parameter dictionary, split a flat vector back into it, and wrap the forward-over-reverse
# product, ``jvp`` of ``grad``, as a function from a flat vector to a flat vector. The model is
# a small ``tanh`` MLP in float64, 8 → 16 → 3, on a batch of 32.
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jvp, vjp
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
# vector: plain autograd, no ``torch.func``, no module. The product must equal the dense
# Hessian times the vector.


def reference_logits(flat):
    p = unflatten(flat)
    hidden = torch.tanh(inputs @ p["0.weight"].T + p["0.bias"])
    return hidden @ p["2.weight"].T + p["2.bias"]


dense_hessian = hessian(lambda flat: loss_fn(unflatten(flat)))(theta)
reference_hessian = torch.autograd.functional.hessian(
    lambda flat: F.cross_entropy(reference_logits(flat), targets), theta
)
hessian_error = (
    (dense_hessian - reference_hessian).norm() / reference_hessian.norm()
).item()
print(f"hessian against autograd's: relative error {hessian_error:.1e}")
assert hessian_error < 3e-14
product_error = (
    (hvp(vector) - reference_hessian @ vector).norm() / vector.norm()
).item()
print(f"P = {num_params}; H v against the dense Hessian times v: {product_error:.1e}")
assert product_error < 5e-15

# %%
# Dense Hessian or products?
# --------------------------
# At this size the dense Hessian is cheap: it does many products' worth of matrix-product
# FLOPs (counted with ``FlopCounterMode``), but in one vectorised call, and its time is a much
# smaller multiple of one product's (both printed): at this size both calls are probably
# dominated by per-operation overhead, not arithmetic. What rules it out for large models is
# its size, P² numbers against a product's P (bytes counted below).


def matmul_flops(fn):
    flop_counter = FlopCounterMode(display=False)
    with flop_counter:
        fn()
    return flop_counter.get_total_flops()


def time_call(fn):
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.2)


def dense_then_product():
    return hessian(lambda flat: loss_fn(unflatten(flat)))(theta) @ vector


dense_time, product_time = time_call(dense_then_product), time_call(lambda: hvp(vector))
flop_ratio = matmul_flops(dense_then_product) / matmul_flops(lambda: hvp(vector))
print(
    f"dense Hessian then times v: {dense_time.median * 1e3:.2f} ms "
    f"(IQR {dense_time.iqr * 1e3:.2f} ms); one product: {product_time.median * 1e3:.2f} ms "
    f"(IQR {product_time.iqr * 1e3:.2f} ms)"
)
print(
    f"dense / product: {dense_time.median / product_time.median:.2f}x the time, "
    f"{flop_ratio:.1f}x the matrix-product FLOPs"
)
print(
    f"dense Hessian: {dense_hessian.numel() * dense_hessian.element_size():,} bytes; "
    f"one product: {vector.numel() * vector.element_size():,} bytes"
)

# %%
# The top eigenvalue by power iteration
# -------------------------------------
# Repeated products ``v ← H v / ‖H v‖`` turn ``v`` towards the eigenvector whose eigenvalue
# has the largest magnitude, and the Rayleigh quotient ``vᵀ H v`` converges to that eigenvalue
# (the "sharpness" that studies of training dynamics track). Its error shrinks by about
# ``(λ₂/λ₁)²`` per product, where λ₂ is the next eigenvalue in magnitude, so a small gap takes
# many products. We check the eigenvalue against :func:`torch.linalg.eigh` of the dense
# reference, the direction against its eigenvector, and the rate against the eigenvalues.
eigenvalues, eigenvectors = torch.linalg.eigh(reference_hessian)
by_magnitude = eigenvalues.abs().argsort(descending=True)
top, top_value = by_magnitude[0], eigenvalues[by_magnitude[0]].item()
rate = (eigenvalues[by_magnitude[1]] / top_value).item() ** 2


def power_iteration(product, steps):
    generator = torch.Generator().manual_seed(3)
    current = torch.randn(num_params, generator=generator, dtype=torch.float64).to(
        device
    )
    current /= current.norm()
    estimates = []
    for _ in range(steps):
        image = product(current)
        estimates.append(torch.dot(current, image).item())
        current = image / image.norm()
    return estimates, current


estimates, top_vector = power_iteration(hvp, steps=80)
errors = [abs(estimate - top_value) / abs(top_value) for estimate in estimates]
alignment = torch.dot(top_vector, eigenvectors[:, top]).abs().item()
half = len(errors) // 2
measured_rate = (errors[-1] / errors[half]) ** (1 / max(len(errors) - 1 - half, 1))
print(
    f"the error shrinks by {measured_rate:.3f} per product over the last half; "
    f"(λ₂/λ₁)² = {rate:.3f}"
)
print(
    f"power iteration, {len(estimates)} products: {estimates[-1]:.10f}; eigh: "
    f"{top_value:.10f} (relative error {errors[-1]:.1e}); "
    f"|cos| with its eigenvector 1 - {1 - alignment:.1e}"
)
assert (
    errors[-1] < 1e-4 and 1 - alignment < 1e-3 and abs(measured_rate / rate - 1) < 0.05
)

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


_, hessian_residuals, hessian_stopped = conjugate_gradients(hvp)
met = "met" if hessian_stopped else "did not meet"
print(
    f"CG on H + λI: {met} non-positive curvature after {len(hessian_residuals)} steps"
)
assert hessian_stopped

# %%
# Gauss-Newton products
# ---------------------
# The generalised Gauss-Newton matrix ``G = Jᵀ H_L J`` keeps the curvature that comes through
# the loss (``J``: the Jacobian of the logits with respect to the parameters; ``H_L``: the
# Hessian of the loss with respect to the logits) and drops the model's own second
# derivatives. For cross-entropy ``H_L`` is positive semi-definite, so ``G`` is too, and
# ``G + λI`` is positive definite for any λ > 0. Its product needs no second derivative of the
# model: a ``jvp`` of the logits gives ``J v``; for softmax cross-entropy averaged over B
# samples, ``H_L`` acts per sample as ``(diag(p) − p pᵀ) / B``; a ``vjp`` applies ``Jᵀ``.


def ggn_product(vector):
    def logits_fn(p):
        return functional_call(model, p, (inputs,))

    logits, logits_tangent = jvp(logits_fn, (params,), (unflatten(vector),))
    probs = logits.softmax(dim=-1)
    weighted = probs * logits_tangent
    loss_curvature = (weighted - probs * weighted.sum(-1, keepdim=True)) / len(inputs)
    _, vjp_fn = vjp(logits_fn, params)
    return flatten(vjp_fn(loss_curvature)[0])


# %%
# The check is the explicit matrix, from plain autograd on the hand-written forward:
# :func:`torch.autograd.functional.jacobian` of the logits for ``J``, and
# :func:`torch.autograd.functional.hessian` of the loss as a function of the logits for
# ``H_L``.
jacobian = torch.autograd.functional.jacobian(reference_logits, theta)
jacobian = jacobian.reshape(-1, num_params)
logits = reference_logits(theta)
loss_hessian = torch.autograd.functional.hessian(
    lambda z: F.cross_entropy(z.view_as(logits), targets), logits.reshape(-1)
)
explicit_ggn = jacobian.T @ loss_hessian @ jacobian
expected = explicit_ggn @ vector
ggn_error = ((ggn_product(vector) - expected).norm() / expected.norm()).item()
ggn_eigenvalues = torch.linalg.eigvalsh(explicit_ggn + damping * identity)
print(f"G v against the explicit Jᵀ H_L J v: relative error {ggn_error:.1e}")
print(f"G + λI: smallest eigenvalue {ggn_eigenvalues.min().item():.2e}, none negative")
assert ggn_error < 3e-14 and ggn_eigenvalues.min() > 0

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
assert not ggn_stopped and step_error < 3e-11
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
# Counted in matrix-product FLOPs, against one gradient of this model: the GGN product, the
# two Hessian products that differentiate the gradient (forward-over-reverse, used above, and
# reverse-over-reverse, ``vjp`` of ``grad``), and the two forward passes inside the GGN
# product (one as the ``jvp``'s primal, one to build the ``vjp``). The check: the GGN product
# counts within 10% of reverse-over-reverse. It is not cheaper than the cheaper Hessian
# product; what it buys is a matrix that CG can solve with.
gradient_flops = matmul_flops(lambda: grad(loss_fn)(params))
counted = {
    "GGN": matmul_flops(lambda: ggn_product(vector)),
    "forward-over-reverse": matmul_flops(lambda: hvp(vector)),
    "reverse-over-reverse": matmul_flops(
        lambda: vjp(grad(loss_fn), params)[1](unflatten(vector))
    ),
    "two forward passes": 2 * matmul_flops(lambda: loss_fn(params)),
}
for name, flops in counted.items():
    print(f"{name}: {flops / gradient_flops:.2f}x one gradient's matrix-product FLOPs")
assert abs(counted["GGN"] / counted["reverse-over-reverse"] - 1) < 0.1

# %%
# What to remember
# ----------------
# * With only ``H v`` (``jvp`` of ``grad``, on a flat vector), power iteration finds the top
#   eigenvalue, its error shrinking by ``(λ₂/λ₁)²`` per product; check it against ``eigh`` of a
#   small model's dense Hessian.
# * Before CG on ``H + λI``, count its negative eigenvalues on a small model: with some left,
#   CG meets non-positive curvature and must stop.
# * The Gauss-Newton product ``Jᵀ H_L J v`` is a ``jvp`` and a ``vjp`` of the logits around
#   ``H_L``; check it against the explicit matrix built by autograd.
# * Damped CG on the Gauss-Newton matrix reaches the dense solve and a descent direction;
#   count its product's FLOPs against a gradient's rather than assume them.
