"""
Model ensembling with ``stack_module_state`` and ``vmap``
=========================================================

An ensemble of N small models buys accuracy and uncertainty estimates at the price of running
N models. This page stacks the members' weights with ``stack_module_state`` and runs all of
them in one ``vmap``'d call, checks every member's output and three Adam training steps against
that member alone, shows what changes with gradient clipping, dropout and BatchNorm, and then
times the single call against a Python loop over the members for N = 1 to 32, counting the
operations each way to see why either can win.
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
# Each member is the same small classifier (64 features, two hidden layers of 128 units, 10
# classes), initialised from its own seed. The data is random: this page is about how the
# ensemble runs, not what it learns.
class SmallClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
            nn.Linear(128, 10),
        )  # fmt: skip

    def forward(self, features):
        return self.layers(features)


def make_members(count):
    members = []
    for seed in range(count):
        torch.manual_seed(seed)
        members.append(SmallClassifier().to(device))
    return members


batch_size = 64
members = make_members(8)

# %%
# The recipe: stack the weights, ``vmap`` a functional call
# ---------------------------------------------------------
# :func:`~torch.func.stack_module_state` returns two dictionaries (parameters and buffers) whose
# tensors have the members along a new first dimension. A copy of one member on the ``"meta"``
# device is the template that :func:`~torch.func.functional_call` runs: it has the architecture
# and no memory, since its own weights are never used. :func:`~torch.func.vmap` maps over the
# member dimension. The mental model: the result equals stacking ``member(x)`` over the members.
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
# The minibatch is shared, so it is not mapped: ``in_dims=(0, 0, None)``. Each slice of the
# result must equal that member run alone. The stacked call uses a batched matrix product where
# the member uses its own, so the bound allows float32 rounding (3e-6, about 25 times float32's
# machine epsilon); the printed error can also come out exactly zero.
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
# The stacked parameters are ordinary leaf tensors, so an ordinary optimiser trains them. The
# loss is the *sum* of the members' losses: each member's loss depends only on its own slice, so
# the gradient of the sum, slice by slice, is each member's own gradient (a mean would divide it
# by N). Adam keeps its moments element by element, so one Adam over the stacked tensors keeps
# one state per member. The reference is each member trained alone, with its own Adam.
targets = torch.randint(0, 10, (len(members), batch_size), device=device)
trained = {
    name: p.detach().clone().requires_grad_() for name, p in stacked_params.items()
}
stacked_optimizer = torch.optim.Adam(trained.values(), lr=1e-2)
copies = [copy.deepcopy(m) for m in members]
optimizers = [torch.optim.Adam(c.parameters(), lr=1e-2) for c in copies]
grad_errors = []
for _ in range(3):
    stacked_optimizer.zero_grad()
    losses = vmap(F.cross_entropy)(
        separate(trained, stacked_buffers, own_batches), targets
    )
    losses.sum().backward()
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
# After three steps, each member's slice of the stacked weights must sit where that member's own
# Adam put it, parameter by parameter. The weights moved, so the check is not comparing the
# starting point with itself. Adam divides each entry by its own running size, so rounding
# differences between the two gradients pass into the weights almost whole: the bound is 3e-5.
weight_errors = []
for index, member in enumerate(copies):
    for name, p in member.named_parameters():
        error = relative_error(trained[name][index], p)
        assert error < 3e-5, f"member {index} {name}: relative error {error:.1e}"
        moved = ((p - stacked_params[name][index]).norm() / p.norm()).item()
        assert moved > 1e-3, f"member {index} {name} did not move"
        weight_errors.append(error)
print(f"3 stacked Adam steps = 3 separate ones, {len(copies)} members:", end=" ")
print(f"worst relative error {max(weight_errors):.1e}")

# %%
# Gradient clipping: per member, not over the stack
# -------------------------------------------------
# One optimiser over the stacked tensors equals N optimisers only while every step treats the
# members' slices apart. ``torch.nn.utils.clip_grad_norm_`` over the stacked tensors does not:
# it computes one norm over all members together and scales every member by it. Per member,
# take each member's norm over its own slices (all dimensions but the first) and scale its
# slices. The reference gives each member's slices of the same gradients to ``clip_grad_norm_``,
# one member at a time (the gradients themselves were checked above); the limit is the median
# of the members' own gradient norms, so that some members are clipped and some not.
stacked_grads = {name: p.grad for name, p in trained.items()}
member_norms = torch.stack(
    [g.flatten(start_dim=1).norm(dim=1) for g in stacked_grads.values()]
).norm(dim=0)  # (N,): each member's gradient norm over all its parameters
own_norms = [
    torch.cat([p.grad.flatten() for p in m.parameters()]).norm() for m in copies
]
max_norm = torch.stack(own_norms).median().item()
scale = (max_norm / (member_norms + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s formula
clipped = {
    name: g * scale.view(-1, *[1] * (g.dim() - 1)) for name, g in stacked_grads.items()
}
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
print(f"member norms {member_norms.min():.3f} to {member_norms.max():.3f}, "
      f"limit {max_norm:.3f}")  # fmt: skip
print(f"per-member clipping: worst error {max(clip_errors):.1e}; clip_grad_norm_ over the "
      f"stack: worst error {max(stack_errors):.1e}")  # fmt: skip
assert max(clip_errors) < 1e-6, f"per-member clipping: error {max(clip_errors):.1e}"
assert max(stack_errors) > 1e-2, "clipping over the stack matched per-member clipping"


# %%
# Dropout and BatchNorm
# ---------------------
# Dropout under ``vmap`` raises unless ``randomness=`` says whether the members share one mask
# or draw their own; separate members draw their own, which is ``randomness="different"``
# (:ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py` checks what each setting does).
# BatchNorm in training mode works on stacked buffers: each member updates the running
# statistics in its own slice. We check them against each member run alone (BatchNorm comes
# before dropout, so its statistics do not depend on the masks). The failing call runs on
# copies of the buffers, and we check that it had updated them before dropout raised.
def make_normed_member(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(128, 10),
    ).to(device)  # fmt: skip


normed = [make_normed_member(seed) for seed in range(len(members))]
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
print(
    f"BatchNorm running statistics, member by member: worst error {max(stat_errors):.1e}"
)
assert max(stat_errors) < 1e-6, f"running statistics: error {max(stat_errors):.1e}"

# %%
# How fast is it?
# ---------------
# For N = 1 to 32 members, we time the loop and the stacked call in both cases, without autograd
# (inference only). :class:`torch.utils.benchmark.Timer` repeats each call in blocks, at least
# five, and reports the median and the interquartile range (IQR) over them.
member_counts = [1, 2, 4, 8, 16, 32]
speedups = {"same minibatch": [], "own minibatches": []}
apart = {case: [] for case in speedups}  # vmap faster, the quartiles apart
times_ms = {"loop": [], "vmap": []}  # same minibatch, for the second panel


def median_and_iqr_ms(fn):
    n_threads = torch.get_num_threads()
    call_timer = benchmark.Timer("call()", globals={"call": fn}, num_threads=n_threads)
    measurement = call_timer.blocked_autorange(min_run_time=0.15)
    # A slow machine fills fewer blocks: add blocks of one call, up to five.
    while len(measurement.times) < 5:
        more = call_timer.timeit(1)
        measurement = benchmark.Measurement.merge([measurement, more])[0]
    iqr_ms = measurement.iqr * 1e3  # two significant digits for a small spread
    iqr_text = f"{iqr_ms:.2f}" if iqr_ms >= 0.1 else f"{iqr_ms:.2g}"
    quartiles = torch.tensor(measurement.times).quantile(torch.tensor([0.25, 0.75]))
    return (
        measurement.median * 1e3,
        iqr_text,
        len(measurement.times),
        quartiles.tolist(),
    )


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
        ms, quartiles = {}, {}
        for name, fn in calls.items():
            ms[name], iqr, blocks, quartiles[name] = median_and_iqr_ms(fn)
            print(f"N={count:2d} {name:10s} {ms[name]:7.3f} ms "
                  f"(IQR {iqr} ms, {blocks} blocks)")  # fmt: skip
        speedups["same minibatch"].append(ms["loop, same"] / ms["vmap, same"])
        speedups["own minibatches"].append(ms["loop, own"] / ms["vmap, own"])
        for case, key in [("same minibatch", "same"), ("own minibatches", "own")]:
            # vmap's slowest quarter of blocks faster than the loop's fastest quarter
            apart[case].append(
                quartiles[f"vmap, {key}"][1] < quartiles[f"loop, {key}"][0]
            )
        times_ms["loop"].append(ms["loop, same"])
        times_ms["vmap"].append(ms["vmap, same"])
print("the loop's time divided by vmap's (above 1: vmap was faster):")
for case, values in speedups.items():
    print(
        f"  {case:16s}"
        + "".join(f"  N={n}: {s:.3g}x" for n, s in zip(member_counts, values))
    )
    # the smallest N from which vmap was clearly faster at every larger N, on this run
    ahead = [n for i, n in enumerate(member_counts) if all(apart[case][i:])]
    print(
        f"    on this run vmap was faster, the quartiles apart, from N={ahead[0]} up"
        if ahead
        else f"    on this run vmap was not clearly faster at N={member_counts[-1]}"
    )


# %%
# Where a loop can win: small N
# ------------------------------
# Both ways do the same matrix products: ``torch.utils.flop_counter.FlopCounterMode`` counts
# their FLOPs (it has no formula for elementwise operations such as the bias additions and the
# ReLUs). What differs is how many operations PyTorch dispatches, which a small dispatch mode
# counts. Each operation has a fixed price (Python, the dispatcher, on a GPU a kernel launch) on
# top of its arithmetic. Both tools are first checked on one member, whose answer is known:
# three linear layers are three ``t`` (a transposing view) and three ``addmm``, plus two
# ``relu``, and ``2 · batch · (64·128 + 128·128 + 128·10)`` FLOPs.
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
    print(
        f"N={count:2d}: loop {loop_ops.total():4d} ops, vmap {vmap_ops.total():4d} ops;",
        end=" ",
    )
    print(f"matrix-product FLOPs {loop_flops / 1e6:.1f} M each way")
    assert loop_flops == vmap_flops, (loop_flops, vmap_flops)
    vmap_ops_by_count[count] = vmap_ops
assert vmap_ops_by_count[1] == vmap_ops_by_count[member_counts[-1]]
print("loop's ops at N=32:", dict(loop_ops.most_common()))
print("vmap's ops, the same at N=1 and N=32:", dict(vmap_ops.most_common()))

# %%
# The loop dispatches the same few operations per member (a transposing view and one fused
# matrix product with bias per linear layer), so its count grows with N. The stacked call
# dispatches a fixed number, but more than one member needs: each linear layer becomes views
# (which compute nothing), a batched matrix product, a multiplication of the bias by
# ``addmm``'s scale β = 1, and a separate bias addition. So at N=1 the stacked call pays for
# more operations doing the same matrix products, plus probably some Python work of
# ``functional_call`` and ``vmap``, so the loop can be faster there (the timings above say
# whether it was, on this run). As N grows, the loop pays N fixed prices where the stacked call
# pays one. Where the break-even falls depends on how long each operation's arithmetic takes
# against its fixed price; the left panel shows both times, the right one their ratio.
fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
for method in ["loop", "vmap"]:
    ax_time.plot(member_counts, times_ms[method], marker="o", color=METHOD_COLORS[method],
                 label=method)  # fmt: skip
ax_time.set_ylabel("median time per call (ms)")
ax_time.set_title("Same minibatch")
ax_time.legend()
for case, style in [("same minibatch", "-"), ("own minibatches", "--")]:
    ax_speed.plot(member_counts, speedups[case], marker="o", linestyle=style,
                  color=METHOD_COLORS["vmap"], label=case)  # fmt: skip
ax_speed.axhline(1, color="black", linestyle=":", linewidth=1)
ax_speed.set_ylabel("loop time / vmap time")
ax_speed.set_title("Loop time / vmap time (above 1: vmap is faster)")
ax_speed.legend()
for ax in (ax_time, ax_speed):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(member_counts, [str(n) for n in member_counts])
    ax.set_xlabel("members in the ensemble (N)")
plt.show()

# %%
# What to remember
# ----------------
# - Ensemble recipe: ``stack_module_state(members)``, a ``"meta"`` copy as the template, and
#   ``vmap(functional_call(...), in_dims=(0, 0, None))`` for a shared minibatch or ``(0, 0, 0)``
#   for one minibatch per member.
# - Train the stacked weights with one optimiser on the *sum* of the members' losses: Adam's
#   element-wise state is then one state per member. Clip each member's gradient norm from its
#   own slices: ``clip_grad_norm_`` over the stack couples the members.
# - Dropout needs ``randomness="different"`` under ``vmap``; BatchNorm's running statistics
#   update per member in the stacked buffers.
# - Both ways do the same matrix products. The loop dispatches its operations once per member,
#   the stacked call a fixed, larger set once: it needs enough members to pay off, so read the
#   break-even for your hardware off a timing over N, and check each member on its own against
#   the member run alone.
