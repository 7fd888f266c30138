"""
Troubleshooting, part 11: vmap(hessian(...)) wrong through torch.linalg.solve, det and slogdet
==============================================================================================

Batched Hessians of a loss that solves a linear system, ``vmap(hessian(f))``, come out wrong on
the CPU in torch 2.13 in batch rows after the first: no error, no NaN, no warning. The same
holds for ``vmap(jacfwd(f))`` through ``torch.linalg.solve``, ``torch.linalg.det`` and
``torch.linalg.slogdet``. Here: the recipe and its fixes, each checked against a closed form; which
functions and transforms are hit; why (``torch.linalg.lu_solve`` reads an unsqueezed LU at the
wrong place, shown without any transform); and a small check to run on your own function.
det's NaN Hessians at tied singular values: :doc:`plot_troubleshooting_refused_modules_and_nan`;
part 1: :doc:`plot_troubleshooting`.
"""

import warnings

import matplotlib.pyplot as plt
import torch
from torch.autograd.functional import hessian as eager_hessian
from torch.autograd.functional import jacobian as eager_jacobian
from torch.func import hessian, jacfwd, jacrev, jvp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
on_cpu = device.type == "cpu"  # the wrong rows are asserted on the CPU only
f64 = dict(device=device, dtype=torch.float64)


def shown(errors):  # row errors, one digit each
    return [f"{e:.0e}" for e in errors]


def per_row(got, want):
    """Each batch row's error: its largest gap over its largest reference entry."""
    gap, size = (got - want).reshape(len(want), -1), want.reshape(len(want), -1)
    gaps = gap.abs().amax(1) / size.abs().amax(1)
    return [float(g) for g in gaps]


def holds(label, got, want, bound):
    """Every row within bound of its reference (a NaN fails); prints the worst."""
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)}"
    rows = per_row(got, want)
    assert all(e <= bound for e in rows), f"{label}: row errors {rows}"
    print(f"  {label}: worst row error {max(rows):.1e} (bound {bound:.0e})")
    return rows


def spd(eigenvalues):  # S = Q diag(l) Q^T, Q a rotation: S and its exact inverse
    skew = torch.randn(len(eigenvalues), len(eigenvalues), **f64)
    rotation = torch.linalg.matrix_exp(skew - skew.T)  # orthogonal, no solver involved
    scale = torch.tensor(eigenvalues, **f64)
    return (rotation * scale) @ rotation.T, (rotation / scale) @ rotation.T


# %%
# (No error) vmap(hessian(...)) wrong through torch.linalg.solve: a Student-t loss
# --------------------------------------------------------------------------------
# The recipe: one Hessian per sample of a loss that solves S z = x with a fixed SPD matrix S,
# differentiated in x only. The loss is the multivariate Student-t negative log-likelihood (up
# to a constant), as robust regression uses it; its Hessian depends on x, so a row swapped
# with another would show. With u = S⁻¹x, q = x·u and c = (ν + d)/(ν + q), the Hessian is
# c S⁻¹ - 2c/(ν + q) u uᵀ, written out below from S⁻¹ = Q diag(1/λ) Qᵀ (no solver). The
# natural code, ``vmap(hessian(nll))``, matches it in rows 0 and 4 only, on the CPU in torch 2.13.
S, S_inv = spd([0.5, 1.0, 2.0, 4.0])
nu, dim = 4.0, 4
xs = torch.randn(6, dim, **f64)


def nll(x):  # Student-t negative log-likelihood of x, location 0, scale matrix S
    q = x @ torch.linalg.solve(S, x)
    return 0.5 * (nu + dim) * torch.log1p(q / nu)


