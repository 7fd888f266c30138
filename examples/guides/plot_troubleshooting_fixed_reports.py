"""
Troubleshooting, part 13: reported bugs that torch 2.13 no longer has
=====================================================================

Four reports of wrong numbers or errors from ``torch.func`` that torch 2.13 does not reproduce:
zeros from ``grad``, ``vjp`` and ``jvp`` under ``torch.inference_mode()`` (``linearize`` still
gives them); half the gradient from ``torch.compile`` around ``grad`` with ``+=``; "Dimension out
of range" from ``jacrev`` or ``jacfwd`` at a 0-d input; ``vmap`` over ``torch.linspace``. Also two
performance warnings (``where``, ``scatter_reduce``) that 2.13 no longer gives.
Each section re-runs code like the reporter's against a closed form or a loop, and checks a
workaround on 2.13 (the inference-mode ones for ``grad``, ``vjp`` and ``jvp`` also on 2.11, which
has that bug). Then a check to run on your release. Part 1: :doc:`plot_troubleshooting`; other
old threads: :doc:`plot_troubleshooting_escaped_tensors` ("(Older releases)").
"""

import textwrap
import warnings
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import grad, jacfwd, jacrev, jvp, linearize, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
F64 = {"dtype": torch.float64, "device": device}
measured = {}  # label: (error, bound), for the figure at the end


def gap_to(label, got, want, bound):
    """Asserts got matches want (shape, then largest gap / largest entry); prints both."""
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)}, {want.shape}"
    scale = want.abs().max().clamp_min(1e-300)
    gap = ((got.double() - want.double()).abs().max() / scale).item()
    print(f"  {label}: error {gap:.1e} (bound {bound:.0e})")
    assert gap <= bound, f"{label}: error {gap:.1e} above {bound:.0e}"
    measured[label] = gap, bound


def fails_with(kind, words, call):
    """call() raises exactly kind, with words in its message; the error is returned."""
    try:
        call()
    except kind as err:  # another type fails the run
        message = " ".join(str(err).split())
        assert type(err) is kind and words in message, f"not {kind.__name__}: {message}"
        print(f"  {kind.__name__}: {textwrap.shorten(message, 96)}")
        return err
    raise AssertionError(f"torch {torch.__version__}: no {kind.__name__} raised")


# %%
# (No error) grad, vjp and jvp inside torch.inference_mode() return zeros
# ------------------------------------------------------------------------
# pytorch#177318 (2026): under ``torch.inference_mode()``, ``jvp`` of ``x**2`` returned a tangent
# of zeros, and ``grad`` and ``vjp`` zeros too, with no error. The thread's account: the
# transforms turn grad mode on, but inference mode also removes autograd's dispatch keys. With
# torch 2.11.0 (one run, an NVIDIA H100 machine, CUDA and CPU) the bug was there: inference mode
# on inside, wrong derivatives, ``still_there`` printing "wrong values". On 2.13 the transformed
# function runs with inference mode off (asserted, with ``torch.is_inference_mode_enabled()``),
# and vjp's backward, which runs later, leaves it through ``_disable_inference_mode``, named in
# PR #177596, which says it fixes the issue. Here: the three in the block, on an input made
# before it and on one made in it (an inference tensor), against ``2 x``.
square = lambda x: x**2  # noqa: E731
square_sum = lambda x: square(x).sum()  # noqa: E731
x = torch.tensor([1.0, -2.0, 3.0], **F64)
v = torch.tensor([0.5, 1.0, -1.0], **F64)  # a tangent; also the cotangent for vjp
modes_seen = []  # inference mode, as the transformed function sees it


def square_sum_noting(x):
    modes_seen.append(torch.is_inference_mode_enabled())
    return square_sum(x)


def three_derivatives(at):  # grad, the jvp tangent and the vjp, each of x**2
    _, tangent = jvp(square, (at,), (v,))
    _, pull = vjp(square, at)
    return {"grad": grad(square_sum)(at), "jvp": tangent, "vjp": pull(v)[0]}


