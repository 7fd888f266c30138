"""
A physics-informed network: the PDE residual inside the loss
============================================================

A physics-informed neural network (PINN) learns the solution of a differential equation from
the equation itself: its loss holds the equation's residual, made of derivatives of the
network's output with respect to its input *coordinates*, at many points. On this page you
write the network as a function of two scalar coordinates ``x`` and ``t``, take ``∂u/∂t`` and
``∂²u/∂x²`` with ``grad(..., argnums=...)``, nested and mapped over points with ``vmap``, and
get the gradient and the Hessian from one ``jacfwd(..., has_aux=True)`` call. You check them,
and the gradient of the loss with respect to the parameters, against float64 autograd loops and
finite differences, then train the network with Adam and L-BFGS until it matches the
closed-form solution of the heat equation.
"""

# %%
# Setup
# -----
import copy
import math

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, grad, jacfwd, vmap
from torch.utils.benchmark import Measurement, Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# The heat equation, and its solution
# -----------------------------------
# A rod on ``0 ≤ x ≤ 1`` starts with the temperature ``u(x, 0) = sin(πx)``, its ends are held
# at zero, and heat diffuses: ``∂u/∂t = κ ∂²u/∂x²`` with ``κ = 0.1``, for ``0 ≤ t ≤ 1``. The
# solution is ``u = exp(−κπ²t) sin(πx)``: the sine keeps its shape and decays. The network never
# sees it; it is kept to judge the result. What the network sees is the equation at 256 random
# *collocation* points inside the domain, the initial values at 64 points on ``t = 0``, and the
# zero at 64 points on the two ends. The points are drawn on the CPU, the same on every device.
diffusivity = 0.1


def exact_solution(x, t):
    return torch.exp(-diffusivity * math.pi**2 * t) * torch.sin(math.pi * x)


draw = torch.Generator().manual_seed(0)
inside_x, inside_t = torch.rand(2, 256, generator=draw).to(device)
start_x = torch.rand(64, generator=draw).to(device)
end_x = (torch.arange(64) % 2).float().to(device)  # x = 0 and x = 1, in turn
end_t = torch.rand(64, generator=draw).to(device)


