"""
Jacobians and Hessians: ``jacrev``, ``jacfwd`` and ``hessian``
==============================================================

A Jacobian collects the derivative of every output with respect to every input. Autograd's
``backward`` gives one row of it per pass (a vector-Jacobian product), so the classic recipe
loops over rows. ``torch.func`` vectorises that loop with ``vmap``, and offers two engines:
reverse mode, ``jacrev``, with one pass per output, and forward mode, ``jacfwd``, with one pass
per input. On this page you will compute a Jacobian three ways and check each against the
formula, learn which engine wins for tall and for wide Jacobians, find where they cross over
on the machine that built the page, and compute Hessians by composing the two.
"""

# %%
# Where this page ran
# -------------------
# The timings below depend on the hardware, so we print it. We pick the GPU when there is one
# and seed the generator so every run sees the same weights and inputs.
import ctypes
import os
import platform
import re
import statistics
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev, vjp, vmap
from torch.utils import benchmark

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
# Some Hessians below allocate hundreds of MB per call. On a CPU, glibc's ``malloc`` by default
# returns such blocks to the kernel when they are freed, and decides when to do so from the
# process's history, so the same call can be fast or slow depending on what ran before. We ask
# glibc (through ``mallopt``) to keep freed memory for reuse, which makes the timings
# reproducible; the per-sample-gradients page measures what fresh pages cost. Without glibc
# the cell changes nothing and says so.
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
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Checks in float64, and no TF32
# ------------------------------
# Every result is compared with a formula evaluated in float64, by its relative error
# ``‖J − J_ref‖ / ‖J_ref‖``. On recent NVIDIA GPUs PyTorch can run float32 matrix products in
# TF32, with a 10-bit mantissa, which would make those errors a thousand times larger. Its
# default is full float32 precision; we set that explicitly, so the bounds below are about
# float32 arithmetic and nothing else. float32 carries about 7 significant digits, so a bound
# of 1e-5 leaves room for rounding to accumulate over hundreds of inputs while still catching
# any wrong entry.
torch.set_float32_matmul_precision("highest")
print(f"float32 machine epsilon: {torch.finfo(torch.float32).eps:.1e}")


def check(result, reference64, what, bound=1e-5):
    """Assert the shape and the relative error of a float32 result against float64."""
    assert result.shape == reference64.shape, (what, result.shape, reference64.shape)
    error = ((result.double() - reference64).norm() / reference64.norm()).item()
    assert error < bound, f"{what}: relative error {error:.2e}"
    return error


def median_times_ms(methods, rounds=9, min_run_time=0.1):
    """Median time of each method in ``{name: fn}``, in ms, using all of torch's threads.

    Each method is called three times untimed first, so that caches, lazy initialisation and
    the allocator's heap settle. Then the methods are timed in turn, round after round, and
    each one's median over the rounds is reported: a slow spell of the machine hits every
    method alike instead of whichever happened to run during it.
    """
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


# %%
# The function and its exact Jacobian
# -----------------------------------
# One dense layer with a ``tanh``: *f(W, b, x) = tanh(W x + b)*. It is small enough to
# differentiate by hand, which gives an independent reference for every check on this page:
#
# .. code-block:: text
#
#    ∂f_i/∂x_k  = (1 − f_i²) W_ik
#    ∂f_i/∂b_j  = (1 − f_i²) δ_ij
#    ∂f_i/∂W_jk = (1 − f_i²) δ_ij x_k
#
# The references evaluate these formulas in float64, from the same weights and inputs.


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


def exact_input_jacobian64(weight, bias, x):
    weight, bias, x = weight.double(), bias.double(), x.double()
    y = layer(weight, bias, x)
    return (1 - y**2)[:, None] * weight


size = 16
weight = torch.randn(size, size, device=device) / size**0.5
bias = torch.randn(size, device=device)
x = torch.randn(size, device=device)
reference = exact_input_jacobian64(weight, bias, x)
print("Jacobian shape (outputs, inputs):", tuple(reference.shape))

# %%
# Way 1: row by row with ``autograd.grad``
# ----------------------------------------
# Backpropagating the unit vector ``e_i`` from the output gives row ``i`` of the
# Jacobian: ``e_iᵀ J``. One backward pass per output, in a Python loop, keeping the
# graph alive between passes.


