"""
Troubleshooting torch.func, by error message
============================================

Paste an error message into the search box: each title begins with the message's first words as
PyTorch 2.13 prints them, in alphabetical order. Each section triggers the error (or links it),
asserts its type and words (``raises``), checks the fix (``agree``); :doc:`plot_pitfalls` explains
some. Parts 2 to 20, each with what it covers: :ref:`the Guides on the home page
<guides-on-the-home-page>`.
"""

import contextlib
import textwrap
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributions import Categorical, StudentT, kl_divergence
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64 = {"device": device, "dtype": torch.float64}
fix_errors = {}  # fix -> (measured error, bound), for the figure


@contextlib.contextmanager
def raises(error_type, words):
    try:
        yield
    except error_type as err:
        assert type(err) is error_type and words in str(err), f"{type(err)}: {err}"
        print(f"{error_type.__name__}: {textwrap.shorten(str(err), 150)}")
        return
    raise AssertionError(f"no {error_type.__name__} raised")


def agree(fix, got, want, bound):
    assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan()), fix
    got, want = got.detach().nan_to_num(), want.detach().nan_to_num()
    error = ((got - want).abs().max() / want.abs().max()).item()
    margin = f"margin {bound / error:.0f}x" if error else "exact"
    print(f"{fix}: error {error:.1e} (bound {bound:.0e}, {margin})")
    assert error < bound, fix
    fix_errors[fix] = (error, bound)


# %%
# Batch norm got a batched tensor as input while the running_mean or running_var ...
# -----------------------------------------------------------------------------------
# A ``RuntimeError`` from training-mode BatchNorm on single samples under ``vmap``: see
# :ref:`pitfalls <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, `section 6
# <plot_pitfalls.html#batchnorm-what-each-remedy-computes>`__. Under ``grad``: next section.
with raises(RuntimeError, "running_mean or running_var"):
    vmap(nn.BatchNorm2d(2).to(device))(torch.randn(4, 1, 2, 3, 3, device=device))

# %%
# During a grad (vjp, jvp, grad, etc) transform, ... would mutate a captured Tensor
# ---------------------------------------------------------------------------------
# A ``RuntimeError`` from training-mode BatchNorm under ``grad``, ``jacrev`` or ``jacfwd``: it
# adds one to its ``num_batches_tracked`` buffer in place: the ``aten::add_`` the message names.
# Its running statistics, also captured buffers, are updated too, and raise nothing themselves.
net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
net, batch = net.to(**f64), torch.randn(6, 3, **f64)
with raises(RuntimeError, "would mutate a captured Tensor"):
    jacrev(net)(batch)
# The fix the message suggests: pass the buffers in, as an argument not differentiated. They
# are updated once per call (the running mean to 0.9 times itself plus 0.1 times the batch mean),
# and each output depends on every sample, through the batch statistics (checked by autograd).
# ``vjp`` has no ``argnums``: there, clone them inside the function and return them as ``aux``
# (the page "functional_call in practice", section "Buffers", checks it).
net[1].running_mean.normal_()  # as if from earlier batches
state = {name: t.detach().clone() for name, t in net.state_dict().items()}
jac = jacrev(lambda s, x: functional_call(net, s, (x,)), argnums=1)(state, batch)
want = 0.9 * net[1].running_mean + 0.1 * net[0](batch).mean(0)
agree("running mean", state["1.running_mean"], want, 1e-14)
leaf = batch.clone().requires_grad_()
rows = [torch.autograd.grad(y, leaf, retain_graph=True)[0] for y in net(leaf)[:, 0]]
agree("train-mode Jacobian", jac[:, 0], torch.stack(rows), 1e-14)
print(f"sample 0's output moves with sample 1's input: {jac[0, 0, 1].norm():.2f}")
net.eval()  # per-sample Jacobians: now each output depends on its own sample only
per_sample = vmap(jacrev(lambda x: net(x[None])[0]))(batch)
loop = [torch.autograd.grad(net(x[None]).sum(), x)[0] for x in leaf]
agree("eval-mode per-sample Jacobians", per_sample[:, 0], torch.stack(loop), 1e-14)

