"""
Sparse Jacobians of PDE residuals: colouring, and Newton–Krylov without the matrix
==================================================================================

A finite-difference residual ``F(u)`` with ``N`` unknowns has a band ``N × N`` Jacobian.
``jacfwd`` pushes ``N`` basis vectors through and stores ``N²`` numbers, nearly all zero. Here
you get it from three ``jvp`` calls by *colouring* its columns, store it as a sparse CSR tensor,
and solve ``F(u) = 0`` by Newton's method, checked against a closed form; then drop the matrix:
Newton–Krylov needs only products ``J v``. A 2-D stencil needs five colours. Last, you time both
solvers, see when ``linearize`` pays for its trace, and time the Jacobian as ``N`` grows.
"""

# %%
# Setup
# -----
# Everything runs in float64; SciPy's solvers get CPU copies (why, below).
import math
import warnings
from functools import partial

import matplotlib.pyplot as plt
import scipy.sparse
import scipy.sparse.linalg
import torch
import torch.nn.functional as F
from torch.func import grad, jacfwd, jvp, linearize, vmap
from torch.utils.benchmark import Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64 = dict(dtype=torch.float64, device=device)
EPS = torch.finfo(torch.float64).eps
METHOD_COLORS = {"jacfwd": "#E69F00", "vmap": "#009E73"}


def close(what, got, reference, bound):  # each entry within bound; prints the worst
    worst = (got - reference).abs().max().item()
    print(f"{what:48s} worst error {worst:.1e}, bound {bound:.1e}")
    assert worst <= bound, f"{what}: error {worst:.2e} above {bound:.2e}"


# %%
# The problem: Bratu's equation, and its exact solution
# -----------------------------------------------------
# ``u'' + λ eᵘ = 0`` on ``(0, 1)``, ``u(0) = u(1) = 0``, is Frank-Kamenetskii's model of thermal
# ignition in a slab. Below a turning point ``λ*``, the largest value of ``θ² / (2 cosh²(θ/4))``,
# it has two solutions; the lower one is ``u(x) = −2 ln[cosh((x − ½) θ/2) / cosh(θ/4)]``, ``θ``
# the smaller root of ``θ = √(2λ) cosh(θ/4)``. With ``λ = 1``, a scalar Newton iteration finds
# ``θ``; ``vmap(grad(grad(u)))`` gives ``u''`` at 101 points, where ``u'' + λ eᵘ`` must vanish.
lam, thetas = 1.0, torch.linspace(0.01, 20, 200_001, dtype=torch.float64)
turning = (thetas**2 / (2 * torch.cosh(thetas / 4) ** 2)).max().item()
assert abs(turning - 3.513830719) < 1e-7 and lam < turning  # λ* from the literature
k, theta = math.sqrt(2 * lam), 1.0  # Newton from 1 finds the smaller root
for _ in range(20):
    theta -= (theta - k * math.cosh(theta / 4)) / (1 - k * math.sinh(theta / 4) / 4)
assert abs(theta - k * math.cosh(theta / 4)) < 4 * EPS * theta


def exact(x):
    return -2 * torch.log(torch.cosh((x - 0.5) * theta / 2) / math.cosh(theta / 4))


points = torch.linspace(0, 1, 101, **f64)
ode = vmap(grad(grad(exact)))(points) + lam * torch.exp(exact(points))
print(f"λ* = {turning:.7f}, θ = {theta:.15f}, u(½) = {exact(points[50]):.6f}")
close("closed form: u'' + λ exp(u) at 101 points", ode, 0, 16 * EPS * theta**2)
assert exact(points[[0, -1]]).abs().max() < 4 * EPS  # u(0) = u(1) = 0


