"""
Jacobian-vector products: forward mode or the double-backward trick
===================================================================

A Jacobian-vector product ``J v`` is the derivative of ``f`` at ``x`` in the direction ``v``.
PyTorch offers four ways to compute one. Two run forward-mode AD: :func:`torch.func.jvp` and
the dual tensors of ``torch.autograd.forward_ad``. Two run reverse mode twice, the
"double-backward trick": :func:`torch.autograd.functional.jvp`, and two calls to
:func:`torch.autograd.grad`. Here you compute ``J v`` all four ways, with respect to inputs
and to parameters, and check each against a closed form and float64 finite differences. You
tell the two kinds apart by the errors they raise on custom functions, and see where each
fails (silently, once). You time them doing the same work on three layers, see what matrix
products each ran, and why the value that ``jvp(grad(loss))`` returns beside its product can
differ from ``grad(loss)`` by rounding, and how to compare it.
"""

# %%
# Setup
# -----
# TF32 stays off on GPUs, so that float32 checks measure float32 rounding.
import copy
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.func import functional_call, grad, jvp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
torch.set_float32_matmul_precision("highest")
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {
    "func.jvp": "#0077BB",
    "forward_ad": "#222255",
    "autograd.functional.jvp": "#7570B3",
    "double-backward trick": "#A6761D",
}

# %%
# The recipe: ``torch.func.jvp``
# ------------------------------
# ``jvp(f, primals, tangents)`` returns ``f(x)`` and ``J v`` together, from one forward pass
# that carries the tangent beside every value. The function here is a small tanh network of its
# input; its Jacobian ``J`` is (64 × 32) per sample. For a linear layer ``J v = W v``, a closed
# form; for the network, a central difference in float64 along ``v`` is the reference.
network = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(),
                              torch.nn.Linear(128, 64)).to(device)  # fmt: skip
inputs = torch.randn(16, 32, device=device)
direction = torch.randn_like(inputs)
value, tangent = jvp(network, (inputs,), (direction,))
print(f"f(x) {tuple(value.shape)}, J v {tuple(tangent.shape)}")


def assert_close(name, got, want, bound):
    error = ((got - want).abs() / (1 + want.abs())).max().item()
    print(f"{name:46s} max error {error:.1e} (bound {bound:.0e})")
    assert error <= bound, (name, error)


def refused(kind, start, call):
    """call() raises exactly kind, its message starting with start."""
    try:
        call()
    except kind as raised:
        assert type(raised) is kind and str(raised).startswith(start), raised
        print(f"  {kind.__name__}: {str(raised)[:72]}...")
        return
    raise AssertionError(f"no {kind.__name__}: {start}")


network64 = copy.deepcopy(network).double()
step = 1e-6
x64, v64 = inputs.double(), direction.double()
difference = (network64(x64 + step * v64) - network64(x64 - step * v64)) / (2 * step)
assert_close("func.jvp vs float64 difference", tangent, difference, 2e-6)
layer = network[0]
_, linear_tangent = jvp(layer, (inputs,), (direction,))
assert_close(
    "func.jvp of a Linear vs W v", linear_tangent, direction @ layer.weight.T, 1e-6
)


# %%
# Four ways, one answer
# ---------------------
# The dual tensors of ``torch.autograd.forward_ad`` are what ``torch.func.jvp`` builds on:
# ``make_dual`` attaches the tangent and ``unpack_dual`` reads it off the output. The
# double-backward trick uses that ``uᵀJ`` is linear in ``u``: backpropagate with a dummy ``u``
# that requires grad, keep that graph (``create_graph=True``), and differentiate ``(uᵀJ)·v`` with
# respect to ``u``, which gives ``J v``. :func:`torch.autograd.functional.jvp` does that for you.
def by_forward_ad(fn, x, v):
    with forward_ad.dual_level():
        return forward_ad.unpack_dual(fn(forward_ad.make_dual(x, v))).tangent


