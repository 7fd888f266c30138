"""
Against a derivative you wrote by hand
======================================

When you can write a derivative down, the formula is usually faster than a transform: for the
sum of squares of each row, *f(x) = Σ x²*, the gradient is ``2 * x``, one multiplication,
while ``vmap(jacrev(f))`` runs the function forward and then backward. On this page you compute
each row's gradient both ways and check them against each other, see which operations the
transform runs (counted with a tool checked first), time the formula against the transform, one
backward over the whole batch, and a compiled transform, and use the transform for what it is
best at when a formula exists: testing the formula.
"""

# %%
# Setup
# -----
import time

import matplotlib.pyplot as plt
import torch
from torch.func import grad, jacrev, vmap
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# The recipe, checked
# -------------------
# Each row of a (4096, 4096) batch is one input, and *f* maps a row to the sum of its squares, so
# each row's Jacobian is a gradient of 4096 entries, ``2 x``. ``vmap(jacrev(f))`` computes all of
# them; for a function with one output, :func:`~torch.func.grad` gives the same numbers. The
# reference is the formula in float64.
rows = torch.rand(4096, 4096, device=device)


def sum_of_squares(row):
    return (row**2).sum(-1)


def hand_written_gradient(rows):
    return 2 * rows


per_row_jacobians = vmap(jacrev(sum_of_squares))(rows)
reference64 = hand_written_gradient(rows.double())
for label, got in [
    ("vmap(jacrev(f))", per_row_jacobians),
    ("vmap(grad(f))", vmap(grad(sum_of_squares))(rows)),
]:
    torch.testing.assert_close(got.double(), reference64, rtol=1e-7, atol=0)
    worst = (got.double() - reference64).abs().max().item()
    print(f"{label:16s} {tuple(got.shape)}  largest error {worst:.1e}")

# %%
# Both agree with the float64 formula to the last bit here: the transform's backward of
# ``row**2`` doubles each entry, and doubling a float32 is exact. The bound (a relative error
# of ``1e-7``, about one float32 rounding) fails for a gradient that is off by a factor, such as
# ``rows`` instead of ``2 * rows``.

# %%
# One backward for the whole batch
# --------------------------------
# Each row's output depends on that row alone, so the gradient of the *batch sum* of the outputs
# is every row's gradient at once: one forward and one backward over the whole batch, with no
# ``vmap``. The :doc:`batch Jacobians page <plot_batch_jacobians_hessians>` says when this
# trick is exact and shows where it fails (rows that interact, as in batch normalisation).


def batch_sum(rows):
    return sum_of_squares(rows).sum()


torch.testing.assert_close(
    grad(batch_sum)(rows).double(), reference64, rtol=1e-7, atol=0
)
print("grad of the batch sum: every row's gradient, checked")

# %%
# The transform checks the formula
# --------------------------------
# Formulas go wrong in ways that still run. Take the norm of each row, ``‖x‖``, whose gradient
# is ``x / ‖x‖``. A slip of the chain rule gives ``x / ‖x‖²``, with the right shape and the
# right direction. In float64, ``vmap(grad(...))`` is an independent reference for the formula:
# the right one agrees to rounding, the slip fails by far.


def row_norm(row):
    return (row**2).sum(-1).sqrt()


def norm_gradient(rows):
    return rows / rows.norm(dim=-1, keepdim=True)


def norm_gradient_slip(rows):
    return rows / (rows**2).sum(-1, keepdim=True)


rows64 = rows[:64].double()
by_transform64 = vmap(grad(row_norm))(rows64)
torch.testing.assert_close(norm_gradient(rows64), by_transform64, rtol=1e-14, atol=0)
right_error = (norm_gradient(rows64) - by_transform64).abs().max().item()
slip = norm_gradient_slip(rows64)
slip_error = ((slip - by_transform64).norm() / by_transform64.norm()).item()
print(f"right formula: largest error {right_error:.1e}")
print(f"the slip: relative error {slip_error:.2f}")
assert slip_error > 0.1