u = xs @ S_inv  # S_inv is symmetric
q = (xs * u).sum(1)
c = ((nu + dim) / (nu + q))[:, None, None]
exact = c * S_inv - 2 * c / (nu + q)[:, None, None] * u[:, :, None] * u[:, None, :]
batched = vmap(hessian(nll))(xs)
errors = per_row(batched, exact)
print(f"vmap(hessian(nll)), row errors: {shown(errors)}")
if on_cpu:
    wrong = [i for i, e in enumerate(errors) if e > 1e-3]
    assert errors[0] < 1e-14 and wrong == [1, 2, 3, 5], errors
else:  # CUDA's and MPS's kernels are other code: not asserted, only printed
    print(f"  (on {device.type}: not asserted; the page was written with a CPU only)")

# %%
# No NaN, and the first row is right, so a spot check on sample 0 passes. Rows 0 and 4 right of
# six is no luck: "Why", below, gives the rule (with one n x n S for all rows, rows 0, n, 2n, ...
# are right; measured for n = 3, 4, 5). The Gaussian negative log-likelihood
# ``0.5 x·solve(S, x)``, whose Hessian is S⁻¹ everywhere, is hit the same, and so is float32
# (row 0 within 1e-6, rows 1 to 3 far off).
gaussian = vmap(hessian(lambda x: 0.5 * x @ torch.linalg.solve(S, x)))(xs)
gaussian_rows = per_row(gaussian, S_inv.expand(6, 4, 4))
print(f"  Gaussian, row errors: {shown(gaussian_rows)}")
S32 = S.float()
single = vmap(hessian(lambda x: 0.5 * x @ torch.linalg.solve(S32, x)))(xs.float())
f32_rows = per_row(single.double(), S_inv.expand(6, 4, 4))
print(f"  Gaussian in float32, row errors: {shown(f32_rows)}")
if on_cpu:
    assert gaussian_rows[0] < 1e-14 and min(gaussian_rows[1:4]) > 1e-3
    assert f32_rows[0] < 1e-6 and min(f32_rows[1:4]) > 1e-3

# %%
# The fixes, each against the closed form on every device, for one S shared by the batch. (1)
# Reverse over reverse through ``linalg.solve``: ``vmap(jacrev(jacrev(nll)))``. Reverse over
# forward, ``jacrev(jacfwd)``, is no fix (printed), nor is ``jacfwd(jacrev)``, which ``hessian``
# is. (We did not trace why only these orders go wrong.) (2) For an SPD S, its Cholesky factor,
# once, and ``torch.cholesky_solve``. (3) For any invertible S: its LU factors, once, and
# ``torch.linalg.lu_solve`` in the loss; these factors reach the faulty kernel unbatched (recorded
# below). (4) One sample at a time. With a matrix per sample that ``vmap`` batches (checked after
# the four), (1) and (2) still hold; (3) does not, even at first order (``vmap(jacrev)``), unless
# the loss passes ``LU.contiguous()``: the copy the kernel reads right (section "why").
by_reverse = holds(
    "(1) vmap(jacrev(jacrev(nll)))", vmap(jacrev(jacrev(nll)))(xs), exact, 1e-14
)
reverse_over_forward = per_row(vmap(jacrev(jacfwd(nll)))(xs), exact)
print(f"  not a fix, vmap(jacrev(jacfwd)): {shown(reverse_over_forward)}")
assert not on_cpu or max(reverse_over_forward) > 1e-3
cholesky = torch.linalg.cholesky(S)


def nll_cholesky(x):
    q = x @ torch.cholesky_solve(x[:, None], cholesky)[:, 0]
    return 0.5 * (nu + dim) * torch.log1p(q / nu)


by_cholesky = holds(
    "(2) Cholesky, vmap(hessian)", vmap(hessian(nll_cholesky))(xs), exact, 1e-14
)
LU, pivots = torch.linalg.lu_factor(S)


def nll_lu(x):
    q = x @ torch.linalg.lu_solve(LU, pivots, x[:, None])[:, 0]
    return 0.5 * (nu + dim) * torch.log1p(q / nu)


