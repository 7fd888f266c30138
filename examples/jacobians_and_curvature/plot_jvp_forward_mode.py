"""
Jacobian-vector products: forward mode or the double-backward trick
===================================================================

A Jacobian-vector product ``J v`` is the derivative of ``f`` at ``x`` in the direction ``v``.
PyTorch offers four ways to compute one. Two run forward-mode AD: :func:`torch.func.jvp` and
the dual tensors of :mod:`torch.autograd.forward_ad`. Two run reverse mode twice, the
"double-backward trick": :func:`torch.autograd.functional.jvp`, and two calls to
:func:`torch.autograd.grad`. Here you compute ``J v`` all four ways and check each against a
closed form and float64 finite differences. You tell the two kinds apart by the error each
raises on a function that has only one kind of derivative. You time them fairly on a linear
layer and a deeper network, and see why the value that ``jvp`` returns beside ``J v`` can
differ from a plain call in the last bits, and how to compare it.
"""

# %%
# Setup
# -----
# TF32 stays off on GPUs, so that float32 checks measure float32 rounding.
import copy

import matplotlib.pyplot as plt
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.func import grad, jvp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
torch.set_float32_matmul_precision("highest")
print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads")
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
# The dual tensors of :mod:`torch.autograd.forward_ad` are what ``torch.func.jvp`` builds on:
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
# Measuring: what each way costs
# ------------------------------
# Forward mode does one pass carrying the tangent; the trick runs a forward pass, a backward that
# records its own graph, and a backward through that graph. Which is faster is a measurement, on
# your model and device. Each way runs on a ``Linear(512, 512)`` (the layer of the forum question
# that asked this) and on a 4-layer tanh network of width 512, for a batch of 64, with the
# parameters requiring grad as in training and with ``requires_grad_(False)``. Times are medians
# of :class:`~torch.utils.benchmark.Timer` blocks after a warm-up, on all threads.
def tanh_stack(width, depth):
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
              for _ in range(depth)]  # fmt: skip
    return torch.nn.Sequential(*blocks).to(device)


models = {"Linear(512, 512)": torch.nn.Linear(512, 512).to(device),
          "4-layer tanh network": tanh_stack(512, 4)}  # fmt: skip
batch = torch.randn(64, 512, device=device)
probe = torch.randn(64, 512, device=device)
times = {}
for model_name, model in models.items():
    for params_grad in (True, False):
        model.requires_grad_(params_grad)
        reference = by_func_jvp(model, batch, probe)
        for name, route in jvp_routes.items():
            assert_close(
                f"{name}, {model_name}", route(model, batch, probe), reference, 1e-6
            )
            timer = Timer("route(model, batch, probe)", num_threads=torch.get_num_threads(),
                          globals={"route": route, "model": model, "batch": batch,
                                   "probe": probe})  # fmt: skip
            times[model_name, params_grad, name] = timer.blocked_autorange(
                min_run_time=0.25
            )
for model_name in models:
    for params_grad in (True, False):
        block = {name: times[model_name, params_grad, name] for name in jvp_routes}
        fastest = min(block, key=lambda name: block[name].median)
        print(f"{model_name}, parameters {'with' if params_grad else 'without'} grad:")
        for name, measured in block.items():
            ratio = measured.median / block[fastest].median
            versus = (
                f"{ratio:.2g}x the time of {fastest}" if name != fastest else "fastest"
            )
            print(f"  {name:24s} {measured.median * 1e6:8.0f} µs (IQR "
                  f"{measured.iqr * 1e6:.0f}), {versus}")  # fmt: skip

fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained", sharey=True)
for ax, model_name in zip(axes, models):
    for row, params_grad in enumerate((True, False)):
        for col, (name, colour) in enumerate(METHOD_COLORS.items()):
            measured = times[model_name, params_grad, name]
            ax.barh(row * 5 + col, measured.median * 1e6, color=colour, xerr=measured.iqr * 1e6,
                    label=name if row == 0 else None)  # fmt: skip
    ax.set_yticks([1.5, 6.5], ["parameters\nwith grad", "parameters\nwithout grad"])
    ax.set(
        title=f"{model_name}, batch 64, {device.type.upper()}",
        xlabel="median time (µs)",
    )
axes[0].invert_yaxis()
axes[1].legend(loc="lower right", fontsize=8)
plt.show()


# %%
# What ran: the matrix products of each way
# -----------------------------------------
# Forward mode is often described as "one pass instead of two". An operator log (a
# :class:`~torch.utils._python_dispatch.TorchDispatchMode` that records each ATen operator, and
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
        return [
            (name, zero) for name, zero in self.calls if name in ("mm", "addmm", "bmm")
        ]


linear = models["Linear(512, 512)"]
with OperatorLog() as known:
    batch @ linear.weight.T
assert known.products() == [("mm", False)], known.calls
logs = {}
for name in ("func.jvp", "double-backward trick"):
    with OperatorLog() as logs[name]:
        jvp_routes[name](linear, batch, probe)
    print(f"{name:22s} matrix products (operator, an all-zero argument): "
          f"{logs[name].products()}")  # fmt: skip
assert logs["func.jvp"].products() == [("addmm", False), ("mm", True), ("mm", False)]
assert logs["double-backward trick"].products() == logs["func.jvp"].products()

# %%
# **Reading the numbers.** Both ways ran three matrix products of the same size on this layer,
# one of them on an all-zero argument: forward mode multiplied the input by the weight's tangent,
# zero because only the input has one; the trick multiplied its zero dummy ``u`` by the weight.
# So forward mode saved no product here, and the rest of each way's work decided the times above
# (this machine's; time your own model). Two things hold whatever the times: the trick keeps the
# first backward's graph alive until the second one runs, and it needs a backward rule of the
# backward, where forward mode needs only the forward rules.

# %%
# The value beside ``J v``: equal, or equal to rounding?
# ------------------------------------------------------
# ``jvp`` also returns ``f(x)``. For the network above it is the plain call's result bit for bit.
# In forward-over-reverse, ``jvp(grad(loss))`` (a Hessian-vector product), the value returned is
# the gradient, and for some operators it differs from ``grad(loss)`` in the last bits. Both are
# then compared with a float64 gradient: each must be within float32 rounding of it.
assert torch.equal(value, network(inputs))
weight, bias, target = (torch.randn(256, device=device) for _ in range(3))
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
for name, op in cases.items():

    def loss(t, op=op):
        return (op(t) * target.to(t.dtype)).sum()

    plain = grad(loss)(points)
    beside_hvp, _ = jvp(grad(loss), (points,), (tangents,))
    exact = grad(loss)(points.double())
    print(f"{name:11s} bit-equal: {torch.equal(plain, beside_hvp)!s:5s}, differ by at most "
          f"{(plain - beside_hvp).abs().max():.1e}")  # fmt: skip
    assert_close(f"  grad(loss) vs float64, {name}", plain, exact, 1e-6)
    assert_close(f"  value beside the HVP vs float64, {name}", beside_hvp, exact, 1e-6)


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
# * :func:`torch.func.jvp` and :mod:`torch.autograd.forward_ad` are forward mode;
#   :func:`torch.autograd.functional.jvp` is the double-backward trick, two reverse passes.
# * A custom Function needs a ``jvp`` rule for forward mode and a ``backward`` for the trick.
# * Which is faster depends on the model and the device: time both, warmed up, with the
#   parameters' ``requires_grad`` as in your real use.
# * The value ``jvp`` returns can differ from the plain call in the last bits (forward-over-
#   reverse decomposes some backward kernels); compare both with float64, with a tolerance.