# %%
# element 0 of tensors does not require grad and does not have a grad_fn
# ----------------------------------------------------------------------
# A ``RuntimeError`` from ``torch.autograd.grad`` inside ``vmap``: a sample's output has no graph to
# the weights. The fix, :func:`~torch.func.grad` inside ``vmap``, checked against a loop.
weights = torch.randn(3, **f64, requires_grad=True)
points, w = torch.randn(5, 3, **f64), weights.detach()
with raises(RuntimeError, "does not require grad"):
    vmap(lambda x: torch.autograd.grad((x @ weights).sin(), weights))(points)
per_sample = vmap(grad(lambda w, x: (x @ w).sin()), in_dims=(None, 0))(w, points)
loop = [torch.autograd.grad((x @ weights).sin(), weights)[0] for x in points]
agree("grad inside vmap", per_sample, torch.stack(loop), 1e-14)

# %%
# Expected tensors, got unsupported type <class 'float'>
# ------------------------------------------------------
# A ``RuntimeError`` from ``jacrev(f, has_aux=True)`` or ``grad`` when ``f`` returns a float as aux.


def residuals(w, x, as_float=True):  # x an argument: as a global, dynamo's guard on it
    r = (x @ w).tanh() - 1  # failed in the gallery's one-process build
    loss = r.detach().square().mean()
    return r, loss.item() if as_float else loss


with raises(RuntimeError, "unsupported type <class 'float'>"):
    jacrev(residuals, has_aux=True)(w, points)
# The fix: return the tensor, call .item() outside. Compiled around the transform: one graph, no
# break in dynamo's counters (``aot_eager`` traces with AOTAutograd, then runs the graphs as Python
# without Inductor's code generation: a fast build). The reference: (1 − tanh²(x·w)) x.
counters.clear()
compiled = torch.compile(jacrev(residuals, has_aux=True), backend="aot_eager")
jac, loss = compiled(w, points, False)
graphs, breaks = counters["stats"]["unique_graphs"], len(counters["graph_break"])
print(f"graphs: {graphs}, graph breaks: {breaks}, logged loss {loss.item():.4f}")
assert graphs == 1 and breaks == 0
want = (1 - (points @ w).tanh() ** 2)[:, None] * points
agree("has_aux tensor, compiled", jac, want, 1e-14)

# %%
# functional_call got multiple values for keys [...], which are tied
# -------------------------------------------------------------------
# A ``ValueError`` when two names of one tied parameter get two tensors, here an output layer
# reusing the embedding (``named_parameters()`` lists one name). ``tie_weights``: pitfalls,
# `section 7 <plot_pitfalls.html#tied-weights-in-functional-call>`__.


