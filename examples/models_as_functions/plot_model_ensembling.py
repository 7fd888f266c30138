"""
Model ensembling with ``stack_module_state`` and ``vmap``
=========================================================

An ensemble of N small models buys accuracy and uncertainty estimates at the cost of running N.
Here the members' weights, stacked by ``stack_module_state``, run in one ``vmap``'d call checked
against each member alone (outputs, Adam steps, clipping, dropout, BatchNorm, the ensemble as a
submodule of a larger model); then the stacked call is timed against a loop for N = 1 to 32.
"""

# %%
# Setup
# -----
import copy
from collections import Counter

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73"}


# %%
# The members
# -----------
# Each member is the same small classifier (64 features, two hidden layers of 128, 10 classes)
# from its own seed, on random data: this page is about how the ensemble runs, not what it learns.
def make_members(count):
    members = []
    for seed in range(count):
        torch.manual_seed(seed)
        members.append(nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
            nn.Linear(128, 10),
        ).to(device))  # fmt: skip
    return members


batch_size = 64
members = make_members(8)

# %%
# The recipe: stack the weights, ``vmap`` a functional call
# ---------------------------------------------------------
# :func:`~torch.func.stack_module_state` returns two dictionaries (parameters, buffers) whose
# tensors have the members along a new first dimension. :func:`~torch.func.functional_call` runs
# a copy of one member on the ``"meta"`` device, the template: the architecture without memory
# (its weights are never used). :func:`~torch.func.vmap` maps over the members: the result equals
# ``member(x)`` stacked over the members.
stacked_params, stacked_buffers = stack_module_state(members)
template = copy.deepcopy(members[0]).to("meta")
print({name: tuple(p.shape) for name, p in stacked_params.items()})


def run_member(params, buffers, x):
    return functional_call(template, (params, buffers), (x,))


def relative_error(result, reference):
    return ((result - reference).norm() / reference.norm()).item()


def worst_member_error(outputs, references):
    """Largest relative error ‖out − ref‖ / ‖ref‖ over the members, each compared alone."""
    return max(relative_error(out, ref) for out, ref in zip(outputs, references))


# %%
# Case 1: every member sees the same minibatch
# --------------------------------------------
# The minibatch is shared, so it is not mapped: ``in_dims=(0, 0, None)``. Each slice must equal
# its member run alone, up to float32 rounding (a batched matrix product against the member's
# own): bound 3e-6, about 25 times float32's machine epsilon; the error can also be exactly zero.
same_batch = torch.randn(batch_size, 64, device=device)
shared = vmap(run_member, in_dims=(0, 0, None))
same_out = shared(stacked_params, stacked_buffers, same_batch)
error = worst_member_error(same_out, [member(same_batch) for member in members])
print(f"same minibatch {tuple(same_out.shape)}: worst member's error {error:.1e}")
assert error < 3e-6, f"same minibatch: worst member error {error:.1e}"

# %%
# Case 2: each member sees its own minibatch
# ------------------------------------------
# With a minibatch per member (bagging, or a data shard per member), the data has a member
# dimension too, and everything is mapped: ``in_dims=(0, 0, 0)``.
own_batches = torch.randn(len(members), batch_size, 64, device=device)
separate = vmap(run_member, in_dims=(0, 0, 0))
own_out = separate(stacked_params, stacked_buffers, own_batches)
error = worst_member_error(own_out, [m(x) for m, x in zip(members, own_batches)])
print(f"own minibatches {tuple(own_out.shape)}: worst member's error {error:.1e}")
assert error < 3e-6, f"own minibatches: worst member error {error:.1e}"

# %%
# Training the stacked ensemble
# -----------------------------
# The stacked parameters are leaf tensors, so an ordinary optimiser trains them, on the *sum* of
# the members' losses: each loss depends only on its member's slice, so the sum's gradient, slice
# by slice, is each member's own (a mean would divide it by N). Adam's state is per element, so
# one Adam over the stack keeps one state per member. Reference: each member with its own Adam.
targets = torch.randint(0, 10, (len(members), batch_size), device=device)
trained = {n: p.detach().clone().requires_grad_() for n, p in stacked_params.items()}
stacked_optimizer = torch.optim.Adam(trained.values(), lr=1e-2)
copies = [copy.deepcopy(m) for m in members]
optimizers = [torch.optim.Adam(c.parameters(), lr=1e-2) for c in copies]
grad_errors = []
for _ in range(3):
    stacked_optimizer.zero_grad()
    outputs = separate(trained, stacked_buffers, own_batches)
    vmap(F.cross_entropy)(outputs, targets).sum().backward()
    stacked_optimizer.step()
    for index, (member, optimizer) in enumerate(zip(copies, optimizers)):
        optimizer.zero_grad()
        F.cross_entropy(member(own_batches[index]), targets[index]).backward()
        optimizer.step()
        for name, p in member.named_parameters():  # Adam reads .grad, never changes it
            grad_errors.append(relative_error(trained[name].grad[index], p.grad))
