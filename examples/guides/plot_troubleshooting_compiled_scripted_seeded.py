"""
Troubleshooting, part 5: compiled operators, scripts, stop-gradients, seeds, solvers, profiler
==============================================================================================

After parts 1 to 4 (:ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py` links them all): a
custom operator under ``torch.compile(vmap(f))``, ``vmap`` over TorchScript, Hessians through a
straight-through estimator, ensemble seeds, Jacobians of an adaptive ODE solve, profiler memory.
Titles begin with the message users reported (2.13's; 2.0's where marked), alphabetically, silent
problems ("No error") last. Each fix is checked against an independent reference.
"""

import ctypes
import inspect
import json
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import torch
from torch import Tensor
from torch.func import grad, hessian, jacfwd, jacrev, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
wide64 = dict(device=device, dtype=torch.float64)
fixed, broken = {}, {}  # check -> (relative error, bound); silent failure -> its error


def gap(got, want):  # the norm of the difference over the reference's norm
    got, want = (torch.as_tensor(t).detach().cpu().double() for t in (got, want))
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def agrees(check, got, want, bound):  # bound 0: bit for bit
    error = gap(got, want)
    room = f"{bound / error:.0f}x under it" if error else "exact"
    print(f"  {check}: relative error {error:.1e} (bound {bound:g}, {room})")
    assert error < bound or error == bound == 0, f"{check}: {error:.2e} >= {bound:.0e}"
    fixed[check] = (error, bound)


# %%
# expected size ...==..., stride ...==... at dim=0 ... a incorrect fake (aka meta) kernel
# ---------------------------------------------------------------------------------------
# ``torch.compile(vmap(f))`` calling a ``torch.library.custom_op`` whose fake kernel has the real
# kernel's shape but not its strides: eager calls on real tensors never run the fake, while
# Inductor's generated code checks its strides and raises this ``AssertionError``. pytorch#146536
# reported such a quantile operator silently wrong; pytorch#141455's assert is gone.
rows = torch.randn(6, 9, device=device)
levels = torch.tensor([0.1, 0.5, 0.9], device=device)
per_row = vmap(lambda row: quantiles(row, levels, 0))  # quantiles: defined next


def quantile_op(name, layout):
    @torch.library.custom_op(f"stats::{name}", mutates_args=())
    def op(x: Tensor, q: Tensor, dim: int) -> Tensor:
        return layout(torch.quantile(x, q, dim))

    @op.register_fake
    def _(x, q, dim):  # the right shape, contiguous strides
        return x.new_empty(q.numel(), *x.shape[:dim], *x.shape[dim + 1 :])

    @op.register_vmap
    def _(info, in_dims, x, q, dim):  # x batched: batch dimension last, one call
        return op(x.movedim(in_dims[0], -1), q, dim), -1

    return op


quantiles = quantile_op("quantiles", lambda out: out)  # the output as it comes
by_loop = torch.stack([torch.quantile(row, levels) for row in rows])
exact = 0 if device.type == "cpu" else 1e-6  # the CPU's loop: bit for bit
agrees("custom op, eager vmap", per_row(rows), by_loop, exact)
real = quantiles(rows.T, levels, 0)
fake = quantiles(rows.T.to("meta"), levels.to("meta"), 0)  # meta tensors: the fake
print(f"strides: the real kernel's output {real.stride()}, the fake's {fake.stride()}")
assert real.shape == fake.shape and real.stride() != fake.stride()
try:
    torch.compile(per_row, fullgraph=True)(rows)
    raise RuntimeError("the compiled call raised nothing")
except AssertionError as err:  # its type exactly, and its words
    said = " ".join(str(err).split())
    print(f"AssertionError, as expected: {textwrap.shorten(said, 125)}")
    assert type(err) is AssertionError and "expected size" in said, said
    assert "stats.quantiles" in said and "incorrect fake (aka meta) kernel" in said
