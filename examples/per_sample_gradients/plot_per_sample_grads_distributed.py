"""
Per-sample gradients across processes: DistributedDataParallel, all-reduce, SyncBatchNorm
=========================================================================================

In data-parallel training each process (a *rank*) holds a copy of the model and a shard of the
batch. DP-SGD clips each example's gradient before anything is summed, which DDP
(``DistributedDataParallel``) cannot do: its all-reduce, in ``loss.backward()``, gets each rank's
gradient already summed over the shard's samples. Here two processes clip per-sample gradients
from ``vmap(grad(...))`` and all-reduce the sums, or let DDP's all-reduce carry them through a
reweighted backward; both are checked against a float64 loop. Then: DDP and :mod:`torch.func`'s
gradients, the error "Expected to have finished reduction", and ``SyncBatchNorm``.
"""

# %%
# Setup
# -----
# Two fresh Python processes run the distributed code, with ``gloo`` on the CPU also where there is
# a GPU ("Running two processes from a page" says what to change); this page checks what they save.
import inspect
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap
from torch.nn.parallel import DistributedDataParallel

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
FEATURES, HIDDEN, CLASSES, BATCH, STEPS = 10, 16, 3, 16, 2  # BATCH: the global batch
CLIP, NOISE_STD, LR = 2.0, 1.0, 0.5  # DP-SGD's C, its noise σ·C (σ = 0.5), SGD's rate


# %%
# The recipe, inside each rank
# ----------------------------
# Per-sample gradients are computed as in one process
# (:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads.py`), on the rank's
# shard, through the plain module ``ddp.module``. The wrapper's forward also does DDP's own
# bookkeeping (buffer copies, a bucket rebuild after the first backward, with some options an
# ``autograd.Function``), which can raise under a transform at some iterations (the probe below;
# :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_libraries.py`). Each sample's gradient
# is scaled to norm at most ``C`` over all parameters; the clipped sum and the factors return.
def clipped_grad_sum(model, inputs, labels):
    weights = {name: p.detach() for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())  # BatchNorm's statistics, if any

    def sample_loss(params, buffers, x, y):
        logits = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, None, 0, 0))
    per_sample = per_sample_grads(weights, buffers, inputs, labels)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()])
    scale = (CLIP / norms.norm(dim=0)).clamp(max=1.0)  # one factor per sample
    return {n: torch.tensordot(scale, g, dims=1) for n, g in per_sample.items()}, scale


# %%
# The first route's step: ``torch.distributed.all_reduce`` adds the ranks' clipped sums in place,
# one call per tensor (DDP packs gradients into buckets instead), divided then by the *global*
# batch size. The summed noise must have standard deviation σ·C; the simplest way: rank 0 alone
# adds it, as Opacus's distributed optimizer does (W ranks each adding σ·C give √W times that).
def dp_sgd_step(model, optimizer, inputs, labels, noise, all_reduce=True):
    summed, _ = clipped_grad_sum(model, inputs, labels)
    for name, p in model.named_parameters():
        total = summed[name] + noise[name] * (dist.get_rank() == 0)  # rank 0's only
        if all_reduce:
            dist.all_reduce(total)
        p.grad = total / BATCH
    optimizer.step()


# %%
# A second route, through DDP's all-reduce: weight each sample's loss by its clip factor; one
# ``.backward()`` through the wrapper then gives the clipped sum, averaged over the W ranks by
# DDP's hooks (hence ``W / B``, not a mean over the shard: shards can differ in size, as under
# Poisson sampling and here); each rank adds rank 0's noise. It fits a DDP loop and keeps DDP's
# bucketed all-reduce. Here it costs the first route's work plus a forward and a backward, as the
# factors come from per-sample gradients (:ref:`ghost norms
# <sphx_glr_auto_examples_per_sample_gradients_plot_dp_sgd_ghost_norms.py>` get them without).
# Its forward must not be random: dropout's masks would differ from those behind the factors, and
# the reweighted gradients need not have norm at most ``C``.
def ddp_backward_step(ddp, optimizer, inputs, labels, noise):
    _, scale = clipped_grad_sum(ddp.module, inputs, labels)  # the factors only
    losses = F.cross_entropy(ddp(inputs), labels, reduction="none")
    optimizer.zero_grad()  # .backward() adds to .grad
    (losses * scale * dist.get_world_size() / BATCH).sum().backward()
    for name, p in ddp.module.named_parameters():  # by name, not position
        dist.broadcast(noise[name], src=0)  # rank 0's noise, on every rank
        p.grad += noise[name] / BATCH
    optimizer.step()


