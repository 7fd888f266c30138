"""
Model ensembling with ``stack_module_state`` and ``vmap``
=========================================================

An ensemble of N small models buys accuracy and uncertainty estimates at the price of running
N models. This page stacks the members' weights with ``stack_module_state`` and runs all of
them in one ``vmap``'d call, checks every member's output and three Adam training steps against
that member alone, and then measures from which N the single call beats a Python loop over the
members, counting the operations each way to see why.
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


def worst_member_error(outputs, references):
    """Largest relative error ‖out − ref‖ / ‖ref‖ over the members, each compared alone."""
    return max(
        ((out - ref).norm() / ref.norm()).item()
        for out, ref in zip(outputs, references)
    )


# %%
# Case 1: every member sees the same minibatch
# --------------------------------------------
# The minibatch is shared, so it is not mapped: ``in_dims=(0, 0, None)``. Each slice of the
# result must equal that member run alone. The stacked call uses a batched matrix product where
# the member uses its own, so the bound allows float32 rounding (1e-6, about 8 times float32's
# machine epsilon); the printed error can also come out exactly zero.
same_batch = torch.randn(batch_size, 64, device=device)
shared = vmap(run_member, in_dims=(0, 0, None))
same_out = shared(stacked_params, stacked_buffers, same_batch)
error = worst_member_error(same_out, [member(same_batch) for member in members])
print(f"same minibatch {tuple(same_out.shape)}: worst member's error {error:.1e}")
assert error < 1e-6, f"same minibatch: worst member error {error:.1e}"

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
assert error < 1e-6, f"own minibatches: worst member error {error:.1e}"

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
        for name, p in member.named_parameters():  # before Adam rescales them
            grad_errors.append(
                ((trained[name].grad[index] - p.grad).norm() / p.grad.norm()).item()
            )
print(f"gradients of each member and parameter: worst error {max(grad_errors):.1e}")
assert max(grad_errors) < 1e-5, f"gradients: worst error {max(grad_errors):.1e}"

# %%
# After three steps, each member's slice of the stacked weights must sit where that member's own
# Adam put it, parameter by parameter. The weights moved, so the check is not comparing the
# starting point with itself.
weight_errors = []
for index, member in enumerate(copies):
    for name, p in member.named_parameters():
        error = ((trained[name][index] - p).norm() / p.norm()).item()
        assert error < 3e-6, f"member {index} {name}: relative error {error:.1e}"
        moved = ((p - stacked_params[name][index]).norm() / p.norm()).item()
        assert moved > 1e-3, f"member {index} {name} did not move"
        weight_errors.append(error)
print(f"3 stacked Adam steps = 3 separate ones, {len(copies)} members:", end=" ")
print(f"worst relative error {max(weight_errors):.1e}")

# %%
# How fast is it?
# ---------------
# For N = 1 to 32 members, we time the loop and the stacked call in both cases, without autograd
# (inference only). :class:`torch.utils.benchmark.Timer` repeats each call in blocks and reports
# the median and the interquartile range (IQR) over them.
member_counts = [1, 2, 4, 8, 16, 32]
speedups = {"same minibatch": [], "own minibatches": []}
times_ms = {"loop": [], "vmap": []}  # same minibatch, for the second panel


def median_and_iqr_ms(fn):
    n_threads = torch.get_num_threads()
    call_timer = benchmark.Timer("call()", globals={"call": fn}, num_threads=n_threads)
    measurement = call_timer.blocked_autorange(min_run_time=0.15)
    return measurement.median * 1e3, measurement.iqr * 1e3


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
        ms = {}
        for name, fn in calls.items():
            ms[name], iqr = median_and_iqr_ms(fn)
            print(f"N={count:2d} {name:10s} {ms[name]:7.2f} ms (IQR {iqr:.2f} ms)")
        speedups["same minibatch"].append(ms["loop, same"] / ms["vmap, same"])
        speedups["own minibatches"].append(ms["loop, own"] / ms["vmap, own"])
        times_ms["loop"].append(ms["loop, same"])
        times_ms["vmap"].append(ms["vmap, same"])
for case, values in speedups.items():
    print(
        f"{case:16s}"
        + "".join(f"  N={n}: {s:.2f}x" for n, s in zip(member_counts, values))
    )


# %%
# Where a loop can win: small N
# ------------------------------
# Both ways do the same arithmetic: ``torch.utils.flop_counter.FlopCounterMode`` counts
# the FLOPs of each. What differs is how many operations PyTorch dispatches, which a small
# dispatch mode counts. Each operation has a fixed price (Python, the dispatcher, on a GPU a
# kernel launch) on top of its arithmetic.
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
    print(f"FLOPs {loop_flops / 1e6:.1f} M each way")
    assert loop_flops == vmap_flops, (loop_flops, vmap_flops)
    vmap_ops_by_count[count] = vmap_ops
assert vmap_ops_by_count[1] == vmap_ops_by_count[member_counts[-1]]
print("loop's ops at N=32:", dict(loop_ops.most_common()))
print("vmap's ops, the same at N=1 and N=32:", dict(vmap_ops.most_common()))

# %%
# The loop dispatches the same few operations per member (one fused matrix product with bias per
# linear layer), so its count grows with N. The stacked call dispatches a fixed number, but more
# than one member needs: each linear layer becomes views, a batched matrix product and a separate
# bias addition. So at N=1 the stacked call pays for more operations doing the same arithmetic,
# plus probably some Python work of ``functional_call`` and ``vmap``, so the loop can be faster
# there (the timings below say whether it was, on this run). As N grows, the loop pays N fixed
# prices where the stacked call pays one. Where the break-even falls depends on how long each
# operation's arithmetic takes against its fixed price; the left panel shows both times, the right
# one their ratio.
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
ax_speed.set_title("Speed-up of vmap (below 1: the loop wins)")
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
#   element-wise state is then one state per member.
# - Both ways do the same FLOPs. The loop dispatches its operations once per member, the
#   stacked call a fixed, larger set once: it needs enough members to pay off, so read the
#   break-even for your hardware off a timing over N.
# - Check each member on its own against the member run alone.
