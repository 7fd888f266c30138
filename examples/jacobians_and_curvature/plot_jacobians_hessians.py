"""
Jacobians and Hessians: ``jacrev``, ``jacfwd`` and ``hessian``
==============================================================

A Jacobian holds the derivative of every output of a function with respect to every input, and
a Hessian the second derivatives; you need them for sensitivity analysis, Newton steps and
curvature. On this page you compute the Jacobian of a small layer with ``jacrev`` and
``jacfwd``, check every entry against the formula, see how each engine builds it (``jacrev``
row by row, ``jacfwd`` column by column), compute Hessians by composing the two, and then
count and time the work to find which engine wins for tall and for wide Jacobians.
"""

# %%
# Setup
# -----
import ctypes
import platform
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.set_float32_matmul_precision("highest")  # no TF32 on GPUs: the checks see float32

# %%
# A layer and its exact Jacobian
# ------------------------------
# One dense layer, *f(x) = tanh(W x + b)*, with 12 outputs and 16 inputs: different sizes, so a
# transposed Jacobian has the wrong shape. Differentiating by hand gives
# ``∂f_i/∂x_k = (1 − f_i²) W_ik``, which we evaluate in float64 as the reference.
num_outputs, num_inputs = 12, 16
weight = torch.randn(num_outputs, num_inputs, device=device) / num_inputs**0.5
bias = torch.randn(num_outputs, device=device)
x = torch.randn(num_inputs, device=device)


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


def exact_jacobian64(weight, bias, x):
    outputs64 = layer(weight.double(), bias.double(), x.double())
    return (1 - outputs64**2)[:, None] * weight.double()


jacobian_reference = exact_jacobian64(weight, bias, x)

# %%
# Every check compares entry by entry, ``|error| ≤ atol + rtol·|ref|``, so one wrong entry
# fails it. The tolerances sit within about 100x of float32 rounding; each check prints its share.


def check_entries(name, result, reference64, rtol=1e-5, atol=1e-6, quiet=False):
    torch.testing.assert_close(result.double(), reference64, rtol=rtol, atol=atol)
    error = (result.double() - reference64).abs()
    used = (error / (atol + rtol * reference64.abs())).max().item()
    if not quiet:
        print(f"{name:>15}: largest error {error.max():.1e} ({used:.1%} of tolerance)")


# %%
# The recipe: ``jacrev`` and ``jacfwd``
# -------------------------------------
# :func:`~torch.func.jacrev` (reverse mode) and :func:`~torch.func.jacfwd` (forward mode) take a
# function and return a function that computes its Jacobian; ``argnums=2`` picks the argument to
# differentiate, here ``x``. The result has the output axis first, then the input axis. The
# mental model: ``jacrev`` builds the Jacobian row by row, one vector-Jacobian product per
# output; ``jacfwd`` column by column, one Jacobian-vector product per input.
jacobian_rev = jacrev(layer, argnums=2)(weight, bias, x)
jacobian_fwd = jacfwd(layer, argnums=2)(weight, bias, x)
print("Jacobian shape (outputs, inputs):", tuple(jacobian_rev.shape))
check_entries("jacrev", jacobian_rev, jacobian_reference)
check_entries("jacfwd", jacobian_fwd, jacobian_reference)

# %%
# How each engine builds it: rows or columns
# ------------------------------------------
# Row ``i`` of the Jacobian is the vector-Jacobian product (vjp) ``e_iᵀ J``, and column ``k``
# the Jacobian-vector product (jvp) ``J e_k``. ``jacrev`` and ``jacfwd`` hand the whole stack of
# unit vectors to :func:`~torch.func.vmap`, which runs the products as one batched call. Written
# out with :func:`~torch.func.vjp` and :func:`~torch.func.jvp`:
f_of_x = partial(layer, weight, bias)
_, vjp_of_f = vjp(f_of_x, x)
output_basis = torch.eye(num_outputs, device=device)  # the unit vectors e_i
(rows,) = vmap(vjp_of_f)(output_basis)
check_entries("vmap(vjp) rows", rows, jacobian_reference)