closed = {"grad": 2 * x, "jvp": 2 * x * v, "vjp": 2 * x * v}
with torch.inference_mode():
    made_inside = x.clone()  # an inference tensor
    in_block = {
        "before": three_derivatives(x),
        "inside": three_derivatives(made_inside),
    }
    grad(square_sum_noting)(x), jvp(square_sum_noting, (x,), (v,))
    print(
        f"  in the block: {torch.is_inference_mode_enabled()}; under grad, jvp: {modes_seen}"
    )
assert made_inside.is_inference() and modes_seen == [False, False], (
    f"inference mode seen inside grad, jvp: {modes_seen}: this torch has pytorch#177318"
)
for where, results in in_block.items():
    for name, got in results.items():
        gap_to(f"inference_mode, {name}, input made {where}", got, closed[name], 1e-15)

# %%
# The fix covers ``grad``, ``vjp`` and ``jvp`` (and ``jacrev``, ``jacfwd``, ``hessian``, built on
# them), not ``torch.func.linearize``: its ``jvp_fn`` made in the block returns zeros on 2.13,
# even when called after the block (asserted). Nor ``torch.autograd.functional.jacobian``: zeros
# in the block, silently (pytorch#128264, open when read; asserted). Three workarounds for a
# release with the bug, checked here with ``torch.func`` (the second with ``jacobian`` and
# ``linearize`` too):
# ``torch.no_grad()`` instead (the transforms turn grad mode back on, as the thread says they did
# already); ``torch.inference_mode(False)`` around the derivative with cloned inputs (a clone made
# there is an ordinary tensor, asserted, where an inference tensor may be refused: "Inference
# tensors cannot be saved for backward", :doc:`plot_troubleshooting_custom_and_compiled`); or the
# derivative after the block.
with torch.inference_mode():
    old_api = torch.autograd.functional.jacobian(square, x)
    _, pushed = linearize(square, x)  # its jvp_fn
print("  autograd.functional.jacobian in the block: all zeros:", not old_api.any())
print(
    "  linearize's jvp_fn, made in the block, called after: all zeros:",
    not pushed(v).any(),
)
assert not old_api.any() and not pushed(v).any()
diagonal = torch.diag(2 * x)  # the Jacobian of x**2
with torch.inference_mode():
    values = square(made_inside)  # the evaluation the block is for
    with torch.inference_mode(False):
        fresh = made_inside.clone()
        assert not fresh.is_inference()
        workaround = {"inference_mode(False)": three_derivatives(fresh)}
        jacobian_inside = torch.autograd.functional.jacobian(square, fresh)
        pushed_inside = linearize(square, fresh)[1]
workaround["no_grad"] = torch.no_grad()(three_derivatives)(x)  # as a decorator
workaround["after the block"] = three_derivatives(made_inside.clone())
for how, results in workaround.items():
    for name, got in results.items():
        gap_to(f"{how}, {name}", got, closed[name], 1e-15)
gap_to(
    "inference_mode(False), autograd.functional.jacobian",
    jacobian_inside,
    diagonal,
    1e-15,
)
gap_to("inference_mode(False), linearize", pushed_inside(v), 2 * x * v, 1e-15)
gap_to("the block's own values", values, x * x, 1e-15)


# %%
# (No error) torch.compile of a function calling torch.func.grad: ±1 where eager gives ±2
# ---------------------------------------------------------------------------------------
# pytorch#136662 (2024): a gradient differed between eager and ``torch.compile(backend="inductor",
# fullgraph=True)``; a maintainer reduced it to two ``y[:, 0] += x[:, 2].abs()`` into
# ``torch.zeros_like(x)``, then ``grad`` of ``y.sum()``, compiled: ±1 in column 2 where eager gave
# ±2. The thread was open when read, names no fix, and its releases I could not run. On 2.13 the
# same code compiled with inductor, the reporter's backend, gives eager's values and the closed
# form, ``2 sign(x)`` in column 2 and zeros elsewhere. A counter asserts that one graph was
# compiled and run.
def twice_in_place(x):  # the thread's function, reduced
    y = torch.zeros_like(x)
    y[:, 0] += x[:, 2].abs()
    y[:, 0] += x[:, 2].abs()
    return y.sum()


