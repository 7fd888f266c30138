"""
``torch.compile`` and the transforms: what compiles, and what to check
======================================================================

Can ``torch.compile`` compile a function that uses ``vmap``, ``grad``, ``jacrev``, ``jacfwd`` or
``hessian``? Mostly yes, into one graph, when it goes *around* the transforms. Below: the recipe, a
table of nestings, two that fail (and break the process), cache limits, recompiles, draws, timings.
"""

# %%
# Setup
# -----
# ``GraphCounter`` is a ``torch.compile`` backend that keeps the graphs dynamo hands it and runs
# them as they are, without generating code: cheap enough for the table below to try many.
import sys
import time
import warnings
from subprocess import PIPE, Popen
from unittest import TestCase

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._dynamo.utils import counters
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.profiler import profile
from torch.utils import benchmark
from torch.utils._python_dispatch import _get_current_dispatch_mode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None  # for clocks
METHOD_COLORS = {"torch eager": "#004488", "compiled": "#117733"}


class GraphCounter(list):  # a list of the graphs
    def __call__(self, gm, example_inputs):
        self.append(gm)
        return gm.forward


# %%
# The recipe: compile around the transform
# ----------------------------------------
# A neural potential maps a configuration ``x`` to an energy; its gradient in ``x`` gives the
# forces. :func:`~torch.func.grad` takes it for one configuration, :func:`~torch.func.vmap` maps
# that over a batch, and :func:`torch.compile` (inductor, ``fullgraph=True``) goes around a function
# of our own that calls both (why: below). The energy holds a Python float, as real code does. The
# first call compiles; inductor's cache on disk may hold the code (a hit) or not (a miss). Checks:
# eager code, and a float64 loop of :func:`torch.autograd.grad`, as relative errors with bounds.
def energy(params, x):
    hidden = torch.tanh(x @ params["w_in"] + params["b_in"])
    return hidden @ params["w_out"] + 0.5 * (x * x).sum()


params = {
    "w_in": torch.randn(3, 32, device=device) / 3**0.5,
    "b_in": 0.1 * torch.randn(32, device=device),
    "w_out": torch.randn(32, device=device) / 32**0.5,
}
positions = torch.randn(256, 3, device=device)


def energy_grads(params, positions):  # our own function around the transforms
    return vmap(grad(energy, argnums=1), in_dims=(None, 0))(params, positions)


compiled_grads = torch.compile(energy_grads, fullgraph=True)
counters.clear()  # dynamo's counters last as long as the process: count from here
tic = time.perf_counter()
compiled_result = compiled_grads(params, positions)
sync()
seconds, graphs = time.perf_counter() - tic, counters["stats"]["unique_graphs"]
cache = "inductor's cache: {fxgraph_cache_hit} hits, {fxgraph_cache_miss} misses"
print(f"compiling: {seconds:.1f} s (measured once), {graphs} graph, ", end="")
print(f"{len(counters['graph_break'])} breaks;", cache.format_map(counters["inductor"]))
assert graphs == 1 and not counters["graph_break"], dict(counters["graph_break"])
eager_result = energy_grads(params, positions)
params64 = {name: p.double() for name, p in params.items()}
x64 = positions.double().requires_grad_()
reference = torch.stack([torch.autograd.grad(energy(params64, x), x)[0] for x in x64])


def relative_error(result, exact):
    return ((result.double() - exact).norm() / exact.norm()).item()


for name, result, exact in [
    ("compiled against the float64 loop", compiled_result, reference),
    ("eager against the float64 loop", eager_result, reference),
    ("compiled against eager", compiled_result, eager_result.double()),
]:
    error = relative_error(result, exact)
    print(f"{name}: relative error {error:.1e} (bound 1e-6)")
    assert error < 1e-6, name

