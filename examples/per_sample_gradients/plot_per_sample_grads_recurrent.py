"""
Per-sample gradients through GRU and LSTM layers
================================================

``vmap(grad(loss))`` through an unmodified :class:`~torch.nn.GRU` stops with an error, and
through :class:`~torch.nn.LSTM` it does or not depending on dtype and backend, as users keep
reporting. This page triggers those errors on a small sequence classifier, finds out from the
messages and the operators' schemas why they happen, and computes per-sample gradients in ways
that work: a hand-written time loop over the module's own parameters (any device), a batched
initial state (a CPU shortcut) and the cells. Every route is checked against a float64 loop,
sample by sample. Then an ensemble of LSTMs, and what each route costs.
"""

# %%
# Setup
# -----
# The data are drawn on the CPU, the same on every device. The demonstrations of what fails
# run on the CPU on every machine: on CUDA the modules call cuDNN, and the messages differ.
import copy
import re
import warnings

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
sequences = torch.randn(n_samples, seq_len, n_in)
labels = torch.randint(0, n_classes, (n_samples,))


# %%
# A sequence classifier, and what fails
# -------------------------------------
# An unmodified recurrent layer reads the sequence; a linear head reads its last output. The
# recipe of :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads.py`
# maps ``grad`` of one sample's loss, written with :func:`~torch.func.functional_call`, over
# the batch. ``nn.GRU`` accepts one unbatched ``(L, H_in)`` sequence too, so we try both forms.
class SequenceClassifier(nn.Module):
    def __init__(self, recurrent_layer):
        super().__init__()
        self.rnn = recurrent_layer(n_in, n_hidden, batch_first=True)
        self.head = nn.Linear(n_hidden, n_classes)

    def forward(self, seqs, state=None):
        outputs, _ = self.rnn(seqs, state)
        return self.head(outputs[..., -1, :])  # (B, L, H) or (L, H)


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


models = {"GRU": SequenceClassifier(nn.GRU), "LSTM": SequenceClassifier(nn.LSTM)}
params32 = {kind: m.state_dict() for kind, m in models.items()}  # detached parameters
failing = [("GRU", torch.float32, False), ("GRU", torch.float32, True),
           ("LSTM", torch.float64, False)]  # fmt: skip
for kind, dtype, unbatched in failing:
    fn = vmap(grad(loss_of_one(models[kind], unbatched)), in_dims=(None, 0, 0))
    params = {n: p.to(dtype) for n, p in params32[kind].items()}
    w = n_hidden if kind == "GRU" else 4 * n_hidden
    shapes = f"[1, {w}] doesn't match the broadcast shape [{n_samples}, 1, {w}]"
    message = raises(shapes, fn, params, sequences.to(dtype), labels)
    form = "unbatched" if unbatched else "batch of one"
    print(f"nn.{kind}, {dtype}, {form}: RuntimeError: {message}")

# %%
# Why it fails
# ------------
# Without ``grad``, ``vmap`` of the forward pass alone gives the message of pytorch#134606 and
# functorch#1147. When an operator has no batching rule, ``vmap`` falls back to calling it
# once per sample and stacking the results; but that fallback refuses operators that take a
# list of tensors (``areAnyArgumentsTensorList`` in PyTorch's
# ``aten/src/ATen/functorch/BatchedFallback.cpp``), and ``aten::gru`` takes its weights as
# one, ``Tensor[] params``, as its schema shows:
message = raises("We could not generate a fallback", vmap(models["GRU"]), sequences)
print(f"vmap(model) -> RuntimeError: {message}")
gru_schema = str(torch.ops.aten.gru.input._schema)
assert "Tensor[] params" in gru_schema, gru_schema
print(gru_schema)

# %%
# Under ``grad`` the message comes from *inside* ``aten::gru``'s C++ implementation
# (``aten/src/ATen/native/RNN.cpp``): a loop over time steps of small operations, into which
# the call is broken before ``vmap`` sees it. The shapes name the culprit. ``[1, 16]`` is a
# gate computed from the hidden state, which has no sample dimension: ``nn.GRU`` made its
# initial state itself, ``torch.zeros`` for a batch of one, out of ``vmap``'s reach.
# ``[32, 1, 16]`` is that gate's share from the inputs, one per sample. The CPU cell adds the
# second into the first *in place* (``chunked_hgates[0].add_(chunked_igates[0])``), and an
# in-place write cannot give a tensor a batch dimension
# (:ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`).
# The LSTM cell does the same with its four gates at once, hence ``[1, 64]``.