# %%
# The residual, and its dense Jacobian
# ------------------------------------
# On ``n`` interior points ``x_i = i h``, ``h = 1/(n + 1)``, the three-point difference gives
# ``F_i(u) = (u_{i−1} − 2u_i + u_{i+1}) / h² + λ e^{u_i}``, zeros padded for the boundary: a
# function of one vector, so :func:`~torch.func.jacfwd` gives its Jacobian. At a random ``u``
# the corner shows the band; every row has nonzeros only in columns ``i − 1``, ``i``, ``i + 1``.
def bratu_1d(u):
    h = 1 / (u.shape[-1] + 1)
    padded = F.pad(u, (1, 1))  # u_0 = u_{n+1} = 0
    return (padded[:-2] - 2 * u + padded[2:]) / h**2 + lam * torch.exp(u)


n, probe = 40, 0.3 * torch.randn(40, **f64)
dense = jacfwd(bratu_1d)(probe)
print(dense[:4, :4].cpu())
apart = (torch.arange(n)[:, None] - torch.arange(n)).abs()  # |i − j| for entry (i, j)
assert (dense.cpu()[apart > 1] == 0).all()


# %%
# Three colours, three ``jvp`` calls
# ----------------------------------
# ``J s`` sums the columns of ``J`` that the seed ``s`` selects. Colour column ``j`` by
# ``j mod 3`` and give seed ``c`` ones at the columns of colour ``c``: two columns of a colour
# are three or more apart, so no row holds both, and each nonzero ``J_ij`` stands alone in entry
# ``i`` of ``J s_{colour(j)}``. So three :func:`~torch.func.jvp` products, one
# :func:`~torch.func.vmap` call, give the whole band for any ``n`` (Curtis, Powell and Reid
# grouped finite differences so in 1974); a row with ``k`` nonzeros needs at least ``k`` colours.
# :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_diagonals_and_higher_orders.py`
# keeps only a diagonal this way; here every entry goes into a CSR tensor, checked against
# ``jacfwd`` and the closed form (``1/h²`` off the diagonal, ``−2/h² + λ e^{u_i}`` on it). On a
# mesh, take the pattern from its cells and colour greedily: each column the lowest colour that
# no column sharing a row with it has.
def stencil_pattern(shape, offsets, weights):  # built on the CPU, then moved
    flat = torch.arange(math.prod(shape))
    at = torch.stack(torch.unravel_index(flat, shape))  # grid index per unknown
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]  # row-major
    rows, cols = [], []
    for offset in offsets:
        moved = at + torch.tensor(offset)[:, None]
        inside = ((moved >= 0) & (moved < torch.tensor(shape)[:, None])).all(0)
        rows.append(flat[inside])
        cols.append(flat[inside] + sum(o * s for o, s in zip(offset, strides)))
    colour = (torch.tensor(weights)[:, None] * at).sum(0) % len(offsets)
    return tuple(t.to(device) for t in (torch.cat(rows), torch.cat(cols), colour))


def check_colouring(rows, cols, colour):  # no two columns of a colour share a row
    pairs = rows * (int(colour.max()) + 1) + colour[cols]  # one per (row, colour)
    assert pairs.unique().numel() == rows.numel(), "a row holds two columns of a colour"


def coloured_jacobian(fn, u, rows, cols, colour):
    """The Jacobian of fn at u, nonzero at (rows, cols), from one jvp per colour."""
    seeds = colour == torch.arange(int(colour.max()) + 1, device=u.device)[:, None]
    compressed = vmap(lambda s: jvp(fn, (u,), (s,))[1])(seeds.to(u.dtype))
    values = compressed[colour[cols], rows]  # J_ij is entry i of J s_colour(j)
    where, size = torch.stack([rows, cols]), (len(u), len(u))
    entries = torch.sparse_coo_tensor(where, values, size, check_invariants=True)
    with warnings.catch_warnings():  # to_sparse_csr warns that CSR is in beta
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return entries.coalesce().to_sparse_csr()


def closed_form_jacobian(rows, cols, u, h, centre):  # centre: −2 in 1-D, −4 in 2-D
    by_hand = torch.zeros(len(u), len(u), **f64)
    on_diagonal = centre / h**2 + lam * torch.exp(u[rows])
    by_hand[rows, cols] = torch.where(rows == cols, on_diagonal, 1 / h**2)
    return by_hand