# %%
# The network as a function of scalar coordinates
# -----------------------------------------------
# A small tanh network maps a point ``(x, t)`` to ``u``; tanh, because the loss needs second
# derivatives, and a ReLU network's are zero almost everywhere.
# :func:`~torch.func.functional_call` runs it with the parameters we pass, so
# ``u(x, t, params)`` is a plain function, and one of *scalar* coordinates:
# :func:`~torch.func.grad` needs a scalar output, and ``argnums=0`` or ``1`` picks the
# coordinate to differentiate by. ``u_xx`` is ``grad`` of ``u_x``, and :func:`~torch.func.vmap`
# maps the residual over the points, sharing the parameters (``in_dims=None``). Given tensors
# of points instead of scalars, ``u`` also evaluates a batch.
layers = [nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
model = nn.Sequential(*layers).to(device)


def u(x, t, params):
    return functional_call(model, params, (torch.stack([x, t], dim=-1),)).squeeze(-1)


u_x = grad(u, argnums=0)
u_t = grad(u, argnums=1)
u_xx = grad(u_x, argnums=0)  # grad(grad(u, argnums=0), argnums=0)


def residual(x, t, params):
    return u_t(x, t, params) - diffusivity * u_xx(x, t, params)


residuals = vmap(residual, in_dims=(0, 0, None))

# %%
# The loss adds the mean squared residual, the error on the initial values and the values at
# the ends. Called with the module's own parameters, which require gradients, it is recorded
# by ordinary autograd *through* the nested transforms, so ``loss.backward()`` gives the
# gradient an optimiser needs; the check below confirms it.


def pinn_loss(params):
    pde = residuals(inside_x, inside_t, params)
    start = u(start_x, torch.zeros_like(start_x), params) - torch.sin(math.pi * start_x)
    ends = u(end_x, end_t, params)
    return pde.square().mean() + start.square().mean() + ends.square().mean()


first_loss = pinn_loss(dict(model.named_parameters()))
print(f"loss of the untrained network {first_loss.item():.3f}")


# %%
# The gradient and the Hessian from one call: ``has_aux``
# -------------------------------------------------------
# Sometimes every first and second derivative is wanted: the gradient ``(u_x, u_t)`` and the
# Hessian ``[[u_xx, u_xt], [u_tx, u_tt]]``. Written as a function of the point ``(x, t)``,
# ``grad`` gives the gradient; :func:`~torch.func.jacfwd` of that gives the Hessian,
# forward-over-reverse. With ``has_aux=True`` a function returns a second output that
# ``jacfwd`` passes through without differentiating it; returning the gradient there too gives
# both from one call.
def u_at(point, params):
    return u(point[0], point[1], params)


def gradient_twice(point, params):
    gradient = grad(u_at)(point, params)
    return gradient, gradient  # the first is differentiated, the second passed through


hessian_and_gradient = jacfwd(gradient_twice, has_aux=True)
point = torch.tensor([0.3, 0.6], device=device)
one_hessian, one_gradient = hessian_and_gradient(point, dict(model.named_parameters()))
print(f"at (x, t) = (0.3, 0.6): gradient {tuple(one_gradient.shape)}, "
      f"Hessian {tuple(one_hessian.shape)}")  # fmt: skip


# %%
# The check: float64 autograd loops, and a finite difference
# ----------------------------------------------------------
# The reference runs a float64 copy of the same untrained network on one point at a time:
# :func:`torch.autograd.grad` with ``create_graph=True`` for the gradient, then once per
# coordinate again for the rows of the Hessian. It shares no code with the transforms, not even
# ``u``. Every entry is compared on its own: ``|error| ≤ atol + rtol·|reference|``, the bounds
# a few times the float32 rounding measured; the share of its bound the worst entry uses is
# printed.
def derivatives_by_loop(net, xs, ts):
    """The gradient and the Hessian of net at each point, one autograd.grad at a time."""
    gradients, hessians = [], []
    for x, t in zip(xs.tolist(), ts.tolist()):
        where = torch.tensor([x, t], dtype=torch.float64, requires_grad=True)
        (first,) = torch.autograd.grad(net(where).squeeze(), where, create_graph=True)
        rows = [
            torch.autograd.grad(first[i], where, retain_graph=True)[0] for i in (0, 1)
        ]
        gradients.append(first.detach())
        hessians.append(torch.stack(rows))
    return torch.stack(gradients), torch.stack(hessians)


def within_bound(what, got, reference, atol, rtol=0.0):
    error = (got.detach().cpu().double() - reference).abs()
    share = error.div(atol + rtol * reference.abs()).max().item()
    print(f"{what:40s} worst error {error.max().item():.1e}, {share:4.0%} of the bound")
    assert share <= 1, f"{what}: an entry is at {share:.2f} times its bound"


net64 = copy.deepcopy(model).to("cpu", torch.float64)
check_x, check_t = torch.rand(2, 32, generator=draw)
ref_gradients, ref_hessians = derivatives_by_loop(net64, check_x, check_t)

untrained = {name: p.detach() for name, p in model.named_parameters()}
xs, ts = check_x.to(device), check_t.to(device)
for name, fn, reference in (
    ("u_x = grad(u, argnums=0)", u_x, ref_gradients[:, 0]),
    ("u_t = grad(u, argnums=1)", u_t, ref_gradients[:, 1]),
    ("u_xx = grad(u_x, argnums=0)", u_xx, ref_hessians[:, 0, 0]),
):
    got = vmap(fn, in_dims=(0, 0, None))(xs, ts, untrained)
    within_bound(name, got, reference, 1.5e-7)
hessians, gradients = vmap(hessian_and_gradient, in_dims=(0, None))(
    torch.stack([xs, ts], dim=1), untrained
)
within_bound("gradient, has_aux output of jacfwd", gradients, ref_gradients, 1.5e-7)
within_bound("Hessian, from the same jacfwd call", hessians, ref_hessians, 1.5e-7)

# %%
# The loop differentiates the same network; a central finite difference checks the
# derivatives themselves, without autograd. In float64 (``functional_call`` accepts float64
# parameters for the float32 module), at one point, with steps ``h`` small enough that rounding
# dominates: the bounds are five times rounding's ``ε|u|/h`` and ``4ε|u|/h²``, not fitted:
# ``u_t ≈ (u(x, t + h) − u(x, t − h)) / 2h`` (``u_x`` likewise) and
# ``u_xx ≈ (u(x + h, t) − 2u(x, t) + u(x − h, t)) / h²``.
params64 = {name: p.to("cpu", torch.float64) for name, p in untrained.items()}
x0, t0 = torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.6, dtype=torch.float64)


