"""
Troubleshooting, part 16: LSTM weights and forward mode, one_hot, a mask written in place
=========================================================================================

Reports users still find when they search an error, re-run on torch 2.13: an ``nn.LSTM`` under
``functional_call`` that silently used its own weights (pytorch#90500); "Trying to use forward AD
with mkldnn_rnn_layer" from ``jacfwd`` of an LSTM (pytorch#103161); "Cannot call numel()" from
``F.one_hot`` in a compiled ``jacfwd`` (pytorch#160752), and ``F.one_hot`` under ``vmap(grad)``,
which 2.13 still refuses; "inplace arithmetic" from a mask written in place in library code
(posteriors#103). Each: what 2.13 does, against a float64 or closed-form reference or a loop; the
fix, checked where 2.13 runs it; where one helps, a test for your release. Part 1:
:doc:`plot_troubleshooting`.
"""

import copy
import textwrap
import warnings
from unittest import TestCase

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import functional_call, functionalize, grad, jacfwd, jacrev, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cpu = torch.device("cpu")  # sections 1, 2 and 4: their errors are the CPU's
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
measured = {}  # label: (error, bound), for the figure at the end


def gap_to(label, got, want, bound):
    """Asserts got matches want (shape, then largest gap / largest entry); prints both."""
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)}, {want.shape}"
    scale = want.abs().max().clamp_min(1e-300)
    gap = ((got.double() - want.double()).abs().max() / scale).item()
    assert gap <= bound, f"{label}: {gap:.1e} > {bound:.0e}"
    return gap


def each_tensor(label, got, want, bound):
    """gap_to for each named tensor; the largest gap is printed and kept for the figure."""
    assert got.keys() == want.keys(), f"{label}: {sorted(got)} vs {sorted(want)}"
    gaps = {n: gap_to(f"{label}, {n}", got[n], want[n], bound) for n in want}
    worst = max(gaps, key=gaps.get)
    print(f"  {label}: largest error {gaps[worst]:.1e} ({worst}; bound {bound:.0e})")
    measured[label] = gaps[worst], bound


# %%
# (No error) an LSTM under functional_call used its own weights, not yours: fixed
# -------------------------------------------------------------------------------
# pytorch#90500 (2022, silent): gradients with respect to the dict passed to ``functional_call``
# came out wrong for an ``nn.LSTM``. The thread's account: the LSTM computed with
# ``self._flat_weights``, a list of its own weights, not the names ``functional_call`` swaps; PR
# #91111 rebuilds the list in ``forward`` when the parameters are other tensors (which release
# first had it, the thread does not say). On 2.13: a dict far from the module's own, by
# ``torch.autograd.grad`` and ``torch.func.grad``, against the network by hand in float64.
class Encoder(nn.Module):  # the report's: linear, LSTM, linear on the last step
    def __init__(self, features=4, hidden=3):
        super().__init__()
        self.embed = nn.Linear(features, features)
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, steps):
        states, _ = self.lstm(self.embed(steps))
        return self.head(states[:, -1])


encoder, sequences = Encoder().to(cpu), torch.randn(3, 5, 4)  # float32, as reported
yours = {name: (p.detach() + 0.5 * torch.randn_like(p)).requires_grad_()
         for name, p in encoder.named_parameters()}  # fmt: skip


def loss_through(module, params):
    return functional_call(module, params, (sequences,)).square().sum()


by_autograd = torch.autograd.grad(loss_through(encoder, yours), list(yours.values()))
by_func_grad = grad(lambda p: loss_through(encoder, p))(yours)


def encoder_by_hand(p, x):
    """The same network in tensor algebra; an LSTM's four gates come in the order i, f, g, o."""
    embedded = x @ p["embed.weight"].T + p["embed.bias"]
    h = c = x.new_zeros(x.shape[0], p["lstm.weight_hh_l0"].shape[1])
    for t in range(x.shape[1]):
        gates = embedded[:, t] @ p["lstm.weight_ih_l0"].T + p["lstm.bias_ih_l0"]
        gates = gates + h @ p["lstm.weight_hh_l0"].T + p["lstm.bias_hh_l0"]
        i, f, g, o = gates.chunk(4, dim=1)
        c = f.sigmoid() * c + i.sigmoid() * g.tanh()
        h = o.sigmoid() * c.tanh()
    return h @ p["head.weight"].T + p["head.bias"]


