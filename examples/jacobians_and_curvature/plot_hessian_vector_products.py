"""
Hessian-vector products, curvature and Gauss-Newton
===================================================

Second-order information about a loss, its curvature, is what Newton's method, sharpness measures,
influence functions and many optimisers need. For a model with P parameters the Hessian has P²
entries: for a million parameters, terabytes in float32 (the page prints the exact figure), so
nobody forms it. What they use instead is the Hessian *times a vector*, which costs a few gradients
and no more memory than a few gradients. This page builds that product three ways from ``grad``,
``jvp`` and ``vjp`` on a model's parameters, checks them against a float64 reference, times each one
against one gradient (eager and compiled) with its peak memory, and then uses it: the top eigenvalue
of the Hessian by power iteration, and Newton steps by conjugate gradients, both checked against the
dense Hessian of a small model. Finally it builds the Gauss-Newton product, which is what a Newton
solver should usually use instead, and shows why.
"""

# %%
# Where this page ran
# -------------------
# We use the GPU when there is one and seed the random number generator.
import ctypes
import gc
import os
import platform
import re
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jvp, vjp
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

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
# As on every page of this site, glibc is asked to keep freed memory for reuse, so that the
# timings do not depend on what the process did before. Without glibc the cell changes
# nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


def glibc():
    """The C library, if it is glibc (whose mallopt we call), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


allocator_pinned = keep_freed_memory()
print(
    "allocator: glibc keeps freed memory for reuse"
    if allocator_pinned
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Timing and memory helpers
# -------------------------
# Medians over interleaved rounds of :class:`torch.utils.benchmark.Timer` after untimed
# calls. Peak memory of one call: on a GPU from the CUDA allocator's record of the call; on a
# CPU with glibc from malloc's own count of the bytes it has handed out, read after every
# tensor operation of the call by a ``TorchDispatchMode`` (a hook that sees each operation;
# it lives in ``torch.utils._python_dispatch``, a private module). Matrix products run in full
# float32 precision.
torch.set_float32_matmul_precision("highest")


def median_times_ms(methods, rounds=7, min_run_time=0.05):
    """Median time of each method in ``{name: fn}``, in ms, round after round."""
    for fn in methods.values():
        for _ in range(3):
            fn()
    timers = {
        name: benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
        for name, fn in methods.items()
    }
    rounds_ms = {name: [] for name in methods}
    for _ in range(rounds):
        for name, timer in timers.items():
            blocks = timer.blocked_autorange(min_run_time=min_run_time)
            rounds_ms[name].append(blocks.median * 1e3)
    return {name: statistics.median(times) for name, times in rounds_ms.items()}


def cuda_peak_bytes(fn):
    """Peak of live CUDA memory during fn(), from the allocator's record of this call."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(
        context=None, clear_history=True, max_entries=1_000_000
    )
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live = peak = 0
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live += event["size"]
            peak = max(peak, live)
        elif event["action"] == "free_completed":
            live -= event["size"]
    return peak


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): the heap's counters, in bytes."""

    _fields_ = [
        (field, ctypes.c_size_t)
        for field in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                      "fsmblks", "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


class PeakLiveMemory(TorchDispatchMode):
    """Reads malloc's count of live bytes (heap chunks in use plus mmapped blocks) after
    every tensor operation run under it, and keeps the highest."""

    def __init__(self, mallinfo2):
        super().__init__()
        self.mallinfo2 = mallinfo2
        self.peak = self.live_bytes()

    def live_bytes(self):
        info = self.mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.live_bytes())
        return result


def cpu_peak_bytes(fn):
    """Peak of live malloc'd memory during fn(), above where it started; None without
    glibc 2.33's mallinfo2. Unlike resident memory, this does not depend on what earlier
    cells left in the heap: it counts what is allocated, not which pages are touched."""
    libc = glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = MallInfo2  # a struct returned by value
    tracker = PeakLiveMemory(mallinfo2)
    start = tracker.peak
    with tracker:
        fn()
    return tracker.peak - start