# %%
# .. warning::
#    The noise below comes from a public seed so that the float64 loop can draw it again; anyone
#    else can too, subtract it, and nothing is private. Train with noise nobody can predict
#    (:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_dp_sgd_training.py`; Opacus's
#    ``secure_mode=True`` needs ``torchcsprng``, whose last PyPI release pins torch 1.8; one
#    user reports building it from source for torch 2.4, in meta-pytorch/csprng#130).
def global_batch(step, rank=None):  # every rank draws the whole batch, keeps its shard
    gen = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(BATCH, FEATURES, generator=gen)
    batch = inputs, torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return batch if rank is None else [t.tensor_split([10])[rank] for t in batch]


def dp_noise(step, model, rank=0):  # per rank: a rank adding its own fails the check
    gen = torch.Generator().manual_seed(1000 + step + 97 * rank)
    return {n: NOISE_STD * torch.randn(p.shape, generator=gen)
            for n, p in model.named_parameters()}  # fmt: skip


def make_model(seed, norm=None):
    torch.manual_seed(seed)  # each rank its own seed; DDP then copies rank 0's weights
    layers = [nn.Linear(FEATURES, HIDDEN), norm or nn.Identity(), nn.Tanh()]
    if isinstance(norm, nn.SyncBatchNorm):  # running statistics, as if trained
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    return nn.Sequential(*layers, nn.Linear(HIDDEN, CLASSES))


# %%
# Each rank trains three times, two steps each: the recipe, the recipe without the all-reduce
# (as if DDP would do it), and the route through DDP's backward.
def train_on_rank(rank, world_size):
    trained = {}
    for variant in ("all_reduce", "no all_reduce", "DDP's backward"):
        model = make_model(seed=rank)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            inputs, labels = global_batch(step, rank)  # 10 and 6 samples
            args = (optimizer, inputs, labels, dp_noise(step, model, rank))
            if variant == "DDP's backward":
                ddp_backward_step(ddp, *args)
            else:
                dp_sgd_step(model, *args, all_reduce=variant == "all_reduce")
        trained[variant] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trained


# %%
# A probe, run in the same processes
# ----------------------------------
# DDP all-reduces in hooks that fire when ``.backward()``, after a forward through the wrapper,
# accumulates into ``.grad``. The probe builds DDP three ways (``find_unused_parameters``,
# ``static_graph``, the defaults), runs the recipe through each, then :func:`torch.autograd.grad`
# (which accumulates nothing) of a forward; on the last, twice ``.backward()`` and the recipe, and
# a ``.backward()`` of some parameters. Then it tries ``SyncBatchNorm`` and two fixes.
def error_of(action, *args):
    try:
        action(*args)
    except (RuntimeError, ValueError) as err:
        return type(err).__name__, " ".join(str(err).split())


def probe(rank, world_size):
    inputs, labels = global_batch(0, rank)
    seen = {}
    for options in ({"find_unused_parameters": True}, {"static_graph": True}, {}):
        ddp = DistributedDataParallel(make_model(seed=0), **options)
        key = next(iter(options), "defaults")
        seen[f"recipe, {key}"] = error_of(clipped_grad_sum, ddp, inputs, labels)
        loss = F.cross_entropy(ddp(inputs), labels)
        torch.autograd.grad(loss, list(ddp.parameters()))
        seen[f".grad, {key}"] = [p.grad for p in ddp.parameters()]
        seen[f"next forward, {key}"] = error_of(ddp, inputs)
    seen["both"] = [clipped_grad_sum(m, inputs, labels) for m in (ddp, ddp.module)]
    for key in ("after a .backward()", "after one more iteration"):
        F.cross_entropy(ddp(inputs), labels).backward()  # DDP's own route
        seen[f"recipe, {key}"] = error_of(clipped_grad_sum, ddp, inputs, labels)
    F.cross_entropy(ddp(inputs), labels).backward(inputs=[*ddp.module[0].parameters()])
    seen["after a partial backward"] = error_of(ddp, inputs)
    model = make_model(0, nn.SyncBatchNorm(HIDDEN))
    seen["DDP(SyncBatchNorm)"] = error_of(DistributedDataParallel, model)
    seen["train"] = error_of(clipped_grad_sum, model, inputs, labels)
    seen["eval"] = clipped_grad_sum(model.eval(), inputs, labels)[0]
    replace_all_batch_norm_modules_(model.train())
    seen["replaced, train"] = error_of(clipped_grad_sum, model, inputs, labels)
    group_norm = make_model(0, nn.GroupNorm(4, HIDDEN))
    seen["GroupNorm"] = clipped_grad_sum(group_norm, inputs, labels)[0]
    return seen


