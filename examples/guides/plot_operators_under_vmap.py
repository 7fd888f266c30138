"""
Which operators batch under vmap? An executed table for the installed torch
===========================================================================

"There is a performance drop because we have not yet implemented the batching rule for aten::X"
or "Batching rule not implemented for aten::X": does ``X`` batch under ``vmap``, its backward under
``vmap(grad(...))``, and what to write instead? Two tests (a warning filter and a switch that
makes every fallback raise), then about three dozen operators users ask about, each against a loop.
"""

import os
import tempfile
import textwrap
import warnings
from contextlib import contextmanager

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import grad, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64 = {"dtype": torch.float64, "device": device}


# %%
# Test one: warnings into errors
# ------------------------------
# An operator without a batching rule often still runs under :func:`~torch.func.vmap`: a
# *fallback* calls it once per sample, stacks the results, and warns; through torch's Python
# functions (``torch.histc``) with a ``UserWarning``, which a warnings-as-errors filter turns into
# an error naming the operator. Then compare with a loop: no warning does not mean right.
def check_batches(fn, batch):
    with warnings.catch_warnings(action="error"):  # a fallback's Python warning raises
        mapped = vmap(fn)(batch)
    torch.testing.assert_close(mapped, torch.stack([fn(sample) for sample in batch]))
    return mapped


rows = torch.randn(4, 8, **f64)
check_batches(lambda row: torch.sort(row).values, rows)
print("sort: batched, no warning, equal to a loop")
try:
    check_batches(lambda row: torch.histc(row, bins=4, min=-2, max=2), rows)
    raise AssertionError("histc ran under vmap without a warning")
except UserWarning as warning:
    assert "performance drop" in str(warning) and "aten::histc" in str(warning), warning
    print("histc:", textwrap.shorten(str(warning), width=110))