def by_double_backward(fn, x, v):
    x = x.detach().requires_grad_()
    out = fn(x)
    dummy = torch.zeros_like(out, requires_grad=True)
    (u_jacobian,) = torch.autograd.grad(out, x, dummy, create_graph=True)
    return torch.autograd.grad(u_jacobian, dummy, v)[0]


def by_functional(fn, x, v):
    return torch.autograd.functional.jvp(fn, x, v)[1]


def by_func_jvp(fn, x, v):
    return jvp(fn, (x,), (v,))[1]


jvp_routes = {
    "func.jvp": by_func_jvp,
    "forward_ad": by_forward_ad,
    "autograd.functional.jvp": by_functional,
    "double-backward trick": by_double_backward,
}
for name, route in jvp_routes.items():
    assert_close(f"{name} vs float64 difference", route(network, inputs, direction),
                 difference, 2e-6)  # fmt: skip

# %%
# The same with respect to the parameters: :func:`~torch.func.functional_call` makes the
# network a function of a dict of tensors, and the tangent is a dict of the same shapes. The
# reference is a float64 central difference along that direction in parameter space.
params = {name: p.detach() for name, p in network.named_parameters()}
param_direction = {name: torch.randn_like(p) for name, p in params.items()}


def network_at(p, net=network):
    return functional_call(net, p, (inputs.to(next(iter(p.values())).dtype),))


_, param_tangent = jvp(network_at, (params,), (param_direction,))
at64 = {name: p.double() for name, p in params.items()}
shifted = [{name: at64[name] + sign * step * param_direction[name].double() for name in at64}
           for sign in (1, -1)]  # fmt: skip
param_difference = (
    network_at(shifted[0], network64) - network_at(shifted[1], network64)
) / (2 * step)
assert_close(
    "func.jvp in the parameters vs difference", param_tangent, param_difference, 1e-5
)


# %%
# Which way is forward mode? Ask a function with one derivative
# -------------------------------------------------------------
# A custom :class:`torch.autograd.Function` may define only a forward-mode rule (``jvp``) or only
# a reverse-mode one (``backward``). Each route then either works or names the rule it lacks,
# which shows which mode it runs. Both functions compute ``sin`` and their rule is ``cos``.
class SinForwardRule(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, sin_inputs, sin_output):
        ctx.save_for_forward(sin_inputs[0])

    @staticmethod
    def jvp(ctx, x_tangent):
        return ctx.saved_tensors[0].cos() * x_tangent


class SinBackwardRule(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, sin_inputs, sin_output):
        ctx.save_for_backward(sin_inputs[0])

    @staticmethod
    def backward(ctx, out_grad):
        return ctx.saved_tensors[0].cos() * out_grad


LACKS = {SinForwardRule: "You must implement either the backward or vjp",
         SinBackwardRule: "You must implement the jvp function"}  # fmt: skip
point, along = torch.randn(5, device=device), torch.randn(5, device=device)
mode_of = {}
for name, route in jvp_routes.items():
    works = []
    for rule in (SinForwardRule, SinBackwardRule):
        try:
            got = route(rule.apply, point, along)
        except NotImplementedError as error:
            assert type(error) is NotImplementedError, error
            assert str(error).startswith(LACKS[rule]), error
            continue
        assert_close(f"{name} through {rule.__name__}", got, point.cos() * along, 1e-6)
        works.append(rule)
    mode_of[name] = {(SinForwardRule,): "forward", (SinBackwardRule,): "reverse"}[
        tuple(works)
    ]
    print(f"{name:24s} works with {works[0].__name__} only: {mode_of[name]} mode")
assert list(mode_of.values()) == ["forward", "forward", "reverse", "reverse"], mode_of


