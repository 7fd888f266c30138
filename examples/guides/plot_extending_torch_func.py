"""
Extending ``torch.func``: custom autograd Functions under transforms
====================================================================

When a function cannot be written with PyTorch operators (it calls NumPy or a C library, or
its gradient needs a formula autograd would not find), a custom
:class:`torch.autograd.Function` supplies the forward and the derivatives by hand. To work
under ``grad``, ``vmap``, ``jvp``, ``jacrev``, ``jacfwd`` and ``hessian``, it must follow three
rules: a forward without ``ctx`` plus a ``setup_context``; a ``vmap`` staticmethod or
``generate_vmap_rule = True``; a ``jvp`` staticmethod for forward mode. This page writes two
such Functions, checks every derivative against closed forms and with ``gradcheck`` in float64,
and shows the error for each rule that is broken.
"""

# %%
# Setup
# -----
# Everything runs in float64, so that ``gradcheck``'s finite differences are accurate.
import textwrap

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

x = torch.linspace(-2, 2, 9, device=device, dtype=torch.float64)

# %%
# The recipe: a Function whose forward PyTorch cannot see into
# ------------------------------------------------------------
# ``NumpyTanh`` computes tanh in NumPy, so no transform can look inside it. It says everything
# itself:
#
# * ``forward(x)`` computes the output, with no ``ctx``;
# * ``setup_context`` saves the output, which both derivatives need: ``save_for_backward`` for
#   reverse mode, ``save_for_forward`` for forward mode;
# * ``backward`` is the vector-Jacobian product ``g · (1 − y²)``, written with PyTorch
#   operators so that it can itself be differentiated (``hessian`` needs that);
# * ``jvp`` is the Jacobian-vector product ``t · (1 − y²)``;
# * ``vmap`` says how to run on a batch: tanh is element-wise, so the batched input goes
#   through the same NumPy call and the output is batched along the same dimension.


