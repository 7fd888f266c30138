"""
Troubleshooting, part 3: errors and wrong values from code you did not write
============================================================================

After :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py` and
:ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_arguments.py`, what goes wrong inside
code you did not write: ``DistributedDataParallel``, module hooks, operators without a
forward-mode formula, ``torch.distributions``. Titles begin with the message's first words as
PyTorch 2.13 prints them, in alphabetical order; three problems that raise nothing follow. Each
entry asserts the problem (``must_raise``), and checks the fix against a reference (``near``).
"""

import os
import sys
import tempfile
import textwrap
import traceback
import warnings
from contextlib import contextmanager

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.distributions import Gamma, Independent, MultivariateNormal, Normal
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.nn.parallel import DistributedDataParallel

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64 = {"dtype": torch.float64, "device": device}


@contextmanager
def must_raise(error_class, first_words):
    """Fail unless the block raises exactly ``error_class`` with ``first_words`` in it."""
    caught = []  # the error, kept for a look at its traceback
    try:
        with warnings.catch_warnings(action="ignore"):  # from code meant to fail
            yield caught
    except error_class as error:
        said = " ".join(str(error).split())
        assert type(error) is error_class, f"{type(error).__name__}: {said}"
        assert first_words in said, said
        print(f"{error_class.__name__} as expected: {textwrap.shorten(said, 150)}")
        caught.append(error)
    else:
        raise AssertionError(f"the block raised no {error_class.__name__}")


def near(fix, got, want, bound):
    """Per tensor (a dict is checked key by key): worst error / largest reference entry."""
    got = got if isinstance(got, dict) else {"": got}
    want = want if isinstance(want, dict) else {"": want}
    assert got.keys() == want.keys(), (fix, got.keys(), want.keys())
    worst = 0.0
    for key, tensor in got.items():
        assert tensor.shape == want[key].shape, (fix, key, tensor.shape)
        gap = (tensor.detach().cpu() - want[key].detach().cpu()).abs().max()
        error = (gap / want[key].abs().max().cpu()).item()
        assert error < bound, f"{fix} {key}: error {error:.1e} >= {bound:.0e}"
        worst = max(worst, error)
    margin = f", {bound / worst:.0f}x under it" if worst else ", exact"
    print(f"  checked, {fix}: error {worst:.1e} (bound {bound:.0e}{margin})")


# %%
# During a grad (vjp, jvp, grad, etc) transform, ... in-place operation (aten::copy\_) ...
# ----------------------------------------------------------------------------------------
# A ``RuntimeError`` from a model wrapped in ``DistributedDataParallel`` (DDP): its forward first
# copies rank 0's buffers, here BatchNorm's running statistics, into each rank's own, in place,
# and a transform may not write into a tensor the function captured. One process with ``gloo``
# and a file as meeting point shows it on the CPU: a Hessian-vector product, forward over reverse.
def hvp_through(model, direction, batch):
    """The loss's Hessian times ``direction``, through ``model``'s forward."""
    point = {name: p.detach() for name, p in model.named_parameters()}
    tangent = {name: direction[name.removeprefix("module.")] for name in point}
    loss = lambda p: functional_call(model, p, (batch,)).square().mean()  # noqa: E731
    return jvp(grad(loss), (point,), (tangent,))[1]