# %%
# The recipe: the module's parameters, a hand-written time loop
# -------------------------------------------------------------
# We run the same equations ourselves, with out-of-place operations only. The functions read
# ``nn.GRU``'s and ``nn.LSTM``'s own parameters under their own names (``weight_ih_l0`` holds
# the input weights of all gates, stacked), so the dictionaries of
# :func:`~torch.func.functional_call` still fit. The gate order is PyTorch's documented one:
# ``r, z, n`` for the GRU, ``i, f, g, o`` for the LSTM. The inputs' share of the gates is
# computed for all steps at once; only the recurrent share runs step by step.
def gru_steps(p, seqs):
    """One-layer nn.GRU over seqs (..., L, H_in) from a zero state: all hidden states."""
    x_gates = F.linear(seqs, p["weight_ih_l0"], p["bias_ih_l0"]).unbind(-2)
    h = torch.zeros_like(x_gates[0][..., : p["weight_hh_l0"].shape[1]])
    outputs = []
    for xg in x_gates:
        x_r, x_z, x_n = xg.chunk(3, dim=-1)
        h_r, h_z, h_n = F.linear(h, p["weight_hh_l0"], p["bias_hh_l0"]).chunk(3, -1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        h = (1 - z) * n + z * h
        outputs.append(h)
    return torch.stack(outputs, dim=-2)


def lstm_steps(p, seqs):
    """One-layer nn.LSTM over seqs (..., L, H_in) from a zero state: all hidden states."""
    x_gates = F.linear(seqs, p["weight_ih_l0"], p["bias_ih_l0"]).unbind(-2)
    h = c = torch.zeros_like(x_gates[0][..., : p["weight_hh_l0"].shape[1]])
    outputs = []
    for xg in x_gates:
        gates = xg + F.linear(h, p["weight_hh_l0"], p["bias_hh_l0"])
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, dim=-2)


steps_by_hand = {"GRU": gru_steps, "LSTM": lstm_steps}


def loss_by_hand(kind):
    def loss(params, seq, label):
        layer = {k[4:]: v for k, v in params.items() if k.startswith("rnn.")}
        last = steps_by_hand[kind](layer, seq)[-1]
        logits = F.linear(last, params["head.weight"], params["head.bias"])
        return F.cross_entropy(logits, label)

    return loss


# %%
# **Check 1: the hand-written layers are the modules.** In float64 on the CPU, the hidden state
# of every step of every sequence is compared with the module's own output.
models64 = {kind: copy.deepcopy(m).double() for kind, m in models.items()}
for kind, model in models64.items():
    layer = {n: p.detach() for n, p in model.rnn.named_parameters()}
    expected = model.rnn(sequences.double())[0].detach()
    found = steps_by_hand[kind](layer, sequences.double())
    error = ((found - expected).abs().max() / expected.abs().max()).item()
    print(f"{kind} by hand vs nn.{kind}, float64: max relative deviation {error:.1e}")
    assert error < 1e-14, f"{kind}: the hand-written layer is not the module"


# %%
# **Check 2: per-sample gradients.** The reference runs the float64 module on one sample at a
# time with :func:`torch.autograd.grad`. Each parameter of each sample is compared on its own,
# by ``‖g − g_ref‖ / ‖g_ref‖``, so that neither a small tensor (a bias) nor one sample is
# drowned by the rest. The recipe runs on ``device``, in float64 and in float32.
def loop_reference(model, seqs, targets):
    names, weights = zip(*model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(s[None]), y[None]), weights)
            for s, y in zip(seqs, targets)]  # fmt: skip
    return {name: torch.stack(g) for name, g in zip(names, zip(*rows))}


