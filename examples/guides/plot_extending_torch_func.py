"""
Extending ``torch.func``: custom autograd Functions under transforms
====================================================================

When a function cannot be written with PyTorch operators (it calls NumPy or a C library, or its
gradient needs a formula autograd would not find), a custom :class:`torch.autograd.Function`
supplies the forward and the derivatives by hand. Under the transforms it needs a forward without
``ctx`` plus a ``setup_context``; ``vmap`` and ``jacfwd`` need a ``vmap`` staticmethod or
``generate_vmap_rule = True``, forward mode a ``jvp`` staticmethod. Each is checked, and broken
once; then come batching rules by hand, saved intermediates, in-place Functions,
``once_differentiable`` and custom ops.
"""

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.autograd.function import once_differentiable
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

x = torch.linspace(-2, 2, 9, device=device, dtype=torch.float64)  # float64: gradcheck

# %%
# The recipe: a Function whose forward PyTorch cannot see into
# ------------------------------------------------------------
# ``NumpyTanh`` computes tanh in NumPy, where no transform can look. It supplies everything:
#
# * ``forward(x)`` computes the output, with no ``ctx``;
# * ``setup_context`` saves the output, which both derivatives need: ``save_for_backward`` for
#   reverse mode, ``save_for_forward`` for forward mode;
# * ``backward``, the vector-Jacobian product ``g · (1 − y²)``, in PyTorch operators: under
#   ``grad`` it gets the transforms' tensors, which NumPy cannot read, and ``hessian``
#   differentiates it again; ``jvp``, the Jacobian-vector product ``t · (1 − y²)``;
# * ``vmap`` runs a batch: tanh is element-wise, so the batch goes through the same NumPy call
#   and comes out batched along the same dimension.


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
# Every transform must agree with tanh's derivative ``1 − tanh²`` and second derivative
# ``−2 tanh (1 − tanh²)``, computed with ``torch.tanh``; ``vmap`` over dimension 1 checks that the
# rule returns the batch dimension it was given. :func:`torch.autograd.gradcheck` compares the
# derivatives with finite differences, in reverse and (``check_forward_ad=True``) forward mode;
# :func:`torch.autograd.gradgradcheck` checks the derivative of the backward pass.
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
x_leaf = (x.clone().requires_grad_(),)
assert torch.autograd.gradcheck(NumpyTanh.apply, x_leaf, check_forward_ad=True)
assert torch.autograd.gradgradcheck(NumpyTanh.apply, x_leaf)
print("grad, vmap, jvp, vjp, jacrev, jacfwd, hessian agree; gradcheck passes")

# %%
# Breaking the rules one at a time
# --------------------------------
# Each missing piece has its own error, naming what is missing. A Function in the older style,
# ``ctx`` first in ``forward`` (still documented, fine for plain autograd), works with
# ``backward()`` but not under the transforms; one that saves an intermediate from ``forward``
# converts as ``TopKSum`` does, below.


def expect_error(fn, error_type, fragment):
    try:
        fn()
    except error_type as error:
        assert type(error) is error_type and fragment in str(error), repr(error)
        message = f"{type(error).__name__}: " + " ".join(str(error).split())[:300]
        return print(textwrap.fill(message, width=88))
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


class DoubleOldStyle(torch.autograd.Function):
    forward = staticmethod(lambda ctx, x: 2 * x)  # ctx first: the older style
    backward = staticmethod(lambda ctx, grad_output: 2 * grad_output)


leaf = x.clone().requires_grad_()
DoubleOldStyle.apply(leaf).sum().backward()
torch.testing.assert_close(leaf.grad, torch.full_like(x, 2.0))
expect_error(lambda: vmap(DoubleOldStyle.apply)(x), RuntimeError, "setup_context")

# %%
# Without a ``vmap`` staticmethod (or a generated rule) ``vmap`` refuses, and so does ``jacfwd``
# (so ``hessian`` too), which runs its Jacobian-vector products under ``vmap``; without a
# ``jvp`` staticmethod forward mode refuses. Reverse mode alone works. A ``backward`` that reads
# its tensors with NumPy suits plain autograd, not ``grad``: its tensors have no storage.


class TanhWithoutVmapOrJvp(torch.autograd.Function):
    forward = NumpyTanh.forward
    setup_context = NumpyTanh.setup_context
    backward = NumpyTanh.backward