holds("(3) LU outside, vmap(hessian)", vmap(hessian(nll_lu))(xs), exact, 1e-14)
one_by_one = torch.stack([hessian(nll)(x) for x in xs])
holds("(4) hessian, one sample at a time", one_by_one, exact, 1e-14)
in_eager = torch.stack([eager_hessian(nll, x) for x in xs])
holds("(4) eager autograd, one at a time", in_eager, exact, 1e-14)
shifted = vmap(jacrev(jacrev(nll)))(xs.roll(1, 0))  # rows misaligned: the check sees it
assert min(per_row(shifted, exact)) > 1e-3


def nll_with(x, solved):  # the same loss, given S^-1 x however it was computed
    return 0.5 * (nu + dim) * torch.log1p(x @ solved / nu)


own = [spd([0.5, 1.0, 2.0, 4.0]) for _ in xs]  # a matrix per sample, and its inverse
Ss, Ss_inv = (torch.stack(pair) for pair in zip(*own))
u_own = torch.einsum("bij,bj->bi", Ss_inv, xs)
c_own = ((nu + dim) / (nu + (xs * u_own).sum(1)))[:, None, None]
q_own = (nu + (xs * u_own).sum(1))[:, None, None]
exact_own = c_own * Ss_inv - 2 * c_own / q_own * u_own[:, :, None] * u_own[:, None, :]
nll_own = lambda x, S: nll_with(x, torch.linalg.solve(S, x))  # noqa: E731
chol_own = lambda x, L: nll_with(x, torch.cholesky_solve(x[:, None], L)[:, 0])  # noqa: E731
lu_own = lambda x, LU, p: nll_with(x, torch.linalg.lu_solve(LU, p, x[:, None])[:, 0])  # noqa
holds("per-sample S, (1)", vmap(jacrev(jacrev(nll_own)))(xs, Ss), exact_own, 2e-14)
holds("per-sample S, (2)", vmap(hessian(chol_own))(xs, torch.linalg.cholesky(Ss)),
      exact_own, 2e-14)  # fmt: skip
lu_rows = per_row(vmap(hessian(lu_own))(xs, *torch.linalg.lu_factor(Ss)), exact_own)
print(f"  per-sample S, (3) lu_solve, row errors: {shown(lu_rows)}")
first = vmap(jacrev(lambda x, LU, p: torch.linalg.lu_solve(LU, p, x[:, None])[:, 0]))
first_rows = per_row(first(xs, *torch.linalg.lu_factor(Ss)), Ss_inv)
print(f"  per-sample S, vmap(jacrev(lu_solve)), row errors: {shown(first_rows)}")
assert not on_cpu or (max(lu_rows) > 1e-3 and max(first_rows) > 1e-3)
lu_copy = lambda x, LU, p: lu_own(x, LU.contiguous(), p)  # noqa: E731
holds("per-sample S, (3) with LU.contiguous()",
      vmap(hessian(lu_copy))(xs, *torch.linalg.lu_factor(Ss)), exact_own, 2e-14)  # fmt: skip

# %%
# Each batch row's error against the closed form: the recipe and reverse over forward (wrong
# rows on the CPU), fix (1) (brown) and fix (2) (grey), on top of each other at about 1e-15.
# An exact row would be drawn at 1e-18; the dashed line is the fixes' bound.
METHOD_COLORS = {"hessian": "#56B4E9", "reverse-over-forward": "#BBCC33",
                 "reverse-over-reverse": "#997700"}  # fmt: skip
LABELS = {
    "hessian": "the recipe, vmap(hessian)",
    "reverse-over-forward": "vmap(jacrev(jacfwd))",
    "reverse-over-reverse": "fix (1), vmap(jacrev(jacrev))",
    "cholesky": "fix (2), Cholesky",
}
drawn = {"hessian": errors, "reverse-over-forward": reverse_over_forward,
         "reverse-over-reverse": by_reverse, "cholesky": by_cholesky}  # fmt: skip