# The fix: kernel and fake agree on strides (here the kernel returns a contiguous copy). The
# message's ``torch.library.opcheck`` finds the mismatch in eager mode. Reference: the loop.
dense = quantile_op("quantiles_dense", Tensor.contiguous)
compiled = torch.compile(vmap(lambda row: dense(row, levels, 0)), fullgraph=True)
agrees("custom op, compile(vmap), fullgraph", compiled(rows), by_loop, exact)

# %%
# FALLBACK path has been taken inside: torch::jit::fuser::cuda::runCudaFusionGroup (2.0)
# --------------------------------------------------------------------------------------
# nvFuser's ``UserWarning`` (PyTorch 2.0) under ``vmap`` of a scripted function, pytorch#98557.
# 2.13's TorchScript has no nvFuser (its switches warn "nvfuser is no longer supported in torch
# script"); ``torch.jit.script`` warns it is deprecated. On the CPU, ``vmap`` calls match a loop and
# warn nothing; the graph is plain operators. On CUDA, TorchScript's fuser (NNC) fuses a profiled
# function: on an H100 with torch 2.11.0+cu130, ``vmap`` calls of it raised "Cannot access data
# pointer of Tensor that doesn't have storage" (probably, the fused kernel reads memory a batched
# tensor lacks). On CUDA the page prints each call's outcome and checks ``torch.jit.fuser("none")``.
# The route: ``vmap`` the Python function
# (:ref:`sphx_glr_auto_examples_guides_plot_compile_and_transforms.py`).


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


batch = torch.randn(8, 16, device=device)
looped = torch.stack([quick_gelu(row) for row in batch])
with warnings.catch_warnings(action="always", record=True) as heard:
    scripted = torch.jit.script(quick_gelu)
no_storage = "Cannot access data pointer of Tensor that doesn't have storage"
outcomes = []  # per call: equal to the loop, or (on CUDA, once fused) the error
with warnings.catch_warnings(action="always", record=True) as heard_calls:
    for call in range(3):  # TorchScript optimises after its first, profiling, runs
        try:
            got = vmap(scripted)(batch)
        except RuntimeError as refused:
            assert device.type == "cuda" and no_storage in str(refused), refused
            outcomes.append(f"RuntimeError: {no_storage}")
            continue
        agrees(f"vmap(scripted), call {call + 1}", got, looped, 1e-7)
        outcomes.append("equal to the loop")
graph = torch.jit.last_executed_optimized_graph()  # this thread's last finished call's
kinds = sorted({n.kind() for n in graph.nodes()}) if graph is not None else []
print(f"torch.jit.script warns: {[w.category.__name__ for w in heard]}; the vmap calls: "
      f"{len(heard_calls)} warnings, {outcomes}; graph: {kinds}")  # fmt: skip
assert [w.category for w in heard] == [DeprecationWarning]
plain = all(kind.startswith(("aten::", "prim::Constant")) for kind in kinds)
assert device.type != "cpu" or (plain and not heard_calls)  # nothing fused
if device.type == "cuda":  # the fuser off, for the same function compiled afresh
    with torch.jit.fuser("none"):
        unfused = torch.jit.CompilationUnit(inspect.getsource(quick_gelu)).quick_gelu
        for call in range(3):
            agrees(f"fuser off, call {call + 1}", vmap(unfused)(batch), looped, 1e-7)
agrees("vmap(the Python function)", vmap(quick_gelu)(batch), looped, 1e-7)

# %%
# (No error) a straight-through estimator written with .data: not stop_gradient's Hessian
# ---------------------------------------------------------------------------------------
# functorch#353: the Hessian through ``q(y) = tanh(y) + (clip(round(y)) - tanh(y)).detach()``
# disagreed with JAX's ``stop_gradient``, which stops the gradient at every order: the outer
# derivative too sees ``q`` move like ``tanh``. 2.13's ``.detach()`` does too (closed form below;
# r = M q(y) - M x, s = 1 - tanh²(y)). ``.data`` hides the dependence from the innermost transform
# only; the outer one sees ``clip(round(y))``, of derivative zero, and keeps the first term,
# ``bend``: the derivative of the gradient as computed, as central differences of ``grad`` find.
# Wrong under JAX's convention only, silently; ``torch.autograd`` gives the closed form with it.
# H = diag(-2 tanh(y) s ⊙ Mᵀr/‖r‖) + diag(s) Mᵀ (I/‖r‖ - r rᵀ/‖r‖³) M diag(s).
mix = torch.tensor([[-1.7055013, 0.214439], [1.5994732, 1.179864]], **wide64)
target = torch.tensor([0.279999, -1.8200971], **wide64)
point = torch.tensor([-0.33679163, -1.0274953], **wide64)


