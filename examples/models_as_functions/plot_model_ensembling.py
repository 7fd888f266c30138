"""
Model ensembling with ``stack_module_state`` and ``vmap``
=========================================================

An ensemble of small models is a common way to buy accuracy and uncertainty estimates, and a
Python loop over the members wastes the hardware: every member launches its own small
operations. :func:`~torch.func.stack_module_state` stacks the members' weights into one set of
tensors with a leading "member" dimension, and ``vmap`` runs all members in one call. This
page checks that the stacked ensemble computes exactly what the members compute alone, in two
cases (every member sees the same minibatch, or each sees its own), measures how the speedup
over the loop grows with the number of members and what it costs in memory, and trains the
stacked ensemble with one optimiser whose state is per member, checking that its steps equal
separate steps of separate models.
"""

# %%
# Where this page ran
# -------------------
# We use the GPU when there is one and seed the random number generator.
import copy
import ctypes
import gc
import os
import platform
import re
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


def describe_hardware():
    """One line naming the processor or GPU, torch's version and its thread count."""
    if device.type == "cuda":
        name = f"GPU: {torch.cuda.get_device_name(device)}"
    else:
        cpuinfo = Path("/proc/cpuinfo")  # Linux names the CPU model here
        model = (
            re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
            if cpuinfo.exists()
            else None
        )
        cpu = model.group(1) if model else (platform.processor() or platform.machine())
        name = f"CPU: {cpu}, {os.cpu_count()} cores"
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


print(describe_hardware())

# One colour per method, the same on every page of this site: colour-blind-safe hues from
# Okabe and Ito's palette and Tol's. Black is kept for guides: thresholds, fits, markers.
METHOD_COLORS = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "batched": "#666666",
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
    "sum trick": "#CC79A7",
    "vmap chunked": "#44AA99",
    "compiled": "#117733",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
    "ghost clipping": "#CC6677",
    "book-keeping": "#6699CC",
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
    "GGN": "#EE8866",
    "ntk-vector products": "#5D69B1",
    "linearize": "#CC3311",
}

# %%
# Pinning the memory allocator's policy
# -------------------------------------
# As on every page of this site, glibc is asked to keep freed memory for reuse, so that the
# timings do not depend on what the process did before. Without glibc the cell changes
# nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # from glibc's <malloc.h>


def glibc():
    """The C library, if it is glibc (whose mallopt we call), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


allocator_pinned = keep_freed_memory()
print(
    "allocator: glibc keeps freed memory for reuse"
    if allocator_pinned
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Timing and memory helpers
# -------------------------
# Medians over interleaved rounds of :class:`torch.utils.benchmark.Timer` after untimed
# calls; peak memory from the allocator's record of one call on a GPU, and on a Linux CPU from
# the rise of the process's peak resident memory during one call (with freed memory returned
# to the kernel meanwhile, so that resident memory follows the live tensors). Matrix products
# run in full float32 precision.
torch.set_float32_matmul_precision("highest")


def median_times_ms(methods, rounds=7, min_run_time=0.05):
    """Median time of each method in ``{name: fn}``, in ms, round after round."""
    for fn in methods.values():
        for _ in range(3):
            fn()
    timers = {
        name: benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
        for name, fn in methods.items()
    }
    rounds_ms = {name: [] for name in methods}
    for _ in range(rounds):
        for name, timer in timers.items():
            blocks = timer.blocked_autorange(min_run_time=min_run_time)
            rounds_ms[name].append(blocks.median * 1e3)
    return {name: statistics.median(times) for name, times in rounds_ms.items()}


def cuda_peak_bytes(fn):
    """Peak of live CUDA memory during fn(), from the allocator's record of this call."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(
        context=None, clear_history=True, max_entries=1_000_000
    )
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live = peak = 0
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live += event["size"]
            peak = max(peak, live)
        elif event["action"] == "free_completed":
            live -= event["size"]
    return peak


def cpu_peak_bytes(fn):
    """Rise of the process's resident memory during fn(), or None where Linux cannot say."""
    status, clear_refs = Path("/proc/self/status"), Path("/proc/self/clear_refs")
    if not (allocator_pinned and status.exists()):
        return None

    def resident(field):
        text = status.read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) << 10

    libc = glibc()
    libc.mallopt(
        M_MMAP_MAX, 65536
    )  # glibc's defaults, held fixed: freed memory goes back
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    libc.malloc_trim(0)
    try:
        clear_refs.write_text("5")  # reset the peak to the current resident size
        start = resident("VmRSS")
        fn()
        return resident("VmHWM") - start
    except OSError:
        return None
    finally:
        keep_freed_memory()


def peak_mib(fn):
    # Garbage from earlier cells, if collected during the call, would hide part of its peak.
    gc.collect()
    peak = cuda_peak_bytes(fn) if device.type == "cuda" else cpu_peak_bytes(fn)
    return None if peak is None else peak / 2**20


# %%
# The members
# -----------
# Each member is the same small classifier (64 features, two hidden layers of 128 units, 10
# classes), initialised from its own seed. The data is random: this page is about how the
# ensemble runs, not about what it learns.
class SmallClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
            nn.Linear(128, 10),
        )  # fmt: skip

    def forward(self, x):
        return self.layers(x)


def make_members(count):
    members = []
    for seed in range(count):
        torch.manual_seed(seed)
        members.append(SmallClassifier().to(device))
    return members


batch_size = 64
members = make_members(8)
print(f"{sum(p.numel() for p in members[0].parameters()):,} parameters per member")

