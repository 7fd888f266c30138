"""
Troubleshooting, part 9: tensors that escape a transform, internal asserts, older messages
==========================================================================================

A tensor made inside a transform and kept (a cache on ``self``, a list, a hook's capture) reaches
the next call as a functorch wrapper: an internal assert that asks for a bug report, or a silent
run on the first call's values. Here: both asserts torch 2.13 gives, the silent cases, finding the
kept tensor, the fixes; a kernel with no ``vmap`` rule; old functorch messages; your traceback line.
"Either your tensor may have escaped": :doc:`plot_troubleshooting_arguments` (a checkpoint).
"""

import copy
import traceback
import warnings
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._C import _functorch as ft
from torch.func import functional_call, grad, hessian, jacrev, stack_module_state, vmap
from torch.utils._pytree import tree_leaves

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
F64 = dict(dtype=torch.float64, device=device)


def loss_of(model):  # one sample's squared error, the weights given to functional_call
    return lambda p, x, y: (functional_call(model, p, (x,)) - y).square().sum()


def per_sample(model):  # per-sample gradients: vmap over grad, the weights shared
    return vmap(grad(loss_of(model)), in_dims=(None, 0, 0))


def must_fail(kind, words, call):
    """call() raises exactly ``kind``, ``words`` in its message; returns the error."""
    try:
        call()
    except kind as err:
        said = " ".join(format(err).split())
        assert type(err) is kind and words in said, f"{type(err).__name__}: {said}"
        shown = f"{said[:64]} ... {said[-26:]}" if len(said) > 96 else said
        print(f"  {kind.__name__}: {shown}")
        return err
    raise AssertionError(f"torch {torch.__version__}: no {kind.__name__}, {words}")


def agrees(label, got, want, bound):
    """Each tensor, or each dict entry, against its reference: max gap / max entry."""
    pairs = [(got[k], want[k]) for k in want] if type(want) is dict else [(got, want)]
    worst = 0.0
    for mine, truth in pairs:
        assert mine.shape == truth.shape, f"{label}: {mine.shape} for {truth.shape}"
        gap = ((mine - truth).abs().max() / truth.abs().max()).item()
        assert gap <= bound, f"{label}: error {gap:.1e} above {bound:.0e}"
        worst = max(worst, gap)
    print(f"  {label}: error {worst:.1e} (bound {bound:.0e})")


def leaks(where):
    """Functorch wrappers kept in a module or a dict: {name: its layers, outermost first}."""
    if isinstance(where, nn.Module):
        subs = where.named_modules()
        where = {f"{p}.{k}".lstrip("."): v for p, m in subs for k, v in vars(m).items()}
    found = {}
    for name, value in where.items():
        for leaf in tree_leaves(value):
            layers = []
            while torch.is_tensor(leaf) and ft.is_functorch_wrapped_tensor(leaf):
                if ft.is_batchedtensor(leaf):
                    level = ft.maybe_get_level(leaf)
                    layers.append(f"vmap's BatchedTensor (level {level})")
                else:
                    state = "dead" if ft.is_dead_tensor_wrapper(leaf) else "live"
                    layers.append(f"a {state} autograd wrapper")
                leaf = ft.get_unwrapped(leaf)
            if layers:
                found[name] = " around ".join(layers)
    return found


