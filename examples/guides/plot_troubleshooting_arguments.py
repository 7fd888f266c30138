"""
Troubleshooting, part 2: errors about arguments, outputs and what runs inside a transform
=========================================================================================

The companion of :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py`, for the errors
raised by what a transform is given (``in_dims``, tangents, cotangents, keywords, integer inputs,
parameter names), by what the function returns (a vector, a float, a complex number, an ``aux``
without its tuple) and by what runs inside it (``backward()``, checkpointing, custom Functions,
NumPy). Wrong values without an error: :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`;
errors from library code: :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_libraries.py`.
Each title begins with the message's first words as PyTorch 2.13 prints them, in alphabetical
order. Each section triggers the error and asserts its type and words (``fails_with``), says where
it comes from, and checks the fix against an independent reference (``check``).
"""

import contextlib
import math
import textwrap
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, stack_module_state, vjp, vmap
from torch.utils.checkpoint import checkpoint

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
F64 = dict(device=device, dtype=torch.float64)
measured = {}  # the fix -> (relative error, bound), drawn at the end


@contextlib.contextmanager
def fails_with(kind, *words):
    """The block must raise exactly ``kind``, its message holding each of ``words``."""
    try:
        yield
    except kind as error:
        text = " ".join(str(error).split())  # messages with pytree specs span lines
        absent = [w for w in words if w not in text]
        assert type(error) is kind and not absent, f"{type(error).__name__}: {text}"
        print(textwrap.shorten(f"raised {kind.__name__}: {text}", 180))
    else:
        raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def check(fix, got, want, bound):
    """Largest error over the largest reference entry, below ``bound``; kept for the figure."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape, f"{fix}: {tuple(got.shape)} vs {tuple(want.shape)}"
    error = ((got - want).abs().amax() / want.abs().amax()).item()
    room = f"{bound / error:.0f}x under" if error else "exact"
    print(f"  fix, {fix}: relative error {error:.1e}, bound {bound:.0e} ({room})")
    assert error < bound, f"{fix}: {error:.1e} >= {bound:.0e}"
    measured[fix] = (error, bound)


# %%
# backward() called inside a functorch transform
# ----------------------------------------------
# A ``RuntimeError``: ``.backward()`` stores gradients in ``.grad`` instead of returning them,
# and the transforms refuse to run it. Here each of four stacked linear models, under ``vmap``,
# calls it on its loss. The fix: ask for the gradient as an output, ``grad`` inside ``vmap``;
# the reference is ``.backward()`` on each model in a Python loop.
models = [nn.Linear(3, 1).to(**F64) for _ in range(4)]
stacked, _ = stack_module_state(models)
inputs, targets = torch.randn(8, 3, **F64), torch.randn(8, 1, **F64)


def fit_loss(params, x):
    return (functional_call(models[0], params, (x,)) - targets).square().mean()


with fails_with(RuntimeError, "backward() called inside a functorch transform"):
    vmap(lambda p: fit_loss(p, inputs).backward())(stacked)
per_model = vmap(grad(fit_loss), in_dims=(0, None))(stacked, inputs)
for model in models:
    fit_loss(dict(model.named_parameters()), inputs).backward()
for name in ("weight", "bias"):
    by_loop = torch.stack([getattr(model, name).grad for model in models])
    check(f"grad inside vmap, 4 models, {name}", per_model[name], by_loop, 1e-14)

# %%
# Cannot access data pointer of Tensor that doesn't have storage
# --------------------------------------------------------------
# A ``RuntimeError`` from NumPy (or a C++ extension) under ``vmap``: a sample there is a batched
# wrapper without storage for them to read (under ``grad``, NumPy fails otherwise, as in
# :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`; with a GPU tensor, NumPy's ``TypeError:
# can't convert cuda:0 device type tensor`` comes first, hence ``grid.cpu()``). The fix: the
# torch operator (:func:`torch.sinc` for ``np.sinc``), or a custom operator with a ``vmap`` rule
# (:ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`). Reference: NumPy by row.
grid = torch.linspace(-2, 2, 12, **F64).view(3, 4)
with fails_with(RuntimeError, "Cannot access data pointer of Tensor that doesn't have"):
    vmap(lambda row: torch.as_tensor(np.sinc(row)))(grid.cpu())
by_numpy = torch.as_tensor(np.stack([np.sinc(row) for row in grid.cpu().numpy()]))
check("torch.sinc under vmap", vmap(torch.sinc)(grid), by_numpy, 1e-14)

# %%
# Error(s) in reparametrizing for Linear: Unexpected key(s)
# ---------------------------------------------------------
# A ``RuntimeError`` from ``functional_call(..., strict=True)`` when a name matches no
# parameter or buffer. With the default ``strict=False`` a misspelt name is ignored and the
# module silently uses its own weight: the output below equals ``layer(x)`` exactly.
layer, x = nn.Linear(3, 2).to(**F64), torch.randn(3, **F64)
new = {"weights": torch.randn(2, 3, **F64), "bias": torch.randn(2, **F64)}
assert torch.equal(functional_call(layer, {"weights": new["weights"]}, (x,)), layer(x))
with fails_with(RuntimeError, "Unexpected key(s): 'weights'"):
    functional_call(layer, new, (x,), strict=True)
# A prefix that names no submodule, as ``module.`` in a state dict saved from a
# DistributedDataParallel model, raises even without strict=True, another message.
with fails_with(AttributeError, "Linear has no attribute `module`"):
    functional_call(layer, {"module.weight": new["weights"]}, (x,))
# A name in two dictionaries (``functional_call(m, (params, buffers), ...)``) raises too.
with fails_with(ValueError, "['bias'] appeared in multiple dictionaries; behavior of"):
    functional_call(layer, (new, {"bias": new["bias"]}), (x,))
# The fix: the module's own names, checked by strict=True (which wants every parameter and
# buffer) or, for a partial dictionary, against ``named_parameters()`` and ``named_buffers()``
# (``state_dict()`` leaves out non-persistent buffers). The reference: W x + b by hand.
new["weight"] = new.pop("weights")
known = dict(layer.named_parameters()) | dict(layer.named_buffers())
assert not new.keys() - known.keys(), new.keys() - known.keys()
swapped = functional_call(layer, new, (x,), strict=True)
check("strict=True, names fixed", swapped, new["weight"] @ x + new["bias"], 1e-14)

# %%
# Expected weight from each model to have the same .requires_grad
# ---------------------------------------------------------------
# A ``RuntimeError`` from ``stack_module_state`` when a parameter is frozen in some models and
# not in others: each name becomes one stacked tensor, with one ``requires_grad``. The fix:
# freeze it in every model, or, as here, in none. The reference: each model called in a loop.
ensemble = [nn.Linear(3, 2).to(**F64) for _ in range(4)]
ensemble[0].weight.requires_grad_(False)
with fails_with(RuntimeError, "Expected weight from each model to have the same"):
    stack_module_state(ensemble)
ensemble[0].weight.requires_grad_(True)
params, _ = stack_module_state(ensemble)
outputs = vmap(functional_call, in_dims=(None, 0, None))(ensemble[0], params, (x,))
check("frozen in every model", outputs, torch.stack([m(x) for m in ensemble]), 1e-14)

# %%
# Got argnum=0, but only 0 positional inputs
# ------------------------------------------
# A ``RuntimeError`` from ``grad`` when the argument to differentiate comes by keyword:
# ``argnums`` counts positional arguments only, and keyword arguments pass through without a
# gradient. The fix: pass it by position. The reference: ``d/dw Σ sin(w·x) = x·cos(w·x)``.
wavy = lambda w, x: (w * x).sin().sum()  # noqa: E731
w = torch.randn(3, **F64)
with fails_with(RuntimeError, "Got argnum=0, but only 0 positional inputs"):
    grad(wavy)(w=w, x=x)
check("w by position", grad(wavy)(w, x=x), x * (w * x).cos(), 1e-14)

# %%
# grad can be implicitly created only for real scalar outputs
# -----------------------------------------------------------
# A ``RuntimeError`` when the loss is complex, here a weighted sum of a signal's Fourier
# coefficients: backpropagation starts from a seed of 1, defined for real scalars. The fix: a real
# loss, the weighted power ``Σ w_k |X_k|²`` (or ``.real``). The reference: central differences
# along each coordinate (exact but for rounding, since the loss is quadratic).
signal, weights = torch.randn(16, **F64), torch.linspace(0, 1, 16, **F64)
with fails_with(RuntimeError, "grad can be implicitly created only for real scalar"):
    grad(lambda s: (weights * torch.fft.fft(s)).sum())(signal)
power = lambda s: (weights * torch.fft.fft(s).abs().square()).sum(-1)  # noqa: E731
nudges = 1e-3 * torch.eye(16, **F64)
by_differences = (power(signal + nudges) - power(signal - nudges)) / 2e-3
check("real loss |X|², grad", grad(power)(signal), by_differences, 3e-12)

# %%
# grad_and_value(f)(\*args): Expected f(\*args) to return a ...
# --------------------------------------------------------------
# A ``RuntimeError`` when ``f`` returns no scalar tensor: a vector of per-sample losses, a
# model's output of shape ``[1]`` ("scalar Tensor, got tensor with 1 dims"), or a Python float
# from ``math`` or ``.item()`` ("a Tensor, got <class 'float'>"; ``jacrev`` and ``vjp`` say
# ``vjp(f, *primals): expected f(*primals) to return only tensors``).
head = nn.Linear(3, 1).to(**F64)
for not_scalar in (head, lambda x: (inputs @ x).square()):
    with fails_with(RuntimeError, "to return a scalar Tensor, got tensor with 1 dims"):
        grad(not_scalar)(x)
with warnings.catch_warnings(action="ignore", category=UserWarning):  # from float()
    with fails_with(RuntimeError, "to return a Tensor, got <class 'float'>"):
        grad(lambda x: math.sqrt(x.square().sum()))(x)
    with fails_with(RuntimeError, "expected f(*primals) to return only tensors"):
        jacrev(lambda x: math.sqrt(x.square().sum()))(x)
# Fixes: index or sum to a scalar (head(x)[0]); torch operators, not math; and for one gradient
# per output, jacrev or vjp, as the message says. The references are closed forms.
check("grad of head(x)[0]", grad(lambda x: head(x)[0])(x), head.weight[0], 1e-14)
check("grad of torch's norm", grad(torch.linalg.vector_norm)(x), x / x.norm(), 1e-14)
per_loss = jacrev(lambda x: (inputs @ x).square())(x)
check("jacrev, one row per loss", per_loss, 2 * (inputs @ x)[:, None] * inputs, 1e-14)

# %%
# grad_and_value(f)(\*args): output of function f should be a tuple: (output, aux) ...
# ------------------------------------------------------------------------------------
# A ``RuntimeError`` with ``has_aux=True`` when ``f`` returns the loss alone, or the loss and two
# auxiliary values (a tuple of three). ``jacrev`` and ``vjp`` say ``vjp(f, *primals): output
# of function f ...``, ``jacfwd`` ``jvp(f, primals, tangents): ...``. The fix: ``(loss, aux)``,
# with several values packed into one dictionary.


def loss_and_parts(w):
    fit, size = (inputs @ w - targets[:, 0]).square().mean(), w.square().sum()
    return fit + size, {"fit": fit, "size": size}


with fails_with(RuntimeError, "output of function f should be a tuple: (output, aux)"):
    grad(lambda w: loss_and_parts(w)[0], has_aux=True)(x)
with fails_with(RuntimeError, "vjp(f, *primals): output of function f should be a"):
    jacrev(lambda w: (inputs @ w, w.sum(), w.norm()), has_aux=True)(x)
slope, parts = grad(loss_and_parts, has_aux=True)(x)
residual = inputs @ x - targets[:, 0]
check("has_aux, the gradient", slope, 2 * inputs.T @ residual / 8 + 2 * x, 1e-14)
check("has_aux, the aux value", parts["fit"], residual.square().mean(), 1e-14)

# %%
# In order to use an autograd.Function with functorch transforms ... setup_context
# --------------------------------------------------------------------------------
# A ``RuntimeError`` from an ``autograd.Function`` in the older style (``ctx`` as the forward's
# first argument), such as ``checkpoint(use_reentrant=True)``. For your own Function, the fix
# is a ``setup_context`` staticmethod, plus, under ``vmap``, a ``vmap`` staticmethod or
# ``generate_vmap_rule = True`` and, under ``jvp`` or ``jacfwd``, a ``jvp`` staticmethod, or
# they raise too (:ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`).
calls = []  # one entry per run of the block below


class Cube(torch.autograd.Function):  # x³, written short
    forward = staticmethod(lambda x: x**3)
    setup_context = staticmethod(lambda ctx, xs, out: ctx.save_for_backward(*xs))
    backward = staticmethod(lambda ctx, g: 3 * ctx.saved_tensors[0] ** 2 * g)


def block(x, W):  # one sample's features, or a batch's
    calls.append(tuple(x.shape))
    return (x @ W).tanh()


W = torch.randn(3, 4, **F64)
with fails_with(RuntimeError, "it must override the setup_context staticmethod"):
    vmap(lambda x: checkpoint(block, x, W, use_reentrant=True))(inputs)
with fails_with(RuntimeError, "You tried to vmap over Cube, but it does not have vmap"):
    vmap(Cube.apply)(grid)
with fails_with(NotImplementedError, "You must implement the jvp function"):
    jvp(Cube.apply, (grid,), (grid,))
Cube.generate_vmap_rule = True
cube_slopes = vmap(grad(lambda row: Cube.apply(row).sum()))(grid)
check("Cube, generate_vmap_rule", cube_slopes, 3 * grid**2, 1e-14)  # d x³ / dx by hand
# use_reentrant=False runs forward under vmap, but its recomputation in backward meets batched
# tensors outside vmap. The fix: checkpoint outside, use_reentrant=False for autograd.grad (the
# block runs twice). The reference: d/dW Σ tanh²(XW) = Xᵀ (2y (1 − y²)) for y = tanh(XW).
leaf = W.clone().requires_grad_()
with fails_with(RuntimeError, "Either your tensor may have escaped"):
    inside = vmap(lambda x: checkpoint(block, x, leaf, use_reentrant=False))(inputs)
    torch.autograd.grad(inside.square().sum(), leaf)
by_rows = vmap(block, in_dims=(0, None))
with fails_with(RuntimeError, "When use_reentrant=True, torch.utils.checkpoint is"):
    redone = checkpoint(by_rows, inputs, leaf, use_reentrant=True)
    torch.autograd.grad(redone.sum(), leaf)
calls.clear()
outside = checkpoint(by_rows, inputs, leaf, use_reentrant=False)
(by_autograd,) = torch.autograd.grad(outside.square().sum(), leaf)
assert len(calls) == 2, calls
y = (inputs @ W).tanh()
closed_form = inputs.T @ (2 * y * (1 - y**2))
check("checkpoint(vmap(f)), autograd", by_autograd, closed_form, 1e-14)

# %%
# jvp(f, primals, tangents): Expected primals to be a tuple / primals and tangents to ...
# ---------------------------------------------------------------------------------------
# A ``RuntimeError`` when ``primals`` is not a tuple (a list, a tensor), or ``tangents`` not
# one of the same length ("Expected primals and tangents to have the same python structure");
# a tangent of another shape than its primal raises ``Trying to set a forward gradient that
# has a different size ...``. The fix: a tuple of tangents, one per primal, each shaped like
# it. The reference: the product rule, ``d(a·sin b) = da·sin b + a·cos b·db``.
a, b, da, db = torch.randn(4, 5, **F64)
wave = lambda a, b: a * b.sin()  # noqa: E731
with fails_with(RuntimeError, "Expected primals to be a tuple. E.g. it should be"):
    jvp(wave, [a, b], [da, db])
with fails_with(RuntimeError, "Expected primals and tangents to have the same python"):
    jvp(wave, (a, b), (da,))
with fails_with(RuntimeError, "Trying to set a forward gradient that has a different"):
    jvp(wave, (a, b), (da, db[:4]))
_, directional = jvp(wave, (a, b), (da, db))
check("jvp, tangents like primals", directional, da * b.sin() + a * b.cos() * db, 1e-14)

# %%
# Mismatch in shape: grad_output[0] has a shape of ...
# ----------------------------------------------------
# A ``RuntimeError`` when the cotangent given to ``vjp``'s function is shaped like the input,
# not the output; a function of several outputs wants a tuple of cotangents (``Expected pytree
# structure of cotangents ...``). The fix: a cotangent per output, shaped like it. The
# reference: ``Jᵀ u`` with the Jacobian of ``A tanh(v)`` by hand, ``A diag(1 − tanh² v)``.
A = torch.randn(2, 5, **F64)
squash = lambda v: A @ v.tanh()  # noqa: E731
_, pull_back = vjp(squash, a)
with fails_with(RuntimeError, "Mismatch in shape: grad_output[0] has a shape of"):
    pull_back(torch.ones(5, **F64))
u = torch.randn(2, **F64)
(cotangent_in,) = pull_back(u)
by_hand = (1 - a.tanh() ** 2) * (A.T @ u)
check("vjp, cotangent like the output", cotangent_in, by_hand, 1e-14)
_, pull_both = vjp(lambda v: (squash(v), v.square().sum()), a)
with fails_with(RuntimeError, "Expected pytree structure of cotangents"):
    pull_both(u)
(both_in,) = pull_both((u, torch.tensor(1.0, **F64)))
check("vjp, one cotangent per output", both_in, by_hand + 2 * a, 1e-14)

# %%
# only Tensors of floating point dtype can require gradients
# ----------------------------------------------------------
# A ``RuntimeError`` when ``argnums`` (by default the first argument) points at an integer
# tensor, here token ids before an embedding table (``jvp`` raises ``ValueError: Expected
# primal to be floating point or complex``). The fix: differentiate the float arguments only.
# The reference: the gradient of ``Σ table[ids]²`` is ``2·table`` times each row's count.
table = torch.randn(6, 3, **F64)
ids = torch.tensor([0, 2, 2, 5, 2], device=device)
lookup = lambda ids, table: table[ids].square().sum()  # noqa: E731
with fails_with(RuntimeError, "only Tensors of floating point dtype can require"):
    grad(lookup)(ids, table)
counts = torch.bincount(ids, minlength=6).to(torch.float64)
table_grad = grad(lookup, argnums=1)(ids, table)
check("argnums=1, the table", table_grad, 2 * table * counts[:, None], 1e-14)

# %%
# torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks
# ----------------------------------------------------------------------------
# A ``RuntimeError`` whenever saved tensor hooks (``checkpoint(use_reentrant=False)``,
# ``torch.autograd.graph.save_on_cpu``, inside the function or around it) are active while
# ``grad``, ``vjp`` or ``jacrev`` runs, ``vmap(grad(f))`` included: there, 2.13 cannot run
# ``torch.utils.checkpoint``. Loop over samples, drop it, or rerun the block in your own
# Function's backward (:doc:`plot_extending_torch_func`; unchecked). For ``jacrev``'s memory, use
# ``chunk_size=`` (:doc:`../models_as_functions/plot_memory_control`). Both run under ``jvp`` (a
# ``backward`` through it fails: part 12), ``jacfwd``, forward-only ``vmap``, ``autograd.grad``.
sample_loss = lambda W, x: checkpoint(block, x, W, use_reentrant=False).square().sum()  # noqa
with fails_with(RuntimeError, "don't yet support saved tensor hooks"):
    vmap(grad(sample_loss), in_dims=(None, 0))(W, inputs)
with fails_with(RuntimeError, "don't yet support saved tensor hooks"):
    with torch.autograd.graph.save_on_cpu():
        grad(lambda W: block(inputs, W).square().sum())(W)
calls.clear()
per_sample = [torch.autograd.grad(sample_loss(leaf, x), leaf)[0] for x in inputs]
assert len(calls) == 2 * len(inputs), calls
per_sample_by_hand = inputs[:, :, None] * (2 * y * (1 - y**2))[:, None, :]
check("a loop over samples", torch.stack(per_sample), per_sample_by_hand, 1e-14)
dW = torch.randn(3, 4, **F64)
_, along = jvp(lambda W: checkpoint(block, inputs, W, use_reentrant=False), (W,), (dW,))
check("checkpoint under jvp", along, (1 - y**2) * (inputs @ dW), 1e-14)
calls.clear()
with torch.autograd.graph.save_on_cpu():
    (offloaded,) = torch.autograd.grad(block(inputs, leaf).square().sum(), leaf)
assert len(calls) == 1, calls
check("save_on_cpu, autograd.grad", offloaded, closed_form, 1e-14)

# %%
# vmap(f, ..., out_dims=...)(<inputs>): out_dims is not compatible / must only return Tensors
# -------------------------------------------------------------------------------------------
# A ``ValueError`` when ``out_dims`` has more or fewer entries than ``f`` has outputs, or when
# ``f`` returns a Python number (``vmap(f, ...): `f` must only return Tensors, got type``).
# The fix: one ``out_dims`` entry per output, ``None`` for a value returned once; here each
# standardised row lands in a column (``1``). The reference: the formula on the whole batch.


def standardise(row, eps=1e-6):
    return (row - row.mean()) / (row.std() + eps), eps


with fails_with(ValueError, "out_dims is not compatible with the structure of"):
    vmap(standardise, out_dims=(1, None, None))(grid)
with fails_with(ValueError, "must only return Tensors, got type <class 'float'>"):
    vmap(standardise)(grid)
columns, eps = vmap(standardise, out_dims=(1, None))(grid)
centred, spread = grid - grid.mean(1, keepdim=True), grid.std(1, keepdim=True) + eps
check("out_dims=(1, None)", columns, (centred / spread).T, 1e-14)

# %%
# vmap(f, in_dims=..., ...)(<inputs>): in_dims is not compatible / Got in_dim=...
# -------------------------------------------------------------------------------
# A ``ValueError`` when ``in_dims`` does not give one entry per argument, is a list
# (``expected `in_dims` to be int or a (potentially nested) tuple``), gives an axis the tensor
# lacks (``Got in_dim=1 for some input, but that input is a Tensor of dimensionality 1``), or
# an axis to a Python number (``Got in_dim=0 for an input but the input is of type``). The fix:
# a tuple with, per argument, the batch axis of a batched tensor and ``None`` for the rest.
samples = torch.randn(3, 5, **F64)  # five samples, one per column
weight, shift = torch.randn(2, 3, **F64), torch.randn(2, **F64)
affine = lambda x, weight, shift: weight @ x + shift  # noqa: E731
with fails_with(ValueError, "in_dims is not compatible with the structure of `inputs`"):
    vmap(affine, in_dims=(1, None))(samples, weight, shift)
with fails_with(ValueError, "expected `in_dims` to be int or a (potentially nested)"):
    vmap(affine, in_dims=[1, None, None])(samples, weight, shift)
with fails_with(ValueError, "Got in_dim=1 for some input, but that input is a"):
    vmap(affine, in_dims=1)(samples, weight, shift)
with fails_with(ValueError, "We cannot vmap over non-Tensor arguments, please use"):
    vmap(affine, in_dims=(1, None, 0))(samples, weight, 0.5)
mapped = vmap(affine, in_dims=(1, None, None))(samples, weight, shift)
check("in_dims=(1, None, None)", mapped, (weight @ samples + shift[:, None]).T, 1e-14)

# %%
# vmap: Expected all tensors to have the same size in the mapped dimension
# ------------------------------------------------------------------------
# A ``ValueError``: the default ``in_dims=0`` maps every tensor argument along its first axis,
# shared weights too, and their first sizes differ from the batch's. The fix, as above:
# ``None`` for what every sample shares.
rows = samples.T.contiguous()  # five samples, one per row
with fails_with(ValueError, "Expected all tensors to have the same size in the mapped"):
    vmap(affine)(rows, weight, shift)
mapped = vmap(affine, in_dims=(0, None, None))(rows, weight, shift)
check("in_dims=(0, None, None)", mapped, rows @ weight.T + shift, 1e-14)

# %%
# You are attempting to call Tensor.requires_grad_() ... inside of a function being transformed
# ---------------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``x.requires_grad_()`` inside a transform, as done before
# ``torch.autograd.grad``, and from ``torch.autograd.functional.jacobian`` or ``hessian``,
# which do it for you. The fix: the transform of the same name, here ``vmap(jacrev(f))``. The
# reference: the Jacobian of ``weight·tanh(x)`` by hand, ``weight·diag(1 − tanh² x)``.
layer_out = lambda x: weight @ x.tanh()  # noqa: E731
with fails_with(RuntimeError, "You are attempting to call Tensor.requires_grad_()"):
    vmap(lambda x: torch.autograd.functional.jacobian(layer_out, x))(rows)
jacobians = vmap(jacrev(layer_out))(rows)
check("vmap(jacrev(f))", jacobians, weight * (1 - rows.tanh() ** 2)[:, None, :], 1e-14)

# %%
# Every fix against its reference
# -------------------------------
# Each fix's relative error (grey; an exact match drawn at 1e-18) and its bound (black).
labels, (errors, bounds) = list(measured), zip(*measured.values())
fig, ax = plt.subplots(figsize=(7, 8), layout="constrained")
ax.barh(labels, [max(e, 1e-18) for e in errors], color="0.65", label="measured")
ax.scatter(bounds, labels, marker="|", s=220, color="black", label="bound")
ax.set(xscale="log", xlim=(1e-19, 1e-9), xlabel="relative error against the reference")
ax.set_title(f"{len(labels)} fixes, each checked on {device.type}")
ax.legend(loc="lower right", frameon=False)
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# * ``in_dims`` and ``out_dims``: an int, or a tuple (not a list) of one entry per argument or
#   output: a batch axis, ``None`` for what is shared or not a tensor, or such entries nested.
# * ``grad`` wants a real scalar tensor (``(loss, aux)`` with ``has_aux``) and differentiates
#   positional arguments only; ``jvp`` wants tuples, a tangent per primal, and ``vjp`` a
#   cotangent per output, each of the same shape.
# * Inside a transform, ask for gradients as outputs (``grad``, ``jacrev``), never by
#   ``.backward()``, ``requires_grad_()`` or ``torch.autograd.functional``; give a custom
#   ``autograd.Function`` ``setup_context``, a vmap rule and ``jvp``. NumPy goes out of ``vmap``.
# * Saved tensor hooks (``checkpoint(use_reentrant=False)``, ``save_on_cpu``) run under ``jvp``,
#   ``jacfwd`` and a forward-only ``vmap``, not while ``grad``, ``vjp`` or ``jacrev`` runs,
#   ``vmap(grad(f))`` included: loop over samples, or recompute in your own Function.
# * Check names for ``functional_call`` against ``named_parameters()`` and ``named_buffers()``,
#   or with ``strict=True``; ``stack_module_state`` wants a parameter frozen in all or none.