fig, ax = plt.subplots(figsize=(7.2, 3.8), layout="constrained")
for (route, rows), marker in zip(drawn.items(), "os^v", strict=True):
    floored = [max(e, 1e-18) for e in rows]
    ax.plot(
        floored,
        marker + "-",
        color=METHOD_COLORS.get(route, "0.5"),
        label=LABELS[route],
    )
ax.axhline(1e-14, color="black", linestyle="--", linewidth=1)
ax.set(yscale="log", xlabel="batch row", ylabel="row error / largest true entry",
       title=f"Student-t Hessians on {device.type}, torch {torch.__version__}")  # fmt: skip
ax.legend(fontsize="small")
plt.show()

# %%
# (No error) vmap(jacfwd(...)) wrong through det, slogdet and solve: which functions
# ----------------------------------------------------------------------------------
# A survey: eight linear-algebra functions of a batch of three 4 x 4 matrices, under five
# batched transforms, each batch row against eager autograd (``torch.autograd.functional``'s
# ``jacobian`` and ``hessian``, a Python loop with no ``torch.func``). Second derivatives are of
# the scalar ``(f(A) * W).sum()``, W random. "wrong": some row off by over 1e-6; "right": every row
# within 1e-10. The matrices are random, away from det's ties (at those, part 10's NaN).
A = torch.randn(3, 4, 4, **f64) + 3 * torch.eye(4, **f64)
b, eye = torch.randn(4, **f64), torch.eye(4, **f64)
tangents = torch.randn(3, 4, 4, **f64)
FUNCTIONS = {
    "linalg.solve": lambda M: torch.linalg.solve(M, b),
    "linalg.det": torch.linalg.det,
    "linalg.slogdet": lambda M: torch.linalg.slogdet(M).logabsdet,
    "linalg.inv": torch.linalg.inv,
    "cholesky_solve": lambda M: torch.cholesky_solve(
        b[:, None], torch.linalg.cholesky(M @ M.T + eye)
    )[:, 0],
    "solve_triangular": lambda M: torch.linalg.solve_triangular(
        M.triu() + 4 * eye, b[:, None], upper=True
    )[:, 0],
    "lu_factor+lu_solve": lambda M: torch.linalg.lu_solve(
        *torch.linalg.lu_factor(M), b[:, None]
    ),
    "linalg.lstsq": lambda M: torch.linalg.lstsq(M, b[:, None]).solution,
}
TRANSFORMS = ["jacfwd", "jvp", "jacrev", "hessian", "jacrev(jacrev)"]  # each under vmap


def survey_row(f):
    weights = torch.randn(f(A[0]).shape, **f64)
    score = lambda M: (f(M) * weights).sum()  # noqa: E731
    jacobians = torch.stack([eager_jacobian(f, M) for M in A])
    along = (jacobians * tangents[:, *[None] * weights.dim()]).sum((-2, -1))  # J t
    hessians = torch.stack([eager_hessian(score, M) for M in A])
    runs = {
        "jacfwd": (lambda: vmap(jacfwd(f))(A), jacobians),
        "jvp": (lambda: vmap(lambda M, t: jvp(f, (M,), (t,))[1])(A, tangents), along),
        "jacrev": (lambda: vmap(jacrev(f))(A), jacobians),
        "hessian": (lambda: vmap(hessian(score))(A), hessians),
        "jacrev(jacrev)": (lambda: vmap(jacrev(jacrev(score)))(A), hessians),
    }
    verdicts = []
    for name in TRANSFORMS:
        call, want = runs[name]
        worst = max(per_row(call(), want))
        verdict = "right" if worst <= 1e-10 else "close" if worst <= 1e-6 else "wrong"
        verdicts.append(verdict)
    return verdicts