# %%
# Two consequences. The trick differentiates each ``backward`` with respect to the gradient it
# receives, which a ``backward`` marked ``@once_differentiable`` does not allow:
# :func:`torch.autograd.functional.jvp` then returns zeros without an error, and only
# ``strict=True`` says so. And forward mode needs a forward rule for every
# operator on the path: a few built-in ones lack it, such as ``F.grid_sample``, through which the
# trick works.
class SinOnceDifferentiable(SinBackwardRule):
    @staticmethod
    @once_differentiable
    def backward(ctx, out_grad):
        return ctx.saved_tensors[0].cos() * out_grad


silent = by_functional(SinOnceDifferentiable.apply, point, along)
assert not silent.any(), silent
print(
    f"autograd.functional.jvp through a once-differentiable backward: {silent.tolist()}"
)
strict = partial(torch.autograd.functional.jvp, strict=True)
refused(RuntimeError, "The gradient with respect to the input is independent",
        partial(strict, SinOnceDifferentiable.apply, point, along))  # fmt: skip
image = torch.randn(1, 1, 4, 4, device=device)
sample_grid = torch.rand(1, 3, 3, 2, device=device) * 2 - 1
grid_direction = torch.randn_like(sample_grid)


def sampled(g):
    return F.grid_sample(image.to(g.dtype), g, align_corners=False)


print("func.jvp through F.grid_sample:")
refused(NotImplementedError, "Trying to use forward AD with grid_sampler_2d",
        partial(by_func_jvp, sampled, sample_grid, grid_direction))  # fmt: skip
by_trick = by_double_backward(sampled, sample_grid, grid_direction)
along_grid = (sampled(sample_grid.double() + 1e-6 * grid_direction.double())
              - sampled(sample_grid.double() - 1e-6 * grid_direction.double())) / 2e-6  # fmt: skip
assert_close("double-backward trick through grid_sample", by_trick, along_grid, 1e-5)


# %%
# Measuring: what each way costs
# ------------------------------
# Forward mode does one pass carrying the tangent; the trick runs a forward pass, a backward that
# records its own graph, and a backward through that graph. Which is faster is a measurement, on
# your model and device. Each way runs on the forum question's layer, ``Linear(20, 20)`` with a
# batch of 16, on ``Linear(512, 512)`` and on a 4-layer tanh network of width 512 (batch 64).
# The parameters are frozen (``requires_grad_(False)``): with trainable ones, forward mode would
# also record a graph for its ``J v`` (so that a loss could be trained through it), while the
# trick's ``J v`` carries none, and the two would not do the same work (asserted below). Times
# are medians of :class:`~torch.utils.benchmark.Timer` blocks after a warm-up, on all threads.
def tanh_stack(width, depth):
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
              for _ in range(depth)]  # fmt: skip
    return torch.nn.Sequential(*blocks).to(device)


models = {"Linear(20, 20), batch 16": (torch.nn.Linear(20, 20).to(device), 16, 20),
          "Linear(512, 512), batch 64": (torch.nn.Linear(512, 512).to(device), 64, 512),
          "4 tanh layers of 512, batch 64": (tanh_stack(512, 4), 64, 512)}  # fmt: skip
trainable = models["Linear(20, 20), batch 16"][0]
small_batch = torch.randn(16, 20, device=device)
assert by_func_jvp(trainable, small_batch, small_batch).requires_grad
assert not by_double_backward(trainable, small_batch, small_batch).requires_grad
times = {}
for model_name, (model, rows, width) in models.items():
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())  # the same work for all
    batch, probe = torch.randn(2, rows, width, device=device)
    model64, batch64, probe64 = (
        copy.deepcopy(model).double(),
        batch.double(),
        probe.double(),
    )
    reference = (
        model64(batch64 + step * probe64) - model64(batch64 - step * probe64)
    ) / (2 * step)
    for name, route in jvp_routes.items():
        assert_close(
            f"{name}, {model_name}", route(model, batch, probe), reference, 1e-5
        )
        timer = Timer("route(model, batch, probe)", num_threads=torch.get_num_threads(),
                      globals={"route": route, "model": model, "batch": batch,
                               "probe": probe})  # fmt: skip
        times[model_name, name] = timer.blocked_autorange(min_run_time=0.25)
