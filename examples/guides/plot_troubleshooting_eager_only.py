"""
Troubleshooting, part 14: what eager allows and vmap refuses: .data, memory formats, 1-D weights
================================================================================================

Errors from code that runs in eager and stops under a transform: reading ``.data`` inside
``vmap`` (a model's own code, or a summary tool's hook, as torchinfo's); asking for a memory
format such as ``channels_last`` inside ``vmap``; and ``F.linear`` with a 1-D weight under
``grad``, ``jvp`` or ``vmap``; anomaly mode, and a custom backward with ``out=`` or a view, under a
batched backward pass. Each is raised and
asserted, its cause read in torch's source or shown by a log of the operators that ran, and its
fix checked against eager autograd or a loop. Then a table of what a function may ask of its
tensor under ``vmap``, ``grad`` and ``jvp``.
Part 1: :doc:`plot_troubleshooting`; hooks under transforms: :doc:`plot_extending_torch_func`.
"""

import warnings
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jacrev, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
wide = dict(dtype=torch.float64, device=device)  # float64 on the page's device


def raises(kind, words, call):
    """call() raises exactly kind, with words in its message; returns the message."""
    try:
        call()
    except kind as err:  # any other type stops the page
        text = " ".join(f"{err}".split())
        assert type(err) is kind and words in text, f"{type(err).__name__}: {text}"
        print(f"  {kind.__name__}: {text[:100]}")
        return text
    raise AssertionError(f"torch {torch.__version__}: no {kind.__name__} ({words})")


def close(label, got, want, bound):
    """got against want: the largest gap over the largest reference entry, within bound."""
    assert got.shape == want.shape, f"{label}: {tuple(got.shape)}, {tuple(want.shape)}"
    gap = ((got - want).abs().max() / want.abs().max()).item()
    assert gap <= bound, f"{label}: error {gap:.1e} above {bound:.0e}"  # NaN fails too
    print(f"  {label}: error {gap:.1e}, bound {bound:.0e}")


# %%
# accessing `data` under vmap transform is not allowed
# ----------------------------------------------------
# A ``RuntimeError`` when code under ``vmap`` reads ``t.data``: yours, or a tool's. Here a layer
# maps a small function over its channels with ``vmap`` (as state-space layers such as S5 do;
# i404788/s5-pytorch#5), and a summary tool records each layer's input with a forward hook that
# asks ``hasattr(t, "data")``, as torchinfo does. ``hasattr`` catches only ``AttributeError``, so
# the ``RuntimeError`` goes through. The hook on the mapped ``nn.Linear`` runs inside ``vmap``.
class PerChannel(nn.Module):  # one small MLP shared by every channel, mapped with vmap
    def __init__(self, width=8):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 1))
        self.inner.to(**wide)

    def forward(self, x):  # x: (batch, channels, 3) -> (batch, channels)
        return vmap(self.inner, in_dims=1, out_dims=1)(x)[..., 0]


def summary(model, x, check):
    """Each leaf module's input size, from forward hooks; check(t) picks what is a tensor."""
    rows, handles = [], []
    for name, layer in model.named_modules():
        if not list(layer.children()):
            hook = lambda m, args, out, n=name: rows.append(  # noqa: E731
                (n, tuple(args[0].shape) if check(args[0]) else None)
            )
            handles.append(layer.register_forward_hook(hook))
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return rows


layer, x = PerChannel(), torch.randn(5, 4, 3, **wide)  # 5 samples, 4 channels
raises(RuntimeError, "accessing `data` under vmap transform is not allowed",
       lambda: summary(layer, x, lambda t: hasattr(t, "data")))  # fmt: skip

# %%
# The fix in the tool: ask ``isinstance(t, torch.Tensor)``, not for ``.data``. The sizes it then
# records for the layers inside the ``vmap`` are one channel's, (5, 3), with no channel axis
# (asserted): a summary of a mapped layer describes one call of the function ``vmap`` maps.
# torchinfo itself still asks ``hasattr``; a summary that runs no forward pass (no input given)
# calls no hook (torchinfo was not run here).
rows = summary(layer, x, lambda t: isinstance(t, torch.Tensor))
print("  recorded:", rows)
assert rows[0] == ("inner.0", (5, 3)) and rows[-1] == ("inner.2", (5, 8)), rows