def jvp_of_f(tangent):
    return jvp(f_of_x, (x,), (tangent,))[1]


columns = vmap(jvp_of_f)(torch.eye(num_inputs, device=device))  # column k is columns[k]
check_entries("vmap(jvp) cols", columns.T, jacobian_reference)

# %%
# Before ``torch.func``, the row-by-row recipe was a Python loop of backward passes, one per
# output, keeping the graph alive between them. It gives the same rows, one call at a time.
# ``torch.autograd.functional.jacobian(..., vectorize=True)`` batches those backward passes
# with ``vmap`` instead; it gives the same Jacobian (checked below), and its documentation
# recommends ``jacrev``/``jacfwd``.


def jacobian_row_by_row(weight, bias, x):
    x = x.detach().requires_grad_()
    y = layer(weight, bias, x)
    unit_vectors = torch.eye(y.numel(), device=y.device)
    return torch.stack(
        [torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in unit_vectors]
    )


check_entries("row by row", jacobian_row_by_row(weight, bias, x), jacobian_reference)
vectorized = torch.autograd.functional.jacobian(f_of_x, x, vectorize=True)
check_entries("vectorize=True", vectorized, jacobian_reference)

# %%
# Jacobians with respect to the parameters
# ----------------------------------------
# ``argnums`` also takes a tuple. With respect to the weight, the Jacobian has shape
# ``(outputs, *weight.shape)``: ``∂f_i/∂W_jk = (1 − f_i²) δ_ij x_k``; with respect to the bias,
# ``∂f_i/∂b_j = (1 − f_i²) δ_ij``. Each is checked against its own formula.
jacobian_weight, jacobian_bias = jacrev(layer, argnums=(0, 1))(weight, bias, x)
slope64 = 1 - layer(weight.double(), bias.double(), x.double()) ** 2
identity64 = torch.eye(num_outputs, device=device, dtype=torch.float64)
weight_reference = torch.einsum("i,ij,k->ijk", slope64, identity64, x.double())
check_entries("d f / d weight", jacobian_weight, weight_reference)
check_entries("d f / d bias", jacobian_bias, torch.diag(slope64))

# %%
# Hessians: a Jacobian of a Jacobian
# ----------------------------------
# Any pair of engines computes a Hessian. :func:`~torch.func.hessian` is
# ``jacfwd(jacrev(f))``, forward-over-reverse, the usual choice for a scalar loss, whose
# gradient is one reverse pass; for other functions the cheapest order is measured below. On a
# wider layer, 128 inputs to 32 outputs, we check all four orders against the exact Hessian
# ``∂²f_i/∂x_k∂x_l = −2 f_i (1 − f_i²) W_ik W_il``, a (32, 128, 128) tensor.
hess_weight = torch.randn(32, 128, device=device) / 128**0.5
hess_bias, hess_x = torch.randn(32, device=device), torch.randn(128, device=device)
w64 = hess_weight.double()
f64 = layer(w64, hess_bias.double(), hess_x.double())
hessian_reference = torch.einsum("i,ik,il->ikl", -2 * f64 * (1 - f64**2), w64, w64)
hessian_orders = {
    "hessian": hessian(layer, argnums=2),
    "jacfwd(jacfwd)": jacfwd(jacfwd(layer, argnums=2), argnums=2),
    "jacrev(jacrev)": jacrev(jacrev(layer, argnums=2), argnums=2),
    "jacrev(jacfwd)": jacrev(jacfwd(layer, argnums=2), argnums=2),
}
hessians = {o: fn(hess_weight, hess_bias, hess_x) for o, fn in hessian_orders.items()}
for order, result in hessians.items():
    check_entries(order, result, hessian_reference)

