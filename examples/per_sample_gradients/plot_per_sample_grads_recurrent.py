"""
Per-sample gradients through GRU and LSTM layers
================================================

``vmap(grad(loss))`` through :class:`~torch.nn.GRU` stops with an error; through
:class:`~torch.nn.LSTM` it stops or runs by dtype and backend. First, a route that works, checked
against a float64 loop: the module's own parameters through a hand-written time loop, also stacked,
bidirectional or over sequences of different lengths; then the errors, and their causes.
"""

# %%
# Setup
# -----
import copy
import re
import warnings
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
torch.backends.cudnn.allow_tf32 = False  # float32 checks through cuDNN; no-op on a CPU
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73", "batched": "#666666",
                 "hand-written": "#999933"}  # fmt: skip
n_samples, seq_len, n_in, n_hidden, n_classes = 32, 12, 8, 16, 3
sequences = torch.randn(n_samples, seq_len, n_in)  # on the CPU: the same everywhere
labels = torch.randint(0, n_classes, (n_samples,))
WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")  # of each layer, by suffix


# %%
# The recipe: the module's parameters, a hand-written time loop
# -------------------------------------------------------------
# A recurrent layer reads the sequence, a linear head its last output. We run the layer's
# equations ourselves, out of place, on ``nn.GRU``'s own parameters by their own names
# (``weight_ih_l0`` stacks the input weights of the gates ``r, z, n``, PyTorch's documented
# order), so the dictionaries of :func:`~torch.func.functional_call` still fit.
class SequenceClassifier(nn.Module):
    def __init__(self, recurrent_layer, num_layers=1, bidirectional=False):
        super().__init__()
        self.rnn = recurrent_layer(n_in, n_hidden, num_layers, batch_first=True,
                                   bidirectional=bidirectional)  # fmt: skip
        self.head = nn.Linear(n_hidden * (1 + bidirectional), n_classes)

    def forward(self, seqs, state=None):
        return self.head(self.rnn(seqs, state)[0][..., -1, :])  # (B, L, H) or (L, H)


def gru_steps(p, seqs, layer="l0"):
    """nn.GRU's `layer` (l0, l1, l0_reverse...) over seqs (..., L, H_in) from zeros."""
    w_ih, w_hh, b_ih, b_hh = (p[f"{w}_{layer}"] for w in WEIGHTS)
    h, outputs = seqs.new_zeros(*seqs.shape[:-2], w_hh.shape[1]), []
    for xg in F.linear(seqs, w_ih, b_ih).unbind(-2):  # inputs' share, all steps at once
        x_r, x_z, x_n = xg.chunk(3, dim=-1)
        h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        h = (1 - z) * torch.tanh(x_n + r * h_n) + z * h
        outputs.append(h)
    return torch.stack(outputs, dim=-2)


def loss_by_hand(layers):
    def loss(params, seq, label):
        outputs = layers({k[4:]: v for k, v in params.items() if k[:4] == "rnn."}, seq)
        logits = F.linear(outputs[-1], params["head.weight"], params["head.bias"])
        return F.cross_entropy(logits, label)

    return loss


models = {"GRU": SequenceClassifier(nn.GRU), "LSTM": SequenceClassifier(nn.LSTM)}
params32 = {kind: m.state_dict() for kind, m in models.items()}  # detached parameters
per_sample = vmap(grad(loss_by_hand(gru_steps)), in_dims=(None, 0, 0))
grads = per_sample(params32["GRU"], sequences, labels)
print("rnn.weight_hh_l0:", tuple(params32["GRU"]["rnn.weight_hh_l0"].shape), "->",
      tuple(grads["rnn.weight_hh_l0"].shape), "per-sample gradients")  # fmt: skip