class TinyLM(nn.Module):  # keyword inputs, as Hugging Face models take them
    def __init__(self, vocab=7, width=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.unembed = nn.Linear(width, vocab, bias=False)
        self.unembed.weight = self.embed.weight  # tied

    def forward(self, input_ids=None, attention_mask=None):
        return self.unembed((self.embed(input_ids) * attention_mask[..., None]).tanh())


lm, ids = TinyLM().to(**f64), torch.randint(0, 7, (2, 5), device=device)
tokens = {"input_ids": ids, "attention_mask": (ids > 0).to(torch.float64)}
table, other = torch.randn(2, 7, 4, **f64)
with raises(ValueError, "which are tied"):
    functional_call(lm, {"embed.weight": table, "unembed.weight": other}, (), tokens)
# The fix: one name; the tie carries the tensor to the other, and the gradient adds up both
# uses. The reference: the model written out by hand, and autograd.
leaf = table.clone().requires_grad_()
by_hand = (leaf[ids] * tokens["attention_mask"][..., None]).tanh() @ leaf.T
(want,) = torch.autograd.grad(by_hand.square().sum(), leaf)
one_name = {"embed.weight": table}
agree("tied, one name", functional_call(lm, one_name, (), tokens), by_hand, 1e-14)
got = grad(lambda p: functional_call(lm, p, (), tokens).square().sum())(one_name)
agree("tied weight, gradient", got["embed.weight"], want, 1e-14)

# %%
# functional_call() got an unexpected keyword argument 'input_ids'
# ----------------------------------------------------------------
# A ``TypeError``: ``functional_call(model, params, **batch)`` hands the model's keyword inputs
# to ``functional_call`` (a dictionary as ``args`` would become the first input). The fix is
# ``kwargs=``; the reference, the model written out by hand with the swapped-in table.
with raises(TypeError, "unexpected keyword argument 'input_ids'"):
    functional_call(lm, one_name, **tokens)
agree("kwargs=", functional_call(lm, one_name, kwargs=tokens), by_hand, 1e-14)

# %%
# If \`is_grads_batched=True\`, we interpret the first dimension of each grad_output as ...
# -----------------------------------------------------------------------------------------
# A ``RuntimeError``: with ``is_grads_batched=True`` the first axis of ``grad_outputs`` counts
# cotangents, so one shaped like the output reads as a batch of smaller ones. For one cotangent,
# drop the flag; for the Jacobian, pass the identity's rows. Both against closed forms.
x = torch.randn(4, **f64, requires_grad=True)
y = x.sin() * x.sum()
with raises(RuntimeError, "grad_output as the batch dimension"):
    torch.autograd.grad(y, x, torch.ones_like(y), True, is_grads_batched=True)
(jac,) = torch.autograd.grad(y, x, torch.eye(4, **f64), True, is_grads_batched=True)
want = torch.diag(x.cos() * x.sum()) + x.sin()[:, None]
agree("is_grads_batched Jacobian", jac, want, 1e-14)
(one,) = torch.autograd.grad(y, x, torch.ones_like(y))
agree("one cotangent, no flag", one, x.cos() * x.sum() + x.sin().sum(), 1e-14)

# %%
# jacrev: Expected all inputs to be real but received complex tensor
# -------------------------------------------------------------------
# A ``RuntimeError``: :func:`~torch.func.jacrev` and ``jacfwd`` refuse complex inputs, and complex
# outputs ("Expected all outputs to be real"). The fix: :func:`torch.view_as_real` on both sides;
# for ``z ↦ a·z`` the real Jacobian has 2×2 blocks ``[[Re a, −Im a], [Im a, Re a]]``.
mix = torch.randn(3, 3, dtype=torch.complex128, device=device)
z = torch.randn(3, dtype=torch.complex128, device=device)
with raises(RuntimeError, "jacrev: Expected all inputs to be real"):
    jacrev(lambda v: mix @ v)(z)
jac = jacrev(lambda v: torch.view_as_real(mix @ torch.view_as_complex(v)))
want = torch.stack([mix.real, -mix.imag, mix.imag, mix.real], -1).view(3, 3, 2, 2)
agree("view_as_real Jacobian", jac(torch.view_as_real(z)), want.transpose(1, 2), 1e-14)
# grad of a *real* loss of complex inputs runs: it returns ∂L/∂x + i·∂L/∂y, twice the conjugate
# Wirtinger derivative ∂L/∂z̄. The reference: central differences along the real and imaginary
# axes of each entry (exact but for rounding: the loss is quadratic).
steps = 1e-3 * torch.eye(3, dtype=torch.complex128, device=device)
shifted = z + torch.cat([steps, -steps, 1j * steps, -1j * steps])  # one per row
energies = (shifted @ mix.T).abs().square().sum(1).view(4, 3)
want = (energies[0] - energies[1] + 1j * (energies[2] - energies[3])) / 2e-3
agree("grad, real loss", grad(lambda v: (mix @ v).abs().square().sum())(z), want, 2e-12)

# %%
# stack expects each tensor to be equal size
# -------------------------------------------
# A ``RuntimeError`` from ``vmap``'s fallback loop: :func:`torch.bincount` has no batching rule, so
# ``vmap`` runs it per sample, with a warning, and stacks results as long as each sample's largest
# label plus one. It works while the maxima agree, and fails on the first batch where they do not
# (as does ``repeat_interleave`` with tensor repeats). The fix: one-hot rows summed.
labels = torch.tensor([[0, 1, 1, 3], [2, 1, 0, 3], [0, 4, 4, 2]], device=device)
with warnings.catch_warnings(action="ignore", category=UserWarning):
    print("first two samples, largest label 3:", vmap(torch.bincount)(labels[:2]).shape)
    with raises(RuntimeError, "stack expects each tensor to be equal size"):
        vmap(torch.bincount)(labels)
counts = vmap(lambda row: F.one_hot(row, 5).sum(0))(labels)
want = torch.stack([torch.bincount(row, minlength=5) for row in labels])
agree("fixed-length counts", counts, want, 1e-16)

# %%
# The differentiated Tensor at index 0 appears to not have been used in the graph
# -------------------------------------------------------------------------------
# A ``RuntimeError`` when ``forward`` reads a parameter from a Python list made in ``__init__``:
# ``functional_call`` swaps registered parameters, not the list, so the tensor passed goes unused
# (``grad`` returns zeros). Another cause, ``y[0]`` differentiated with respect to ``x[0]``, is
# in :doc:`part 17 <plot_troubleshooting_one_sample_numpy_and_integers>`.


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.lin = nn.Parameter(torch.ones(3)), nn.Linear(3, 3)
        self.gates = [self.gate]  # a plain list

    def forward(self, x, through_list=True):
        gate = self.gates[0] if through_list else self.gate
        decay = sum(p.square().sum() for p in self.lin.parameters())
        return (self.lin(x) * gate).sum() + 0.1 * decay


gated, sample = Gated().to(**f64), torch.randn(3, **f64)
new = {k: torch.randn_like(p, requires_grad=True) for k, p in gated.named_parameters()}
with raises(RuntimeError, "at index 0 appears to not have been used"):
    torch.autograd.grad(functional_call(gated, new, sample), tuple(new.values()))
new = {name: t.detach() for name, t in new.items()}
silent = grad(lambda p: functional_call(gated, p, sample))(new)["gate"]
print(f"torch.func.grad through the list: gate gradient {silent.tolist()}")
assert not silent.any()
# Fixes: self.gate, or self.parameters() in forward (pytorch#92295). By hand: Wx + b, gate + 0.2b.
fixed = grad(lambda p: functional_call(gated, p, (sample, False)))(new)
weight, bias, gate = new["lin.weight"], new["lin.bias"], new["gate"]
agree("gate read as an attribute", fixed["gate"], weight @ sample + bias, 1e-14)
agree("self.parameters() in forward", fixed["lin.bias"], gate + 0.2 * bias, 1e-14)

# %%
# vmap: called random operation while in randomness error mode
# -------------------------------------------------------------
# A ``RuntimeError``: choose ``randomness=``; see :ref:`pitfalls
# <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, `section 5 <plot_pitfalls.html#randomness>`__.
with raises(RuntimeError, "randomness error mode"):
    vmap(lambda r: F.dropout(r, 0.5))(points)

# %%
# vmap: index_put_(self, \*extra_args) is not possible ...
# --------------------------------------------------------
# A ``RuntimeError`` from inside ``torch.distributions.StudentT``'s ``mean``: it
# copies ``loc`` (2, unbatched) and writes NaN into the copy where the batched ``df ≤ 1``. (A
# batched ``loc`` fails on a boolean mask, below.) The fix: :func:`torch.where`.
dfs = torch.tensor([0.5, 1.5, 3.0, 0.9], **f64)
with raises(RuntimeError, "vmap: index_put_(self, *extra_args) is not possible"):
    vmap(lambda df: StudentT(df, loc=2.0).mean)(dfs)
mean = vmap(lambda df: torch.where(df > 1, 2.0, torch.nan))(dfs)
want = torch.stack([StudentT(df, 2.0).mean for df in dfs])
agree("StudentT mean, torch.where", mean, want, 1e-16)

# %%
# vmap: inplace arithmetic(self, \*extra_args) is not possible ...
# ----------------------------------------------------------------
# A ``RuntimeError`` from writing batched values into a tensor made inside the function:
# :ref:`pitfalls <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, `section 1
# <plot_pitfalls.html#in-place-writes-into-a-tensor-made-inside-the-function>`__.
with raises(RuntimeError, "vmap: inplace arithmetic"):
    vmap(lambda r: torch.zeros(3, **f64).copy_(r))(points)

# %%
# vmap: It looks like you're attempting to use a Tensor in some data-dependent control flow
# -----------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``if`` or ``while`` on a tensor (:ref:`pitfalls
# <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, `section 2
# <plot_pitfalls.html#item-data-dependent-control-flow-and-leaving-torch>`__), in torch too:
# :func:`~torch.nn.functional.gaussian_nll_loss` tests ``any(var < 0)``: a batched ``var`` fails.
with raises(RuntimeError, "data-dependent control flow"):
    vmap(F.gaussian_nll_loss)(*torch.rand(3, 5, 4, **f64))
# So does a solver that stops on its residual, here Newton's method for x³ + x = a. The fix: a
# fixed number of steps, torch.where freezing each converged sample, then one step more for all:
# a frozen sample keeps the derivative of its last step, taken farther from the root. The
# references: the while loop per sample; dx/da = 1 / (3x² + 1) (implicit function theorem).


def newton(a, tol=1e-12, steps=None):
    x = torch.ones_like(a)
    while steps is None and (x**3 + x - a).abs() > tol:
        x = x - (x**3 + x - a) / (3 * x**2 + 1)
    for _ in range(steps or 0):
        r = x**3 + x - a
        x = torch.where(r.abs() > tol, x - r / (3 * x**2 + 1), x)
    return x - (x**3 + x - a) / (3 * x**2 + 1)  # one more step, for every sample


rights = 5 * torch.randn(6, **f64)
with raises(RuntimeError, "data-dependent control flow"):
    vmap(newton)(rights)
roots = torch.stack([newton(a) for a in rights])
agree("Newton, 40 steps + torch.where", vmap(newton)(rights, steps=40), roots, 1e-15)
slopes = vmap(grad(newton))(rights, steps=40)
agree("Newton, derivative", slopes, 1 / (3 * roots**2 + 1), 1e-14)
# A trap in torch.where: the branch not taken is still differentiated, and a NaN there (0 times
# an infinite slope) poisons the gradient. Keep both branches finite: where the input as well.
sqrt_or_zero = lambda x: torch.where(x > 0, x.sqrt(), 0.0)  # noqa: E731
safe = lambda x: torch.where(x > 0, torch.where(x > 0, x, 1.0).sqrt(), 0.0)  # noqa: E731
points = torch.tensor([0.0, 4.0], **f64)
assert vmap(grad(sqrt_or_zero))(points)[0].isnan()  # d√x at 0 is infinite, times 0: NaN
agree("torch.where, input guarded too", vmap(grad(safe))(points),
      torch.tensor([0, 0.25], **f64), 1e-15)  # fmt: skip

# %%
# vmap: It looks like you're calling .item() on a Tensor
# ------------------------------------------------------
# A ``RuntimeError`` from ``.item()``, ``float()`` or ``int()`` on a batched tensor: section 2
# of :ref:`pitfalls <sphx_glr_auto_examples_guides_plot_pitfalls.py>` (link above). Operators
# that size their output from values raise the next three errors.

# %%
# vmap: We do not support batching operators that can output dynamic shape ...
# ----------------------------------------------------------------------------
# A ``RuntimeError`` from ``nonzero``, ``unique`` and others whose output size depends on the
# values: :ref:`pitfalls <sphx_glr_auto_examples_guides_plot_pitfalls.py>`, `section 10
# <plot_pitfalls.html#operators-without-a-batching-rule-a-slow-loop-or-an-error>`__.
with raises(RuntimeError, "can output dynamic shape"):
    vmap(torch.unique)(labels)

# %%
# vmap: We do not support batching operators that can support dynamic shape ...
# -----------------------------------------------------------------------------
# A ``RuntimeError`` ending "Attempting to batch over indexing with a boolean mask", here from
# inside ``torch.distributions.kl_divergence`` of two ``Categorical``: it sets the terms where
# ``q`` is zero to infinity through a boolean mask. The fix: the KL written with ``log_softmax``,
# its per-sample gradients checked against ``autograd.grad`` of torch's KL on the whole batch.
p, q = torch.randn(2, 5, 4, **f64)  # logits of two distributions, per sample
with raises(RuntimeError, "indexing with a boolean mask"):
    vmap(lambda a, b: kl_divergence(Categorical(logits=a), Categorical(logits=b)))(p, q)
kl = grad(lambda a, b: (a.softmax(0) * (a.log_softmax(0) - b.log_softmax(0))).sum())
leaf = p.clone().requires_grad_()
distances = kl_divergence(Categorical(logits=leaf), Categorical(logits=q))
(want,) = torch.autograd.grad(distances.sum(), leaf)
agree("KL written out, gradients", vmap(kl)(p, q), want, 1e-14)

# %%
# When vmap-ing torch.nn.functional.one_hot, please provide an explicit positive ...
# ----------------------------------------------------------------------------------
# A ``RuntimeError``: without ``num_classes``, :func:`~torch.nn.functional.one_hot` takes its
# width from the largest label, a value. The fix is to give ``num_classes``.
with raises(RuntimeError, "provide an explicit positive num_classes"):
    vmap(F.one_hot)(labels)
want = torch.stack([F.one_hot(row, 5) for row in labels])
agree("one_hot, num_classes", vmap(F.one_hot, (0, None))(labels, 5), want, 1e-16)

# %%
# ZeroTensors are immutable. Please use the materialized zero tensor obtained using .clone()
# ------------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``jvp(grad(loss))`` with :func:`~torch.nn.functional.mse_loss`'s
# default ``reduction="mean"`` (pytorch#112013, #123996): per a proposed fix (pytorch#197723),
# its second-derivative formula divides in place the target's tangent, a ZeroTensor since the
# target has none (``reduction="sum"`` runs). Fixes: reverse over reverse (``vjp`` of ``grad``),
# the squared error written out, or an explicit zero tangent for the target. The
# reference: the Hessian-vector product ``2/(n·m)·Xᵀ X V`` for ``n`` samples of ``m`` outputs.
X, goal = torch.randn(10, 3, **f64), torch.randn(10, 2, **f64)
W, V = torch.randn(2, 3, 2, **f64)
mse_grad = grad(lambda W: F.mse_loss(X @ W, goal))
with raises(RuntimeError, "ZeroTensors are immutable"):
    jvp(mse_grad, (W,), (V,))
written_grad = grad(lambda W: (X @ W - goal).square().mean())
want = X.T @ X @ V / 10  # 2/(n·m) = 1/10
agree("jvp(grad), written out", jvp(written_grad, (W,), (V,))[1], want, 1e-14)
agree("vjp(grad(mse_loss))", vjp(mse_grad, W)[1](V)[0], want, 1e-14)
both_grad = grad(lambda W, target: F.mse_loss(X @ W, target))
tangent = jvp(both_grad, (W, goal), (V, torch.zeros_like(goal)))[1]
agree("jvp(grad), zero target tangent", tangent, want, 1e-14)

# %%
# (No error) jvp in a training loss, then backward()
# --------------------------------------------------
# Forward mode and ``backward()`` do mix, with no error in 2.13: a training penalty on a
# Jacobian-vector product, by :func:`~torch.func.jvp` of the model, backpropagates like any
# loss. The reference: central differences along each entry of the first weight.
smooth = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)).to(**f64)
probe, direction = torch.randn(2, 6, 3, **f64)