def peak_mib(fn):
    # Garbage from earlier cells, if collected during the call, would hide part of its peak.
    gc.collect()
    peak = cuda_peak_bytes(fn) if device.type == "cuda" else cpu_peak_bytes(fn)
    return None if peak is None else peak / 2**20


# %%
# A model and a loss with a million parameters
# --------------------------------------------
# An MLP on flattened 28×28 images, 784 → 1024 → 256 → 10, with ``tanh`` activations: a
# smooth network, so that its Hessian exists everywhere and a finite difference of
# gradients can serve as an independent reference (ReLU's kinks would spoil it). The loss is
# the mean cross-entropy over a batch of 128. As on the other pages, the parameters are a
# dictionary, and :func:`~torch.func.functional_call` runs the module with them.


class TanhMLP(nn.Module):
    def __init__(self, widths):
        super().__init__()
        pairs = zip(widths[:-1], widths[1:])
        self.layers = nn.ModuleList(nn.Linear(n_in, n_out) for n_in, n_out in pairs)

    def forward(self, inputs):
        hidden = inputs
        for layer in self.layers[:-1]:
            hidden = torch.tanh(layer(hidden))
        return self.layers[-1](hidden)


def make_problem(widths, batch_size, seed):
    generator = torch.Generator().manual_seed(seed)
    net = TanhMLP(widths).to(device)
    inputs = torch.randn(batch_size, widths[0], generator=generator).to(device)
    targets = torch.randint(0, widths[-1], (batch_size,), generator=generator).to(
        device
    )
    params = {name: p.detach() for name, p in net.named_parameters()}
    return net, params, inputs, targets


net, params, inputs, targets = make_problem([784, 1024, 256, 10], 128, seed=0)
num_params = sum(p.numel() for p in params.values())
print(f"MLP: {num_params:,} parameters, batch of {len(inputs)}")
print(f"its Hessian in float32 would take {num_params**2 * 4 / 1e12:.1f} TB")


def loss_fn(params, inputs, targets):
    return F.cross_entropy(functional_call(net, params, (inputs,)), targets)


def random_direction(params, seed):
    """A direction in parameter space, as a dictionary like ``params``, of unit norm."""
    generator = torch.Generator().manual_seed(seed)
    direction = {
        name: torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device)
        for name, p in params.items()
    }
    norm = torch.sqrt(sum((d**2).sum() for d in direction.values()))
    return {name: d / norm for name, d in direction.items()}


direction = random_direction(params, seed=1)

# %%
# Three ways to build a Hessian-vector product
# --------------------------------------------
# The gradient ``g(θ) = ∇L(θ)`` is itself a function of the parameters, and the
# Hessian-vector product is its derivative in the direction ``v``: ``H v = d/dε g(θ + ε v)``
# at ε = 0. The transforms give three ways to take that derivative.
#
# * **forward-over-reverse**: push the tangent ``v`` forward through the gradient
#   computation, ``jvp(grad(L), (θ,), (v,))``. One forward-mode pass over the backward pass.
#   It also returns the gradient itself, as the primal output, for free.
# * **reverse-over-reverse**: the Hessian is symmetric, so ``H v = Hᵀ v`` is a
#   vector-Jacobian product of the gradient, ``vjp(grad(L), θ)`` applied to ``v``. This is
#   what ``torch.autograd.grad(g, θ, v)`` with ``create_graph=True`` does: it records the
#   backward pass and differentiates through it.
# * **reverse-over-forward**: first the directional derivative ``θ ↦ ∇L(θ)·v`` by a ``jvp``
#   of the loss, a scalar; then its gradient: ``grad`` of that scalar is ``H v``.


def hvp_forward_over_reverse(params, vector, inputs, targets):
    gradient_fn = grad(loss_fn)
    _, hvp = jvp(lambda p: gradient_fn(p, inputs, targets), (params,), (vector,))
    return hvp