THREE_POINT = dict(offsets=[(-1,), (0,), (1,)], weights=[1])
band = stencil_pattern((n,), **THREE_POINT)
check_colouring(*band)
sparse = coloured_jacobian(bratu_1d, probe, *band)
by_hand = closed_form_jacobian(band[0], band[1], probe, 1 / (n + 1), -2)
print(f"CSR Jacobian: {sparse._nnz()} values stored of {n * n}, from 3 jvp calls")
for what, reference in (("dense jacfwd", dense), ("the closed form", by_hand)):
    close(f"colouring vs {what}, all entries", sparse.to_dense(), reference,
          4 * EPS * reference.abs().max().item())  # fmt: skip

# %%
# Newton's method with the sparse Jacobian
# ----------------------------------------
# Newton solves ``J(u_k) d = −F(u_k)`` and moves to ``u_k + d``. ``torch.sparse.spsolve``
# refuses CPU tensors (below; on CUDA it needs a build with NVIDIA's cuDSS, not checked here);
# SciPy's ``spsolve`` takes CPU copies of the CSR arrays, checked against ``torch.linalg.solve``
# on ``jacfwd``'s Jacobian of the residual plus an upwind term: a ``J`` not symmetric, so that a
# transpose (in the colouring too) would show.
try:
    torch.sparse.spsolve(sparse.cpu(), torch.ones(n, dtype=torch.float64))
    raise AssertionError("torch.sparse.spsolve solved a CPU system")
except NotImplementedError as err:
    assert "aten::_spsolve" in str(err) and "SparseCsrCPU" in str(err), str(err)
    print("torch.sparse.spsolve on the CPU:", str(err).split(". ")[0])


def sparse_solve(J, rhs):
    arrays = (J.values(), J.col_indices(), J.crow_indices())
    A = scipy.sparse.csr_matrix(tuple(a.cpu().numpy() for a in arrays), shape=J.shape)
    return torch.from_numpy(scipy.sparse.linalg.spsolve(A, rhs.cpu().numpy())).to(rhs)


upwind = lambda w: bratu_1d(w) + (w - F.pad(w, (1, 0))[:-1]) * (len(w) + 1)  # noqa: E731
rhs = torch.randn(n, **f64)
reference = torch.linalg.solve(jacfwd(upwind)(probe), rhs)
close("SciPy's sparse solve vs torch.linalg.solve",
      sparse_solve(coloured_jacobian(upwind, probe, *band), rhs), reference,
      256 * EPS * reference.abs().max().item())  # fmt: skip


def newton_sparse(fn, u, pattern, most=8, tol=1e-9):
    norms = []
    for _ in range(most):  # Newton steps at most
        value = fn(u)
        norms.append(value.norm().item())
        if norms[-1] < tol:
            break
        u = u + sparse_solve(coloured_jacobian(fn, u, *pattern), -value)
    return u, norms


# %%
# From ``u = 0`` on 31 to 255 points, ``r_k = ‖F(u_k)‖`` per step. Newton squares the error
# each step, so the order ``log(r_{k+1}/r_k) / log(r_k/r_{k−1})`` nears 2; each one with
# ``r_{k+1}`` above 1e-8, clear of rounding, must exceed 1.8 (inexact steps bring it near 1,
# below). The discrete solution misses the exact one by ``O(h²)``: halving ``h`` must divide the
# largest error by about 4.
def report(what, norms):  # prints the residuals and orders; returns the orders
    r = torch.tensor(norms, dtype=torch.float64).log()
    orders = ((r[2:] - r[1:-1]) / (r[1:-1] - r[:-2]))[torch.tensor(norms[2:]) > 1e-8]
    print(f"{what}, ‖F‖ per step:", ", ".join(f"{r:.1e}" for r in norms))
    print("    measured orders:", ", ".join(f"{p:.2f}" for p in orders))
    assert norms[-1] < 1e-9, norms
    return orders.tolist()