meeting, excepthook = tempfile.TemporaryDirectory(), sys.excepthook
store = f"file://{meeting.name}/store"
dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
sys.excepthook = excepthook  # init_process_group replaced it, for good
try:  # the group is destroyed at the end, also when a check fails
    net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1))
    net = net.double().eval()  # on the CPU, like the gloo backend
    batch = torch.randn(8, 3, dtype=torch.float64)
    direction = {name: torch.randn_like(p) for name, p in net.named_parameters()}
    with must_raise(RuntimeError, "in-place operation (aten::copy_) that would mutate"):
        hvp_through(DistributedDataParallel(net), direction, batch)
    # The fix: call the module DDP wraps, ddp.module. The reference, per tensor: autograd's
    # double backward on the plain module, ∇(∇L · v).
    from_module = hvp_through(DistributedDataParallel(net).module, direction, batch)
    loss = net(batch).square().mean()
    first = torch.autograd.grad(loss, net.parameters(), create_graph=True)
    along = sum((g * v).sum() for g, v in zip(first, direction.values()))
    want = dict(zip(direction, torch.autograd.grad(along, net.parameters())))
    near("functional_call on ddp.module", from_module, want, 1e-14)
    # Each rank gets its own batch's product (DDP's hooks never fire): all_reduce (a sum), then
    # divide by the world size. forward_sync_buffers=False skips the copy too, in every forward,
    # and fails with find_unused_parameters=True or static_graph=True (part 2's older-style
    # Function) and in the forward after DDP rebuilds its buckets, after the first backward.
    plain = DistributedDataParallel(net, forward_sync_buffers=False)
    unsynced = {k[7:]: t for k, t in hvp_through(plain, direction, batch).items()}
    near("forward_sync_buffers=False, before any backward", unsynced, want, 1e-14)
    for extra in ({"find_unused_parameters": True}, {"static_graph": True}):
        ddp = DistributedDataParallel(net, forward_sync_buffers=False, **extra)
        with must_raise(RuntimeError, "it must override the setup_context"):
            hvp_through(ddp, direction, batch)
    # In training mode even ddp.module fails: BatchNorm counts its batches in place, the
    # ``aten::add_`` of :ref:`part 1 <sphx_glr_auto_examples_guides_plot_troubleshooting.py>`.
    with must_raise(RuntimeError, "in-place operation (aten::add_.Tensor) that would"):
        hvp_through(DistributedDataParallel(net.train()).module, direction, batch)
finally:
    dist.destroy_process_group()
    meeting.cleanup()

# %%
# Either your tensor may have escaped from inside a function being vmapped ...
# ----------------------------------------------------------------------------
# A ``RuntimeError`` from a tensor that a module hook kept under ``vmap``, used after the call.
# Inside, the hook sees one sample's shape, ``(6,)``, not the batch's: the tensor is a transform's
# wrapper (grad's, around vmap's), dead once the call returns: its shape reads, operations raise.
mlp = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(**f64)
weights = {name: p.detach() for name, p in mlp.named_parameters()}
xs, ys = torch.randn(8, 3, **f64), torch.randn(8, 2, **f64)
caught = {}  # the hook writes the last layer's input here
catcher = mlp[2].register_forward_pre_hook(lambda _, a: caught.update(inputs=a[0]))


def sample_loss(p, x, y):
    return (functional_call(mlp, p, (x,)) - y).square().sum()


per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(weights, xs, ys)
escaped = caught.pop("inputs")
print(f"the hook saw shape {tuple(escaped.shape)}, for a batch of {len(xs)}")
assert escaped.shape == (6,), escaped.shape
with must_raise(RuntimeError, "Either your tensor may have escaped from inside a"):
    escaped * 2
# A full backward hook, for the gradient at the layer's output, fails under grad, with part 2's
# setup_context error: it runs through an autograd.Function of the older style.
seen = []  # what the backward hook receives: d loss / d output, one sample at a time
watcher = mlp[2].register_full_backward_hook(lambda _, ins, outs: seen.append(outs[0]))
with must_raise(RuntimeError, "it must override the setup_context staticmethod"):
    grad(sample_loss)(weights, xs[0], ys[0])
# Outside transforms the hook works: autograd.grad one sample at a time gives two references.
own, loop = dict(mlp.named_parameters()), []
for x, y in zip(xs, ys):  # to every weight, so the gradient reaches the layer's input
    loop.append(torch.autograd.grad(sample_loss(own, x, y), list(own.values())))
stacked = {name: torch.stack(g) for name, g in zip(own, zip(*loop))}
watcher.remove()
# The fixes, in one vmap call. The input: return what the hook caught as an output, through
# has_aux, so vmap stacks it. The output's gradient: a forward hook adds a zero "probe" to the
# layer's output, and grad differentiates with respect to the probe too (argnums). Activations
# alone need no vmap: an ordinary batched call computes them for every sample.
probe = {"zero": 0.0}  # what the forward hook adds: 0 outside the transform
adder = mlp[2].register_forward_hook(lambda _, args, out: out + probe["zero"])


def loss_and_inputs(p, zero, x, y):
    probe["zero"] = zero
    loss = sample_loss(p, x, y)
    probe["zero"] = 0.0  # keep no per-sample tensor past the call
    return loss, caught.pop("inputs")