# %%
# Nestings that compile, through dynamo
# --------------------------------------
# Each row is compiled with ``fullgraph=True`` (a graph break would raise) and ``GraphCounter``,
# and checked against eager code and float64 closed forms: ``wave(x) = 2.0 * sin(A x)`` (a Python
# float, a constant matrix) has the Jacobian ``2 cos(A x) A`` (row by row); its sum, ``height``,
# the Hessian ``-2 Aᵀ diag(sin(A x)) A``. The two that fail run in a child process on the CPU.
CHILD = """
import gc, torch
from torch.func import grad, hessian, jacfwd, vmap
A, xs = torch.randn(4, 3), torch.randn(5, 3)
wave = lambda x: 2.0 * torch.sin(A @ x)
excluded = lambda: len(str(torch._C._dispatch_tls_local_exclude_set()).split(","))
before, kept = excluded(), []  # the errors stay alive until the end
for name, fn in [("vmap(jacfwd)", vmap(jacfwd(wave))),
                 ("vmap(hessian)", vmap(hessian(lambda x: torch.sin(A @ x).sum())))]:
    try:
        torch.compile(lambda xs, fn=fn: fn(xs), fullgraph=True)(xs)
    except RuntimeError as failure:
        kept.append(failure)
        inner, first = "INTERNAL ASSERT FAILED" in str(failure), str(failure).splitlines()[0]
        print(f"{name}|{type(failure).__name__}|{first}|{inner}")
del kept
gc.collect()
try:
    outcome = str(grad(lambda x: x.sin().sum())(torch.randn(3)).shape)
except RuntimeError as failure:
    outcome = str(failure).splitlines()[0]
print(f"afterwards|{before}|{excluded()}|{outcome}")
"""
child = Popen([sys.executable, "-c", CHILD], stdout=PIPE, stderr=PIPE, text=True)
A, x = torch.randn(4, 3, device=device), torch.randn(3, device=device)
v, u = torch.randn(3, device=device), torch.randn(4, device=device)
xs = torch.randn(5, 3, device=device)


def wave(x, A):
    return 2.0 * torch.sin(A @ x)


def height(x, A):
    return wave(x, A).sum()


def closed_forms(x, A):
    x, A = x.double(), A.double()
    jac = 2 * torch.cos(A @ x)[:, None] * A
    hess = -2 * A.T @ (torch.sin(A @ x)[:, None] * A)
    return {"wave": 2 * torch.sin(A @ x), "jac": jac, "grad": jac.sum(0), "hess": hess}


def jacobians_forward(xs, A):  # per-sample Jacobians by forward mode, not vmap(jacfwd)
    push = lambda e: jvp(lambda t: vmap(wave, B)(t, A), (xs,), (e.expand_as(xs),))[1]  # noqa: E731
    return vmap(push, out_dims=-1)(torch.eye(3, device=xs.device))


def linear_height(p, x):  # nn.Linear(3, 4) with the parameters p
    return 2.0 * torch.sin(functional_call(linear, p, (x,))).sum()


E = closed_forms(x, A)
S = {k: torch.stack([closed_forms(row, A)[k] for row in xs]) for k in E}
E["jvp"], E["vjp"] = E["jac"] @ v.double(), E["jac"].T @ u.double()
linear = nn.Linear(3, 4).to(device)
weights = {name: p.detach() for name, p in linear.named_parameters()}
slope = 2 * torch.cos(linear(x).detach().double())  # d height / d (W x + b)
E["linear"] = (slope[:, None] * x.double(), slope)
B = (0, None)  # vmap's in_dims: map over the first argument, share A
opaque = torch._dynamo.allow_in_graph(vmap(grad(height), in_dims=B))
rows = {  # name: (function, float64 closed form); each reads its inputs as globals
    "grad": (lambda: grad(height)(x, A), E["grad"]),
    "vjp": (lambda: vjp(wave, x, A)[1](u)[0], E["vjp"]),
    "jvp": (lambda: jvp(wave, (x, A), (v, 0 * A)), (E["wave"], E["jvp"])),
    "jacrev": (lambda: jacrev(wave)(x, A), E["jac"]),
    "jacfwd": (lambda: jacfwd(wave)(x, A), E["jac"]),
    "hessian": (lambda: hessian(height)(x, A), E["hess"]),
    "grad, has_aux": (
        lambda: grad(lambda t: (height(t, A), wave(t, A)), has_aux=True)(x),
        (E["grad"], E["wave"]),
    ),
    "grad of functional_call": (lambda: grad(linear_height)(weights, x), E["linear"]),
    "vmap(grad)": (lambda: vmap(grad(height), B)(xs, A), S["grad"]),
    "vmap(jacrev)": (lambda: vmap(jacrev(wave), B)(xs, A), S["jac"]),
    "vmap(jacfwd), without 2.0": (
        lambda: vmap(jacfwd(lambda t, A: torch.sin(A @ t)), B)(xs, A),
        S["jac"] / 2,
    ),
    "vmap(jacrev(jacrev))": (lambda: vmap(jacrev(jacrev(height)), B)(xs, A), S["hess"]),
    "jvp over a basis, vmap": (lambda: jacobians_forward(xs, A), S["jac"]),
    "allow_in_graph(vmap(grad))": (lambda: opaque(xs, A), S["grad"]),
}