# %%
# Running two processes from a page
# ---------------------------------
# ``multiprocessing``'s ``spawn`` (which ``torch.multiprocessing.spawn`` uses) finds a function
# by its module and name, which fails for functions defined in a notebook or a sphinx-gallery
# page. So the page writes their source (``inspect.getsource``) into a script and starts it once
# per rank with ``subprocess.Popen``, setting the variables ``init_process_group`` reads; each
# rank saves what its functions return. In a script of your own, ``torchrun --nproc-per-node=N``
# sets them; on GPUs use ``nccl``, each rank on its own device. DP's accounting assumes Poisson
# sampling, not ``DistributedSampler``'s shuffled shards: Opacus's ``make_private`` on a DDP model
# switches to its ``DistributedUniformWithReplacementSampler`` and to an optimizer that adds rank
# 0's noise and all-reduces, as the first route does; ``BATCH`` is then the expected batch size.
WORKER_IMPORTS = """import sys; from pathlib import Path; import torch
import torch.distributed as dist; import torch.nn.functional as F; from torch import nn
from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap
from torch.nn.parallel import DistributedDataParallel
"""
SETTINGS = "FEATURES HIDDEN CLASSES BATCH STEPS CLIP NOISE_STD LR".split()


def worker_main(entries):
    torch.set_num_threads(1)  # two processes on a shared CPU
    dist.init_process_group("gloo")  # from MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        results = {entry.__name__: entry(rank, world_size) for entry in entries}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(sys.argv[1]) / f"rank{rank}.pt")


def run_on_ranks(entries, helpers, timeout=60):  # on two ranks
    settings = [f"{name} = {globals()[name]!r}" for name in SETTINGS]
    functions = [inspect.getsource(f) for f in [*helpers, *entries, worker_main]]
    call = f"worker_main([{', '.join(entry.__name__ for entry in entries)}])"
    with tempfile.TemporaryDirectory(prefix="ranks") as workdir:
        script = Path(workdir) / "worker.py"
        script.write_text("\n".join([WORKER_IMPORTS, *settings, *functions, call]))
        with socket.socket() as free:  # a port that is free now
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
        logs = [Path(workdir) / f"rank{rank}.err" for rank in range(2)]
        processes, deadline = [], time.monotonic() + timeout
        for rank, log in enumerate(logs):
            with log.open("w") as err:  # the process keeps its own handle
                command, env["RANK"] = [sys.executable, str(script), workdir], str(rank)
                processes.append(subprocess.Popen(command, env=env, stderr=err))
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if any(p.poll() for p in processes):  # a rank failed: the others may hang
                break
            time.sleep(0.1)
        for process in processes:
            if process.poll() is None:
                process.kill()  # a rank that failed, or the time ran out
            process.wait()
        codes = [process.returncode for process in processes]
        report = [f"exit codes {codes}; -9: killed, on a failure or at {timeout} s"]
        report += [f"rank {rank}:\n{log.read_text()}" for rank, log in enumerate(logs)]
        assert codes == [0, 0], "\n".join(report)
        return [torch.load(Path(workdir) / f"rank{rank}.pt") for rank in range(2)]


helpers = [clipped_grad_sum, dp_sgd_step, ddp_backward_step, global_batch, dp_noise]
helpers += [make_model, error_of]
ranks = run_on_ranks([train_on_rank, probe], helpers)


# %%
# The check: both ranks take the float64 loop's step
# ---------------------------------------------------
# The reference runs here on the whole global batch in float64, one sample at a time with
# :func:`torch.autograd.grad`: it clips by each sample's norm over all parameters, adds rank 0's
# noise and takes SGD steps by hand from rank 0's initial weights. ``C`` was chosen from these
# norms so that the check sees clipped and unclipped samples (DP-SGD fixes it in advance). Each
# tensor's *update* (trained minus start) is compared on its own: the weights would dilute an error.
def loop_clipped_sum(model, inputs, labels):
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    clipped = 0
    for x, y in zip(inputs, labels):
        loss = F.cross_entropy(model(x[None]), y[None])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        norm = torch.cat([g.flatten() for g in grads]).norm().item()
        clipped += norm > CLIP
        for name, g in zip(total, grads):
            total[name] += g * min(1.0, CLIP / norm)
    return total, clipped