# %%
# The LSTM's gates come in the order ``i, f, g, o``. A stacked layer reads the outputs of the
# layer below (``weight_ih_l1``...); a bidirectional one adds a pass over the reversed
# sequence (``weight_ih_l0_reverse``...), whose outputs, turned back, join the forward ones.
def lstm_steps(p, seqs, layer="l0"):
    w_ih, w_hh, b_ih, b_hh = (p[f"{w}_{layer}"] for w in WEIGHTS)
    h = c = seqs.new_zeros(*seqs.shape[:-2], w_hh.shape[1])
    outputs = []
    for xg in F.linear(seqs, w_ih, b_ih).unbind(-2):
        i, f, g, o = (xg + F.linear(h, w_hh, b_hh)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, dim=-2)


def layers_by_hand(rnn, p, seqs):
    """The hand-written counterpart of an nn.GRU or nn.LSTM, all layers and directions."""
    steps = {"GRU": gru_steps, "LSTM": lstm_steps}[rnn.mode]
    for k in range(rnn.num_layers):
        out = steps(p, seqs, f"l{k}")
        if rnn.bidirectional:
            back = steps(p, seqs.flip(-2), f"l{k}_reverse").flip(-2)
            out = torch.cat([out, back], dim=-1)
        seqs = out
    return seqs


# %%
# **The checks.** In float64 on the CPU, the hidden state of every step of every sequence is
# compared with the module's, for one layer and for two bidirectional ones. Then the
# per-sample gradients, on ``device`` in float64 and float32, with the float64 module run on
# one sample at a time by :func:`torch.autograd.grad`: each parameter of each sample on its
# own, by ``‖g − g_ref‖ / ‖g_ref‖``, so that no small tensor or sample is drowned.
def loop_reference(model, seqs, targets, lengths=(seq_len,) * n_samples):
    names, weights = zip(*model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(s[None, :n]), y[None]), weights)
            for s, y, n in zip(seqs, targets, lengths)]  # fmt: skip
    return {name: torch.stack(g) for name, g in zip(names, zip(*rows))}


def check_per_sample(found, reference, bound, what):
    worst = 0.0
    for pname, ref_grad in reference.items():
        diff = (found[pname].cpu().double() - ref_grad).flatten(1).norm(dim=1)
        norms = ref_grad.flatten(1).norm(dim=1)  # where zero, the error is absolute:
        errors = torch.where(norms > 0, diff / norms, diff)  # one per sample
        i = errors.argmax().item()
        assert errors[i] < bound, f"{what}: {pname}, sample {i}: {errors[i]:.1e}"
        worst = max(worst, errors[i].item())
    print(f"{what}: worst error {worst:.1e}, bound {bound:.0e} ({bound / worst:.0f}x)")


deep = {f"2-layer bidirectional {k}": SequenceClassifier(m, 2, True) for k, m in
        (("GRU", nn.GRU), ("LSTM", nn.LSTM))}  # fmt: skip
models64 = {kind: copy.deepcopy(m).double() for kind, m in (models | deep).items()}
on_device = {k: {n: p.to(device) for n, p in m.state_dict().items()}
             for k, m in (models | deep).items()}  # fmt: skip
seqs64, seqs_dev = sequences.double(), sequences.to(device)
labels_dev = labels.to(device)
references = {}
for kind, model in models64.items():
    found = layers_by_hand(model.rnn, dict(model.rnn.named_parameters()), seqs64)
    expected = model.rnn(seqs64)[0]
    error = ((found - expected).abs().max() / expected.abs().max()).item()
    print(f"{kind} by hand vs the module, float64: max relative deviation {error:.1e}")
    assert error < 1e-14, f"{kind}: the hand-written layer is not the module"
    references[kind] = loop_reference(model, seqs64, labels)
    fn = vmap(grad(loss_by_hand(partial(layers_by_hand, model.rnn))), (None, 0, 0))
    as64 = {n: p.double() for n, p in on_device[kind].items()}
    grads = fn(as64, seqs_dev.double(), labels_dev)
    check_per_sample(grads, references[kind], 1e-14, f"{kind} by hand, float64")
    grads = fn(on_device[kind], seqs_dev, labels_dev)
    check_per_sample(grads, references[kind], 5e-6, f"{kind} by hand, float32")