def flat(out):  # a tensor, or a tuple or dict of them, as one float64 vector
    parts = out.values() if type(out) is dict else out if type(out) is tuple else [out]
    return torch.cat([part.reshape(-1).double() for part in parts])


print(f"{'nesting':28} graphs breaks calls  vs eager  vs float64")
with warnings.catch_warnings(record=True, action="always") as caught:
    for name, (fn, exact_out) in rows.items():
        backend = GraphCounter()
        counters["graph_break"].clear()
        out = flat(torch.compile(fn, backend=backend, fullgraph=True)())
        to_eager = (out - flat(fn())).abs().max().item()
        error = relative_error(out, flat(exact_out))
        calls = sum(n.op.startswith("call") for n in backend[0].graph.nodes)
        breaks = sum(counters["graph_break"].values())
        print(f"{name:28} {len(backend):6} {breaks:6} {calls:5}  ", end="")
        print(f"{to_eager:8.1e}  {error:9.1e}")
        assert (len(backend), breaks, to_eager) == (1, 0, 0), name
        assert error < 1e-6, name
    fn, exact_out = rows["allow_in_graph(vmap(grad))"]  # through AOTAutograd too
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)()
    error = relative_error(flat(out), flat(exact_out))
    print(f"{'the same, backend aot_eager':28} {error:40.1e}")
    assert error < 1e-6
assert not [w for w in caught if "batching rule" in str(w.message)], "a fallback"

# %%
# One graph each, no break, ``jacfwd`` with its Python float included (pytorch#125078, fixed), the
# numbers of eager code bit for bit (``GraphCounter`` runs dynamo's graph on eager kernels), and
# the closed forms' (bound 1e-6). Dynamo traces into the transforms (the calls column);
# ``allow_in_graph``, the functorch-era workaround, hides the call behind one node: not needed. No
# "batching rule for aten::matmul" warning came, with ``GraphCounter`` or through AOTAutograd
# (``aot_eager``, where pytorch#97425 met it with that workaround): the check fails on any. See
# :ref:`sphx_glr_auto_examples_guides_plot_functorch_migration.py` for ``functorch.compile``;
# :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py` (section 12): a compiled function called
# *inside* a transform is not compiled; compiled ``grad`` ignores a custom ``autograd.Function``'s
# ``backward``, silently, in this release (pytorch#193279;
# :ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`).

# %%
# ``vmap(jacfwd)`` and ``vmap(hessian)``: an internal assert, then a broken process
# ---------------------------------------------------------------------------------
# Compiled, ``vmap`` of :func:`~torch.func.jacfwd` fails when the function multiplies (or divides)
# by a constant, ``2.0`` here; without the factor it compiles (see the table). ``vmap`` of
# :func:`~torch.func.hessian` (``jacfwd(jacrev)``) fails even without one: the child's is ``sin(A
# x)`` summed. Eager code works (checked below). Open: pytorch#160508, pytorch#151196. Worse, once
# the error's frames are freed the thread excludes more dispatch keys, and even an eager ``grad``
# fails: hence the child process (in a notebook, restart the kernel). The child frees them with
# ``gc.collect()``; in a script, the break comes whenever Python's cycle collector next runs. Ways
# around it, in the table: ``vmap(jacrev(jacrev))``; ``jvp`` over basis vectors.
for name, fn in [("jac", jacfwd(wave)), ("hess", hessian(height))]:  # eager
    error = relative_error(vmap(fn, B)(xs, A), S[name])
    print(f"eager, against the closed form's {name}: {error:.1e} (bound 1e-6)")
    assert error < 1e-6, name