points = torch.randn(4, 3, **F64)
signs = torch.zeros_like(points)
signs[:, 2] = 2 * points[:, 2].sign()  # the closed form: d/dx of 2 |x| in column 2
counter = CompileCounterWithBackend("inductor")
compiled = torch.compile(
    lambda t: grad(twice_in_place)(t), backend=counter, fullgraph=True
)
from_compiled = compiled(points)
print(
    f"  graphs compiled: {counter.frame_count}; column 2: {from_compiled[:, 2].tolist()}"
)
assert counter.frame_count == 1
gap_to("eager grad", grad(twice_in_place)(points), signs, 0.0)
gap_to("compiled grad (inductor)", from_compiled, signs, 0.0)


# %%
# The workaround for a release that still halves it: accumulate out of place.
# ``y.select_scatter(column, 1, 0)`` returns a new tensor with ``column`` as column 0, where
# ``y[:, 0] += ...`` wrote into ``y``. Checked in eager and compiled. To test your own code:
# compare the compiled call with eager on one input, and the ``aot_eager`` backend with
# ``inductor``, which tells whether a gap comes from inductor's kernels or from the steps before.
def twice_out_of_place(x):
    y = torch.zeros_like(x)
    y = y.select_scatter(y[:, 0] + x[:, 2].abs(), 1, 0)
    y = y.select_scatter(y[:, 0] + x[:, 2].abs(), 1, 0)
    return y.sum()


rewritten = torch.compile(lambda t: grad(twice_out_of_place)(t), backend="inductor")
gap_to("out of place, eager", grad(twice_out_of_place)(points), signs, 0.0)
gap_to("out of place, compiled (inductor)", rewritten(points), signs, 0.0)

# %%
# Dimension out of range (expected to be in range of [-1, 0], but got 1): a 0-d input
# ------------------------------------------------------------------------------------
# An ``IndexError`` from ``jacrev`` or ``jacfwd`` of ``torch.roll`` at a 0-d input, where
# ``torch.autograd.functional.jacobian`` gave ``tensor(1.)`` (pytorch#94925, on torch
# 2.0.0.dev20230105, the thread's version). PR #95048, "[functorch] roll : fix batching rule for
# scalar tensor" (February 2023), names it as the issue it fixes; which release shipped the fix
# first I did not check. On
# 2.13 both run: here ``roll(x, 1) ** 3``, whose derivative at a 0-d ``x`` is ``3 x**2``, shape
# ``()``. The workaround for a release that raises it: give the op a ``(1,)`` tensor and return
# a 0-d one (``reshape``), checked on 2.13 (only) with both transforms.
scalar = torch.tensor(0.7, **F64)
rolled_cube = lambda s: torch.roll(s, 1) ** 3  # noqa: E731
via_vector = lambda s: torch.roll(s.reshape(1), 1).reshape(()) ** 3  # noqa: E731
slope = 3 * scalar**2
for transform in [jacrev, jacfwd]:
    gap_to(
        f"{transform.__name__}, 0-d input", transform(rolled_cube)(scalar), slope, 1e-15
    )
    gap_to(
        f"{transform.__name__}, via (1,)", transform(via_vector)(scalar), slope, 1e-15
    )
old_jacobian = torch.autograd.functional.jacobian(rolled_cube, scalar)
gap_to("autograd.functional.jacobian", old_jacobian, slope, 1e-15)