# %%
# The most common case is the Hessian of a scalar, such as a loss: here the sum of the outputs,
# whose (128, 128) Hessian is the sum of the per-output Hessians. ``jacrev`` takes
# ``chunk_size``, which computes the Jacobian that many rows at a time and bounds the memory of
# the batched call; the result is the same (``jacfwd`` has no such argument in this release).
scalar_hessian = hessian(lambda *args: layer(*args).sum(), argnums=2)
scalar = scalar_hessian(hess_weight, hess_bias, hess_x)
check_entries("scalar loss", scalar, hessian_reference.sum(dim=0))
chunked = jacrev(layer, argnums=2, chunk_size=5)(weight, bias, x)
check_entries("chunk_size=5", chunked, jacobian_reference)

# %%
# The entry-by-entry check sees one wrong entry: scaling only the largest entry of the Hessian
# by 1.01 fails it, however small the relative norm error stays.
tampered = hessians["hessian"].clone()
tampered[torch.unravel_index(hessian_reference.abs().argmax(), tampered.shape)] *= 1.01
norm_error = (tampered.double() - hessian_reference).norm() / hessian_reference.norm()
try:
    check_entries("tampered", tampered, hessian_reference)
    raise RuntimeError("a 1% change of one Hessian entry went unnoticed")
except AssertionError as caught:
    assert "Mismatched elements: 1 /" in str(caught), caught
print(f"one entry 1% off fails the check (relative norm error {norm_error:.1e})")

# %%
# How much work? Counting it
# --------------------------
# The mental model predicts the arithmetic: each vjp or jvp through the layer is one
# vector-matrix product with ``W``, ``2 · inputs · outputs`` FLOPs, so ``jacrev`` should cost in
# proportion to the outputs and ``jacfwd`` to the inputs, and a tall Jacobian should favour
# ``jacfwd``. We count the matrix-product FLOPs with ``torch.utils.flop_counter.FlopCounterMode``
# in that unit, on Jacobians that keep ``32 · 1024`` entries while their shape runs from wide
# (1024 inputs, 32 outputs) to tall (32 inputs, 1024 outputs). On a GPU both sides are scaled
# up by 4, yet its times can stay flat, set by a fixed cost per operation (Python, the
# dispatcher, a kernel launch) rather than by the products; the lines after the sweep say which.
scale = 1 if device.type == "cpu" else 4
tall_inputs, tall_outputs = 32 * scale, 1024 * scale
engines = {"jacrev": jacrev, "jacfwd": jacfwd}


def random_layer(inputs, outputs):
    return (
        torch.randn(outputs, inputs, device=device) / inputs**0.5,
        torch.randn(outputs, device=device),
        torch.randn(inputs, device=device),
    )


def matmul_flops(call):
    with FlopCounterMode(display=False) as flop_counter:
        call()
    return flop_counter.get_total_flops()


def products_through_weight(engine, args):
    """Matrix-product FLOPs of one Jacobian, in units of one vector through the weight."""
    outputs, inputs = args[0].shape
    flops = matmul_flops(partial(engine(layer, argnums=2), *args))
    return flops / (2 * inputs * outputs)