def objective(y, stop=Tensor.detach):  # q(y): tanh(y), moved by a stopped step
    smooth = torch.tanh(y)
    q = smooth + stop(torch.clip(torch.round(y), -1, 1) - smooth)
    return torch.linalg.vector_norm(mix @ q - mix @ target) + 0.1 * y.abs().sum()


r = mix @ torch.clip(torch.round(point), -1, 1) - mix @ target
slope = 1 - torch.tanh(point) ** 2
bend = torch.diag(-2 * torch.tanh(point) * slope * (mix.T @ r) / r.norm())
inner = torch.eye(2, **wide64) / r.norm() - torch.outer(r, r) / r.norm() ** 3
closed = bend + torch.diag(slope) @ mix.T @ inner @ mix @ torch.diag(slope)
agrees("hessian, .detach()", hessian(objective)(point), closed, 1e-15)
with jax.enable_x64(True):  # the same function with JAX's stop_gradient, in float64
    as_jax = [jnp.asarray(t.cpu().numpy()) for t in (mix, target, point)]

    def objective_jax(y, m, x):
        smooth = jnp.tanh(y)
        q = smooth + jax.lax.stop_gradient(jnp.clip(jnp.round(y), -1, 1) - smooth)
        return jnp.linalg.norm(m @ q - m @ x) + 0.1 * jnp.abs(y).sum()

    by_jax = jax.jit(jax.hessian(objective_jax))(as_jax[2], *as_jax[:2])  # float64
agrees("JAX stop_gradient (checks the closed form)", by_jax, closed, 1e-15)
data_of = lambda t: t.data  # noqa: E731
through_data = hessian(objective)(point, data_of)
print(f".data: diagonal {through_data.diagonal().tolist()}, zeros off it (the issue's)")
reported = torch.diag(through_data.new_tensor([-0.1969, 0.5616]))  # in functorch#353
assert torch.allclose(through_data, reported, atol=1e-4)
agrees(".data: the first term, bend", through_data, bend, 1e-14)
broken["STE Hessian with .data, JAX's convention"] = gap(through_data, closed)
g, nudges = grad(objective), 1e-6 * torch.eye(2, **wide64)  # central differences
moved = [(g(point + e) - g(point - e)) / 2e-6 for e in nudges]  # column j: by y_j
agrees("central differences of grad: bend", torch.stack(moved, 1), bend, 1e-8)
by_autograd = torch.autograd.functional.hessian(lambda y: objective(y, data_of), point)
agrees("torch.autograd's hessian, .data", by_autograd, closed, 1e-14)

# %%
# (No error) every ensemble member draws the same noise, or noise that moves with the ensemble
# --------------------------------------------------------------------------------------------
# ``vmap`` has no generator per slice in 2.13: ``randomness="same"`` gives every member one draw;
# ``"different"`` one draw of the whole batch from one generator (``generator=`` too), the numbers
# of one ``torch.randn`` of that size. Member i's noise is its row i, which moves with the number of
# members where ``randn``'s first numbers depend on how many it draws: on the CPU, for 10 numbers
# against 20 (the randomness page: rows of 10, not of 64, against a loop). Fix: a seeded
# :class:`torch.Generator` per member draws all its steps' noise in one call, a ``vmap`` input.
# More: :ref:`sphx_glr_auto_examples_models_as_functions_plot_randomness_under_transforms.py`.
arguments = list(inspect.signature(vmap).parameters)
print(f"vmap's arguments: {arguments}")
assert "generator" not in arguments and "randomness" in arguments
members, steps, width = 4, 6, 5
seeds = [1000 + member for member in range(members)]


