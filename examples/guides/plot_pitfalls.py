"""
Pitfalls: what goes wrong under ``torch.func``, and the fix
===========================================================

The questions that come back most often in PyTorch's and functorch's issue trackers are not
about what the transforms compute but about code that stops working, or worse, keeps working
and computes something else, once it runs under ``vmap`` or ``grad``. This page runs each of
them. Where a transform raises, the error is caught, its type and a stable part of its message
are checked, and the message is printed in full. Where the result is silently wrong, the page
shows by how much. Then comes the fix, with an assertion that it is right.

You will learn about in-place writes into new tensors, ``.item()`` and data-dependent control
flow, reductions over "the batch", Python side effects, randomness, BatchNorm, tied weights,
loss reduction, matching gradients by name, TF32 tolerances, the slow-fallback warning, and
``torch.compile`` around transforms.
"""

# %%
# Where this page ran
# -------------------
# A few results below depend on the hardware (the TF32 section and the timings), so the page
# says what it ran on. We use the GPU when there is one and seed the random number generator.
import ctypes
import os
import platform
import re
import statistics
import textwrap
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import (
    functional_call,
    functionalize,
    grad,
    replace_all_batch_norm_modules_,
    vmap,
)
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
# few timings below do not depend on what the process did before. Without glibc the cell
# changes nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


print(
    "allocator: glibc keeps freed memory for reuse"
    if keep_freed_memory()
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Two helpers
# -----------
# ``expect_error`` runs code that must raise a given error type with a given fragment in its
# message, and prints the message in full; anything else (no error, another type, another
# message) fails the page. ``median_times_ms`` times functions as on the other pages: untimed
# calls first, then interleaved rounds of :class:`torch.utils.benchmark.Timer`, medians.


def expect_error(fn, error_type, fragment):
    """Run fn, which must raise error_type with fragment in its message; print the message."""
    try:
        fn()
    except error_type as error:
        message = str(error)
        assert fragment in message, f"unexpected message: {message}"
        print(f"{type(error).__name__}:")
        print(textwrap.fill(" ".join(message.split()), width=88))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


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


samples = torch.randn(4, 3, device=device)

# %%
# 1. In-place writes into a tensor made inside the function
# ---------------------------------------------------------
# ``torch.zeros(x.shape)`` inside a function under ``vmap`` makes *one* tensor, not one per
# sample, because ``x.shape`` is the shape of a single sample. Writing the batched ``x`` into
# it cannot work, and ``vmap`` says so.


def copy_into_zeros(x):
    out = torch.zeros(x.shape, device=x.device)
    out.copy_(2 * x)
    return out


expect_error(lambda: vmap(copy_into_zeros)(samples), RuntimeError, "inplace arithmetic")

# %%
# Three fixes. ``x.new_zeros(...)`` (or ``torch.zeros_like(x)``) makes a tensor that is
# batched like ``x``. Out-of-place code has no problem to begin with. And
# :func:`~torch.func.functionalize` rewrites the function's in-place operations as out-of-place
# ones, so the original code runs unchanged (here through a slower fallback for ``copy``, whose
# warning we silence; see section 11).


def copy_into_new_zeros(x):
    out = x.new_zeros(x.shape)
    out.copy_(2 * x)
    return out


torch.testing.assert_close(vmap(copy_into_new_zeros)(samples), 2 * samples)
torch.testing.assert_close(vmap(lambda x: 2 * x)(samples), 2 * samples)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="There is a performance drop")
    functional_result = vmap(functionalize(copy_into_zeros))(samples)
torch.testing.assert_close(functional_result, 2 * samples)
print("new_zeros, out-of-place code and functionalize all give 2·x for every sample")

# %%
# 2. ``.item()`` and data-dependent control flow
# ----------------------------------------------
# ``if tensor:`` and ``.item()`` need one concrete number, but under ``vmap`` a tensor holds
# one number per sample. Both raise.
expect_error(
    lambda: vmap(lambda x: x if x.sum() > 0 else -x)(samples),
    RuntimeError,
    "data-dependent control flow",
)
expect_error(lambda: vmap(lambda x: x.sum().item())(samples), RuntimeError, ".item()")