# %%
# Stacking the weights
# --------------------
# ``stack_module_state`` returns two dictionaries, parameters and buffers, whose tensors have
# the members along a new first dimension. A copy of one member on the ``"meta"`` device serves
# as the template that ``functional_call`` runs: it has the architecture and no memory, since
# its own weights are never used.
stacked_params, stacked_buffers = stack_module_state(members)
template = copy.deepcopy(members[0]).to("meta")
print({name: tuple(p.shape) for name, p in stacked_params.items()})


def run_member(params, buffers, x):
    return functional_call(template, (params, buffers), (x,))


# %%
# Case 1: every member sees the same minibatch
# --------------------------------------------
# The minibatch is shared, so it is not mapped: ``in_dims=(0, 0, None)``. The result has one
# slice per member, and each slice must equal that member run alone.
same_batch = torch.randn(batch_size, 64, device=device)
shared = vmap(run_member, in_dims=(0, 0, None))
same_out = shared(stacked_params, stacked_buffers, same_batch)
for member, out in zip(members, same_out):
    torch.testing.assert_close(out, member(same_batch))
print("same minibatch:", tuple(same_out.shape), "- every member matches its own run")

# %%
# Case 2: each member sees its own minibatch
# ------------------------------------------
# With a minibatch per member (bagging, or a different data shard per member), the data has a
# member dimension too, and everything is mapped: ``in_dims=(0, 0, 0)``.
own_batches = torch.randn(len(members), batch_size, 64, device=device)
separate = vmap(run_member, in_dims=(0, 0, 0))
own_out = separate(stacked_params, stacked_buffers, own_batches)
for member, batch, out in zip(members, own_batches, own_out):
    torch.testing.assert_close(out, member(batch))
print("own minibatches:", tuple(own_out.shape), "- every member matches its own run")

# %%
# How the speedup grows with the number of members
# ------------------------------------------------
# For N = 1 to 32 members, the loop and the stacked call take turns in the same timing rounds,
# in both cases. Inference only, so no autograd graph is kept.
member_counts = [1, 4, 16, 32]
speedups = {"same minibatch": [], "own minibatches": []}
peaks = {}
with torch.no_grad():
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
        times = median_times_ms(calls)
        speedups["same minibatch"].append(times["loop, same"] / times["vmap, same"])
        speedups["own minibatches"].append(times["loop, own"] / times["vmap, own"])
        if count == member_counts[-1]:
            peaks = {name: peak_mib(fn) for name, fn in calls.items()}
            last_times = times
for case, values in speedups.items():
    print(
        f"{case:16s}"
        + "".join(f"  N={n}: {s:.2f}x" for n, s in zip(member_counts, values))
    )
largest = member_counts[-1]
print(
    f"ensemble speedup over the loop at N={largest}: "
    f"{speedups['same minibatch'][-1]:.2f}x (same minibatch), "
    f"{speedups['own minibatches'][-1]:.2f}x (own minibatches)"
)
if peaks["vmap, same"] is not None:
    print(
        f"peak memory at N={largest}: loop {peaks['loop, same']:.1f} MiB, "
        f"vmap {peaks['vmap, same']:.1f} MiB (same minibatch); "
        f"loop {peaks['loop, own']:.1f} MiB, vmap {peaks['vmap, own']:.1f} MiB (own)"
    )

# %%
# The figure shows the speedup against the number of members. Below the dashed line the loop
# is faster.
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
for case, marker in [("same minibatch", "o"), ("own minibatches", "s")]:
    ax.plot(member_counts, speedups[case], marker=marker, color=METHOD_COLORS["vmap"],
            linestyle="-" if marker == "o" else "--", label=case)  # fmt: skip
ax.axhline(1, color="black", linestyle=":", linewidth=1)
ax.set_xscale("log", base=2)
ax.set_xticks(member_counts, [str(n) for n in member_counts])
ax.set_xlabel("members in the ensemble")
ax.set_ylabel("loop time / vmap time")
ax.set_title(f"Stacked ensemble on {device.type.upper()}: speedup over a Python loop")
ax.legend()
plt.show()

# %%
# Training the stacked ensemble
# -----------------------------
# The stacked parameters are ordinary leaf tensors, so an ordinary optimiser can train them.
# The loss is the *sum* of the members' losses: each member's loss depends only on its own
# slice, so the gradient of the sum, slice by slice, is each member's own gradient. Adam keeps
# its moments element by element, so one Adam over the stacked tensors keeps exactly one state
# per member. We check that three steps of the stacked ensemble land where three steps of each
# member with its own Adam land.
targets = torch.randint(0, 10, (len(members), batch_size), device=device)
trained = {
    name: p.detach().clone().requires_grad_() for name, p in stacked_params.items()
}
stacked_optimizer = torch.optim.Adam(trained.values(), lr=1e-2)
copies = [copy.deepcopy(m) for m in members]
optimizers = [torch.optim.Adam(c.parameters(), lr=1e-2) for c in copies]
for _ in range(3):
    stacked_optimizer.zero_grad()
    logits = separate(trained, stacked_buffers, own_batches)
    losses = vmap(F.cross_entropy)(logits, targets)
    losses.sum().backward()
    stacked_optimizer.step()
    for member, optimizer, batch, target in zip(
        copies, optimizers, own_batches, targets
    ):
        optimizer.zero_grad()
        F.cross_entropy(member(batch), target).backward()
        optimizer.step()
for index, member in enumerate(copies):
    for name, p in member.named_parameters():
        torch.testing.assert_close(
            trained[name][index],
            p,
            msg=lambda m, name=name, index=index: f"member {index} {name}: {m}",
        )
moved = (trained["layers.0.weight"] - stacked_params["layers.0.weight"]).norm().item()
assert moved > 0
print(
    "3 stacked Adam steps equal 3 separate Adam steps, for every member and parameter"
)