def noise_in_vmap(count, mode):
    source = torch.Generator(device).manual_seed(7)
    draw = lambda w: w + torch.randn(width, generator=source, device=device)  # noqa: E731
    return vmap(draw, randomness=mode)(torch.zeros(count, width, device=device))


alike = noise_in_vmap(members, "same")
assert all(torch.equal(alike[0], row) for row in alike)  # every member: one draw
seven = torch.Generator(device).manual_seed(7)
block = torch.randn(members, width, generator=seven, device=device)
assert torch.equal(noise_in_vmap(members, "different"), block)  # one draw, all members
of_two, of_four = noise_in_vmap(2, "different")[0], noise_in_vmap(4, "different")[0]
print(f"member 0's noise, 2 members vs 4: the same? {torch.equal(of_two, of_four)}")
assert device.type != "cpu" or not torch.equal(of_two, of_four)  # 10 numbers vs 20
if not torch.equal(of_two, of_four):
    broken["member 0's noise, 2 vs 4 members"] = gap(of_four, of_two)
design, response = torch.randn(12, width, **wide64), torch.randn(12, **wide64)
rate, heat = 0.05, 0.01  # Langevin steps: w - rate g + sqrt(2 rate heat) ξ
misfit = lambda w: (design @ w - response).square().mean()  # noqa: E731


def ensemble(seeds):  # a generator per member draws every step's noise in one call
    own = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    noise = torch.stack([torch.randn(steps, width, generator=g, **wide64) for g in own])
    w = torch.zeros(len(seeds), width, **wide64)
    for step in range(steps):
        w = w - rate * vmap(grad(misfit))(w) + (2 * rate * heat) ** 0.5 * noise[:, step]
    return w


together = ensemble(seeds)
agrees("members 0-1: ensemble of 2, of 4", ensemble(seeds[:2]), together[:2], 1e-15)
alone = []  # reference: each member by itself, torch.manual_seed, autograd.grad
for seed in seeds:
    torch.random.manual_seed(seed)  # the global generator
    noise, w = torch.randn(steps, width, **wide64), torch.zeros(width, **wide64)
    for step in range(steps):
        (g,) = torch.autograd.grad(misfit(w.requires_grad_()), w)
        w = (w - rate * g + (2 * rate * heat) ** 0.5 * noise[step]).detach()
    alone.append(w)
agrees("ensemble of 4, members alone", together, torch.stack(alone), 1e-15)

# %%
# (No error) jacrev of a batched adaptive ODE solve: rows that finish early go wrong
# ----------------------------------------------------------------------------------
# Per-row Jacobians d y(T) / d y(0) of a batched solve (torchode#32): one ``jacrev`` of the row sum
# gives them all if rows are independent, with a step size per row (one step for the batch couples
# rows, by about the tolerance). A row that reaches T first must stop: stepping on by 0
# (``torch.minimum`` clips h to what is left), its ``jacrev`` goes wrong, silently. A zero step's
# error estimate is 0, so h grows by the cap, 5; the next ``minimum(0, 0)`` gives each side half of
# h's adjoint (asserted next), and the half to 2 - t comes back to h through t = t + h with the
# opposite sign. Over the zero steps the adjoint swings and grows by about √(cap/2) a step at the
# caps measured below (2 barely grows; larger caps, such as torchode's default, follow another
# rate, not run here), then cancels to rounding error where the row ended. ``jacfwd``
# splits ties too, but its tangents are 0 once a row ends. Fix (torchode's): a mask freezes finished
# rows, neither accepting nor adapting their steps. Reference: rows alone, central differences.
assert grad(lambda p: torch.minimum(*p))(torch.zeros(2, **wide64)).tolist() == [0.5] * 2
rates = torch.tensor([[0.5], [2.0], [4.0]], **wide64)  # damped pendulums, one per row
starts = torch.tensor([[1.0, 0.0], [0.5, -0.3], [-0.8, 0.4]], **wide64)