def penalised(p):
    out, slope = jvp(lambda x: functional_call(smooth, p, x), (probe,), (direction,))
    return out.square().mean() + slope.square().mean()


penalised({}).backward()  # {}: the model's own parameters
first, steps = smooth[0].weight, 1e-5 * torch.eye(24, **f64).view(24, 8, 3)
with torch.no_grad():  # a step along each entry, each way
    ends = [penalised({"0.weight": first + s * e}) for s in (1, -1) for e in steps]
want = (torch.stack(ends[:24]) - torch.stack(ends[24:])).view(8, 3) / 2e-5
agree("jvp penalty, backward()", first.grad, want, 5e-9)

# %%
# Every fix against its reference
# -------------------------------
# Each fix's relative error (grey; an exact match drawn at 1e-18) and its bound (black).
names, (errors, bounds) = list(fix_errors), zip(*fix_errors.values())
fig, ax = plt.subplots(figsize=(7, 7.5), layout="constrained")
ax.barh(names, [max(e, 1e-18) for e in errors], color="0.6")  # measured
ax.scatter(bounds, names, color="black", marker="|", s=200)  # allowed
ax.set(xscale="log", xlim=(1e-19, 1e-8), xlabel="error relative to the reference")
ax.set_title(f"{len(names)} checked fixes, {device.type}")
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# * Errors from inside torch (distributions, losses): rewrite those lines with batched operators.
# * Under ``vmap`` no shape and no ``if`` may depend on values: give ``num_classes``, fixed lengths
#   and solvers a fixed number of steps, frozen with ``torch.where``. Part 15: batch-sized code.
# * Transforms want state as inputs and tensors as outputs: pass BatchNorm buffers in, return
#   tensors from ``has_aux``, and use ``grad``, not ``autograd.grad``, inside ``vmap``.
# * ``functional_call``: inputs by ``kwargs=``, one name per tied weight, registered parameters.
# * Complex Jacobians: ``view_as_real`` both sides. If ``jvp(grad)`` hits ``ZeroTensors``: ``vjp``.