# %%
# batched == nullptr INTERNAL ASSERT FAILED at ".../functorch/Interpreter.cpp"
# ----------------------------------------------------------------------------
# A ``RuntimeError`` from a tensor that ``vmap`` batched and a module kept, used under ``grad``.
# The module turns each pair of features by position x frequency, with a cos/sin table built on
# the first call (as rotary embeddings do); the reference, in complex numbers, keeps nothing. An
# ensemble (``stack_module_state`` and ``vmap``) maps the buffers too, so the table kept on the
# module ``functional_call`` runs is a ``BatchedTensor`` (``leaks``), which one member's gradients
# meet (``sanityCheckStack`` finds a wrapper below the last transform). With no transform it
# raises parts 2 and 3's error; a new ``vmap`` of another size fails, of the same size runs wrongly.
class Rotary(nn.Module):
    def __init__(self, width=4, learned=False):
        super().__init__()
        self.mix = nn.Linear(width, width, **F64)
        freq = 1 / 100 ** torch.linspace(0, 1, width // 2, **F64)
        if learned:
            self.freq = nn.Parameter(freq)
        else:
            self.register_buffer("freq", freq)
        self.table = None  # cos and sin, a row per position: built on the first call

    def forward(self, tokens):  # (length, width)
        if self.table is None:
            angles = torch.arange(len(tokens), **F64)[:, None] * self.freq
            self.table = angles.cos(), angles.sin()
        cos, sin = self.table
        even, odd = self.mix(tokens).unflatten(-1, (-1, 2)).unbind(-1)
        turned = even * cos - odd * sin, even * sin + odd * cos
        return torch.stack(turned, -1).flatten(-2)


def by_hand(weight, bias, freq, tokens):  # the reference: (e + i o) * exp(i angle)
    mixed = (tokens @ weight.T + bias).unflatten(-1, (-1, 2)).contiguous()
    angles = torch.arange(len(tokens), **F64)[:, None] * freq
    turned = torch.view_as_complex(mixed) * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(turned).flatten(-2)


def loop_grads(weights, xs, ys, names):  # per-sample: one autograd.grad per sample
    order = ("mix.weight", "mix.bias", "freq")
    leaves = {k: weights[k].clone().requires_grad_() for k in order}
    rows = []
    for x, y in zip(xs, ys):
        loss = (by_hand(*leaves.values(), x) - y).square().sum()
        rows.append(torch.autograd.grad(loss, [leaves[k] for k in names]))
    return {k: torch.stack(column) for k, column in zip(names, zip(*rows))}


xs, ys = torch.randn(2, 6, 5, 4, **F64)  # 6 samples of 5 tokens, and their targets
members = [Rotary() for _ in range(3)]
weights, buffers = stack_module_state(members)
shared = copy.deepcopy(members[0])  # the module functional_call runs for every member
on_shared = lambda w, b, x: functional_call(shared, (w, b), (x,))  # noqa: E731
ensemble = vmap(on_shared, in_dims=(0, 0, None))
outputs = ensemble(weights, buffers, xs[0])
print("kept on the module:", leaks(shared))
assert leaks(shared) == {"table": "vmap's BatchedTensor (level 1)"}
wanted = torch.stack([by_hand(*m.mix.parameters(), m.freq, xs[0]) for m in members])
agrees("the ensemble's own call", outputs, wanted, 1e-14)
first_member = {k: v[0] for k, v in weights.items()}
must_fail(RuntimeError, "batched == nullptr INTERNAL ASSERT FAILED",
          lambda: grad(loss_of(shared))(first_member, xs[0], ys[0]))  # fmt: skip
must_fail(RuntimeError, "Either your tensor may have escaped", lambda: shared(xs[0]))
must_fail(RuntimeError, "must match the size of tensor b (3)",
          lambda: per_sample(shared)(first_member, xs, ys))  # fmt: skip
# A ``vmap`` of the ensemble's size (3) raises nothing: sample i meets member i's row of the kept
# table. The members' frequencies are equal here; made to differ, samples 1 and 2 go wrong.
shared.table = None
ensemble(weights, {"freq": buffers["freq"] * torch.arange(1, 4, **F64)[:, None]}, xs[0])
names = ["mix.weight", "mix.bias"]
truth = loop_grads({**first_member, "freq": members[0].freq}, xs, ys, names)
silent = per_sample(shared)(first_member, xs[:3], ys[:3])["mix.weight"]
gaps = [(s - r).abs().max() / r.abs().max() for s, r in zip(silent, truth[names[0]])]
print("  3 samples, frequencies x1, x2, x3: errors", [f"{g:.2g}" for g in gaps])
assert gaps[0] < 1e-14 and min(gaps[1:]) > 0.1

# %%
# Two fixes, checked against the loop: build the table in eager before any transform, or give
# ``vmap`` the buffers unmapped (``in_dims`` ``None``; equal in every member, checked). Both hold
# while the table depends on nothing that a transform maps or differentiates.
shared.table = None
shared(xs[0])  # fix 1: built in eager
agrees("fix 1, the ensemble", ensemble(weights, buffers, xs[0]), wanted, 1e-14)
agrees("fix 1, per sample", per_sample(shared)(first_member, xs, ys), truth, 1e-14)
assert leaks(shared) == {}
assert all(torch.equal(b, buffers["freq"][0]) for b in buffers["freq"]), "differ"
one_buffer = {k: v[0] for k, v in buffers.items()}
unmapped = vmap(on_shared, in_dims=(0, None, None))
shared.table = None
agrees("fix 2, the ensemble", unmapped(weights, one_buffer, xs[0]), wanted, 1e-14)
agrees("fix 2, per sample", per_sample(shared)(first_member, xs, ys), truth, 1e-14)
assert leaks(shared) == {}

# %%
# level.has_value() && level <= current_level INTERNAL ASSERT FAILED ... escaped?
# --------------------------------------------------------------------------------
# A ``RuntimeError`` from a tensor kept from a call with two autograd levels (``hessian``,
# ``jacrev(jacrev(...))``), used under ``grad``; older releases wrote the check as
# ``wrapper->level().value() <= current_level`` (functorch#1131; zhengyuf/PointAvatar#24). Here
# the frequencies are learned; the loss's 2 x 2 Hessian in them comes first. The table kept is two
# dead wrappers (``leaks``): the next call unwraps the outer one, and ``grad`` meets the inner one
# where it expects a live level at most its own (``materializeGradWrappers``). Without a
# transform it runs, on the stale table.
tuned = Rotary(learned=True)
tuned_weights = {k: v.detach() for k, v in tuned.named_parameters()}
freq_0 = tuned_weights["freq"]


def with_freq(model):  # one sample's loss as a function of the frequencies alone
    return lambda f: loss_of(model)({**tuned_weights, "freq": f}, xs[0], ys[0])


curvature = hessian(with_freq(tuned))(freq_0)
print("kept on the module:", leaks(tuned))
assert leaks(tuned) == {"table": " around ".join(["a dead autograd wrapper"] * 2)}
must_fail(RuntimeError, "level <= current_level INTERNAL ASSERT FAILED",
          lambda: grad(loss_of(tuned))(tuned_weights, xs[0], ys[0]))  # fmt: skip
freq_leaf = freq_0.clone().requires_grad_()
by_loop = (by_hand(*tuned.mix.parameters(), freq_leaf, xs[0]) - ys[0]).square().sum()
(slope,) = torch.autograd.grad(by_loop, freq_leaf, create_graph=True)
second = [torch.autograd.grad(s, freq_leaf, retain_graph=True)[0] for s in slope]
second = torch.stack(second)
agrees("the Hessian itself", curvature, second, 1e-14)
tuned(xs[0])  # no transform active: runs


# %%
# The fix for a table made from what a transform differentiates: build it in each call, keep
# nothing (in eager, a kept table misses an optimizer's in-place step and holds a freed graph).
# Built in eager (fix 1), it is a constant to ``grad``: a zero gradient (asserted below).
class Fresh(Rotary):  # builds its table in every call, keeps none
    def forward(self, tokens):
        try:
            return super().forward(tokens)
        finally:
            self.table = None


fresh = Fresh(learned=True)
agrees("Fresh, the Hessian", hessian(with_freq(fresh))(freq_0), second, 1e-14)
names = ["mix.weight", "mix.bias", "freq"]
truth_1 = loop_grads(tuned_weights, xs, ys, names)
assert leaks(fresh) == {}
for tokens in xs[:2]:  # eager training: each backward has its own graph, and runs
    fresh(tokens).sum().backward()
with torch.no_grad():
    fresh.freq.mul_(2)  # an optimizer's in-place step
    want = by_hand(*fresh.mix.parameters(), fresh.freq, xs[0])
    agrees("Fresh in eager, after a step", fresh(xs[0]), want, 1e-14)


# %%
# You tried to vmap over GridLookup, but it does not have vmap support
# --------------------------------------------------------------------
# A ``RuntimeError`` when an ensemble's forward calls a kernel from outside torch through an
# ``autograd.Function`` with ``setup_context`` but no ``vmap`` rule (kxhit/vMAP#26 asked about
# instant-NGP's CUDA kernels; tiny-cuda-nn's ``forward(ctx, ...)`` stops earlier, at part 2's
# setup_context error). NumPy stands in for the kernel: each member interpolates its own table.
# Part 2's fix, ``generate_vmap_rule=True``, hands the kernel batched tensors NumPy cannot read
# (asserted; pytorch#122706). Two fixes, checked against ``torch.lerp``: a loop over the members,
# and a ``vmap`` staticmethod that loops (:doc:`plot_extending_torch_func`; or ``custom_op`` with
# ``register_vmap``). Or, where torch ops can do the lookup, as ``torch.lerp``, no ``Function``.
def lookup_kernel(x, table):  # the "extension": linear interpolation, NumPy, on the CPU
    at = x.detach().cpu().numpy() * (len(table) - 1)
    cell = np.minimum(at.astype(np.int64), len(table) - 2)
    part, rows = (at - cell)[:, None], table.detach().cpu().numpy()
    mixed = (1 - part) * rows[cell] + part * rows[cell + 1]
    return torch.from_numpy(mixed).to(table.device)


class GridLookup(torch.autograd.Function):
    forward = staticmethod(lookup_kernel)
    setup_context = staticmethod(lambda ctx, inputs, _: ctx.save_for_backward(*inputs))

    @staticmethod
    def backward(ctx, g):  # the two rows around each x share g
        x, table = ctx.saved_tensors
        at = x * (len(table) - 1)
        cell = at.long().clamp(max=len(table) - 2)
        part = (at - cell)[:, None]
        shares = torch.zeros_like(table).index_add(0, cell, (1 - part) * g)
        return None, shares.index_add(0, cell + 1, part * g)


class LoopedLookup(GridLookup):  # fix 2: a vmap rule, one kernel call per member
    @staticmethod
    def vmap(info, in_dims, *args):
        split = [a.movedim(d, 0) if d is not None else [a] * info.batch_size
                 for a, d in zip(args, in_dims)]  # fmt: skip
        return torch.stack([GridLookup.apply(*pair) for pair in zip(*split)]), 0


class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 3, **F64))
        self.lookup = GridLookup.apply

    def forward(self, x):  # x: (n,), in [0, 1)
        return self.lookup(x, self.table).sum(-1)