# %%
# Sequences of different lengths
# ------------------------------
# Pad the batch to one length and map the lengths along with it; each sample's loss reads the
# output at its own last valid step, picked by a mask. One direction never reads ahead, so
# the padding after that step changes nothing (a reverse pass would read it first: not this
# way). The reference runs the float64 module on each unpadded sequence alone.
lengths = torch.randint(2, seq_len + 1, (n_samples,))
padded = sequences * (torch.arange(seq_len) < lengths[:, None])[..., None]


def loss_of_padded(params, seq, label, length):
    outputs = gru_steps({k[4:]: v for k, v in params.items() if k[:4] == "rnn."}, seq)
    steps = torch.arange(seq_len, device=seq.device)
    last = (outputs * (steps == length - 1)[:, None]).sum(0)
    logits = F.linear(last, params["head.weight"], params["head.bias"])
    return F.cross_entropy(logits, label)


padded_fn = vmap(grad(loss_of_padded), in_dims=(None, 0, 0, 0))
grads = padded_fn(params32["GRU"], padded, labels, lengths)
reference = loop_reference(models64["GRU"], seqs64, labels, lengths)  # unpadded
check_per_sample(grads, reference, 5e-6, "GRU by hand, padded, float32")


# %%
# A sequence classifier, and what fails
# -------------------------------------
# The recipe of :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads.py`,
# ``grad`` of one sample's loss through the unmodified module, mapped over the batch, in both
# the forms ``nn.GRU`` accepts: a batch of one, and one unbatched ``(L, H_in)`` sequence. On
# every machine this runs on the CPU (on CUDA the modules call cuDNN: probably other messages).
def loss_of_one(model, unbatched=False):
    def loss(params, seq, label, state=None):
        if unbatched:
            return F.cross_entropy(functional_call(model, params, (seq, state)), label)
        logits = functional_call(model, params, (seq.unsqueeze(0), state))
        return F.cross_entropy(logits, label.unsqueeze(0))

    return loss


def raises(expected, fn, *args):
    """Call fn(*args); it must raise a RuntimeError whose message holds `expected`."""
    try:
        fn(*args)
    except RuntimeError as err:
        assert expected in str(err), str(err)
        return str(err)
    raise AssertionError(f"no error raised; expected {expected!r}")


clash = "[1, {0}] doesn't match the broadcast shape [" + f"{n_samples}, 1, {{0}}]"

f32, f64 = torch.float32, torch.float64
failing = [("GRU", f32, False), ("GRU", f32, True), ("LSTM", f64, False)]
for kind, dtype, unbatched in failing:
    fn = vmap(grad(loss_of_one(models[kind], unbatched)), in_dims=(None, 0, 0))
    params = {n: p.to(dtype) for n, p in params32[kind].items()}
    width = n_hidden if kind == "GRU" else 4 * n_hidden
    message = raises(clash.format(width), fn, params, sequences.to(dtype), labels)
    form = "unbatched" if unbatched else "batch of one"
    print(f"nn.{kind}, {dtype}, {form}: RuntimeError: {message}")

# %%
# Why it fails
# ------------
# ``vmap`` of the forward pass alone gives the message of pytorch#134606 and functorch#1147.
# An operator with no batching rule goes to ``vmap``'s fallback, which calls it once per
# sample and stacks the results, but refuses operators that take a list of tensors
# (``areAnyArgumentsTensorList`` in ``aten/src/ATen/functorch/BatchedFallback.cpp``), and
# ``aten::gru`` takes ``Tensor[] params``. Under ``grad`` the fallback never sees
# ``aten::gru``: of the dispatch keys printed below it has a kernel for
# ``CompositeImplicitAutograd`` only (oneDNN's layer has a CPU one), so ``grad``, the inner
# transform, first breaks it into ``RNN.cpp``'s time loop of small operations.
message = raises("We could not generate a fallback", vmap(models["GRU"]), sequences)
print(f"vmap(model) -> RuntimeError: {message}")
gru_schema = str(torch.ops.aten.gru.input._schema)
assert "Tensor[] params" in gru_schema, gru_schema
print(gru_schema)
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
keys = ("CompositeImplicitAutograd", "Autograd", "CPU", "CUDA", "FuncTorchBatched")
for op in ("aten::gru.input", "aten::mkldnn_rnn_layer"):
    print(f"{op} has kernels for {[k for k in keys if has_kernel(op, k)]}")
