"""
Batch Jacobians and Hessians
============================

Models run on batches, and often you want one Jacobian *per sample*: the derivative of each
sample's output with respect to that sample's input, for example to inspect how sensitive a
model is at each point of a batch. On this page you compute a batch of Jacobians and a batch of
Hessians with ``vmap``, check them against the formula, learn the older "sum over the batch"
trick and the exact condition under which it is valid, see a function for which both the trick
and a careless ``vmap`` silently return the wrong answer, and then time ``vmap``, the trick and
a Python loop.
"""

# %%
# Setup
# -----
# Matrix products run in full float32 precision (no TF32 on GPUs), so the checks below measure
# float32 rounding and nothing else.
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.set_float32_matmul_precision("highest")  # no TF32 on GPUs: checks see float32

# %%
# A batch and a layer
# -------------------
# 64 inputs of 31 features go through *f(x) = tanh(W x + b)* to 33 outputs. The sizes differ on
# purpose: in a (64, 33, 31) result every axis has its own length, so a transposed axis cannot
# hide. For one sample, ``∂f_i/∂x_k = (1 − f_i²) W_ik``; broadcast over the batch in float64,
# that formula is the reference for the whole batch.
batch_size, num_inputs, num_outputs = 64, 31, 33
weight = torch.randn(num_outputs, num_inputs, device=device) / num_inputs**0.5
bias = torch.randn(num_outputs, device=device)
inputs = torch.randn(batch_size, num_inputs, device=device)
weight64, bias64, inputs64 = weight.double(), bias.double(), inputs.double()


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


outputs64 = layer(weight64, bias64, inputs64)
reference_jacobians = (1 - outputs64**2)[:, :, None] * weight64

# %%
# Each result is compared with its reference entry by entry (``|error| ≤ atol + rtol·|ref|``
# for every entry), so one wrong entry is enough to fail. The tolerances sit within about 100x
# of float32 rounding, and each check prints its largest error.


def assert_entrywise(label, got, want64, rtol=1e-5, atol=1e-6):
    """Every entry of a float32 result within atol + rtol·|want| of its float64 value."""
    torch.testing.assert_close(got.double(), want64, rtol=rtol, atol=atol)
    worst = (got.double() - want64).abs().max().item()
    print(
        f"{label}: {tuple(got.shape)}, largest entry error {worst:.1e} (atol {atol:.0e})"
    )


# %%
# The recipe: ``vmap(jacrev(...))``
# ---------------------------------
# The mental model: ``vmap(f)(x)`` equals stacking ``f(x_b)`` over ``x.unbind(0)``. So write the
# Jacobian of *one* sample with :func:`~torch.func.jacrev` (``argnums=2`` picks ``x``), and map
# it over the batch with :func:`~torch.func.vmap`: ``in_dims=(None, None, 0)`` shares the weight
# and bias and maps over the first axis of the inputs. The result has the batch axis first,
# then the output axis, then the input axis.
batch_jacobian = vmap(jacrev(layer, argnums=2), in_dims=(None, None, 0))
vmap_jacobians = batch_jacobian(weight, bias, inputs)
assert_entrywise("vmap(jacrev)", vmap_jacobians, reference_jacobians)

# %%
# Each sample's Jacobian here is nearly square (33 outputs, 31 inputs), so forward mode is a
# fair alternative: :func:`~torch.func.jacfwd` pushes 31 tangents where ``jacrev`` pulls 33
# cotangents. It maps over the batch the same way; the timings below include it.
batch_jacobian_fwd = vmap(jacfwd(layer, argnums=2), in_dims=(None, None, 0))
assert_entrywise(
    "vmap(jacfwd)", batch_jacobian_fwd(weight, bias, inputs), reference_jacobians
)