def swing(y, rate):  # (angle, velocity) -> their time derivatives, row by row
    pull = -(rate**2) * torch.sin(y[:, :1]) - 0.1 * y[:, 1:]
    return torch.cat([y[:, 1:], pull], dim=1)


def step32(y, h, rate):  # Bogacki-Shampine: a third-order step, a second-order twin
    k1 = swing(y, rate)
    k2 = swing(y + h * k1 / 2, rate)
    k3 = swing(y + 3 * h * k2 / 4, rate)
    third = y + h * (2 * k1 + 3 * k2 + 4 * k3) / 9
    return third, y + h * (7 * k1 / 24 + k2 / 4 + k3 / 3 + swing(third, rate) / 8)


def adaptive(y, rate, per_row=True, mask=True, cap=5.0, seen=lambda h: None):
    """To t = 2, tolerance 1e-5: a step size per row, or one for the batch."""
    t = y.new_zeros(len(y) if per_row else 1, 1)
    h = torch.full_like(t, 0.05)
    while bool((t < 2.0).any()):
        running = (t < 2.0) | (not mask)  # without the mask, ended rows step by 0
        h = torch.minimum(h, 2.0 - t)  # the step, or what is left of the way
        seen(h)
        third, second = step32(y, h, rate)
        scaled = (third - second) / (1e-5 + 1e-5 * third.abs())
        ratio = scaled.square().mean(1, keepdim=True)
        if not per_row:  # the worst row decides for all
            ratio = ratio.amax(0, keepdim=True)
        accept = (ratio <= 1) & running
        y, t = torch.where(accept, third, y), torch.where(accept, t + h, t)
        grown = h * (0.9 * (ratio + 1e-12) ** (-1 / 6)).clamp(0.2, cap)
        h = torch.where(running, grown, h)
    return y


def sum_trick(solve, transform=jacrev):  # (rows, 2, 2), one transform of the row sum
    return transform(lambda y: solve(y, rates).sum(0))(starts).permute(1, 0, 2)


def rows_alone(solve, eps=1e-6):  # each row solved by itself, central differences
    bumps = torch.eye(2, **wide64)[:, None] * eps
    return torch.stack([
        torch.stack([(solve(y + b, k) - solve(y - b, k))[0] / (2 * eps) for b in bumps], 1)
        for y, k in zip(starts[:, None], rates[:, None])
    ])  # fmt: skip


each = rows_alone(adaptive)
agrees("mask, sum trick", sum_trick(adaptive), each, 1e-8)
no_mask = lambda y, k: adaptive(y, k, mask=False)  # noqa: E731
per_row_error = [gap(a, b) for a, b in zip(sum_trick(no_mask), each)]
print(f"no mask, jacrev, error per row: {[f'{e:.1e}' for e in per_row_error]}")
assert max(per_row_error) > 1e-3  # the row that ends first
broken["ODE: no mask, jacrev"] = max(per_row_error)
agrees("no mask, jacfwd", sum_trick(no_mask, jacfwd), each, 1e-8)
for cap in (5.0, 2.0):  # no mask: the adjoint of each step h (the 1st is fixed)
    kept, y0 = [], starts.clone().requires_grad_()
    end = adaptive(y0, rates, mask=False, cap=cap, seen=kept.append).sum()
    back = torch.cat(torch.autograd.grad(end, kept[1:]), 1).abs()  # (rows, steps)
    zero = back[0, torch.cat(kept[1:], 1)[0] == 0]  # row 0 ends first: its zero steps
    growth = (zero.max() / zero[-1]) ** (1 / (len(zero) - 1))  # a step, on average
    print(f"no mask, cap {cap:.0f}: largest adjoint {back.max():.1e}; row 0's grows by "
          f"{growth:.3f} a zero step, √(cap/2) = {(cap / 2) ** 0.5:.3f}")  # fmt: skip
    assert abs(growth / (cap / 2) ** 0.5 - 1) < 0.01, growth  # the model above
    assert (back.max() > 1e10) == (cap > 2)