def hvp_reverse_over_reverse(params, vector, inputs, targets):
    gradient_fn = grad(loss_fn)
    _, vjp_fn = vjp(lambda p: gradient_fn(p, inputs, targets), params)
    (hvp,) = vjp_fn(vector)
    return hvp


def hvp_reverse_over_forward(params, vector, inputs, targets):
    def directional_derivative(p):
        _, slope = jvp(lambda q: loss_fn(q, inputs, targets), (p,), (vector,))
        return slope

    return grad(directional_derivative)(params)


hvp_methods = {
    "forward-over-reverse": hvp_forward_over_reverse,
    "reverse-over-reverse": hvp_reverse_over_reverse,
    "reverse-over-forward": hvp_reverse_over_forward,
}

# %%
# Checking them against a finite difference in float64
# ----------------------------------------------------
# The reference uses none of ``torch.func``: ordinary autograd gradients in float64 at
# ``θ + εv`` and ``θ − εv``, and their central difference ``(g(θ+εv) − g(θ−εv)) / 2ε``. Its
# error is of order ε² (about 1e-8 relative here) plus rounding (1e-16 / ε), far below float32's
# precision, so it can judge the float32 products, tensor by tensor. The bound, 1e-4, is
# about a thousand times float32's rounding unit: a wrong product, or a missing term, is off by
# order one. Each method is also run in float64, where it must agree with the reference to
# the reference's own accuracy.


def autograd_gradient(params, inputs, targets):
    leaves = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    loss = F.cross_entropy(functional_call(net, leaves, (inputs,)), targets)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def finite_difference_hvp(params, vector, inputs, targets, step=1e-4):
    shifted = {
        sign: {name: p + sign * step * vector[name] for name, p in params.items()}
        for sign in (1, -1)
    }
    up = autograd_gradient(shifted[1], inputs, targets)
    down = autograd_gradient(shifted[-1], inputs, targets)
    return {name: (up[name] - down[name]) / (2 * step) for name in params}


def relative_errors(result, reference):
    """Relative error of every tensor in ``result`` against ``reference``, one by one."""
    return {
        name: ((result[name].double() - ref).norm() / ref.norm()).item()
        for name, ref in reference.items()
    }


def check_each_tensor(what, result, reference, bound):
    errors = relative_errors(result, reference)
    for name, error in errors.items():
        assert result[name].shape == reference[name].shape, (what, name)
        assert error < bound, f"{what}: {name} has relative error {error:.2e}"
    worst = max(errors, key=errors.get)
    print(f"{what:34s} worst tensor {worst}: relative error {errors[worst]:.1e}")


to64 = lambda tree: {name: t.double() for name, t in tree.items()}  # noqa: E731
net.double()
params64, direction64 = to64(params), to64(direction)
inputs64 = inputs.double()
reference_hvp = finite_difference_hvp(params64, direction64, inputs64, targets)
for method, hvp_fn in hvp_methods.items():
    result64 = hvp_fn(params64, direction64, inputs64, targets)
    check_each_tensor(f"{method} (float64)", result64, reference_hvp, bound=1e-6)
net.float()
for method, hvp_fn in hvp_methods.items():
    result = hvp_fn(params, direction, inputs, targets)
    check_each_tensor(f"{method} (float32)", result, reference_hvp, bound=1e-4)

# %%
# The check can fail. A classic mistake is to differentiate the *loss* in the direction ``v``
# twice, as if ``vᵀ H v`` were the product, or, as here, to forget that ``jvp`` returns the
# pair (value, tangent) and keep the value, which is the gradient, not ``H v``.
mistaken = jvp(lambda p: grad(loss_fn)(p, inputs, targets), (params,), (direction,))[0]
try:
    check_each_tensor("the gradient, taken for H v", mistaken, reference_hvp, 1e-4)
except AssertionError as error:
    print("caught:", error)
    assert "has relative error" in str(error)
else:
    raise AssertionError("the gradient passed for a Hessian-vector product")