def jacobian_row_by_row(weight, bias, x):
    x = x.detach().requires_grad_()
    y = layer(weight, bias, x)
    unit_vectors = torch.eye(y.numel(), device=y.device)
    rows = [torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in unit_vectors]
    return torch.stack(rows)


row_by_row = jacobian_row_by_row(weight, bias, x)
check(row_by_row, reference, "row by row")

# %%
# Way 2: ``vmap`` over ``vjp``
# ----------------------------
# :func:`~torch.func.vjp` returns a function that computes ``vᵀ J`` for any ``v``.
# Instead of calling it once per unit vector, :func:`~torch.func.vmap` calls it once with all of
# them stacked: the whole identity matrix goes through a single, batched backward pass.
identity = torch.eye(size, device=device)
_, vjp_fn = vjp(partial(layer, weight, bias), x)
(vmapped_vjp,) = vmap(vjp_fn)(identity)
check(vmapped_vjp, reference, "vmap(vjp)")

# %%
# Way 3: ``jacrev``
# -----------------
# :func:`~torch.func.jacrev` packages exactly that recipe. ``argnums=2`` picks the argument to
# differentiate, here ``x``.
jacobian_x = jacrev(layer, argnums=2)(weight, bias, x)
error = check(jacobian_x, reference, "jacrev")
print(f"row by row, vmap(vjp) and jacrev all match the formula (jacrev: {error:.1e})")

# %%
# ``argnums`` also takes a tuple. With respect to the weight the Jacobian has shape
# ``(outputs, *weight.shape)``, and with respect to the bias ``(outputs, *bias.shape)``. Each is
# checked against its own formula.
jacobian_weight, jacobian_bias = jacrev(layer, argnums=(0, 1))(weight, bias, x)
print(
    "d f / d weight:",
    tuple(jacobian_weight.shape),
    "  d f / d bias:",
    tuple(jacobian_bias.shape),
)
slope64 = 1 - layer(weight.double(), bias.double(), x.double()) ** 2
identity64 = torch.eye(size, device=device, dtype=torch.float64)
check(
    jacobian_weight,
    torch.einsum("i,ij,k->ijk", slope64, identity64, x.double()),
    "d f / d weight",
)
check(jacobian_bias, torch.diag(slope64), "d f / d bias")

# %%
# How much the vectorised versions save at this size:
jacobian_times_ms = median_times_ms(
    {
        "row by row": lambda: jacobian_row_by_row(weight, bias, x),
        "vmap(vjp)": lambda: vmap(vjp(partial(layer, weight, bias), x)[1])(identity),
        "jacrev": lambda: jacrev(layer, argnums=2)(weight, bias, x),
    }
)
for method, ms in jacobian_times_ms.items():
    speedup = jacobian_times_ms["row by row"] / ms
    print(f"{method:10s} {ms:6.3f} ms  ({speedup:.2f}x vs row by row)")

# %%
# Forward or reverse mode?
# ------------------------
# Reverse mode builds the Jacobian from vector-Jacobian products, one per **output**; forward
# mode (:func:`~torch.func.jacfwd`) builds it from Jacobian-vector products, one per **input**.
# Both batch their passes with ``vmap``, but the batch is as large as the number of rows or
# columns. So a *tall* Jacobian (many outputs, few inputs) favours ``jacfwd``, and a *wide* one
# (few outputs, many inputs) favours ``jacrev``. A GPU needs larger problems than a CPU before
# the arithmetic, rather than the fixed cost of launching kernels, decides the time, so on a GPU
# both sides of every shape below are scaled up; the sizes are printed.
scale = 1 if device.type == "cpu" else 4
tall_shape = (32 * scale, 1024 * scale)  # (inputs, outputs)
wide_shape = tall_shape[::-1]


def random_layer(inputs, outputs):
    return (
        torch.randn(outputs, inputs, device=device) / inputs**0.5,
        torch.randn(outputs, device=device),
        torch.randn(inputs, device=device),
    )


def time_both_modes(args):
    return median_times_ms(
        {
            "jacfwd": lambda: jacfwd(layer, argnums=2)(*args),
            "jacrev": lambda: jacrev(layer, argnums=2)(*args),
        },
        rounds=5,
    )