in_float64 = {name: p.detach().double().requires_grad_() for name, p in yours.items()}
exact = encoder_by_hand(in_float64, sequences.double()).square().sum()
wanted = dict(zip(yours, torch.autograd.grad(exact, list(in_float64.values()))))
by_autograd = dict(zip(yours, by_autograd))
each_tensor("functional_call + autograd.grad", by_autograd, wanted, 2e-6)
each_tensor("functional_call + func.grad", by_func_grad, wanted, 2e-6)

# %%
# The test for your release, without writing the network by hand: a copy of the module that
# *loaded* your dict (``load_state_dict`` copies into the module's own tensors, which the list
# holds) and ``backward()`` give the gradients with no ``functional_call`` involved. Before
# torch 2.0 (no ``torch.func``): ``torch.nn.utils.stateless.functional_call`` and
# ``torch.autograd.grad``, the first route above, compared the same way.
loaded = copy.deepcopy(encoder)
loaded.load_state_dict({name: p.detach() for name, p in yours.items()})
loaded(sequences).square().sum().backward()
from_loaded = {name: p.grad for name, p in loaded.named_parameters()}
each_tensor("your release: func.grad vs loaded", by_func_grad, from_loaded, 1e-6)
each_tensor("your release: autograd.grad vs loaded", by_autograd, from_loaded, 1e-6)

# %%
# What the bug looks like, and that the test sees it. In 2.13 the LSTM's ``forward`` calls
# ``_update_flat_weights``, which rebuilds the list when its weights are other tensors
# (``_weights_have_changed``, in ``torch/nn/modules/rnn.py``). Made to do nothing, for this block
# only, it leaves the list stale: the LSTM computes with its own weights, ``func.grad`` gives
# zeros for the LSTM's weights and off values for the rest, and ``autograd.grad`` (the route
# before 2.0) raises, as the LSTM's weights are not in the graph.
rebuild = nn.RNNBase._update_flat_weights
nn.RNNBase._update_flat_weights = lambda self: None
try:
    stale = grad(lambda p: loss_through(encoder, p))(yours)
    loss = loss_through(encoder, yours)
    TestCase().assertRaisesRegex(RuntimeError, "appears to not have been used in the graph",
                                 torch.autograd.grad, loss, list(yours.values()))  # fmt: skip
finally:
    nn.RNNBase._update_flat_weights = rebuild
zeros = [name for name, g in stale.items() if not g.any()]
off = {n: gap_to(f"stale, {n}", stale[n], from_loaded[n], float("inf")) for n in stale}
rest = min(gap for n, gap in off.items() if n not in zeros)
print(f"  stale list: zero gradients for {zeros}; the others off by {rest:.2f} or more")
assert zeros == [n for n in stale if n.startswith("lstm.")] and rest > 0.05, off
print("  autograd.grad: RuntimeError: ... appears to not have been used in the graph")


# %%
# Trying to use forward AD with mkldnn_rnn_layer that does not support it
# -----------------------------------------------------------------------
# A ``NotImplementedError`` from ``jacfwd``, ``jvp`` or ``hessian`` of an LSTM in float32 (or
# bfloat16) on the CPU: there the module runs oneDNN's ``aten::mkldnn_rnn_layer`` (when oneDNN is
# available and enabled), an operator with no forward-mode formula. Run on the CPU, the ``jacfwd``
# cell of pytorch#103161 raises it (the thread's own error, on CUDA, is part 8's:
# :doc:`plot_troubleshooting_cuda_kernels`; its ``jacrev`` cell runs here). The fixes: reverse mode
# (``jacrev``, or ``grad`` for a scalar), or ``torch.backends.mkldnn.flags(enabled=False)`` around
# the call, which sends the LSTM through its ordinary operators. In float64 the LSTM does not take
# the oneDNN route, and ``jacfwd`` runs. Reference: float64 ``torch.autograd.grad``.
lstm = nn.LSTM(4, 3, batch_first=True).to(cpu)
weights = {name: p.detach() for name, p in lstm.named_parameters()}


def mean_output(params, dtype=torch.float32):
    return functional_call(lstm, params, (sequences.to(dtype),))[0].mean()