def at(x, t):
    return u(x, t, params64)


h1, h2 = 1e-5, 1e-4
by_difference = {
    "u_x": (at(x0 + h1, t0) - at(x0 - h1, t0)) / (2 * h1),
    "u_t": (at(x0, t0 + h1) - at(x0, t0 - h1)) / (2 * h1),
    "u_xx": (at(x0 + h2, t0) - 2 * at(x0, t0) + at(x0 - h2, t0)) / h2**2,
}
rounding = torch.finfo(torch.float64).eps * abs(at(x0, t0).item())
bounds = {
    "u_x": 5 * rounding / h1,
    "u_t": 5 * rounding / h1,
    "u_xx": 20 * rounding / h2**2,
}
for name, fn in (("u_x", u_x), ("u_t", u_t), ("u_xx", u_xx)):
    got, bound = fn(x0, t0, params64), bounds[name]
    within_bound(
        f"{name} in float64 vs a finite difference", got, by_difference[name], bound
    )


# %%
# The check: the gradient of the loss with respect to the parameters
# ------------------------------------------------------------------
# The optimiser's gradient is where a PINN goes wrong silently: detached copies of the parameters
# for the residual alone leave it out of the gradient, and training still runs. The reference
# computes the same loss in float64 with the loop above (``create_graph=True`` keeps each residual
# differentiable), then one :func:`torch.autograd.grad` for the parameters. Each parameter tensor
# is compared entry by entry, with ``atol`` scaled to the tensor's largest entry.
def loss_by_loop(net):
    pde = []
    for x, t in zip(inside_x.tolist(), inside_t.tolist()):
        where = torch.tensor([x, t], dtype=torch.float64, requires_grad=True)
        (first,) = torch.autograd.grad(net(where).squeeze(), where, create_graph=True)
        (second,) = torch.autograd.grad(first[0], where, create_graph=True)
        pde.append(first[1] - diffusivity * second[0])
    start = torch.stack([start_x, torch.zeros_like(start_x)], dim=1).cpu().double()
    start_error = net(start).squeeze(1) - torch.sin(math.pi * start[:, 0])
    ends = net(torch.stack([end_x, end_t], dim=1).cpu().double())
    return (
        torch.stack(pde).square().mean()
        + start_error.square().mean()
        + ends.square().mean()
    )


ref_grads = torch.autograd.grad(loss_by_loop(net64), list(net64.parameters()))
model.zero_grad()
pinn_loss(dict(model.named_parameters())).backward()
for (name, p), reference in zip(model.named_parameters(), ref_grads):
    scale = reference.abs().max().item()
    within_bound(f"d loss / d {name}", p.grad, reference, 1e-6 * scale)

# %%
# Training: Adam, then L-BFGS
# ---------------------------
# 300 steps of ``torch.optim.Adam``, with a learning rate that decays along a cosine, bring
# the network near the solution; ``torch.optim.LBFGS``, a quasi-Newton method, then
# refines it (a common pairing for PINNs). L-BFGS evaluates the loss several times per iteration,
# so it takes a ``closure``; every evaluation's loss is kept for the curve.
history = []


def loss_and_backward(optimizer):
    optimizer.zero_grad()
    loss = pinn_loss(dict(model.named_parameters()))
    loss.backward()
    history.append(loss.item())
    return loss


adam_steps = 300
adam = torch.optim.Adam(model.parameters(), lr=1e-2)
cosine = torch.optim.lr_scheduler.CosineAnnealingLR(adam, T_max=adam_steps)
for step in range(adam_steps):
    loss_and_backward(adam)
    adam.step()
    cosine.step()
    if step % 100 == 0:
        print(f"Adam step {step:3d}: loss {history[-1]:.2e}")
lbfgs = torch.optim.LBFGS(
    model.parameters(), max_iter=300, history_size=50, line_search_fn="strong_wolfe"
)
lbfgs.step(lambda: loss_and_backward(lbfgs))
print(f"after Adam: loss {history[adam_steps - 1]:.2e}; after "
      f"{len(history) - adam_steps} L-BFGS evaluations: loss {history[-1]:.2e}")  # fmt: skip

