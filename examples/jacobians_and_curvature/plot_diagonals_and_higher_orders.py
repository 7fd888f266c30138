"""
Diagonals and higher-order derivatives
======================================

How do you get only the diagonal of a Jacobian or a Hessian, and how do you compute a fourth
derivative, or all third derivatives of a vector function? Here you get a diagonal from one
product when the function allows it (and see the same trick give a wrong answer when it does
not), the exact diagonal of any Jacobian or Hessian from batched products, and an unbiased
estimate from random probes, checked against its standard error. Then you nest ``grad``,
``jacfwd`` and ``jvp`` for k-th derivatives, each checked against a closed form, and time the
full derivative tensor against one directional derivative as the order grows.
"""

# %%
# Setup
# -----
# Everything runs in float64: the references are closed forms, and in float64 the checks can
# demand agreement to a few rounding errors, even for a sixth derivative (its float32 error is
# printed further down for comparison).
import itertools
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Measurement, Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64 = dict(dtype=torch.float64, device=device)
EPS = torch.finfo(torch.float64).eps
METHOD_COLORS = {"jacfwd": "#E69F00", "nested jvp": "#666633"}


def within(what, got, reference, bound):
    """Each entry of got within bound of reference; prints the worst error and the margin."""
    worst = (got - reference).abs().max().item()
    print(f"{what:52s} max error {worst:.1e}, bound {bound:.1e}")
    assert worst <= bound, f"{what}: error {worst:.2e} above {bound:.2e}"


# %%
# An elementwise function: the diagonal is one ``jvp``
# ----------------------------------------------------
# When output ``i`` depends on input ``i`` alone, the Jacobian is diagonal, so ``J 1`` (a
# :func:`~torch.func.jvp` along a vector of ones) *is* its diagonal, and so is ``1ᵀ J``, the
# :func:`~torch.func.grad` of the summed outputs. One product instead of ``n``. For a scalar
# function applied entry by entry, ``vmap(grad(fn))`` says the same thing per entry. (Likewise
# per sample: when sample ``b``'s loss sees only input ``b``, one gradient of the summed losses
# with respect to the *inputs* holds every sample's input gradient; not so for the parameters,
# which every sample's loss sees. See
# :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_batch_jacobians_hessians.py`.) The
# check: SiLU, ``x σ(x)``, whose derivative is ``σ(x)(1 + x(1 − σ(x)))``, and the diagonal of
# the full ``jacrev`` Jacobian.
x = torch.linspace(-4, 4, 200, **f64)
_, diagonal_by_jvp = jvp(F.silu, (x,), (torch.ones_like(x),))
diagonal_by_grad = grad(lambda y: F.silu(y).sum())(x)
diagonal_by_vmap = vmap(grad(F.silu))(x)
silu_slope = torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x)))  # closed form
full_jacobian = jacrev(F.silu)(x)
for name, got in [("one jvp along ones", diagonal_by_jvp),
                  ("grad of the sum", diagonal_by_grad),
                  ("vmap(grad) entry by entry", diagonal_by_vmap),
                  (f"jacrev's diagonal (of {full_jacobian.numel():,})",
                   full_jacobian.diagonal())]:  # fmt: skip
    within(f"SiLU: {name}", got, silu_slope, 4 * EPS)
print(f"products: 1 jvp (or 1 vjp) against {len(x)} for the full Jacobian")

# %%
# With cross terms the trick is wrong
# -----------------------------------
# For ``g(x) = tanh(A x + b)`` with a full square ``A``, output ``i`` depends on every input.
# The ``jvp`` along ones still runs, and returns ``J 1``: the *row sums* of the Jacobian, not its
# diagonal. No error is raised; only a check catches it. The exact diagonal, by hand, is
# ``(1 − tanh²(A x + b)) ⊙ diag(A)``.
n = 64
A = torch.randn(n, n, **f64) / n**0.5
b = torch.randn(n, **f64)
x = torch.randn(n, **f64)


def g(x):
    return torch.tanh(A @ x + b)


slope = 1 - g(x) ** 2
true_diagonal = slope * A.diagonal()  # the closed form
_, ones_jvp = jvp(g, (x,), (torch.ones_like(x),))
within("tanh: jvp along ones = row sums of J", ones_jvp, slope * A.sum(1), 8 * EPS)
off = (ones_jvp - true_diagonal).abs().max() / true_diagonal.abs().max()
print(f"... and it misses the diagonal by {off:.0%} of the diagonal's largest entry")
assert off > 0.5, "the one-jvp trick should not give the diagonal here"