class TanhNumpyBackward(NumpyTanh):  # the same slope, 1 − y², computed in NumPy
    @staticmethod
    def backward(ctx, grad_output):
        y = ctx.saved_tensors[0].detach().cpu().numpy()
        return grad_output * torch.as_tensor(1 - y * y, device=grad_output.device)


bare = TanhWithoutVmapOrJvp.apply
torch.testing.assert_close(grad(lambda t: bare(t).sum())(x), exact_first)
expect_error(lambda: vmap(bare)(x), RuntimeError, "generate_vmap_rule")
expect_error(lambda: jvp(bare, (x,), (x,)), NotImplementedError, "implement the jvp")
expect_error(lambda: jacfwd(bare)(x), RuntimeError, "generate_vmap_rule")
assert torch.autograd.gradcheck(TanhNumpyBackward.apply, x_leaf)  # plain autograd: fine
numpy_grad = grad(lambda t: TanhNumpyBackward.apply(t).sum())
expect_error(lambda: numpy_grad(x), RuntimeError, "doesn't have storage")

# %%
# A generated ``vmap`` rule
# -------------------------
# With forward, backward and jvp in PyTorch operators, ``vmap`` can batch them itself:
# ``generate_vmap_rule = True`` replaces the ``vmap`` staticmethod. ``SoftClip`` is
# ``x / (1 + |x|)``, a smooth clip, with its derivative ``1 / (1 + |x|)²`` written by hand.


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
# ``NumpyMatVec`` computes ``A v`` in NumPy. Its ``vmap`` staticmethod receives ``info`` and
# ``in_dims``, one entry per input: the dimension ``vmap`` maps over, or ``None``. The rule moves
# each mapped dimension to the front, expands an unmapped input to ``info.batch_size`` (a view),
# runs the Function once on the batch and returns the output's batch dimension. The expansion
# matters in nested ``vmap``: an input the outer level does not map holds the inner batch first,
# which ``np.matmul`` would pair with the outer batch. ``backward`` and ``jvp`` see the batch:
# ``...``.


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
        A, v = (  # each input with its batch dimension first
            t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)
            for t, dim in zip((A, v), in_dims)
        )
        return NumpyMatVec.apply(A, v), 0  # the output, and its batch dimension


# The reference for every batching is a loop of ``A @ v``: batch dimensions elsewhere, an
# unmapped input, both nested. For ``u · (A v)`` the gradient is ``u vᵀ`` for ``A`` and ``Aᵀ u``
# for ``v``; the Jacobian in ``v`` is ``A``. ``grad`` and ``jvp`` of a ``vmap`` run on the batch.
matrices = torch.randn(4, 3, 5, device=device, dtype=torch.float64)
vectors = torch.randn(4, 5, device=device, dtype=torch.float64)
weights = torch.randn(3, device=device, dtype=torch.float64)
matvec, A0, v0 = NumpyMatVec.apply, matrices[0], vectors[0]
loop = torch.stack([A @ v for A, v in zip(matrices, vectors)])
torch.testing.assert_close(vmap(matvec)(matrices, vectors), loop)
moved = vmap(matvec, in_dims=(2, 1))(matrices.permute(1, 2, 0), vectors.T)
torch.testing.assert_close(moved, loop)
all_pairs = vmap(vmap(matvec, in_dims=(None, 0)), in_dims=(0, None))(matrices, vectors)
pairs_loop = torch.stack([torch.stack([A @ v for v in vectors]) for A in matrices])
torch.testing.assert_close(all_pairs, pairs_loop)  # needs the expand

weighted = grad(lambda A, v: weights @ matvec(A, v), argnums=(0, 1))
grad_A, grad_v = vmap(weighted)(matrices, vectors)
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
# An intermediate to save, and an argument that is not a tensor
# -------------------------------------------------------------
# With no ``ctx`` in ``forward``, a tensor made there for ``backward`` leaves as an extra output,
# which ``setup_context`` marks with ``ctx.mark_non_differentiable`` and saves. ``TopKSum`` adds
# the ``k`` largest entries of each row (``k`` a Python int); its intermediate is their mask. For
# ``k``, ``in_dims`` holds ``None``, ``jvp`` receives ``None``, ``backward`` returns ``None``. The
# ``vmap`` rule returns one batch dimension per output; ``vmap``'s ``out_dims`` places each output.