out, log = child.communicate(timeout=120)
report = {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines()}
assert "afterwards" in report, log[-3000:]  # the child's last words, if it crashed
for name in ("vmap(jacfwd)", "vmap(hessian)"):
    kind, first_line, internal = report.get(name, ["compiled", "no error", "False"])
    print(f"compiled {name}: {kind}: {first_line}; internal assert inside: {internal}")
    assert kind == "TorchRuntimeError" and internal == "True", (name, first_line)
    assert first_line == "RuntimeError when making fake tensor call", first_line
before, after, broken = report["afterwards"]
print(f"then: dispatch keys excluded {before} before, {after} after; grad: {broken}")
assert int(after) > int(before), (before, after)
assert broken == "Cannot access data pointer of Tensor that doesn't have storage"


# %%
# A transform's functions are one code object to dynamo
# ------------------------------------------------------
# ``torch.compile(vmap(f))`` compiles the function ``vmap`` returns: all of them share one code
# object, as do all that ``grad``, ``jacrev`` or ``jacfwd`` return (``hessian`` returns
# ``jacfwd``'s), and all that a factory of yours returns: one per ``def`` or ``lambda`` in the
# source. Dynamo keeps ``recompile_limit`` versions per code object; a limit of 1 shows the rest.
# Under ``fullgraph=True`` the call raises, and that is all: a later one compiles (below the limit).
# Without it, the call runs eagerly with a logged warning (kept off stderr here), and dynamo
# compiles nothing more for that code object until ``torch.compiler.reset()``: a later one runs a
# version compiled before if one fits, else eagerly (``fullgraph=True``: "found no compiled
# frames"). So pass what varies as tensors (dynamo guards shapes, not values), as the recipe passes
# ``params``; where functions vary, raise ``recompile_limit`` or reset.
def run(f, fullgraph=True):  # compile a new vmap-ed function of f, and call it
    return torch.compile(vmap(f, B), backend=backend, fullgraph=fullgraph)(xs, A)


def per_sample_grads(act):  # a factory of functions of your own
    return lambda xs: vmap(grad(lambda x: act(x).sum()))(xs)


sin_grads, cos_grads = per_sample_grads(torch.sin), per_sample_grads(torch.cos)
shared = [f(height).__code__ is f(wave).__code__ for f in (vmap, grad, jacrev, jacfwd)]
shared += [hessian(height).__code__ is jacfwd(wave).__code__]
shared += [sin_grads.__code__ is cos_grads.__code__]
print(f"one code object: {shared} (four transforms; hessian is jacfwd; factory)")
assert all(shared), shared
backend, check = GraphCounter(), TestCase()  # for its assertLogs and assertRaises
limit_1 = lambda: torch._dynamo.config.patch(recompile_limit=1)  # noqa: E731
with check.assertLogs("torch._dynamo.convert_frame", "WARNING") as logged:
    run(grad(height))  # one version so far
    with limit_1(), check.assertRaises(FailOnRecompileLimitHit) as failed:
        run(jacrev(height))
    assert str(failed.exception) == "Hard failure due to fullgraph=True"
    run(jacrev(height))  # at the default limit: a second version
    print(f"with fullgraph=True: {failed.exception}; then {len(backend)} graphs")
    with limit_1():
        eager_run = run(jacrev(wave), fullgraph=False)
    with check.assertRaises(RuntimeError) as failed:  # at the default limit
        run(jacrev(wave))
    run(grad(height))  # fits the first version: runs it, no complaint
    torch.compile(sin_grads, backend=backend, fullgraph=True)(xs)  # compiles
    with limit_1(), check.assertRaises(FailOnRecompileLimitHit):
        torch.compile(cos_grads, backend=backend, fullgraph=True)(xs)
message = str(failed.exception).split(". ")[0]
assert message == "torch.compile with fullgraph=True found no compiled frames"
torch.testing.assert_close(eager_run, vmap(jacrev(wave), B)(xs, A))
warned = [line for line in logged.output if "hit config.recompile_limit (1)" in line]
assert len(backend) == 3 and len(warned) == 3, (len(backend), warned)
print(f"without fullgraph: right numbers, a warning; a later one raises: {message}")
torch.compiler.reset()  # dynamo's caches only: inductor's on disk stay
run(jacrev(wave))
assert len(backend) == 4
print("the factory's second, at a limit of 1: raised; after reset(): a graph")