print(f"{'under vmap:':>20}" + "".join(f"{t:>16}" for t in TRANSFORMS))
table = {}
with warnings.catch_warnings(action="ignore"):  # lstsq's vmap fallback warns
    for name, f in FUNCTIONS.items():
        table[name] = survey_row(f)
        print(f"{name:>20}" + "".join(f"{v:>16}" for v in table[name]))
hit = ["wrong", "right", "right", "wrong", "right"]  # forward mode under vmap
expected = {name: ["right"] * 5 for name in FUNCTIONS}
expected |= dict.fromkeys(["linalg.solve", "linalg.det", "linalg.slogdet"], hit)
if on_cpu:
    assert table == expected, table

# %%
# Is the eager reference right? For det and log|det|, against their closed forms, B = A⁻¹:
# d²det/dA_ij dA_kl = det(A) (B_ji B_lk - B_jk B_li); d² log|det| / dA_ij dA_kl = -B_jk B_li.
# (The survey's weighted score differs from det; here the eager Hessians of det itself.)
B = torch.linalg.inv(A)
det_exact = torch.einsum("nji,nlk->nijkl", B, B) - torch.einsum("njk,nli->nijkl", B, B)
det_exact = torch.linalg.det(A)[:, None, None, None, None] * det_exact
logabsdet = FUNCTIONS["linalg.slogdet"]
log_exact = -torch.einsum("njk,nli->nijkl", B, B)
for name, f, want, bounds in [("det", torch.linalg.det, det_exact, (5e-15, 2e-14)),
                              ("log|det|", logabsdet, log_exact, (5e-15, 3e-15))]:  # fmt: skip
    by_eager = torch.stack([eager_hessian(f, M) for M in A])
    holds(f"eager hessian of {name}", by_eager, want, bounds[0])
    holds(f"the fix, vmap(jacrev(jacrev({name})))", vmap(jacrev(jacrev(f)))(A),
          want, bounds[1])  # fmt: skip

# %%
# So, in this survey: batched forward mode (``vmap`` over ``jacfwd``, and ``hessian``, which is
# ``jacfwd(jacrev)``) through ``solve``, ``det`` and ``slogdet``. ``vmap(jvp)`` at one level is
# right, and so are both reverse-mode columns. ``inv``, the Cholesky and triangular solvers,
# ``lu_factor`` and ``lu_solve`` called inside the function, and ``lstsq`` are right under all
# five, here, where only the matrix is differentiated (``b`` is a constant); ``lu_solve`` with a
# differentiated right-hand side and batched factors is wrong even under ``vmap(jacrev)`` (above).

# %%
# (No error) why: torch.linalg.lu_solve reads an unsqueezed LU at the wrong offset
# --------------------------------------------------------------------------------
# No transform needed: factor three 4 x 4 matrices (on the CPU, whatever this page's device),
# then insert a size-1 batch dimension, ``LU[:, None]``, and solve. LAPACK's LU is column-major,
# strides (16, 1, 4); the inserted dimension gets stride 4, not 16. Rows after the first come out
# wrong. The same values made contiguous, or factored fresh as a (3, 1, 4, 4) batch, are right.
# And the wrong rows equal, to the last bit, a solve whose matrix i starts 4·i entries into the
# LU's memory (n·i, the inserted stride) instead of 16·i (n²·i).
cpu64 = {"dtype": torch.float64, "device": "cpu"}
M3, rhs = torch.randn(3, 4, 4, **cpu64), torch.randn(3, 4, 2, **cpu64)
LU3, piv3 = torch.linalg.lu_factor(M3)
truth = torch.linalg.solve(M3, rhs)[:, None]
unsqueezed = torch.linalg.lu_solve(LU3[:, None], piv3[:, None], rhs[:, None])
print(f"LU strides {LU3.stride()}, LU[:, None] strides {LU3[:, None].stride()}")
misplaced = per_row(unsqueezed, truth)
print(f"  lu_solve(LU[:, None], ...), row errors: {shown(misplaced)}")
assert misplaced[0] < 1e-14 and min(misplaced[1:]) > 1e-3
copied = torch.linalg.lu_solve(LU3[:, None].contiguous(), piv3[:, None], rhs[:, None])
holds("the same LU, .contiguous()", copied, truth, 1e-14)
holds("lu_factor of a (3, 1, 4, 4) batch", torch.linalg.lu_solve(
    *torch.linalg.lu_factor(M3[:, None]), rhs[:, None]), truth, 1e-14)  # fmt: skip