by_sample = vmap(grad(loss_and_inputs, (0, 1), has_aux=True), (None, 0, 0, 0))
(grads, out_grads), inputs = by_sample(weights, torch.zeros(8, 2, **f64), xs, ys)
near("has_aux, per-sample inputs", inputs, mlp[1](mlp[0](xs)).detach(), 1e-15)
near("has_aux, per-sample gradients", grads, stacked, 1e-14)
near("zero probe, per-sample output gradients", out_grads, torch.stack(seen), 1e-14)
catcher.remove(), adder.remove()

# %%
# Trying to use forward AD with igamma that does not support it
# -------------------------------------------------------------
# A ``NotImplementedError`` from :func:`~torch.func.hessian` (``jacfwd`` over ``jacrev``),
# ``jacfwd`` or ``jvp``, when an operator has no forward-mode formula: here ``igamma``, the
# incomplete gamma function behind ``Gamma(shape, rate).cdf``: the log-probability that each
# wait ends by its time, as a function of the rates. The message names the operator; the last
# frame of the traceback outside torch's folder names your line.
shapes = torch.tensor([0.5, 2.0, 3.5], **f64)
waits, rates = torch.tensor([[1.0, 0.7, 2.0], [0.8, 1.5, 1.2]], **f64)


def log_cdf(rate):
    return Gamma(shapes, rate).cdf(waits).log().sum()


with must_raise(NotImplementedError, "Trying to use forward AD with igamma") as raised:
    hessian(log_cdf)(rates)
frames = traceback.extract_tb(raised[0].__traceback__)
torch_folder = os.path.dirname(torch.__file__)
yours = [frame for frame in frames if not frame.filename.startswith(torch_folder)]
print(f"the last frame outside torch: {yours[-1].name}(): {yours[-1].line}")
assert yours[-1].name == "log_cdf", yours
# Which operators lack the formula? PyTorch publishes no list (its test suite's operator table,
# OpInfo, records supports_forward_ad): call jvp on the operator alone. Three that lack it:
dots = torch.rand(4, 2, **f64)
distances = lambda p: torch.cdist(p, p + 1)  # noqa: E731
zeta = lambda p: torch.special.zeta(p + 1, p)  # noqa: E731
for op in (distances, nn.functional.pdist, zeta):
    with must_raise(NotImplementedError, "Trying to use forward AD with"):
        jvp(op, (dots,), (dots,))
# The fix for igamma: reverse over reverse, jacrev(jacrev(f)), which needs backward formulas
# only; igamma has them in x, at any order (none in the shape). For F = P(a, x) at x = rate·t,
# d² log F / d rate² = t² (p'/F − p²/F²), with the Gamma density p = x^(a−1) e^(−x) / Γ(a) and
# p' = p ((a − 1)/x − 1); the rates do not mix.
x = rates * waits
cdf = torch.special.gammainc(shapes, x)
density = torch.exp((shapes - 1) * x.log() - x - torch.lgamma(shapes))
slope = density * ((shapes - 1) / x - 1)
by_hand = torch.diag(waits**2 * (slope / cdf - density**2 / cdf**2))
near("jacrev(jacrev(f))", jacrev(jacrev(log_cdf))(rates), by_hand, 1e-14)
# Not for the other three: zeta has no derivative in its first argument, pdist and cdist (on
# this path) no second backward; cdist's matrix-product path (the default past 25 rows on either
# side) has one, for jacrev(jacrev), not jvp. Or write it out in operators with formulas, or
# use an autograd.Function: :ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`.
for op in (distances, nn.functional.pdist, zeta):
    with must_raise(NotImplementedError, "the derivative for"):
        jacrev(jacrev(op))(dots)
by_mm = lambda p: torch.cdist(p, p + 1, compute_mode="use_mm_for_euclid_dist")  # noqa: E731
written_out = lambda p: (p[:, None] - p[None] - 1).square().sum(-1).sqrt()  # noqa: E731
near("cdist by mm", jacrev(jacrev(by_mm))(dots), hessian(written_out)(dots), 1e-14)