# %%
# In your own code under ``vmap``, ``t.detach()`` gives what ``t.data`` would: the same values,
# cut from autograd. Here a layer that scales by a weight read through ``.data`` (so no gradient
# flows to it), mapped over an ensemble's members; the fix against a loop of eager calls.
# Why it raises: ``.data`` makes a detached shallow copy of the tensor's implementation, and
# functorch's ``BatchedTensorImpl::shallow_copy_and_detach`` raises this message on purpose
# (read in ``aten/src/ATen/functorch/BatchedTensorImpl.cpp``); setting ``t.data = ...`` raises
# "mutating directly with `.data` under vmap transform is not allowed." Under ``grad``, ``.data``
# runs, as a stop-gradient (:doc:`plot_tensor_types_under_transforms`).
scales = torch.rand(3, 4, **wide) + 0.5  # 3 members' weights
through_data = vmap(lambda s, x: x * s.data[:, None], in_dims=(0, None))
raises(RuntimeError, "accessing `data` under vmap", lambda: through_data(scales, x[0]))
by_detach = vmap(lambda s, x: x * s.detach()[:, None], in_dims=(0, None))(scales, x[0])
close("detach() under vmap, against a loop", by_detach,
      torch.stack([x[0] * s[:, None] for s in scales]), 0.0)  # fmt: skip
cut = lambda s, x: (x * s.detach()[:, None]).sum() + s.sum()  # noqa: E731
through_cut = vmap(grad(cut), in_dims=(0, None))(scales, x[0])  # only s.sum() reaches s
close("detach() cuts the gradient, as .data", through_cut, torch.ones_like(scales), 0.0)
setter = vmap(lambda t: setattr(t, "data", t * 2) or t)
raises(RuntimeError, "mutating directly with `.data`", lambda: setter(x))

# %%
# NYI: querying is_contiguous inside of vmap for memory_format other than torch.contiguous_format
# -------------------------------------------------------------------------------------------------
# A ``RuntimeError`` when code under ``vmap`` asks about or converts to a memory format other
# than the default: ``is_contiguous(memory_format=...)``, ``contiguous(memory_format=...)`` with
# ``channels_last``, ``channels_last_3d``, even ``preserve_format``. Other ``memory_format=``
# arguments raise other messages: ``.to`` and ``empty_like``, "required rank 4 tensor to use
# channels_last format" for a 4-D sample; ``clone``, "NYI: Tensor.clone(memory_format)". Keras
# 3's ``vectorized_map`` on the torch backend raised the first from a 3-D convolution
# (keras-team/keras#23587). ``grad`` and ``jvp`` run the same calls (asserted below); a layout
# changes where values sit, never which.
# The fix: convert the whole batch outside ``vmap``, where the call is allowed, and keep layout
# calls out of the mapped function; checked against the convolution of the whole batch, eager.
# Inside a library you cannot edit: the reporter's Keras 3.13.2 ran; a fix was proposed in
# keras-team/keras#23588 (open when read).
conv = nn.Conv3d(3, 2, 2).to(**wide)
volumes = torch.randn(4, 3, 5, 6, 7, **wide)  # 4 samples, 3 channels, 5 x 6 x 7
to_channels_last = lambda v: v.contiguous(memory_format=torch.channels_last)  # noqa: E731
as_written = vmap(lambda v: conv(to_channels_last(v)[None])[0])  # v: (3, 5, 6, 7)
raises(
    RuntimeError,
    "NYI: querying is_contiguous inside of vmap",
    lambda: as_written(volumes),
)
outside = volumes.contiguous(
    memory_format=torch.channels_last_3d
)  # the batch, outside vmap
mapped = vmap(lambda v: conv(v[None])[0])(outside)
close("channels_last_3d batch, mapped conv", mapped, conv(volumes), 1e-15)
assert outside.is_contiguous(memory_format=torch.channels_last_3d)
as_cl = dict(memory_format=torch.channels_last)
raises(
    RuntimeError,
    "required rank 4 tensor",
    lambda: vmap(lambda v: v.to(**as_cl))(volumes),
)
raises(RuntimeError, "required rank 4 tensor",
       lambda: vmap(lambda v: torch.empty_like(v, **as_cl))(volumes))  # fmt: skip