# %%
# The fixes choose per sample. :func:`torch.where` computes both branches and picks element by
# element, which suits cheap branches. :func:`torch.cond` takes the two branches as functions;
# under ``vmap`` it too evaluates both and selects (a branch may not return its input
# unchanged, hence the ``clone``). The reference is a loop with ordinary Python ``if``.
reference = torch.stack([x if x.sum() > 0 else -x for x in samples])
with_where = vmap(lambda x: torch.where(x.sum() > 0, x, -x))(samples)
with_cond = vmap(
    lambda x: torch.cond(x.sum() > 0, lambda t: t.clone(), lambda t: -t, (x,))
)(samples)
torch.testing.assert_close(with_where, reference)
torch.testing.assert_close(with_cond, reference)
print("torch.where and torch.cond agree with a Python loop over samples")

# %%
# 3. Reductions over "the batch dimension" mean something else
# ------------------------------------------------------------
# Inside ``vmap`` each sample has lost its batch axis, so ``x.mean(dim=0)`` averages over the
# sample's own first axis (here its 3 features) instead of over the batch. Nothing raises: the
# result has the right shape and is a different computation.
centred = vmap(lambda x: x - x.mean(dim=0))(samples)
meant = samples - samples.mean(dim=0)
difference = ((centred - meant).norm() / meant.norm()).item()
print(f"centring inside vmap vs over the batch: relative difference {difference:.2f}")
torch.testing.assert_close(centred, samples - samples.mean(dim=1, keepdim=True))
assert difference > 0.1

# %%
# The fix: compute statistics of the batch *outside* ``vmap`` and pass them in, unmapped
# (``in_dims=None``).
batch_mean = samples.mean(dim=0)
centred_right = vmap(lambda x, m: x - m, in_dims=(0, None))(samples, batch_mean)
torch.testing.assert_close(centred_right, meant)
print("batch statistics passed in with in_dims=None: correct")

# %%
# 4. Python side effects run once
# -------------------------------
# ``vmap`` runs the Python body once for the whole batch, so a counter, a print or an append
# to a list happens once, not once per sample. Again nothing raises.
calls = []
vmap(lambda x: calls.append(x.shape) or x * 2)(samples)
print(f"vmap over {len(samples)} samples ran the Python body {len(calls)} time(s)")
assert len(calls) == 1

# %%
# The fix: keep side effects out of mapped functions, or count with tensors. Returning a
# per-sample value gives one entry per sample.
per_sample_flags = vmap(lambda x: (x.sum() > 0).int())(samples)
assert per_sample_flags.shape == (len(samples),)
print("a per-sample output has one entry per sample:", per_sample_flags.tolist())

# %%
# 5. Randomness
# -------------
# By default ``vmap`` refuses random operations such as dropout, because it cannot know whether
# you want the same random numbers for every sample or different ones.
expect_error(
    lambda: vmap(lambda x: F.dropout(x, 0.5))(samples), RuntimeError, "randomness"
)

# %%
# Say which with ``randomness=``: ``"different"`` draws independently per sample, as dropout
# in a batch does; ``"same"`` draws once and shares the draw.
ones = torch.ones(64, 16, device=device)
different = vmap(lambda x: F.dropout(x, 0.5), randomness="different")(ones)
same = vmap(lambda x: F.dropout(x, 0.5), randomness="same")(ones)
assert (same == same[0]).all()
assert not (different == different[0]).all()
print("randomness='same': one mask for all; 'different': a mask per sample")