fields = [Field() for _ in range(3)]
tables, _ = stack_module_state(fields)
field = copy.deepcopy(fields[0])  # the module functional_call runs for every member
at, values = torch.rand(10, **F64), torch.randn(10, **F64)
member_grads = vmap(grad(loss_of(field)), in_dims=(0, None, None))
per_member = partial(member_grads, tables, at, values)
must_fail(RuntimeError, "You tried to vmap over GridLookup", per_member)
field.lookup = type("Generated", (GridLookup,), {"generate_vmap_rule": True}).apply
must_fail(RuntimeError, "data pointer of Tensor", per_member)
cell = (at * 7).long().clamp(max=6)  # the reference: 8 rows, 7 cells, torch.lerp
lerped = [torch.lerp(f.table[cell], f.table[cell + 1], (at * 7 - cell)[:, None])
          for f in fields]  # fmt: skip
rows = [torch.autograd.grad((o.sum(-1) - values).square().sum(), f.table)[0]
        for o, f in zip(lerped, fields)]  # fmt: skip
by_lerp = {"table": torch.stack(rows)}
looped = [torch.autograd.grad((f(at) - values).square().sum(), f.table)[0]
          for f in fields]  # fmt: skip
agrees("fix 1, a loop", {"table": torch.stack(looped)}, by_lerp, 1e-14)
field.lookup = LoopedLookup.apply
agrees("fix 2, a looping vmap rule", per_member(), by_lerp, 1e-14)

