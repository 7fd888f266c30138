"""
Pitfalls: what goes wrong under ``torch.func``, and the fix
===========================================================

Code that runs fine on its own can stop working under ``vmap`` or ``grad``, or worse, keep
working and compute something else. This page runs twelve such cases, most of them reported in
PyTorch's or functorch's issue trackers (a section names its source where it has one): the
error, with its type and a stable part of its message checked, or the silently wrong result,
measured; then the fix, asserted against an independent reference. Two fixes are timed last.
"""

# %%
# Setup
# -----
# The mental model behind pitfalls 1-4: ``vmap(f)(x)`` equals stacking ``f(x_i)`` over
# ``x.unbind(0)``, but runs ``f``'s Python body *once*, on tensors that hide the batch axis.
import textwrap
import time
import warnings

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
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# Two helpers
# -----------
# ``expect_error`` runs code that must raise exactly a given type with a given fragment in its
# message, and prints it. ``timed`` is :class:`torch.utils.benchmark.Timer`'s autorange.


def expect_error(fn, error_type, fragment):
    try:
        fn()
    except error_type as error:
        assert type(error) is error_type, f"{type(error).__name__}: {error}"
        assert fragment in str(error), f"unexpected message: {error}"
        print(f"{type(error).__name__}:", textwrap.shorten(str(error), width=300))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


def timed(fn):
    threads = torch.get_num_threads()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=0.3)


samples = torch.randn(4, 3, device=device)

# %%
# 1. In-place writes into a tensor made inside the function
# ---------------------------------------------------------
# (pytorch#103329, pytorch#97248.) Under ``vmap``, ``x.shape`` is one sample's shape, so
# ``torch.zeros(x.shape)`` is *one* unbatched tensor, and writing the batched ``2 * x`` into it
# cannot work.


def copy_into_zeros(x):
    out = torch.zeros(x.shape, device=x.device)
    out.copy_(2 * x)
    return out


expect_error(lambda: vmap(copy_into_zeros)(samples), RuntimeError, "inplace arithmetic")

# %%
# Fixes: ``x.new_zeros(...)`` is batched like ``x``; out-of-place code has no problem; and
# :func:`~torch.func.functionalize` rewrites the in-place operations so the original code runs
# (through a slower fallback for ``copy``, whose warning pitfall 11 explains).


def copy_into_new_zeros(x):
    out = x.new_zeros(x.shape)
    out.copy_(2 * x)
    return out


torch.testing.assert_close(vmap(copy_into_new_zeros)(samples), 2 * samples)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="There is a performance drop")
    functional_result = vmap(functionalize(copy_into_zeros))(samples)
torch.testing.assert_close(functional_result, 2 * samples)
print("new_zeros and functionalize give 2·x for every sample")

# %%
# 2. ``.item()`` and data-dependent control flow
# ----------------------------------------------
# (functorch#257.) ``if tensor:`` and ``.item()`` need one number, but under ``vmap`` a tensor
# holds one per sample.
expect_error(
    lambda: vmap(lambda x: x if x.sum() > 0 else -x)(samples),
    RuntimeError,
    "data-dependent control flow",
)
expect_error(lambda: vmap(lambda x: x.sum().item())(samples), RuntimeError, ".item()")

# %%
# Fixes choose per sample: :func:`torch.where` computes both branches and picks element by
# element; :func:`torch.cond` takes the branches as functions (under ``vmap`` it too runs both;
# a branch may not return its input as is, hence ``clone``). The reference is a Python loop.
reference = torch.stack([x if x.sum() > 0 else -x for x in samples])
with_where = vmap(lambda x: torch.where(x.sum() > 0, x, -x))(samples)
with_cond = vmap(
    lambda x: torch.cond(x.sum() > 0, lambda t: t.clone(), lambda t: -t, (x,))
)(samples)
torch.testing.assert_close(with_where, reference)
torch.testing.assert_close(with_cond, reference)
print("torch.where and torch.cond agree with a Python loop over samples")

# %%
# 3. A reduction over "the batch axis" reduces something else
# -----------------------------------------------------------
# Inside ``vmap`` a sample has no batch axis, so ``x.mean(dim=0)`` averages the sample's own
# features. Nothing raises. The fix: compute batch statistics outside and pass them in with
# ``in_dims=None``.
centred_wrong = vmap(lambda x: x - x.mean(dim=0))(samples)
centred_loop = torch.stack([x - samples.mean(dim=0) for x in samples])
wrong_by = ((centred_wrong - centred_loop).norm() / centred_loop.norm()).item()
print(
    f"mean(dim=0) inside vmap: relative difference {wrong_by:.2f} from centring the batch"
)
assert wrong_by > 0.1
batch_mean = samples.mean(dim=0)
centred = vmap(lambda x, m: x - m, in_dims=(0, None))(samples, batch_mean)
torch.testing.assert_close(centred, centred_loop)