print(f"gradients of each member and parameter: worst error {max(grad_errors):.1e}")
assert max(grad_errors) < 3e-5, f"gradients: worst error {max(grad_errors):.1e}"

# %%
# After three steps, each member's slice must sit where its own Adam put it, away from the start.
# Adam divides each entry by its running size, so gradient rounding reaches the weights: 3e-5.
weight_errors, moved = [], []
for index, member in enumerate(copies):
    for name, p in member.named_parameters():
        weight_errors.append(relative_error(trained[name][index], p))
        moved.append(relative_error(stacked_params[name][index], p))  # from the start
print(f"3 stacked Adam steps = 3 separate ones: worst error {max(weight_errors):.1e}")
assert max(weight_errors) < 3e-5, f"weights: worst error {max(weight_errors):.1e}"
assert min(moved) > 1e-3, f"a weight did not move: {min(moved):.1e}"

# %%
# Gradient clipping: per member, not over the stack
# -------------------------------------------------
# One optimiser over the stack equals N optimisers only while each step treats the members apart;
# ``torch.nn.utils.clip_grad_norm_`` over the stack scales every member by one norm over them all.
# Per member, each member's norm over its own slices (all dimensions but the first) scales them.
# Reference: ``clip_grad_norm_`` on each member's slices; the limit (the median norm) clips some.
stacked_grads = {name: p.grad for name, p in trained.items()}
per_tensor = torch.stack([g.flatten(1).norm(dim=1) for g in stacked_grads.values()])
member_norms = per_tensor.norm(dim=0)  # (N,): each member's gradient norm
own_grads = [torch.cat([p.grad.flatten() for p in c.parameters()]) for c in copies]
max_norm = torch.stack([g.norm() for g in own_grads]).median().item()
scale = (max_norm / (member_norms + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s formula
clipped = {n: g * scale.view(-1, *[1] * (g.ndim - 1)) for n, g in stacked_grads.items()}
over_the_stack = [torch.zeros_like(p, requires_grad=True) for p in trained.values()]
for holder, g in zip(over_the_stack, stacked_grads.values()):
    holder.grad = g.clone()
torch.nn.utils.clip_grad_norm_(over_the_stack, max_norm)
clip_errors, stack_errors = [], []
for index in range(len(copies)):
    own = [torch.zeros_like(p[index], requires_grad=True) for p in trained.values()]
    for holder, g in zip(own, stacked_grads.values()):
        holder.grad = g[index].clone()
    torch.nn.utils.clip_grad_norm_(own, max_norm)
    for holder, name, held in zip(own, trained, over_the_stack):
        clip_errors.append(relative_error(clipped[name][index], holder.grad))
        stack_errors.append(relative_error(held.grad[index], holder.grad))
print(f"member norms {member_norms.min():.3f} to {member_norms.max():.3f}, limit "
      f"{max_norm:.3f}\nper-member clipping: worst error {max(clip_errors):.1e}; "
      f"clip_grad_norm_ over the stack: worst error {max(stack_errors):.1e}")  # fmt: skip
assert max(clip_errors) < 1e-6, f"per-member clipping: error {max(clip_errors):.1e}"
assert max(stack_errors) > 1e-2, "clipping over the stack matched per-member clipping"

# %%
# Dropout and BatchNorm
# ---------------------
# Dropout under ``vmap`` raises unless ``randomness=`` says whether the members share one mask;
# separate members draw their own: ``randomness="different"``
# (:ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py` checks each setting). In training mode,
# BatchNorm updates each member's running statistics in its slice of the stacked buffers, checked
# against each member run alone (BatchNorm comes before dropout, so the masks do not matter). The
# failing call runs on copies of the buffers; we check it had updated them before it raised.
torch.manual_seed(0)
normed = [nn.Sequential(
    nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10),
).to(device) for _ in members]  # fmt: skip
normed_params, normed_buffers = stack_module_state(normed)
normed_template = copy.deepcopy(normed[0]).to("meta")


def run_normed(params, buffers, x):
    return functional_call(normed_template, (params, buffers), (x,))


spare_buffers = {name: b.clone() for name, b in normed_buffers.items()}
try:
    vmap(run_normed)(normed_params, spare_buffers, own_batches)
    raise AssertionError("dropout ran under vmap without randomness=")
except RuntimeError as error:
    assert "random operation while in randomness error mode" in str(error), error
    print(f"RuntimeError: {str(error).split('.')[0]}")
changed = [n for n, b in spare_buffers.items() if not torch.equal(b, normed_buffers[n])]
assert changed, "the failing call left the buffers as they were"
vmap(run_normed, randomness="different")(normed_params, normed_buffers, own_batches)
stat_errors = []
for index, (member, x) in enumerate(zip(normed, own_batches)):
    member(x)  # training mode: updates its own running statistics
    for name, alone in member.named_buffers():
        if alone.is_floating_point():
            stat_errors.append(relative_error(normed_buffers[name][index], alone))
        else:  # num_batches_tracked
            assert normed_buffers[name][index] == alone == 1, (name, alone)
print(f"BatchNorm running statistics, per member: worst error {max(stat_errors):.1e}")
assert max(stat_errors) < 1e-6, f"running statistics: error {max(stat_errors):.1e}"


# %%
# The ensemble as a submodule of a bigger model
# ---------------------------------------------
# In a larger model (N heads on a shared encoder, say), the parent must own the stacked tensors
# for ``parameters()`` and ``state_dict()`` to list them: ``StackedEnsemble`` registers them
# (``.`` in names made ``__``) and maps the names back. Its meta template stays out of the module
# tree (no entries); ``.train()``/``.eval()`` miss it there, so ``forward`` passes it the mode.
class StackedEnsemble(nn.Module):
    def __init__(self, members):
        super().__init__()
        params, buffers = stack_module_state(members)
        self.names = {name.replace(".", "__"): name for name in [*params, *buffers]}
        for name, p in params.items():
            self.register_parameter(name.replace(".", "__"), nn.Parameter(p))
        for name, b in buffers.items():
            self.register_buffer(name.replace(".", "__"), b)
        # object.__setattr__ skips nn.Module's registration: the template is no submodule
        object.__setattr__(self, "template", copy.deepcopy(members[0]).to("meta"))

    def forward(self, x):
        self.template.train(self.training)
        tensors = [*self.named_parameters(), *self.named_buffers()]
        state = {self.names[name]: t for name, t in tensors}
        return vmap(functional_call, in_dims=(None, 0, None))(self.template, state, x)


class EncoderWithEnsembleHead(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32, device=device), nn.ReLU())
        self.head = StackedEnsemble(heads)

    def forward(self, x):
        return self.head(self.encoder(x)).mean(dim=0)  # the members' average