in_float64 = {name: p.double().requires_grad_() for name, p in weights.items()}
exact = dict(zip(weights, torch.autograd.grad(mean_output(in_float64, torch.float64),
                                              list(in_float64.values()))))  # fmt: skip


onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
print(f"  oneDNN available and enabled: {onednn}")  # if not, nothing raises
dtypes = (torch.float32, torch.bfloat16) if onednn else ()
for dtype in dtypes:  # the error's type and first words, asserted
    try:
        jacfwd(mean_output)({n: p.to(dtype) for n, p in weights.items()}, dtype)
        raise AssertionError(f"torch {torch.__version__}: jacfwd did not raise")
    except NotImplementedError as refusal:
        message = " ".join(str(refusal).split())
        assert type(refusal) is NotImplementedError, type(refusal)
        assert message.startswith("Trying to use forward AD with mkldnn_rnn"), message
        print(f"  {dtype}: NotImplementedError: {textwrap.shorten(message, 80)}")
oneDNN_off = torch.backends.mkldnn.flags(enabled=False)
with warnings.catch_warnings(record=True) as heard, oneDNN_off:  # kept off the page
    each_tensor("jacfwd, oneDNN off", jacfwd(mean_output)(weights), exact, 2e-6)
notes = {str(w.message).split(" is ")[0] for w in heard}  # the flags' own note only
assert notes <= {"TF32 acceleration on top of oneDNN"}, notes
each_tensor("jacrev, as it runs", jacrev(mean_output)(weights), exact, 2e-6)
each_tensor("jacfwd in float64", jacfwd(mean_output)(
    {name: p.double() for name, p in weights.items()}, torch.float64), exact, 1e-14)  # fmt: skip


# %%
# Cannot call numel() on tensor with symbolic sizes/strides: one_hot in a compiled jacfwd
# ---------------------------------------------------------------------------------------
# pytorch#160752 (2025, torch 2.8): ``x.square() * F.one_hot(labels, 3)`` under ``jacfwd``
# runs in eager mode, and raises this ``RuntimeError`` once compiled with
# ``torch.compile(..., dynamic=True)``, from ``at::native::one_hot``. PR #160837 blames the
# rule that maps ``one_hot`` under ``vmap`` (zeros, then a scatter) and proposes ``==`` against
# ``arange`` instead; 2.13 has a Python decomposition of ``one_hot`` built that way
# (``torch/_decomp/decompositions.py``), but the thread does not say which change closed it.
# On 2.13 the report's code runs and matches the closed form: the Jacobian of
# ``x[b, c]² · onehot[b, c]`` is diagonal, with ``2 x[b, c] · onehot[b, c]`` on the diagonal.
CLASSES = 3


def weighted(x, labels):
    return x.square() * F.one_hot(labels, CLASSES)


def weighted_by_comparison(x, labels):  # the workaround: a one-hot from == and arange
    classes = torch.arange(CLASSES, device=labels.device)
    return x.square() * (labels[:, None] == classes).to(x.dtype)


def closed_form(x, labels):
    hot = (labels[:, None] == torch.arange(CLASSES, device=device)).to(x.dtype)
    return torch.diag((2 * x * hot).flatten()).reshape(*x.shape, *x.shape)


graphs, reasons = {}, []
torch._logging.set_logs(recompiles=True)  # why a graph compiles again, as a log record
for name, f in [("F.one_hot", weighted), ("== arange", weighted_by_comparison)]:
    torch._dynamo.reset()  # one code object for both lambdas: start each case afresh
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda x, labels, f=f: jacfwd(f)(x, labels),
                             dynamic=True, backend=counter)  # fmt: skip
    recompiles = TestCase().assertLogs("torch._dynamo.guards.__recompiles", "DEBUG")
    with recompiles as logged, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*_prims_common.check")  # fmt: skip
        for batch in (37, 20):
            x = torch.rand(batch, CLASSES, dtype=torch.float64, device=device)
            labels = torch.randint(CLASSES, (batch,), device=device)
            error = gap_to(name, compiled(x, labels), closed_form(x, labels), 1e-15)
            measured[f"compiled jacfwd, {name}, batch {batch}"] = error, 1e-15
    graphs[name] = counter.frame_count
    reasons += [line.strip() for r in logged.output for line in r.splitlines()
                if "size mismatch" in line]  # fmt: skip
    print(f"  {name}: the closed form at batches 37 and 20; {graphs[name]} graphs")