sol, errors = {}, []
for n in (31, 63, 127, 255):
    x = torch.linspace(0, 1, n + 2, **f64)[1:-1]
    sol[n], norms = newton_sparse(bratu_1d, 0 * x, stencil_pattern((n,), **THREE_POINT))
    assert min(report(f"n = {n}, Newton", norms)) > 1.8
    errors.append((sol[n] - exact(x)).abs().max().item())
    print(f"    max |u − exact| = {errors[-1]:.3e}, error·(n+1)² = "
          f"{errors[-1] * (n + 1) ** 2:.4f}")  # fmt: skip
shrink = torch.tensor(errors[:-1]) / torch.tensor(errors[1:])
print("the error shrinks by", ", ".join(f"{s:.4f}x" for s in shrink), "per halving")
assert ((shrink - 4).abs() < 0.01).all(), shrink
band_127, u_newton = stencil_pattern((127,), **THREE_POINT), sol[127]


# %%
# Newton–Krylov: the Jacobian never formed
# ----------------------------------------
# A Krylov solver needs ``J`` only through products ``J v``. :func:`~torch.func.linearize`
# evaluates ``F`` at ``u_k``, traces its forward-mode derivative into a graph, folds the parts
# without the tangent into constants (``torch.fx``'s ``const_fold``, in its source) and returns
# ``v ↦ J(u_k) v``. ``−J`` is symmetric by construction and definite at the root (checked
# below); conjugate gradients (CG, written out, testing ``pᵀ(−J)p > 0``) solve ``−J d = F`` to
# ``η_k ‖F‖``, ``η_k = min(0.1, ‖F(u_k)‖)``: quadratic convergence near the root, in theory
# (Dembo, Eisenstat and Steihaug, 1982). ``scipy.optimize.newton_krylov`` takes products by
# finite differences, the classic way (Knoll and Keyes, 2004), with a step ``ε`` to tune.
def linear_map(fn, u):
    with warnings.catch_warnings():  # from linearize's tracer; the map is checked below
        warnings.filterwarnings("ignore", "Attempted to insert a get_attr")
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated")
        return linearize(fn, u)


def conjugate_gradients(apply_A, b, tol, max_steps):
    x, r, p, rr = torch.zeros_like(b), b, b, b @ b
    for step in range(1, max_steps + 1):
        Ap = apply_A(p)
        if (curvature := p @ Ap) <= 0:
            raise ValueError(f"A not positive definite: pᵀAp = {curvature:.2e}")
        x, r = x + (rr / curvature) * p, r - (rr / curvature) * Ap
        rr, rr_old = r @ r, rr
        if rr.sqrt() <= tol:
            return x, step
        p = r + (rr / rr_old) * p
    raise RuntimeError(f"CG did not reach {tol:.1e} in {max_steps} steps")


def newton_krylov(fn, u, most=12, tol=1e-9, goal=lambda r: min(0.1, r) * r):
    norms, cg_steps = [], []
    for _ in range(most):  # Newton steps at most
        value = fn(u)
        norms.append(value.norm().item())
        if norms[-1] < tol:  # tested before tracing: one linearize per step taken
            break
        apply_J = linear_map(fn, u)[1]
        minus_J = lambda v: -apply_J(v)  # noqa: B023, E731
        d, used = conjugate_gradients(minus_J, value, goal(norms[-1]), 10 * len(u))
        u = u + d
        cg_steps.append(used)
    return u, norms, cg_steps


# %%
# The product, against the coloured ``J`` at the probe point. SciPy's ``cg`` and ``gmres`` take
# the map wrapped in a ``LinearOperator``, on CPU copies: ``cg`` must agree with the direct
# solve. Then what CG needs, at the solution for ``n = 127``: ``J`` equals its transpose, and
# its largest eigenvalue is negative.
(_, apply_J), v = linear_map(bratu_1d, probe), torch.randn(len(probe), **f64)
close("linearize's J v vs the coloured sparse J @ v", apply_J(v), sparse @ v,
      16 * EPS * (sparse.to_dense().abs() @ v.abs()).max().item())  # fmt: skip