assert [k for k in keys if has_kernel("aten::gru.input", k)] == [keys[0]]

# %%
# The error under ``grad`` comes from those pieces, and its shapes name the culprit. The
# first is a gate computed from the hidden state, which has no sample dimension: ``nn.GRU``
# made its initial state itself, for a batch of one, out of ``vmap``'s reach. The second is
# that gate's share from the inputs, one per sample. The CPU cell adds the second into the
# first *in place* (``chunked_hgates[0].add_(chunked_igates[0])``), and an in-place write
# cannot give a tensor a batch dimension (:ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`).
# The LSTM cell does the same with its four gates at once: wider gates in its message.


# %%
# A shortcut on the CPU: a batched initial state
# ----------------------------------------------
# If the trouble is a state without a sample dimension, pass one with it: zeros of shape
# ``(B, 1, 1, H)`` mapped by ``vmap`` like the data give each sample a ``(num_layers, 1, H)``
# state of its own (a pair for the LSTM). On the CPU the module then runs, and matches the
# loop. The LSTM in float32 warns, and runs even with its own state: there it goes through
# oneDNN's ``aten::mkldnn_rnn_layer``, which has no batching rule and takes no list of
# tensors, so the fallback takes it (the warning names it) and calls it sample by sample;
# that route is not timed here. ``aten::unsafe_chunk``, where pytorch#105311 stopped, runs.
def batched_zeros(kind, dtype):
    zeros = torch.zeros(n_samples, 1, 1, n_hidden, dtype=dtype)
    return zeros if kind == "GRU" else (zeros, zeros.clone())


def fallback_ops(fn, *args):
    """Call fn(*args); return its result and the operators vmap's fallback warned of."""
    with warnings.catch_warnings(record=True) as heard:
        warnings.filterwarnings("always")
        result = fn(*args)
    found = (re.search(r"batching rule for (\S+)\.", str(w.message)) for w in heard)
    return result, sorted({m.group(1) for m in found if m})


onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
cases = [("GRU", f64, 0), ("GRU", f32, 0), ("LSTM", f64, 0), ("LSTM", f32, 0)]
for kind, dtype, state_dim in cases + ([("LSTM", f32, None)] if onednn else []):
    fn = vmap(grad(loss_of_one(models[kind])), in_dims=(None, 0, 0, state_dim))
    params = {n: p.to(dtype) for n, p in params32[kind].items()}
    state = None if state_dim is None else batched_zeros(kind, dtype)
    grads, slow = fallback_ops(fn, params, sequences.to(dtype), labels, state)
    what = f"nn.{kind}, {dtype}, {'own' if state is None else 'batched'} state"
    check_per_sample(grads, references[kind], 1e-14 if dtype == f64 else 5e-6, what)
    uses_onednn = onednn and kind == "LSTM" and dtype == f32
    assert slow == (["aten::mkldnn_rnn_layer"] if uses_onednn else []), slow
    print(f"    fallback warnings for: {', '.join(slow) or 'none'}")

# %%
# With cuDNN on CUDA the shortcut fails another way: a tensor "doesn't have storage". Probably
# in Python: given new weights by ``functional_call``, the module re-packs them for cuDNN
# (``RNNBase.flatten_parameters`` in ``torch/nn/modules/rnn.py``), which reads each weight's
# ``data_ptr()``, and ``grad``'s wrapper tensors have none. There the page asserts that message.
gru_shortcut = vmap(grad(loss_of_one(models["GRU"])), in_dims=(None, 0, 0, 0))
if device.type == "cuda" and torch.backends.cudnn.is_available():
    no_storage = "Cannot access data pointer of Tensor that doesn't have storage"
    args = on_device["GRU"], seqs_dev, labels_dev, batched_zeros("GRU", f32).to(device)
    message = raises(no_storage, gru_shortcut, *args).splitlines()[0]
    print(f"on CUDA, the shortcut fails: {message}")