class NumpyTanh(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return torch.as_tensor(np.tanh(x.detach().cpu().numpy()), device=x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return grad_output * (1 - y * y)

    @staticmethod
    def jvp(ctx, tangent):
        (y,) = ctx.saved_tensors
        return tangent * (1 - y * y)

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpyTanh.apply(x), in_dims[0]


through_grad = vmap(grad(NumpyTanh.apply))(x)
print("vmap(grad(NumpyTanh.apply)) at", x.tolist(), "\n", through_grad)

# %%
# Checked against the closed forms
# --------------------------------
# Every transform must agree with the derivative of tanh, ``1 − tanh²``, and the second
# derivative, ``−2 tanh (1 − tanh²)``, computed with ``torch.tanh``.
exact_first = 1 - torch.tanh(x) ** 2
exact_second = -2 * torch.tanh(x) * exact_first
_, through_jvp = jvp(NumpyTanh.apply, (x,), (torch.ones_like(x),))
_, pullback = vjp(NumpyTanh.apply, x)
(through_vjp,) = pullback(torch.ones_like(x))
for name, result in [
    ("grad", through_grad),
    ("jvp", through_jvp),
    ("vjp", through_vjp),
]:
    torch.testing.assert_close(result, exact_first, msg=name)
torch.testing.assert_close(jacrev(NumpyTanh.apply)(x), torch.diag(exact_first))
torch.testing.assert_close(jacfwd(NumpyTanh.apply)(x), torch.diag(exact_first))
torch.testing.assert_close(vmap(hessian(NumpyTanh.apply))(x), exact_second)
print(
    "grad, vmap, jvp, vjp, jacrev, jacfwd and hessian agree with 1 − tanh² and its slope"
)

# %%
# :func:`torch.autograd.gradcheck` compares the hand-written derivatives with finite
# differences, in float64, in reverse mode and (``check_forward_ad=True``) in forward mode;
# :func:`torch.autograd.gradgradcheck` checks the derivative of the backward pass.
assert torch.autograd.gradcheck(
    NumpyTanh.apply, (x.clone().requires_grad_(),), check_forward_ad=True
)
assert torch.autograd.gradgradcheck(NumpyTanh.apply, (x.clone().requires_grad_(),))
print("gradcheck (reverse and forward mode) and gradgradcheck pass")

# %%
# Breaking the rules one at a time
# --------------------------------
# Each missing piece has its own error, and each error names what is missing. A Function
# written the pre-2.0 way, with ``ctx`` as the forward's first argument, works with
# ``loss.backward()`` but not under the transforms.


def expect_error(fn, error_type, fragment):
    """fn must raise error_type with fragment in its message; print the message."""
    try:
        fn()
    except error_type as error:
        assert type(error) is error_type, f"{type(error).__name__}: {error}"
        assert fragment in str(error), f"unexpected message: {error}"
        message = f"{type(error).__name__}: " + " ".join(str(error).split())[:300]
        print(textwrap.fill(message, width=88))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


class DoubleOldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad_output):
        return 2 * grad_output


leaf = x.clone().requires_grad_()
DoubleOldStyle.apply(leaf).sum().backward()
torch.testing.assert_close(leaf.grad, torch.full_like(x, 2.0))
expect_error(lambda: vmap(DoubleOldStyle.apply)(x), RuntimeError, "setup_context")

# %%
# Without a ``vmap`` staticmethod (and without a generated rule), ``vmap`` refuses; without a
# ``jvp`` staticmethod, forward mode refuses. Reverse mode alone still works.


class TanhWithoutVmapOrJvp(torch.autograd.Function):
    forward = NumpyTanh.forward
    setup_context = NumpyTanh.setup_context
    backward = NumpyTanh.backward


torch.testing.assert_close(
    grad(lambda t: TanhWithoutVmapOrJvp.apply(t).sum())(x), exact_first
)
expect_error(
    lambda: vmap(TanhWithoutVmapOrJvp.apply)(x), RuntimeError, "generate_vmap_rule"
)
expect_error(
    lambda: jvp(TanhWithoutVmapOrJvp.apply, (x,), (torch.ones_like(x),)),
    NotImplementedError,
    "implement the jvp function",
)

# %%
# ``jacfwd`` (and ``hessian``, which is ``jacfwd`` of ``jacrev``) runs its Jacobian-vector
# products under ``vmap``, one per basis vector, so it asks for the batching rule first.
expect_error(
    lambda: jacfwd(TanhWithoutVmapOrJvp.apply)(x), RuntimeError, "generate_vmap_rule"
)

# %%
# A generated ``vmap`` rule
# -------------------------
# When the forward, the backward and the jvp are written with PyTorch operators, ``vmap`` can
# batch them itself: set ``generate_vmap_rule = True`` instead of writing a ``vmap``
# staticmethod. ``SoftClip`` is ``x / (1 + |x|)``, a smooth alternative to clipping, with its
# derivative ``1 / (1 + |x|)²`` written by hand.


class SoftClip(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x / (1 + x.abs())

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output / (1 + x.abs()) ** 2

    @staticmethod
    def jvp(ctx, tangent):
        (x,) = ctx.saved_tensors
        return tangent / (1 + x.abs()) ** 2


batch = torch.randn(4, 9, device=device, dtype=torch.float64)
soft_slope = 1 / (1 + batch.abs()) ** 2
torch.testing.assert_close(vmap(SoftClip.apply)(batch), batch / (1 + batch.abs()))
torch.testing.assert_close(vmap(vmap(grad(SoftClip.apply)))(batch), soft_slope)
torch.testing.assert_close(
    vmap(jacfwd(SoftClip.apply))(batch), torch.diag_embed(soft_slope)
)
assert torch.autograd.gradcheck(
    SoftClip.apply, (batch[0].clone().requires_grad_(),), check_forward_ad=True
)
assert torch.autograd.gradgradcheck(
    SoftClip.apply, (batch[0].clone().requires_grad_(),)
)
print("SoftClip: generated vmap rule, grad, jacfwd, gradcheck and gradgradcheck agree")

# %%
# Both Functions and their derivatives
# ------------------------------------
# The figure draws each Function with the derivative that ``vmap(grad)`` finds through it.
METHOD_COLORS = {"vmap": "#009E73"}
grid = torch.linspace(-4, 4, 200, device=device, dtype=torch.float64)
fig, axes = plt.subplots(1, 2, figsize=(8, 3), layout="constrained", sharey=True)
for ax, (name, fn) in zip(axes, [("NumpyTanh", NumpyTanh), ("SoftClip", SoftClip)]):
    ax.plot(grid.cpu(), fn.apply(grid).cpu(), color="black", label=f"{name}(x)")
    ax.plot(
        grid.cpu(),
        vmap(grad(fn.apply))(grid).cpu(),
        color=METHOD_COLORS["vmap"],
        linestyle="--",
        label="vmap(grad) through it",
    )
    ax.set_xlabel("x")
    ax.set_title(name)
    ax.legend(fontsize=8, loc="lower right")
fig.suptitle("Two custom Functions, and the derivatives that grad finds through them")
plt.show()

# %%
# What to remember
# ----------------
# * A Function for ``torch.func``: ``forward`` without ``ctx``, plus ``setup_context`` that
#   saves with ``save_for_backward`` and ``save_for_forward``.
# * ``vmap``, and ``jacfwd`` which batches with it, need a ``vmap`` staticmethod or
#   ``generate_vmap_rule = True``; forward mode (``jvp``) needs a ``jvp`` staticmethod.
# * Write ``backward`` with PyTorch operators so that it can be differentiated again.
# * Check hand-written derivatives with ``gradcheck(..., check_forward_ad=True)`` and
#   ``gradgradcheck`` in float64.