# %%
# 4. Python side effects run once
# -------------------------------
# A counter, a print or an append in a mapped function happens once for the whole batch. The
# fix: keep side effects out, and return per-sample values instead.
calls = []
vmap(lambda x: calls.append(x.shape) or x * 2)(samples)
print(f"vmap over {len(samples)} samples ran the Python body {len(calls)} time(s)")
assert len(calls) == 1
positive = vmap(lambda x: (x.sum() > 0).int())(samples)
assert positive.tolist() == [int(x.sum() > 0) for x in samples]

# %%
# 5. Randomness
# -------------
# (torch.func's UX-limitations page.) ``vmap`` refuses random operations such as dropout by
# default: should each sample get its own draw, or share one? Say which with ``randomness=``.
expect_error(
    lambda: vmap(lambda x: F.dropout(x, 0.5))(samples), RuntimeError, "randomness"
)
ones = torch.ones(64, 16, device=device)
different = vmap(lambda x: F.dropout(x, 0.5), randomness="different")(ones)
same = vmap(lambda x: F.dropout(x, 0.5), randomness="same")(ones)
assert set(different.unique().tolist()) == {0.0, 2.0}  # dropped, or scaled by 1/(1-p)
assert (same == same[0]).all() and not (different == different[0]).all()
print("randomness='same': one mask for all samples; 'different': a mask per sample")

# %%
# 6. BatchNorm: what each remedy computes
# ---------------------------------------
# (functorch#115.) Training-mode batch norm normalises with statistics of the whole batch, and
# updates its running statistics in place. Under ``vmap`` over single samples it refuses.
images = torch.randn(8, 3, 5, 5, device=device)
batch_norm = nn.BatchNorm2d(3).to(device)
expect_error(
    lambda: vmap(lambda x: batch_norm(x.unsqueeze(0)))(images),
    RuntimeError,
    "running_mean or running_var",
)

# %%
# **eval()** uses the running statistics, which do not depend on the batch: per-sample and
# batched results agree. **GroupNorm** normalises each sample on its own by design: the same.
batch_norm.eval()
per_sample_eval = vmap(lambda x: batch_norm(x.unsqueeze(0)).squeeze(0))(images)
torch.testing.assert_close(per_sample_eval, batch_norm(images))
group_norm = nn.GroupNorm(num_groups=1, num_channels=3).to(device)
per_sample_group = vmap(lambda x: group_norm(x.unsqueeze(0)).squeeze(0))(images)
torch.testing.assert_close(per_sample_group, group_norm(images))

# %%
# :func:`~torch.func.replace_all_batch_norm_modules_` (or ``track_running_stats=False``) lets
# training mode run, but each call now sees *one* sample, which is normalised by its own
# statistics per channel: instance normalisation, a different model. The reference normalises
# each sample and channel by hand. ``BatchNorm1d`` on (N, C) features refuses, since one sample
# has one value per channel; on (N, C, L) sequences it runs, and it too silently becomes
# instance normalisation.


def normalise_each_sample(t, eps=1e-5):
    """Each sample and channel by its own mean and (biased) variance."""
    axes = tuple(range(2, t.dim()))
    mean = t.mean(axes, keepdim=True)
    return (t - mean) / (t.var(axes, unbiased=False, keepdim=True) + eps).sqrt()


def under_vmap(layer, batch):
    return vmap(lambda x: layer(x.unsqueeze(0)).squeeze(0))(batch)


sequences = torch.randn(8, 3, 7, device=device)
for layer, batch in [(nn.BatchNorm2d(3), images), (nn.BatchNorm1d(3), sequences)]:
    replace_all_batch_norm_modules_(layer.to(device))
    per_sample = under_vmap(layer, batch)
    torch.testing.assert_close(per_sample, normalise_each_sample(batch))
    batch_mode = layer(batch)  # the same layer, given the whole batch
    differs = ((per_sample - batch_mode).norm() / batch_mode.norm()).item()
    name = f"{type(layer).__name__} {tuple(batch.shape[1:])}"
    print(f"{name}: per-sample vs batch mode, relative difference {differs:.2f}")
    assert differs > 0.05
