"""
Pitfalls: what goes wrong under ``torch.func``, and the fix
===========================================================

Code that runs fine on its own can stop working under ``vmap`` or ``grad``, or worse, keep
working and compute something else. This page runs twelve such cases, six of them reported in
PyTorch's or functorch's issue trackers (a section names its source where it has one): the
error, with its type and a stable part of its message checked, or the silently wrong result,
measured; then the fix, asserted against an independent reference. One fix is timed last.
"""

# %%
# Setup
# -----
# The mental model behind pitfalls 1-4: ``vmap(f)(x)`` equals stacking ``f(x_i)`` over
# ``x.unbind(0)``, but runs ``f``'s Python body *once*, on tensors that hide the batch axis.
import re
import textwrap
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.exc import RecompileError, Unsupported
from torch._dynamo.utils import counters
from torch.func import functional_call, functionalize, grad, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


# %%
# Two helpers
# -----------
# ``expect_error`` runs code that must raise exactly a given type with a given fragment in its
# message and prints it; ``under_vmap`` runs a layer on each sample alone, as a batch of one.
def expect_error(fn, error_type, fragment):
    try:
        fn()
    except error_type as error:
        assert type(error) is error_type, f"{type(error).__name__}: {error}"
        assert fragment in str(error), f"unexpected message: {error}"
        message = re.sub(r"\S*/(?:site-packages/|(?=plot_\w+\.py))", "", str(error))
        print(f"{type(error).__name__}:", textwrap.shorten(message, width=300))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


def under_vmap(layer, batch):
    return vmap(lambda x: layer(x.unsqueeze(0)).squeeze(0))(batch)


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
# (through a slower fallback for ``copy``, whose warning pitfall 10 explains).
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
# 2. ``.item()``, data-dependent control flow, and leaving torch
# --------------------------------------------------------------
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
by_cond = lambda x: torch.cond(x.sum() > 0, lambda t: t.clone(), lambda t: -t, (x,))  # noqa: E731
with_cond = vmap(by_cond)(samples)
torch.testing.assert_close(with_where, reference)
torch.testing.assert_close(with_cond, reference)
print("torch.where and torch.cond agree with a Python loop over samples")

# %%
# Leaving torch fails too: under ``vmap``, ``.tolist()`` or ``.numpy()`` finds no memory to read;
# under ``grad``, so does ``.detach().numpy()``, whatever the message suggests. Stay with torch,
# or give NumPy its own rules: :ref:`sphx_glr_auto_examples_guides_plot_extending_torch_func.py`.
expect_error(lambda: vmap(lambda x: x.tolist())(samples), RuntimeError, "storage")
on_cpu = samples[0].cpu()  # NumPy reads CPU memory: on a GPU, that error comes first
expect_error(lambda: grad(lambda x: x.numpy())(on_cpu), RuntimeError, "numpy()")
detached = lambda x: torch.as_tensor(x.detach().numpy()).sum() + x.sum()  # noqa: E731
expect_error(lambda: grad(detached)(on_cpu), RuntimeError, "doesn't have storage")

# %%
# 3. A reduction over "the batch axis" reduces something else
# -----------------------------------------------------------
# Inside ``vmap`` a sample has no batch axis, so ``x.mean(dim=0)`` averages the sample's own
# features. Nothing raises. The fix: compute batch statistics outside and pass them in with
# ``in_dims=None``.
centred_wrong = vmap(lambda x: x - x.mean(dim=0))(samples)
centred_loop = torch.stack([x - samples.mean(dim=0) for x in samples])
wrong_by = ((centred_wrong - centred_loop).norm() / centred_loop.norm()).item()
print(f"mean(dim=0) inside vmap: {wrong_by:.2f} relative difference from centring")
assert wrong_by > 0.1
centred = vmap(lambda x, m: x - m, in_dims=(0, None))(samples, samples.mean(dim=0))
torch.testing.assert_close(centred, centred_loop)

# %%
# 4. Python side effects run once
# -------------------------------
# A counter, a print or an append in a mapped function happens once for the whole batch;
# adding in place into a captured tensor (a running total) raises, as a batch does not fit one
# sample's shape. The fix: keep side effects out, return per-sample values, reduce outside.
calls = []
vmap(lambda x: calls.append(x.shape) or x * 2)(samples)
print(f"vmap over {len(samples)} samples ran the Python body {len(calls)} time(s)")
assert len(calls) == 1
total = torch.zeros(3, device=device)
expect_error(lambda: vmap(total.add_)(samples), RuntimeError, "broadcast shape")
positive = vmap(lambda x: (x.sum() > 0).int())(samples)
assert positive.tolist() == [int(x.sum() > 0) for x in samples]