# %%
# vmap: It looks like you're either (1) calling .item() on a Tensor or (2) ...
# ----------------------------------------------------------------------------
# A ``RuntimeError`` from validation in ``torch.distributions``: a constraint's check runs a Python
# ``if``, here ``MultivariateNormal``'s positive-definite test of a per-sample covariance, in
# ``vmap(jacrev(log_prob))`` (``Normal`` passes: its check batches). The fix:
# ``validate_args=False``, or ``Distribution.set_default_validate_args(False)`` for all. The page
# asks for validation explicitly: once ``torch.compile`` has run in a process, it is off.
head = nn.Linear(3, 2).to(**f64)
params = {name: p.detach() for name, p in head.named_parameters()}
targets, roots = torch.randn(8, 2, **f64), torch.randn(8, 2, 2, **f64)
covariances = roots @ roots.mT + 0.5 * torch.eye(2, **f64)  # one per sample


def log_density(p, x, y, cov, validate=None):
    mean = functional_call(head, p, (x,))
    return MultivariateNormal(mean, cov, validate_args=validate).log_prob(y)


mapped, validated_call = (None, 0, 0, 0), (params, xs, targets, covariances, True)
with must_raise(RuntimeError, "vmap: It looks like you're either (1) calling .item()"):
    vmap(jacrev(log_density), (*mapped, None))(*validated_call)
# Under a plain vmap, with no jacrev, the same test raises part 1's other message, "vmap: It
# looks like you're attempting to use a Tensor in some data-dependent control flow".
with must_raise(RuntimeError, "use a Tensor in some data-dependent control flow"):
    vmap(log_density, (*mapped, None))(*validated_call)
jacobians = vmap(jacrev(log_density), (*mapped, None))(*validated_call[:4], False)
previous = torch.distributions.Distribution._validate_args  # torch's default: __debug__
torch.distributions.Distribution.set_default_validate_args(False)
try:
    unchecked = vmap(jacrev(log_density), mapped)(params, xs, targets, covariances)
finally:  # the previous default, back for what follows
    torch.distributions.Distribution.set_default_validate_args(previous)
# The reference: the Gaussian's d log p / d mean = Σ⁻¹ (y − mean), times xᵀ for the weight.
residual = targets - (xs @ params["weight"].T + params["bias"])
pull = torch.linalg.solve(covariances, residual)
want = {"weight": pull[:, :, None] * xs[:, None, :], "bias": pull}
near("validate_args=False", jacobians, want, 1e-14)
near("set_default_validate_args(False)", unchecked, want, 1e-14)
# The question's Independent(Normal(...)), validated, runs; here d log p / d mean = (y − mean)/σ².


def normal_log_density(p, x, y, scale=0.5):
    normal = Normal(functional_call(head, p, (x,)), scale, validate_args=True)
    return Independent(normal, 1).log_prob(y)


validated = vmap(jacrev(normal_log_density), (None, 0, 0))(params, xs, targets)
near("Independent(Normal), validated", validated["bias"], residual / 0.5**2, 1e-14)
# One invalid batch element fails the whole batch. Where the ValueError's message prints a
# tensor with no dimensions per sample, it calls .item(), and that message comes instead.
one_negative = torch.tensor([1.0, -1.0], **f64)
with must_raise(RuntimeError, "vmap: It looks like you're calling .item() on a Tensor"):
    vmap(lambda s: Normal(0.0, s, validate_args=True).log_prob(s))(one_negative)

# %%
# (No error) hessian is wrong where two points coincide; jacrev(jacrev) gives NaN
# -------------------------------------------------------------------------------
# A pair energy, Σ exp(−r²) over pairs of points at distance r = ‖d‖, d = xᵢ − xⱼ, with two of
# three points at the same place. The gradient of r is d/r, 0/0 there, and PyTorch's norm returns
# 0 (printed below). The gradient of r² is then computed as 2r times that slope: 0, the right
# value, but a product of two zeros, whose derivative is 0, where the true gradient's, 2d's, is
# 2 per coordinate. :func:`~torch.func.hessian` silently drops the coincident pair's ±2 terms,
# and ``jacrev(jacrev(f))`` returns NaN. A perturbation of 1e-6 separates the points and hides it.
pair_i, pair_j = torch.triu_indices(3, 3, 1, device=device)