# %%
# ``nn.GRUCell`` and ``nn.LSTMCell``
# ----------------------------------
# A cell takes one step; a Python loop drives it over time. This section runs on the CPU.
# Mapping a cell's forward pass alone (pytorch#112459) shows the fallback's two faces:
# ``aten::gru_cell`` takes tensors only, so the fallback runs it once per sample and warns;
# ``aten::lstm_cell`` takes its state as a ``Tensor[]``, so it stops. Under ``grad``, with the
# layers' weights under the cells' names, both cells give the layers' error when they make
# their own state, and with a batched state run without a warning and match the loop. On CUDA
# the GRU cell probably calls ``aten::_thnn_fused_gru_cell``, which has no batching rule
# either: probably the warning of pytorch#144850.
cells = {"GRU": nn.GRUCell(n_in, n_hidden), "LSTM": nn.LSTMCell(n_in, n_hidden)}
out, slow = fallback_ops(vmap(cells["GRU"]), sequences[:, 0])
error = (out - cells["GRU"](sequences[:, 0])).abs().max().item()
print(f"vmap(GRUCell) warns for {slow}; vs batched call {error:.1e} (bound 1e-6)")
assert slow == ["aten::gru_cell"] and error < 1e-6, (slow, error)
no_rule = "Batching rule not implemented for aten::{}. We could not generate a fallback"
raises(no_rule.format("lstm_cell"), vmap(cells["LSTM"]), sequences[:, 0])


def loss_through_cell(cell):
    def loss(params, seq, label, state):
        cell_params = {k[4:-3]: v for k, v in params.items() if k.startswith("rnn.")}
        for x_t in seq:  # "rnn.weight_ih_l0" -> "weight_ih"
            state = functional_call(cell, cell_params, (x_t, state))
        h = state[0] if isinstance(state, tuple) else state
        logits = F.linear(h, params["head.weight"], params["head.bias"])
        return F.cross_entropy(logits, label)

    return loss


for kind, cell in cells.items():
    own = vmap(grad(loss_through_cell(cell)), in_dims=(None, 0, 0, None))
    width = n_hidden if kind == "GRU" else 4 * n_hidden
    message = raises(clash.format(width), own, params32[kind], sequences, labels, None)
    print(f"nn.{kind}Cell, its own state: RuntimeError: {message}")
    zeros = torch.zeros(n_samples, n_hidden)
    state = zeros if kind == "GRU" else (zeros, zeros.clone())
    fn = vmap(grad(loss_through_cell(cell)), in_dims=(None, 0, 0, 0))
    grads, slow = fallback_ops(fn, params32[kind], sequences, labels, state)
    check_per_sample(grads, references[kind], 5e-6, f"nn.{kind}Cell, batched state")
    assert not slow, slow


# %%
# Ensembles of ``nn.LSTM``
# ------------------------
# :func:`~torch.func.stack_module_state` stacks the parameters of models of one shape, and
# ``vmap`` over :func:`~torch.func.functional_call` runs them all in one call. For LSTMs
# (pytorch#105982) the forward pass stops at the fallback, for the reason above. The
# hand-written layer, mapped over the stacked parameters instead, runs every member.
members = [nn.LSTM(n_in, n_hidden, batch_first=True) for _ in range(4)]
stacked, stacked_buffers = stack_module_state(members)
all_members = vmap(lambda p, b, s: functional_call(members[0], (p, b), (s,))[0],
                   in_dims=(0, 0, None))  # fmt: skip
raises(no_rule.format("lstm.input"), all_members, stacked, stacked_buffers, sequences)
ensemble_fn = vmap(lstm_steps, in_dims=(0, None))
outputs = ensemble_fn({k: v.to(device) for k, v in stacked.items()}, seqs_dev).cpu()
expected = torch.stack([member(sequences)[0] for member in members]).detach()
errors = (outputs - expected).abs().amax((1, 2, 3)) / expected.abs().amax((1, 2, 3))
print(f"members' deviations {[f'{e:.1e}' for e in errors.tolist()]}, bound 5e-6")
assert (errors < 5e-6).all(), errors