# %%
# The exact diagonal of any Jacobian: ``n`` products
# --------------------------------------------------
# Entry ``i`` of the diagonal is ``e_iᵀ J e_i``. Push each basis vector through ``jvp`` and keep
# the ``i``-th entry of ``J e_i``, or, with :func:`~torch.func.vjp`, pull each basis vector
# back: ``vjp`` returns the function ``u ↦ uᵀ J``, and :func:`~torch.func.vmap` over it runs
# all ``n`` cotangents as one batched call (the *batched VJP* idiom: ``vmap(vjp_fn)`` over the
# rows of a matrix gives those rows times ``J``). Over the basis, that is what ``jacrev`` itself
# runs: it builds all ``n`` rows of ``J``, ``n × n`` numbers, before you keep the diagonal, so
# this route costs what ``jacrev(g)(x).diagonal()`` costs, in time and memory; the batched
# ``jvp`` builds the ``n`` columns likewise. Only ``chunk_size``, which runs the products that
# many at a time, bounds ``vmap``'s memory; fewer products need to know where ``J`` is zero (next
# section).
basis = torch.eye(n, **f64)
_, g_vjp = vjp(g, x)
(rows,) = vmap(g_vjp)(basis)  # row i is e_iᵀ J; vjp_fn returns a tuple
by_vjp = rows.diagonal()
entry = lambda e: e @ jvp(g, (x,), (e,))[1]  # noqa: E731
by_jvp = vmap(entry)(basis)
by_jvp_chunked = vmap(entry, chunk_size=16)(basis)

# %%
# The references: the closed form, and a Python loop of :func:`torch.autograd.grad` calls, one
# backward per output, keeping the ``i``-th entry of each (plain autograd, no ``torch.func``).
x_leaf = x.detach().requires_grad_()
outputs = g(x_leaf)
loop = torch.stack([torch.autograd.grad(outputs[i], x_leaf, retain_graph=True)[0][i]
                    for i in range(n)])  # fmt: skip
within("autograd loop vs the closed form", loop, true_diagonal, 2 * EPS)
for name, got in [("vmap(vjp_fn) over basis rows", by_vjp),
                  ("vmap over basis of jvp", by_jvp),
                  ("same, chunk_size=16", by_jvp_chunked)]:  # fmt: skip
    within(f"tanh(Ax+b) diagonal: {name}", got, loop, 2 * EPS)
print(f"products: {len(basis)} ({len(basis)} vjps, or {len(basis)} jvps)")


# %%
# Between the two cases: a structured Jacobian
# --------------------------------------------
# Fewer products suffice when the sparsity is known. In ``h(x)_i = x_i (x_{i−1} + x_{i+1}) +
# sin x_i`` (periodic), output ``i`` depends on inputs ``i − 1``, ``i`` and ``i + 1``. Colour the
# inputs by parity: along the sum of one colour's basis vectors, entry ``i`` of that colour
# collects only ``∂h_i/∂x_i``, as both its neighbours have the other colour. Two products for
# any even ``n`` (the whole tridiagonal ``J`` takes more, as ``i − 1`` and ``i + 1`` share
# row ``i``); the diagonal is ``x_{i−1} + x_{i+1} + cos x_i``.
def h(x):
    return x * (x.roll(1) + x.roll(-1)) + torch.sin(x)


u = torch.randn(60, **f64)
parity = torch.arange(len(u), device=device) % 2
colours = torch.stack([parity == 0, parity == 1]).double()  # (2, 60): one row a colour
columns = vmap(lambda c: jvp(h, (u,), (c,))[1])(colours)  # J times each colour
by_colour = (colours * columns).sum(0)
within("tridiagonal h: 2 jvps, one per colour", by_colour,
       u.roll(1) + u.roll(-1) + torch.cos(u), 4 * EPS)  # fmt: skip
within("... agrees with jacfwd's diagonal", by_colour, jacfwd(h)(u).diagonal(), 4 * EPS)