# %%
# 5. Randomness
# -------------
# (torch.func's UX-limitations page.) ``vmap`` refuses random operations such as dropout by
# default: should each sample get its own draw, or share one? Say which with ``randomness=``.
dropout = lambda x: F.dropout(x, 0.5)  # noqa: E731
expect_error(lambda: vmap(dropout)(samples), RuntimeError, "randomness")
ones = torch.ones(64, 16, device=device)  # a mask drops to 0 or scales by 1/(1-p) = 2
different = vmap(lambda x: F.dropout(x, 0.5), randomness="different")(ones)
same = vmap(lambda x: F.dropout(x, 0.5), randomness="same")(ones)
assert {0.0, 2.0} == set(different.unique().tolist()) == set(same.unique().tolist())
assert (same == same[0]).all() and not (different == different[0]).all()
print("randomness='same': one mask for all samples; 'different': a mask per sample")

# %%
# 6. BatchNorm: what each remedy computes
# ---------------------------------------
# (functorch#115.) Training-mode batch norm normalises with statistics of the whole batch, and
# updates its running statistics in place. Under ``vmap`` over single samples it refuses.
images = torch.randn(8, 3, 5, 5, device=device)
batch_norm = nn.BatchNorm2d(3).to(device)
expect_error(lambda: under_vmap(batch_norm, images), RuntimeError, "running_mean")

# %%
# **eval()** uses the running statistics, which do not depend on the batch: per-sample and
# batched results agree. **GroupNorm** normalises each sample on its own by design: the same.
batch_norm.eval()
group_norm = nn.GroupNorm(num_groups=1, num_channels=3).to(device)
for layer in (batch_norm, group_norm):
    torch.testing.assert_close(under_vmap(layer, images), layer(images))


# %%
# :func:`~torch.func.replace_all_batch_norm_modules_` (or ``track_running_stats=False``) lets
# training mode run, but each call now sees *one* sample, which is normalised by its own
# statistics per channel: instance normalisation, a different model. The reference normalises
# each sample and channel by hand. ``BatchNorm1d`` on (N, C) features refuses, since one sample
# has one value per channel; on (N, C, L) sequences it runs, and it too silently becomes
# instance normalisation.
def normalise_each_sample(t, eps=1e-5):
    axes = tuple(range(2, t.dim()))
    mean = t.mean(axes, keepdim=True)
    return (t - mean) / (t.var(axes, unbiased=False, keepdim=True) + eps).sqrt()


sequences = torch.randn(8, 3, 7, device=device)
for layer, batch in [(nn.BatchNorm2d(3), images), (nn.BatchNorm1d(3), sequences)]:
    torch.func.replace_all_batch_norm_modules_(layer.to(device))
    per_sample = under_vmap(layer, batch)
    torch.testing.assert_close(per_sample, normalise_each_sample(batch))
    batch_mode = layer(batch)  # the same layer, given the whole batch
    differs = ((per_sample - batch_mode).norm() / batch_mode.norm()).item()
    name = f"{type(layer).__name__} {tuple(batch.shape[1:])}"
    print(f"{name}: per-sample vs batch mode, relative difference {differs:.2f}")
    assert differs > 0.05
expect_error(lambda: under_vmap(layer, samples), ValueError, "more than 1 value")


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
swap = {"encoder.weight": new_weight}
tied = functional_call(autoencoder, swap, (samples,))
untied = functional_call(autoencoder, swap, (samples,), tie_weights=False)
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
# ``grad`` of a function of a dictionary returns a dictionary in the key order of its input.
# Pairing it with ``model.parameters()`` by position is right only while both follow one order,
# as when the dictionary comes straight from ``named_parameters()``. Built in another order,
# it pairs the wrong tensors: here, where shapes match, silently. The reference is ordinary
# ``backward()``.
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
# 10. Operators without a batching rule: a slow loop, or an error
# ---------------------------------------------------------------
# (functorch#328, pytorch#105220.) An operator without a batching rule still runs under
# ``vmap``, once per sample in a loop, with a warning (its ``out=`` form and view operators
# raise instead). :func:`torch.histc` is one in this release. The fix: operators with batching
# rules, here each value's bin index counted with ``scatter_add``. The reference is ``histc``
# on each sample in a Python loop.
counts = torch.rand(2048, 64, device=device)  # many small samples