# %%
# (No error) the next call runs on the first call's table: stale values, a zero gradient
# --------------------------------------------------------------------------------------
# Per-sample gradients, a step, per-sample gradients again, as a training loop does. The first
# call keeps a table that is one dead wrapper; the second uses it as a constant: the old
# frequencies, no path from the new ones, a zero gradient in them, wrong values. Plain autograd
# fails loudly on the same cache (a freed graph). ``Fresh`` gets both steps right; a table built
# in eager (fix 1) gives a zero gradient again. The figure: each sample's largest gap in its
# ``mix.weight`` gradient at the second call, over the loop's largest entry (exact at 1e-18).
tuned = Rotary(learned=True)
step_1 = per_sample(tuned)(tuned_weights, xs, ys)
agrees("first call", step_1, truth_1, 1e-14)
stepped = {k: v - 0.05 * step_1[k].mean(0) for k, v in tuned_weights.items()}
step_2 = per_sample(tuned)(stepped, xs, ys)
truth_2 = loop_grads(stepped, xs, ys, names)
for k in names:
    gap = ((step_2[k] - truth_2[k]).abs().max() / truth_2[k].abs().max()).item()
    print(f"  second call, {k}: error {gap:.2f} of its largest entry (wrong: > 0.01)")
    assert gap > 0.01, k