class TopKSum(torch.autograd.Function):
    @staticmethod
    def forward(x, k):
        kth_largest = np.sort(x.detach().cpu().numpy(), axis=-1)[..., -k, None]
        chosen = (x >= torch.as_tensor(kth_largest, device=x.device)).to(x.dtype)
        return (x * chosen).sum(-1), chosen  # the sum, and the intermediate

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])
        ctx.save_for_forward(output[1])

    @staticmethod
    def backward(ctx, grad_total, grad_chosen):  # grad_chosen: zeros, unused
        (chosen,) = ctx.saved_tensors
        return grad_total[..., None] * chosen, None  # None: no gradient for k

    @staticmethod
    def jvp(ctx, tangent_x, tangent_k):  # tangent_k: None
        (chosen,) = ctx.saved_tensors
        return (tangent_x * chosen).sum(-1), None

    @staticmethod
    def vmap(info, in_dims, x, k):  # in_dims: (the dimension of x, None)
        outputs = TopKSum.apply(x.movedim(in_dims[0], 0), k)
        return outputs, (0, 0)  # one batch dimension per output


# The references: a loop of ``sort`` per row, and the mask built with ``torch.topk``, which is
# the gradient of the sum and contracts the tangent in ``jvp``.
scores = torch.randn(4, 7, device=device, dtype=torch.float64)
top3 = lambda s: TopKSum.apply(s, 3)[0]  # noqa: E731
mask = torch.zeros_like(scores).scatter(-1, scores.topk(3).indices, 1.0)
sums, masks = vmap(TopKSum.apply, in_dims=(1, None), out_dims=(0, 1))(scores.T, 3)
by_sorting = torch.stack([s.sort().values[-3:].sum() for s in scores])
torch.testing.assert_close(sums, by_sorting)
torch.testing.assert_close(masks, mask.T)
torch.testing.assert_close(vmap(grad(top3))(scores), mask)
_, pushed = jvp(vmap(top3), (scores,), (batch[:, :7],))
torch.testing.assert_close(pushed, (batch[:, :7] * mask).sum(-1))
score_leaf = scores[0].clone().requires_grad_()
chosen = TopKSum.apply(score_leaf, 3)[1]
assert not chosen.requires_grad  # marked, so not differentiable
assert torch.autograd.gradcheck(top3, (score_leaf,), check_forward_ad=True)
print("TopKSum: vmap, grad, jvp and gradcheck agree; the mask is not differentiable")

# %%
# Two features that need care
# ---------------------------
# An in-place Function marks its input with ``ctx.mark_dirty``. It runs under ``grad``, but a
# generated ``vmap`` rule refuses it, with a message that misleads: the input *is* returned. Fix:
# rewrite it out of place, or write its ``vmap`` staticmethod by hand, which composes with ``grad``.


class DoubleInPlace(torch.autograd.Function):
    generate_vmap_rule = True
    forward = staticmethod(lambda x: x.mul_(2))
    setup_context = staticmethod(lambda ctx, inputs, output: ctx.mark_dirty(inputs[0]))
    backward = staticmethod(lambda ctx, grad_output: 2 * grad_output)


class DoubleInPlaceByHand(DoubleInPlace):  # the whole batch doubled in place
    generate_vmap_rule = False
    vmap = staticmethod(lambda info, dims, x: (DoubleInPlaceByHand.apply(x), dims[0]))


in_place = grad(lambda t: DoubleInPlace.apply(t.clone()).sum())(x)  # t itself: a leaf
torch.testing.assert_close(in_place, torch.full_like(x, 2.0))
expect_error(lambda: vmap(DoubleInPlace.apply)(batch.clone()), RuntimeError, "as dirty")
doubled = batch.clone()
torch.testing.assert_close(vmap(DoubleInPlaceByHand.apply)(doubled), 2 * batch)
torch.testing.assert_close(doubled, 2 * batch)  # written in place
by_hand = vmap(grad(lambda t: DoubleInPlaceByHand.apply(t.clone()).sum()))(batch)
torch.testing.assert_close(by_hand, torch.full_like(batch, 2.0))

# %%
# A ``backward`` under ``once_differentiable`` runs in ``no_grad``: nested ``grad`` takes its
# result as a constant and silently drops every term through it (here all: 0; plain autograd may
# raise, or not). ``hessian`` stays right: ``no_grad`` does not stop forward mode.