def pair_energy(flat, how="norm"):  # flat: (..., 6), three points in 2-D
    points = flat.unflatten(-1, (3, 2))
    gaps = points[..., pair_i, :] - points[..., pair_j, :]
    squares = gaps.square().sum(-1)  # r²
    if how == "squared":  # the fix
        return torch.exp(-squares).sum(-1)
    if how == "norm":
        return torch.exp(-(torch.linalg.vector_norm(gaps, dim=-1) ** 2)).sum(-1)
    safe = torch.where(squares > 0, squares, 1.0)  # "guarded": no 0/0 in the gradient
    return torch.exp(-(torch.where(squares > 0, safe.sqrt(), 0.0) ** 2)).sum(-1)


spot = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.5], **f64)  # points 0 and 1 coincide
norm_slope = grad(torch.linalg.vector_norm)(torch.zeros(2, **f64))
print(f"gradient of the norm at 0: {norm_slope.tolist()}")
assert not norm_slope.any()
# The reference: central second differences of the energy's values, no derivative taken.
h, step = 1e-4, 1e-4 * torch.eye(6, **f64)
shifted = [spot + a * step[:, None] + b * step[None] for a in (1, -1) for b in (1, -1)]
values = [pair_energy(s) for s in shifted]  # each (6, 6): one per pair of coordinates
by_values = (values[0] - values[1] - values[2] + values[3]) / (4 * h**2)
forward_over_reverse = hessian(pair_energy)(spot)
reverse_twice = jacrev(jacrev(pair_energy))(spot)
nans = reverse_twice.isnan().sum().item()
print(f"jacrev(jacrev): {nans} of 36 entries NaN; hessian: no NaN, but see below")
assert nans > 0
nudged = spot + 1e-6 * torch.randn(6, **f64)
near("a 1e-6 perturbation", hessian(pair_energy)(nudged), by_values, 1e-5)
# The fix: write the energy in r², so that no square root is differentiated: r² is smooth in
# the points, r is not where two coincide.
fixed = hessian(lambda flat: pair_energy(flat, "squared"))(spot)
near("squared distances, hessian", fixed, by_values, 1e-6)
# Guarding the norm with two torch.where, as at the end of part 1's section on data-dependent
# control flow, removes the NaN, not the error: hessian on either norm, and jacrev(jacrev) on
# the guarded one, miss the same block, to rounding: exp(−‖d‖²)'s Hessian at d = 0, −2 on each
# point's own coordinates and +2 across.
pair_block = torch.zeros(6, 6, **f64)
pair_block[:4, :4] = torch.tensor([[-2.0, 2.0], [2.0, -2.0]]).kron(torch.eye(2))
guarded = lambda flat: pair_energy(flat, "guarded")  # noqa: E731
twice = {"hessian": forward_over_reverse, "hessian, guarded": hessian(guarded)(spot)}
twice["jacrev(jacrev), guarded"] = jacrev(jacrev(guarded))(spot)
for name, second in twice.items():
    missed = (second + pair_block - fixed).abs().max().item()
    print(f"{name} + the pair block = the fix's Hessian, to {missed:.0e}")
    assert not second.isnan().any() and missed < 1e-14, (name, missed)
panels = {
    "hessian, via the norm: wrong": forward_over_reverse,
    "jacrev(jacrev), via the norm: NaN": reverse_twice,
    "hessian, squared distances: right": fixed,
}
coordinates = ["x₀", "y₀", "x₁", "y₁", "x₂", "y₂"]
fig, axes = plt.subplots(1, 3, figsize=(10, 3.6), layout="constrained")
shades = plt.get_cmap("RdBu_r").with_extremes(bad="black")
for ax, (name, matrix) in zip(axes, panels.items()):
    image = ax.imshow(matrix.cpu(), cmap=shades, vmin=-2.5, vmax=2.5)
    ax.set_title(name, fontsize=10)
    ax.set_xticks(range(6), coordinates)
    ax.set_yticks(range(6), coordinates)
fig.colorbar(image, ax=axes, shrink=0.8, label="Hessian entry (NaN in black)")
fig.suptitle("The pair energy's Hessian where points 0 and 1 coincide")
plt.show()