capped = lambda y, k: adaptive(y, k, mask=False, cap=2.0)  # noqa: E731
agrees("no mask, cap 2, jacrev", sum_trick(capped), rows_alone(capped), 1e-8)
blocks = jacrev(lambda y: adaptive(y, rates, per_row=False))(starts)  # (3, 2, 3, 2)
trick, own = blocks.sum(0).transpose(0, 1), blocks.diagonal(0, 0, 2).permute(2, 0, 1)
assert gap(trick, own) > 0  # the rows act on each other, through the step size
agrees("one step for all: sum trick, own blocks", trick, own, 1e-5)  # the tolerance
agrees("one step for all: own blocks, rows alone", own, each, 1e-4)

# %%
# (No error) memory grows at every step under torch.profiler.profile
# ------------------------------------------------------------------
# Without a ``schedule`` the profiler keeps every step's events in C++ memory (the first
# ``events()``, ``key_averages()`` or ``table()`` makes Python objects of them). The options set the
# size: ``record_shapes=True`` stores each operator's input shapes, ``with_stack=True`` adds an
# event per Python call. Gradients written by hand, without ``vmap``, grow too. Fix: only the
# options you use (for times, none) and a :func:`torch.profiler.schedule` (``wait``, ``warmup``,
# ``active``, ``repeat=1``) that records a few steps. Measured in a fresh CPU process: bytes in use
# from glibc's ``mallinfo2`` (2.33 on) and events, each first checked on known answers.
CHILD = """
import ctypes, json, os, torch
from torch.func import grad, vmap
from torch.profiler import ProfilerActivity, profile, schedule
torch.set_num_threads(1)
class Info(ctypes.Structure):  # glibc's struct mallinfo2: ten counts
    _fields_ = [(n, ctypes.c_size_t) for n in "a b c d mapped e f small g h".split()]
libc = ctypes.CDLL(None); libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
in_use = lambda: (libc.mallinfo2().small + libc.mallinfo2().mapped) / 1024  # KiB in use
torch.ones(8).add(1)  # the first operation's own start-up, before measuring
before = in_use(); block = torch.ones(2**24); found = {"64 MiB": (in_use() - before) / 1024}
kept = (ctypes.c_void_p * 8192)()  # small blocks: 120 B, plus glibc's 8 B header, 1 MiB
before = in_use(); kept[:] = [libc.malloc(120) for _ in kept]; found["small"] = in_use() - before
with profile(activities=[ProfilerActivity.CPU]) as prof:
    [torch.add(block[:3], 1) for _ in range(15)]
found["15 additions"] = sum(e.name == "aten::add" for e in prof.events())
w, xs, ys = torch.randn(16, 8), torch.randn(32, 16), torch.randn(32, 8)
by_vmap = vmap(grad(lambda w, x, y: (torch.tanh(x @ w) - y).square().sum()), (None, 0, 0))
def by_hand(w, xs, ys):  # the same per-sample gradients, written out
    r = torch.tanh(xs @ w)
    return torch.einsum("bi,bj->bij", xs, 2 * (r - ys) * (1 - r**2))
assert torch.allclose(by_hand(w, xs, ys), by_vmap(w, xs, ys), atol=1e-5)
def growth(step, tick=lambda: None, n=20):  # KiB per step, from step 5 to step n
    for i in range(n):
        step(w, xs, ys), tick()
        low = in_use() if i == 4 else low if i > 4 else None
    return (in_use() - low) / (n - 5)
cpu = dict(activities=[ProfilerActivity.CPU])
every = dict(cpu, record_shapes=True, profile_memory=True, with_stack=True)
few = dict(every, schedule=schedule(wait=1, warmup=1, active=2, repeat=1))
growth(by_hand), growth(by_vmap); found["no profiler"] = [growth(by_vmap), 0, 0]
for name, options in {"times only": cpu, "record_shapes": dict(cpu, record_shapes=True),
        "with_stack": dict(cpu, with_stack=True), "all three": every,
        "all three, schedule": few, "all three, by hand": every}.items():
    with profile(**options) as prof:
        kib = growth(by_hand if "hand" in name else by_vmap, prof.step)
    events = prof.events()
    found[name] = [kib, len(events), sum(e.is_python_function for e in events)]
print(json.dumps(found), flush=True)
os._exit(0)  # skips the interpreter's teardown
"""
glibc = sys.platform == "linux" and hasattr(ctypes.CDLL(None), "mallinfo2")
print(f"glibc 2.33's mallinfo2: {'found' if glibc else 'missing: not measured here'}")
per_step, command = {}, [sys.executable, "-c", CHILD]  # per_step: KiB more in use
if glibc:  # not on macOS, Windows, musl, glibc before 2.33
    run = subprocess.run(command, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:].decode()
    out = json.loads(run.stdout)
    tools = out.pop("64 MiB"), out.pop("small"), out.pop("15 additions")
    print(f"the tools: a 64 MiB tensor, {tools[0]:.2f} MiB more in use; 8192 mallocs of "
          f"120 + 8 B, {tools[1]:.1f} KiB; 15 additions, {tools[2]} aten::add events")  # fmt: skip
    assert abs(tools[0] - 64) < 0.05 and abs(tools[1] - 1024) < 1 and tools[2] == 15
    for name, (kib, events, calls) in out.items():
        print(f"{name:>19}: {kib:5.1f} KiB more in use per step; {events:5} events kept, "
              f"{calls:5} of them Python calls")  # fmt: skip
    per_step = {name: kib for name, (kib, *_) in out.items()}
    least = max(per_step["no profiler"], per_step["all three, schedule"], 0.5)
    assert min(per_step["times only"], per_step["all three, by hand"]) > 10 * least
    assert per_step["record_shapes"] > per_step["with_stack"] > per_step["times only"]
    assert out["with_stack"][2] > out["with_stack"][1] / 2 and not out["times only"][2]