# ``layer`` is now the BatchNorm1d; on (N, C) features a sample has one value per channel.
expect_error(
    lambda: under_vmap(layer, samples),
    ValueError,
    "Expected more than 1 value per channel",
)

# %%
# 7. Tied weights in ``functional_call``
# --------------------------------------
# (pytorch#86708.) A decoder that reuses the encoder's weight has one parameter under two
# names; ``named_parameters()`` lists it once. ``functional_call`` follows the tie by default:
# a tensor passed for ``encoder.weight`` is used by the decoder too. With ``tie_weights=False``
# the decoder silently keeps the module's own weight.


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
old_weight = autoencoder.encoder.weight.detach()
tied = functional_call(autoencoder, {"encoder.weight": new_weight}, (samples,))
untied = functional_call(
    autoencoder, {"encoder.weight": new_weight}, (samples,), tie_weights=False
)
torch.testing.assert_close(tied, samples @ new_weight.T @ new_weight.T)
torch.testing.assert_close(untied, samples @ new_weight.T @ old_weight.T)

# %%
# 8. Mean or sum: the loss reduction scales per-sample gradients
# --------------------------------------------------------------
# A per-sample gradient is the gradient of one sample's loss. Derived from a batch loss, it
# depends on the reduction: a mean divides each sample's share by B. The reference is the
# closed form of cross-entropy's gradient with respect to the logits, ``softmax(z) − onehot(y)``.
logits = torch.randn(8, 5, device=device)
labels = torch.randint(0, 5, (8,), device=device)
closed_form = logits.softmax(dim=1) - F.one_hot(labels, 5).to(logits.dtype)
per_sample = vmap(grad(F.cross_entropy))(logits, labels)
from_mean = grad(lambda z: F.cross_entropy(z, labels))(logits)
from_sum = grad(lambda z: F.cross_entropy(z, labels, reduction="sum"))(logits)
torch.testing.assert_close(per_sample, closed_form)
torch.testing.assert_close(from_sum, closed_form)
torch.testing.assert_close(from_mean, closed_form / len(logits))
print(f"mean reduction: each sample's gradient scaled by 1/B = 1/{len(logits)}")

# %%
# 9. Match gradients by parameter name, not by position
# -----------------------------------------------------
# (pytorch/tutorials#3460 fixed exactly this.) ``grad`` of a function of a dictionary returns
# a dictionary in the key order of its input. Built in another order, pairing it with
# ``model.parameters()`` by position pairs the wrong tensors: here, where shapes match,
# silently. The reference is ordinary ``backward()``.
mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(device)
params = dict(sorted((name, p.detach()) for name, p in mlp.named_parameters()))
params = dict(reversed(params.items()))
x = torch.randn(4, device=device)
grads = grad(lambda p: functional_call(mlp, p, (x,)).square().sum())(params)
mlp(x).square().sum().backward()
pairs = list(zip(grads.values(), mlp.parameters()))
mismatched = sum(g.shape != p.shape or not torch.allclose(g, p.grad) for g, p in pairs)
print(f"pairing by position: {mismatched} of {len(pairs)} pairs are wrong")
assert mismatched > 0
for name, p in mlp.named_parameters():
    torch.testing.assert_close(grads[name], p.grad)

# %%
# 10. TF32: tolerances depend on a global setting
# -----------------------------------------------
# (PyTorch's per-sample-gradients tutorial needed ``atol=3e-3`` on GPUs.) On NVIDIA GPUs since
# Ampere, ``torch.set_float32_matmul_precision("high")`` runs float32 matrix products in TF32,
# with a 10-bit mantissa; cuDNN convolutions do by default. Measure the error against float64
# and pick the bound knowing the setting. On a CPU the setting changes nothing here.
a, b = torch.randn(2, 512, 512, device=device)
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
# (functorch#328, pytorch#105220.) An operator without a batching rule still runs under
# ``vmap``: once per sample, in a loop, with a warning. :func:`torch.histc` is one in this
# release. The fix is to use operators that have batching rules: here each value's bin,
# one-hot encoded and summed. The reference is ``histc`` on each sample in a Python loop.
counts = torch.rand(2048, 64, device=device)  # many small samples


def histc_per_sample(v):
    return torch.histc(v, bins=10, min=0, max=1)


def histogram(v, bins=10):
    index = (v * bins).long().clamp(max=bins - 1)  # values in [0, 1)
    return F.one_hot(index, bins).sum(dim=0).to(v.dtype)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fallback_hist = vmap(histc_per_sample)(counts)