class TanhOnce(NumpyTanh):  # its vmap rule runs NumpyTanh, below the grad levels
    backward = staticmethod(once_differentiable(NumpyTanh.backward))


second = vmap(grad(grad(TanhOnce.apply)))(x)
torch.testing.assert_close(vmap(grad(TanhOnce.apply))(x), exact_first)
torch.testing.assert_close(vmap(hessian(TanhOnce.apply))(x), exact_second)
print(f"once_differentiable, grad(grad): largest |second derivative| {second.abs().max():.2f}"
      f", where −2 tanh (1 − tanh²) reaches {exact_second.abs().max():.2f}")  # fmt: skip
assert (second == 0).all() and exact_second.abs().max() > 0.5
leaf = x.clone().requires_grad_()
(slope,) = torch.autograd.grad(TanhOnce.apply(leaf).sum(), leaf, create_graph=True)
again = lambda: torch.autograd.grad(slope.sum(), leaf)  # noqa: E731
expect_error(again, RuntimeError, "element 0 of tensors does not require grad")

# %%
# ``autograd.Function`` or ``torch.library.custom_op``?
# -----------------------------------------------------
# ``torch.library.custom_op`` wraps the same NumPy code as an operator that ``torch.compile``
# keeps whole, as one node (``register_fake`` gives it the output's shape), with
# ``register_autograd`` and ``register_vmap``. In this release ``vmap``, the compiled graph and
# plain autograd work, but ``grad`` refuses the op with the old-style Function's error (reported
# for ``grad`` and ``jacrev``: pytorch#168393, pytorch#179652), and ``jvp`` and ``jacfwd`` return
# a zero tangent, silently. So: an ``autograd.Function`` for ``torch.func``'s derivatives; a
# custom op for ``torch.compile``, ``vmap`` and ``backward()``. Compiled, ``grad`` of a Function
# differentiates its forward and ignores ``backward``, silently (pytorch#193279; ``jvp``:
# pytorch#192985): through ``NumpyTanh``'s detached forward, zeros. Keep that out of the compile.
graph_ops = []  # what dynamo captured, recorded by the backend below, which runs it as is


def record(gm, example_inputs):
    graph_ops.extend(n.target for n in gm.graph.nodes if n.op.startswith("call_"))
    return gm.forward


@torch.library.custom_op("extending::numpy_tanh", mutates_args=())
def tanh_op(x: torch.Tensor) -> torch.Tensor:
    return NumpyTanh.forward(x)


tanh_op.register_fake(torch.empty_like)
tanh_op.register_autograd(NumpyTanh.backward, setup_context=NumpyTanh.setup_context)
tanh_op.register_vmap(lambda info, in_dims, x: (tanh_op(x), in_dims[0]))
torch.testing.assert_close(vmap(tanh_op, in_dims=1)(batch), torch.tanh(batch).T)
assert torch.autograd.gradcheck(tanh_op, x_leaf)  # plain autograd
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
compiled_grad = grad(lambda t: NumpyTanh.apply(t).sum())
compiled_grad = torch.compile(compiled_grad, backend=record, fullgraph=True)
assert not compiled_grad(x).any() and exact_first.min() > 0  # eager grad: exact_first

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
# * ``forward`` without ``ctx``; ``setup_context`` saves with ``save_for_backward`` and
#   ``save_for_forward``, and intermediates come out as outputs marked non-differentiable.
# * ``vmap`` and ``jacfwd`` need a ``vmap`` staticmethod or ``generate_vmap_rule = True``; a
#   rule by hand brings each input's batch dimension first (``in_dims`` is ``None`` for
#   non-tensors). Forward mode needs a ``jvp`` staticmethod.
# * Write ``backward`` in PyTorch operators: NumPy cannot read the transforms' tensors, and
#   ``once_differentiable`` makes nested ``grad`` wrong. Compiled ``grad`` ignores ``backward``.
# * Check with ``gradcheck(..., check_forward_ad=True)`` and ``gradgradcheck`` in float64.
# * ``torch.library.custom_op`` suits ``torch.compile``, ``vmap`` and ``backward()``; in this
#   release ``grad`` refuses it and ``jvp`` through it returns zeros, silently.