x64 = {"device": device, "dtype": torch.float64}
reference = make_model(seed=0).to(**x64)  # rank 0's initial weights
start = {n: p.detach().cpu().clone() for n, p in reference.named_parameters()}
for step in range(STEPS):
    inputs, labels = global_batch(step)
    summed, clipped = loop_clipped_sum(reference, inputs.to(**x64), labels.to(device))
    assert 0 < clipped < BATCH, f"step {step}: the check must see both kinds of sample"
    noise = dp_noise(step, reference)
    for name, p in reference.named_parameters():  # SGD, outside autograd
        p.detach().sub_(LR * (summed[name] + noise[name].to(p)) / BATCH)
    print(f"step {step}: {clipped} of {BATCH} per-sample gradients clipped")

want = {n: p.detach().cpu() - start[n] for n, p in reference.named_parameters()}

errors = {}
for variant in ranks[0]["train_on_rank"]:
    runs = [r["train_on_rank"][variant] for r in ranks]
    errors[variant] = [{n: ((run[n].double() - start[n] - w).norm() / w.norm()).item()
                        for n, w in want.items()} for run in runs]  # fmt: skip
    same = all(torch.equal(runs[0][n], runs[1][n]) for n in want)
    worst = max(max(e.values()) for e in errors[variant])
    print(f"{variant:15s} ranks bitwise equal: {same!s:5s} worst error {worst:.1e}")
    if variant == "no all_reduce":
        assert not same and worst > 1e-2, f"{variant}: the ranks did not diverge"
        continue
    assert same, f"{variant}: the ranks hold different parameters"
    for rank, errs in enumerate(errors[variant]):
        for name, err in errs.items():
            assert err < 2e-6, f"{variant}, rank {rank}, {name}: error {err:.1e}"
    print(f"{'':15s} bound 2e-06, {2e-6 / worst:.0f}x the worst error")

# %%
# Float32 rounding on both routes and ranks; without the all-reduce, each rank went its own way.
fig, axes = plt.subplots(1, 3, figsize=(11, 3), sharey=True, layout="constrained")
roundoff = torch.finfo(torch.float32).eps / 2
for ax, variant in zip(axes, ("all_reduce", "DDP's backward", "no all_reduce")):
    for rank, (shade, errs) in enumerate(zip(("black", "gray"), errors[variant])):
        x = [i + 0.4 * rank - 0.2 for i in range(len(want))]
        ax.bar(x, errs.values(), 0.4, color=shade, label=f"rank {rank}")
    ax.axhline(roundoff, color="black", linestyle="--", label="float32 roundoff")
    ax.set_xticks(range(len(want)), list(want))
    ax.set(yscale="log", title=variant)
axes[0].set_ylabel("update error vs float64 loop")
axes[0].legend(loc="upper left")
plt.show()

# %%
# What DDP does, and does not do
# ------------------------------
# Without the explicit all-reduce the ranks diverged: DDP's hooks never saw the gradients of
# ``vmap(grad(...))`` on ``ddp.module``; through DDP's ``.backward()`` on reweighted losses, they
# averaged the clipped sums. In the probe the recipe through a fresh wrapper raised with
# ``find_unused_parameters=True`` (by DDP's source, in every forward) or ``static_graph=True`` (in
# its first iteration): DDP's forward calls an ``autograd.Function`` without ``setup_context``. With
# the defaults it ran, giving bitwise the sums of ``ddp.module``, raised after the first
# ``.backward()`` (DDP rebuilds its buckets in the next forward) and ran again one iteration later.
# After a forward through the wrapper, :func:`torch.autograd.grad` left ``.grad`` unset and the next
# forward raised nothing, in all three builds: DDP does not complain, it just does not average.
# So the first route uses DDP only for its constructor's broadcast of rank 0's parameters and
# buffers; one ``dist.broadcast`` per tensor at the start would do. The second route needs it.
setup_context = "In order to use an autograd.Function with functorch transforms"
raises = {"find_unused_parameters": setup_context, "static_graph": setup_context}
raises |= {"defaults": "", "after a .backward()": "Cannot access data pointer"}
raises["after one more iteration"] = ""
probes = [r["probe"] for r in ranks]
for key, words in raises.items():
    for seen in probes:
        kind, message = seen[f"recipe, {key}"] or ("ran", "no error")
        assert message.startswith(words) and (kind == "ran") == (not words), (key, kind)
        if f".grad, {key}" in seen:  # a fresh build: a forward, torch.autograd.grad
            assert all(g is None for g in seen[f".grad, {key}"]), key
            assert seen[f"next forward, {key}"] is None, key
    print(f"recipe through the wrapper, {key}: {kind}, {message[:60]}")
for (outer, _), (inner, _) in (seen["both"] for seen in probes):  # wrapper, module
    assert all(torch.equal(outer["module." + n], g) for n, g in inner.items()), "ddp"
print("defaults: the sums of ddp.module, bitwise; .grad unset, the next forward ran")