raises(RuntimeError, "NYI: Tensor.clone(memory_format)",
       lambda: vmap(lambda v: v.clone(**as_cl))(volumes))  # fmt: skip
for name, transform in [("grad", lambda f, v: grad(lambda u: f(u).sum())(v)),
                        ("jvp", lambda f, v: jvp(f, (v,), (v,))[1])]:  # fmt: skip
    transform(to_channels_last, volumes[0])  # runs: only vmap refuses
    print(f"  {name}: contiguous(memory_format=channels_last) runs")


# %%
# mat2 must be a matrix, got 1-D tensor
# -------------------------------------
# A ``RuntimeError`` from ``F.linear(x, w, b)`` with a 1-D weight ``w`` (one output, no output
# axis) and a bias, as pytorch#188891 reports: with a 0-d bias eager accepts a 1-D or 3-D ``x``
# but refuses a 2-D one (with a ``(1,)`` bias, as ``nn.Linear(3, 1)`` has, eager refuses every
# rank), and under ``grad`` and ``jvp`` the 3-D call fails too; ``vmap`` over the sequences hands
# it 2-D samples ("Shape mismatch: Got incorrect dims for mm"). Why: under a transform, functorch
# runs its own ``linear``, ``linear_hack`` (read in functorch's ``PyTorchOperatorHacks.cpp``),
# which sends a 2-D input with a bias, and a contiguous 3-D one viewed as 2-D, to ``addmm``, a
# matrix product that wants a 2-D weight. Eager's ``linear`` uses
# ``addmm`` for a 2-D input only. A log of the operators that reached the kernels (a
# ``TorchDispatchMode``) shows it: eager, 3-D: ``view`` and ``mv``; 2-D: ``addmm``; under ``grad``,
# 3-D: ``view`` then ``addmm``. Without a bias, neither takes ``addmm``, and the call runs.
class Operators(TorchDispatchMode):  # records each operator that reaches a kernel
    def __torch_dispatch__(self, kernel, types, args=(), kwargs=None):
        self.seen.append(kernel.overloadpacket.__name__)
        return kernel(*args, **(kwargs or {}))

    def __enter__(self):
        self.seen = []
        return super().__enter__()


tokens = torch.randn(2, 5, 3, **wide)  # 2 sequences of 5 tokens, 3 features
w, b = torch.randn(3, **wide), torch.tensor(0.5, **wide)
eager_3d, eager_2d, under_grad = Operators(), Operators(), Operators()
with eager_3d:
    F.linear(tokens, w, b)  # runs
with eager_2d:
    raises(RuntimeError, "mat2 must be a matrix", lambda: F.linear(tokens[0], w, b))
raises(RuntimeError, "mat2 must be a matrix", lambda: F.linear(tokens, w, b[None]))
readout = lambda w: F.linear(tokens, w, b).sum()  # noqa: E731
with under_grad:
    raises(
        RuntimeError, "mat2 must be a matrix, got 1-D tensor", lambda: grad(readout)(w)
    )
for label, log in [("eager, 3-D", eager_3d), ("eager, 2-D", eager_2d),
                   ("grad, 3-D", under_grad)]:  # fmt: skip
    print(f"  {label}: {log.seen}")
assert "mv" in eager_3d.seen and "addmm" not in eager_3d.seen
assert "addmm" in eager_2d.seen and "addmm" in under_grad.seen
raises(RuntimeError, "mat2 must be a matrix",
       lambda: jvp(lambda t: F.linear(t, w, b), (tokens,), (tokens,)))  # fmt: skip
raises(RuntimeError, "Shape mismatch: Got incorrect dims for mm",
       lambda: vmap(lambda t: F.linear(t, w, b))(tokens))  # fmt: skip
no_bias = grad(lambda w: F.linear(tokens, w).sum())(w)  # runs: no bias, no addmm
close("no bias, grad", no_bias, tokens.sum((0, 1)), 1e-15)