# %%
# 6. BatchNorm: what each remedy computes
# ---------------------------------------
# Training-mode batch norm normalises each sample with statistics of the *whole batch*, so a
# per-sample function of it is not well defined, and updating the running statistics is an
# in-place write. The usual remedies are not equivalent: each one computes a different
# function. We map over single images of shape (3, 5, 5) and compare with the layer applied to
# the batch.
images = torch.randn(8, 3, 5, 5, device=device)
batch_norm = nn.BatchNorm2d(3).to(device)
expect_error(
    lambda: vmap(lambda x: batch_norm(x.unsqueeze(0)))(images),
    RuntimeError,
    "running_mean or running_var",
)

# %%
# **eval() mode** normalises with the running statistics, which do not depend on the batch.
# Per-sample and batched results agree: this is the model as it runs at inference time.
batch_norm.eval()
per_sample_eval = vmap(lambda x: batch_norm(x.unsqueeze(0)).squeeze(0))(images)
torch.testing.assert_close(per_sample_eval, batch_norm(images))

# %%
# **track_running_stats=False** (or :func:`~torch.func.replace_all_batch_norm_modules_`, which
# switches it off in place) lets training mode run under ``vmap``. But each call now sees one
# sample, so ``BatchNorm2d`` normalises every image by its *own* mean and variance per channel:
# that is instance normalisation, a different model from the batch-mode layer. For
# ``BatchNorm1d`` a single sample has one value per channel, and it refuses outright.
per_sample_bn = nn.BatchNorm2d(3).to(device)
replace_all_batch_norm_modules_(per_sample_bn)
per_sample_train = vmap(lambda x: per_sample_bn(x.unsqueeze(0)).squeeze(0))(images)
torch.testing.assert_close(
    per_sample_train, F.instance_norm(images, eps=per_sample_bn.eps)
)
batch_mode = per_sample_bn(images)  # the same layer, given the whole batch
difference = ((per_sample_train - batch_mode).norm() / batch_mode.norm()).item()
print(f"per-sample vs batch-mode normalisation: relative difference {difference:.2f}")
assert difference > 0.05

features_bn = nn.BatchNorm1d(3, track_running_stats=False).to(device)
expect_error(
    lambda: vmap(lambda x: features_bn(x.unsqueeze(0)))(samples),
    ValueError,
    "Expected more than 1 value per channel",
)

# %%
# **GroupNorm** normalises each sample on its own by design, so per-sample and batched results
# are the same function.
group_norm = nn.GroupNorm(num_groups=1, num_channels=3).to(device)
per_sample_group = vmap(lambda x: group_norm(x.unsqueeze(0)).squeeze(0))(images)
torch.testing.assert_close(per_sample_group, group_norm(images))
print("eval(), instance-style and GroupNorm behave as described")

# %%
# 7. Tied weights in ``functional_call``
# --------------------------------------
# An autoencoder whose decoder reuses the encoder's weight has one parameter under two names,
# and ``named_parameters()`` lists it once, under the first name. ``functional_call`` follows
# the tie by default (``tie_weights=True``): a tensor passed for ``encoder.weight`` is used by
# the decoder too. With ``tie_weights=False`` the decoder silently keeps the module's own
# weight.


class TiedAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(3, 3, bias=False)
        self.decoder = nn.Linear(3, 3, bias=False)
        self.decoder.weight = self.encoder.weight  # one tensor, two names

    def forward(self, x):
        return self.decoder(self.encoder(x))


autoencoder = TiedAutoencoder().to(device)
print("parameters listed:", [name for name, _ in autoencoder.named_parameters()])
new_weight = torch.randn(3, 3, device=device)
tied = functional_call(autoencoder, {"encoder.weight": new_weight}, (samples,))
untied = functional_call(
    autoencoder, {"encoder.weight": new_weight}, (samples,), tie_weights=False
)
torch.testing.assert_close(tied, samples @ new_weight.T @ new_weight.T)
torch.testing.assert_close(
    untied, samples @ new_weight.T @ autoencoder.encoder.weight.detach().T
)
print("tie_weights=True uses the new weight twice; False mixes new and old")