# %%
# The same words have a second cause, in the code: part 9 re-runs pytorch#99187, where
# ``vmap(jacrev(F.normalize))`` over rows raises this ``IndexError`` on 2.13 too, because vmap
# hands the function one row and ``F.normalize``'s default ``dim=1`` does not exist on it. To
# tell the two apart, call the function outside any transform on what the transform gives it:
# one sample (``x[0]``) under ``vmap``, the input itself under ``jacrev`` or ``jacfwd``. Raises
# too: your code (give the dim, ``dim=-1``). Runs: the transform's rule, as with ``roll`` (upgrade,
# or reshape). Part 9 also shows which traceback frame is yours.
def blame(fn, as_seen):  # the call without the transform: raises, or runs
    try:
        fn(as_seen)
    except IndexError:
        return "your code: the function raises without the transform"
    return "the transform: the function runs without it"


rows = torch.randn(5, 2, **F64)
normalize_rows = lambda t: F.normalize(t)  # noqa: E731 (as in pytorch#99187)
fails_with(IndexError, "but got 1)", lambda: vmap(jacrev(normalize_rows))(rows))
checks = {
    "F.normalize under vmap": (normalize_rows, rows[0]),
    "roll at 0-d": (rolled_cube, scalar),
}
verdicts = {name: blame(*pair) for name, pair in checks.items()}
for name, verdict in verdicts.items():
    print(f"  {name}: {verdict}")
assert verdicts["F.normalize under vmap"].startswith("your code")
assert verdicts["roll at 0-d"].startswith("the transform")

# %%
# vmap: It looks like you're calling .item() on a Tensor: torch.linspace with batched ends
# ----------------------------------------------------------------------------------------
# pytorch#102208 (2023): ``vmap(partial(torch.linspace, steps=10))(start, stop)`` with ``start``
# and ``stop`` of shape ``(3,)`` raised, and the reporter wrote ``arange`` code instead. Then
# ``linspace`` took ``Scalar`` ends only, as the diff of PR #104889 ("Introduce Tensor overload to
# linspace and logspace") shows; PR #105451 added the batching rules. A ``Scalar`` is a number,
# and vmap refuses to turn a batched tensor into one: the message above, shown here with
# ``float``. The thread's traceback, as stored, stops before its message: compare yours. Which
# release first had the overloads was not checked; 2.13 has them (listed), and the call runs with
# no fallback warning, against a loop of ``linspace`` on plain numbers.
start, stop = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([25.0, 26.0, 27.0])
as_numbers = lambda a, b: torch.linspace(float(a), float(b), 10)  # noqa: E731 (Scalar ends)
item_error = "vmap: It looks like you're calling .item() on a Tensor"
fails_with(RuntimeError, item_error, lambda: vmap(as_numbers)(start, stop))
overloads = torch.ops.aten.linspace.overloads()
print("  aten::linspace overloads:", ", ".join(overloads))
assert "Tensor_Tensor" in overloads
looped = torch.stack(
    [torch.linspace(a.item(), b.item(), 10) for a, b in zip(start, stop)]
)
with warnings.catch_warnings(record=True, action="always") as told:
    batched = vmap(partial(torch.linspace, steps=10))(start, stop)
assert not told, [str(w.message) for w in told]
gap_to("vmap(linspace)", batched, looped, 0.0)


# %%
# The workaround for a release without the overloads: ``start + (stop - start) * t`` with ``t =
# arange(steps) / (steps - 1)``, only tensor arithmetic, which vmap batches. It is not bit-for-bit
# ``linspace``, whose kernel computes the second half of the points back from ``stop``, so the
# bound is float32's rounding; the last point equals ``stop`` for these integer ends (asserted),
# and may miss it by a rounding for others.
def spaced(a, b, steps=10):
    t = torch.arange(steps, dtype=a.dtype, device=a.device) / (steps - 1)
    return a + (b - a) * t


by_arange = vmap(spaced)(start, stop)
gap_to("arange workaround under vmap", by_arange, looped, 2e-7)
assert torch.equal(by_arange[:, -1], stop)