(warning,) = [w for w in caught if "performance drop" in str(w.message)]
assert warning.category is UserWarning and "aten::histc" in str(warning.message)
print(
    f"{warning.category.__name__}:", textwrap.shorten(str(warning.message), width=300)
)
loop_hist = torch.stack([histc_per_sample(v) for v in counts])
torch.testing.assert_close(fallback_hist, loop_hist)
torch.testing.assert_close(vmap(histogram)(counts), loop_hist)

# %%
# 12. ``torch.compile`` around transforms
# ---------------------------------------
# (pytorch#114306, pytorch#138422.) In this release ``torch.compile`` accepts a function built
# from ``vmap`` and ``grad`` and compiles the whole composition, here the per-sample gradients
# of a small MLP. Each new input shape compiles again, so it pays only for repeated calls.
# The reference is one ordinary ``autograd.grad`` per sample.
net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
net_params = {name: p.detach() for name, p in net.named_parameters()}
inputs = torch.randn(64, 64, device=device)
targets = torch.randint(0, 10, (64,), device=device)


def sample_loss_of(module):
    # The module reaches the loss through a closure: compiled code guards on it there.
    def sample_loss(params, x, y):
        logits = functional_call(module, params, (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    return sample_loss


per_sample_grads = vmap(grad(sample_loss_of(net)), in_dims=(None, 0, 0))
compiled_grads = torch.compile(per_sample_grads)
start = time.perf_counter()
compiled_result = compiled_grads(net_params, inputs, targets)
print(f"first call (compiling), measured once: {time.perf_counter() - start:.1f} s")
loop_grads = [
    torch.autograd.grad(F.cross_entropy(net(x[None]), y[None]), net.parameters())
    for x, y in zip(inputs, targets)
]
compile_errors = {}
for i, name in enumerate(net_params):
    reference = torch.stack([g[i] for g in loop_grads])
    error = ((compiled_result[name] - reference).norm() / reference.norm()).item()
    assert error < 2e-6, f"{name}: compiled differs from the loop by {error:.1e}"
    compile_errors[name] = error
print(f"compiled matches the loop, largest error {max(compile_errors.values()):.1e}")

# %%
# How much do the two fixes save?
# -------------------------------
# Both are timed with :class:`torch.utils.benchmark.Timer`: the fallback loop against the
# batched rewrite, and eager ``vmap(grad)`` against the compiled function (already compiled
# above, so its timing excludes compilation).
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="There is a performance drop")
    hist_times = {
        "loop": timed(lambda: vmap(histc_per_sample)(counts)),
        "vmap": timed(lambda: vmap(histogram)(counts)),
    }
grad_times = {
    "vmap": timed(lambda: per_sample_grads(net_params, inputs, targets)),
    "compiled": timed(lambda: compiled_grads(net_params, inputs, targets)),
}
for what, times in [("histogram", hist_times), ("per-sample grads", grad_times)]:
    for method, m in times.items():
        print(f"{what}, {method}: {m.median * 1e3:.2f} ms (IQR {m.iqr * 1e3:.2f} ms)")
print(
    f"batched histogram: {hist_times['loop'].median / hist_times['vmap'].median:.2f}x"
)
print(f"compiled: {grad_times['vmap'].median / grad_times['compiled'].median:.2f}x")

METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73", "compiled": "#117733"}
fig, axes = plt.subplots(1, 2, figsize=(8, 2.8), layout="constrained")
for ax, times, title, labels in [
    (axes[0], hist_times, "11. slow fallback", ["loop (histc)", "vmap (one_hot)"]),
    (axes[1], grad_times, "12. compiled transforms", ["vmap (eager)", "compiled"]),
]:
    medians = [m.median * 1e3 for m in times.values()]
    ax.barh(labels, medians, color=[METHOD_COLORS[method] for method in times])
    ax.set_xlabel("median time (ms)")
    ax.set_title(title)
    ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# * Make new tensors from the input (``x.new_zeros``), choose per sample with ``torch.where``,
#   and compute batch statistics outside ``vmap``.
# * Say ``randomness=`` under ``vmap``; BatchNorm under ``vmap`` is eval mode, GroupNorm, or
#   instance normalisation in disguise, for images and sequences alike.
# * Match gradients to parameters by name, and mind the loss reduction: a mean scales each
#   per-sample gradient by 1/B.
# * A slow-fallback warning names the operator to rewrite with batched operators.