# %%
# The gradient, the product and the logits from one call
# ------------------------------------------------------
# A training step that also wants curvature should not run the model twice. With
# ``has_aux=True``, :func:`~torch.func.grad` lets the loss function return extra outputs
# (here the logits) next to the loss, and passes them through; ``jvp`` with ``has_aux=True``
# passes them on again. :func:`~torch.func.grad_and_value` returns the loss as well as the
# gradient. So one call of the forward-over-reverse product gives the gradient (the primal
# output of the ``jvp``), ``H v`` (its tangent output), and the logits.


def loss_and_logits(params, inputs, targets):
    logits = functional_call(net, params, (inputs,))
    return F.cross_entropy(logits, targets), logits


gradient_and_logits = grad(loss_and_logits, has_aux=True)
gradient, hvp, logits = jvp(
    lambda p: gradient_and_logits(p, inputs, targets),
    (params,),
    (direction,),
    has_aux=True,
)
(_, (loss, logits_again)) = grad_and_value(loss_and_logits, has_aux=True)(
    params, inputs, targets
)
check_each_tensor(
    "gradient from the jvp's primal",
    gradient,
    autograd_gradient(params64, inputs64, targets),
    bound=1e-4,
)
check_each_tensor("H v from the same call", hvp, reference_hvp, bound=1e-4)
torch.testing.assert_close(logits, net(inputs))
torch.testing.assert_close(logits_again, logits)
torch.testing.assert_close(loss, F.cross_entropy(net(inputs), targets))
print(f"loss {loss.item():.4f} and logits {tuple(logits.shape)} came back with them")

# %%
# What each product costs against one gradient
# --------------------------------------------
# Theory (the "cheap gradient principle" of automatic differentiation, applied twice) says a
# Hessian-vector product costs a small constant times one gradient, independent of P. We time
# each method against one gradient, all in the same rounds, and measure each one's peak memory.
#
# Compiling: :func:`torch.compile` traces through the transforms and fuses the element-wise
# work. Compiling costs seconds per function, so on a CPU this page compiles the gradient and
# the forward-over-reverse product only; a GPU build compiles all three. The compiled product
# is compared with the compiled gradient, so that both sides get the same treatment. The first
# call compiles, and its time is reported on its own.
timed_calls = {"gradient": lambda: grad(loss_fn)(params, inputs, targets)}
for method, hvp_fn in hvp_methods.items():
    timed_calls[method] = lambda hvp_fn=hvp_fn: hvp_fn(
        params, direction, inputs, targets
    )

compiled_methods = (
    list(hvp_methods) if device.type == "cuda" else ["forward-over-reverse"]
)
compiled = {"gradient": torch.compile(grad(loss_fn))}
for method in compiled_methods:
    compiled[method] = torch.compile(hvp_methods[method])
compile_seconds = {}
for name, fn in compiled.items():
    arguments = (
        (params, inputs, targets)
        if name == "gradient"
        else (params, direction, inputs, targets)
    )
    start = time.perf_counter()
    result = fn(*arguments)  # the first call compiles
    compile_seconds[name] = time.perf_counter() - start
    if name != "gradient":
        check_each_tensor(f"{name} (compiled)", result, reference_hvp, bound=1e-4)
    timed_calls[f"{name} (compiled)"] = lambda fn=fn, arguments=arguments: fn(
        *arguments
    )
for name, seconds in compile_seconds.items():
    print(f"torch.compile, {name}: first call {seconds:.1f} s")

times_ms = median_times_ms(timed_calls)
peaks = {name: peak_mib(fn) for name, fn in timed_calls.items()}

# %%
# The lines below are printed in a fixed form, so that they can be read mechanically. Each
# method's time is a multiple of one gradient's, eager against eager and compiled against
# compiled.
gradient_ms = {
    "eager": times_ms["gradient"],
    "compiled": times_ms["gradient (compiled)"],
}
for name in timed_calls:
    peak = "n/a" if peaks[name] is None else f"{peaks[name]:.0f} MiB"
    print(f"{name:33s} {times_ms[name]:7.2f} ms   peak {peak}")
