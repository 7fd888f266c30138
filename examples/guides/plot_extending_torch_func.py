"""
Extending ``torch.func``: custom autograd Functions under transforms
====================================================================

When a function cannot be written with PyTorch operators (it calls NumPy or a C library, or its
gradient needs a formula autograd would not find), a custom :class:`torch.autograd.Function`
supplies the forward and the derivatives by hand. The transforms ask for a few more pieces, each
checked here and broken once; then come NumPy in ``backward``, batching rules by hand, saved
intermediates, in-place Functions, ``once_differentiable``, custom ops and ``torch.compile``.
"""

from textwrap import fill

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
# * ``backward``, the vector-Jacobian product ``g · (1 − y²)``, in PyTorch operators or other
#   Functions: under ``grad`` it gets the transforms' tensors, which NumPy cannot read, and
#   ``hessian`` differentiates it again; ``jvp``, the Jacobian-vector product ``t · (1 − y²)``;
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
# Every transform must agree, to float64 rounding, with tanh's derivative ``1 − tanh²`` and second
# derivative ``−2 tanh (1 − tanh²)`` from ``torch.tanh`` (``check``; the page ends printing the
# largest error); ``vmap`` over dimension 1 checks that the rule returns the batch dimension it was
# given. :func:`torch.autograd.gradcheck` compares the derivatives with finite differences, in
# reverse and (``check_forward_ad=True``) forward mode; ``gradgradcheck``, those of ``backward``.
errors = []


def check(actual, expected, bound=1e-14):
    torch.testing.assert_close(actual, expected, rtol=0, atol=bound)
    errors.append((actual - expected).abs().max().item())


exact_first = 1 - torch.tanh(x) ** 2
exact_second = -2 * torch.tanh(x) * exact_first
check(through_grad, exact_first)
check(jvp(NumpyTanh.apply, (x,), (torch.ones_like(x),))[1], exact_first)
check(vjp(NumpyTanh.apply, x)[1](torch.ones_like(x))[0], exact_first)
check(jacrev(NumpyTanh.apply)(x), torch.diag(exact_first))
check(jacfwd(NumpyTanh.apply)(x), torch.diag(exact_first))
check(vmap(hessian(NumpyTanh.apply))(x), exact_second)
check(vmap(NumpyTanh.apply, in_dims=1)(x.view(3, 3)), torch.tanh(x.view(3, 3)).T)
x_leaf = (x.clone().requires_grad_(),)
assert torch.autograd.gradcheck(NumpyTanh.apply, x_leaf, check_forward_ad=True)
assert torch.autograd.gradgradcheck(NumpyTanh.apply, x_leaf)
print("grad, vmap, jvp, vjp, jacrev, jacfwd, hessian agree; gradcheck passes")

# %%
# Breaking the rules one at a time
# --------------------------------
# Each missing piece has its own error, naming it. A Function in the older style, ``ctx`` first in
# ``forward`` (still documented), works in plain autograd but not under the transforms; one that
# saves an intermediate from ``forward`` converts as ``TopKSum`` does, below. Without a ``vmap``
# staticmethod (or a generated rule) ``vmap`` refuses, and so does ``jacfwd`` (so ``hessian`` too),
# which runs its Jacobian-vector products under ``vmap``; without a ``jvp`` staticmethod forward
# mode refuses. Reverse mode alone works.


def expect_error(fn, error_type, fragment):
    try:
        fn()
    except error_type as error:
        assert type(error) is error_type and fragment in str(error), repr(error)
        return print(fill(f"{error_type.__name__}: {str(error).splitlines()[0]}", 88))
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


class DoubleOldStyle(torch.autograd.Function):
    forward = staticmethod(lambda ctx, x: 2 * x)  # ctx first: the older style
    backward = staticmethod(lambda ctx, grad_output: 2 * grad_output)


class TanhWithoutVmapOrJvp(torch.autograd.Function):
    forward = NumpyTanh.forward
    setup_context = NumpyTanh.setup_context
    backward = NumpyTanh.backward