# %%
# The Hessian diagonal, exactly: batched Hessian-vector products
# --------------------------------------------------------------
# A Hessian is the Jacobian of the gradient, so the same recipe holds with ``grad(f)`` in place
# of ``g``: ``jvp(grad(f), (w,), (e_i,))`` is the Hessian-vector product ``H e_i``
# (forward-over-reverse, as in
# :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_hessian_vector_products.py`),
# and ``vmap`` over a stack of directions ``V`` gives ``H V``, *batched H·V*. Our function: the
# loss of a logistic regression in 128 weights on 512 samples, with an L2 penalty λ. By hand,
# ``H = (1/m) Σ_k s_k a_k a_kᵀ + λ I`` with ``s_k = σ(z_k)(1 − σ(z_k))``, ``z_k = y_k a_kᵀ w``.
m, d, lam = 512, 128, 1e-2
features = torch.randn(m, d, **f64)
labels = torch.randint(0, 2, (m,), device=device).to(torch.float64) * 2 - 1
w = torch.randn(d, **f64) / d**0.5


def loss(w):
    return F.softplus(-labels * (features @ w)).mean() + lam / 2 * w @ w


def batched_hvp(w, directions, chunk_size=None):  # row j: H times direction j
    hvp = lambda v: jvp(grad(loss), (w,), (v,))[1]  # noqa: E731
    return vmap(hvp, chunk_size=chunk_size)(directions)


z = labels * (features @ w)
s = torch.sigmoid(z) * (1 - torch.sigmoid(z))
H = (features.T * s) @ features / m + lam * torch.eye(d, **f64)  # closed form
exact_diagonal = batched_hvp(w, torch.eye(d, **f64), chunk_size=32).diagonal()
within(
    "Hessian diagonal by d HVPs, chunks of 32", exact_diagonal, H.diagonal(), 4 * EPS
)
within("... vs hessian(loss)'s diagonal", exact_diagonal, hessian(loss)(w).diagonal(),
       4 * EPS)  # fmt: skip

# %%
# The Hessian diagonal, estimated: random ±1 probes
# -------------------------------------------------
# For a probe ``v`` with independent entries ±1 (Rademacher), ``(v ⊙ H v)_i = H_ii + Σ_{j≠i}
# H_ij v_i v_j``, and each ``v_i v_j`` has mean zero, so ``E[v ⊙ H v] = diag(H)`` (Bekas,
# Kokiopoulou and Saad, 2007; AdaHessian preconditions with it). The ``v_i v_j`` for ``j ≠ i`` are
# independent ±1, so one probe's entry ``i`` has variance ``Σ_{j≠i} H_ij²``, and the mean of
# ``S`` probes a standard error ``√(Σ_{j≠i} H_ij² / S)``. ``S`` products instead of ``d``, at the
# price of noise: it pays when the diagonal dominates. (Summing the entries gives Hutchinson's
# trace estimate; :ref:`sphx_glr_auto_examples_science_plot_forces_and_laplacians.py` uses it for
# a Laplacian.) The probes come from a seeded CPU generator, so a GPU sees the same ones.
S, B = 16, 8
gen = torch.Generator().manual_seed(0)
probes = (torch.randint(0, 2, (B, S, d), generator=gen) * 2 - 1).to(**f64)
samples = probes * batched_hvp(w, probes.reshape(B * S, d)).reshape(B, S, d)  # v ⊙ H v
within("each probe's v ⊙ Hv vs the closed form", samples, probes * (probes @ H),
       8 * EPS * H.abs().sum(1).max())  # fmt: skip
# (B, d): B independent estimates, each of S probes; you would use one, the rest serve the checks
estimates = samples.mean(1)
off_diagonal = H.square().sum(1) - H.diagonal().square()  # Σ_{j≠i} H_ij²
standard_error = (off_diagonal / S).sqrt()
z_scores = (estimates - H.diagonal()) / standard_error
print(f"products: {d} for the exact diagonal, {S} for the estimate; a standard error is "
      f"{(standard_error / H.diagonal()).median():.1%} of the diagonal (median entry)")  # fmt: skip

# %%
# Three checks derived from that variance, on ``B`` independent estimates (``B S`` products in
# all; only the first ``S`` make the estimate). Every entry lies within 5 standard errors (the
# chance that one of the ``B d`` errors, were they Gaussian, strays further is printed). Entries
# ``i`` and ``k`` of one estimate correlate by ``R_ik = H_ik² / √(Var_i Var_k)`` (as for the
# variance), so for Gaussian errors the mean z-score, of expectation 0, has a standard deviation
# ``√(Σ R_ik) / (d √B)``, and the mean squared z-score, of expectation exactly 1, one of
# ``√2 ‖R‖_F / (d √B)``; each must lie within 4 such deviations of its expectation. A bias of one
# sign moves the first, a standard error off by a factor the second: how far is printed.
stray = B * d * math.erfc(5 / math.sqrt(2))
print(f"worst entry {z_scores.abs().max():.2f} standard errors off (bound 5; chance of any "
      f"beyond it {stray:.2%})")  # fmt: skip