# %%
# A new batch size: what recompiles
# ---------------------------------
# Dynamo remembers shapes per code object: each mode resets dynamo, then compiles ``sin_grads``
# (with ``GraphCounter``) at batch sizes 8, 16, 32, 8. By default the second size recompiles with a
# symbolic batch size that later sizes reuse; ``dynamic=False`` compiles each size;
# ``dynamic=True`` and ``torch._dynamo.mark_dynamic`` compile once; all match eager code. A loss
# that pins the batch size does otherwise: :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`.
expected = {"default": [1, 2, 2, 2], "dynamic=False": [1, 2, 3, 3]}
modes = {"default": None, "dynamic=False": False, "dynamic=True": True}
modes["mark_dynamic"] = None
for mode, dynamic in modes.items():
    torch.compiler.reset()
    backend, counts = GraphCounter(), []
    fn = torch.compile(sin_grads, backend=backend, fullgraph=True, dynamic=dynamic)
    for size in (8, 16, 32, 8):
        xs = torch.randn(size, 3, device=device)
        if mode == "mark_dynamic":
            torch._dynamo.mark_dynamic(xs, 0)
        torch.testing.assert_close(fn(xs), sin_grads(xs))
        counts.append(len(backend))
    print(f"{mode:14} graphs compiled after each call: {counts}")
    assert counts == expected.get(mode, [1, 1, 1, 1]), (mode, counts)


# %%
# Randomness: the same modes, other numbers
# -----------------------------------------
# Under inductor, ``randomness="different"`` (see
# :ref:`sphx_glr_auto_examples_models_as_functions_plot_randomness_under_transforms.py`) gives
# each sample its own draw, but from the same seed other values than eager code, unless
# ``torch._inductor.config.fallback_random`` is set *when the function compiles*: dynamo's cache
# ignores inductor's settings, so a function compiled before keeps its own draws.
def noisy(xs):
    return vmap(lambda x: x + torch.rand_like(x), randomness="different")(xs)


zeros, draws, matches = torch.zeros(6, 3, device=device), {}, {}
compiled_noisy = torch.compile(noisy, fullgraph=True)
for name, fn in [("eager", noisy), ("compiled", compiled_noisy)]:
    torch.manual_seed(0)
    draws[name] = fn(zeros)
with torch._inductor.config.patch(fallback_random=True):
    compiled_after = torch.compile(lambda xs: noisy(xs), fullgraph=True)
    for name, fn in [("before", compiled_noisy), ("after", compiled_after)]:
        torch.manual_seed(0)
        draws[f"compiled {name} fallback_random=True"] = fn(zeros)
for name, draw in draws.items():
    assert not (draw == draw[0]).all(), f"{name}: the samples share a draw"
    matches[name] = [torch.equal(draw, draws[k]) for k in ("eager", "compiled")]
    print(f"{name:37} one draw per row; equal to eager's, compiled's: {matches[name]}")
assert list(matches.values()) == [[1, 0], [0, 1], [0, 1], [1, 0]], matches

# %%
# Is it faster?
# -------------
# The recipe at the batch above and a larger one, by :class:`torch.utils.benchmark.Timer` on all
# threads after a warm-up: median, interquartile range (IQR), blocks. The resets above emptied
# dynamo's caches, not inductor's on disk: each size first compiles again, timed apart, with
# inductor's hits and misses. A timed call must run compiled code: ``fullgraph=True`` turns eager
# fallbacks into errors; no Python dispatch mode is active (under one, dynamo does not compile);
# once both sizes compiled, a profiled call at each holds one "Torch-Compiled Region" event, the
# same (one version serves both); and dynamo compiles nothing new while the timer runs.
big = torch.randn(16384, 3, device=device)
assert _get_current_dispatch_mode() is None
for configs in positions, big:
    counters["inductor"].clear()
    tic = time.perf_counter()
    result = compiled_grads(params, configs)
    sync()
    seconds = time.perf_counter() - tic
    print(f"first call at {len(configs)}: {seconds:.1f} s (measured once); ", end="")
    print(cache.format_map(counters["inductor"]))
    torch.testing.assert_close(result, energy_grads(params, configs))