# %%
# 8. Mean or sum: the loss reduction scales per-sample gradients
# ---------------------------------------------------------------
# A per-sample gradient is the gradient of one sample's loss. Tools that compute them from a
# *batch* loss must know how that loss was reduced: a mean divides every sample's contribution
# by B. Here ``vmap(grad)`` of one sample's loss is the reference, and the gradient of the
# batch-mean loss with respect to each sample's logits shows the factor directly.
logits = torch.randn(8, 5, device=device)
labels = torch.randint(0, 5, (8,), device=device)
per_sample = vmap(grad(lambda z, y: F.cross_entropy(z, y)))(logits, labels)
from_mean = torch.func.grad(lambda z: F.cross_entropy(z, labels))(logits)
from_sum = torch.func.grad(lambda z: F.cross_entropy(z, labels, reduction="sum"))(
    logits
)
torch.testing.assert_close(from_mean * len(logits), per_sample)
torch.testing.assert_close(from_sum, per_sample)
print(f"mean reduction: each sample's gradient is scaled by 1/B = 1/{len(logits)}")

# %%
# 9. Match gradients by parameter name, not by position
# -----------------------------------------------------
# ``grad`` of a function of a dictionary returns a dictionary in the same key order as its
# input. Build that dictionary in another order (sorted, or from a checkpoint) and pairing
# results with ``model.parameters()`` by position pairs the wrong tensors: here, where
# shapes happen to match, silently.
mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(device)
params = dict(sorted((name, p.detach()) for name, p in mlp.named_parameters()))
params = dict(reversed(list(params.items())))
x = torch.randn(4, device=device)
grads = grad(lambda p: functional_call(mlp, p, (x,)).square().sum())(params)
mlp.zero_grad()
mlp(x).square().sum().backward()
pairs_by_position = list(zip(grads.values(), mlp.parameters()))
mismatched = sum(
    g.shape != p.shape or not torch.allclose(g, p.grad) for g, p in pairs_by_position
)
print(f"pairing by position: {mismatched} of {len(pairs_by_position)} pairs are wrong")
assert mismatched > 0
for name, p in mlp.named_parameters():
    torch.testing.assert_close(grads[name], p.grad)
print("pairing by name: every gradient matches")

# %%
# 10. TF32: tolerances depend on a global setting
# -----------------------------------------------
# On NVIDIA GPUs since Ampere, PyTorch can run float32 matrix products in TF32, with a 10-bit
# mantissa, when ``torch.set_float32_matmul_precision("high")`` is set; cuDNN convolutions use
# it by default. A check with float32 tolerances then fails, or passes by luck. Measure the
# error against a float64 reference instead, and choose the bound knowing the setting. On a CPU
# the setting changes nothing here, as the printout shows.
a = torch.randn(512, 512, device=device)
b = torch.randn(512, 512, device=device)
exact = a.double() @ b.double()
errors = {}
for precision in ["highest", "high"]:
    torch.set_float32_matmul_precision(precision)
    errors[precision] = ((a @ b).double() - exact).norm().item() / exact.norm().item()
torch.set_float32_matmul_precision("highest")
for precision, error in errors.items():
    print(f"matmul precision {precision!r}: relative error {error:.1e} against float64")
assert errors["highest"] < 1e-5
if device.type == "cuda" and torch.cuda.get_device_capability()[0] >= 8:
    assert errors["high"] > 10 * errors["highest"]  # TF32 on Ampere and later

# %%
# 11. The slow-fallback warning
# -----------------------------
# When an operator has no batching rule, ``vmap`` still works: it runs the operator once per
# sample in a loop, and warns. :func:`torch.histc` is one such operator in this release. The
# loop costs most when there are many small samples.
counts_per_sample = torch.rand(2048, 64, device=device)  # many small samples
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fallback_hist = vmap(lambda v: torch.histc(v, bins=10, min=0, max=1))(
        counts_per_sample
    )