def check_per_sample(found, reference, bound, what):
    worst = 0.0
    for pname, ref_grad in reference.items():
        diff = (found[pname].cpu().double() - ref_grad).flatten(1).norm(dim=1)
        errors = diff / ref_grad.flatten(1).norm(dim=1)  # one per sample
        i = errors.argmax().item()
        assert errors[i] < bound, f"{what}: {pname}, sample {i}: {errors[i]:.1e}"
        worst = max(worst, errors[i].item())
    print(f"{what}: worst error {worst:.1e}, bound {bound:.0e} ({bound / worst:.0f}x)")


seqs64 = sequences.double()
references = {k: loop_reference(m, seqs64, labels) for k, m in models64.items()}
by_hand_fns = {k: vmap(grad(loss_by_hand(k)), in_dims=(None, 0, 0)) for k in models}
on_device = {k: {n: p.to(device) for n, p in ps.items()} for k, ps in params32.items()}
seqs_dev, labels_dev = sequences.to(device), labels.to(device)
for kind, fn in by_hand_fns.items():
    as64 = {n: p.double() for n, p in on_device[kind].items()}
    grads = fn(as64, seqs_dev.double(), labels_dev)
    check_per_sample(grads, references[kind], 1e-14, f"{kind} by hand, float64")
    grads = fn(on_device[kind], seqs_dev, labels_dev)
    check_per_sample(grads, references[kind], 5e-6, f"{kind} by hand, float32")
print("rnn.weight_hh_l0:", tuple(params32["LSTM"]["rnn.weight_hh_l0"].shape), "->",
      tuple(grads["rnn.weight_hh_l0"].shape), "per-sample gradients")  # fmt: skip


# %%
# A shortcut on the CPU: a batched initial state
# ----------------------------------------------
# If the trouble is a state without a sample dimension, pass one with it: zeros of shape
# ``(B, 1, 1, H)`` mapped by ``vmap`` like the data, so that each sample gets a
# ``(num_layers, 1, H)`` state of its own (a pair of them for the LSTM). On the CPU the
# module then runs, and matches the loop. The LSTM in float32 warns, and runs even with its
# own state: there ``nn.LSTM`` goes through oneDNN's ``aten::mkldnn_rnn_layer``, which has no
# batching rule and takes no list of tensors, so the fallback runs it once per sample:
# correct, but a loop in disguise. So whether ``nn.LSTM`` fails depends on dtype and oneDNN.
# (``aten::unsafe_chunk``, where pytorch#105311 stopped, is called by the CPU cells and runs.)
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
f32, f64 = torch.float32, torch.float64
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
# On a GPU, ``nn.GRU`` and ``nn.LSTM`` call cuDNN's fused operator, whose schema also takes a
# ``Tensor[]``; so there the shortcut probably stops at the fallback, like ``vmap(model)``
# above. The page checks the schema, and on CUDA prints what happens.
cudnn_schema = str(torch.ops.aten._cudnn_rnn.default._schema)
assert "Tensor[] weight" in cudnn_schema, cudnn_schema
gru_shortcut = vmap(grad(loss_of_one(models["GRU"])), in_dims=(None, 0, 0, 0))
on_gpu = device.type == "cuda"
if on_gpu:
    try:
        gpu_state = batched_zeros("GRU", f32).to(device)
        grads = gru_shortcut(on_device["GRU"], seqs_dev, labels_dev, gpu_state)
    except RuntimeError as err:
        print(f"on CUDA, the shortcut fails: {str(err).splitlines()[0]}")
    else:
        check_per_sample(grads, references["GRU"], 5e-6, "nn.GRU, batched state, CUDA")


# %%
# ``nn.GRUCell`` and ``nn.LSTMCell``
# ----------------------------------
# A cell takes one step; a Python loop drives it over time. Mapping a cell's forward pass
# alone (pytorch#112459) shows the fallback's two faces: ``aten::gru_cell`` takes tensors only,
# so the fallback runs it once per sample and warns; ``aten::lstm_cell`` takes its state as a
# ``Tensor[]``, so it stops. Under ``grad``, with a batched state, both cells run without a
# warning on the CPU and match the loop; we give them the layers' weights under the cells'
# names. On CUDA, ``RNN.cpp``'s GRU cell calls ``aten::_thnn_fused_gru_cell``, which has no
# batching rule either: probably the warning of pytorch#144850. This section runs on the CPU.
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
    zeros = torch.zeros(n_samples, n_hidden)
    state = zeros if kind == "GRU" else (zeros, zeros.clone())
    fn = vmap(grad(loss_through_cell(cell)), in_dims=(None, 0, 0, 0))
    grads, slow = fallback_ops(fn, params32[kind], sequences, labels, state)
    check_per_sample(grads, references[kind], 5e-6, f"nn.{kind}Cell, float32")
    assert not slow, slow