def make_heads(seed):  # one seed, N members; no bias before BatchNorm (it cancels it)
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 10)).to(device) for _ in members]  # fmt: skip


# %%
# Each member's output must equal the member run alone, in training mode (updating the running
# statistics) and in eval mode (using them); ``named_parameters()``, ``parameters()`` and
# ``state_dict()`` must hold the encoder's tensors and each member's stacked, nothing else.
heads = make_heads(0)
model = EncoderWithEnsembleHead(heads)
features = model.encoder(same_batch).detach()
member_errors = []
for training in [True, False]:
    alone = [head.train(training)(features) for head in heads]
    stacked_out = model.train(training).head(features)
    member_errors.append(worst_member_error(stacked_out, alone))
print(f"outputs, member by member: worst error {max(member_errors):.1e} (bound 3e-6)")
assert max(member_errors) < 3e-6, f"members: worst error {max(member_errors):.1e}"


def in_parent(pairs):  # a member's names and shapes, as the parent holds them
    return {f"head.{n.replace('.', '__')}": (len(heads), *t.shape) for n, t in pairs}


enc = {f"encoder.{n}": tuple(p.shape) for n, p in model.encoder.named_parameters()}
named = {n: tuple(p.shape) for n, p in model.named_parameters()}
assert named == enc | in_parent(heads[0].named_parameters()), named
assert len(list(model.parameters())) == len(named)
state = {n: tuple(t.shape) for n, t in model.state_dict().items()}
assert state == enc | in_parent(heads[0].state_dict().items()), state
print(f"{len(named)} parameters, {len(state)} state_dict entries:", list(state))