# %%
# The fixes: add the bias after, ``F.linear(x, w) + b``, or write the product out,
# ``x @ w + b`` (``matmul`` takes a 1-D right operand at any rank), or keep the weight 2-D,
# ``(1, features)``, and drop the output axis. Checked in float64: values against the sum
# ``(x * w).sum(-1) + b``; the gradient in ``w`` of their sum, the sum of the tokens; the jvp in
# ``x`` along ``v``, ``v @ w``; under ``vmap`` over the sequences, a loop of eager calls.
by_sum = (tokens * w).sum(-1) + b  # no matrix product: the reference values
FIXES = {
    "F.linear(x, w) + b": lambda w, t: F.linear(t, w) + b,
    "x @ w + b": lambda w, t: t @ w + b,
    "2-D weight": lambda w, t: F.linear(t, w[None], b)[..., 0],
}
along = torch.randn_like(tokens)
for name, fixed in FIXES.items():
    in_w, in_x = partial(fixed, t=tokens), partial(fixed, w)  # functions of w, of x
    close(f"{name}, values", fixed(w, tokens), by_sum, 1e-15)
    summed = grad(lambda w, f=in_w: f(w).sum())(w)
    close(f"{name}, grad", summed, tokens.sum((0, 1)), 1e-15)
    close(f"{name}, jvp", jvp(in_x, (tokens,), (along,))[1], along @ w, 1e-15)
    close(f"{name}, vmap", vmap(in_x)(tokens), torch.stack([in_x(t) for t in tokens]),
          1e-15)  # fmt: skip

# %%
# Batching rule not implemented for aten::item. We could not generate a fallback
# -------------------------------------------------------------------------------
# Raised by autograd's own batched backward (``is_grads_batched=True``, which
# ``torch.autograd.functional.jacobian(..., vectorize=True)`` uses) under
# ``torch.autograd.set_detect_anomaly(True)``. That backward runs on an older vmap
# (``torch._vmap_internals``), not ``torch.func.vmap``. Anomaly mode checks each gradient for NaN,
# and there the check asks the batched gradient for one Python value: with ``check_nan=False``
# (no NaN check, the forward traceback kept) the same calls run (asserted). Better, as it keeps
# the check: ``torch.func.jacrev`` (or ``vmap`` over ``torch.func.vjp`` for other cotangents)
# runs under full anomaly mode and still names the operator that made a NaN (asserted with
# ``sqrt`` of a negative number). Without anomaly mode, a custom ``backward`` that calls
# ``float`` or ``.item()`` on its gradient raises the same under ``vectorize=True`` (asserted; an
# ``if`` on it raises the ``aten::is_nonzero`` form): keep Python numbers out of it.
at = torch.randn(5, requires_grad=True, **wide)
curve = at.sin() * at
exact = torch.diag(at.cos() * at + at.sin()).detach()  # d(x sin x)/dx on the diagonal
rows = {
    "is_grads_batched": lambda: torch.autograd.grad(
        curve, at, torch.eye(5, **wide), retain_graph=True, is_grads_batched=True
    )[0],
    "jacobian(vectorize=True)": lambda: torch.autograd.functional.jacobian(
        lambda t: t.sin() * t, at.detach(), vectorize=True
    ),
}
with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
    warnings.simplefilter("ignore")  # anomaly mode warns at every backward
    for name, call in rows.items():
        print(f"{name}, anomaly mode:")
        raises(RuntimeError, "Batching rule not implemented for aten::item", call)
    close(
        "jacrev, anomaly mode", jacrev(lambda t: t.sin() * t)(at.detach()), exact, 1e-15
    )
    negative = -at.detach().abs() - 1  # sqrt of these is NaN, and so is its backward
    print("jacrev, anomaly mode, NaN from sqrt:")
    raises(RuntimeError, "Function 'SqrtBackward0' returned nan values", lambda: jacrev(
        lambda t: torch.where(t > 0, t.sqrt(), t))(negative))  # fmt: skip
with (
    warnings.catch_warnings(),
    torch.autograd.set_detect_anomaly(True, check_nan=False),
):
    warnings.simplefilter("ignore")
    for name, call in rows.items():
        close(f"{name}, anomaly mode with check_nan=False", call(), exact, 1e-15)


class DoubleIfPositive(
    torch.autograd.Function
):  # a backward that asks for a Python number
    forward = staticmethod(lambda ctx, t: 2 * t)
    backward = staticmethod(lambda ctx, g: 2 * g if float(g.norm()) >= 0 else g)


print("a backward calling float(), vectorize=True, no anomaly mode:")
vectorized = partial(torch.autograd.functional.jacobian, vectorize=True)
raises(RuntimeError, "Batching rule not implemented for aten::item",
       partial(vectorized, DoubleIfPositive.apply, at.detach()))  # fmt: skip