# %%
# The error users meet, "Expected to have finished reduction in the prior iteration", comes from
# a ``.backward()`` that reaches only some parameters, here ``backward(inputs=...)`` with the
# first layer's: some hooks fire, the reduction never completes, and the *next* forward raises.
# Unused parameters do the same under the default ``find_unused_parameters=False``.
words = "Expected to have finished reduction in the prior iteration"
for seen in probes:
    kind, message = seen["after a partial backward"] or ("no error", "")
    assert kind == "RuntimeError" and message.startswith(words), (kind, message)
print(f"{kind}: {message[:120]}...")

# %%
# BatchNorm and SyncBatchNorm
# ---------------------------
# In training mode :class:`~torch.nn.SyncBatchNorm` normalises with the global batch's mean and
# variance, gathered from all ranks: no sample has a gradient of its own for clipping to bound.
# On the CPU the probe met refusals first: DDP does not wrap it, and its training-mode forward
# refuses CPU tensors, also under ``vmap(grad(...))`` and after ``replace_all_batch_norm_modules_``
# (which drops the running statistics, not the synchronisation). On a GPU, by torch's source (not
# run here), the forward reaches an ``autograd.Function`` without ``setup_context``, which
# transforms refuse (:ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`).
on_gpu = "SyncBatchNorm expected input tensor to be on GPU"
expected = {"DDP(SyncBatchNorm)": "SyncBatchNorm layers only work with GPU modules"}
expected |= {"train": on_gpu, "replaced, train": on_gpu}
for attempt, words in expected.items():
    for seen in probes:
        kind, message = seen[attempt] or ("no error", "")
        assert kind == "ValueError" and message.startswith(words), (attempt, kind)
    print(f"{attempt}: ValueError: {words}")

# %%
# Two fixes give each sample a gradient of its own. In eval mode the layer normalises with its
# running statistics, the same on every rank, and synchronises nothing (``eval()`` also stops
# dropout: to keep it, call ``eval()`` on the norm layers alone, pass ``randomness="different"`` to
# ``vmap`` and take the first route). :class:`~torch.nn.GroupNorm` uses each sample's own
# statistics. Each rank's clipped sums are checked against the float64 loop on its shard.
#
# .. warning::
#    For DP, running statistics computed on the private data are not private: take them from
#    public data or pre-training. Opacus's ``ModuleValidator`` rejects BatchNorm layers with
#    trainable parameters, in eval mode too (a frozen one passes), and offers GroupNorm instead.
shards = [global_batch(0, rank) for rank in range(2)]
fixes = {"eval": make_model(0, nn.SyncBatchNorm(HIDDEN)).eval()}
fixes["GroupNorm"] = make_model(0, nn.GroupNorm(4, HIDDEN))
for fix, model in fixes.items():
    model.to(**x64)
    worst = 0.0
    for rank, (inputs, labels) in enumerate(shards):
        want_sum, _ = loop_clipped_sum(model, inputs.to(**x64), labels.to(device))
        got = probes[rank][fix]
        for name, w in want_sum.items():
            err = ((got[name].double() - w.cpu()).norm() / w.cpu().norm()).item()
            assert err < 5e-6, f"{fix}, rank {rank}, {name}: error {err:.1e}"
            worst = max(worst, err)
    print(f"{fix:9s} clipped sums: worst error {worst:.1e} (bound 5e-06)")

# %%
# What to remember
# ----------------
# * Under DDP, take per-sample gradients with ``vmap(grad(...))`` over
#   ``functional_call(ddp.module, ...)`` on the rank's shard, clip and sum them, ``all_reduce``
#   the sums, divide by the global batch size; add DP noise nobody can predict, on one rank only.
# * Or let DDP reduce: weight each sample's loss by its clip factor from ``vmap(grad(...))``,
#   run one ``.backward()`` through the wrapper, then add the same noise on every rank. Its two
#   forwards must compute the same function: no dropout.
# * DDP averages only what ``.backward()`` accumulates after a forward through the wrapper;
#   gradients from :mod:`torch.func` or :func:`torch.autograd.grad` pass it by, silently.
#   "Expected to have finished reduction" means a ``.backward()`` reached only some parameters.
# * ``SyncBatchNorm`` in training mode leaves per-sample gradients undefined: use eval-mode
#   statistics (from public data, for DP) or ``GroupNorm``;
#   :func:`~torch.func.replace_all_batch_norm_modules_` does not stop it from synchronising.
# * Check both: the ranks hold bitwise-equal weights, and a float64 loop in one process gives
#   the same update to float32 rounding. Give the ranks unequal shards, so a wrong divisor shows.