# %%
# The sum-over-batch trick
# ------------------------
# Before ``vmap``, a common shortcut was to differentiate the *sum over the batch* of the
# outputs. That function maps the whole (64, 31) batch to 33 numbers, so ``jacrev`` gives a
# (33, 64, 31) tensor; moving the batch axis to the front gives (64, 33, 31). Entry
# ``(b, i, k)`` of it is ``Σ_c ∂f_i(x_c)/∂x_bk``: the sample's own term (``c = b``) plus the
# cross-sample terms (``c ≠ b``). The trick is exact precisely when the cross-sample terms sum
# to zero, which holds when each output depends on its own sample alone, as here.


def sum_trick_jacobians(fn, weight, bias, inputs):
    summed = jacrev(lambda batch: fn(weight, bias, batch).sum(dim=0))(inputs)
    return summed.movedim(1, 0)


trick_jacobians = sum_trick_jacobians(layer, weight, bias, inputs)
assert_entrywise("sum trick", trick_jacobians, reference_jacobians)

# %%
# Where the trick silently fails
# ------------------------------
# Now make the samples interact: centre the batch (subtract its mean) before the layer, as
# batch normalisation does. With ``f_c = tanh(W (x_c − x̄) + b)`` and ``x̄`` the batch mean,
#
# .. code-block:: text
#
#    ∂f_c/∂x_b = diag(1 − f_c²) W (δ_bc − 1/B)
#
# so each sample's own block is ``diag(1 − f_b²) W (1 − 1/B)``, and the trick, which sums over
# ``c``, returns ``diag((1 − f_b²) − mean_c(1 − f_c²)) W`` instead. Both formulas are checked
# below; the trick runs without complaint, returns the right shape, and is wrong.


def centred_layer(weight, bias, batch):
    return layer(weight, bias, batch - batch.mean(dim=0))


slopes64 = 1 - centred_layer(weight64, bias64, inputs64) ** 2  # (B, outputs): 1 − f_c²
true_blocks = slopes64[:, :, None] * weight64 * (1 - 1 / batch_size)
trick_formula = (slopes64 - slopes64.mean(dim=0))[:, :, None] * weight64
wrong_blocks = sum_trick_jacobians(centred_layer, weight, bias, inputs)
assert_entrywise("sum trick, centred batch", wrong_blocks, trick_formula)
trick_error = ((wrong_blocks.double() - true_blocks).norm() / true_blocks.norm()).item()
print(f"the trick's relative error against the true blocks: {trick_error:.2f}")
assert trick_error > 0.1

# %%
# Why the cross terms add up
# --------------------------
# The full Jacobian of the centred batch function, computed by autograd in float64, holds
# every term ``∂f_c/∂x_b``: its diagonal blocks must match the true blocks above, and its
# off-diagonal blocks are the cross terms. For ``c ≠ b`` the formula gives
# ``−(1 − f_ic²) W_ik / B``: the multiplier changes with the sample ``c`` and the row ``i``,
# but for each entry ``(i, k)`` every term has the sign of ``−W_ik``. Terms that share their
# sign entry by entry cannot cancel: the size of their sum equals the sum of their sizes. We
# check that on the measured terms, and that their sum is exactly the trick's error.
full_jacobian = jacrev(centred_layer, argnums=2)(weight64, bias64, inputs64)
by_sample = full_jacobian.permute(2, 0, 1, 3)  # (b, c, i, k): ∂f_i(x_c) / ∂x_bk
samples = torch.arange(batch_size, device=device)
torch.testing.assert_close(by_sample[samples, samples], true_blocks)
cross_terms = by_sample.clone()
cross_terms[samples, samples] = 0  # keep c ≠ b
cross_sum = cross_terms.sum(dim=1)
sum_of_sizes = cross_terms.abs().sum(dim=1)
torch.testing.assert_close(cross_sum.abs(), sum_of_sizes)  # fails if any pair cancels
kept = (cross_sum.abs() / sum_of_sizes)[sum_of_sizes > 0].min().item()
print(f"smallest |sum of cross terms| / (sum of their sizes), over entries: {kept:.6f}")
assert_entrywise("trick's error", wrong_blocks.double() - true_blocks, cross_sum)

