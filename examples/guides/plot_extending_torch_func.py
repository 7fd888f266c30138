"""
Extending ``torch.func``: custom autograd Functions under transforms
====================================================================

When a function cannot be written with PyTorch operators (it calls NumPy or a C library, or
its gradient needs a formula autograd would not find), a custom
:class:`torch.autograd.Function` supplies the forward and the derivatives by hand. To work
under ``grad``, ``vmap``, ``jvp``, ``jacrev``, ``jacfwd`` and ``hessian``, it must follow three
rules: a forward without ``ctx`` plus a ``setup_context``; a ``vmap`` staticmethod or
``generate_vmap_rule = True``; a ``jvp`` staticmethod for forward mode. This page writes three
such Functions, checks their derivatives against closed forms and ``gradcheck``, shows the
error for each broken rule, writes a batching rule for two inputs, fixes an in-place Function
and ``once_differentiable``, and compares ``torch.library.custom_op``.
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
# derivative, ``−2 tanh (1 − tanh²)``, computed with ``torch.tanh``. ``vmap`` over dimension 1
# checks that the rule returns the batch dimension it was given.
exact_first = 1 - torch.tanh(x) ** 2
exact_second = -2 * torch.tanh(x) * exact_first
_, through_jvp = jvp(NumpyTanh.apply, (x,), (torch.ones_like(x),))
(through_vjp,) = vjp(NumpyTanh.apply, x)[1](torch.ones_like(x))
for result in (through_grad, through_jvp, through_vjp):
    torch.testing.assert_close(result, exact_first)
torch.testing.assert_close(jacrev(NumpyTanh.apply)(x), torch.diag(exact_first))
torch.testing.assert_close(jacfwd(NumpyTanh.apply)(x), torch.diag(exact_first))
torch.testing.assert_close(vmap(hessian(NumpyTanh.apply))(x), exact_second)
tile = x.reshape(3, 3)
torch.testing.assert_close(vmap(NumpyTanh.apply, in_dims=1)(tile), torch.tanh(tile).T)
print("grad, vmap, jvp, vjp, jacrev, jacfwd and hessian agree with the closed forms")

# %%
# :func:`torch.autograd.gradcheck` compares the hand-written derivatives with finite
# differences, in float64, in reverse mode and (``check_forward_ad=True``) in forward mode;
# :func:`torch.autograd.gradgradcheck` checks the derivative of the backward pass.
x_leaf = (x.clone().requires_grad_(),)
assert torch.autograd.gradcheck(NumpyTanh.apply, x_leaf, check_forward_ad=True)
assert torch.autograd.gradgradcheck(NumpyTanh.apply, x_leaf)
print("gradcheck (reverse and forward mode) and gradgradcheck pass")

# %%
# Breaking the rules one at a time
# --------------------------------
# Each missing piece has its own error, and each error names what is missing. A Function in
# the older style, with ``ctx`` as the forward's first argument (still documented, and fine
# for plain autograd), works with ``loss.backward()`` but not under the transforms.


def expect_error(fn, error_type, fragment):
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
# Without a ``vmap`` staticmethod (or a generated rule), ``vmap`` refuses, and so does
# ``jacfwd`` (and ``hessian``, ``jacfwd`` of ``jacrev``), which runs its Jacobian-vector
# products under ``vmap``; without a ``jvp`` staticmethod, forward mode refuses. Reverse mode
# alone still works.


class TanhWithoutVmapOrJvp(torch.autograd.Function):
    forward = NumpyTanh.forward
    setup_context = NumpyTanh.setup_context
    backward = NumpyTanh.backward


bare = TanhWithoutVmapOrJvp.apply
torch.testing.assert_close(grad(lambda t: bare(t).sum())(x), exact_first)
expect_error(lambda: vmap(bare)(x), RuntimeError, "generate_vmap_rule")
expect_error(lambda: jvp(bare, (x,), (x,)), NotImplementedError, "implement the jvp")
expect_error(lambda: jacfwd(bare)(x), RuntimeError, "generate_vmap_rule")

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
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

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
torch.testing.assert_close(vmap(jacfwd(SoftClip.apply))(batch), soft_slope.diag_embed())
soft_leaf = (batch[0].clone().requires_grad_(),)
assert torch.autograd.gradcheck(SoftClip.apply, soft_leaf, check_forward_ad=True)
assert torch.autograd.gradgradcheck(SoftClip.apply, soft_leaf)
print("SoftClip: generated vmap rule, grad, jacfwd, gradcheck and gradgradcheck agree")

# %%
# A batching rule by hand, for a Function of two inputs
# -----------------------------------------------------
# ``NumpyMatVec`` computes the matrix-vector product ``A v`` in NumPy. Its ``vmap``
# staticmethod receives ``info`` and ``in_dims``, one entry per input: the dimension that
# ``vmap`` maps over, or ``None`` for an input it does not map over. The rule moves each
# mapped dimension to the front, expands an unmapped input to ``info.batch_size`` copies, runs
# the Function once on the whole batch, and returns the output with its batch dimension
# (``out_dims``: a tuple with one entry per output, for a Function that returns several).
# ``np.matmul`` broadcasts over leading dimensions, so one plain matrix needs no copies; but
# under nested ``vmap`` an input that the outer level does not map holds the inner batch as a
# leading dimension, which ``np.matmul`` would pair element by element with the outer batch.
# Inside the rule the Function sees the batch, so its ``backward`` and ``jvp`` are written
# with ``...`` to accept leading batch dimensions.


class NumpyMatVec(torch.autograd.Function):
    @staticmethod
    def forward(A, v):
        A_np, v_np = A.detach().cpu().numpy(), v.detach().cpu().numpy()
        product = np.matmul(A_np, v_np[..., None])[..., 0]
        return torch.as_tensor(product, device=v.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        A, v = ctx.saved_tensors
        grad_A = grad_output[..., :, None] * v[..., None, :]  # an outer product
        return grad_A, (grad_output[..., None, :] @ A)[..., 0, :]

    @staticmethod
    def jvp(ctx, tangent_A, tangent_v):
        A, v = ctx.saved_tensors
        return (tangent_A @ v[..., None] + A @ tangent_v[..., None])[..., 0]

    @staticmethod
    def vmap(info, in_dims, A, v):
        def batch_first(t, dim):
            if dim is None:
                return t.expand(info.batch_size, *t.shape)
            return t.movedim(dim, 0)

        A_dim, v_dim = in_dims
        product = NumpyMatVec.apply(batch_first(A, A_dim), batch_first(v, v_dim))
        return product, 0  # the output, and its batch dimension


# %%
# The reference for every batching is a Python loop of ``A @ v``: batch dimensions in other
# places, an unmapped input, and both nested. The derivatives have closed forms: for
# ``u · (A v)``, the gradient is ``u vᵀ`` for ``A`` and ``Aᵀ u`` for ``v``; the Jacobian with
# respect to ``v`` is ``A``. ``grad`` and ``jvp`` of a ``vmap`` run ``backward`` and ``jvp`` on
# the whole batch.
matrices = torch.randn(4, 3, 5, device=device, dtype=torch.float64)
vectors = torch.randn(4, 5, device=device, dtype=torch.float64)
weights = torch.randn(3, device=device, dtype=torch.float64)
matvec, A0, v0 = NumpyMatVec.apply, matrices[0], vectors[0]
loop = torch.stack([A @ v for A, v in zip(matrices, vectors)])
torch.testing.assert_close(vmap(matvec)(matrices, vectors), loop)
moved = vmap(matvec, in_dims=(2, 1))(matrices.permute(1, 2, 0), vectors.T)
torch.testing.assert_close(moved, loop)
one_matrix = vmap(matvec, in_dims=(None, 0))(A0, vectors)
torch.testing.assert_close(one_matrix, torch.stack([A0 @ v for v in vectors]))
one_vector = vmap(matvec, in_dims=(0, None))(matrices, v0)
torch.testing.assert_close(one_vector, torch.stack([A @ v0 for A in matrices]))
all_pairs = vmap(vmap(matvec, in_dims=(None, 0)), in_dims=(0, None))(matrices, vectors)
pairs_loop = torch.stack([torch.stack([A @ v for v in vectors]) for A in matrices])
torch.testing.assert_close(all_pairs, pairs_loop)  # needs the expand

grad_A, grad_v = vmap(grad(lambda A, v: weights @ matvec(A, v), argnums=(0, 1)))(
    matrices, vectors
)
torch.testing.assert_close(grad_A, weights[None, :, None] * vectors[:, None, :])
torch.testing.assert_close(grad_v, matrices.transpose(1, 2) @ weights)
summed = grad(lambda A: vmap(matvec, in_dims=(None, 0))(A, vectors).sum())(A0)
torch.testing.assert_close(summed, torch.ones(3, 1, device=device) * vectors.sum(0))
A_dot, v_dot = torch.randn_like(matrices), torch.randn_like(vectors)
_, pushed = jvp(vmap(matvec), (matrices, vectors), (A_dot, v_dot))
expected = (A_dot @ vectors[..., None] + matrices @ v_dot[..., None])[..., 0]
torch.testing.assert_close(pushed, expected)
for jacobian in (jacrev, jacfwd):
    torch.testing.assert_close(jacobian(matvec, argnums=1)(A0, v0), A0)
inputs = (A0.clone().requires_grad_(), v0.clone().requires_grad_())
assert torch.autograd.gradcheck(matvec, inputs, check_forward_ad=True)
assert torch.autograd.gradgradcheck(matvec, inputs)
print("NumpyMatVec: each vmap, grad, jvp, jacrev, jacfwd and gradcheck agree")

# %%
# Two features that need care
# ---------------------------
# An in-place Function marks its input with ``ctx.mark_dirty``. It runs under ``grad``, but a
# generated ``vmap`` rule refuses it, with a message that misleads: the input *is* returned.
# Two fixes: rewrite it out of place, or write its ``vmap`` staticmethod by hand, which here
# doubles the whole batch in place and composes with ``grad``.


class DoubleInPlace(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.mul_(2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, grad_output):
        return 2 * grad_output


class DoubleInPlaceByHand(DoubleInPlace):
    generate_vmap_rule = False

    @staticmethod
    def vmap(info, in_dims, x):
        return DoubleInPlaceByHand.apply(x), in_dims[0]


torch.testing.assert_close(
    grad(lambda t: DoubleInPlace.apply(t.clone()).sum())(x), torch.full_like(x, 2.0)
)
expect_error(lambda: vmap(DoubleInPlace.apply)(batch.clone()), RuntimeError, "as dirty")
doubled = batch.clone()
torch.testing.assert_close(vmap(DoubleInPlaceByHand.apply)(doubled), 2 * batch)
torch.testing.assert_close(doubled, 2 * batch)  # written in place
by_hand = vmap(grad(lambda t: DoubleInPlaceByHand.apply(t.clone()).sum()))(batch)
torch.testing.assert_close(by_hand, torch.full_like(batch, 2.0))

# %%
# A ``backward`` decorated with ``once_differentiable`` runs under ``no_grad``, so what it
# returns carries no graph. Nested ``grad`` then returns a second derivative of 0, silently;
# plain autograd raises, but with a message that does not name the decorator. For ``x³`` the
# second derivative is ``6x``: without the decorator, ``backward`` is differentiated again.


class Cube(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad_output


class CubeOnce(Cube):
    backward = staticmethod(torch.autograd.function.once_differentiable(Cube.backward))


first = vmap(grad(CubeOnce.apply))(x)
second = vmap(grad(grad(CubeOnce.apply)))(x)
torch.testing.assert_close(first, 3 * x**2)
print(f"once_differentiable under grad(grad): largest |second derivative| "
      f"{second.abs().max():.1f}, where 6x reaches {(6 * x).abs().max():.1f}")  # fmt: skip
assert (second == 0).all() and (6 * x).abs().max() > 1
torch.testing.assert_close(vmap(grad(grad(Cube.apply)))(x), 6 * x)
leaf = x.clone().requires_grad_()
(slope,) = torch.autograd.grad(CubeOnce.apply(leaf).sum(), leaf, create_graph=True)
expect_error(
    lambda: torch.autograd.grad(slope.sum(), leaf),
    RuntimeError,
    "element 0 of tensors does not require grad",
)

# %%
# ``autograd.Function`` or ``torch.library.custom_op``?
# -----------------------------------------------------
# ``torch.library.custom_op`` wraps the same NumPy code as an operator that
# ``torch.compile`` keeps whole, as one node (``register_fake`` gives it the output's shape),
# with ``register_autograd`` and ``register_vmap``. In this release ``vmap``, the compiled graph
# and plain autograd work, but ``grad`` refuses the op with the old-style Function's error
# (reported for ``grad`` and ``jacrev``: pytorch#168393, pytorch#179652), and ``jvp`` and
# ``jacfwd`` return a zero tangent, silently. So: an ``autograd.Function`` for ``torch.func``'s
# derivatives; a custom op for ``torch.compile``, ``vmap`` and ``backward()``.


@torch.library.custom_op("extending::numpy_tanh", mutates_args=())
def tanh_op(x: torch.Tensor) -> torch.Tensor:
    return NumpyTanh.forward(x)


tanh_op.register_fake(torch.empty_like)
tanh_op.register_autograd(NumpyTanh.backward, setup_context=NumpyTanh.setup_context)
tanh_op.register_vmap(lambda info, in_dims, x: (tanh_op(x), in_dims[0]))
torch.testing.assert_close(vmap(tanh_op, in_dims=1)(batch), torch.tanh(batch).T)
assert torch.autograd.gradcheck(tanh_op, x_leaf)  # plain autograd
graph_ops = []  # a backend that records what dynamo captured, then runs it as it is


def record(gm, example_inputs):
    graph_ops.extend(n.target for n in gm.graph.nodes if n.op.startswith("call_"))
    return gm.forward


compiled = torch.compile(lambda t: tanh_op(t).sin(), backend=record, fullgraph=True)
torch.testing.assert_close(compiled(x), torch.tanh(x).sin())
print("torch.compile, one graph; its calls:", [str(op) for op in graph_ops])
assert graph_ops == [torch.ops.extending.numpy_tanh.default, "sin"], graph_ops
expect_error(lambda: grad(lambda t: tanh_op(t).sum())(x), RuntimeError, "setup_context")
tangent = jvp(tanh_op, (x,), (torch.ones_like(x),))[1]
forward_jacobian = jacfwd(tanh_op)(x)
largest = max(tangent.abs().max(), forward_jacobian.abs().max())
print(f"jvp and jacfwd through the custom op: largest |entry| {largest:.1f}, "
      f"where 1 − tanh² reaches {exact_first.max():.1f}")  # fmt: skip
assert not tangent.any() and not forward_jacobian.any() and exact_first.max() > 0.5

# %%
# The two element-wise Functions and their derivatives
# ----------------------------------------------------
# The figure draws each Function with the derivative that ``vmap(grad)`` finds through it.
METHOD_COLORS = {"vmap": "#009E73"}
grid = torch.linspace(-4, 4, 200, device=device, dtype=torch.float64)
fig, axes = plt.subplots(1, 2, figsize=(8, 3), layout="constrained", sharey=True)
for ax, (name, fn) in zip(axes, [("NumpyTanh", NumpyTanh), ("SoftClip", SoftClip)]):
    slope = vmap(grad(fn.apply))(grid).cpu()
    ax.plot(grid.cpu(), fn.apply(grid).cpu(), color="black", label=f"{name}(x)")
    ax.plot(grid.cpu(), slope, "--", color=METHOD_COLORS["vmap"], label="vmap(grad)")
    ax.set(xlabel="x", title=name)
    ax.legend(fontsize=8, loc="lower right")
fig.suptitle("Two custom Functions, and the derivatives that grad finds through them")
plt.show()

# %%
# What to remember
# ----------------
# * A Function for ``torch.func``: ``forward`` without ``ctx``, plus ``setup_context`` that
#   saves with ``save_for_backward`` and ``save_for_forward``.
# * ``vmap``, and ``jacfwd`` which batches with it, need a ``vmap`` staticmethod or
#   ``generate_vmap_rule = True``; a hand-written rule moves or expands each input to a
#   leading batch dimension. Forward mode (``jvp``) needs a ``jvp`` staticmethod.
# * Write ``backward`` with PyTorch operators, without ``once_differentiable``, so that it can
#   be differentiated again: nested ``grad`` otherwise returns a zero second derivative.
# * Check hand-written derivatives with ``gradcheck(..., check_forward_ad=True)`` and
#   ``gradgradcheck`` in float64.
# * ``torch.library.custom_op`` suits ``torch.compile``, ``vmap`` and ``backward()``; in this
#   release ``grad`` refuses it and ``jvp`` through it returns zeros, silently.