shape_times = {}
for name, (inputs, outputs) in [("tall", tall_shape), ("wide", wide_shape)]:
    args = random_layer(inputs, outputs)
    expected = exact_input_jacobian64(*args)
    check(jacfwd(layer, argnums=2)(*args), expected, f"{name} jacfwd")
    check(jacrev(layer, argnums=2)(*args), expected, f"{name} jacrev")
    shape_times[name] = time_both_modes(args)
    fwd_ms, rev_ms = shape_times[name]["jacfwd"], shape_times[name]["jacrev"]
    winner, ratio = (
        ("jacfwd", rev_ms / fwd_ms) if fwd_ms < rev_ms else ("jacrev", fwd_ms / rev_ms)
    )
    print(
        f"{name} ({inputs} in, {outputs} out): jacfwd {fwd_ms:.2f} ms, "
        f"jacrev {rev_ms:.2f} ms -> {winner} is {ratio:.2f}x faster"
    )

# %%
# Where is the crossover?
# -----------------------
# Published tutorials stop at those two shapes. Here we sweep the shape instead: the Jacobian
# keeps a fixed number of entries while its aspect ratio (outputs / inputs) runs from the wide
# shape above to the tall one, and we plot how much slower ``jacfwd`` is than ``jacrev``.
entries = tall_shape[0] * tall_shape[1]
input_sizes = [wide_shape[0]]  # from the wide shape above, halving, to the tall one
while input_sizes[-1] > tall_shape[0]:
    input_sizes.append(input_sizes[-1] // 2)
aspect_ratios, fwd_over_rev = [], []
for inputs in input_sizes:
    outputs = entries // inputs
    times = time_both_modes(random_layer(inputs, outputs))
    aspect_ratios.append(outputs / inputs)
    fwd_over_rev.append(times["jacfwd"] / times["jacrev"])
    print(
        f"{inputs:5d} in, {outputs:5d} out: jacfwd takes {fwd_over_rev[-1]:.2f}x "
        "the time of jacrev"
    )

# %%
# To find the crossover we do not look for the first sign change between two neighbouring
# points, which noise could place anywhere. We fit a straight line to all points of the sweep
# in log-log coordinates and take the aspect ratio where the line crosses 1.
#
# Counting multiply-adds predicts a tie at a *square* Jacobian: ``jacfwd`` pushes ``inputs``
# tangents through a layer of ``inputs × outputs`` weights, ``jacrev`` pulls ``outputs``
# cotangents back through the same layer, so their costs stand in the ratio inputs : outputs.
# Where the measured crossover lies away from 1, the two engines differ by a constant factor
# per product on this hardware (how well each one's matrix shapes suit the matrix-product
# kernels, and how much fixed bookkeeping each adds). That factor is measured here, not
# derived. The line is shallow, so the crossing point is sensitive to timing noise; the page
# prints how sensitive, and a fresh run can put it noticeably elsewhere.
log_aspect = torch.tensor(aspect_ratios, dtype=torch.float64).log()
log_ratio = torch.tensor(fwd_over_rev, dtype=torch.float64).log()
design = torch.stack([log_aspect, torch.ones_like(log_aspect)], dim=1)
fit_slope, fit_intercept = torch.linalg.lstsq(design, log_ratio[:, None]).solution[:, 0]
crossover = None
if fit_slope < 0:
    candidate = torch.exp(-fit_intercept / fit_slope).item()
    if min(aspect_ratios) <= candidate <= max(aspect_ratios):
        crossover = candidate
print(f"fitted slope of log(time ratio) against log(aspect ratio): {fit_slope:.2f}")
if crossover is None:
    print("no crossover inside the sweep: one engine wins at every shape here")
else:
    print(f"jacfwd and jacrev tie at about {crossover:.1f} outputs per input")
    # A shallow line makes the crossing sensitive: 10% of timing noise moves it this much.
    print(f"10% of timing noise moves that by a factor {1.1 ** (-1 / fit_slope):.2f}")

fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
ax.loglog(aspect_ratios, fwd_over_rev, "o", color="black", base=2, label="measured")
fitted = torch.exp(fit_slope * log_aspect + fit_intercept)
ax.loglog(aspect_ratios, fitted, "-", color="black", base=2, label="log-log fit")
ax.axhline(1, color="black", linewidth=0.8)
if crossover is not None:
    ax.axvline(
        crossover, color="black", linestyle=":", label=f"crossover ≈ {crossover:.2g}"
    )
ax.legend(loc="upper right")
ax.set_xlabel(f"Jacobian aspect ratio: outputs / inputs ({entries:,} entries)")
ax.set_ylabel("time(jacfwd) / time(jacrev)")
ax.set_title(f"jacfwd vs jacrev by Jacobian shape ({device.type.upper()})")
ax.text(
    aspect_ratios[0],
    1.05,
    "jacrev faster ↑",
    color=METHOD_COLORS["jacrev"],
    va="bottom",
)
ax.text(
    aspect_ratios[0], 0.95, "jacfwd faster ↓", color=METHOD_COLORS["jacfwd"], va="top"
)
plt.show()

# %%
# Hessians: compositions of the two
# ---------------------------------
# A Hessian is the Jacobian of a Jacobian, so any pair of engines computes it.
# :func:`~torch.func.hessian` is ``jacfwd(jacrev(f))``: reverse mode inside, where the function
# maps many inputs to few outputs, and forward mode outside, where the inner Jacobian is tall.
# We compare it with the other orders for a layer with 256 inputs and 32 outputs, whose Hessian
# has shape (32, 256, 256). The exact Hessian is
# ``∂²f_i/∂x_k∂x_l = −2 f_i (1 − f_i²) W_ik W_il``,
# evaluated in float64 as the reference.
hess_weight, hess_bias, hess_x = random_layer(inputs=256, outputs=32)
weight64 = hess_weight.double()
y64 = layer(weight64, hess_bias.double(), hess_x.double())
hessian_reference = torch.einsum(
    "i,ik,il->ikl", -2 * y64 * (1 - y64**2), weight64, weight64
)

hessian_methods = {
    "hessian": hessian(layer, argnums=2),
    "jacfwd(jacfwd)": jacfwd(jacfwd(layer, argnums=2), argnums=2),
    "jacrev(jacrev)": jacrev(jacrev(layer, argnums=2), argnums=2),
    "jacrev(jacfwd)": jacrev(jacfwd(layer, argnums=2), argnums=2),
}
hessian_colors = [
    METHOD_COLORS["hessian"],
    METHOD_COLORS["jacfwd"],
    METHOD_COLORS["jacrev"],
    METHOD_COLORS["jacrev(jacfwd)"],
]

# %%
# Every composition must match the exact Hessian within the float32 bound set above.
hessian_errors = {
    method: check(hessian_fn(hess_weight, hess_bias, hess_x), hessian_reference, method)
    for method, hessian_fn in hessian_methods.items()
}
hessian_times_ms = median_times_ms(
    {
        method: partial(hessian_fn, hess_weight, hess_bias, hess_x)
        for method, hessian_fn in hessian_methods.items()
    },
    rounds=5,
)
for method, ms in hessian_times_ms.items():
    print(f"{method:15s} relative error {hessian_errors[method]:.1e}   {ms:8.2f} ms")

hessian_ratios = {
    m: ms / hessian_times_ms["hessian"] for m, ms in hessian_times_ms.items()
}
for method, ratio in hessian_ratios.items():
    print(f"{method:15s} takes {ratio:.2f}x the time of hessian")

# %%
# The axis is logarithmic, so that equal distances are equal factors, whether the ratios are
# close together or orders of magnitude apart.
fig, ax = plt.subplots(figsize=(7, 2.8), layout="constrained")
bars = ax.barh(
    list(hessian_ratios), list(hessian_ratios.values()), color=hessian_colors
)
ax.bar_label(bars, labels=[f"{r:.2f}x" for r in hessian_ratios.values()], padding=4)
ax.set_xscale("log")
ax.set_xlim(min(hessian_ratios.values()) / 2, max(hessian_ratios.values()) * 4)
ax.invert_yaxis()
ax.set_xlabel("median time, as a multiple of hessian's")
ax.set_title("Hessian of a 256 → 32 layer, (32, 256, 256) entries")
plt.show()

# %%
# What to remember
# ----------------
# * ``jacrev`` costs about one backward pass per output, ``jacfwd`` one forward pass per input;
#   both run those passes as one vectorised batch.
# * Start from the shape: counted in multiply-adds, tall Jacobians favour ``jacfwd`` and wide
#   ones ``jacrev``. Then measure, as the sweep above does: the boundary need not be at a
#   square shape, and on some hardware one engine wins at every shape of the sweep.
# * ``hessian`` is ``jacfwd(jacrev(...))``, PyTorch's default for a scalar or few-output
#   function of many inputs. The timings above show how the other orders compare with it on
#   this page's hardware.