# %%
# (No error) jacrev and jacfwd disagree on a function with torch.no_grad inside
# -----------------------------------------------------------------------------
# :class:`~torch.no_grad` stops reverse mode only (its documentation says so: forward mode goes
# on), so ``jacrev`` treats what it computes as a constant and ``jacfwd`` differentiates it.
# Here a vector divided by its norm, the norm computed under ``no_grad``. How ``grad`` treats
# ``no_grad`` inside and around it: `pitfalls, section 11
# <plot_pitfalls.html#torch-no-grad-inside-the-function-and-around-grad>`__.


def scaled(v, detached=False):
    with torch.no_grad():  # a constant, for reverse mode only
        size = torch.linalg.vector_norm(v)
    if detached:  # the fix
        size = torch.linalg.vector_norm(v).detach()
    return v / size


v = torch.randn(4, **f64)
by_rev, by_fwd = jacrev(scaled)(v), jacfwd(scaled)(v)
gap = (by_rev - by_fwd).abs().max().item()
print(f"jacrev and jacfwd differ by up to {gap:.2f}")
assert gap > 0.01
# Which is right depends on what no_grad was for: a constant, then jacrev. The references by
# hand: a constant norm gives I/‖v‖; the norm differentiated, I/‖v‖ − v vᵀ/‖v‖³.
length = torch.linalg.vector_norm(v)
constant = torch.eye(4, **f64) / length
near("jacrev, what no_grad meant", by_rev, constant, 1e-15)
differentiated = constant - torch.outer(v, v) / length**3
near("jacfwd, the norm differentiated", by_fwd, differentiated, 1e-15)
# The fix: .detach() stops both modes. Keep no_grad for code that nothing differentiates.
near("jacfwd with .detach()", jacfwd(scaled)(v, True), constant, 1e-15)

# %%
# (No error) memory grows step after step in a torch.func training loop
# ----------------------------------------------------------------------
# The weights from ``named_parameters()`` require grad, so ``grad(loss)(weights)`` returns
# gradients that still have a graph back to them, and ``p - lr * g`` extends it: every step
# keeps all earlier steps' graphs, and the tensors they saved, alive. Counted here, not bytes:
# the graph's size, as the autograd nodes reachable from one weight after each step.


def reachable(tensor):
    nodes, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            todo.extend(parent for parent, _ in node.next_functions)
    return len(nodes)


def fit_loss(p):
    return (functional_call(mlp, p, (xs,)) - ys).square().mean()


def train(start, steps=8, lr=0.1):
    state, sizes = dict(start), []
    for _step in range(steps):
        slopes = grad(fit_loss)(state)
        state = {name: p - lr * slopes[name] for name, p in state.items()}
        sizes.append(reachable(state["0.weight"]))
    return state, sizes


leaky, grown = train(mlp.named_parameters())
clean, steady = train({name: p.detach() for name, p in mlp.named_parameters()})
print(f"nodes after each step: {grown} with history, {steady} detached")
growth = {b - a for a, b in zip(grown, grown[1:])}
assert len(growth) == 1 and growth.pop() > 0 and not any(steady)
# The fix: .detach() the start (or update under torch.no_grad()). The values never differed;
# the reference is the stateful loop: backward() and torch.optim.SGD on the module itself.
assert all(torch.equal(leaky[name], clean[name]) for name in clean)
sgd = torch.optim.SGD(mlp.parameters(), lr=0.1)
for _ in range(8):
    sgd.zero_grad()
    (mlp(xs) - ys).square().mean().backward()
    sgd.step()
near("detached start, 8 steps", clean, dict(mlp.named_parameters()), 1e-14)

# %%
# What to remember
# ----------------
# * Under DDP, transform ``ddp.module``: DDP's forward writes buffers in place.
# * Hooks under ``vmap`` see one sample and must not keep it: return it through ``has_aux``; for
#   the output's gradient, differentiate a zero probe. ``torch.distributions`` under ``vmap``:
#   ``validate_args=False``.
# * ``hessian`` and ``jacfwd`` need forward formulas: where one is missing (``igamma``), try
#   ``jacrev(jacrev(f))``. ``no_grad`` stops reverse mode only: ``.detach()`` stops both.
# * Norms at zero, like coincident points, give wrong or NaN second derivatives, silently, and a
#   ``torch.where`` guard removes only the NaN: use squared distances.
# * In a training loop, ``.detach()`` the weights you start from, or the graph grows each step.