matvec = lambda x: -apply_J(torch.from_numpy(x).to(v)).cpu().numpy()  # noqa: E731
minus_J = scipy.sparse.linalg.LinearOperator((40, 40), matvec=matvec, dtype=float)
d, info = scipy.sparse.linalg.cg(minus_J, rhs.cpu().numpy(), rtol=1e-12, atol=0)
reference = sparse_solve(sparse, -rhs)  # −J d = rhs
assert info == 0, f"SciPy's cg stopped with info {info}"
close("SciPy's cg on linearize's map vs sparse solve", torch.from_numpy(d).to(v),
      reference, 256 * EPS * reference.abs().max().item())  # fmt: skip
J = coloured_jacobian(bratu_1d, u_newton, *band_127).to_dense()
top = torch.linalg.eigvalsh(J).max().item()
print(f"n = 127, at the solution: J symmetric, largest eigenvalue {top:.3f}")
assert (J == J.T).all() and top < 0


# %%
# What the shrinking tolerance buys, on ``n = 127`` from ``u = 0``, beside a fixed ``η = 0.1``.
# While ``‖F‖ > 0.1`` the cap holds ``η`` at 0.1 (low early orders, by design); then its last
# order must exceed 1.8, in fewer Newton steps than the fixed one (orders below 1.5), and
# land on Newton's root to 256 roundings of ``max |u|``.
shrinking = newton_krylov(bratu_1d, 0 * u_newton)
fixed = newton_krylov(bratu_1d, 0 * u_newton, most=20, goal=lambda r: 0.1 * r)
orders = [report(f"Newton–Krylov, η = {name}, CG steps {r[2]}", r[1])
          for name, r in (("min(0.1, ‖F‖)", shrinking), ("0.1", fixed))]  # fmt: skip
assert orders[0][-1] > 1.8 and max(orders[1]) < 1.5, orders
assert len(shrinking[1]) < len(fixed[1])  # fewer Newton steps
close("Newton–Krylov vs Newton, coloured J", shrinking[0], u_newton,
      256 * EPS * u_newton.max().item())  # fmt: skip


# %%
# Two dimensions: five colours for the five-point stencil
# -------------------------------------------------------
# On the unit square, ``Δu + λ eᵘ = 0`` with ``u = 0`` on the edges, on an ``m × m`` grid:
# ``F_ij = (u_{i−1,j} + u_{i+1,j} + u_{i,j−1} + u_{i,j+1} − 4u_ij) / h² + λ e^{u_ij}``, five
# nonzeros per row, so five colours at least. ``(i + 2j) mod 5`` suffices: two columns sharing
# a row lie ``(±2, 0)``, ``(0, ±2)``, ``(±1, ±1)``, ``(±1, 0)`` or ``(0, ±1)`` apart, never a
# multiple of 5 in colour (``check_colouring`` confirms it). The helpers serve unchanged.
def bratu_2d(u):
    m = math.isqrt(u.shape[-1])
    p = F.pad(u.reshape(m, m), (1, 1, 1, 1))
    centre = p[1:-1, 1:-1]
    lap = p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * centre
    return (lap * (m + 1) ** 2 + lam * torch.exp(centre)).flatten()


FIVE_POINT = dict(offsets=[(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)], weights=[1, 2])
m, stencil = 12, stencil_pattern((12, 12), **FIVE_POINT)
check_colouring(*stencil)
probe_2d = 0.3 * torch.randn(m * m, **f64)
sparse_2d = coloured_jacobian(bratu_2d, probe_2d, *stencil).to_dense()
print(f"m = {m}: {m * m} unknowns, {len(stencil[0])} nonzeros from 5 jvp calls")
by_hand = closed_form_jacobian(stencil[0], stencil[1], probe_2d, 1 / (m + 1), -4)
close("2-D: colouring vs the closed form, all entries", sparse_2d, by_hand,
      4 * EPS * by_hand.abs().max().item())  # fmt: skip