for model_name in models:
    block = {name: times[model_name, name] for name in jvp_routes}
    fastest = min(block, key=lambda name: block[name].median)
    print(f"{model_name}:")
    for name, measured in block.items():
        ratio = measured.median / block[fastest].median
        print(f"  {name:24s} {measured.median * 1e6:8.0f} µs (IQR "
              f"{measured.iqr * 1e6:.0f}), {ratio:.2f}x the time of {fastest}")  # fmt: skip

fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), layout="constrained")
for ax, model_name in zip(axes, models):
    for row, (name, colour) in enumerate(METHOD_COLORS.items()):
        measured = times[model_name, name]
        levels = torch.tensor([0.25, 0.75], dtype=torch.float64)
        times_us = torch.tensor(measured.times, dtype=torch.float64) * 1e6
        low, high = times_us.quantile(levels).tolist()
        mid = measured.median * 1e6  # with one block, all three are its time
        spread = [[max(mid - low, 0.0)], [max(high - mid, 0.0)]]
        ax.barh(row, measured.median * 1e6, xerr=spread, color=colour, label=name)
    ax.set(
        yticks=[], title=model_name, xlabel="median time (µs), bars to the quartiles"
    )
    ax.invert_yaxis()
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4)
fig.suptitle(f"One J v per call, {device.type.upper()}, parameters frozen")
plt.show()


# %%
# What ran: the matrix products of each way
# -----------------------------------------
# Forward mode is often described as "one pass instead of two". An operator log (a
# ``torch.utils._python_dispatch.TorchDispatchMode`` that records each ATen operator, and
# whether any of its tensor arguments is all zeros) shows what each way ran on the linear layer.
# Checked first on a known answer: ``batch @ weight.T`` must log one ``mm`` and nothing zero.
PRODUCTS = ("mm", "addmm", "bmm")


class OperatorLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []  # (operator name, whether a tensor argument is all zeros)

    def __torch_dispatch__(self, aten_op, types, args=(), kwargs=None):
        name = aten_op.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor) and not a.is_meta]
        zero = name in PRODUCTS and any(not a.any() for a in tensors)
        self.calls.append((name, zero))
        return aten_op(*args, **(kwargs or {}))

    def products(self):
        return [(name, zero) for name, zero in self.calls if name in PRODUCTS]


linear, _, _ = models["Linear(512, 512), batch 64"]
batch, probe = torch.randn(2, 64, 512, device=device)
with OperatorLog() as known:
    batch @ linear.weight.T
assert known.products() == [("mm", False)], known.calls
logs = {}
for name in ("func.jvp", "forward_ad", "double-backward trick"):
    with OperatorLog() as logs[name]:
        jvp_routes[name](linear, batch, probe)
    print(f"{name:22s} matrix products (operator, an all-zero argument): "
          f"{logs[name].products()}")  # fmt: skip
assert logs["func.jvp"].products() == [("addmm", False), ("mm", True), ("mm", False)]
assert logs["double-backward trick"].products() == logs["func.jvp"].products()
assert [op for op, _ in logs["forward_ad"].calls] == [
    op for op, _ in logs["func.jvp"].calls
]

# %%
# **Reading the numbers.** Both ways ran three matrix products of the same size on this layer,
# one of them on an all-zero argument: forward mode multiplied the input by the weight's tangent,
# zero because only the input has one; the trick multiplied its zero dummy ``u`` by the weight.
# So forward mode saved no product here. ``func.jvp`` and ``forward_ad`` ran the same operators
# (asserted), so what separates them is work around the operators (wrapping and dispatch), not
# arithmetic; a profile of your own model shows where its time goes (the times above are this
# machine's). Whatever the times, the trick keeps the first
# backward's graph alive until the second one runs, and differentiates every backward again,
# where forward mode needs every operator's forward rule.