# %%
# Batching rule not implemented for aten::alias; the fallback path doesn't work on out= or view ops
# -------------------------------------------------------------------------------------------------
# Also from ``jacobian(..., vectorize=True)``, whose batched backward runs each ``backward`` of a
# custom Function on the older vmap (part 4, :doc:`plot_troubleshooting_custom_and_compiled`,
# shows the message under ``torch.vmap``): an operator with no batching rule falls back to a loop
# over the batch, except ``out=`` forms and some views (``aten.alias`` here; ``.detach()`` and
# ``.flatten()`` too), which raise. The same Functions run with ``vectorize=False`` (one backward
# per row), and written without ``out=`` or the view they run either way. ``torch.func.jacrev``
# runs the view backward once the Function has ``setup_context`` (asserted), not the ``out=`` one.
# ``strategy="forward-mode"`` exists only with ``vectorize=True`` (asserted below); for forward
# mode without that API, ``torch.func.jacfwd``.
class DoubleInto(DoubleIfPositive):  # a backward that writes into a buffer
    backward = staticmethod(lambda ctx, g: torch.mul(g, 2, out=torch.empty_like(g)))


class DoubleAlias(DoubleIfPositive):  # a backward that returns a view of its result
    backward = staticmethod(lambda ctx, g: torch.ops.aten.alias(2 * g))


class DoubleOutOfPlace(DoubleIfPositive):  # the fix: a new tensor, no out=, no view
    backward = staticmethod(lambda ctx, g: 2 * g)


class DoubleAliasNewStyle(torch.autograd.Function):  # the alias, for torch.func.jacrev
    forward = staticmethod(lambda t: 2 * t)
    setup_context = staticmethod(lambda ctx, inputs, output: None)
    backward = DoubleAlias.backward


twice = 2 * torch.eye(5, **wide)
close("jacrev, the alias with setup_context", jacrev(DoubleAliasNewStyle.apply)(at.detach()),
      twice, 0.0)  # fmt: skip
close("DoubleOutOfPlace, vectorize=True", vectorized(DoubleOutOfPlace.apply, at.detach()),
      twice, 0.0)  # fmt: skip
for function, op in ((DoubleInto, "aten::mul.out"), (DoubleAlias, "aten::alias")):
    print(f"{function.__name__}, vectorize=True:")
    raises(RuntimeError, f"Batching rule not implemented for {op}; the fallback",
           partial(vectorized, function.apply, at.detach()))  # fmt: skip
    row_by_row = torch.autograd.functional.jacobian(function.apply, at.detach())
    close(f"{function.__name__}, vectorize=False", row_by_row, twice, 0.0)
forward_mode = partial(torch.autograd.functional.jacobian, torch.sin, at.detach(),
                       strategy="forward-mode")  # fmt: skip
print("strategy='forward-mode', vectorize=False:")
raises(NotImplementedError, "only implemented for `vectorize=True`", forward_mode)
close("forward-mode, vectorize=True", forward_mode(vectorize=True),
      torch.diag(at.cos()).detach(), 1e-15)  # fmt: skip


