"""
Bounding the memory of Jacobians: ``chunk_size`` and ``linearize``
==================================================================

``jacrev`` and ``vmap`` run everything they map at the same time, so the memory of a Jacobian
grows with the number of rows or samples mapped. This page sets ``chunk_size`` on ``jacrev``
and ``vmap``, checks the results, measures peak memory and time against the chunk size, picks
a chunk size from a memory budget by a fitted rule and measures it; then compares
:func:`~torch.func.linearize` with calling ``jvp`` each time and with ``vmap(jvp)``, and finds
when it pays. The kernel such Jacobians feed is on
:ref:`sphx_glr_auto_examples_models_as_functions_plot_neural_tangent_kernel.py`.
"""

# %%
# A token-wise MLP and its Jacobian
# ---------------------------------
# ``jacrev(f)(x)`` maps one ``vjp`` over all unit vectors of the output with ``vmap``: all rows'
# backward passes run at once. ``jacrev(f, chunk_size=c)`` maps ``c`` rows at a time;
# ``vmap(f, chunk_size=c)(x)`` equals concatenating ``vmap(f)`` over ``x.split(c)``. The model:
# an MLP on each of 32 tokens (16 → 512 → 512 → 4, ``tanh``), then a linear layer that mixes
# the tokens (no attention). Its input Jacobian is (4, 32) by (32, 16), small, but each of its
# 128 backward passes carries (32, 512) activations.
import copy
import ctypes
import gc
import json
import operator
import platform
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, jacrev, jvp, linearize, vmap
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


class TokenwiseMLPThenMix(nn.Module):
    def __init__(self, tokens=32, features=16, hidden=512, outputs=4):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(),
                                 nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, outputs))  # fmt: skip
        self.mix = nn.Linear(tokens, tokens)

    def forward(self, sequence):  # (..., tokens, features) -> (..., outputs, tokens)
        return self.mix(self.mlp(sequence).transpose(-1, -2))


net = TokenwiseMLPThenMix().to(device).requires_grad_(False)
sequences = torch.randn(4, 32, 16, device=device)

# %%
# The recipe, checked against a float64 loop
# -------------------------------------------
# The reference differentiates a float64 copy with ordinary autograd, one backward pass per
# output entry. Every entry of ``jacrev(..., chunk_size=16)`` on one sequence must match it.
# ``vmap(jacrev(...), chunk_size=2)`` over all 4 sequences must match, entry by entry, a
# Python loop of unchunked ``jacrev`` over the sequences (the first also against the reference).
jacobian = jacrev(net, chunk_size=16)(sequences[0])  # (4, 32, 32, 16)
batch_jacobians = vmap(jacrev(net), chunk_size=2)(sequences)  # (4, 4, 32, 32, 16)


def loop_jacobian(sequence):
    net64, inputs = copy.deepcopy(net).double(), sequence.double().requires_grad_()
    outputs = net64(inputs)
    rows = [
        torch.autograd.grad(out, inputs, retain_graph=True)[0]
        for out in outputs.flatten()
    ]
    return torch.stack(rows).view(*outputs.shape, *inputs.shape)


def check_entries(name, result, expected):
    scale = expected.abs().max().item()
    error = (result.double() - expected).abs().max().item() / scale
    print(f"{name:34s} largest entry error / largest entry: {error:.1e} (bound 1e-05)")
    torch.testing.assert_close(result.double(), expected, rtol=0, atol=1e-5 * scale)


reference = loop_jacobian(sequences[0])
check_entries("jacrev, chunk_size=16", jacobian, reference)
references = torch.stack([jacrev(net)(sequence) for sequence in sequences]).double()
check_entries("loop of jacrev, sequence 0", references[0], reference)
check_entries("vmap(jacrev), chunk_size=2", batch_jacobians, references)