# %%
# A training step of the whole model must give the encoder, and each member's slice, the
# gradient of a loop over copies of the encoder and the members. After an SGD step, a
# ``state_dict`` loaded into a fresh model (other seeds) must give the same outputs, bit for bit.
loop = nn.ModuleList([copy.deepcopy(model.encoder), *copy.deepcopy(heads)]).train()
F.cross_entropy(model.train()(same_batch), targets[0]).backward()
loop_out = torch.stack([head(loop[0](same_batch)) for head in loop[1:]]).mean(dim=0)
F.cross_entropy(loop_out, targets[0]).backward()
assert all(p.grad is not None for p in model.parameters()), "a tensor got no gradient"
grad_errors = [relative_error(p.grad, q.grad)
               for p, q in zip(model.encoder.parameters(), loop[0].parameters())]  # fmt: skip
for n, p in model.head.named_parameters():
    alone = [h.get_parameter(model.head.names[n]).grad for h in loop[1:]]
    grad_errors.append(worst_member_error(p.grad, alone))
print(f"one step's gradients: worst error {max(grad_errors):.1e} (bound 1e-5)")
assert max(grad_errors) < 1e-5, f"gradients: worst error {max(grad_errors):.1e}"
torch.optim.SGD(model.parameters(), lr=0.1).step()
fresh = EncoderWithEnsembleHead(make_heads(1)).eval()
before = fresh(same_batch)
fresh.load_state_dict(model.state_dict())
original = model.eval()(same_batch)
assert not torch.equal(before, original), "the fresh model matched before loading"
assert torch.equal(fresh(same_batch), original), "the loaded model gives other outputs"
print("state_dict round trip into a fresh model: outputs equal, bit for bit")

# %%
# How fast is it?
# ---------------
# For N = 1 to 32, both ways in both cases, without autograd: :class:`~torch.utils.benchmark.Timer`
# runs each call in blocks (at least five) and gives the median and interquartile range (IQR).
member_counts = [1, 2, 4, 8, 16, 32]
speedups = {"same minibatch": [], "own minibatches": []}
apart = {case: [] for case in speedups}  # vmap faster, the quartiles apart
times_ms = {"loop": [], "vmap": []}  # same minibatch, for the second panel


def median_and_iqr_ms(fn):
    n_threads = torch.get_num_threads()
    call_timer = benchmark.Timer("call()", globals={"call": fn}, num_threads=n_threads)
    runs = call_timer.blocked_autorange(min_run_time=0.15)
    while len(runs.times) < 5:  # a slow machine fills fewer: add blocks of one call
        runs = benchmark.Measurement.merge([runs, call_timer.timeit(1)])[0]
    iqr_ms = runs.iqr * 1e3  # two significant digits for a small spread
    iqr_text = f"{iqr_ms:.2f}" if iqr_ms >= 0.1 else f"{iqr_ms:.2g}"
    quartiles = torch.tensor(runs.times).quantile(torch.tensor([0.25, 0.75])).tolist()
    return runs.median * 1e3, iqr_text, len(runs.times), quartiles


with torch.set_grad_enabled(False):
    for count in member_counts:
        group = make_members(count)
        params, buffers = stack_module_state(group)
        batches = torch.randn(count, batch_size, 64, device=device)
        calls = {
            "loop, same": lambda g=group: [m(same_batch) for m in g],
            "vmap, same": lambda p=params, b=buffers: shared(p, b, same_batch),
            "loop, own": lambda g=group, d=batches: [m(x) for m, x in zip(g, d)],
            "vmap, own": lambda p=params, b=buffers, d=batches: separate(p, b, d),
        }
        ms, q = {}, {}  # medians and quartiles
        for name, fn in calls.items():
            ms[name], iqr, blocks, q[name] = median_and_iqr_ms(fn)
            print(f"N={count:2d} {name:10s} {ms[name]:7.3f} ms "
                  f"(IQR {iqr} ms, {blocks} blocks)")  # fmt: skip
        for case, key in [("same minibatch", "same"), ("own minibatches", "own")]:
            speedups[case].append(ms[f"loop, {key}"] / ms[f"vmap, {key}"])
            # vmap's slowest quarter of blocks faster than the loop's fastest quarter
            apart[case].append(q[f"vmap, {key}"][1] < q[f"loop, {key}"][0])
        times_ms["loop"].append(ms["loop, same"])
        times_ms["vmap"].append(ms["vmap, same"])
print("the loop's time divided by vmap's (above 1: vmap was faster):")
for case, values in speedups.items():
    ratios = "".join(f"  N={n}: {s:.3g}x" for n, s in zip(member_counts, values))
    # the smallest N from which vmap was clearly faster at every larger N, on this run
    ahead = [n for i, n in enumerate(member_counts) if all(apart[case][i:])]
    verdict = (f"was faster, the quartiles apart, from N={ahead[0]} up" if ahead
               else f"was not clearly faster at N={member_counts[-1]}")  # fmt: skip
    print(f"  {case:16s}{ratios}\n    on this run vmap {verdict}")