with profile() as prof:  # after both compiled: what the timer will run
    for configs in positions, big:
        compiled_grads(params, configs)
regions = [e.name for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
print(f"profiled, one call at each size: {regions}")
assert len(regions) == 2 and regions[0] == regions[1], regions
graphs_before, times = counters["stats"]["unique_graphs"], {}
threads, stmt = torch.get_num_threads(), "fn(params, configs)"
for size, configs in [("small", positions), ("large", big)]:
    for method, fn in [("torch eager", energy_grads), ("compiled", compiled_grads)]:
        fn(params, configs)  # a warm-up
        t = benchmark.Timer(stmt, globals=globals(), num_threads=threads)
        m = times[size, method] = t.blocked_autorange(min_run_time=0.5)
        n = len(m.times)
        spread = f"IQR {m.iqr * 1e3:.2g} ms; {n} blocks" if n > 1 else "measured once"
        print(f"{len(configs)} configs, {method}: {m.median * 1e3:.3g} ms ({spread})")
    ratio = times[size, "compiled"].median / times[size, "torch eager"].median
    words = "takes {:.2f}x the time of" if ratio >= 1 else "is {:.2f}x faster than"
    print(f"  {size}: compiled", words.format(max(ratio, 1 / ratio)), "eager")
assert counters["stats"]["unique_graphs"] == graphs_before, "the timer compiled again"
fig, ax = plt.subplots(figsize=(6, 2.6), layout="constrained")
for i, (method, c) in enumerate(METHOD_COLORS.items()):
    ms = [times[size, method] for size in ("small", "large")]
    medians, spreads = [m.median * 1e3 for m in ms], [m.iqr * 1e3 / 2 for m in ms]
    ax.bar((0.4 * i, 1 + 0.4 * i), medians, 0.4, yerr=spreads, color=c, label=method)
ax.set_xticks([0.2, 1.2], [f"{len(c)} configurations" for c in (positions, big)])
ax.set(yscale="log", ylabel=f"median ms ± IQR/2, {device.type}")
ax.set_title("Per-sample gradients, vmap(grad(energy)), eager and compiled")
ax.legend()
plt.show()

# %%
# Compiled numbers may differ from eager ones
# -------------------------------------------
# ``backend="aot_eager"`` runs the graphs that dynamo and AOTAutograd trace on eager kernels;
# inductor decomposes them further and generates its own. Each against eager code, in float32 and
# float64: bitwise equal, and the largest difference over the largest entry. ``aot_eager`` gives
# eager's bits (asserted), so any difference comes from inductor's part: check compiled results
# against float64 with a relative bound, as the recipe does, not bitwise against eager code.
aot_grads = torch.compile(energy_grads, backend="aot_eager", fullgraph=True)
for p, configs, bound in (params, positions, 1e-6), (params64, x64.detach(), 1e-14):
    eager_out = energy_grads(p, configs)
    for name, fn in [("aot_eager", aot_grads), ("inductor", compiled_grads)]:
        out = fn(p, configs)
        share = ((out - eager_out).abs().max() / eager_out.abs().max()).item()
        same = torch.equal(out, eager_out)
        print(f"{configs.dtype} {name:9}: bitwise {same!s:5};", end=" ")
        print(f"max |difference| / max |entry| {share:.1e} (bound {bound:.0e})")
        assert same if name == "aot_eager" else share <= bound, (configs.dtype, name)

# %%
# What to remember
# ----------------
# * Compile a function of your own around the transforms, with ``fullgraph=True``, passing what
#   varies as tensors: the recipe and the table's nestings compile into one graph each.
# * Compiled ``vmap(jacfwd)`` of a function with a constant factor, and ``vmap(hessian)``, fail
#   with an internal assert and break the process (on the CPU, in this release): restart, use
#   ``vmap(jacrev(jacrev))`` or ``jvp`` over basis vectors.
# * Dynamo keeps about ``recompile_limit`` versions per code object, shared by all that a
#   transform (or a factory of yours) returns. Past it a call raises under ``fullgraph=True``, or
#   runs eagerly and nothing more compiles for that code object until ``torch.compiler.reset()``.
# * Check compiled results against float64 with a relative bound, not bitwise against eager code.