# %%
# How much memory, and how long?
# ------------------------------
# A call's peak memory is measured above what was live before it: on a GPU from the CUDA
# allocator's count of bytes requested (``requested_bytes``, before it rounds blocks up); on a
# CPU from :class:`torch.profiler.profile`, which records every allocation (scratch memory
# inside an operation included) with the total allocated after it (counted from the
# recording's first allocation). The last total is what the call leaves allocated, its result
# included. Times come from :class:`torch.utils.benchmark.Timer`: the median and the IQR over
# at least five blocks. Every chunk size's result is checked against the reference again.
#
# The larger calls allocate and free tens of MiB each. On a CPU under Linux we ask glibc's
# ``malloc`` to keep freed memory for reuse, so that a call's time does not depend on what ran
# before it in the same process (:doc:`/reading-timings` says why).
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    assert libc.mallopt(-4, 0), "M_MMAP_MAX: serve large blocks from the heap"
    assert libc.mallopt(-1, -1), "M_TRIM_THRESHOLD: never hand freed memory back"


def memory_mib(fn):
    """(peak, left allocated at the end) of fn(), in MiB above what was live before."""
    gc.collect()
    if device.type != "cpu":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_stats(device)["requested_bytes.all.current"]
        kept = fn()  # noqa: F841 (what fn returns counts as left allocated)
        stats = torch.cuda.memory_stats(device)
        peak, after = (stats[f"requested_bytes.all.{k}"] for k in ("peak", "current"))
        return (peak - before) / 2**20, (after - before) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        kept = fn()  # noqa: F841
    with tempfile.TemporaryDirectory() as scratch:
        recorded.export_chrome_trace(str(Path(scratch, "trace.json")))
        trace = json.loads(Path(scratch, "trace.json").read_text())["traceEvents"]
    allocations = [event["args"] for event in trace if event.get("name") == "[memory]"]
    # The running total also counts what earlier recordings saw allocated and never freed
    # while recording: the start is the first total less the first allocation's own bytes.
    start = allocations[0]["Total Allocated"] - allocations[0]["Bytes"]
    totals = [args["Total Allocated"] - start for args in allocations]
    return max(totals) / 2**20, totals[-1] / 2**20


def timed(call):
    """blocked_autorange, topped up with one-call blocks to at least five blocks."""
    timer = benchmark.Timer(stmt="call()", globals={"call": call},
                            num_threads=torch.get_num_threads())  # fmt: skip
    blocks = timer.blocked_autorange(min_run_time=0.2)
    while len(blocks.times) < 5:
        blocks = benchmark.Measurement.merge([blocks, timer.timeit(1)])[0]
    return blocks


def spread(time):
    iqr = time.iqr * 1e3  # in ms: two decimals, or two significant digits below 0.1 ms
    digits = f"{iqr:.2f}" if iqr >= 0.1 else f"{iqr:.2g}"
    return f"(IQR {digits} ms, {len(time.times)} blocks)"


jacrev_curve, vmap_curve = {}, {}
for chunk_size in [4, 16, 64, 128]:  # 128 rows: the last is no chunking at all

    def call(chunk_size=chunk_size):
        return jacrev(net, chunk_size=chunk_size)(sequences[0])

    check_entries(f"jacrev, chunk_size={chunk_size}", call(), reference)
    jacrev_curve[chunk_size] = timed(call), memory_mib(call)[0]
for chunk_size in [1, 2, 4]:  # 4 sequences: the last is no chunking at all

    def call(chunk_size=chunk_size):
        return vmap(jacrev(net), chunk_size=chunk_size)(sequences)

    check_entries(f"vmap(jacrev), chunk_size={chunk_size}", call(), references)
    vmap_curve[chunk_size] = timed(call), memory_mib(call)[0]
print(f"one Jacobian: {jacobian.numel() * jacobian.element_size() / 2**10:.0f} KiB")
for name, curve in [("jacrev", jacrev_curve), ("vmap chunked", vmap_curve)]:
    for chunk_size, (time, peak) in curve.items():
        print(f"{name} chunk_size={chunk_size:3d}: {time.median * 1e3:7.1f} ms "
              f"{spread(time)}, peak {peak:6.2f} MiB")  # fmt: skip
    r = curve[min(curve)][0].median / curve[max(curve)][0].median
    say = f"takes {r:.2f}x the time of" if r >= 1 else f"is {1 / r:.2f}x faster than"
    print(f"{name}: chunk_size={min(curve)} {say} no chunking")
    peaks = [peak for _, peak in curve.values()]  # chunk_size doubles or more a step
    growth = min(after / before for before, after in zip(peaks, peaks[1:]))
    print(f"{name}: each step's peak is at least {growth:.2f}x the last (bound 1.5)")
    assert growth > 1.5, f"{name}: the peak does not grow with chunk_size"