(warning,) = [w for w in caught if "performance drop" in str(w.message)]
print(f"{warning.category.__name__}:")
print(textwrap.fill(" ".join(str(warning.message).split()), width=88))
assert "aten::histc" in str(warning.message)

# %%
# The fix is to express the operation with operators that do have batching rules: here, the
# bin of each value, one-hot encoded and summed. It agrees exactly, and runs batched.


def histogram(v, bins=10):
    index = (v * bins).long().clamp(max=bins - 1)  # values in [0, 1)
    return F.one_hot(index, bins).sum(dim=0).to(v.dtype)


batched_hist = vmap(histogram)(counts_per_sample)
torch.testing.assert_close(batched_hist, fallback_hist)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="There is a performance drop")
    hist_ms = median_times_ms(
        {
            "loop": lambda: vmap(lambda v: torch.histc(v, bins=10, min=0, max=1))(
                counts_per_sample
            ),
            "vmap": lambda: vmap(histogram)(counts_per_sample),
        },
        min_run_time=0.2,
    )
print(
    f"fallback {hist_ms['loop']:.2f} ms, batched rewrite {hist_ms['vmap']:.2f} ms: "
    f"{hist_ms['loop'] / hist_ms['vmap']:.2f}x faster"
)

# %%
# 12. ``torch.compile`` around transforms
# ---------------------------------------
# With this release, ``torch.compile`` accepts a function built from ``vmap`` and ``grad``
# and compiles the whole composition: here the per-sample gradients of a small MLP. The first
# call compiles (timed on its own); after it, the compiled function must give the same result
# as the eager one. Compilation pays off only when the function is called many times, and each
# new input shape compiles again.
net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
net_params = {name: p.detach() for name, p in net.named_parameters()}
inputs = torch.randn(128, 64, device=device)
targets = torch.randint(0, 10, (128,), device=device)


def per_sample_grad_fn(module):
    def sample_loss(params, x, y):
        logits = functional_call(module, params, (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))


per_sample_grads = per_sample_grad_fn(net)
compiled_grads = torch.compile(per_sample_grads)
start = time.perf_counter()
compiled_result = compiled_grads(net_params, inputs, targets)
compile_s = time.perf_counter() - start
eager_result = per_sample_grads(net_params, inputs, targets)
for name in net_params:
    error = (compiled_result[name] - eager_result[name]).norm() / eager_result[
        name
    ].norm()
    assert error < 1e-5, f"{name}: compiled differs from eager by {error:.1e}"
compile_ms = median_times_ms(
    {
        "vmap": lambda: per_sample_grads(net_params, inputs, targets),
        "compiled": lambda: compiled_grads(net_params, inputs, targets),
    }
)
print(f"first call (compiling): {compile_s:.1f} s")
print(
    f"eager {compile_ms['vmap']:.2f} ms, compiled {compile_ms['compiled']:.2f} ms: "
    f"compiled is {compile_ms['vmap'] / compile_ms['compiled']:.2f}x faster"
)

# %%
# The figure shows the two timed fixes: the batched rewrite of a fallback operator, and
# compiling a transformed function.
fig, axes = plt.subplots(1, 2, figsize=(8, 2.8), layout="constrained")
axes[0].barh(
    ["histc under vmap\n(per-sample fallback)", "one_hot + sum\n(batched)"],
    [hist_ms["loop"], hist_ms["vmap"]],
    color=[METHOD_COLORS["loop"], METHOD_COLORS["vmap"]],
)
axes[0].set_xlabel("median time (ms)")
axes[0].set_title("11. slow fallback")
axes[1].barh(
    ["vmap(grad), eager", "torch.compile"],
    [compile_ms["vmap"], compile_ms["compiled"]],
    color=[METHOD_COLORS["vmap"], METHOD_COLORS["compiled"]],
)
axes[1].set_xlabel("median time (ms)")
axes[1].set_title("12. compiled transforms")
for ax in axes:
    ax.invert_yaxis()
plt.show()
