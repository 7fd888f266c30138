"""
Troubleshooting, part 2: errors about arguments, outputs and what runs inside a transform
=========================================================================================

The companion of :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py`, for the errors
raised by what a transform is given (``in_dims``, tangents, cotangents, integer inputs,
parameter names), by what the function returns (a vector, a float, a complex number, an
``aux`` without its tuple) and by what runs inside it (``backward()``, checkpointing, NumPy).
Each section's title begins with the message's first words as PyTorch 2.13 prints them, in
alphabetical order. Each section triggers the error and asserts its type and words
(``fails_with``), says where it comes from in one sentence, and checks the fix against an
independent reference (``check``): a loop, a closed form, NumPy or finite differences.
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
grads_by_loop = torch.stack([model.weight.grad for model in models])
check("grad inside vmap, 4 models", per_model["weight"], grads_by_loop, 1e-14)

# %%
# Cannot access data pointer of Tensor that doesn't have storage
# --------------------------------------------------------------
# A ``RuntimeError`` from NumPy (or a C++ extension) under ``vmap``: a sample there is a batched
# wrapper without storage of its own for them to read. The fix: the torch operator
# (:func:`torch.sinc` for ``np.sinc``), or a custom operator with a ``vmap`` rule
# (:ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`). The reference: NumPy,
# row by row. Under ``grad``, NumPy fails otherwise: :ref:`pitfalls
# <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, section 2.
grid = torch.linspace(-2, 2, 12, **F64).view(3, 4)
with fails_with(RuntimeError, "Cannot access data pointer of Tensor that doesn't have"):
    vmap(lambda row: torch.as_tensor(np.sinc(row)))(grid.cpu())
by_numpy = torch.as_tensor(np.stack([np.sinc(row) for row in grid.cpu().numpy()]))
check("torch.sinc under vmap", vmap(torch.sinc)(grid), by_numpy, 1e-15)

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
# The fix: the module's own names, checked by strict=True (which wants every parameter and
# buffer) or, for a partial dictionary, against them. The reference: W x + b by hand.
new["weight"] = new.pop("weights")
assert not new.keys() - layer.state_dict().keys()
swapped = functional_call(layer, new, (x,), strict=True)
check("strict=True, names fixed", swapped, new["weight"] @ x + new["bias"], 1e-15)

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


def power(s):  # s: one signal, or one signal per row
    return (weights * torch.fft.fft(s).abs().square()).sum(-1)


nudges = 1e-3 * torch.eye(16, **F64)
by_differences = (power(signal + nudges) - power(signal - nudges)) / 2e-3
check("real loss |X|², grad", grad(power)(signal), by_differences, 3e-12)

# %%
# grad_and_value(f)(\*args): Expected f(\*args) to return a ...
# --------------------------------------------------------------
# A ``RuntimeError`` when ``f`` returns no scalar tensor: a vector of per-sample losses, a
# model's output of shape ``[1]`` ("scalar Tensor, got tensor with 1 dims"), or a Python float
# from ``math`` or ``.item()`` ("a Tensor, got <class 'float'>").
head = nn.Linear(3, 1).to(**F64)
for not_scalar in (head, lambda x: (inputs @ x).square()):
    with fails_with(RuntimeError, "to return a scalar Tensor, got tensor with 1 dims"):
        grad(not_scalar)(x)
quiet = warnings.catch_warnings(action="ignore", category=UserWarning)  # from float()
with quiet, fails_with(RuntimeError, "to return a Tensor, got <class 'float'>"):
    grad(lambda x: math.sqrt(x.square().sum()))(x)
# Fixes: index or sum to a scalar (head(x)[0]); torch operators, not math; and for one gradient
# per output, jacrev or vjp, as the message says. The references are closed forms.
check("grad of head(x)[0]", grad(lambda x: head(x)[0])(x), head.weight[0], 1e-15)
norm_grad = grad(lambda x: x.square().sum().sqrt())(x)
check("grad of torch.sqrt", norm_grad, x / x.norm(), 1e-15)
per_loss = jacrev(lambda x: (inputs @ x).square())(x)
check("jacrev, one row per loss", per_loss, 2 * (inputs @ x)[:, None] * inputs, 1e-15)

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
check("has_aux, the gradient", slope, 2 * inputs.T @ residual / 8 + 2 * x, 1e-15)
check("has_aux, the aux value", parts["fit"], residual.square().mean(), 1e-15)

# %%
# In order to use an autograd.Function with functorch transforms ... setup_context
# --------------------------------------------------------------------------------
# A ``RuntimeError`` from an ``autograd.Function`` in the older style (``ctx`` as the forward's
# first argument), such as ``torch.utils.checkpoint.checkpoint(use_reentrant=True)``. For your
# own Function, the fix is a ``setup_context`` staticmethod:
# :ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`.
W = torch.randn(3, 4, **F64)
block = lambda x, W: (x @ W).tanh()  # noqa: E731  one sample's features
with fails_with(RuntimeError, "it must override the setup_context staticmethod"):
    vmap(lambda x: checkpoint(block, x, W, use_reentrant=True))(inputs)
# use_reentrant=False runs forward under vmap, but its recomputation in backward then meets
# batched tensors outside vmap and fails. The fix: checkpoint outside the transform, with the
# gradient by autograd. The reference: d/dW Σ tanh²(XW) = Xᵀ (2y (1 − y²)) for y = tanh(XW).
leaf = W.clone().requires_grad_()
with fails_with(RuntimeError, "Either your tensor may have escaped"):
    inside = vmap(lambda x: checkpoint(block, x, leaf, use_reentrant=False))(inputs)
    torch.autograd.grad(inside.square().sum(), leaf)
outside = checkpoint(vmap(block, in_dims=(0, None)), inputs, leaf, use_reentrant=False)
(by_autograd,) = torch.autograd.grad(outside.square().sum(), leaf)
y = block(inputs, W)
closed_form = inputs.T @ (2 * y * (1 - y**2))
check("checkpoint(vmap(f)), autograd", by_autograd, closed_form, 1e-15)

# %%
# jvp(f, primals, tangents): Expected primals and tangents to have the same python structure
# ------------------------------------------------------------------------------------------
# A ``RuntimeError`` when ``tangents`` is not a tuple of the same length as ``primals``; a
# tangent of another shape than its primal raises ``Trying to set a forward gradient that has
# a different size ...``. The fix: one tangent per primal, each shaped like it. The reference:
# the product rule, ``d(a·sin b) = da·sin b + a·cos b·db``.
a, b, da, db = torch.randn(4, 5, **F64)
wave = lambda a, b: a * b.sin()  # noqa: E731
with fails_with(RuntimeError, "Expected primals and tangents to have the same python"):
    jvp(wave, (a, b), (da,))
with fails_with(RuntimeError, "Trying to set a forward gradient that has a different"):
    jvp(wave, (a, b), (da, db[:4]))
_, directional = jvp(wave, (a, b), (da, db))
check("jvp, tangents like primals", directional, da * b.sin() + a * b.cos() * db, 1e-15)

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
check("vjp, cotangent like the output", cotangent_in, by_hand, 1e-15)
_, pull_both = vjp(lambda v: (squash(v), v.square().sum()), a)
with fails_with(RuntimeError, "Expected pytree structure of cotangents"):
    pull_both(u)
(both_in,) = pull_both((u, torch.tensor(1.0, **F64)))
check("vjp, one cotangent per output", both_in, by_hand + 2 * a, 1e-15)

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
check("argnums=1, the table", table_grad, 2 * table * counts[:, None], 1e-15)

# %%
# torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks
# ----------------------------------------------------------------------------
# A ``RuntimeError`` from ``checkpoint(use_reentrant=False)`` or
# ``torch.autograd.graph.save_on_cpu`` inside a reverse-mode transform, both built on saved
# tensor hooks. The fix: take the outer gradient with ``torch.autograd.grad``, where both
# work, or drop them inside ``grad``. The reference: the closed form of the previous section.
with fails_with(RuntimeError, "don't yet support saved tensor hooks"):
    grad(lambda W: checkpoint(block, inputs, W, use_reentrant=False).square().sum())(W)
with fails_with(RuntimeError, "don't yet support saved tensor hooks"):
    with torch.autograd.graph.save_on_cpu():
        grad(lambda W: block(inputs, W).square().sum())(W)
with torch.autograd.graph.save_on_cpu():
    (offloaded,) = torch.autograd.grad(block(inputs, leaf).square().sum(), leaf)
check("save_on_cpu, autograd.grad", offloaded, closed_form, 1e-15)

# %%
# vmap(f, ..., out_dims=...): out_dims is not compatible / must only return Tensors
# ---------------------------------------------------------------------------------
# A ``ValueError`` when ``out_dims`` has more or fewer entries than ``f`` has outputs, or when
# ``f`` returns a Python number (``f must only return Tensors, got type <class 'float'>``).
# The fix: one ``out_dims`` entry per output, ``None`` for a value returned once; here each
# standardised row lands in a column (``1``). The reference: the formula on the whole batch.


def standardise(row, eps=1e-6):
    return (row - row.mean()) / (row.std() + eps), eps


with fails_with(ValueError, "must only return Tensors, got type <class 'float'>"):
    vmap(standardise)(grid)
with fails_with(ValueError, "out_dims is not compatible with the structure of"):
    vmap(standardise, out_dims=(1, None, None))(grid)
columns, eps = vmap(standardise, out_dims=(1, None))(grid)
centred, spread = grid - grid.mean(1, keepdim=True), grid.std(1, keepdim=True) + eps
check("out_dims=(1, None)", columns, (centred / spread).T, 1e-15)

# %%
# vmap(f, in_dims=..., ...)(<inputs>): in_dims is not compatible / Got in_dim=...
# -------------------------------------------------------------------------------
# A ``ValueError`` when ``in_dims`` does not give one entry per argument, an axis the tensor
# lacks (``Got in_dim=1 for some input, but that input is a Tensor of dimensionality 1``), or
# an axis to a Python number (``Got in_dim=0 for an input but the input is of type``). The fix:
# per argument, the batch axis of a batched tensor and ``None`` for everything else.
samples = torch.randn(3, 5, **F64)  # five samples, one per column
weight, shift = torch.randn(2, 3, **F64), torch.randn(2, **F64)
affine = lambda x, weight, shift: weight @ x + shift  # noqa: E731
with fails_with(ValueError, "in_dims is not compatible with the structure of `inputs`"):
    vmap(affine, in_dims=(1, None))(samples, weight, shift)
with fails_with(ValueError, "Got in_dim=1 for some input, but that input is a"):
    vmap(affine, in_dims=1)(samples, weight, shift)
with fails_with(ValueError, "We cannot vmap over non-Tensor arguments, please use"):
    vmap(affine, in_dims=(1, None, 0))(samples, weight, 0.5)
mapped = vmap(affine, in_dims=(1, None, None))(samples, weight, shift)
check("in_dims=(1, None, None)", mapped, (weight @ samples + shift[:, None]).T, 1e-15)

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
check("in_dims=(0, None, None)", mapped, rows @ weight.T + shift, 1e-15)

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
check("vmap(jacrev(f))", jacobians, weight * (1 - rows.tanh() ** 2)[:, None, :], 1e-15)

# %%
# Every fix against its reference
# -------------------------------
# Each fix's relative error (grey; an exact match drawn at 1e-18) and its bound (black).
labels, pairs = list(measured), list(measured.values())
errors, bounds = [max(e, 1e-18) for e, _ in pairs], [bound for _, bound in pairs]
fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
ax.barh(labels, errors, color="0.65", label="measured")
ax.scatter(bounds, labels, marker="|", s=220, color="black", label="bound")
ax.set(xscale="log", xlim=(1e-19, 1e-9), xlabel="relative error against the reference")
ax.set_title(f"{len(labels)} fixes, each checked on {device.type}")
ax.legend(loc="lower right", frameon=False)
ax.invert_yaxis()
plt.show()

# %%
# Where to look when the message is not here
# ------------------------------------------
# Errors from batching rules, BatchNorm, ``has_aux`` floats, ``functional_call`` keywords and tied
# weights, complex Jacobians and ``ZeroTensors``: part 1,
# :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py`. Code that runs but computes
# something else (in-place writes, reductions over the batch, randomness, loss reductions):
# :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`. Custom ``autograd.Function`` and
# operators: :ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`.

# %%
# What to remember
# ----------------
# * ``in_dims`` and ``out_dims`` take one entry per argument or output: the batch axis of a
#   tensor, ``None`` for what is shared or not a tensor.
# * ``grad`` wants a real scalar tensor (``(loss, aux)`` with ``has_aux``); ``jvp`` wants one
#   tangent per primal and ``vjp`` one cotangent per output, each of the same shape.
# * Inside a transform, ask for gradients as outputs (``grad``, ``jacrev``), never by
#   ``.backward()``, ``requires_grad_()`` or ``torch.autograd.functional``.
# * Checkpointing and ``save_on_cpu`` go outside the transforms (``checkpoint(vmap(f))``), the
#   gradient by autograd; NumPy goes out of ``vmap`` (use torch operators).
# * ``functional_call`` ignores misspelt names unless ``strict=True``: check the names.