# %%
# Operators called through ``torch.ops``; test two
# ------------------------------------------------
# An operator reached through ``torch.ops`` (a ``torch.library`` custom operator, or
# ``torch.ops.aten.histc``, checked last) falls back too, but warns only with a C++ log line on
# stderr, which a filter can neither catch nor silence. torchvision's ``nms`` calls
# ``torch.ops.torchvision.nms`` (its source): probably the same. Shown on a custom operator like
# ``nms``, keeping the indices of the scores above a threshold: with equal counts per sample,
# ``check_batches`` passes it; with unequal counts the fallback's stack fails. Its author can give
# it a rule, ``register_vmap``: :ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`.
@torch.library.custom_op("opsundervmap::above", mutates_args=())
def above(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    return torch.nonzero(scores > threshold).flatten()


def c_stderr(call):  # call()'s result, and what C++ wrote meanwhile to stderr
    with tempfile.TemporaryFile() as log:
        saved, _ = os.dup(2), os.dup2(log.fileno(), 2)
        try:
            result = call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return result, log.read().decode()


def raises(call, start):  # call()'s RuntimeError, checked to begin with start
    try:
        call()
    except RuntimeError as failure:
        assert str(failure).startswith(start), failure
        return str(failure)
    raise AssertionError(f"no error; expected {start}")


scores = torch.tensor([[0.9, 0.1, 0.7], [0.2, 0.8, 0.6]], **f64)
kept, log = c_stderr(lambda: check_batches(lambda s: above(s, 0.5), scores))
print("above(s, 0.5): no Python warning, equal to a loop:", kept.tolist())
print("  stderr:", textwrap.shorten(log.split("] ")[-1], width=125))
assert "rule for opsundervmap::above" in log and kept.tolist() == [[0, 2], [1, 2]]
unequal = lambda: c_stderr(lambda: vmap(above, (0, None))(scores, 0.65))  # noqa: E731
print("above(s, 0.65):", raises(unequal, "stack expects each tensor to be equal size"))
_, log = c_stderr(lambda: check_batches(lambda r: torch.ops.aten.histc(r, 4), rows))
assert "rule for aten::histc" in log, log  # and no Python warning


# %%
# The certain test is a switch: with ``torch._C._functorch._set_vmap_fallback_enabled(False)``
# every fallback raises ``RuntimeError``, however the operator is called. It is private (it may
# change or go) and process-global (a static flag in ``BatchedFallback.cpp``): restore it in a
# ``finally``, as PyTorch's tests do (``DisableVmapFallback``, ``test/functorch/common_utils.py``).
# To silence the warning instead, see section "No module named 'functorch._C'" of
# :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_versions_and_export.py`.
@contextmanager
def fallback_raises():
    was = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(was)


DISABLED = "hit the vmap fallback which is currently disabled"
with fallback_raises():
    for name, call in [("opsundervmap::above", lambda: vmap(above, (0, None))(scores, 0.5)),
                       ("aten::histc", lambda: vmap(torch.histc)(rows))]:  # fmt: skip
        print("fallback off: RuntimeError:", raises(call, f"{name} {DISABLED}"))
assert torch._C._functorch._is_vmap_fallback_enabled()

# %%
# A verdict for forward and backward
# ----------------------------------
# The table runs each call twice: fallbacks off (a fallback raises, naming its operator), then on,
# recording warnings and catching errors. A result that differs from the loop, has another shape,
# or is not finite is WRONG. The backward is ``vmap(grad(loss))``, ``loss = (op(x) · w).sum()``,
# a cotangent ``w`` and inputs per sample, as in per-sample gradients (one ``cdist`` row shares
# the inputs, as ``jacrev`` does). Reference, in float64: a loop of :func:`torch.autograd.grad`.
# "Equal": a relative error within ``BOUND``, wider on CUDA (cuBLAS, cuSOLVER may round otherwise).
BOUND = 1e-13 if device.type == "cuda" else 1e-14
RAISED = (RuntimeError, NotImplementedError)
GIST = {"dynamic shape": "dynamic output shape", "could not generate": "no fallback",
        "derivative for": "no derivative", "broadcast shape": "shape mismatch"}  # fmt: skip


def attempt(call):  # result, error, and the operators that fell back
    fallen = set()
    try:
        with fallback_raises():
            call()
    except RAISED as raised:
        fallen |= {str(raised).split()[0]} if DISABLED in str(raised) else set()
    with warnings.catch_warnings(record=True, action="always") as drops:
        try:
            result, error = call(), None
        except RAISED as raised:
            result, error = None, raised
    said = [str(w.message) for w in drops if "performance drop" in str(w.message)]
    fallen |= {s.split("rule for ")[1].split(". ")[0] for s in said}
    names = sorted({n.split(".")[0].removeprefix("aten::") for n in fallen})
    return result, error, names


def relative_error(got, want):  # inf for another shape; nan if not finite
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def classify(error, fallen, errors):  # (class, text, error, the failure's message)
    if error is not None:
        text = str(error)
        op = text.split("aten::")[1].split()[0].strip(".") if "aten::" in text else ""
        why = next((v for k, v in GIST.items() if k in text), text[:30])
        message = f"{type(error).__name__}: {text}"
        return "fails", f"fails: {why}" + (op and f", {op}"), 0.0, message
    bad = [e for e in errors if not e <= BOUND]  # nan and inf included
    if bad:
        return "wrong", f"WRONG (error {bad[0]:.1e})", bad[0], ""
    if fallen:
        return "falls back", "falls back: " + ", ".join(fallen), max(errors), ""
    return "batched", "batched", max(errors), ""


def verdicts(op, args, dims, wrt, grad_dims=None):
    # forward: vmap(op) against a loop over the batched arguments
    pick = lambda i, dims: [a[i] if d == 0 else a for a, d in zip(args, dims)]  # noqa: E731
    size = next(a.shape[0] for a, d in zip(args, dims) if d == 0)
    result, error, fallen = attempt(lambda: vmap(op, in_dims=dims)(*args))
    loop = torch.stack([op(*pick(i, dims)) for i in range(size)]) if not error else None
    errors = [0.0] if error else [relative_error(result.to(loop.dtype), loop)]
    forward = classify(error, fallen, errors)
    if not wrt:
        return forward, ("n/a", "not differentiable", 0.0, "")
    # backward: vmap(grad) with a cotangent per sample, against torch.autograd.grad in a loop
    cots = torch.randn_like(torch.stack([op(*pick(i, dims)) for i in range(size)]))
    loss = lambda *a: (op(*a[:-1]) * a[-1]).sum()  # noqa: E731
    in_dims = (*(grad_dims or dims), 0)
    call = lambda: vmap(grad(loss, argnums=wrt), in_dims=in_dims)(*args, cots)  # noqa: E731
    result, error, fallen = attempt(call)
    errors = [0.0]
    fresh = lambda t: t.detach().clone().requires_grad_(t.is_floating_point())  # noqa: E731
    for k, i in enumerate(wrt if not error else ()):
        xs = [[fresh(t) for t in pick(s, in_dims)] for s in range(size)]
        pulls = [torch.autograd.grad(loss(*x, w), x[i]) for x, w in zip(xs, cots)]
        errors.append(relative_error(result[k], torch.stack([g for (g,) in pulls])))
    return forward, classify(error, fallen, errors)


# %%
# The operators users ask about
# -----------------------------
# Each entry: the operator on *one* sample, a batch of inputs (matrices well conditioned), their
# ``in_dims``, the arguments to differentiate, and optionally other ``in_dims`` for the backward.
rand = lambda *shape: torch.randn(4, *shape, **f64)  # noqa: E731
spd = lambda: (m := rand(3, 3)) @ m.mT + 3 * torch.eye(3, **f64)  # noqa: E731
la, cell = torch.linalg, torch.nn.LSTMCell(3, 2).double()  # on the CPU, as its input
hann, edges = torch.hann_window(8, **f64), torch.linspace(-1, 1, 5, **f64)
ids, im = torch.randint(0, 6, (4, 2, 3), device=device), rand(2, 5, 5)
AB, tall = (spd(), rand(3, 2)), (rand(5, 3), rand(5, 2))
OPS = {  # name: (op on one sample, arguments, in_dims, differentiate, backward in_dims)
    "linalg.solve": (la.solve, (spd(), rand(3)), (0, 0), (0, 1)),
    "linalg.slogdet": (lambda A: la.slogdet(A).logabsdet, (spd(),), (0,), (0,)),
    "linalg.inv": (la.inv, (spd(),), (0,), (0,)),
    "linalg.eigh": (lambda A: la.eigh(A + A.mT).eigenvectors ** 2, (rand(3, 3),), (0,), (0,)),
    "cholesky_solve": (lambda A, B: torch.cholesky_solve(B, la.cholesky(A)), AB, (0, 0), (0, 1)),
    "ldl_factor + ldl_solve": (lambda A, B: la.ldl_solve(*la.ldl_factor(A), B), AB, (0, 0), (0, 1)),
    "lu_factor + lu_solve": (lambda A, B: la.lu_solve(*la.lu_factor(A), B), AB, (0, 0), (0, 1)),
    "linalg.lstsq, matrix B": (lambda A, B: la.lstsq(A, B).solution, tall, (0, 0), (0, 1)),
    "linalg.qr": (lambda A: la.qr(A).R, (rand(4, 3),), (0,), (0,)),
    "linalg.svd": (lambda A: la.svd(A).U.abs(), (rand(4, 3),), (0,), (0,)),
    "householder_product": (la.householder_product, (rand(4, 3), rand(3)), (0, 0), (0, 1)),
    "searchsorted": (torch.searchsorted, (rand(6).sort().values, rand(3)), (0, 0), ()),
    "bucketize, shared edges": (lambda x: torch.bucketize(x, edges), (rand(6),), (0,), ()),
    "bucketize, own edges": (torch.bucketize, (rand(6), rand(5).sort().values), (0, 0), ()),
    "histc": (lambda x: torch.histc(x, 4, -2, 2), (rand(8),), (0,), ()),
    "bincount, minlength": (lambda i: torch.bincount(i, minlength=6), (ids[:, 0],), (0,), ()),
    "unique": (torch.unique, (ids[:, 0],), (0,), ()),
    "nonzero": (torch.nonzero, (ids[:, 0],), (0,), ()),
    "custom op (torch.library)": (lambda s: above(s, 0.0), (rand(6).abs(),), (0,), ()),
    "topk": (lambda x: x.topk(2).values, (rand(6),), (0,), (0,)),
    "sort": (lambda x: x.sort().values, (rand(6),), (0,), (0,)),
    "kthvalue": (lambda x: x.kthvalue(2).values, (rand(6),), (0,), (0,)),
    "median": (torch.median, (rand(7),), (0,), (0,)),
    "quantile": (lambda x: torch.quantile(x, 0.3), (rand(7),), (0,), (0,)),
    "F.affine_grid": (lambda t: F.affine_grid(t[None], [1, 1, 4, 4], False)[0],
                      (rand(2, 3),), (0,), (0,)),
    "F.grid_sample": (lambda im, g: F.grid_sample(im[None], g[None], align_corners=False)[0],
                      (im, rand(3, 3, 2).tanh()), (0, 0), (0, 1)),
    "F.interpolate, bilinear": (lambda im: F.interpolate(im[None], None, 2, "bilinear")[0],
                                (im,), (0,), (0,)),
    "F.embedding_bag": (lambda w, i: F.embedding_bag(i, w), (rand(6, 3), ids), (0, 0), (0,)),
    "nn.LSTMCell, own state": (lambda x: cell(x)[0], (rand(3).cpu(),), (0,), (0,)),
    "nn.LSTMCell, batched state": (lambda x, h, c: cell(x, (h, c))[0],
                                   tuple(rand(n).cpu() for n in (3, 2, 2)), (0, 0, 0), (0, 1, 2)),
    "torch.stft": (lambda x: torch.stft(x, 8, window=hann, return_complex=True).abs(),
                   (rand(32),), (0,), (0,)),
    "F.pad, reflect": (lambda x: F.pad(x, (2, 2), mode="reflect"), (rand(2, 6),), (0,), (0,)),
    "roll": (lambda x: x.roll(1, 0), (rand(6),), (0,), (0,)),
    "F.max_pool2d, indices": (lambda im: F.max_pool2d_with_indices(im, 2)[1], (im,), (0,), ()),
    "cdist": (torch.cdist, (rand(4, 3), rand(5, 3)), (0, 0), (0, 1)),
    "cdist, shared points": (torch.cdist, (rand(4, 3), rand(5, 3)), (0, 0), (0, 1), (None, None)),
}  # fmt: skip
table, _ = c_stderr(lambda: {n: verdicts(*entry) for n, entry in OPS.items()})
# multinomial: two draws, without replacement, from sample s's outcomes s and s + 2 give both
support = torch.arange(4, device=device)[:, None] + torch.tensor([0, 2], device=device)
draws = vmap(torch.multinomial, (0, None), randomness="different")
probs = torch.zeros(4, 6, **f64).scatter(1, support, 0.5)
result, error, fallen = attempt(lambda: draws(probs, 2))
gap = relative_error(result.sort(1).values.to(**f64), support.to(**f64))
table["multinomial, different"] = classify(error, fallen, [gap]), ("n/a", "-", 0.0, "")
print(f"{f'operator ({len(table)} rows)':26s} | {'vmap(op)':38s} | vmap(grad(loss))")
for name, ((_, forward, *_), (_, backward, *_)) in table.items():
    print(f"{name:26s} | {forward:38s} | {backward}")
top = max(v[2] for cells in table.values() for v in cells if v[0] != "wrong")
print(f"largest error of the results equal to the loop: {top:.1e} (bound {BOUND:.0e})")
wrong = [name for name, cells in table.items() if any(c[0] == "wrong" for c in cells)]
(cd, (P, Q), *_), err = OPS["cdist, shared points"], table["cdist, shared points"][1][2]
same = vmap(grad(lambda p, w: (cd(p, Q) * w).sum()), (None, 0))(P, rand(4, 5))
gap = relative_error(same, same[:1].expand_as(same))
print(f"cdist, shared points: each sample's gradient vs the first's, error {gap:.1e}")
assert wrong == ["cdist, shared points"] and 0.1 < err < float("inf") and gap <= BOUND
assert table["F.embedding_bag"][1][1].endswith(", _embedding_bag_backward"), table
assert [c[0] for c in table["nn.LSTMCell, batched state"]] == ["fails", "batched"]
assert table["multinomial, different"][0][0] == "batched"
assert table["custom op (torch.library)"][0][1] == "falls back: opsundervmap::above"
assert [c[0] for c in table["torch.stft"]] == ["falls back", "batched"]
assert [c[0] for c in table["householder_product"]] == ["batched", "falls back"]

# %%
# The failures. ``unique``, ``nonzero``: the output's shape depends on the data. ``lstm_cell``:
# the fallback refuses, among others, operators taking a list of tensors (as read in torch's
# ``BatchedFallback.cpp``), as ``lstm_cell`` does (its schema, printed): under ``vmap``, write the
# cell out. Under ``grad`` on the CPU the cell runs as smaller operations (``RNN.cpp``), and its
# own state, with no sample dimension, takes the batched gates in an in-place add; a batched
# ``(h, c)`` matches the loop, as section "``nn.GRUCell`` and ``nn.LSTMCell``" of
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_recurrent.py` shows.
# These rows run on the CPU: on CUDA the cell calls ``_thnn_fused_lstm_cell``, which has no
# batching rule in 2.13's table, so there it probably falls back, with a batched state or not.
# ``ldl_solve`` has no derivative, under vmap or not: use ``lu_factor`` + ``lu_solve``, or
# ``cholesky`` + ``cholesky_solve`` for a positive-definite matrix (both batched above).
#
# The wrong result: the shared-points ``cdist`` row gives its 4 sets of 4 and 5 points in 3-D
# whole to every sample (``cdist`` runs its own batch) and maps over the cotangents alone: every
# sample gets the same gradient (printed). It takes ``_cdist_backward`` (at most 25 points per set,
# default ``compute_mode``); other sizes, ``p`` and ``compute_mode``, ``jacrev(torch.cdist)`` (hit
# too), why, and the fixes: "(No error) torch.cdist's backward under jacrev or vmap" in
# :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_indices_and_batched_grads.py`.
for name, col, says in [("nn.LSTMCell, own state", 0, "lstm_cell. We could not generate"),
                        ("nn.LSTMCell, own state", 1, "match the broadcast shape [4, 1, 8]"),
                        ("ldl_factor + ldl_solve", 1, "linalg_ldl_solve is not implemented"),
                        ("unique", 0, "dynamic shape. Attempted to vmap over")]:  # fmt: skip
    message = table[name][col][3]
    assert message.startswith("RuntimeError: ") and says in message, message
    print(f"{name}: {textwrap.shorten(message, width=140)}")
print("aten::lstm_cell's schema:", torch.ops.aten.lstm_cell.default._schema)

# %%
# The table as a grid: the shade is the class; the text, the operator that fell back or the error.
SHADES = {"batched": 1.0, "falls back": 0.75, "fails": 0.45, "wrong": 0.0, "n/a": 0.93}
fig, ax = plt.subplots(figsize=(9, 0.28 * len(table) + 1))
shades = [[SHADES[verdict[0]] for verdict in cells] for cells in table.values()]
ax.imshow(shades, "gray", vmin=0, vmax=1, aspect="auto", extent=(0, 2, len(table), 0))
for row, name in enumerate(table):
    for col, (kind, text, *_) in enumerate(table[name]):
        ink = "white" if kind in ("wrong", "fails") else "black"
        ax.text(col + 0.03, row + 0.5, text[:52], va="center", fontsize=7, color=ink)
ax.set_xticks([0.5, 1.5], ["vmap(op)", "vmap(grad(loss))"])
ax.set_yticks([r + 0.5 for r in range(len(table))], list(table), fontsize=7)
ax.set_title(f"torch {torch.__version__} on {device.type}: verdicts as run here")
fig.tight_layout()
plt.show()


# %%
# The batched route
# -----------------
# A fallback is right but slow; a failure needs another formula. Outside ``vmap``, call the
# operator on the batch (linalg operators take leading batch dimensions, ``quantile`` a ``dim``).
# Inside a vmapped function (a spatial transformer under ``vmap(grad(functional_call))``), build
# it from batched operators: ``affine_grid`` as pixel centres times θᵀ, ``quantile`` as a sort and
# a ``lerp``, counts by ``scatter_add`` or ``one_hot``; each against a loop, with the fallback off.
def against_loop(label, batched, op, *args, bound=BOUND / 10):  # 0 for counts
    loop = torch.stack([op(*sample) for sample in zip(*args)])
    gap = relative_error(batched.to(loop.dtype), loop)
    print(f"{label:44s} error {gap:.1e} (bound {bound:.0e})")
    assert gap <= bound, label


centres = lambda n: (2 * torch.arange(n, **f64) + 1) / n - 1  # noqa: E731
ys, xs = torch.meshgrid(centres(4), centres(4), indexing="ij")  # align_corners=False
base = torch.stack([xs, ys, torch.ones_like(xs)], dim=-1)  # (4, 4, 3): x, y, 1
(spatial, (thetas,), *_), weights = OPS["F.affine_grid"], torch.randn(4, 4, 4, 2, **f64)
pulled = lambda t, w: torch.autograd.grad((spatial(t) * w).sum(), t)[0]  # noqa: E731
(quantile, (x,), *_), q, labels = OPS["quantile"], 0.3, ids[:, 0]
at = q * (x.shape[-1] - 1)  # the quantile's place in a sorted row: between k and k + 1
k, frac = int(at), at - int(at)
values, lo, hi, bins = OPS["histc"][1][0], -2.0, 2.0, 4  # histc(values, bins, lo, hi)
with fallback_raises():
    in_vmap = vmap(lambda t: base @ t.mT)(thetas)
    against_loop("affine_grid as base @ theta.mT, in vmap", in_vmap, spatial, thetas)
    by_grad = vmap(grad(lambda t, w: ((base @ t.mT) * w).sum()))(thetas, weights)
    against_loop("  its vmap(grad), vs autograd.grad", by_grad, pulled,
                 thetas.clone().requires_grad_(), weights)  # fmt: skip
    against_loop("quantile on the batch, dim=-1", torch.quantile(x, q, -1), quantile, x)
    by_sort = vmap(lambda r: torch.lerp(*r.sort().values[k : k + 2], frac))(x)
    against_loop("quantile as sort + lerp, in vmap", by_sort, quantile, x)
    one_hot = vmap(lambda i: F.one_hot(i, 6).sum(0))(labels)
    against_loop("bincount as one_hot(...).sum(0), in vmap", one_hot,
                 OPS["bincount, minlength"][0], labels, bound=0)  # fmt: skip
    inside = (values >= lo) & (values <= hi)  # counted; hi goes in the last bin
    which = ((values - lo) * bins / (hi - lo)).floor().long().clamp(0, bins - 1)
    hist = torch.zeros(4, bins, **f64).scatter_add_(1, which, inside.double())
    against_loop("histc as scatter_add", hist, OPS["histc"][0], values, bound=0)
    (bag, (table_w, bags), *_) = OPS["F.embedding_bag"]
    got = vmap(lambda w, i: w[i].mean(-2))(table_w, bags)
    against_loop("embedding_bag as gather + mean, in vmap", got, bag, table_w, bags)


# %%
# Non-maximum suppression (NMS) keeps a data-dependent number of boxes per image: a per-image NMS
# cannot stack under ``vmap``. The batched route: shift each image's boxes so that no two images'
# boxes overlap, and run one NMS on all (``torchvision.ops.batched_nms`` does so for small inputs,
# its source shows; large ones loop). torchvision is not installed here: a greedy NMS of ours
# stands in, and the shift is checked against a loop over the images.
def greedy_nms(boxes, scores, most=0.5):  # kept indices, by falling score
    low = torch.maximum(boxes[:, None, :2], boxes[:, :2])
    meet = (torch.minimum(boxes[:, None, 2:], boxes[:, 2:]) - low).clamp_min(0).prod(-1)
    area = (boxes[:, 2:] - boxes[:, :2]).prod(-1)
    overlaps, alive, kept = meet / (area[:, None] + area - meet), scores > -1, []
    for i in scores.argsort(descending=True).tolist():
        if alive[i]:
            kept.append(i)
            alive &= overlaps[i] <= most  # drops box i too: its IoU with itself is 1
    return torch.tensor(kept, device=scores.device)


corners, box_scores = 3 * torch.rand(5, 30, 2, **f64), torch.rand(5, 30, **f64)
boxes = torch.cat([corners, corners + 1 + 2 * torch.rand(5, 30, 2, **f64)], dim=-1)
per_image = [greedy_nms(b, s) for b, s in zip(boxes, box_scores)]
shift = (boxes.amax() + 1) * torch.arange(5, **f64)  # image i moves i (max + 1)
flat = greedy_nms((boxes + shift[:, None, None]).flatten(0, 1), box_scores.flatten())
assert all(torch.equal(flat[flat // 30 == i] % 30, k) for i, k in enumerate(per_image))
counts = [len(kept) for kept in per_image]
print(f"one NMS over 5 images keeps {counts} of 30 boxes, as a loop over images does")
assert len(set(counts)) > 1  # unequal: a per-image NMS under vmap could not stack

# %%
# What the fallback costs
# -----------------------
# ``affine_grid`` for 256 matrices: ``vmap``'s fallback loop against one call on the batch.
many, timings, threads = torch.randn(256, 2, 3, **f64), {}, torch.get_num_threads()
routes = {"vmap, fallback loop": lambda: vmap(spatial)(many),
          "one call on the batch": lambda: F.affine_grid(many, [256, 1, 4, 4], False)}  # fmt: skip
with warnings.catch_warnings(action="ignore"):  # the fallback's warning, shown above
    for label, run in routes.items():
        run()
        timer = benchmark.Timer("run()", globals={"run": run}, num_threads=threads)
        timings[label] = t = timer.blocked_autorange(min_run_time=0.3)
        spread = f"IQR {t.iqr * 1e3:.3f} ms, {len(t.times)} blocks"
        print(f"{label:24s} {t.median * 1e3:.3f} ms ({spread})")
ratio = timings["vmap, fallback loop"].median / timings["one call on the batch"].median
print(f"the fallback loop takes {ratio:.1f}x the time of one call on the batch")

# %%
# What to remember
# ----------------
# * Test under ``warnings.catch_warnings(action="error")`` (Python functions only), or with the
#   private ``torch._C._functorch._set_vmap_fallback_enabled(False)`` (all); then against a loop.
# * A fallback is right but runs the operator per sample. Failures here: a data-dependent output
#   shape (``unique``: a fixed-size formula), an operator the fallback refuses (``lstm_cell``:
#   write it out; on the CPU ``vmap(grad)`` runs with a batched ``(h, c)``), a missing derivative.
# * Test the backward too: ``vmap(grad(...))`` can fall back where the forward batched
#   (``householder_product``), or batch where it fell back (``stft``); ``cdist`` with shared
#   points batches *wrongly* without a warning.
# * The batched route: call the operator on the batch outside ``vmap``; inside, build it from
#   batched operators (``affine_grid`` as ``base @ theta.mT``, counts by ``scatter_add``); for
#   NMS, one NMS on boxes shifted apart per image (``batched_nms``, on small inputs).