sweep_inputs = [tall_outputs // 2**step for step in range(6)]  # 1024, 512, ..., 32
sweep = [random_layer(n, tall_inputs * tall_outputs // n) for n in sweep_inputs]
aspect_ratios = [args[0].shape[0] / args[0].shape[1] for args in sweep]
counted = {
    name: [products_through_weight(engine, args) for args in sweep]
    for name, engine in engines.items()
}
for args, rev, fwd in zip(sweep, *counted.values()):
    outputs, inputs = args[0].shape
    print(
        f"{inputs:5d} in, {outputs:5d} out: products jacrev {rev:.0f}, jacfwd {fwd:.0f}"
    )
    # jacrev: one vjp per output row, plus one product, the forward pass. jacfwd: one jvp
    # per input column, plus two single-row products: the forward pass, and one whose other
    # operand is all zeros, the tangent of the weight, which is not differentiated but which
    # the matrix product's forward-mode rule multiplies by anyway (PyTorch issue #69687).
    assert rev == outputs + 1 and fwd == inputs + 2

# %%
# How fast is it?
# ---------------
# Some Hessians below allocate blocks of 64 MiB per call. On a CPU, glibc's ``malloc`` may by
# default map such blocks afresh on every call, and the kernel then faults their pages in each
# time; whether it does depends on what the process did before. So we ask glibc to keep freed
# memory for reuse: a fresh run of this page and a long site build then time the same thing.
# (:doc:`/reading-timings` explains more.) Times are medians of
# :class:`torch.utils.benchmark.Timer` blocks, with their interquartile range (IQR) and count.
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>
    assert ctypes.CDLL(None).mallopt(M_MMAP_MAX, 0) == 1  # large blocks from the heap
    assert ctypes.CDLL(None).mallopt(M_TRIM_THRESHOLD, -1) == 1  # never hand them back


def median_and_iqr_ms(call, min_run_time=0.3, min_blocks=5):
    threads = torch.get_num_threads()
    timer = benchmark.Timer("call()", globals={"call": call}, num_threads=threads)
    m = timer.blocked_autorange(min_run_time=min_run_time)
    extra = [timer.timeit(1) for _ in range(min_blocks - len(m.times))]  # slow calls
    m = benchmark.Measurement.merge([m, *extra])[0]
    return m.median * 1e3, m.iqr * 1e3, len(m.times)


def spread(iqr, blocks):
    return f"IQR {iqr:.3g} ms, {blocks} blocks"


# %%
# Tall, wide, and whether they cross
# ----------------------------------
# For each of the sweep's shapes, from wide to tall, both engines are checked against the
# formula and timed, and the ratio of their times set beside the ratio of their counted FLOPs.
timed = {name: [] for name in engines}
for args, rev, fwd in zip(sweep, *counted.values()):
    line = f"{args[0].shape[1]:5d} in, {args[0].shape[0]:5d} out:"
    for name, engine in engines.items():
        jacobian = engine(layer, argnums=2)(*args)
        check_entries(name, jacobian, exact_jacobian64(*args), quiet=True)
        timed[name].append(median_and_iqr_ms(partial(engine(layer, argnums=2), *args)))
        ms, iqr, blocks = timed[name][-1]
        line += f"  {name} {ms:7.2f} ms ({spread(iqr, blocks)})"
    time_ratio = timed["jacfwd"][-1][0] / timed["jacrev"][-1][0]
    print(f"{line}  jacfwd/jacrev: time {time_ratio:.3g}x, FLOPs {fwd / rev:.3g}x")

# %%
# Counted in FLOPs, the engines tie at a square Jacobian. For the time, we fit a straight line
# to ``log(time(jacfwd) / time(jacrev))`` against ``log(outputs / inputs)`` over the whole
# sweep, rather than look for a sign change between two neighbours, which noise could place
# anywhere, and take the shape where the line crosses 1, if it does inside the sweep. A slope
# near −1 means the time follows the FLOPs; a shallower one, that a cost which does not grow
# with the products weighs in (this page does not measure which); near 0, the engines' times
# keep one ratio whatever the shape, and need not cross at all.
log_aspect = torch.tensor(aspect_ratios, dtype=torch.float64).log()
log_time_ratio = torch.tensor(
    [fwd[0] / rev[0] for fwd, rev in zip(timed["jacfwd"], timed["jacrev"])],
    dtype=torch.float64,
).log()
design = torch.stack([log_aspect, torch.ones_like(log_aspect)], dim=1)
solution = torch.linalg.lstsq(design, log_time_ratio[:, None]).solution
fit_slope, fit_intercept = solution[:, 0]
print(f"slope of log(time ratio) against log(shape): {fit_slope:.2f} (FLOPs: -1)")
crossover = torch.exp(-fit_intercept / fit_slope).item() if fit_slope < 0 else None
if crossover is None or not min(aspect_ratios) <= crossover <= max(aspect_ratios):
    crossover = None
    print("the fitted line does not cross 1 inside the sweep")
else:
    print(f"the engines take the same time at about {crossover:.2g} outputs per input")
for name, counts in counted.items():  # from the widest shape to the tallest
    growth = counts[-1] / counts[0], timed[name][-1][0] / timed[name][0][0]
    print(f"{name}, wide to tall: products x{growth[0]:.3g}, time x{growth[1]:.3g}")

# %%
# On the left, the counted products; on the right, the measured times with their IQR, whose
# lines may cross more than once where noise is larger than the gap.
METHOD_COLORS = {
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
}
fig, (ax_flops, ax_time) = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
for name in engines:
    medians, iqrs, _ = zip(*timed[name])
    style = {"color": METHOD_COLORS[name], "label": name}
    ax_flops.plot(aspect_ratios, counted[name], "o-", **style)
    ax_time.errorbar(
        aspect_ratios, medians, yerr=[q / 2 for q in iqrs], fmt="o-", **style
    )
if crossover is not None:
    ax_time.axvline(crossover, color="black", linestyle="--", label="crossover (fit)")
for ax in (ax_flops, ax_time):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("Jacobian shape: outputs / inputs")
    ax.axvline(1, color="black", linewidth=0.8, linestyle=":")
    ax.legend()
ax_flops.set_ylabel("products through W (counted)")
ax_time.set_ylabel(f"median time (ms), {device.type.upper()}")
ax_flops.set_title("Arithmetic: rows vs columns")
ax_time.set_title("Time")
plt.show()

# %%
# Which order for a Hessian?
# --------------------------
# The four orders, timed on the 128 → 32 layer, beside two counts as multiples of ``hessian``'s:
# matrix-product FLOPs, and elements written (of every tensor each operation returns, added up
# by a ``TorchDispatchMode``; checked first: a (4, 5) by (5, 6) product writes 24 elements,
# ``tanh`` of it 24 more, and its transpose, a view, none).


class ElementsWritten(TorchDispatchMode):
    """Adds up the elements each operation writes: its outputs, less those that share an
    input's storage (views, ``_unsafe_view``, in place) or have none (zero tensors)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = {address for address, _ in storages(args, kwargs)} | {0}
        self.count += sum(n for address, n in storages(out) if address not in read)
        return out


def storages(*trees):
    """(storage address, elements) of each tensor; address 0 for a zero tensor."""
    return [(0 if t._is_zerotensor() else t.untyped_storage().data_ptr(), t.numel())
            for t in tree_leaves(trees) if isinstance(t, torch.Tensor)]  # fmt: skip


def elements_written(call):
    with ElementsWritten() as counter:
        call()
    return counter.count


known = torch.randn(4, 5, device=device), torch.randn(5, 6, device=device)
flat = lambda: torch.tanh(known[0] @ known[1]).T.flatten().reshape(6, 4)  # noqa: E731
assert elements_written(flat) == 24 + 24 + 24  # mm, tanh, flatten's copy; views count 0

hessian_flops, hessian_written, hessian_times, paces = {}, {}, {}, {}
for order, fn in hessian_orders.items():
    call = partial(fn, hess_weight, hess_bias, hess_x)
    hessian_flops[order] = matmul_flops(call)
    hessian_written[order] = elements_written(call)
    hessian_times[order] = median_and_iqr_ms(call, min_run_time=0.5)
for order, (ms, iqr, blocks) in hessian_times.items():
    r = ms / hessian_times["hessian"][0]  # the time ratio, worded by its size
    paces[order] = f"{1 / r:.2f}x faster" if r < 1 else f"{r:.2f}x the time"
    print(
        f"{order:>14}: {ms:8.2f} ms ({spread(iqr, blocks)}); against hessian: "
        f"{paces[order]}, "
        f"FLOPs {hessian_flops[order] / hessian_flops['hessian']:.2f}x, "
        f"elements written {hessian_written[order] / hessian_written['hessian']:.2f}x"
    )

# %%
# Picking each engine by the shape it differentiates gives ``hessian``'s order here (the layer
# is wide; its Jacobian, as a function of ``x``, is tall), yet ``jacfwd(jacfwd)`` counts a
# fraction of its FLOPs: the rule does not carry over to a composition. Reverse mode multiplies
# by ``W`` after ``tanh``'s derivative ``1 − f²``, which depends on ``x``, so ``hessian``'s outer
# pass pushes each of its 128 tangents through that product for each of the 32 rows: 4096
# vectors through ``W``. ``jacfwd(jacfwd)`` pushes its 128 tangents through ``W`` three times
# (one of them multiplies the weight's all-zero tangent). In one vector through ``W``:
unit = 2 * hess_weight.numel()
print({order: round(flops / unit) for order, flops in hessian_flops.items()})
# hessian: those 4096 and a few more; jacfwd(jacfwd): three 128-row products, four single rows.
assert hessian_flops["hessian"] >= 128 * 32 * unit
assert hessian_flops["jacfwd(jacfwd)"] == (3 * 128 + 4) * unit

# %%
# Are the orders ranked by time as by either count? The counts are exact; the time is this
# run's, and orders with close times can swap. The elements written include elementwise work
# and copies, which the FLOP counter leaves out. The bars have a logarithmic axis.
by_time = sorted(hessian_times, key=lambda order: hessian_times[order][0])
print("fastest to slowest:", ", ".join(by_time))
for what, counts in [("FLOPs", hessian_flops), ("elements written", hessian_written)]:
    by_count = sorted(counts, key=counts.get)
    same = "the same as the time's" if by_count == by_time else "not the time's"
    print(f"fewest to most {what}: {', '.join(by_count)}; {same}")
fig, ax = plt.subplots(figsize=(8, 2.8), layout="constrained")
time_ratios = [ms / hessian_times["hessian"][0] for ms, _, _ in hessian_times.values()]
# jacfwd(jacfwd) and jacrev(jacrev) take the colour of their single engine.
colors = [METHOD_COLORS[c] for c in ("hessian", "jacfwd", "jacrev", "jacrev(jacfwd)")]
bars = ax.barh(list(hessian_times), time_ratios, color=colors)
ax.bar_label(bars, padding=4, labels=[
    f"{paces[o]}, {hessian_flops[o] / hessian_flops['hessian']:.2f}x FLOPs, "
    f"{hessian_written[o] / hessian_written['hessian']:.2f}x written"
    for o in hessian_times])  # fmt: skip
ax.set_xscale("log")
ax.set_xlim(min(time_ratios) / 2, max(time_ratios) * 300)
ax.invert_yaxis()
ax.set_xlabel("median time, as a multiple of hessian's")
ax.set_title("Hessian of a 128 → 32 layer: (32, 128, 128) entries")
plt.show()

# %%
# What to remember
# ----------------
# * ``jacrev(f, argnums=i)`` and ``jacfwd(f, argnums=i)`` give the (outputs, inputs) Jacobian;
#   check it entry by entry (``torch.testing.assert_close``) against a float64 reference.
# * ``jacrev`` runs one vjp per output (row), ``jacfwd`` one jvp per input (column), batched by
#   ``vmap``: the counted FLOPs grow in step with outputs and inputs.
# * In FLOPs, tall Jacobians favour ``jacfwd``, wide ones ``jacrev``; the times may cross
#   elsewhere, or nowhere when a fixed cost per operation sets them: time your own shapes.
# * ``hessian`` is ``jacfwd(jacrev(f))``. All four orders agree entry by entry, but choosing
#   each engine by its own shape does not pick the cheapest composition (here ``jacfwd(jacfwd)``
#   counts fewer FLOPs), and FLOPs need not rank them as the time does: count and time the
#   orders on your own function.