# %%
# Every fix against its reference
# -------------------------------
# Left: each check's relative error (dot), its bound (bar; 0s at 1e-18), silent failures
# (crosses). Right: bytes in use added per profiled step (0.1 KiB or less: at 0.1).
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 7), layout="constrained")
errors, bounds = ([max(v, 1e-18) for v in values] for values in zip(*fixed.values()))
left.scatter(errors, list(fixed), color="black", zorder=3)
left.scatter(bounds, list(fixed), marker="|", s=200, color="0.55")
wrong = [f"wrong: {name}" for name in broken]
left.scatter(list(broken.values()), wrong, marker="x", s=60, color="black")
left.set(xscale="log", xlabel="relative error, ‖got - reference‖ / ‖reference‖")
left.set_title(f"{len(fixed)} checks, {len(broken)} silent failures ({device.type})")
left.invert_yaxis()
right.barh(list(per_step), [max(v, 0.1) for v in per_step.values()], color="0.55")
right.set(xscale="log", xlim=(0.05, None), xlabel="KiB / step")
right.set_title("memory" if per_step else "memory: not measured here (no mallinfo2)")
right.tick_params(axis="y", left=bool(per_step), labelleft=bool(per_step))
plt.show()

# %%
# What to remember
# ----------------
# * A custom operator's fake kernel must match the real kernel's strides, not only its shape:
#   compiled code checks them. ``vmap`` the Python function rather than a TorchScript one.
# * Straight-through estimator: ``.detach()`` gives JAX's ``stop_gradient`` Hessian; under
#   torch.func, ``.data`` gives the derivative of the computed gradient (stopped innermost only).
# * ``vmap`` has no generator per member: draw each member's noise with its own
#   :class:`torch.Generator`, outside, and pass it in.
# * A row sum's ``jacrev`` gives per-row Jacobians of an ODE solve with a step per row; freeze
#   finished rows with a mask, as torchode does, or ``jacrev`` can go wrong, silently.
# * Profile with a ``schedule`` and only the options you read: without one, every step's events
#   stay in memory.