assert (z_scores.abs() <= 5).all()
R = H.square() / (off_diagonal[:, None] * off_diagonal[None, :]).sqrt()
R.diagonal().fill_(1)
mean_spread = R.sum().sqrt() / (d * math.sqrt(B))
square_spread = math.sqrt(2) * torch.linalg.matrix_norm(R) / (d * math.sqrt(B))
within("mean z-score vs its expectation, 0", z_scores.mean(), 0, 4 * mean_spread)
within("mean squared z-score vs its expectation, 1", z_scores.square().mean(), 1,
       4 * square_spread)  # fmt: skip
bias = 4 * mean_spread / standard_error.reciprocal().mean()  # one bias, all entries
over, under = (1 - 4 * square_spread) ** -0.5, (1 + 4 * square_spread) ** -0.5
print(f"in expectation they fail for a bias beyond {bias:.1e} (leaving out the penalty, "
      f"-λ = {-lam:.0e}), or a standard error over {over:.2f}x or under {under:.2f}x "
      f"the true one")  # fmt: skip


# %%
# k-th derivatives of a scalar function: nest ``grad``
# ----------------------------------------------------
# ``grad`` returns a function of the same kind as its input, so it nests: ``k`` applications
# give the k-th derivative of a scalar function of a scalar, and ``vmap`` maps it over points.
# Checked against ``dᵏ/dxᵏ sin(a x) = aᵏ sin(a x + kπ/2)`` for ``k`` = 1 to 6, to a few float64
# roundings of the size ``aᵏ``; ``sin(θ + kπ/2)`` is taken as ``sin θ``, ``cos θ``, ``−sin θ`` or
# ``−cos θ`` for ``k mod 4`` = 0 to 3, so the reference does not round the shifted angle.
def kth_derivative(fn, k):
    for _ in range(k):
        fn = grad(fn)
    return fn


a = 1.7
points = torch.linspace(-3, 3, 25, **f64)
turns = (torch.sin, torch.cos, lambda t: -torch.sin(t), lambda t: -torch.cos(t))
for k in range(1, 7):
    got = vmap(kth_derivative(lambda t: torch.sin(a * t), k))(points)
    reference = a**k * turns[k % 4](a * points)
    within(f"sin(ax): derivative {k}", got, reference, 4 * EPS * a**k)
single = vmap(kth_derivative(lambda t: torch.sin(a * t), 6))(points.float())
print(
    f"the sixth derivative in float32: max error {(single - reference).abs().max():.1e}"
)

# %%
# A polynomial of degree 4 checks the other end: its fourth derivative is ``4!`` times the
# leading coefficient everywhere, and the fifth and sixth vanish, exactly.
poly = lambda t: 3 * t**4 - 2 * t**3 + t - 5  # noqa: E731
assert (vmap(kth_derivative(poly, 4))(points) == 72).all()
for k in (5, 6):
    assert (vmap(kth_derivative(poly, k))(points) == 0).all(), k
print("polynomial: 4th derivative exactly 72 everywhere, 5th and 6th exactly 0")


# %%
# All k-th derivatives of a vector function: nest ``jacfwd``
# ----------------------------------------------------------
# For ``f: ℝⁿ → ℝᵐ``, :func:`~torch.func.jacfwd` nested ``k`` times returns the tensor of all
# k-th derivatives, of shape ``(m,) + (n,)*k``. ``jacfwd`` is the natural choice after the first
# level, as each level's function has more outputs than inputs. For ``f(x) = exp(W x)`` the
# closed form is ``T_{a i j…} = exp(W x)_a W_ai W_aj …``; the tensor is also symmetric under any
# permutation of its input axes, which is checked on its own for every permutation. So only one
# entry per multiset of ``k`` input indices differs, ``C(n+k−1, k)`` per output: printed, with
# the formula checked against a count of the sorted index tuples.
def derivative_tensor(fn, k):
    for _ in range(k):
        fn = jacfwd(fn)
    return fn