hvp_ratios = {}
for name in timed_calls:
    if not name.startswith("gradient"):
        mode = "compiled" if name.endswith("(compiled)") else "eager"
        hvp_ratios[name] = times_ms[name] / gradient_ms[mode]
        print(f"hvp {name}: {hvp_ratios[name]:.2f} x one gradient")
best = min(hvp_ratios, key=hvp_ratios.get)
verdict = "met" if hvp_ratios[best] <= 3 else "missed"
goal = "met" if hvp_ratios[best] <= 2 else "not met"
print(f"target (best hvp within 3x one gradient): {verdict}, by {best}")
print(f"goal (within 2x): {goal}")

# %%
# The figure shows both costs of each product, in units of one gradient: time on the left,
# peak memory on the right.
shown = [name for name in timed_calls if not name.startswith("gradient")]
fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
rows = range(len(shown))
colors = [METHOD_COLORS[name.removesuffix(" (compiled)")] for name in shown]
hatches = ["//" if name.endswith("(compiled)") else "" for name in shown]
ax_time.barh(rows, [hvp_ratios[name] for name in shown], color=colors, hatch=hatches)
ax_time.axvline(1, color="black", linewidth=1)
ax_time.axvline(3, color="black", linestyle=":", linewidth=1)
ax_time.set_yticks(rows, shown)
ax_time.invert_yaxis()
ax_time.set_xlabel("time / one gradient (dotted: the 3x target)")
if peaks["gradient"] is not None:
    memory_ratios = [
        peaks[name] / peaks["gradient (compiled)" if "compiled" in name else "gradient"]
        for name in shown
    ]
    ax_memory.barh(rows, memory_ratios, color=colors, hatch=hatches)
    ax_memory.axvline(1, color="black", linewidth=1)
    ax_memory.set_yticks(rows, [])
    ax_memory.invert_yaxis()
    ax_memory.set_xlabel("peak memory / one gradient's")
else:
    ax_memory.set_axis_off()
fig.suptitle(
    f"Hessian-vector products on {device.type.upper()}, {num_params:,} parameters"
)
plt.show()

# %%
# Reading the numbers:
#
# * A gradient is one forward and one backward pass. Each product adds a second
#   differentiation on top of it. Forward-over-reverse carries a tangent through both passes,
#   which roughly doubles the arithmetic and the live intermediates. Reverse-over-reverse
#   records the backward pass as a graph and runs a second backward through it.
#   Reverse-over-forward runs a forward-mode pass, then a backward pass through it. Counted in
#   operations, each is a small multiple of a gradient, between 2 and 4 in the textbook
#   accounting, whatever P is.
# * What keeps the measured ratios above 2 is element-wise work: ``tanh``, its first and
#   second derivatives and the tangent updates each make a pass over memory of their own in
#   eager mode, while the matrix products, where the gradient spends most of its time, stay as
#   efficient as before. Compiling fuses those passes; the table shows how much that gains
#   here.
# * Which eager method is fastest depends on the model and the hardware, which is why the
#   table is printed rather than a ranking asserted.

# %%
# Dense Hessian against products, on a small model
# ------------------------------------------------
# For comparison, and to check what follows, a small model whose Hessian fits easily:
# 8 → 16 → 3 with ``tanh``, 195 parameters, a batch of 32, all in float64. To treat the
# parameters as one vector we flatten them, and split a flat vector back into the
# dictionary. :func:`~torch.func.hessian` of the flat loss is the dense (P, P) matrix. It is
# P products' worth of arithmetic, but vectorised into one call, so at P = 195 it costs only
# a few products' time (printed below). What rules it out for large models is its P² memory,
# not its time on small ones.
torch.set_default_dtype(torch.float64)
small_net, small_params, small_inputs, small_targets = make_problem([8, 16, 3], 32, 2)
torch.set_default_dtype(torch.float32)
shapes = {name: p.shape for name, p in small_params.items()}
small_num_params = sum(p.numel() for p in small_params.values())