# %%
# Ensembles of ``nn.LSTM``
# ------------------------
# :func:`~torch.func.stack_module_state` stacks the parameters of models of one shape, and
# ``vmap`` over :func:`~torch.func.functional_call` runs them all in one call. For LSTMs
# (pytorch#105982) the forward pass stops at the fallback, for the reason above. The
# hand-written layer, mapped over the stacked parameters instead of the data, runs every
# member; each is checked against calling its own module.
members = [nn.LSTM(n_in, n_hidden, batch_first=True) for _ in range(4)]
stacked, stacked_buffers = stack_module_state(members)


def member_outputs(params, buffers, seqs):
    return functional_call(members[0], (params, buffers), (seqs,))[0]


all_members = vmap(member_outputs, in_dims=(0, 0, None))
raises(no_rule.format("lstm.input"), all_members, stacked, stacked_buffers, sequences)
ensemble_fn = vmap(lstm_steps, in_dims=(0, None))
outputs = ensemble_fn({k: v.to(device) for k, v in stacked.items()}, seqs_dev).cpu()
print(f"outputs of {len(members)} members: {tuple(outputs.shape)}")
for m, member in enumerate(members):
    expected = member(sequences)[0].detach()
    error = ((outputs[m] - expected).abs().max() / expected.abs().max()).item()
    print(f"  member {m}: deviation {error:.1e} from its own module (bound 5e-6)")
    assert error < 5e-6, f"ensemble member {m}: {error:.1e}"


# %%
# Cost
# ----
# The GRU classifier's gradients four ways, on ``device``: ``loop`` runs the module once per
# sample; ``hand-written`` is the recipe; ``vmap`` is the module with a batched state, timed on
# the CPU only, where it runs; ``batched`` is one ordinary gradient of the batch mean, which
# gives no per-sample gradients and serves as the yardstick.
gru_dev = copy.deepcopy(models["GRU"]).to(device)
weights = list(gru_dev.parameters())


def per_sample_loop():
    return [torch.autograd.grad(F.cross_entropy(gru_dev(s[None]), y[None]), weights)
            for s, y in zip(seqs_dev, labels_dev)]  # fmt: skip


methods = {
    "loop": per_sample_loop,
    "hand-written": lambda: by_hand_fns["GRU"](on_device["GRU"], seqs_dev, labels_dev),
    "batched": lambda: torch.autograd.grad(
        F.cross_entropy(gru_dev(seqs_dev), labels_dev), weights
    ),
}
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
# **Reading the numbers.** The loop pays the fixed price of every operation (Python, the
# dispatcher, on a GPU a kernel launch) once per sample; the hand-written route and the
# shortcut pay it once per time step for the whole batch. So the loop's cost grows with the
# number of samples, theirs probably mostly with the number of steps: the printed ratios hold
# for these sizes only. The batched gradient, which gives no per-sample gradients, is the
# yardstick: the ratio to it is the price of having them.

# %%
# What to remember
# ----------------
# * ``vmap`` of ``nn.GRU`` or ``nn.LSTM`` stops because their operators take a ``Tensor[]``,
#   which the per-sample fallback cannot slice; under ``grad``, because the CPU cells write
#   per-sample gates in place into gates of the module's own, unbatched, initial state.
# * The route that works on every device and dtype: the module's own parameters, by their
#   own names, through a hand-written time loop of the documented equations (GRU ``r, z, n``;
#   LSTM ``i, f, g, o``), checked first against the module's output.
# * On the CPU a batched initial state is enough. A "performance drop" warning means that the
#   fallback loops over the samples inside ``vmap``: correct, not fast.
# * Ensembles of LSTMs: map the hand-written layer over ``stack_module_state``'s parameters.