# %%
# What the transform runs
# -----------------------
# The formula is one multiplication. To see what the transform runs instead, a
# ``TorchDispatchMode`` lists the ATen operations that reach the kernels. Two traps: views
# (``expand``, ``view``) are listed but launch nothing, so they are left out; and a dispatch
# mode turns ``torch.compile`` off, so nothing compiled is counted. The tool is checked first on
# cases whose answer is known: the formula, one ``mul`` over the whole batch; and a function
# with views, an in-place ``add_`` and a ``sum`` per row, where only the views are left out
# and only the ``sum`` is not full-size.


class OperationLog(TorchDispatchMode):
    """The ATen operations that ran, each with whether its output is as large as the batch."""

    def __init__(self, batch_numel):
        super().__init__()
        self.batch_numel, self.ran = batch_numel, []

    def __torch_dispatch__(self, overload, types, args=(), kwargs=None):
        out = overload(*args, **(kwargs or {}))
        if not overload.is_view:  # views launch nothing
            full = isinstance(out, torch.Tensor) and out.numel() == self.batch_numel
            self.ran.append((overload.overloadpacket.__name__, full))
        return out


def operations(fn, rows):
    with OperationLog(rows.numel()) as log:
        fn(rows)
    return log.ran


def known_case(rows):
    doubled = rows.mul(2)
    doubled.view(-1).add_(1)  # a view, then an in-place add through it
    return doubled.t(), rows.sum(-1)  # a view, and one number per row


assert operations(hand_written_gradient, rows) == [("mul", True)]
known_answer = [("mul", True), ("add_", True), ("sum", False)]
assert operations(known_case, rows) == known_answer
# Under vmap it sees the batched operation, one mul over the whole batch, not one per row.
assert operations(vmap(hand_written_gradient), rows) == [("mul", True)]
routes = {
    "vmap(jacrev(f))": vmap(jacrev(sum_of_squares)),
    "vmap(grad(f))": vmap(grad(sum_of_squares)),
    "grad(batch sum)": grad(batch_sum),
}
for label, fn in routes.items():
    ran = operations(fn, rows)
    names = ", ".join(name + ("*" if full else "") for name, full in ran)
    print(
        f"{label:16s} {sum(full for _, full in ran)} full-size of {len(ran)}: {names}"
    )

# %%
# A star marks an operation whose output is as large as the batch; the others make one number
# per row or less. Each transform runs the forward ``pow`` (the squares, which the gradient does
# not need), then a backward that writes several more batch-sized tensors (its ``pow`` is the
# ``x¹`` in the derivative of ``x²``); the formula writes one.

# %%
# How fast is each route?
# -----------------------
# Each time is the median of :class:`torch.utils.benchmark.Timer` blocks in this run, after a
# warm-up call, with its interquartile range (IQR). The compiled transform is compiled by its
# first call, timed apart, and counted: one graph, so the timed calls ran compiled code. The
# question (pytorch/pytorch#105220, on a 10000 × 10000 batch) timed one call of each with
# ``time.time()``; here each route gets an untimed call first, then at least seven timed
# blocks, and the table gives their median.
compiled_grad = torch.compile(vmap(grad(sum_of_squares)))
torch._dynamo.utils.counters.clear()
started = time.perf_counter()
compiled_grad(rows)[0, 0].item()  # .item() waits until the device has finished
first_call = time.perf_counter() - started
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
assert graphs == 1, graphs
print(
    f"compiling vmap(grad(f)): first call {first_call:.1f} s, measured once; {graphs} graph"
)
torch.testing.assert_close(compiled_grad(rows).double(), reference64, rtol=1e-7, atol=0)

timed = {
    "2 * rows": hand_written_gradient,
    **routes,
    "compiled vmap(grad)": compiled_grad,
}
measured = {}
threads_here = torch.get_num_threads()
for label, fn in timed.items():
    scope = {"fn": fn, "rows": rows}
    stopwatch = benchmark.Timer("fn(rows)", globals=scope, num_threads=threads_here)
    stopwatch.timeit(1)  # one call first, untimed
    m = stopwatch.blocked_autorange(min_run_time=0.3)
    extra = [stopwatch.timeit(1) for _ in range(7 - len(m.times))]  # at least 7 blocks
    measured[label] = benchmark.Measurement.merge([m, *extra])[0]
assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile
formula_time = measured["2 * rows"].median
for label, m in measured.items():
    line = f"{label:20s} {m.median * 1e3:7.2f} ms (IQR {m.iqr * 1e3:.2g} ms, "
    line += f"{len(m.times)} blocks)"
    if label != "2 * rows":
        line += f"  takes {m.median / formula_time:.1f}x the time of the formula"
    print(line)

# %%
# Compare each ratio with the transform's count of full-size operations above. Where they are
# close, the time probably goes into writing batch-sized tensors, not into the transform's own
# bookkeeping (the page did not measure memory traffic). The compiled transform's time is
# printed beside the formula's; how close it comes depends on the device, which the run prints.
METHOD_COLORS = {
    "hand-written": "#999933", "jacrev": "#0072B2", "vmap": "#009E73",
    "sum trick": "#CC79A7", "compiled": "#117733",
}  # fmt: skip
colours = {
    "2 * rows": METHOD_COLORS["hand-written"],
    "vmap(jacrev(f))": METHOD_COLORS["jacrev"],
    "vmap(grad(f))": METHOD_COLORS["vmap"],
    "grad(batch sum)": METHOD_COLORS["sum trick"],
    "compiled vmap(grad)": METHOD_COLORS["compiled"],
}
fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
medians = [m.median * 1e3 for m in measured.values()]
bars = ax.barh(
    list(measured),
    medians,
    xerr=[m.iqr * 1e3 / 2 for m in measured.values()],
    color=[colours[label] for label in measured],
    ecolor="black",
)
ax.bar_label(bars, labels=[f"{ms:.1f} ms" for ms in medians], padding=3)
ax.invert_yaxis()
ax.set_xlim(0, max(medians) * 1.3)
ax.set_xlabel("median time per call (ms); whiskers: IQR, centred")
ax.set_title(f"Gradients of 4096 rows of 4096 on {device.type.upper()}")
plt.show()

# %%
# And the Hessian?
# ----------------
# The Hessian of one row's sum of squares is ``2 I``. ``vmap(hessian(f))`` builds it as a dense
# (n, n) matrix per row, so its size grows with the square of the row length: fine for short
# rows, hopeless for long ones. For 4096 rows of 4096 it would hold the number of bytes printed
# below. When the Hessian is known to be diagonal, as here, one Hessian-vector product with a
# vector of ones gives its diagonal; the :doc:`diagonals page <plot_diagonals_and_higher_orders>`
# gives the general recipes.
from torch.func import hessian, jvp  # noqa: E402

dense_bytes = rows.shape[0] * rows.shape[1] ** 2 * rows.element_size()
print(f"vmap(hessian) for all 4096 rows: {dense_bytes / 2**30:.0f} GiB")
short_rows = rows[:8, :5]
torch.testing.assert_close(
    vmap(hessian(sum_of_squares))(short_rows),
    2 * torch.eye(5, device=device).expand(8, 5, 5),
    rtol=0,
    atol=1e-6,
)


def hessian_diagonal_when_diagonal(rows):
    ones = torch.ones_like(rows)
    return jvp(vmap(grad(sum_of_squares)), (rows,), (ones,))[1]


torch.testing.assert_close(
    hessian_diagonal_when_diagonal(rows), torch.full_like(rows, 2.0), rtol=0, atol=1e-6
)
print(
    "per-row Hessians 2I (8 rows of 5) and the diagonal of all rows by one jvp: checked"
)

# %%
# What to remember
# ----------------
# * A reverse-mode transform (``grad``, ``jacrev``) runs your function forward and then its
#   backward, operation by operation; a formula you wrote runs only what the derivative
#   needs. When the formula is short, it is usually faster.
# * Use the transform to test the formula: ``vmap(grad(f))`` in float64 against your
#   ``df``, entry by entry. A slip of the chain rule keeps the shape and fails the check.
# * For a batch of rows that do not interact, ``grad`` of the batch sum gives every row's
#   gradient in one backward, without ``vmap``.
# * A compiled transform can come close to the formula (compare the two in the run above);
#   time it after its first call, which compiles.
# * Before asking for a per-row Hessian, check its size: a diagonal one needs one ``jvp``.