def unflatten(flat):
    pieces = flat.split([shape.numel() for shape in shapes.values()])
    return {
        name: piece.view(shape) for (name, shape), piece in zip(shapes.items(), pieces)
    }


def flatten(tree):
    return torch.cat([tree[name].reshape(-1) for name in shapes])


def small_loss(params):
    logits = functional_call(small_net, params, (small_inputs,))
    return F.cross_entropy(logits, small_targets)


def small_hvp(vector):
    """Forward-over-reverse on the small model, flat vector in, flat vector out."""
    _, product = jvp(grad(small_loss), (small_params,), (unflatten(vector),))
    return flatten(product)


theta = flatten(small_params)
dense_hessian = hessian(lambda flat: small_loss(unflatten(flat)))(theta)
# An independent dense reference: autograd's own Hessian, without torch.func.
autograd_hessian = torch.autograd.functional.hessian(
    lambda flat: small_loss(unflatten(flat)), theta
)
torch.testing.assert_close(dense_hessian, autograd_hessian, rtol=1e-10, atol=1e-12)
torch.testing.assert_close(dense_hessian, dense_hessian.T, rtol=1e-10, atol=1e-12)
small_vector = torch.randn(small_num_params, dtype=torch.float64, device=device)
torch.testing.assert_close(small_hvp(small_vector), dense_hessian @ small_vector)
print(f"small model: P = {small_num_params}, Hessian {tuple(dense_hessian.shape)}")
print("the product equals the dense Hessian times the vector (float64)")

small_times_ms = median_times_ms(
    {
        "hessian": lambda: (
            hessian(lambda flat: small_loss(unflatten(flat)))(theta) @ small_vector
        ),
        "forward-over-reverse": lambda: small_hvp(small_vector),
    },
    rounds=5,
)
print(
    f"dense Hessian, then times v: {small_times_ms['hessian']:.2f} ms; one product: "
    f"{small_times_ms['forward-over-reverse']:.2f} ms "
    f"({small_times_ms['hessian'] / small_times_ms['forward-over-reverse']:.1f}x)"
)

# %%
# The top eigenvalue by power iteration
# -------------------------------------
# Repeated products ``v ← H v / ‖H v‖`` turn ``v`` towards the eigenvector whose eigenvalue
# has the largest magnitude, and the Rayleigh quotient ``vᵀ H v`` converges to that
# eigenvalue: the "sharpness" that studies of training dynamics track. Only products are
# needed. We check the result against the eigenvalues of the dense Hessian.
eigenvalues = torch.linalg.eigvalsh(dense_hessian)
largest = eigenvalues[eigenvalues.abs().argmax()].item()


def power_iteration(product, size, steps, seed=3):
    generator = torch.Generator().manual_seed(seed)
    vector = torch.randn(size, generator=generator, dtype=torch.float64).to(device)
    vector /= vector.norm()
    estimates = []
    for _ in range(steps):
        image = product(vector)
        estimates.append(torch.dot(vector, image).item())
        vector = image / image.norm()
    return estimates


power_estimates = power_iteration(small_hvp, small_num_params, steps=60)
power_error = abs(power_estimates[-1] - largest) / abs(largest)
print(
    f"power iteration after {len(power_estimates)} products: {power_estimates[-1]:.6f}; "
    f"dense eigvalsh: {largest:.6f} (relative error {power_error:.1e})"
)
assert power_error < 1e-6