# %%
# ``vmap`` does not give the true blocks either, and it does not complain. Under ``vmap`` the
# function sees one sample of shape (31,), so ``batch.mean(dim=0)`` averages that sample's 31
# *features*: a different function, ``g(x) = tanh(W (x − mean(x)·1) + b)``, whose Jacobian is
# ``diag(1 − g²) W (I − 11ᵀ/31)``. ``W (I − 11ᵀ/31)`` is ``W`` minus the mean of each of its
# rows, and that closed form is the reference.
vmap_centred = vmap(jacrev(centred_layer, argnums=2), in_dims=(None, None, 0))(
    weight, bias, inputs
)
feature_centred64 = layer(
    weight64, bias64, inputs64 - inputs64.mean(dim=1, keepdim=True)
)
row_centred_weight64 = weight64 - weight64.mean(dim=1, keepdim=True)
feature_reference = (1 - feature_centred64**2)[:, :, None] * row_centred_weight64
assert_entrywise("vmap on the centred batch", vmap_centred, feature_reference)
vmap_error = ((vmap_centred.double() - true_blocks).norm() / true_blocks.norm()).item()
print(f"vmap(jacrev)'s relative error against the true blocks: {vmap_error:.2f}")
assert vmap_error > 0.1

# %%
# The lesson: inside ``vmap``, a reduction over "dimension 0" reduces over the sample's own
# first axis, silently. A function that couples samples has no per-sample Jacobian that a
# per-sample transform can see; take the diagonal blocks of the full Jacobian, as above (B²
# blocks, of which only B are kept). With batch normalisation, the usual way out is to evaluate
# with frozen statistics (``model.eval()``): each output then depends on its own sample alone,
# and ``vmap`` gives the exact Jacobian of that function, ``diag(1 − f_b²) W``, checked here
# with the batch mean held fixed.
frozen_mean = inputs.mean(dim=0)  # computed once, then a constant, as in eval mode


def frozen_layer(weight, bias, x):
    return layer(weight, bias, x - frozen_mean)


frozen = vmap(jacrev(frozen_layer, argnums=2), in_dims=(None, None, 0))
frozen_slopes64 = 1 - layer(weight64, bias64, inputs64 - inputs64.mean(dim=0)) ** 2
frozen_reference = frozen_slopes64[:, :, None] * weight64
assert_entrywise("vmap, frozen mean", frozen(weight, bias, inputs), frozen_reference)

# %%
# Batch Hessians
# --------------
# The same pattern gives one Hessian per sample: ``vmap`` over :func:`~torch.func.hessian`.
# Each sample's Hessian of its 33 outputs with respect to its 31 inputs has shape (33, 31, 31),
# so the batch is (64, 33, 31, 31). The exact per-sample Hessian,
# ``−2 f_i (1 − f_i²) W_ik W_il``, evaluated in float64, is the reference.
batch_hessian = vmap(hessian(layer, argnums=2), in_dims=(None, None, 0))
vmap_hessians = batch_hessian(weight, bias, inputs)
reference_hessians = torch.einsum(
    "bi,ik,il->bikl", -2 * outputs64 * (1 - outputs64**2), weight64, weight64
)
assert_entrywise("vmap(hessian)", vmap_hessians, reference_hessians)

# %%
# How fast is it?
# ---------------
# The baseline is a Python loop that calls ``jacrev`` (or ``hessian``) once per sample and
# stacks the results. Both loops are checked against the references first. Each time is the
# median of :class:`torch.utils.benchmark.Timer` blocks in this run, with its interquartile
# range (IQR) and the number of blocks.


def loop_jacobians(weight, bias, inputs):
    return torch.stack([jacrev(layer, argnums=2)(weight, bias, x) for x in inputs])


def loop_hessians(weight, bias, inputs):
    return torch.stack([hessian(layer, argnums=2)(weight, bias, x) for x in inputs])


assert_entrywise(
    "loop of jacrev", loop_jacobians(weight, bias, inputs), reference_jacobians
)
assert_entrywise(
    "loop of hessian", loop_hessians(weight, bias, inputs), reference_hessians
)