# %%
# Choosing a chunk size from the memory you have
# ----------------------------------------------
# If the peak is a fixed part (inputs, result, forward pass) plus a part per row in flight,
# ``peak(c) = base + c · per_row``, two measurements give both numbers, and the largest chunk
# that fits a budget ``M`` is ``c = ⌊(M − base) / per_row⌋``. The per-row part is measured,
# not derived: it depends on what the backward pass keeps. We fit the rule on ``jacrev``'s
# smallest and largest chunk sizes, ask it for the chunk that fits a third of the unchunked
# peak, then measure that chunk size: it must fit the budget, and match the prediction.
small, large = min(jacrev_curve), max(jacrev_curve)
per_row = (jacrev_curve[large][1] - jacrev_curve[small][1]) / (large - small)
base = jacrev_curve[small][1] - per_row * small
budget = jacrev_curve[large][1] / 3
chosen = int((budget - base) // per_row)
predicted = base + per_row * chosen
# Measured as the curve's peaks were, after a first call (there, the timer's).
jacrev(net, chunk_size=chosen)(sequences[0])
measured_peak = memory_mib(lambda: jacrev(net, chunk_size=chosen)(sequences[0]))[0]
print(f"rule: {base:.2f} MiB + {per_row:.4f} MiB per row; budget {budget:.2f} MiB "
      f"-> chunk_size={chosen}")  # fmt: skip
print(f"chunk_size={chosen}: predicted {predicted:.2f} MiB, measured {measured_peak:.2f} MiB "
      f"({measured_peak / budget:.2f} of the budget)")  # fmt: skip
assert measured_peak <= budget, "the chosen chunk size does not fit its budget"
assert abs(measured_peak - predicted) < 0.1 * predicted, "the linear rule is off"

# %%
# ``linearize``: one preparation, many Jacobian-vector products
# -------------------------------------------------------------
# Now the Jacobian is with respect to the parameters, over all 4 sequences, applied to one
# tangent at a time, as an iterative solver does. ``jvp`` runs the forward pass with the
# tangent every time. :func:`~torch.func.linearize` evaluates the function twice (its
# documentation says so: once for the output, once while tracing the Jacobian-vector product
# into a graph), and returns a function that computes the parts of that graph that do not
# depend on the tangent once, on its first call (torch's FX constant folding), and keeps
# them. When all tangents are known at once, ``vmap(jvp)`` is the third way. Each is checked
# against a float64 central finite difference. (torch's FX warns harmlessly while it prepares
# the folding; we silence that.)
params = {name: p.detach() for name, p in net.named_parameters()}
params64 = {name: p.double() for name, p in params.items()}
tangents = [
    {name: torch.randn_like(p) for name, p in params.items()} for _ in range(16)
]


def outputs_at(p):
    return functional_call(net, p, (sequences,))


def prepare(fn=outputs_at, primals=params, tangent=tangents[0]):
    """linearize, and the first product, which computes the folded constants."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        jvp_fn = linearize(fn, primals)[1]
    jvp_fn(tangent)
    return jvp_fn


def finite_difference(tangent, step=1e-6):
    def at(sign):
        shifted = {
            n: p + sign * step * tangent[n].double() for n, p in params64.items()
        }
        return functional_call(net, shifted, (sequences.double(),))

    return (at(1) - at(-1)) / (2 * step)


linearized = prepare()
stacked = {name: torch.stack([t[name] for t in tangents]) for name in params}
vmapped = vmap(lambda t: jvp(outputs_at, (params,), (t,))[1])(stacked)
for k, tangent in enumerate(tangents[:3]):
    expected = finite_difference(tangent)
    check_entries(f"linearize, tangent {k}", linearized(tangent), expected)
    check_entries(
        f"jvp, tangent {k}", jvp(outputs_at, (params,), (tangent,))[1], expected
    )
    check_entries(f"vmap(jvp), tangent {k}", vmapped[k], expected)

# %%
# What each costs, counted and timed
# ----------------------------------
# ``FlopCounterMode`` counts each call's matrix-product FLOPs (``2·m·n·k`` per product of
# ``mm``, ``addmm`` or ``bmm``, the only operations here it has a formula for; ``tanh`` and
# the other elementwise operations go uncounted), as multiples of one forward pass, whose
# count is checked against the closed form; the timer gives the time. The preparation is
# ``linearize`` plus the first product; the break-even number of products ``K`` is where it
# plus ``K − 1`` more products costs as much as ``K`` calls of ``jvp``. ``vmap(jvp)`` is timed
# over all 16 tangents at once; its count shows the primal forward pass done once for all of
# them, not 16 times.
CALLS = {
    "forward": lambda: outputs_at(params),
    "linearize, preparation": prepare,
    "linearize, one product": lambda: linearized(tangents[0]),
    "loop, one jvp": lambda: jvp(outputs_at, (params,), (tangents[0],)),
    "vmap, 16 jvps": lambda: vmap(lambda t: jvp(outputs_at, (params,), (t,))[1])(
        stacked
    ),
}
costs, counted_ops = {}, set()
for name, call in CALLS.items():
    with FlopCounterMode(display=False) as flops:
        call()
    costs[name] = (flops.get_total_flops(), timed(call))
    counted_ops |= set(flops.get_flop_counts()["Global"])
assert counted_ops == {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}
forward_flops = costs["forward"][0]  # the MLP on 4·32 tokens, then the token mixing
assert forward_flops == 2 * (128 * (16 * 512 + 512 * 512 + 512 * 4) + 16 * 32 * 32)
for name, (flop_count, time) in costs.items():
    print(f"{name:23s} {flop_count / forward_flops:5.2f} forwards of matrix-product FLOPs, "
          f"{time.median * 1e3:7.2f} ms {spread(time)}")  # fmt: skip
prepare_ms, linearized_ms, jvp_ms, vmap16_ms = (  # the four calls after "forward"
    costs[name][1].median * 1e3 for name in list(CALLS)[1:]
)
assert costs["linearize, one product"][0] < costs["loop, one jvp"][0], "no FLOPs saved"
assert costs["vmap, 16 jvps"][0] < 16 * costs["loop, one jvp"][0] - 10 * forward_flops
for what, r in [("one linearised product", linearized_ms / jvp_ms),
                 ("vmap(jvp), per tangent,", vmap16_ms / 16 / jvp_ms)]:  # fmt: skip
    say = f"takes {r:.2f}x the time of" if r >= 1 else f"is {1 / r:.2f}x faster than"
    print(f"{what} {say} one jvp")
saving_ms = jvp_ms - linearized_ms
break_even = (prepare_ms - linearized_ms) / saving_ms if saving_ms > 0 else None
if break_even:
    print(f"on this run, linearize pays after about {break_even:.0f} products")
else:
    print("on this run, a linearised product was no faster than jvp: no pay-off")

# %%
# What the linearised function keeps, and what ``vmap(jvp)`` holds
# ----------------------------------------------------------------
# The folded constants are tensors of an FX module in the closure of the function
# ``linearize`` returns (``_FX_CONST_FOLDED_ATTRS``, torch internals that may change); the
# module's graph, run on each call, reads some of them by index. We name each kept tensor by
# comparing it with tensors computed directly, and compare their bytes with what the profiler
# finds the preparation leaves allocated. First on a known answer: a product of ``sin``'s
# Jacobian is ``t · cos x``, so the graph must read ``cos x`` (and ``x``, as a template for the
# tangent's shape); folding also keeps ``sin x``, traced though not needed.


def folded_constants(jvp_fn):
    """The tensors jvp_fn keeps, {index: ops reading it} for those its graph reads, its ops."""
    cells = dict(zip(jvp_fn.__code__.co_freevars, jvp_fn.__closure__))
    module = cells["const_folded_jvp_graph"].cell_contents
    nodes = module.graph.nodes
    read = {node.args[1]: {str(user.target) for user in node.users} for node in nodes
            if node.target is operator.getitem and node.args[0].op == "get_attr"}  # fmt: skip
    kept = list(getattr(module, module.fx_const_folded_attrs_name))
    return kept, read, [str(node.target) for node in nodes]


def identify(tensor, known):  # the name of the tensor with the same entries, any shape
    for name, value in known.items():
        if value.numel() == tensor.numel() and torch.allclose(
            tensor.reshape(value.shape), value, rtol=1e-5, atol=1e-6
        ):
            return name
    return "other" if tensor.any() else "zeros"


def allocated(tensors):  # bytes requested for the tensors, as memory_mib counts them
    return sum(t.numel() * t.element_size() for t in tensors)


TEMPLATE = {"aten._new_zeros_with_same_feature_meta.default"}  # reads shape, dtype
x = torch.randn(1000, device=device)
sin_kept_mib = memory_mib(lambda: prepare(torch.sin, x, torch.ones_like(x)))[1]
kept, read, _ = folded_constants(prepare(torch.sin, x, torch.ones_like(x)))
names = [identify(t, {"x": x, "sin x": x.sin(), "cos x": x.cos()}) for t in kept]
assert sorted(names) == ["cos x", "sin x", "x"], names
reads = {names[i]: op for i, op in read.items()}
assert reads == {"x": TEMPLATE, "cos x": {"aten.mul.Tensor"}}, reads
assert sin_kept_mib * 2**20 == allocated(kept), "the profiler disagrees"

# %%
# Then the model's, named against its parameters, their transposes, and, for each ``tanh``
# layer, the pre-activation ``z = aW^T + b`` of its input ``a``, its output ``h = tanh z`` and
# the derivative ``1 − h²``:
z1 = sequences @ params["mlp.0.weight"].T + params["mlp.0.bias"]
z2 = z1.tanh() @ params["mlp.2.weight"].T + params["mlp.2.bias"]
known = {**{f"parameter {n}": p for n, p in params.items()},
         **{f"transposed {n}": p.T for n, p in params.items() if p.dim() == 2},
         "inputs": sequences, "pre-activation z1": z1, "pre-activation z2": z2,
         "tanh output h1": z1.tanh(), "tanh output h2": z2.tanh(),
         "tanh derivative 1-h1²": 1 - z1.tanh() ** 2,
         "tanh derivative 1-h2²": 1 - z2.tanh() ** 2}  # fmt: skip
kept, read, ops = folded_constants(linearized)
names = [identify(t, known) for t in kept]
prepare_peak, prepare_kept = memory_mib(prepare)
unread = allocated(t for i, t in enumerate(kept) if i not in read) / 2**20
print(f"linearize and a first product: peak {prepare_peak:.2f} MiB, leave {prepare_kept:.2f} MiB"
      f" allocated: {len(kept)} tensors kept, {len(read)} read on each call")  # fmt: skip
for kind in dict.fromkeys(name.rsplit(" ", 1)[0] for name in names + list(known)):
    of_kind = [i for i, name in enumerate(names) if name.rsplit(" ", 1)[0] == kind]
    mib = [allocated(kept[i] for i in of_kind if i in read or not reading) / 2**20
           for reading in (False, True)]  # fmt: skip
    print(f"  {kind:16s} {len(of_kind):2d} kept, {mib[0]:.2f} MiB; "
          f"{sum(i in read for i in of_kind):2d} read, {mib[1]:.2f} MiB")  # fmt: skip
print(f"kept and never read: {unread:.2f} MiB; each product calls tanh_backward "
      f"{ops.count('aten.tanh_backward.default')} times")  # fmt: skip
assert prepare_kept * 2**20 == allocated(kept), "the profiler disagrees"
assert not any(n.startswith("tanh derivative") for n in names), "1 - h² kept"
assert ops.count("aten.tanh_backward.default") == 2, "1 - h² not recomputed"
assert {"tanh output h1", "tanh output h2"} <= {names[i] for i in read}, names
assert {"pre-activation z1", "pre-activation z2"} <= set(names), names
assert not any(names[i].startswith("pre-activation") for i in read), names
assert all(read[i] == TEMPLATE for i, n in enumerate(names) if "parameter" in n)

# %%
# So, among what the table lists, it keeps a copy of each parameter, read only as a template for
# the tangents' shapes; the ``tanh`` outputs, from which ``tanh_backward`` recomputes ``1 − h²``
# on every call; and the pre-activations, never read (all asserted). Last, the peaks of one
# ``jvp`` and of ``vmap(jvp)`` over 16 tangents, which holds 16 tangents' activations.
jvp_peak = memory_mib(CALLS["loop, one jvp"])[0]
vmap_peak = memory_mib(CALLS["vmap, 16 jvps"])[0]
print(f"peak of one jvp {jvp_peak:.2f} MiB; of vmap(jvp) over 16 tangents {vmap_peak:.2f} MiB "
      f"({vmap_peak / jvp_peak:.1f}x)")  # fmt: skip
assert vmap_peak > 8 * jvp_peak, "vmap(jvp) over 16 tangents held no more than 8 jvps"

# %%
# Two figures in one: on the left, each ``chunk_size`` curve as time against peak memory,
# labelled by chunk size, with the rule's budget; on the right, the total time of ``K``
# Jacobian-vector products each way, whose lines cross at the break-even point.
METHOD_COLORS = {"jacrev": "#0072B2", "vmap chunked": "#44AA99", "loop": "#D55E00",
                 "vmap": "#009E73", "linearize": "#CC3311"}  # fmt: skip
fig, (ax_chunk, ax_products) = plt.subplots(
    1, 2, figsize=(10, 3.8), layout="constrained"
)
for name, curve in [("jacrev", jacrev_curve), ("vmap chunked", vmap_curve)]:
    peaks, times = (
        [p for _, p in curve.values()],
        [t.median * 1e3 for t, _ in curve.values()],
    )
    ax_chunk.plot(peaks, times, marker="o", color=METHOD_COLORS[name], label=name)
    for chunk_size, peak, milliseconds in zip(curve, peaks, times):
        ax_chunk.annotate(str(chunk_size), (peak, milliseconds), xytext=(3, 3),
                          textcoords="offset points", fontsize=8)  # fmt: skip
ax_chunk.axvline(
    budget, color="black", linestyle=":", label=f"budget: chunk_size={chosen}"
)
ax_chunk.set(xscale="log", yscale="log", xlabel="peak memory (MiB)", ylabel="time (ms)",
             title="chunk_size: memory against time")  # fmt: skip
ax_chunk.legend(fontsize=8)
counts = torch.arange(1, int(3 * (break_even or 20)) + 2)
ax_products.plot(counts, counts * jvp_ms, color=METHOD_COLORS["loop"], label="loop")
ax_products.plot(counts, prepare_ms + (counts - 1) * linearized_ms,
                 color=METHOD_COLORS["linearize"], label="linearize")  # fmt: skip
ax_products.plot(
    counts, counts * vmap16_ms / 16, color=METHOD_COLORS["vmap"], label="vmap"
)
if break_even:
    ax_products.axvline(break_even, color="black", linestyle=":", label="break-even")
ax_products.set(xlabel="number of Jacobian-vector products K", ylabel="total time (ms)",
                title="jvp each time, linearize, or vmap(jvp)")  # fmt: skip
ax_products.legend(fontsize=8)
plt.show()

# %%
# What to remember
# ----------------
# * ``jacrev(f, chunk_size=c)`` and ``vmap(f, chunk_size=c)`` give the same result (checked entry
#   by entry) with a peak that grows with ``c`` (asserted). Whether smaller chunks also cost
#   time depends on the machine: compare the printed times before you pick the smallest.
# * Pick ``c`` from two measured peaks: ``peak(c) = base + c · per_row``, then
#   ``c = ⌊(M − base) / per_row⌋``; measure the chosen chunk once to confirm it fits.
# * ``linearize`` evaluates the function twice and keeps folded constants (listed above: copies
#   of the parameters and activations, some never read); each product then skips the primal
#   part of a ``jvp`` (fewer matrix-product FLOPs, counted). It pays only past the break-even.
# * With all tangents known, ``vmap(jvp)`` runs the primal forward once for all of them (counted)
#   and holds all their tangent activations at once (measured).