# %%
# Newton steps by conjugate gradients, and why Gauss-Newton
# ---------------------------------------------------------
# A Newton step solves ``(H + λI) d = −g``. Conjugate gradients (CG) solves it with one
# product per step and never forms ``H``, but only for a positive-definite matrix. The
# Hessian of a network's loss is usually *indefinite*: it has negative eigenvalues, and CG can
# then walk uphill or divide by a negative curvature.
#
# The generalised Gauss-Newton matrix ``G = Jᵀ H_L J`` keeps only the part of the curvature
# that comes through the loss (``J`` is the Jacobian of the logits with respect to the
# parameters, ``H_L`` the Hessian of the loss with respect to the logits), and drops the
# model's own second derivatives. For cross-entropy ``H_L`` is positive semi-definite, so
# ``G`` is too, and CG on ``G + λI`` is always safe. Its product needs no second derivative
# of the model: a ``jvp`` of the logits gives ``J v``, a multiplication by ``H_L`` (for
# softmax cross-entropy, ``(diag(p) − p pᵀ) / B`` per sample), and a ``vjp`` gives ``Jᵀ``.


def ggn_vector_product(model, params, vector, inputs):
    """G v = Jᵀ H_L J v for the mean cross-entropy of ``model`` on ``inputs``."""

    def logits_fn(p):
        return functional_call(model, p, (inputs,))

    logits, jacobian_vector = jvp(logits_fn, (params,), (vector,))
    probs = logits.softmax(dim=-1)
    weighted = probs * jacobian_vector
    loss_hessian_times = (weighted - probs * weighted.sum(-1, keepdim=True)) / len(
        inputs
    )
    _, vjp_fn = vjp(logits_fn, params)
    (product,) = vjp_fn(loss_hessian_times)
    return product


def small_ggn(vector):
    return flatten(
        ggn_vector_product(small_net, small_params, unflatten(vector), small_inputs)
    )


# %%
# The check is the explicit matrix. ``J`` comes from autograd's Jacobian of the logits,
# ``H_L`` from autograd's Hessian of the loss as a function of the logits, both in float64
# and without ``torch.func``.
logits_of = lambda flat: functional_call(small_net, unflatten(flat), (small_inputs,))  # noqa: E731
jacobian = torch.autograd.functional.jacobian(logits_of, theta).reshape(
    -1, small_num_params
)
small_logits = logits_of(theta)
loss_hessian = torch.autograd.functional.hessian(
    lambda z: F.cross_entropy(z.view_as(small_logits), small_targets),
    small_logits.reshape(-1),
)
explicit_ggn = jacobian.T @ loss_hessian @ jacobian
torch.testing.assert_close(small_ggn(small_vector), explicit_ggn @ small_vector)
ggn_eigenvalues = torch.linalg.eigvalsh(explicit_ggn)
print("G v matches the explicit Jᵀ H_L J v (float64)")
print(
    f"Hessian eigenvalues from {eigenvalues.min().item():+.2e} to "
    f"{eigenvalues.max().item():+.2e}; GGN from {ggn_eigenvalues.min().item():+.2e} "
    f"to {ggn_eigenvalues.max().item():+.2e}"
)
assert eigenvalues.min() < -1e-6 * eigenvalues.max()  # the Hessian is indefinite here
assert ggn_eigenvalues.min() > -1e-12 * ggn_eigenvalues.max()  # the GGN is not

# %%
# Now CG on the damped Newton system with each matrix, starting from ``d = 0``, damping λ a
# hundredth of the largest GGN eigenvalue. For a positive-definite matrix CG reduces the
# quadratic model ``m(d) = gᵀd + ½ dᵀ(A + λI)d`` at every step, and its solution is a descent
# direction (``gᵀd < 0``). We track both, check the GGN solve against a dense solve, and
# stop a run when it meets negative curvature (``pᵀ(A+λI)p ≤ 0``), as a Newton-CG optimiser
# must.
small_gradient = flatten(grad(small_loss)(small_params))
damping = 1e-2 * ggn_eigenvalues.max().item()