misread = LU3.as_strided((3, 4, 4), (4, 1, 4))  # matrix i at offset 4 i, column-major
as_misread = torch.linalg.lu_solve(misread.mT.contiguous().mT, piv3, rhs)[:, None]
assert torch.equal(unsqueezed, as_misread)
print("  the wrong rows equal a solve with matrix i read at offset 4 i: True")

# %%
# Under ``vmap(jacfwd(...))`` the forward formulas of det, slogdet and solve call ``lu_solve`` on
# the LU saved from the primal call (as PR #192667's description reads ``FunctionsManual.cpp``).
# To see what the kernel receives, and to confirm the cause, register a reference CPU kernel for
# ``aten::linalg_lu_solve`` (unpack, multiply, solve) with ``torch.library.Library("aten",
# "IMPL")``: it records each call's LU, and every wrong row becomes right. ``_destroy`` (private
# in 2.13) restores torch's kernel, checked after. What the functions close over is swapped for
# CPU copies, whatever the page's device. The record: the LU has a size-1 dimension per inner
# level, with stride 4; in the recipe its rows are one LU repeated, so row 4, read at offset 16,
# met row 1's copy: the same LU, hence right. Fix (3)'s factors arrive unbatched.
seen, watching = {}, None


def reference_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    rows = f"rows equal {torch.equal(LU, LU[:1].expand_as(LU))}" if LU.dim() > 2 else ""
    layout = f"LU {tuple(LU.shape)}, strides {LU.stride()}, adjoint {adjoint}"
    seen.setdefault(watching, set()).add(f"{layout}, {rows or 'unbatched'}")
    P, L, U = torch.lu_unpack(LU, pivots)
    full = P @ L @ U  # a fresh, contiguous A
    return torch.linalg.solve(full.mH if adjoint else full, B, left=left)


for left, adjoint in [(True, True), (False, False)]:  # the reference's own check
    rows = rhs if left else rhs.mT
    want = torch.linalg.solve(M3.mT if adjoint else M3, rows, left=left)[:, None]
    got = reference_lu_solve(LU3, piv3, rows, left=left, adjoint=adjoint)[:, None]
    holds(f"reference kernel, left {left}, adjoint {adjoint}", got, want, 2e-15)
solve_score = lambda M: b @ torch.linalg.solve(M, b)  # noqa: E731  (A not symmetric)
by_eager = torch.stack([eager_hessian(solve_score, M) for M in A])
WATCHED = {  # label: the function, its input, its reference, the bound
    "vmap(hessian(nll))": (nll, xs, exact, 1e-14),
    "vmap(hessian(det))": (torch.linalg.det, A, det_exact, 2e-14),
    "vmap(hessian(b·solve(A, b)))": (solve_score, A, by_eager, 2e-15),
    "fix (3), vmap(hessian(nll_lu))": (nll_lu, xs, exact, 1e-14),
}
before = {k: per_row(vmap(hessian(w[0]))(w[1]), w[2]) for k, w in WATCHED.items()}
library, results = torch.library.Library("aten", "IMPL"), {}
try:
    with warnings.catch_warnings(action="ignore"):  # "Overriding a previously ..."
        library.impl("linalg_lu_solve", reference_lu_solve, "CPU")
    S, LU, pivots, b = S.cpu(), LU.cpu(), pivots.cpu(), b.cpu()
    for watching, (f, inputs, *_) in WATCHED.items():  # the kernel files under watching
        results[watching] = vmap(hessian(f))(inputs.cpu())
