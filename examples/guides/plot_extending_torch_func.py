"""
Extending ``torch.func``: custom autograd Functions under transforms
====================================================================

Sometimes a function cannot be written with PyTorch operators: it calls NumPy or a C
library, or its gradient needs a formula that autograd would not find on its own. A custom
:class:`torch.autograd.Function` supplies the forward and the derivatives by hand. To work
under ``torch.func``'s transforms, it must follow a few rules: the forward takes no ``ctx``
and a separate ``setup_context`` saves what the derivatives need; ``vmap`` needs either a
generated rule or an explicit ``vmap`` staticmethod; forward mode (``jvp``, ``jacfwd``) needs
a ``jvp`` staticmethod. This page writes two such functions, shows the error for each rule
that is broken, uses them under ``grad``, ``vmap``, ``jvp``, ``jacrev``, ``jacfwd`` and
``hessian``, and checks every derivative with :func:`torch.autograd.gradcheck` in float64.
"""

# %%
# Where this page ran
# -------------------
# We use the GPU when there is one and seed the random number generator.
import ctypes
import os
import platform
import re
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


def describe_hardware():
    """One line naming the processor or GPU, torch's version and its thread count."""
    if device.type == "cuda":
        name = f"GPU: {torch.cuda.get_device_name(device)}"
    else:
        cpuinfo = Path("/proc/cpuinfo")  # Linux names the CPU model here
        model = (
            re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
            if cpuinfo.exists()
            else None
        )
        cpu = model.group(1) if model else (platform.processor() or platform.machine())
        name = f"CPU: {cpu}, {os.cpu_count()} cores"
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


print(describe_hardware())

# One colour per method, the same on every page of this site: colour-blind-safe hues from
# Okabe and Ito's palette and Tol's. Black is kept for guides: thresholds, fits, markers.
METHOD_COLORS = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "batched": "#666666",
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
    "sum trick": "#CC79A7",
    "vmap chunked": "#44AA99",
    "compiled": "#117733",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
    "ghost clipping": "#CC6677",
    "book-keeping": "#6699CC",
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
    "GGN": "#EE8866",
    "ntk-vector products": "#5D69B1",
    "linearize": "#CC3311",
}

# %%
# Pinning the memory allocator's policy
# -------------------------------------
# Every page of this site asks glibc to keep freed memory for reuse, so that timings do not
# depend on the process's history. This page times nothing, but keeps the same opening so that
# it behaves like the others when run on its own. Without glibc the cell changes nothing.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


print(
    "allocator: glibc keeps freed memory for reuse"
    if keep_freed_memory()
    else "allocator: not glibc, left as it is"
)


def expect_error(fn, error_type, fragment):
    """Run fn, which must raise error_type with fragment in its message; print the message."""
    try:
        fn()
    except error_type as error:
        message = str(error)
        assert fragment in message, f"unexpected message: {message}"
        print(f"{type(error).__name__}:")
        print(textwrap.fill(" ".join(message.split()), width=88))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


x = torch.linspace(-2, 2, 9, device=device, dtype=torch.float64)

# %%
# The old style is refused
# ------------------------
# A Function written the pre-2.0 way, with ``ctx`` as the forward's first argument, works with
# ``loss.backward()`` but not under the transforms, which need the forward to be a pure
# function of its inputs.


class DoubleOldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad_output):
        return 2 * grad_output


expect_error(lambda: vmap(DoubleOldStyle.apply)(x), RuntimeError, "setup_context")

# %%
# A Function whose forward PyTorch cannot see into: NumPy's tanh
# --------------------------------------------------------------
# ``NumpyTanh`` computes its forward in NumPy, so no transform can look inside it. It says
# everything itself:
#
# * ``forward(x)`` computes the output, with no ``ctx``;
# * ``setup_context`` saves the output, which both derivatives need: for the backward pass with
#   ``save_for_backward``, for forward mode with ``save_for_forward``;
# * ``backward`` applies the vector-Jacobian product, ``g · (1 − y²)``, with PyTorch operators,
#   so that it can itself be differentiated (``hessian`` needs that);
# * ``jvp`` applies the Jacobian-vector product, ``t · (1 − y²)``;
# * ``vmap`` says how to run on a batch. tanh is element-wise, so the batched input can go
#   through the same NumPy call, and the output is batched along the same dimension.


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


# %%
# Every transform agrees with the exact derivative of tanh, ``1 − tanh²``, and its second
# derivative, ``−2 tanh (1 − tanh²)``:
exact_first = 1 - torch.tanh(x) ** 2
exact_second = -2 * torch.tanh(x) * exact_first
through_grad = vmap(grad(NumpyTanh.apply))(x)
_, through_jvp = jvp(NumpyTanh.apply, (x,), (torch.ones_like(x),))
_, pullback = vjp(NumpyTanh.apply, x)
(through_vjp,) = pullback(torch.ones_like(x))
torch.testing.assert_close(through_grad, exact_first)
torch.testing.assert_close(through_jvp, exact_first)
torch.testing.assert_close(through_vjp, exact_first)
torch.testing.assert_close(jacrev(NumpyTanh.apply)(x), torch.diag(exact_first))
torch.testing.assert_close(jacfwd(NumpyTanh.apply)(x), torch.diag(exact_first))
second = vmap(hessian(NumpyTanh.apply))(x)
torch.testing.assert_close(second, exact_second)
print(
    "grad, vmap, jvp, vjp, jacrev, jacfwd and hessian agree with 1 − tanh² and its slope"
)

# %%
# :func:`torch.autograd.gradcheck` compares the hand-written derivatives with finite
# differences, in float64, in reverse mode and (``check_forward_ad=True``) in forward mode;
# ``gradgradcheck`` checks the derivative of the backward pass.
assert torch.autograd.gradcheck(
    NumpyTanh.apply, (x.clone().requires_grad_(),), check_forward_ad=True
)
assert torch.autograd.gradgradcheck(NumpyTanh.apply, (x.clone().requires_grad_(),))
print("gradcheck (reverse and forward mode) and gradgradcheck pass")

# %%
# Breaking the rules one at a time
# --------------------------------
# Without a ``vmap`` staticmethod (and without a generated rule), ``vmap`` refuses; without a
# ``jvp`` staticmethod, forward mode refuses. Each error names what is missing.


class TanhWithoutVmap(torch.autograd.Function):
    forward = NumpyTanh.forward
    setup_context = NumpyTanh.setup_context
    backward = NumpyTanh.backward


expect_error(lambda: vmap(TanhWithoutVmap.apply)(x), RuntimeError, "generate_vmap_rule")
expect_error(
    lambda: jvp(TanhWithoutVmap.apply, (x,), (torch.ones_like(x),)),
    NotImplementedError,
    "implement the jvp function",
)

# %%
# A generated ``vmap`` rule
# -------------------------
# When the forward, the backward and the jvp are written with PyTorch operators, ``vmap`` can
# batch them itself: set ``generate_vmap_rule = True`` instead of writing a ``vmap``
# staticmethod. ``SoftClip`` is ``x / (1 + |x|)`` with its derivative ``1 / (1 + |x|)²`` written
# by hand, a smooth alternative to clipping.


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
print("SoftClip: generated vmap rule, grad, jacfwd and gradcheck agree")

# %%
# The figure shows both functions with the derivatives that ``grad`` found through them.
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