def histc_per_sample(v):
    return torch.histc(v, bins=10, min=0, max=1)


def histogram(v, bins=10):
    index = (v * bins).long().clamp(max=bins - 1)  # values in [0, 1)
    return v.new_zeros(bins).scatter_add(0, index, torch.ones_like(v))


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fallback_hist = vmap(histc_per_sample)(counts)
    batched_hist = vmap(histogram)(counts)
(warning,) = [w for w in caught if "performance drop" in str(w.message)]
assert warning.category is UserWarning and "aten::histc" in str(warning.message)
print(f"UserWarning: {textwrap.shorten(str(warning.message), width=300)}")
loop_hist = torch.stack([histc_per_sample(v) for v in counts])
torch.testing.assert_close(fallback_hist, loop_hist)
torch.testing.assert_close(batched_hist, loop_hist)
histc_out = vmap(lambda v: torch.histc(v, 10, 0, 1, out=v.new_empty(10)))
expect_error(lambda: histc_out(counts), RuntimeError, "out= or view ops")

# %%
# Operators whose output shape depends on the values (indexing with a boolean mask,
# ``nonzero``, ``unique``) have no such loop: ``vmap`` raises. Keep the shape fixed (with
# ``torch.where``, a clamp, a mask multiplied in); here, each sample's sum of positive entries.
expect_error(lambda: vmap(lambda x: x[x > 0].sum())(samples), RuntimeError, "shape")
positive_sums = torch.stack([x[x > 0].sum() for x in samples])
torch.testing.assert_close(vmap(lambda x: x.clamp(min=0).sum())(samples), positive_sums)


# %%
# 11. ``torch.no_grad`` inside the function, and around ``grad``
# --------------------------------------------------------------
# (torch.func's UX-limitations page.) ``grad`` respects ``no_grad`` inside the function (what
# it computes is a constant) and ignores it around the call. The references, by hand: the
# gradient of ``Σ x·sin(x)`` is ``sin(x) + x·cos(x)``; with ``sin(x)`` held constant, ``sin(x)``.
def sine_held(x):
    with torch.no_grad():
        sine = x.sin()
    return (x * sine).sum()


point = samples[0]
torch.testing.assert_close(grad(sine_held)(point), point.sin())
with torch.no_grad():
    around = grad(lambda x: (x * x.sin()).sum())(point)
torch.testing.assert_close(around, point.sin() + point * point.cos())

# %%
# 12. ``torch.compile`` and the transforms: the nesting, and new shapes
# ---------------------------------------------------------------------
# (pytorch#114306, pytorch#128711.) Compile *around* the transforms. The other nesting, a
# compiled function called inside ``grad`` or ``vmap``, gives the right numbers but is not
# compiled: dynamo gives up on it and runs it eagerly, saying so only in its counters, unless
# ``fullgraph=True`` turns the fallback into an error.
counters.clear()  # they last as long as the process: count from here
cube_sum = torch.compile(lambda x: x.pow(3).sum())
torch.testing.assert_close(vmap(grad(cube_sum))(samples), 3 * samples**2)
(reason,) = counters["unimplemented"]
assert counters["stats"]["unique_graphs"] == 0 and "functorch" in reason
print(f"compiled inside vmap(grad): no graph; dynamo: {reason.splitlines()[0]}")
strict = torch.compile(lambda x: x.pow(3).sum(), fullgraph=True)
expect_error(lambda: vmap(grad(strict))(samples), Unsupported, "functorch tracing")

# %%
# Around them, ``torch.compile`` compiles the whole composition (per-sample gradients of an
# MLP) into one graph with no graph break. The reference: one ``autograd.grad`` per sample. The
# model comes in a closure: in this site's one-process build, a compiled function reading it as
# a module global failed dynamo's guard building.
net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
net_params = {name: p.detach() for name, p in net.named_parameters()}
inputs = torch.randn(64, 64, device=device)
targets = torch.randint(0, 10, (64,), device=device)