finally:
    library._destroy()
    S, LU, pivots, b = (t.to(device) for t in (S, LU, pivots, b))
for label, (_, _, want, bound) in WATCHED.items():
    print(f"  {label}, the kernel saw:", *sorted(seen[label]), sep="\n    ")
    print(f"  torch's kernel: row errors {shown(before[label])}")
    assert not on_cpu or (max(before[label]) > 1e-3) == (not label.startswith("fix"))
    holds("the reference kernel", results[label], want.cpu(), bound)
again = torch.linalg.lu_solve(LU3[:, None], piv3[:, None], rhs[:, None])
assert torch.equal(again, unsqueezed)  # torch's own kernel is back, wrong as before

# %%
# Not found upstream: a search of PyTorch's issues (lu_solve stride, unsqueezed LU, vmap hessian
# solve) found no report of this. Neighbours: pytorch#192540, a different defect in the same
# forward formulas (``jacfwd(jacfwd(det))`` loses a term; part 10), and pytorch#151440, where
# ``vmap`` and a plain call of ``linalg.solve`` differed in rounding through a layout-dependent
# path (PR #151896). On CUDA, another ``lu_solve`` kernel: one run of this page on an NVIDIA H100
# with torch 2.11.0+cu130 gave every row of the recipe within 2e-15 and every cell of the survey
# "right"; run again there with the GPU hidden, torch 2.11 on the CPU got rows 1, 2, 3 and 5
# wrong, as 2.13 does here. A GPU run prints the rows; only the CPU's are asserted.

# %%
# (No error) your own function: compare vmap with a loop, row by row
# -------------------------------------------------------------------
# No message will tell you, so check once per function and device: the same transform, batched
# and in a Python loop, row by row. Any row beyond rounding is a batching bug. It cannot see a
# transform wrong for every sample (the loop's calls run the same formulas: part 10's
# ``jacfwd(jacfwd(det))`` is wrong in both), so check one sample against a closed form or finite
# differences too. Here it flags the recipe's rows 1, 2, 3 and 5, the ones the closed form found
# wrong, and nothing in the Cholesky version.


def batched_vs_loop(transformed, *batches, bound=1e-10):
    """Rows where vmap(transformed) differs from transformed applied row by row."""
    together = vmap(transformed)(*batches)
    apart = torch.stack([transformed(*row) for row in zip(*batches)])
    errors = per_row(together, apart)
    print(f"  row errors against the loop: {shown(errors)}")
    return [i for i, e in enumerate(errors) if not e <= bound]


flagged = batched_vs_loop(hessian(nll), xs)
by_closed_form = [i for i, e in enumerate(per_row(batched, exact)) if e > 1e-10]
assert flagged == by_closed_form
assert batched_vs_loop(hessian(nll_cholesky), xs) == []

# %%
# What to remember
# ----------------
# - ``vmap(hessian(f))`` and ``vmap(jacfwd(f))`` through ``torch.linalg.solve``, ``det`` or
#   ``slogdet`` are silently wrong on the CPU in torch 2.13, in batch rows after the first (not
#   all), even with a constant matrix. Other devices: run ``batched_vs_loop`` there.
# - Fixes for a shared matrix, checked: ``vmap(jacrev(jacrev(f)))`` through ``solve``;
#   ``cholesky`` and ``cholesky_solve``; ``lu_factor`` once and ``lu_solve``; one sample at a
#   time. A matrix per sample: the first two hold; ``lu_solve`` needs ``LU.contiguous()``.
# - Cause: the CPU ``lu_solve`` kernel reads an LU with an inserted size-1 batch dimension
#   (``LU[:, None]``, as a ``vmap`` nested under the outer one makes) at the wrong offsets.
# - A batched transform with no error can still be wrong: compare it with a loop, row by row.