# %%
# Cost
# ----
# The GRU classifier's gradients, on ``device``: ``loop`` runs the module once per sample,
# ``hand-written`` is the recipe, ``vmap`` the module with a batched state (timed on the CPU
# only: on CUDA it fails) and ``batched`` one ordinary gradient of the batch mean, which gives
# no per-sample gradients: the ratio to it is their price. On a CPU the loop pays each
# operation's fixed cost per step of each sample, the others per step (on CUDA the module runs
# all steps in one cuDNN call, probably): ratios hold for these sizes and this device only.
gru_dev = copy.deepcopy(models["GRU"]).to(device)
weights = list(gru_dev.parameters())


def gru_loss(seqs, targets):
    return F.cross_entropy(gru_dev(seqs), targets)


methods = {
    "loop": lambda: [torch.autograd.grad(gru_loss(s[None], y[None]), weights)
                     for s, y in zip(seqs_dev, labels_dev)],
    "hand-written": lambda: per_sample(on_device["GRU"], seqs_dev, labels_dev),
    "batched": lambda: torch.autograd.grad(gru_loss(seqs_dev, labels_dev), weights),
}  # fmt: skip
if device.type == "cpu":
    state0 = batched_zeros("GRU", f32)
    methods["vmap"] = lambda: gru_shortcut(params32["GRU"], sequences, labels, state0)

times, threads = {}, torch.get_num_threads()
for name, fn in methods.items():
    fn()  # warm-up
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
    runs = [timer.blocked_autorange(min_run_time=0.3)]
    if len(runs[0].times) < 5:  # long blocks: about five more of them, for a spread
        block_s = runs[0].median * runs[0].number_per_run
        runs.append(timer.blocked_autorange(min_run_time=5 * block_s))
    t = times[name] = benchmark.Measurement.merge(runs)[0]
    ms, iqr = t.median * 1e3, t.iqr * 1e3
    print(f"{name:13s} {ms:7.2f} ms (IQR {iqr:.3f} ms, {len(t.times)} blocks)")


def compare(a, b):
    ratio = times[a].median / times[b].median
    if ratio >= 1:
        return f"{a} takes {ratio:.2f}x the time of {b}"
    return f"{a} is {1 / ratio:.2f}x faster than {b}"


headline = compare("hand-written", "loop")
print(headline, compare("hand-written", "batched"), sep="\n")
if "vmap" in times:
    print(compare("vmap", "hand-written"))

# %%
fig, ax = plt.subplots(figsize=(7, 2.8), layout="constrained")
drawn = [m for m in ("batched", "loop", "vmap", "hand-written") if m in times]
ax.barh(drawn, [times[m].median * 1e3 for m in drawn],
        xerr=[times[m].iqr * 1e3 for m in drawn],
        color=[METHOD_COLORS[m] for m in drawn])  # fmt: skip
ax.invert_yaxis()
ax.set_xlabel(f"median time for {n_samples} sequences of {seq_len} steps (ms)")
ax.set_title(f"nn.GRU, {device.type.upper()}: {headline}")
plt.show()

# %%
# What to remember
# ----------------
# * The route that works (checked on the page's device, float32 and float64): the module's own
#   parameters, by name, through a hand-written, out-of-place time loop of the documented
#   equations, layer by layer and direction by direction, checked against the module first.
#   Different lengths: pad, map the lengths, read each sample's output at its last step.
# * ``vmap`` of ``nn.GRU`` or ``nn.LSTM`` stops at the fallback, which cannot slice their
#   ``Tensor[]``. Under ``grad``, ``nn.GRU`` and float64 ``nn.LSTM`` stop because the CPU
#   cells write per-sample gates in place into gates of the module's own unbatched initial
#   state; float32 ``nn.LSTM`` on the CPU runs through oneDNN with a fallback warning.
# * On the CPU a batched initial state is enough (on CUDA, the cuDNN path raises instead). A
#   "performance drop" warning names an operator that the fallback calls sample by sample.
# * Ensembles of LSTMs: map the hand-written layer over ``stack_module_state``'s parameters.