assert not step_2["freq"].any() and truth_2["freq"].abs().max() > 0.1
plain = Rotary(learned=True)
plain(xs[0]).sum().backward()
must_fail(RuntimeError, "backward through the graph a second time",
          lambda: plain(xs[1]).sum().backward())  # fmt: skip
agrees("Fresh, first call", per_sample(fresh)(tuned_weights, xs, ys), truth_1, 1e-14)
fresh_2 = per_sample(fresh)(stepped, xs, ys)
agrees("Fresh, second call", fresh_2, truth_2, 1e-14)
eager_table = Rotary(learned=True)
eager_table(xs[0])
assert not per_sample(eager_table)(stepped, xs, ys)["freq"].any()
fig, ax = plt.subplots(figsize=(6.5, 3.4), layout="constrained")
drawn = {"kept table": (step_2, "s--"), "Fresh": (fresh_2, "o-")}
for label, (second_call, look) in drawn.items():
    gaps = second_call["mix.weight"] - truth_2["mix.weight"]
    per_row = gaps.flatten(1).abs().amax(1) / truth_2["mix.weight"].abs().max()
    ax.plot(per_row.clamp_min(1e-18).cpu(), look, color="black", label=label)
ax.set(yscale="log", xlabel="sample", title=f"Second call, torch {torch.__version__}")
ax.legend()
plt.show()

# %%
# How to find the kept tensor: after a transform returns, run ``leaks`` (top of the page; private
# ``torch._C._functorch`` functions, 2.13) on each module and on ``globals()``, which it searches
# outside modules only. Here: the table on ``tuned``, a list filled in ``vmap``. Return such
# values instead (``has_aux=True``), as torch.func's "UX Limitations" page advises.
seen_inside = []
vmap(lambda x: seen_inside.append(x.mean()) or x.sin())(xs[0])
found = {**{f"tuned.{k}": v for k, v in leaks(tuned).items()}, **leaks(globals())}
print("found:", found)
assert found == {"tuned.table": "a dead autograd wrapper",
                 "seen_inside": "vmap's BatchedTensor (level 1)"}  # fmt: skip


# %%
# (Older releases) functorch and early torch.func messages: does the code run now?
# --------------------------------------------------------------------------------
# A message from functorch or a torch 2.0 nightly may name a bug since fixed, or one in the code:
# run the thread's code (small here) on your torch against a loop or a closed form. Four match now:
# ``prod``'s backward counts zeros with ``.item()``, which a batched input cannot give (PR #81969
# sends vmap's tensors down the zero-safe path), the slice, the masked write, ``torch.take``. Two
# are the code's own: ``torch.tensor`` copies values out of the transform, a zero Jacobian (use
# ``torch.stack``); ``vmap`` hands ``F.normalize`` one row, which has no ``dim=1`` (use ``dim=-1``).
def unit_rows(t):  # as in pytorch#99187: for a batch of rows; vmap gives it one row
    return F.normalize(t)


def clipped(a):  # as in pytorch#94630
    out = a.view(-1, 3, 3).clone()
    out[out < 1e-9] = 1e-9
    return out