# %%
# The value beside ``J v``: equal, or equal to rounding?
# ------------------------------------------------------
# ``jvp`` also returns ``f(x)``. For the network above it is the plain call's result bit for bit.
# In forward-over-reverse, ``jvp(grad(loss))`` (a Hessian-vector product), the value returned is
# the gradient, and for some operators it differs from ``grad(loss)`` by rounding errors (the
# largest difference is printed). Both are then compared with a float64 gradient, each with a
# bound near the error measured for that operator.
assert torch.equal(value, network(inputs))
weight, bias, target = (torch.randn(256, device=device) for _ in range(3))
BOUNDS = {"linear": 2e-7, "layer_norm": 1e-6, "softmax": 1e-7, "log_softmax": 1e-6}
cases = {
    "linear": lambda t: t @ torch.ones(256, 256, device=t.device, dtype=t.dtype) / 16,
    "layer_norm": lambda t: F.layer_norm(
        t, (256,), weight.to(t.dtype), bias.to(t.dtype)
    ),
    "softmax": lambda t: t.softmax(-1),
    "log_softmax": lambda t: t.log_softmax(-1),
}
points = torch.randn(64, 256, device=device)
tangents = torch.randn_like(points)
differs = {}
for name, op in cases.items():

    def loss(t, op=op):
        return (op(t) * target.to(t.dtype)).sum()

    plain = grad(loss)(points)
    beside_hvp, _ = jvp(grad(loss), (points,), (tangents,))
    exact = grad(loss)(points.double())
    print(f"{name:11s} bit-equal: {torch.equal(plain, beside_hvp)!s:5s}, differ by at most "
          f"{(plain - beside_hvp).abs().max():.1e}")  # fmt: skip
    assert_close(f"  grad(loss) vs float64, {name}", plain, exact, BOUNDS[name])
    assert_close(
        f"  value beside the HVP vs float64, {name}", beside_hvp, exact, BOUNDS[name]
    )
    differs[name] = not torch.equal(plain, beside_hvp)
assert any(differs.values()), "the text says some differ: none did on this run"


# %%
# Why: under ``jvp``, the derivative formula of the gradient must itself carry a tangent, and
# some backward kernels have no forward-mode rule. The operator log shows what ran: plain
# ``grad`` of ``layer_norm`` runs its fused backward kernel, ``native_layer_norm_backward``;
# under ``jvp`` that kernel is gone, and the gradient is computed from other operators, which
# round differently.
def norm_loss(t):
    return (F.layer_norm(t, (256,), weight, bias) * target).sum()


with OperatorLog() as plain_log:
    grad(norm_loss)(points)
with OperatorLog() as hvp_log:
    jvp(grad(norm_loss), (points,), (tangents,))
plain_names = {name for name, _ in plain_log.calls}
hvp_names = {name for name, _ in hvp_log.calls}
assert "native_layer_norm_backward" in plain_names
assert "native_layer_norm_backward" not in hvp_names
examples = sorted(hvp_names & {"var_mean", "rsqrt"})
print(f"grad: {len(plain_names)} operators, the fused backward among them; under jvp: "
      f"{len(hvp_names)}, without it, e.g. {examples}")  # fmt: skip

# %%
# What to remember
# ----------------
# * :func:`torch.func.jvp` and ``torch.autograd.forward_ad`` are forward mode;
#   :func:`torch.autograd.functional.jvp` is the double-backward trick, two reverse passes.
# * A custom Function needs a ``jvp`` rule for forward mode, and for the trick a ``backward``
#   differentiable in its incoming gradient; through a ``@once_differentiable`` one,
#   ``autograd.functional.jvp`` returns zeros unless ``strict=True``.
# * Which is faster depends on the model and the device: time both, warmed up, doing the same
#   work (frozen parameters, or a graph for both).
# * The value ``jvp(grad(loss))`` returns beside the product can differ from ``grad(loss)`` by
#   rounding (some backward kernels are decomposed); compare both with float64, with a tolerance.