def loss_of_one_sample(model):
    def sample_loss(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    return sample_loss


per_sample_grads = vmap(grad(loss_of_one_sample(net)), in_dims=(None, 0, 0))
compiled_grads = torch.compile(per_sample_grads)
start = time.perf_counter()
compiled_result = compiled_grads(net_params, inputs, targets)
print(f"first call (compiling), measured once: {time.perf_counter() - start:.1f} s")
assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
assert counters["unimplemented"] == {reason: 2}, "dynamo gave up on something else"
loop_grads = [
    torch.autograd.grad(F.cross_entropy(net(x[None]), y[None]), net.parameters())
    for x, y in zip(inputs, targets)
]
for i, (name, result) in enumerate(compiled_result.items()):
    reference = torch.stack([g[i] for g in loop_grads])
    error = ((result - reference).norm() / reference.norm()).item()
    print(f"{name}: compiled against the loop, relative error {error:.1e} (bound 2e-6)")
    assert error < 2e-6, name

# %%
# A short last batch fails the graph's guards and dynamo compiles again (``error_on_recompile``
# shows it without the cost); past ``recompile_limit`` it runs new shapes eagerly. This loss
# pins the batch size (probably its class-index targets, as the at-the-limit page finds), so
# ``dynamic=True`` does not help. Padding avoids both: each sample's gradient is its own.
short_inputs, short_targets = inputs[:32], targets[:32]
dynamic_grads = torch.compile(lambda p, x, y: per_sample_grads(p, x, y), dynamic=True)
dynamic_grads(net_params, inputs, targets)  # a frame of its own, compiled at 64
with torch._dynamo.config.patch(error_on_recompile=True):
    for compiled in compiled_grads, dynamic_grads:
        expect_error(
            lambda: compiled(net_params, short_inputs, short_targets),  # noqa: B023
            RecompileError,
            "size mismatch at index 0. expected 64, actual 32",
        )
    padded = compiled_grads(
        net_params,
        torch.cat([short_inputs, short_inputs.new_zeros(32, 64)]),
        torch.cat([short_targets, short_targets.new_zeros(32)]),
    )
for name in padded:
    torch.testing.assert_close(padded[name][:32], compiled_result[name][:32])
limit = torch._dynamo.config.recompile_limit
print(f"padded to 64: no recompilation, same gradients; recompile_limit is {limit}")

# %%
# Timing the fallback loop against the rewrite
# --------------------------------------------
# Pitfall 10's fallback loop against the batched rewrite, by :class:`torch.utils.benchmark.Timer`
# on all threads after a warm-up: median, interquartile range (IQR) and blocks measured.
hist_times, threads = {}, torch.get_num_threads()
for method, fn in [("loop", vmap(histc_per_sample)), ("vmap", vmap(histogram))]:
    with warnings.catch_warnings(action="ignore", category=UserWarning):
        fn(counts)  # a warm-up
        timer = benchmark.Timer("fn(counts)", globals=globals(), num_threads=threads)
        m = hist_times[method] = timer.blocked_autorange(min_run_time=0.5)
    n = len(m.times)
    spread = f"IQR {m.iqr * 1e3:.2g} ms, {n} blocks" if n > 1 else "measured once"
    print(f"histogram, {method}: {m.median * 1e3:.3g} ms on {device.type} ({spread})")
ratio = hist_times["vmap"].median / hist_times["loop"].median
words = "takes {:.2f}x the time of" if ratio >= 1 else "is {:.2f}x faster than"
print("the batched histogram", words.format(max(ratio, 1 / ratio)), "the fallback loop")
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73"}
fig, ax = plt.subplots(figsize=(6, 1.8), layout="constrained")
medians = [m.median * 1e3 for m in hist_times.values()]
ax.barh(["loop (histc)", "scatter_add"], medians, color=list(METHOD_COLORS.values()))
ax.set(xlabel=f"median ms, {device.type}", title=f"{len(counts)} histograms, vmap")
plt.show()

# %%
# What to remember
# ----------------
# * Make new tensors from the input (``x.new_zeros``), choose per sample with ``torch.where``,
#   and compute batch statistics outside ``vmap``.
# * Say ``randomness=`` under ``vmap``; BatchNorm under ``vmap`` is eval mode, GroupNorm, or
#   instance normalisation in disguise.
# * Match gradients to parameters by name, and mind the loss reduction: a mean scales each
#   per-sample gradient by 1/B.
# * A performance-drop warning names an operator that ``vmap`` runs in a loop: rewrite it with
#   batched operators, and time the rewrite against the loop.
# * Compile around the transforms, not inside them; pad a short batch if its size recompiles.