# Newton–Krylov on a 31 × 31 grid, unchanged. No closed form: ‖F‖ must fall below 1e-9 (the
# solve; bratu_2d was checked through its Jacobian above), and u must peak at the centre.
u_free, norms, cg_steps = newton_krylov(bratu_2d, torch.zeros(31 * 31, **f64))
report(f"2-D Newton–Krylov, CG steps {cg_steps}", norms)
assert bratu_2d(u_free).norm() < 1e-9 and u_free.argmax() == 31 * 31 // 2


# %%
# Measuring: both solvers end to end, then the Jacobian as ``N`` grows
# --------------------------------------------------------------------
# :class:`~torch.utils.benchmark.Timer` times blocks of calls on all threads: median, IQR
# (interquartile range), count; ``adaptive_autorange``'s first calls warm up, says its source. Whole
# solves from ``u = 0`` at ``n`` = 127 and 511. CG took up to about ``(n+1)/2`` steps per Newton
# step (asserted, within 4), probably near finite termination: ``F`` and ``u`` stay in the
# ``(n+1)/2``-dimensional space mirror-symmetric about ``x = ½``. Each Newton step also traces a
# ``linearize`` (time ``L``; the traces' share is printed); a product of its map takes ``p``, a
# fresh ``jvp`` ``j``. The rule: one trace beats a ``jvp`` per product once a Newton step needs more
# than ``L / (j − p)`` products (each ``n``'s side printed). A preconditioner (Knoll and Keyes,
# 2004) cuts products, not traces. Then the Jacobian alone, ``N`` = 64 to 16,384: dense ``jacfwd``
# (to 2048), colouring, output bytes (not peak memory): ``8N²`` dense; CSR, 8 per value,
# column index (``3N − 2`` each), row start (``N + 1``).
def timed(call):  # threshold=inf: stop once there are 4 blocks and 0.05 s
    timer = Timer("call()", globals={"call": call}, num_threads=torch.get_num_threads())
    return timer.adaptive_autorange(threshold=math.inf, min_run_time=0.05)


def show(t):
    return f"{t.median * 1e3:.4g} ms (IQR {t.iqr * 1e3:.3g} ms, {len(t.times)} blocks)"


def compare(name_a, a, name_b, b):  # a ratio of medians, worded by which is larger
    if a.median < b.median:
        (name_a, a), (name_b, b) = (name_b, b), (name_a, a)
    return f"{name_a} takes {a.median / b.median:.3g}x the time of {name_b}"


for n in (127, 511):
    start, band, out = torch.zeros(n, **f64), stencil_pattern((n,), **THREE_POINT), {}
    direct = timed(lambda: out.update(J=newton_sparse(bratu_1d, start, band)))  # noqa: B023
    free = timed(lambda: out.update(NK=newton_krylov(bratu_1d, start)))  # noqa: B023
    steps, (u_free, norms, cg_steps) = len(out["J"][1]) - 1, out["NK"]
    assert out["J"][1][-1] < 1e-9 and norms[-1] < 1e-9
    print(f"n = {n}: coloured J, {steps} Newton steps, {3 * steps} products: "
          f"{show(direct)}\n    Newton–Krylov, {len(cg_steps)} Newton steps, "
          f"{sum(cg_steps)} products (at most {max(cg_steps)} per step): {show(free)}")  # fmt: skip
    print("   ", compare("Newton–Krylov", free, "the coloured J", direct))
    assert max(cg_steps) <= (n + 1) // 2 + 4, cg_steps
    apply_J, per_step = linear_map(bratu_1d, u_free)[1], sum(cg_steps) / len(cg_steps)
    L, p, j = map(timed, (partial(linear_map, bratu_1d, u_free), partial(apply_J, u_free),
                          partial(jvp, bratu_1d, (u_free,), (u_free,))))  # fmt: skip
    even = L.median / (j.median - p.median) if j.median > p.median else math.inf
    print(f"    one linearize {show(L)}; a product of its map {show(p)}\n    a fresh jvp "
          f"{show(j)}: one linearize takes the time of {L.median / p.median:.3g} products or "
          f"{L.median / j.median:.3g} jvp calls\n    by these medians, its {len(cg_steps)} traces "
          f"make {len(cg_steps) * L.median / free.median:.0%} of the solve; {per_step:.0f} products"
          f" per Newton step, {('fewer', 'more')[more := per_step > even]} than L / (j − p) ="
          f" {even:.3g}:\n    {('a jvp per product', 'linearize')[more]} is cheaper")  # fmt: skip