m, n = 3, 6
W = torch.randn(m, n, **f64) / n**0.5
x = torch.randn(n, **f64)
expf = lambda y: torch.exp(W @ y)  # noqa: E731
for k in range(1, 5):
    T = derivative_tensor(expf, k)(x)
    closed = expf(x).reshape((m,) + (1,) * k)
    for axis in range(1, k + 1):  # multiply in W along each input axis
        closed = closed * W.reshape((m,) + (1,) * (axis - 1) + (n,) + (1,) * (k - axis))
    within(f"exp(Wx): all derivatives of order {k} {tuple(T.shape)}", T, closed,
           4 * EPS * closed.abs().max())  # fmt: skip
    perms = itertools.permutations(range(1, k + 1))  # of the input axes
    asymmetry = max((T.permute(0, *perm) - T).abs().max() for perm in perms)
    within(f"... changed by any permutation of its {k} input axes", asymmetry, 0,
           4 * EPS * T.abs().max())  # fmt: skip
    distinct = math.comb(n + k - 1, k)
    indices = itertools.product(range(n), repeat=k)
    assert distinct == len({tuple(sorted(i)) for i in indices})
    print(f"    {T.numel():,} entries, {m * distinct:,} distinct; one direction: {m}")

# %%
# A Taylor mode propagates ``k + 1`` coefficients of a power series in one pass, at a cost
# polynomial in ``k`` (Griewank and Walther, *Evaluating Derivatives*); JAX has one,
# ``jax.experimental.jet``. We found none in ``torch.func``: a name search finds no ``jet`` or
# ``taylor`` there or in ``torch.autograd.forward_ad``, whose dual numbers carry one tangent.
names = dir(torch.func) + dir(torch.autograd.forward_ad)
assert not [name for name in names if "jet" in name or "taylor" in name.lower()]

# %%
# One direction: nest ``jvp`` ``k`` times
# ---------------------------------------
# Often one direction suffices: ``dᵏ/dtᵏ f(x + t v)`` at ``t = 0`` is the derivative tensor
# contracted with ``v`` in every input axis, ``T[v, …, v]``. Nesting ``jvp`` along ``v``
# computes it without the tensor: ``m`` numbers instead of ``m nᵏ``. Checked against the closed
# form ``exp(W x) (W v)ᵏ`` and against the full tensor contracted with ``v``.
v = torch.randn(n, **f64)


def directional_derivative(fn, k, direction):
    for _ in range(k):
        fn = (lambda inner: lambda y: jvp(inner, (y,), (direction,))[1])(fn)
    return fn


for k in range(1, 5):
    got = directional_derivative(expf, k, v)(x)
    closed = expf(x) * (W @ v) ** k
    contracted = derivative_tensor(expf, k)(x)
    scale = contracted.abs()  # the same sums over absolute values: rounding's scale
    for _ in range(k):
        contracted, scale = contracted @ v, scale @ v.abs()  # the last input axis
    within(f"exp(Wx): order {k} along v, vs closed form", got, closed,
           8 * EPS * closed.abs().max())  # fmt: skip
    within("... vs the full tensor contracted", got, contracted, 4 * EPS * scale.max())


# %%
# Measuring: how the cost grows with the order
# --------------------------------------------
# The sizes are printed above: the full tensor grows n-fold per order, one direction stays at
# ``m`` numbers. What runs is harder to count. A ``TorchDispatchMode`` sees each operation below the
# transforms, but also calls that compute nothing (views, shape checks, zero tensors that hold
# no data), so this one counts a single kind we can count by hand: the matrix-vector products
# (``aten.mv``), and those whose matrix is all zeros. Checked on known cases: ``W @ x`` and
# ``zeros @ x`` are 2 products, 1 on zeros; one ``jvp`` of ``y ↦ W y`` along ``v`` needs ``W x``
# and ``W v``, 2 products on a matrix that is not zero.
class MatrixProducts(TorchDispatchMode):
    products = on_zeros = 0  # per instance once counted

    def __torch_dispatch__(self, aten_op, types, args=(), kwargs=None):
        if aten_op is torch.ops.aten.mv.default:
            self.products += 1
            self.on_zeros += bool((args[0] == 0).all())  # is the matrix all zeros?
        return aten_op(*args, **(kwargs or {}))


with MatrixProducts() as known:
    W @ x, torch.zeros_like(W) @ x
assert (known.products, known.on_zeros) == (2, 1), (known.products, known.on_zeros)
with MatrixProducts() as one_jvp:
    jvp(lambda y: W @ y, (x,), (v,))
assert one_jvp.products - one_jvp.on_zeros == 2, (one_jvp.products, one_jvp.on_zeros)
orders = range(1, 6)  # up to 5, to keep the page's run short
for k in orders:
    with MatrixProducts() as counted:
        directional_derivative(expf, k, v)(x)
    print(f"nested jvp, order {k}: {counted.products} matrix-vector products, "
          f"{counted.on_zeros} of them on an all-zero matrix")  # fmt: skip