# %%
# The result, against the closed form
# ------------------------------------
# On a 51 × 51 grid over ``(x, t)``, the relative L2 error ``‖u − u_exact‖ / ‖u_exact‖``.
# The bounds here and below were chosen from runs with four seeds (of the network's
# initialisation and of the points) tried off the page, each well below them.
grid_x, grid_t = torch.meshgrid(
    torch.linspace(0, 1, 51), torch.linspace(0, 1, 51), indexing="ij"
)
grid_x, grid_t = grid_x.to(device), grid_t.to(device)
exact = exact_solution(grid_x, grid_t)
trained = {name: p.detach() for name, p in model.named_parameters()}
learned = u(grid_x, grid_t, trained)
relative_error = ((learned - exact).norm() / exact.norm()).item()
print(f"relative L2 error of u on the grid: {relative_error:.1e} (bound 5e-03)")
assert relative_error < 5e-3, f"the network is {relative_error:.1e} off the solution"

# %%
# The derivatives were never targets, only the residual they make. The ``has_aux`` call gives
# them at every grid point; it runs under ``torch.no_grad`` here, which stops the recording for
# the parameters while ``grad`` and ``jacfwd`` still differentiate with respect to the point
# (the pitfall on ``torch.no_grad`` in :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`).
# Each is compared with the derivative of the closed form.
grid_points = torch.stack([grid_x.flatten(), grid_t.flatten()], dim=1)
with torch.no_grad():  # no record for the parameters; grad still works inside
    hessians, gradients = vmap(hessian_and_gradient, in_dims=(0, None))(
        grid_points, dict(model.named_parameters())
    )
decay = torch.exp(-diffusivity * math.pi**2 * grid_points[:, 1])
sine, cosine_x = (
    torch.sin(math.pi * grid_points[:, 0]),
    torch.cos(math.pi * grid_points[:, 0]),
)
derivative_checks = {
    "u_x": (gradients[:, 0], math.pi * decay * cosine_x, 1e-2),
    "u_t": (gradients[:, 1], -diffusivity * math.pi**2 * decay * sine, 4e-2),
    "u_xx": (hessians[:, 0, 0], -(math.pi**2) * decay * sine, 5e-2),
}
for name, (got, wanted, bound) in derivative_checks.items():
    error = ((got - wanted).norm() / wanted.norm()).item()
    print(
        f"relative L2 error of {name:4s} on the grid: {error:.1e} (bound {bound:.0e})"
    )
    assert error < bound, f"{name} is {error:.1e} off"
pde_map = (gradients[:, 1] - diffusivity * hessians[:, 0, 0]).reshape(51, 51)
print(f"largest PDE residual on the grid: {pde_map.abs().max().item():.1e}")

# %%
fig, axes = plt.subplots(2, 2, figsize=(9, 6.6), layout="constrained")
box = dict(extent=(0, 1, 0, 1), origin="lower", aspect="auto")
shown = axes[0, 0].imshow(learned.cpu(), cmap="viridis", **box)
fig.colorbar(shown, ax=axes[0, 0], label="u")
axes[0, 0].set_title("learned u(x, t)")
shown = axes[0, 1].imshow((learned - exact).abs().cpu(), cmap="magma", **box)
fig.colorbar(shown, ax=axes[0, 1], label="|u − exact|")
axes[0, 1].set_title(f"error; relative L2 {relative_error:.1e}")
for ax in axes[0]:
    ax.set(xlabel="t", ylabel="x")
for column, marker in zip((0, 25, 50), "os^"):
    when = grid_t[0, column].item()
    axes[1, 0].plot(grid_x[:, 0].cpu(), exact[:, column].cpu(), color="black", lw=1)
    axes[1, 0].plot(grid_x[::3, 0].cpu(), learned[::3, column].cpu(), marker, color="black",
                    mfc="none", label=f"learned, t = {when:.1f}")  # fmt: skip
axes[1, 0].set(xlabel="x", ylabel="u", title="slices: closed form (lines), learned")
axes[1, 0].set_ylim(-0.05, 1.35)
axes[1, 0].legend(fontsize=8, loc="upper right")
axes[1, 1].semilogy(history, color="black")
axes[1, 1].axvline(adam_steps, color="0.5", ls="--")
axes[1, 1].text(adam_steps, max(history), " L-BFGS from here", va="top", fontsize=8)
axes[1, 1].set(xlabel="loss evaluation", ylabel="loss", title="training loss")
plt.show()