# %%
# Where a loop can win: small N
# ------------------------------
# Both ways do the same matrix products: ``torch.utils.flop_counter.FlopCounterMode`` counts
# their FLOPs (it has no formula for elementwise operations such as bias additions and ReLUs).
# What differs is how many operations PyTorch dispatches, each with a fixed price (Python, the
# dispatcher, on a GPU a kernel launch) on top of its arithmetic; a dispatch mode counts them.
# Both tools are first checked on one member: three ``t`` (a transposing view), three ``addmm``,
# two ``relu``, and ``2 · batch · (64·128 + 128·128 + 128·10)`` FLOPs.
class CountOps(TorchDispatchMode):
    """Counts the operations that reach PyTorch's kernels, by name."""

    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_and_flops(fn):
    with torch.no_grad(), CountOps() as ops, FlopCounterMode(display=False) as flops:
        fn()
    return ops.names, flops.get_total_flops()


one_member_ops, one_member_flops = ops_and_flops(lambda: members[0](same_batch))
assert one_member_ops == Counter(t=3, addmm=3, relu=2), one_member_ops
assert one_member_flops == 2 * batch_size * (64 * 128 + 128 * 128 + 128 * 10)
vmap_ops_by_count = {}
for count in [1, member_counts[-1]]:
    group = make_members(count)
    params, buffers = stack_module_state(group)
    loop_ops, loop_flops = ops_and_flops(lambda g=group: [m(same_batch) for m in g])
    vmap_ops, vmap_flops = ops_and_flops(
        lambda p=params, b=buffers: shared(p, b, same_batch)
    )
    print(f"N={count:2d}: loop {loop_ops.total():4d} ops, vmap {vmap_ops.total():4d} ops; "
          f"matrix-product FLOPs {loop_flops / 1e6:.1f} M each way")  # fmt: skip
    assert loop_flops == vmap_flops, (loop_flops, vmap_flops)
    vmap_ops_by_count[count] = vmap_ops
assert vmap_ops_by_count[1] == vmap_ops_by_count[member_counts[-1]]
print("loop's ops at N=32:", dict(loop_ops.most_common()))
print("vmap's ops, the same at N=1 and N=32:", dict(vmap_ops.most_common()))

# %%
# The loop dispatches a few operations per member (per linear layer, a transposing view and one
# fused matrix product with bias), so its count grows with N. The stacked call dispatches a fixed
# set, larger than one member's: per linear layer, views (which compute nothing), a batched
# matrix product, a multiplication of the bias by ``addmm``'s β = 1 and a separate bias addition.
# At N=1 it pays for more operations doing the same products, plus probably Python work in
# ``functional_call`` and ``vmap``, so the loop can be faster there (the timings say whether it
# was, on this run); as N grows, the loop pays N fixed prices, the stacked call one. The
# break-even depends on each operation's arithmetic against its price. Left: times; right: ratio.
fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
for method in ["loop", "vmap"]:
    ax_time.plot(member_counts, times_ms[method], marker="o", color=METHOD_COLORS[method],
                 label=method)  # fmt: skip
ax_time.set(ylabel="median time per call (ms)", title="Same minibatch")
for case, style in [("same minibatch", "-"), ("own minibatches", "--")]:
    ax_speed.plot(member_counts, speedups[case], marker="o", linestyle=style,
                  color=METHOD_COLORS["vmap"], label=case)  # fmt: skip
ax_speed.axhline(1, color="black", linestyle=":", linewidth=1)
ax_speed.set(ylabel="loop time / vmap time",
             title="Loop time / vmap time (above 1: vmap is faster)")  # fmt: skip
for ax in (ax_time, ax_speed):
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="members in the ensemble (N)")
    ax.set_xticks(member_counts, [str(n) for n in member_counts])
    ax.legend()
plt.show()

# %%
# What to remember
# ----------------
# - Recipe: ``stack_module_state(members)``, a ``"meta"`` copy as the template, and ``vmap`` over
#   ``functional_call`` with ``in_dims=(0, 0, None)`` (shared minibatch) or ``(0, 0, 0)``.
# - Train with one optimiser on the *sum* of the members' losses; clip each member's gradient
#   from its own slices. Dropout needs ``randomness="different"``; BatchNorm updates per member.
# - Inside a larger model, register the stacked tensors (``.`` made ``__``), keep the template
#   out of the module tree and pass it the train/eval mode.
# - The loop dispatches its operations once per member, the stacked call a larger set once: read
#   the break-even off a timing over N on your hardware, and check each member against it alone.