# %%
# What a function may ask of its tensor, under each transform
# -----------------------------------------------------------
# Each question asked of the input inside ``vmap``, ``grad`` and ``jvp`` (on the CPU, whatever
# this page's device: ``numpy`` needs it). "runs" or the error's first words; the ``vmap``
# column is asserted. Under ``vmap`` sizes and strides are one sample's. Each transform hands the
# function a wrapper tensor, with no storage: data pointers and NumPy are refused under all three.
# ``requires_grad_`` is refused inside any transform, even on a tensor made there (part 12). Only
# ``vmap`` refuses ``.data`` and memory-format questions.
QUESTIONS = {
    "t.shape, t.stride()": lambda t: (t.shape, t.stride()),
    "isinstance(t, Tensor)": lambda t: isinstance(t, torch.Tensor),
    "t.requires_grad, t.grad_fn": lambda t: (t.requires_grad, t.grad_fn),
    "t.detach()": lambda t: t.detach(),
    "t.is_contiguous()": lambda t: t.is_contiguous(),
    "t.data": lambda t: t.data,
    "t.is_contiguous(channels_last)": lambda t: t.is_contiguous(
        memory_format=torch.channels_last
    ),
    "t.numpy()": lambda t: t.detach().numpy(),
    "t.data_ptr()": lambda t: t.data_ptr(),
    "t.untyped_storage()": lambda t: t.untyped_storage(),
    "t.requires_grad_()": lambda t: t.requires_grad_(),
}
TRANSFORMS = {
    "vmap": lambda ask, t: vmap(lambda u: (ask(u), u)[1])(t),
    "grad": lambda ask, t: grad(lambda u: (ask(u), u.sum())[1])(t[0]),
    "jvp": lambda ask, t: jvp(lambda u: (ask(u), u)[1], (t[0],), (t[0],)),
}
batch = torch.randn(3, 2, 4, 5, dtype=torch.float64)  # on the CPU
answers, refusals = {}, {}  # refusals: (type, message) of each cell that raised
for question, ask in QUESTIONS.items():
    for name, transform in TRANSFORMS.items():
        try:
            transform(ask, batch)
            answers[question, name] = "runs"
        except (RuntimeError, NotImplementedError) as err:
            answers[question, name] = " ".join(str(err).split()[:5])
            refusals[question, name] = type(err), " ".join(str(err).split())
print(f"{'':>31}" + "".join(f"{name:>29}" for name in TRANSFORMS))
for question in QUESTIONS:
    print(
        f"{question:>31}"
        + "".join(f"{answers[question, n][:27]:>29}" for n in TRANSFORMS)
    )
no_storage = {  # refused under every transform: each cell's type and message
    "t.numpy()": (RuntimeError, "Cannot access data pointer of Tensor"),
    "t.data_ptr()": (RuntimeError, "Cannot access data pointer of Tensor"),
    "t.untyped_storage()": (NotImplementedError, "Cannot access storage of"),
    "t.requires_grad_()": (
        RuntimeError,
        "You are attempting to call Tensor.requires_grad_()",
    ),
}
expected = {(q, n): said for q, said in no_storage.items() for n in TRANSFORMS}
expected["t.data", "vmap"] = RuntimeError, "accessing `data` under vmap transform"
expected["t.is_contiguous(channels_last)", "vmap"] = (
    RuntimeError,
    "NYI: querying is_contiguous",
)
assert set(refusals) == set(expected), sorted(set(refusals) ^ set(expected))
for cell, (kind, words) in expected.items():
    assert refusals[cell][0] is kind and words in refusals[cell][1], (
        cell,
        refusals[cell],
    )

# %%
# The same table as a picture: dark where the question raises.
fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
refused = [[answers[q, n] != "runs" for n in TRANSFORMS] for q in QUESTIONS]
ax.imshow(refused, cmap="Greys", vmin=-0.3, vmax=1.3, aspect="auto")
ax.set_xticks(range(len(TRANSFORMS)), list(TRANSFORMS))
ax.set_yticks(range(len(QUESTIONS)), list(QUESTIONS))
ax.set_title(f"Refused (dark) or answered, torch {torch.__version__}")
plt.show()

# %%
# What to remember
# ----------------
# - Under ``vmap``, read ``t.detach()``, not ``t.data``; a tool's hook should test
#   ``isinstance(t, torch.Tensor)``, not ``hasattr(t, "data")``. Inside ``vmap`` a hook sees one
#   sample's sizes.
# - Memory formats are a layout, not values: convert the batch outside ``vmap`` and keep every
#   ``memory_format=`` argument (``contiguous``, ``is_contiguous``, ``to``, ``clone``,
#   ``empty_like``) out of the mapped function.
# - ``F.linear`` with a 1-D weight and a bias fails under ``grad`` and ``jvp`` for a 2-D or
#   contiguous 3-D input, and in eager at some ranks: add the bias after (``F.linear(x, w) + b``),
#   write ``x @ w + b``, or keep the weight 2-D.
# - Inside any transform, storage, data pointers and NumPy are refused; under ``vmap``, sizes
#   and strides are one sample's.
# - ``vectorize=True`` and ``is_grads_batched`` run the backward on an older vmap: under anomaly
#   mode use ``torch.func.jacrev`` (it keeps the NaN check) or ``check_nan=False``; in a custom
#   backward, no Python numbers, no ``out=``, no ``alias``, ``.detach()`` or ``.flatten()``.