timed_calls = {
    "Jacobians": {
        "loop": lambda: loop_jacobians(weight, bias, inputs),
        "sum trick": lambda: sum_trick_jacobians(layer, weight, bias, inputs),
        "vmap(jacrev)": lambda: batch_jacobian(weight, bias, inputs),
        "vmap(jacfwd)": lambda: batch_jacobian_fwd(weight, bias, inputs),
    },
    "Hessians": {
        "loop": lambda: loop_hessians(weight, bias, inputs),
        "vmap": lambda: batch_hessian(weight, bias, inputs),
    },
}
measured = {what: {} for what in timed_calls}
n_threads = torch.get_num_threads()
for what, calls in timed_calls.items():
    for method, call in calls.items():
        timer = benchmark.Timer("run()", globals={"run": call}, num_threads=n_threads)
        m = timer.blocked_autorange(min_run_time=0.3)
        extra = [timer.timeit(1) for _ in range(5 - len(m.times))]  # slow calls
        m = measured[what][method] = benchmark.Measurement.merge([m, *extra])[0]
        line = f"{what:9s} {method:12s} {m.median * 1e3:7.2f} ms "
        line += f"(IQR {m.iqr * 1e3:.3g} ms, {len(m.times)} blocks)"
        loop_time = measured[what]["loop"].median
        if method != "loop" and m.median <= loop_time:
            line += f"  {loop_time / m.median:.2f}x faster than the loop"
        elif method != "loop":
            line += f"  takes {m.median / loop_time:.2f}x the time of the loop"
        print(line)
forward, reverse = (
    measured["Jacobians"][f"vmap({m})"].median for m in ("jacfwd", "jacrev")
)
if forward >= reverse:
    print(f"vmap(jacfwd) takes {forward / reverse:.2f}x the time of vmap(jacrev)")
else:
    print(f"vmap(jacfwd) is {reverse / forward:.2f}x faster than vmap(jacrev)")

# %%
# The time axis is logarithmic, so that a bar ten times shorter is clearly visible; the black
# whiskers are as long as each interquartile range, centred on the median.
METHOD_COLORS = {
    "loop": "#D55E00",
    "sum trick": "#CC79A7",
    "vmap": "#009E73",
    "jacfwd": "#E69F00",
}
bar_colour = {**METHOD_COLORS, "vmap(jacrev)": METHOD_COLORS["vmap"]}
bar_colour["vmap(jacfwd)"] = METHOD_COLORS["jacfwd"]
fig, axes = plt.subplots(1, 2, figsize=(8, 3), layout="constrained")
for ax, (what, by_method) in zip(axes, measured.items()):
    medians = [m.median * 1e3 for m in by_method.values()]
    bars = ax.bar(
        list(by_method),
        medians,
        yerr=[m.iqr * 1e3 / 2 for m in by_method.values()],
        color=[bar_colour[method] for method in by_method],
        ecolor="black",
    )
    ax.bar_label(bars, labels=[f"{ms:.2f}" for ms in medians], padding=2)
    ax.set_yscale("log")
    ax.set_ylim(min(medians) / 2, max(medians) * 3)
    ax.set_ylabel("median time (ms)")
    ax.set_title(f"{batch_size} {what}")
fig.suptitle(f"Batch derivatives on {device.type.upper()}: a Python loop vs one call")
plt.show()

# %%
# What to remember
# ----------------
# * ``vmap(jacrev(f, argnums=...), in_dims=(None, ..., 0))`` gives a (batch, outputs, inputs)
#   tensor (``jacfwd`` maps the same way), and ``vmap(hessian(...))`` a (batch, outputs,
#   inputs, inputs) one.
# * The sum-over-batch trick is exact when the cross-sample terms sum to zero, as when each
#   output depends on its own sample alone. When samples interact through the batch mean,
#   the cross terms share their sign and add up: a plausible tensor that is wrong. Through
#   other batch statistics (batch norm's variance) they need not share a sign, and the trick
#   is wrong all the same.
# * Inside ``vmap``, a reduction over dimension 0 reduces over the sample's own first axis,
#   with no error; check such functions against a closed form or the full Jacobian.