def conjugate_gradients(product, rhs, steps):
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    search = residual.clone()
    residual_norms, model_values, hit_negative_curvature = [], [], False
    for _ in range(steps):
        curved = product(search) + damping * search
        curvature = torch.dot(search, curved)
        if curvature <= 0:
            hit_negative_curvature = True
            break
        step = torch.dot(residual, residual) / curvature
        solution = solution + step * search
        new_residual = residual - step * curved
        search = (
            new_residual
            + torch.dot(new_residual, new_residual)
            / torch.dot(residual, residual)
            * search
        )
        residual = new_residual
        residual_norms.append((residual.norm() / rhs.norm()).item())
        model_values.append(
            (
                torch.dot(small_gradient, solution)
                + 0.5 * torch.dot(solution, product(solution) + damping * solution)
            ).item()
        )
    return solution, residual_norms, model_values, hit_negative_curvature


cg_runs = {
    "GGN": conjugate_gradients(small_ggn, -small_gradient, steps=40),
    "hessian": conjugate_gradients(small_hvp, -small_gradient, steps=40),
}
ggn_step, ggn_residuals, ggn_model, ggn_negative = cg_runs["GGN"]
dense_step = torch.linalg.solve(
    explicit_ggn
    + damping * torch.eye(small_num_params, dtype=torch.float64, device=device),
    -small_gradient,
)
step_error = ((ggn_step - dense_step).norm() / dense_step.norm()).item()
print(
    f"GGN: {len(ggn_residuals)} CG steps, residual {ggn_residuals[-1]:.1e}, "
    f"relative error against the dense solve {step_error:.1e}"
)
assert not ggn_negative and step_error < 1e-6
assert all(b <= a + 1e-15 for a, b in zip(ggn_model, ggn_model[1:]))  # never goes up
assert torch.dot(small_gradient, ggn_step) < 0  # a descent direction
hessian_steps = len(cg_runs["hessian"][1])
if cg_runs["hessian"][3]:
    print(f"Hessian: negative curvature met after {hessian_steps} CG steps")
else:
    print(f"Hessian: {hessian_steps} CG steps without meeting negative curvature")

# %%
# The second figure: power iteration converging on the top eigenvalue, and CG's residual with
# each matrix.
fig, (ax_power, ax_cg) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
ax_power.semilogy(
    range(1, len(power_estimates) + 1),
    [abs(e - largest) / abs(largest) for e in power_estimates],
    color=METHOD_COLORS["forward-over-reverse"],
)
ax_power.set_xlabel("Hessian-vector products")
ax_power.set_ylabel("relative error of the eigenvalue")
ax_power.set_title("power iteration (small model)")
for name, (_, residuals, _, _) in cg_runs.items():
    ax_cg.semilogy(range(1, len(residuals) + 1), residuals, color=METHOD_COLORS[name],
                   label=f"{name} + λI")  # fmt: skip
ax_cg.set_xlabel("CG steps")
ax_cg.set_ylabel("relative residual")
ax_cg.set_title("Newton-CG (small model)")
ax_cg.legend()
plt.show()

# %%
# When Gauss-Newton beats the Hessian
# -----------------------------------
# * For solving: wherever the Hessian is indefinite, as it is here and in most of training.
#   The GGN is positive semi-definite by construction, so damped CG converges and returns a
#   descent direction; on the Hessian it must stop at the first negative curvature.
# * For cost: a GGN product is a ``jvp`` and a ``vjp`` of the model (about two forwards and a
#   backward), with no second derivative of the model anywhere. On the large model:
ggn_times_ms = median_times_ms(
    {
        "gradient": timed_calls["gradient"],
        "GGN": lambda: ggn_vector_product(net, params, direction, inputs),
    }
)
ggn_ratio = ggn_times_ms["GGN"] / ggn_times_ms["gradient"]
print(f"GGN product: {ggn_ratio:.2f} x one gradient (eager, as in the table above)")

# %%
# * The Hessian is the right object when you want the curvature itself, negative directions
#   included: sharpness, saddle points, influence functions.
#
# The methods here compose with the others on this site: ``vmap`` over the vector gives many
# products in one call, and ``vmap`` over samples gives per-sample curvature.