assert one_jvp.on_zeros and counted.on_zeros > counted.products / 2  # the prose below

# %%
# Even one ``jvp`` multiplies a matrix of zeros: forward mode gives ``W``, which the function
# captures, a zero tangent, and the product's derivative multiplies it like any other matrix
# (pytorch issue #69687 tracks such products). At the higher orders most of the products are on
# zeros, probably because each level differentiates the level below, zeros included. Here the
# matrices are small; how much of the time these products take, the timings do not separate.

# %%
# Then the time: :class:`torch.utils.benchmark.Timer` blocks on all threads after a warm-up call,
# median and interquartile range (IQR) per order, the ratio of the medians, and each route's
# growth per order. In the figure, bars run from the first to the third quartile of the blocks.
routes = {"jacfwd": lambda k: derivative_tensor(expf, k),
          "nested jvp": lambda k: directional_derivative(expf, k, v)}  # fmt: skip
times, threads = {name: [] for name in routes}, torch.get_num_threads()
for k in orders:
    for name, build in routes.items():
        call = build(k)
        call(x)  # warm-up
        timer = Timer("call(x)", globals={"call": call, "x": x}, num_threads=threads)
        runs = [timer.blocked_autorange(min_run_time=0.1)]
        if len(runs[0].times) < 5:  # a slow call: a longer run, of 5 calls at least
            runs.append(timer.blocked_autorange(min_run_time=5 * runs[0].median))
        times[name].append(Measurement.merge(runs)[0])
    full, one = (times[name][-1] for name in routes)
    ratio = full.median / one.median
    wording = (f"the full tensor takes {ratio:.2f}x the time of one direction"
               if ratio >= 1 else
               f"one direction takes {1 / ratio:.2f}x the time of the full tensor")  # fmt: skip
    spread = [
        f"{t:,.1f}" if t >= 10 else f"{t:.2g}" for t in (full.iqr * 1e6, one.iqr * 1e6)
    ]
    print(f"order {k}: full tensor {full.median * 1e6:,.0f} µs (IQR {spread[0]} µs), "
          f"nested jvp {one.median * 1e6:,.0f} µs (IQR {spread[1]} µs); {wording}")  # fmt: skip
for name, measured in times.items():
    growth = (measured[-1].median / measured[0].median) ** (1 / (len(measured) - 1))
    print(f"{name}: median time x{growth:.2f} per order (geometric mean, orders 1 to "
          f"{orders[-1]})")  # fmt: skip

# %%
fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
levels = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
sizes = {"jacfwd": f"all {m}·{n}^k derivatives", "nested jvp": f"{m}, one direction"}
for name in routes:
    blocks = [torch.tensor(t.times, dtype=torch.float64) * 1e3 for t in times[name]]
    low, mid, high = torch.stack([ms.quantile(levels) for ms in blocks]).T
    ax.errorbar(orders, mid, yerr=(mid - low, high - mid), marker="o", capsize=3,
                color=METHOD_COLORS[name], label=f"{name}: {sizes[name]}")  # fmt: skip
ax.set(yscale="log", xlabel="derivative order k", ylabel=f"median time (ms), {device}")
ax.set_title(f"Order-k derivatives of exp(Wx), n = {n}: all of them or one direction")
ax.legend()
plt.show()

# %%
# What to remember
# ----------------
# * When output ``i`` depends only on input ``i`` (elementwise, per coordinate, per sample), one
#   ``jvp`` along ones, or ``grad`` of the sum, is the diagonal. With cross terms it silently
#   returns row (or column) sums: check against a loop or a closed form before trusting it.
# * The exact diagonal of a general Jacobian or Hessian takes ``n`` products: ``vmap`` over the
#   basis of ``jvp`` (or of ``jvp(grad(f))``), or ``vmap(vjp_fn)`` over basis rows; known
#   sparsity cuts them to one per colour; ``chunk_size`` bounds the memory.
# * ``mean(v ⊙ H v)`` over ±1 probes estimates the Hessian diagonal with ``S`` products; its
#   standard error is ``√(Σ_{j≠i} H_ij² / S)``: report it, and check against it.
# * Nest ``grad`` (scalar in, scalar out) or ``jacfwd`` (the full ``(m,) + (n,)*k`` tensor) for
#   k-th derivatives; nest ``jvp`` for one direction, ``m`` numbers instead of ``m nᵏ``. Time
#   both per order; forward mode multiplies the zero tangents of captured tensors too.