torch._logging.set_logs()
torch._dynamo.reset()

# %%
# Two graphs for two batch sizes, though ``dynamic=True``: the recompile log (the records
# ``TORCH_LOGS=recompiles`` prints) names a guard on the batch size of ``x``, which under
# ``jacfwd`` stays fixed; ``vmap(grad)`` compiles once (:doc:`plot_compile_and_transforms`). For
# a release that raises (none checked here, as 2.13 does not raise): the one-hot built with
# ``==`` and ``arange`` as above, which also runs where ``F.one_hot`` still fails on 2.13 (next
# section); the one-hot computed outside the compiled function and passed in; ``dynamic=False``.
print("  why the second graph:", *sorted(set(reasons)), sep="\n    ")
assert graphs == {"F.one_hot": 2, "== arange": 2}, graphs
assert len(reasons) == 2, reasons
assert all("'x' size mismatch at index 0. expected 37, actual 20" in r for r in reasons)
# pytorch#181175 (2026) raised the same words from ``torch.func.grad`` over ``ConvTranspose2d``
# compiled with ``dynamic=True``, in the convolution's double backward; PR #184659 removes the
# fixed-size checks there. Not re-run here.


# %%
# vmap: It looks like you're either (1) calling .item() ...: F.one_hot under vmap(grad)
# -------------------------------------------------------------------------------------
# Still on 2.13, on the CPU: per-sample gradients of a loss that builds ``F.one_hot`` of each
# sample's label raise this ``RuntimeError``, though ``vmap`` alone and ``grad`` alone run it.
# ``grad`` takes ``one_hot`` apart into its C++ code, which on the CPU checks the labels' range
# by reading them (``.item()``). (On other devices that code skips the check and writes the ones
# into new zeros in place, which ``vmap`` refuses in another message: read in ``Onehot.cpp``, not
# run here.) The one-hot made with ``==`` against ``arange`` runs. Reference: a loop of
# ``torch.autograd.grad`` over single samples, with ``F.one_hot`` itself.
double = {"dtype": torch.float64, "device": cpu}  # the CPU's message
features = torch.randn(8, 4, **double)
targets = torch.randint(CLASSES, (8,))
scores = torch.randn(CLASSES, 4, **double)


def sample_loss(scores, x, label, encode):  # cross-entropy, written with a one-hot
    return -(encode(label) * torch.log_softmax(scores @ x, dim=0)).sum()


by_one_hot = lambda label: F.one_hot(label, CLASSES).to(torch.float64)  # noqa: E731
by_comparison = lambda label: (label == torch.arange(CLASSES)).double()  # noqa: E731
per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0, None))
try:
    per_sample(scores, features, targets, by_one_hot)
    raise AssertionError(f"torch {torch.__version__}: F.one_hot ran under vmap(grad)")
except RuntimeError as one_hot_error:
    said = str(one_hot_error)
    assert said.startswith("vmap: It looks like you're either (1) calling"), said
    print("  RuntimeError:", textwrap.shorten(said, 96))
leaf = scores.clone().requires_grad_()
loop = [torch.autograd.grad(sample_loss(leaf, x, y, by_one_hot), leaf)[0]
        for x, y in zip(features, targets)]  # fmt: skip
got = per_sample(scores, features, targets, by_comparison)
error = gap_to("== arange", got, torch.stack(loop), 1e-15)
measured["vmap(grad), == arange"] = error, 1e-15
print(f"  == arange under vmap(grad), against a loop: error {error:.1e} (bound 1e-15)")