(old_style_grad,) = torch.autograd.grad(DoubleOldStyle.apply(*x_leaf).sum(), x_leaf)
check(old_style_grad, torch.full_like(x, 2.0))
expect_error(lambda: vmap(DoubleOldStyle.apply)(x), RuntimeError, "setup_context")
bare = TanhWithoutVmapOrJvp.apply
check(grad(lambda t: bare(t).sum())(x), exact_first)
expect_error(lambda: vmap(bare)(x), RuntimeError, "generate_vmap_rule")
expect_error(lambda: jvp(bare, (x,), (x,)), NotImplementedError, "implement the jvp")
expect_error(lambda: jacfwd(bare)(x), RuntimeError, "generate_vmap_rule")

# %%
# A ``backward`` that reads its tensors with NumPy suits plain autograd, not ``grad``: there they
# have no storage. To keep NumPy, call it through another Function with its own derivatives, whose
# ``apply`` hands ``forward`` plain tensors: here ``NumpySlope``, ``1 − y²`` in NumPy.


class NumpySlope(torch.autograd.Function):  # 1 − y² in NumPy; its derivative: −2y
    @staticmethod
    def forward(y):
        return torch.as_tensor(1 - y.detach().cpu().numpy() ** 2, device=y.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    backward = staticmethod(lambda ctx, g: -2 * ctx.saved_tensors[0] * g)
    jvp = backward  # element-wise: the same product
    vmap = staticmethod(lambda info, in_dims, y: (NumpySlope.apply(y), in_dims[0]))


class TanhNumpyBackward(NumpyTanh):  # NumpySlope's NumPy code, called directly
    backward = staticmethod(lambda ctx, g: g * NumpySlope.forward(ctx.saved_tensors[0]))


class TanhViaSlope(NumpyTanh):  # the same code, through NumpySlope.apply
    backward = staticmethod(lambda ctx, g: g * NumpySlope.apply(ctx.saved_tensors[0]))


assert torch.autograd.gradcheck(TanhNumpyBackward.apply, x_leaf)  # plain autograd: fine
expect_error(lambda: grad(TanhNumpyBackward.apply)(x[0]), RuntimeError, "have storage")
check(grad(lambda t: TanhViaSlope.apply(t).sum())(x), exact_first)
check(vmap(grad(TanhViaSlope.apply))(x), exact_first)
check(vmap(grad(grad(TanhViaSlope.apply)))(x), exact_second)  # NumpySlope's backward
check(vmap(hessian(TanhViaSlope.apply))(x), exact_second)  # its jvp
check(vmap(NumpySlope.apply, in_dims=1)(x.view(3, 3)), (1 - x.view(3, 3) ** 2).T)

# %%
# A generated ``vmap`` rule
# -------------------------
# With forward, backward and jvp in PyTorch operators, ``vmap`` can batch them itself:
# ``generate_vmap_rule = True`` replaces the ``vmap`` staticmethod. ``SoftClip`` is
# ``x / (1 + |x|)``, a smooth clip, with its derivative ``1 / (1 + |x|)²`` written by hand.


class SoftClip(torch.autograd.Function):
    generate_vmap_rule = True
    forward = staticmethod(lambda x: x / (1 + x.abs()))
    setup_context = NumpySlope.setup_context  # saves x, for both modes
    backward = staticmethod(lambda ctx, g: g / (1 + ctx.saved_tensors[0].abs()) ** 2)
    jvp = backward  # element-wise, as in NumpySlope


batch = torch.randn(4, 9, device=device, dtype=torch.float64)
soft_slope = 1 / (1 + batch.abs()) ** 2
check(vmap(SoftClip.apply)(batch), batch / (1 + batch.abs()))
check(vmap(vmap(grad(SoftClip.apply)))(batch), soft_slope)
check(vmap(jacfwd(SoftClip.apply))(batch), soft_slope.diag_embed())
soft_leaf = (batch[0].clone().requires_grad_(),)
assert torch.autograd.gradcheck(SoftClip.apply, soft_leaf, check_forward_ad=True)
assert torch.autograd.gradgradcheck(SoftClip.apply, soft_leaf)

# %%
# A batching rule by hand, for a Function of two inputs
# -----------------------------------------------------
# ``NumpyMatVec`` computes ``A v`` in NumPy. Its ``vmap`` staticmethod receives ``info`` and
# ``in_dims``, one entry per input: the dimension ``vmap`` maps over, or ``None``. The rule moves
# each mapped dimension to the front, expands an unmapped input to ``info.batch_size`` (a view),
# runs the Function once on the batch and returns the output's batch dimension. The expansion
# matters in nested ``vmap``: an input the outer level does not map holds the inner batch first,
# which ``np.matmul`` would pair with the outer batch. ``backward`` and ``jvp`` take the batch in
# ``...``. A loop of ``A @ v`` checks each batching (dimensions elsewhere, an unmapped input,
# nested); for ``u · (A v)`` the gradient is ``u vᵀ`` for ``A``, ``Aᵀ u`` for ``v``.


class NumpyMatVec(torch.autograd.Function):
    setup_context = NumpySlope.setup_context  # saves A and v, for both modes

    @staticmethod
    def forward(A, v):
        A_np, v_np = A.detach().cpu().numpy(), v.detach().cpu().numpy()
        product = np.matmul(A_np, v_np[..., None])[..., 0]
        return torch.as_tensor(product, device=v.device)

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


matrices = torch.randn(4, 3, 5, device=device, dtype=torch.float64)
vectors = torch.randn(4, 5, device=device, dtype=torch.float64)
weights = torch.randn(3, device=device, dtype=torch.float64)
matvec, A0, v0 = NumpyMatVec.apply, matrices[0], vectors[0]
loop = torch.stack([A @ v for A, v in zip(matrices, vectors)])
check(vmap(matvec)(matrices, vectors), loop)
check(vmap(matvec, in_dims=(2, 1))(matrices.permute(1, 2, 0), vectors.T), loop)
all_pairs = vmap(vmap(matvec, in_dims=(None, 0)), in_dims=(0, None))(matrices, vectors)
pairs_loop = torch.stack([torch.stack([A @ v for v in vectors]) for A in matrices])
check(all_pairs, pairs_loop)  # needs the expand
weighted = grad(lambda A, v: weights @ matvec(A, v), argnums=(0, 1))
grad_A, grad_v = vmap(weighted)(matrices, vectors)
check(grad_A, weights[None, :, None] * vectors[:, None, :])
check(grad_v, matrices.transpose(1, 2) @ weights)
summed = grad(lambda A: vmap(matvec, in_dims=(None, 0))(A, vectors).sum())(A0)
check(summed, torch.ones(3, 1, device=device) * vectors.sum(0))
A_dot, v_dot = torch.randn_like(matrices), torch.randn_like(vectors)
_, pushed = jvp(vmap(matvec), (matrices, vectors), (A_dot, v_dot))
check(pushed, (A_dot @ vectors[..., None] + matrices @ v_dot[..., None])[..., 0])
for jacobian in (jacrev, jacfwd):
    check(jacobian(matvec, argnums=1)(A0, v0), A0)
inputs = (A0.clone().requires_grad_(), v0.clone().requires_grad_())
assert torch.autograd.gradcheck(matvec, inputs, check_forward_ad=True)
assert torch.autograd.gradgradcheck(matvec, inputs)

# %%
# An intermediate to save, and an argument that is not a tensor
# -------------------------------------------------------------
# With no ``ctx`` in ``forward``, a tensor made there for ``backward`` leaves as an extra output,
# which ``setup_context`` marks with ``ctx.mark_non_differentiable`` and saves. ``TopKSum`` adds
# the ``k`` largest entries of each row (``k`` a Python int); its intermediate is their mask. For
# ``k``, ``in_dims`` holds ``None``, ``jvp`` receives ``None``, ``backward`` returns ``None``. The
# ``vmap`` rule returns one batch dimension per output; ``vmap``'s ``out_dims`` places each. The
# references: a loop of ``sort``, and the mask from ``torch.topk``, which is the sum's gradient.


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
        return TopKSum.apply(x.movedim(in_dims[0], 0), k), (0, 0)  # one per output


scores = torch.randn(4, 7, device=device, dtype=torch.float64)
top3 = lambda s: TopKSum.apply(s, 3)[0]  # noqa: E731
mask = torch.zeros_like(scores).scatter(-1, scores.topk(3).indices, 1.0)
sums, masks = vmap(TopKSum.apply, in_dims=(1, None), out_dims=(0, 1))(scores.T, 3)
check(sums, torch.stack([s.sort().values[-3:].sum() for s in scores]))
check(masks, mask.T)
check(vmap(grad(top3))(scores), mask)
check(jvp(vmap(top3), (scores,), (batch[:, :7],))[1], (batch[:, :7] * mask).sum(-1))
score_leaf = scores[0].clone().requires_grad_()
assert not TopKSum.apply(score_leaf, 3)[1].requires_grad  # marked: not differentiable
assert torch.autograd.gradcheck(top3, (score_leaf,), check_forward_ad=True)

# %%
# Two features that need care
# ---------------------------
# An in-place Function marks its input with ``ctx.mark_dirty``. It runs under ``grad`` on a copy
# (on ``grad``'s input itself, a leaf, autograd raises), but a generated ``vmap`` rule refuses it,
# with a message that misleads: the input *is* returned. Fix: rewrite it out of place, or write
# its ``vmap`` staticmethod by hand, which composes with ``grad``.
#
# A ``backward`` under ``once_differentiable`` runs in ``no_grad``: nested ``grad`` takes its
# result as a constant and silently drops every term through it (here all: 0; plain autograd
# raises here, where nothing else needs a gradient). ``hessian`` stays right: forward mode goes on.


class DoubleInPlace(torch.autograd.Function):
    generate_vmap_rule = True
    forward = staticmethod(lambda x: x.mul_(2))
    setup_context = staticmethod(lambda ctx, inputs, output: ctx.mark_dirty(inputs[0]))
    backward = staticmethod(lambda ctx, grad_output: 2 * grad_output)


class DoubleInPlaceByHand(DoubleInPlace):  # the whole batch doubled in place
    generate_vmap_rule = False
    vmap = staticmethod(lambda info, dims, x: (DoubleInPlaceByHand.apply(x), dims[0]))


class TanhOnce(NumpyTanh):  # its vmap rule runs NumpyTanh, below the grad levels
    backward = staticmethod(once_differentiable(NumpyTanh.backward))


check(grad(lambda t: DoubleInPlace.apply(t.clone()).sum())(x), torch.full_like(x, 2.0))
expect_error(lambda: grad(DoubleInPlace.apply)(x[0].clone()), RuntimeError, "a leaf")
expect_error(lambda: vmap(DoubleInPlace.apply)(batch.clone()), RuntimeError, "as dirty")
doubled = batch.clone()
check(vmap(DoubleInPlaceByHand.apply)(doubled), 2 * batch)
check(doubled, 2 * batch)  # written in place
by_hand = vmap(grad(lambda t: DoubleInPlaceByHand.apply(t.clone()).sum()))(batch)
check(by_hand, torch.full_like(batch, 2.0))
second = vmap(grad(grad(TanhOnce.apply)))(x)
check(vmap(grad(TanhOnce.apply))(x), exact_first)
check(vmap(hessian(TanhOnce.apply))(x), exact_second)
print(f"once_differentiable, grad(grad): largest |second derivative| {second.abs().max():.2f}"
      f", where −2 tanh (1 − tanh²) reaches {exact_second.abs().max():.2f}")  # fmt: skip
assert (second == 0).all() and exact_second.abs().max() > 0.5
leaf = x.clone().requires_grad_()
(slope,) = torch.autograd.grad(TanhOnce.apply(leaf).sum(), leaf, create_graph=True)
expect_error(lambda: torch.autograd.grad(slope.sum(), leaf), RuntimeError, "grad_fn")

# %%
# ``autograd.Function`` or ``torch.library.custom_op``?
# -----------------------------------------------------
# ``torch.library.custom_op`` wraps the same NumPy code as an operator that ``torch.compile`` keeps
# whole, as one node (``register_fake`` gives it the output's shape), with ``register_autograd`` and
# ``register_vmap``. In this release ``vmap``, the compiled graph and plain autograd work, but
# ``grad`` refuses the op with the old-style Function's error (reported for ``grad`` and ``jacrev``:
# pytorch#168393, pytorch#179652), and ``jvp`` and ``jacfwd`` return a zero tangent, silently. So:
# an ``autograd.Function`` for ``torch.func``'s derivatives; a custom op for ``torch.compile``,
# ``vmap`` and ``backward()``. And in torch 2.13 a compiled ``grad`` ignores a Function's
# ``backward`` (pytorch#193279, closed since; ``jvp``: pytorch#192985): dynamo traces NumPy calls as
# torch operations, so it sees into ``NumpyTanh``'s forward, unlike the eager transforms, and
# differentiates it, ``detach`` too: zeros, silently. With ``fullgraph=True``, a forward it cannot
# trace stops the compile instead. Compile the loss and call ``backward()``: the graph keeps the
# Function's own ``backward`` (``fullgraph=True`` refuses one with a ``jvp`` staticmethod).
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
check(vmap(tanh_op, in_dims=1)(batch), torch.tanh(batch).T)
assert torch.autograd.gradcheck(tanh_op, x_leaf)  # plain autograd
compiled = torch.compile(lambda t: tanh_op(t).sin(), backend=record, fullgraph=True)
check(compiled(x), torch.tanh(x).sin())
print("torch.compile, one graph; its calls:", [str(op) for op in graph_ops])
assert graph_ops == [torch.ops.extending.numpy_tanh.default, "sin"], graph_ops
expect_error(lambda: grad(lambda t: tanh_op(t).sum())(x), RuntimeError, "setup_context")
tangents = jvp(tanh_op, (x,), (torch.ones_like(x),))[1], jacfwd(tanh_op)(x)
largest = max(tangent.abs().max() for tangent in tangents)
print(f"jvp and jacfwd through the custom op: largest |entry| {largest:.1f}, "
      f"where 1 − tanh² reaches {exact_first.max():.1f}")  # fmt: skip
assert largest == 0 and exact_first.max() > 0.5
compiled_grad = grad(lambda t: NumpyTanh.apply(t).sum())
compiled_grad = torch.compile(compiled_grad, backend=record, fullgraph=True)
assert not compiled_grad(x).any() and "detach" in graph_ops  # forward traced
torch.compile(lambda t: bare(t).sum(), backend=record, fullgraph=True)(leaf).backward()
check(leaf.grad, exact_first)  # bare's own backward ran
whole = torch.compile(lambda t: NumpyTanh.apply(t), backend=record, fullgraph=True)
expect_error(lambda: whole(leaf), torch._dynamo.exc.Unsupported, "custom `jvp`")
opaque = torch._dynamo.disable(NumpyTanh.apply)  # as if its forward were untraceable
stopped = torch.compile(grad(lambda t: opaque(t).sum()), backend=record, fullgraph=True)
expect_error(lambda: stopped(x), torch._dynamo.exc.Unsupported, "disable")

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
print(f"largest error in {len(errors)} checks: {max(errors):.1e}; bound 1e-14")

# %%
# What to remember
# ----------------
# * ``forward`` without ``ctx``; ``setup_context`` saves with ``save_for_backward`` and
#   ``save_for_forward``, and intermediates come out as outputs marked non-differentiable.
# * ``vmap`` and ``jacfwd`` need a ``vmap`` staticmethod or ``generate_vmap_rule = True``; a
#   rule by hand brings each input's batch dimension first (``in_dims`` is ``None`` for
#   non-tensors). Forward mode needs a ``jvp`` staticmethod.
# * Write ``backward`` in PyTorch operators or other Functions (their ``forward`` may call NumPy,
#   which cannot read the transforms' tensors); ``once_differentiable`` makes nested ``grad`` wrong.
# * Check with ``gradcheck(..., check_forward_ad=True)`` and ``gradgradcheck`` in float64.
# * ``torch.library.custom_op`` suits ``torch.compile``, ``vmap`` and ``backward()``; in this
#   release ``grad`` refuses it and ``jvp`` through it returns zeros, silently. In 2.13 compiled
#   ``grad`` ignores a Function's ``backward``: compile the loss and call ``backward()``.