sizes, dense_cap = (64, 256, 2048, 16384), 2048
times, csr = {name: [] for name in METHOD_COLORS}, []
for N in sizes:
    u, band = 0.3 * torch.randn(N, **f64), stencil_pattern((N,), **THREE_POINT)
    S = coloured_jacobian(bratu_1d, u, *band)  # CSR
    csr.append(S.values().nbytes + S.col_indices().nbytes + S.crow_indices().nbytes)
    assert csr[-1] == 8 * (2 * (3 * N - 2) + N + 1), csr[-1]
    times["vmap"].append(timed(lambda: coloured_jacobian(bratu_1d, u, *band)))  # noqa: B023
    if N <= dense_cap:
        times["jacfwd"].append(timed(lambda: jacfwd(bratu_1d)(u)))  # noqa: B023
    extra = f", jacfwd {show(times['jacfwd'][-1])}" if N <= dense_cap else ""
    print(f"N = {N:5d}: colouring {show(times['vmap'][-1])}{extra}\n    output bytes: "
          f"dense {8 * N * N:,}, CSR {csr[-1]:,}")  # fmt: skip
at = len(times["jacfwd"]) - 1  # the largest N with a dense Jacobian
print(f"N = {sizes[at]}:", compare("jacfwd", times["jacfwd"][at], "the colouring",
                                   times["vmap"][at]))  # fmt: skip
memory = [f"{8 * N * N / b:,.0f}x at N = {N}" for N, b in zip(sizes, csr)]
print("the dense Jacobian's bytes over the CSR one's:", ", ".join(memory))
fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
labels = {"jacfwd": "jacfwd: dense, N products", "vmap": "colouring: vmap of 3 jvp"}
levels = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
for name, colour in METHOD_COLORS.items():
    qs = [torch.tensor(t.times).double().quantile(levels) for t in times[name]]
    low, mid, high = torch.stack(qs).T * 1e3
    ax.errorbar(sizes[: len(qs)], mid, yerr=(mid - low, high - mid), marker="o",
                capsize=3, color=colour, label=labels[name])  # fmt: skip
ax.set(xscale="log", yscale="log", xlabel="unknowns N", ylabel=f"time (ms), {device}",
       title="1-D Bratu Jacobian; bars from the first to the third quartile")  # fmt: skip
ax.legend(loc="best")
plt.show()

# %%
# What to remember
# ----------------
# * A stencil's Jacobian has a known pattern: colour the columns so that no two of a colour
#   share a row (``j mod 3`` for three points, ``(i + 2j) mod 5`` for five in 2-D), run one
#   ``jvp`` per colour under ``vmap``, scatter into a sparse tensor; check it against ``jacfwd``.
# * ``torch.sparse.spsolve`` refuses CPU tensors; SciPy's ``spsolve`` takes CPU copies of the
#   CSR arrays, and its ``cg`` or ``gmres`` takes ``linearize``'s map as a ``LinearOperator``.
# * Newton–Krylov never forms ``J``: a ``linearize`` per Newton step, a product per Krylov step,
#   a tolerance that shrinks with ``‖F‖``; CG needs ``J`` symmetric definite, GMRES does not.
# * A ``linearize`` trace per Newton step beats a fresh ``jvp`` per product once a step needs
#   more than ``L / (j − p)`` products (timed above). A preconditioner cuts products, not traces.