# %%
# There is a performance drop because we have not yet implemented the batching rule for ...
# --------------------------------------------------------------------------------------------
# A ``UserWarning``, not an error: ``vmap`` met an operator with no batching rule and ran it once
# per sample instead: for the operators here, the same values, only slower. Threads:
# ``torch.where`` with two numbers (pytorch#96741, 2023) and ``scatter_reduce`` (pytorch#152141,
# torch 2.5.1). On 2.13 both batch: no warning (asserted), values equal to a loop. On a release
# that warns: give ``where`` tensor operands, and run ``scatter_reduce`` once on the whole batch,
# along dim 1 (each checked on 2.13 against the loop). Silencing hides the warning, not the loop:
# the filter is checked on ``torch.histc``, which still falls back on 2.13.
signs = torch.randn(4, 5, **F64)
slots = torch.randint(0, 3, (4, 5), device=device)
by_numbers = lambda t: torch.where(t > 0, 1.0, -1.0)  # noqa: E731 (where.Scalar)
by_tensors = lambda t: torch.where(t > 0, torch.ones_like(t), -torch.ones_like(t))  # noqa
into_bins = lambda t, i: torch.zeros(3, **F64).scatter_reduce(0, i, t, reduce="sum")  # noqa
with warnings.catch_warnings(record=True) as heard:
    warnings.simplefilter("always", UserWarning)
    mapped_where, mapped_scatter = (
        vmap(by_numbers)(signs),
        vmap(into_bins)(signs, slots),
    )
assert not [str(w.message) for w in heard if "performance drop" in str(w.message)]
print("  where with numbers, scatter_reduce under vmap: no performance warning")
loop_where = torch.stack([by_numbers(t) for t in signs])
loop_scatter = torch.stack([into_bins(t, i) for t, i in zip(signs, slots)])
gap_to("vmap(where with numbers)", mapped_where, loop_where, 0)
gap_to("vmap(where with tensors)", vmap(by_tensors)(signs), loop_where, 0)
gap_to("vmap(scatter_reduce)", mapped_scatter, loop_scatter, 1e-15)
at_once = torch.zeros(4, 3, **F64).scatter_reduce(1, slots, signs, reduce="sum")
gap_to("one scatter_reduce on the batch", at_once, loop_scatter, 1e-15)
histogram = vmap(lambda t: torch.histc(t, bins=4, min=-2, max=2))
with warnings.catch_warnings(record=True) as heard:
    warnings.simplefilter("always", UserWarning)
    histogram(signs)
assert any(
    "performance drop" in str(w.message) for w in heard
)  # histc still falls back
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always", UserWarning)
    warnings.filterwarnings("ignore", message="There is a performance drop")
    histogram(signs)
assert not said, [str(w.message) for w in said]