# %%
# vmap: inplace arithmetic(self, \*extra_args) is not possible: a mask written in place
# -------------------------------------------------------------------------------------
# A ``RuntimeError`` when a function writes a batched value into a tensor that is not batched
# (:doc:`plot_pitfalls`, section 1), raised from code you cannot edit. posteriors#103 (2024) met it
# running a Hugging Face model under ``vmap``; the transformers of that year built the mask in
# ``_update_causal_mask``, writing into a new full-size mask in place (read, not run), and the
# thread's answer is the example's pinned versions (torch 2.0.1, transformers 4.33.2). On
# transformers 5.24, this site's, pass the mask in 4-D and additive (0, or the dtype's minimum),
# for a causal model (1, 1, L, L) with the causal triangle in it: the GPT-2 section of
# :doc:`../models_as_functions/plot_hugging_face_models`. For a write you cannot avoid: wrap the
# loss in :func:`~torch.func.functionalize`, which runs each in-place write as a copy.
# ``mask_in_place`` is a stand-in written here, in a toy attention; the reference is ``grad`` of
# one example at a time, where the write is legal.
def mask_in_place(real):  # causal, then each padded key hidden, written into the mask
    size = (real.shape[-1],) * 2  # not from real: a new tensor, outside vmap's batch
    mask = torch.full(size, -1e9, dtype=torch.float64, device=real.device).triu(1)
    mask[:, :] = mask.masked_fill(real == 0, -1e9)
    return mask


def toy_attention_loss(w, x, real):
    return ((x @ w) @ x.T + mask_in_place(real)).softmax(-1).square().sum()


on_device = dict(double, device=device)
tokens, w = torch.randn(3, 5, 4, **on_device), torch.randn(4, 4, **on_device)
real = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]], device=device)
try:
    vmap(grad(toy_attention_loss), in_dims=(None, 0, 0))(w, tokens, real)
    raise AssertionError(f"torch {torch.__version__}: the in-place mask ran under vmap")
except RuntimeError as written:
    said = str(written)
    assert said.startswith("vmap: inplace arithmetic(self, *extra_args) is not"), said
    print("  RuntimeError:", said.split(". ")[0])
with warnings.catch_warnings(record=True) as fallbacks:
    warnings.filterwarnings("always", message="There is a performance drop")
    functional = functionalize(toy_attention_loss)
    fixed = vmap(grad(functional), in_dims=(None, 0, 0))(w, tokens, real)
loop = torch.stack([grad(toy_attention_loss)(w, x, r) for x, r in zip(tokens, real)])
error = gap_to("functionalize", fixed, loop, 1e-14)
measured["vmap(grad(functionalize))"] = error, 1e-14
notes = [str(h.message) for h in fallbacks if "batching rule for " in str(h.message)]
slow = sorted({note.split("rule for ")[1].split(".")[0] for note in notes})
print(f"  functionalize: error {error:.1e}, against the loop; slow fallback for {slow}")
assert slow == ["aten::copy"], slow


# %%
# How far each check is from failing
# ----------------------------------
# Each check's margin: its bound over its largest error against its reference (hand-written,
# float64, a closed form, a loop or the loaded module). A check fails left of the line at 1; an
# exact match is drawn at 1e12.
EXACT = 1e12
margins = {name: b / e if e else EXACT for name, (e, b) in measured.items()}
fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
ax.barh(list(margins), list(margins.values()), color="0.6")
ax.axvline(1, color="black", linewidth=1)
ax.set(xscale="log", xlim=(0.3, 3 * EXACT), xlabel="bound / largest error (log scale)")
devices = "cpu" if device == cpu else f"cpu and {device}"
ax.set_title(f"{len(margins)} checks on {devices}")
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# - On 2.13, ``functional_call`` on an ``nn.LSTM`` uses the weights you pass. To test your
#   release, compare with a copy of the module that loaded your dict, differentiated by
#   ``backward()``; a stale list gives zeros for the LSTM, or a "not used in the graph" error.
# - "Trying to use forward AD with mkldnn_rnn_layer": forward mode through oneDNN's LSTM, in
#   float32 or bfloat16 on the CPU. Use ``jacrev`` or ``grad``, or ``jacfwd`` inside
#   ``torch.backends.mkldnn.flags(enabled=False)``.
# - ``F.one_hot`` inside a compiled ``jacfwd`` with ``dynamic=True`` runs on 2.13 (each batch
#   size compiles its own graph all the same); under ``vmap(grad)`` it still raises (on the CPU
#   this message). The one-hot built with ``==`` and ``arange`` runs in both.
# - An in-place write in code you cannot edit: ``vmap(grad(functionalize(loss)))``, at the price
#   of ``vmap``'s slower fallback for the copy it becomes. For Hugging Face models, first a 4-D
#   additive mask, as the Hugging Face page builds it.