boxes, quats = torch.rand(4, 3, **F64), torch.randn(4, 11, **F64)
boxes[1, 2] = 0.0  # a zero: prod's backward takes its other branch
others = [torch.cat([boxes[:, :k], boxes[:, k + 1 :]], 1).prod(1) for k in range(3)]
grid = torch.rand(3, 3, **F64) * (torch.rand(3, 3, device=device) > 0.4)
line, picks = torch.rand(10, **F64), torch.tensor([1, 1, 4, 7], device=device)
cells, rows_2d = torch.randn(3, 4, **F64), torch.randn(5, 2, **F64)
unit, size = F.normalize(rows_2d, dim=-1), rows_2d.norm(dim=-1)[:, None, None]
OLD = [  # thread, its message's first words, what 2.13 does, as written, the fix, the reference
    ("functorch#1066", "vmap: It looks like you're either (1) calling .item()", "runs",
     lambda: vmap(jacrev(lambda w: w.prod()))(boxes), None,
     torch.stack(others, 1)),  # d prod / d each entry, row by row
    ("functorch#1024", "vmap: It looks like you're calling .item() on a Tensor", "runs",
     lambda: vmap(jacrev(lambda q: q[0:3]))(quats), None,
     torch.eye(3, 11, **F64).expand(4, -1, -1)),
    ("pytorch#94630", "values.dim() >= num_leading_nones + max_index_dim INTERNAL", "runs",
     lambda: jacrev(clipped)(grid), None,
     torch.diag((grid >= 1e-9).flatten().double()).view(1, 3, 3, 3, 3)),
    ("pytorch#95738", "vmap: aten::put_(self, *extra_args) is not possible", "runs",
     lambda: jacrev(lambda v: torch.take(v, picks))(line), None, F.one_hot(picks, 10).double()),
    ("pytorch#95561", "unwrapped_count > 0 INTERNAL ASSERT FAILED", "wrong: your code",
     lambda: jacrev(lambda x: torch.tensor([x[2, 0], x[1, 1], x[0, 2]]))(cells),
     lambda: jacrev(lambda x: torch.stack([x[2, 0], x[1, 1], x[0, 2]]))(cells),
     F.one_hot(torch.tensor([8, 5, 2], device=device), 12).double().view(3, 3, 4)),
    ("pytorch#99187", "Dimension out of range (expected to be in range of [-1,", "your code",
     lambda: vmap(jacrev(unit_rows))(rows_2d),
     lambda: vmap(jacrev(lambda t: F.normalize(t, dim=-1)))(rows_2d),
     (torch.eye(2, **F64) - unit[:, :, None] * unit[:, None, :]) / size),
]  # fmt: skip
for thread, then, verdict, as_written, fix, want in OLD:
    print(f"{thread}, then: {then} ...; torch {torch.__version__}: {verdict}")
    if thread == "pytorch#99187":  # still raises, inside torch
        pasted = must_fail(IndexError, "Dimension out of range", as_written)
    else:
        with warnings.catch_warnings(record=True, action="always") as told:
            got = as_written()
        for note in {str(w.message).split(".")[0] for w in told}:
            print(f"  warned: {note}")
        if fix is None:
            agrees("as written", got, want, 1e-14)
        else:  # values copied out of the transform: no path back
            print(f"  as written: the Jacobian is zero everywhere: {not got.any()}")
            assert not got.any() and want.any()
    if fix is not None:
        agrees("the fix", fix(), want, 1e-14)

# %%
# Which line is yours? pytorch#99187's ``IndexError`` is raised in ``torch/functional.py``'s
# ``norm``, under ``vmap``'s and ``jacrev``'s frames. Frames outside torch's folder are yours here.
torch_dir = Path(torch.__file__).parent
frames = traceback.extract_tb(pasted.__traceback__)
yours = [f for f in frames if not Path(f.filename).is_relative_to(torch_dir)]
last, mine = frames[-1], yours[-1]
inside = Path(last.filename).relative_to(torch_dir.parent)
print(f"  raised in {inside}, {last.name}; yours: {mine.name}(), line: {mine.line}")
assert (last.name, mine.name) == ("norm", "unit_rows"), frames

# %%
# What to remember
# ----------------
# - An internal assert that names ``escaped?``, ``batched == nullptr`` or a functorch level can
#   come from your code: a tensor made in one transformed call and kept for the next. Look at
#   caches on ``self``, lists and hooks first (``leaks`` walks a module or ``globals()``).
# - A kept tensor can also raise nothing: the next call runs on the first call's values (under a
#   ``vmap`` of the same size, sample i on member i's). Check against a loop at a second step.
# - Build what is kept in eager, from tensors no transform maps or differentiates; a table made
#   from what is differentiated is built in each transformed call, not kept.
# - For a message from functorch or a 2.0 nightly, run the thread's code on your torch against a
#   loop; if it still fails, the last frame outside torch (and other libraries) is your line.