# %%
# Your release: which of the four does it still have?
# ----------------------------------------------------
# ``still_there`` runs the four reports, small, against their closed forms, and ``linearize``
# under inference mode (wrong on 2.13, asserted), and prints what each does on the torch it runs
# on: "fixed", "wrong values" or the error. Copy it, with the page's imports; its default
# compiles with inductor, as the reporter did.
def still_there(backend="inductor"):
    def twice(t):  # pytorch#136662's function
        y = torch.zeros_like(t)
        y[:, 0] += t[:, 2].abs()
        y[:, 0] += t[:, 2].abs()
        return y.sum()

    x = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    pts = torch.tensor([[0.3, 0.1, -0.5], [0.2, 0.4, 0.9]], dtype=torch.float64)
    want_pts = (
        torch.zeros_like(pts).index_fill(1, torch.tensor([2]), 1) * 2 * pts.sign()
    )
    ends = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 3.0])

    def under_inference(transform):
        with torch.inference_mode():
            return transform(lambda t: t**2, x)(torch.ones_like(x)), 2 * x

    probes = {
        "pytorch#177318, inference_mode": lambda: under_inference(
            lambda f, at: lambda dx: jvp(f, (at,), (dx,))[1]
        ),
        "pytorch#136662, compile(grad) with +=": lambda: (
            torch.compile(lambda t: grad(twice)(t), backend=backend)(pts),
            want_pts,
        ),
        "pytorch#94925, jacrev at 0-d": lambda: (
            jacrev(lambda s: torch.roll(s, 1) ** 2)(x[2].clone()),
            2 * x[2],
        ),
        "pytorch#102208, vmap(linspace)": lambda: (
            vmap(partial(torch.linspace, steps=3))(*ends),
            torch.tensor([[0.0, 0.5, 1.0], [1.0, 2.0, 3.0]]),
        ),
        "pytorch#177318, linearize": lambda: under_inference(
            lambda f, at: linearize(f, at)[1]
        ),
    }
    outcomes = {}
    for name, probe in probes.items():
        try:
            got, want = probe()
            good = got.shape == want.shape and torch.allclose(got, want.to(got.dtype))
            outcomes[name] = "fixed" if good else "wrong values"
        except (RuntimeError, IndexError, NotImplementedError) as err:  # as reported
            outcomes[name] = f"{type(err).__name__}: {str(err)[:60]}"
        print(f"  {name}: {outcomes[name]}")
    return outcomes


print(f"torch {torch.__version__}, compiled with inductor:")
outcomes = still_there(backend="inductor")
assert outcomes.pop("pytorch#177318, linearize") == "wrong values", outcomes
assert set(outcomes.values()) == {"fixed"}, outcomes

# %%
# What ``still_there`` prints where a bug is present: 2.13 has none of the four, so one is put
# back by hand, for this call only: ``linspace`` that takes numbers, as before PR #104889. The
# other three could not be put back from Python; in a scratch copy, each probe's result broken
# once (zeros, halved, a ``(1,)`` shape) printed "wrong values".
saved_linspace = torch.linspace
try:
    torch.linspace = lambda a, b, steps: saved_linspace(float(a), float(b), steps)
    undone = still_there(backend="inductor")
finally:
    torch.linspace = saved_linspace
assert undone["pytorch#102208, vmap(linspace)"].startswith(
    "RuntimeError: vmap: It looks"
), undone
assert list(undone.values())[:3] == ["fixed"] * 3, undone  # linearize: as above

# %%
# Every workaround and fix against its reference
# ----------------------------------------------
# Each check's error (black) against its closed form or loop, and its bound (grey bar). A zero,
# exact, is drawn at 1e-18.
labels = list(measured)
error_at, bound_at = (
    [max(value, 1e-18) for value in pair] for pair in zip(*measured.values())
)
fig, ax = plt.subplots(figsize=(7.5, 6), layout="constrained")
ax.barh(labels, [b - 1e-19 for b in bound_at], left=1e-19, color="0.8")
ax.scatter(error_at, labels, color="black", zorder=3)
ax.set(xscale="log", xlim=(1e-19, 1e-4), xlabel="largest gap / largest true entry")
ax.set_title(f"{len(labels)} checks, {device.type}, torch {torch.__version__}")
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# - A pasted message or a wrong number from an old thread may be a bug torch has fixed: re-run
#   the thread's code, small, on your release against a closed form or a loop (``still_there``).
# - Under ``torch.inference_mode()``, take derivatives in ``torch.inference_mode(False)`` with
#   cloned inputs, under ``no_grad`` instead, or after the block. On 2.13 ``grad``, ``vjp`` and
#   ``jvp`` are right in the block; ``linearize`` and ``autograd.functional.jacobian`` give zeros.
# - Check a compiled ``grad`` against eager; accumulate out of place (``select_scatter``).
# - "Dimension out of range" has two causes: call the function on what the transform hands it,
#   without the transform. Raises: your code. Runs: the transform (reshape a 0-d input to ``(1,)``).