# %%
# Cost: ``vmap`` of nested ``grad``, or ``autograd.grad`` on the batch
# --------------------------------------------------------------------
# Without ``torch.func``, PINN code runs the network on the whole batch and calls
# :func:`torch.autograd.grad` on the *sum* of the outputs with ``create_graph=True``. That
# gives each point its own derivative only because each output depends on its own point alone
# (no layer mixes the batch); the transforms need no such argument. First the two residuals
# must agree, within 16 float32 epsilons (``2⁻²³``) of the largest ``|u_t| + κ |u_xx|``: the
# residual subtracts two terms of that size, and rounds at their scale. Then each is timed with
# the backward pass for the parameters, as in one training step.
def residuals_by_autograd(xs, ts, params):
    xs, ts = xs.detach().requires_grad_(), ts.detach().requires_grad_()
    outputs = u(xs, ts, params)
    first_x, first_t = torch.autograd.grad(outputs.sum(), (xs, ts), create_graph=True)
    (second_x,) = torch.autograd.grad(first_x.sum(), xs, create_graph=True)
    return first_t - diffusivity * second_x


live = dict(model.named_parameters())
by_transforms = residuals(inside_x, inside_t, live)
by_autograd = residuals_by_autograd(inside_x, inside_t, live)
sizes = [
    vmap(f, in_dims=(0, 0, None))(inside_x, inside_t, live).abs() for f in (u_t, u_xx)
]
scale = (sizes[0] + diffusivity * sizes[1]).max().item()  # the largest |u_t| + κ |u_xx|
within_bound("residuals: transforms vs autograd.grad", by_transforms,
             by_autograd.detach().cpu().double(), 16 * 2**-23 * scale)  # fmt: skip

routes = {
    "vmap of nested grad": residuals,
    "autograd.grad on the sum": residuals_by_autograd,
}
times = {}
for name, route in routes.items():

    def step(route=route):
        loss = route(inside_x, inside_t, live).square().mean()
        return torch.autograd.grad(loss, list(live.values()), allow_unused=True)

    step()  # warm-up
    timer = Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    measured = timer.blocked_autorange(min_run_time=0.5)
    while (
        len(measured.times) < 5
    ):  # enough blocks for a spread, however busy the machine
        more = timer.timeit(measured.number_per_run)
        measured = Measurement.merge([measured, more])[0]
    times[name] = measured
    print(f"{name:25s} residual and parameter gradient: {measured.median * 1e3:.3g} ms "
          f"(IQR {measured.iqr * 1e3:.3g} ms, {len(measured.times)} blocks)")  # fmt: skip
ratio = times["vmap of nested grad"].median / times["autograd.grad on the sum"].median
slower, faster = ("vmap of nested grad", "autograd.grad on the sum")[
    :: 1 if ratio >= 1 else -1
]
print(f"{slower} takes {max(ratio, 1 / ratio):.3g}x the time of {faster}, "
      f"for {len(inside_x)} points on {device.type.upper()}")  # fmt: skip

# %%
# With a network this small, the time of a step is probably mostly per-operation overhead
# rather than arithmetic. The two routes differ in it: the transforms pass each operation
# through their levels of ``vmap`` and ``grad``, and ``residual`` runs the network once for
# ``u_t`` and again for ``u_xx``, where the autograd route runs it once for both. The
# transforms earn their keep where the sum trick does not apply or gets awkward: a Hessian per
# point, mixed derivatives, a model that mixes points. For the Laplacian in many dimensions,
# and what each way of computing it costs, see
# :ref:`sphx_glr_auto_examples_science_plot_forces_and_laplacians.py`.

# %%
# What to remember
# ----------------
# * Write the network as a function of scalar coordinates, ``u(x, t, params)`` through
#   ``functional_call``: ``grad(u, argnums=1)`` is ``u_t``, and
#   ``grad(grad(u, argnums=0), argnums=0)`` is ``u_xx``; ``vmap`` with ``in_dims=(0, 0, None)``
#   maps them over the collocation points.
# * Pass the module's own parameters, not detached copies, and ``loss.backward()`` reaches them
#   through the nested transforms; check that gradient against a float64 loop once.
# * ``jacfwd(f, has_aux=True)``, with ``f`` returning its gradient twice, gives the Hessian and
#   the gradient from one call.
# * Judge a PINN against a closed-form solution on a grid (here a relative L2 error below 5e-3)
#   and its derivatives too, not by its loss alone.
