"""
Per-sample gradients for a small transformer language model
===========================================================

One gradient per *sequence* of a tiny causal language model called with Hugging Face's keyword
inputs, by ``vmap(grad(loss))``, checked against a float64 loop; then what fails under ``vmap``
in torch 2.13 and the fixes, padding, embeddings (dense, tied, sparse), memory and cost.
"""

# %%
# Setup: a tiny causal language model
# -----------------------------------
# Token and position embeddings; causal attention through
# :func:`~torch.nn.functional.scaled_dot_product_attention`; an MLP; a one-layer post-norm
# :class:`~torch.nn.TransformerEncoder` (``enable_nested_tensor=False``: see the failures); an
# untied output layer, so the table's gradient shows the rows a sequence uses (tied: below).
import copy
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
VOCAB, WIDTH, HEADS, MAX_LEN, PAD, IGNORE = 64, 32, 2, 16, 0, -100


class TinyLM(nn.Module):
    def __init__(self, norm_first=False, **encoder_options):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(MAX_LEN, WIDTH)
        self.attn_norm, self.qkv = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.attn_out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))  # fmt: skip
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, batch_first=True,
                                           norm_first=norm_first)  # fmt: skip
        encoder_options = {"enable_nested_tensor": False, **encoder_options}
        self.encoder = nn.TransformerEncoder(layer, 1, **encoder_options)
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        h = self.tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, length, _ = h.shape
        h = h + self.positions(torch.arange(length, device=h.device))
        qkv = self.qkv(self.attn_norm(h)).view(batch, length, 3, HEADS, WIDTH // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head width)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.attn_out(mixed.transpose(1, 2).reshape(batch, length, WIDTH))
        h = h + self.mlp(h)
        future = torch.ones(length, length, dtype=torch.bool, device=h.device).triu(1)
        ignored = None if attention_mask is None else attention_mask == 0  # "padding"
        h = self.encoder(h, future, src_key_padding_mask=ignored, is_causal=True)
        return self.head(self.final_norm(h))


model = TinyLM().to(device).eval()  # eval: the encoder layer's dropout (p=0.1) is off


# %%
# The recipe: ``vmap(grad(loss of one sequence))``
# ------------------------------------------------
# A batch is a dict of Hugging Face's keyword inputs; ``vmap`` maps over each entry's first
# dimension; :func:`~torch.func.functional_call` passes them as ``kwargs``, with our parameters.
def sequence_loss(params, inputs, targets, net=model, backend=SDPBackend.MATH):
    with sdpa_kernel(backend):  # the math backend batches attention (see the failures)
        one = {key: value[None] for key, value in inputs.items()}  # a batch of one
        logits = functional_call(net, params, (), one)  # HF models: (...).logits
    return F.cross_entropy(logits[0], targets, ignore_index=IGNORE)


per_sequence_grads = vmap(grad(sequence_loss), in_dims=(None, 0, 0))
# Hugging Face models: checkpointing fails (saved-tensor hooks, troubleshooting part 2), and
# ``attn_implementation="eager"`` is reported needed under ``vmap`` (MadryLab/trak#78; not run).
params = {key: tensor.detach() for key, tensor in model.named_parameters()}
print(f"{sum(p.numel() for p in params.values()):,} parameters, {len(params)} tensors")


# %%
# The loss averages over real targets only: padding targets are ``IGNORE`` (-100, also
# ``cross_entropy``'s default ``ignore_index``).
def make_batch(lengths, generator):
    """Random sequences of the given lengths (tokens 1..VOCAB-1), padded into one batch."""
    seqs = [torch.randint(1, VOCAB, (n + 1,), generator=generator) for n in lengths]
    ids = torch.full((len(lengths), MAX_LEN), PAD)
    targets = torch.full((len(lengths), MAX_LEN), IGNORE)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq) - 1], targets[row, : len(seq) - 1] = seq[:-1], seq[1:]
    inputs = {"input_ids": ids, "attention_mask": (ids != PAD).long()}  # 1: real
    inputs = {key: value.to(device) for key, value in inputs.items()}
    return [seq.to(device) for seq in seqs], inputs, targets.to(device)


generator = torch.Generator().manual_seed(0)
full_seqs, full_inputs, full_targets = make_batch([MAX_LEN] * 8, generator)
with warnings.catch_warnings(record=True, action="always") as recipe_warnings:
    grads = per_sequence_grads(params, full_inputs, full_targets)
assert not [w for w in recipe_warnings if "performance drop" in str(w.message)]
print("tokens.weight", tuple(params["tokens.weight"].shape), "->",
      tuple(grads["tokens.weight"].shape), "per-sequence gradients")  # fmt: skip


# %%
# The reference: a float64 loop over sequences
# --------------------------------------------
# The reference runs a float64 copy of the model on each sequence alone, unpadded, with one
# :func:`torch.autograd.grad` each, on its default attention kernel. Each parameter is compared
# on its own, by the worst relative error ``‖g_b − r_b‖ / ‖r_b‖`` over the sequences ``b``.
model64 = copy.deepcopy(model).to(torch.float64)  # same weights


def loop_grads(net, sequences):
    rows = []
    for seq in sequences:
        loss = F.cross_entropy(net(seq[None, :-1])[0], seq[1:])
        rows.append(torch.autograd.grad(loss, list(net.parameters())))
    names = [name for name, _ in net.named_parameters()]
    return {name: torch.stack(g) for name, g in zip(names, zip(*rows))}


def worst_errors(grads, reference, bound, what):
    worst_per_tensor = {}
    for key, expected in reference.items():
        miss = (grads[key].double() - expected).flatten(1).norm(dim=1)
        worst_per_tensor[key] = (miss / expected.flatten(1).norm(dim=1)).max().item()
    key, largest = max(worst_per_tensor.items(), key=lambda item: item[1])
    print(f"{what}: worst {key}, {largest:.1e} (bound {bound:.0e}, margin "
          f"{bound / largest:.0f}x)")  # fmt: skip
    too_far = {k: f"{e:.1e}" for k, e in worst_per_tensor.items() if not e < bound}
    assert not too_far, f"{what}: relative errors above {bound:.0e}: {too_far}"


reference = loop_grads(model64, full_seqs)
vmap64 = per_sequence_grads(dict(model64.named_parameters()), full_inputs, full_targets)
worst_errors(vmap64, reference, 1e-14, "vmap(grad) float64 vs loop")
worst_errors(grads, reference, 1e-5, "vmap(grad) float32 vs loop")


# %%
# What fails under ``vmap``, and the fix
# --------------------------------------
# ``expect`` runs a call that must raise one exception type with a given fragment in its
# message, and prints the message's first line (the messages quoted here are torch 2.13's).
import collections
import functools


def expect(what, error_type, fragment, call):
    print(f"{what}:")
    try:
        call()
    except error_type as raised:
        lines = str(raised).strip().splitlines()
        assert type(raised) is error_type and fragment in str(raised), repr(raised)
        print(f"  {error_type.__name__}: {lines[0][:200]}")
        if fragment not in lines[0]:  # and where the fragment stands
            print("    ... " + next(line for line in lines if fragment in line)[-60:])
    else:
        raise AssertionError(f"no {error_type.__name__} containing {fragment!r}")


def grads_for(net, batch=(full_inputs, full_targets), randomness="error", **options):
    loss = functools.partial(sequence_loss, net=net, **options)
    mapped = vmap(grad(loss), in_dims=(None, 0, 0), randomness=randomness)
    return mapped({key: t.detach() for key, t in net.named_parameters()}, *batch)


def copy_of(**options):  # this page's model, weights included, built with other options
    net = TinyLM(**options).to(device).eval()
    net.load_state_dict(model.state_dict())
    return net


# %%
# **The encoder's fast path** (pytorch#149609). ``TransformerEncoder.forward``
# (``torch/nn/modules/transformer.py``) calls ``aten::_nested_tensor_from_mask_left_aligned``,
# which has no batching rule and no fallback, before it looks at gradients, when all of these
# hold: ``__init__`` kept ``use_nested_tensor`` (``enable_nested_tensor=True``, the default, and
# a post-norm, ``batch_first`` ``TransformerEncoderLayer`` with biases, an even number of heads,
# ReLU or GELU and equal norm eps); the fast path is on; the first layer is in eval mode; the
# input is 3-D; a padding mask is given; ``mask_check=True`` (the default), outside
# ``torch.compile``. With any one false, it is not called. Checked against the loop:
# ``mask_check=False``, and ``torch.backends.mha.set_fastpath_enabled(False)``. This page's
# model builds with ``enable_nested_tensor=False``; a pre-norm layer runs too.
nested = copy_of(enable_nested_tensor=True)
expect("post-norm, enable_nested_tensor=True (the default)", RuntimeError,
       "_nested_tensor_from_mask_left_aligned", lambda: grads_for(nested))  # fmt: skip
torch.backends.mha.set_fastpath_enabled(False)
try:
    worst_errors(grads_for(nested), reference, 1e-5, "fast path off, vs loop")
finally:
    torch.backends.mha.set_fastpath_enabled(True)
unchecked = copy_of(enable_nested_tensor=True, mask_check=False)
worst_errors(grads_for(unchecked), reference, 1e-5, "mask_check=False, vs loop")
with warnings.catch_warnings(action="ignore"):  # "enable_nested_tensor is True, but"
    pre_norm = copy_of(enable_nested_tensor=True, norm_first=True)
print("pre-norm, enable_nested_tensor=True: runs,", len(grads_for(pre_norm)), "tensors")

# %%
# **Dropout** (:ref:`the pitfalls page <sphx_glr_auto_examples_guides_plot_pitfalls.py>`,
# section 5). :class:`~torch.nn.TransformerEncoderLayer` has ``dropout=0.1`` by default. In
# training mode, ``vmap`` refuses to draw random numbers until ``randomness=`` says whether
# sequences share one dropout mask (``"same"``) or draw their own (``"different"``, as a loop).
model.train()
expect("training mode, randomness='error' (the default)", RuntimeError, "randomness",
       lambda: grads_for(model))  # fmt: skip
dropout_grads = grads_for(model, randomness="different")
model.eval()
print("training mode, randomness='different': runs,", len(dropout_grads), "tensors")

# %%
# **The fused CPU attention kernel** is not an error but a fallback. Without
# ``sdpa_kernel(SDPBackend.MATH)``, a 4-D float32 attention call on the CPU goes to
# ``aten::_scaled_dot_product_flash_attention_for_cpu`` (with ``dropout_p > 0``, to the math
# path instead), which has no batching rule, forward or backward: ``vmap`` warns and falls back
# to calling it once per sequence. PyTorch PR #133964 added batching rules for the math backend
# (closing pytorch#108065's "performance drop" warning: the recipe asserts none) and for the
# forward passes of fused CUDA kernels; the CPU kernel is not among them. The profiler, checked
# first on plain calls, counts forward calls: the math backend runs one softmax per attention
# layer for all sequences; the fused kernel, per layer, the call ``vmap`` intercepted and one
# per sequence. This runs on a CPU copy of the model. Masked fused CUDA kernels were reported
# failing under ``vmap`` on torch 2.6 (pytorch#151558): this page, on math, does not test them.
from torch.profiler import profile

FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"


def attention_calls(call):
    with profile() as prof:
        call()
    names = ("aten::_softmax", FUSED)
    return collections.Counter(e.name for e in prof.events() if e.name in names)


# The known answer: 3 softmax, 3 attention calls, 3 with dropout (math: one softmax each).
q = torch.randn(1, HEADS, MAX_LEN, WIDTH // HEADS)
known = attention_calls(lambda: [(F.softmax(q, -1), F.scaled_dot_product_attention(q, q, q),
    F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)) for _ in range(3)])  # fmt: skip
print(f"profiler, plain calls: {dict(known)}")
assert known == {"aten::_softmax": 3 + 3, FUSED: 3}, known
cpu_model = copy_of().cpu()
cpu_batch = ({k: v.cpu() for k, v in full_inputs.items()}, full_targets.cpu())
fused = {"backend": SDPBackend.FLASH_ATTENTION}  # the fused CPU kernel only
with warnings.catch_warnings(record=True, action="always") as fused_warnings:
    fused_grads = grads_for(cpu_model, cpu_batch, **fused)
    fused_calls = attention_calls(lambda: grads_for(cpu_model, cpu_batch, **fused))
messages = sorted({str(w.message).split(". Please")[0] for w in fused_warnings})
print("\n".join(f"  UserWarning: {m}" for m in messages))
assert any("flash_attention_for_cpu" in m for m in messages), messages
math_calls = attention_calls(lambda: grads_for(cpu_model, cpu_batch))
print(f"calls for {len(full_seqs)} sequences, math backend: {dict(math_calls)}")
print(f"calls for {len(full_seqs)} sequences, fused CPU kernel: {dict(fused_calls)}")
assert math_calls == {"aten::_softmax": 2}, math_calls
assert fused_calls == {FUSED: 2 * (len(full_seqs) + 1)}, fused_calls
worst_errors(fused_grads, {k: v.cpu() for k, v in reference.items()}, 5e-6,
             "fused CPU kernel under vmap vs loop")  # fmt: skip

# %%
# **FlexAttention** (attention-gym#25 asks whether it supports ``vmap``): not in torch 2.13
# eager on the CPU. ``vmap`` fails: its operator registers no ``vmap`` rule (its source has
# none, while ``cond`` and ``scan`` have one). ``grad`` fails sooner: the CPU has no backward.
from torch._dynamo.exc import TorchRuntimeError
from torch.nn.attention.flex_attention import flex_attention

qkv = torch.randn(3, 4, 1, HEADS, MAX_LEN, WIDTH // HEADS)  # 4 sequences, batches of 1
# Ignored: "flex_attention called without torch.compile() - this will use an unfused ..."
with warnings.catch_warnings(action="ignore"):
    expect("vmap(flex_attention)", TorchRuntimeError, "TransformType.Vmap",
           lambda: vmap(flex_attention)(*qkv))  # fmt: skip
    expect("grad(flex_attention) on the CPU", NotImplementedError, "backward on CPU",
           lambda: grad(lambda q, k, v: flex_attention(q, k, v).sum())(*qkv[:, 0]))  # fmt: skip

# %%
# Sequences of different lengths in one batch
# -------------------------------------------
# Each sequence is padded on the right with ``PAD`` up to ``MAX_LEN``; its padded targets are
# ``IGNORE``. The encoder's padding mask is ``attention_mask`` inverted: Hugging Face's marks a
# token to keep with 1, PyTorch's ``src_key_padding_mask`` one to ignore with ``True``. The
# attention block has none: under the causal mask a token sees itself and the tokens before
# it, and with padding on the right those are all real. So strictly neither block needs one
# (without the encoder's, the check below still passes; not inverted, it fails). The check:
# each padded sequence's gradient must equal the float64 gradient of the sequence alone.
lengths = torch.randint(3, MAX_LEN + 1, (8,), generator=generator).tolist()
seqs, inputs, targets = make_batch(lengths, generator)
print(f"lengths (inputs): {lengths}")
padded_grads = per_sequence_grads(params, inputs, targets)
padded_reference = loop_grads(model64, seqs)
worst_errors(padded_grads, padded_reference, 1e-5, "padded batch vs each one alone")


# %%
# Embeddings: dense, tied, sparse; memory
# ---------------------------------------
# A sequence looks up a few rows of the token embedding, so only those rows of its gradient can
# be non-zero. ``vmap(grad)`` still returns a dense (B, vocabulary, width) tensor. The check:
# a row is non-zero exactly where the sequence uses the token as an input (its last token is
# only a target), and the ``PAD`` row is zero. The output layer's gradient, by contrast, has a
# non-zero row for every token, through the softmax.
token_grads = padded_grads["tokens.weight"]
used = torch.zeros(len(seqs), VOCAB, dtype=torch.bool, device=device)
for row, seq in enumerate(seqs):
    used[row, seq[:-1]] = True
assert torch.equal(token_grads.ne(0).any(dim=-1), used), "a row is zero iff unused"
assert padded_grads["head.weight"].ne(0).any(dim=-1).all(), "every head row is non-zero"
print(f"tokens.weight per-sample gradient {tuple(token_grads.shape)}: of its "
      f"{used.numel()} rows, {used.sum().item()} ({used.float().mean().item():.0%}) "
      "are used; every other row is exactly zero")  # fmt: skip

# %%
# **Tied, GPT-2 style**: the output layer reuses the token table. ``named_parameters()`` lists
# the shared tensor once, as ``tokens.weight``; ``functional_call`` puts what we pass under that
# name in both places, so its per-sample gradient adds both uses, and no row is zero.
# ``state_dict()`` lists both names, as two tensors: passing it raises a ``ValueError``
# (:ref:`troubleshooting <sphx_glr_auto_examples_guides_plot_troubleshooting.py>`).
tied = copy_of()
tied.head.weight = tied.tokens.weight  # the tie
tied_grads = grads_for(tied, (inputs, targets))
assert list(tied_grads) == [k for k in params if k != "head.weight"], list(tied_grads)
worst_errors(tied_grads, loop_grads(copy.deepcopy(tied).double(), seqs), 1e-5,
             "tied output layer vs loop")  # fmt: skip
assert tied_grads["tokens.weight"].ne(0).any(dim=-1).all(), "tied: every row non-zero"
expect("functional_call(tied, tied.state_dict(), ...)", ValueError, "are tied",
       lambda: functional_call(tied, tied.state_dict(), (), inputs))  # fmt: skip

# %%
# **Sparse**: ``nn.Embedding(sparse=True)`` fails under ``vmap(grad)``, not under ``grad``.
# The operator that builds its sparse gradient has no batching rule (``vmap`` warns and falls
# back); then an ``aten::view`` meets a sparse tensor. The flag sets only the gradient's layout
# (checked on one sequence): for the per-sample pass, set it to ``False``, as this page does.
sparse = copy_of()
sparse.tokens.sparse = True
with warnings.catch_warnings(action="ignore"):  # "performance drop": sparse_coo
    expect("nn.Embedding(sparse=True)", NotImplementedError, "'Sparse",
           lambda: grads_for(sparse, (inputs, targets)))  # fmt: skip
alone = grad(functools.partial(sequence_loss, net=sparse))  # one sequence, no vmap
table = alone(params, {k: v[0] for k, v in inputs.items()}, targets[0])["tokens.weight"]
assert table.is_sparse and torch.allclose(table.to_dense(), token_grads[0])

# %%
# **Memory.** ``vmap(grad)`` returns B × P floats: every parameter's gradient for every
# sequence. Three ways down: ``vmap``'s ``chunk_size``
# (:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_memory.py`), a
# subset of the parameters
# (:ref:`sphx_glr_auto_examples_models_as_functions_plot_choosing_what_to_differentiate.py`),
# or per-sample norms only
# (:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_dp_sgd_ghost_norms.py`).
P = sum(p.numel() for p in params.values())
print(f"B x P here: {len(seqs)} x {P:,} floats, {len(seqs) * P * 4 / 1e6:.1f} MB")
gpt2 = 50257 * 768 + 1024 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768  # GPT-2 small
print(f"GPT-2 small's {gpt2:,} parameters: {gpt2 * 4 / 1e9:.2f} GB per sequence, "
      f"{50257 * 768 * 4 / 1e6:.0f} MB of it the token table (50,257 x 768)")  # fmt: skip


# %%
# Cost
# ----
# Per-sequence gradients of a padded batch of 16 by a float32 loop of :func:`torch.autograd.grad`
# over the unpadded sequences, by the recipe (on the CPU also on the fused CPU kernel), and, as
# a yardstick, one backward pass for the mean gradient. :class:`torch.utils.benchmark.Timer`,
# all threads, after a warm-up call; the spread is the interquartile range (IQR) over blocks.
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73", "batched": "#666666"}
time_seqs, time_inputs, time_targets = make_batch(
    torch.randint(3, MAX_LEN + 1, (16,), generator=generator).tolist(), generator
)


def batched_backward():
    loss = F.cross_entropy(model(**time_inputs).flatten(0, 1), time_targets.flatten(),
                           ignore_index=IGNORE)  # fmt: skip
    return torch.autograd.grad(loss, list(model.parameters()))


candidates = {
    "loop": lambda: loop_grads(model, time_seqs),
    "vmap": lambda: per_sequence_grads(params, time_inputs, time_targets),
    "batched": batched_backward,
}
if not torch.cuda.is_available():  # the fused CPU kernel, timed on the CPU only
    candidates["vmap, fused CPU kernel"] = lambda: grads_for(
        model, (time_inputs, time_targets), **fused
    )
PHRASES = {"loop": "the loop", "vmap": "vmap(grad)",
           "vmap, fused CPU kernel": "vmap(grad) on the fused CPU kernel",
           "batched": "one batched backward"}  # fmt: skip


def measure(call):  # warm-up, then 7 blocks of n calls, n from a first estimate
    call()
    all_threads = {"num_threads": torch.get_num_threads()}
    clock = benchmark.Timer("call()", globals={"call": call}, **all_threads)
    per_call = clock.blocked_autorange(min_run_time=0.1).median
    blocks = [clock.timeit(max(1, round(0.05 / per_call))) for _ in range(7)]
    return benchmark.Measurement.merge(blocks)[0]


timings = {}
with warnings.catch_warnings(action="ignore"):  # "There is a performance drop"
    for name, call in candidates.items():
        timings[name] = measure(call)
        median_ms, iqr_ms = timings[name].median * 1e3, timings[name].iqr * 1e3
        print(f"{name:23s} {median_ms:7.2f} ms (IQR {iqr_ms:.3g} ms, 7 blocks)")


def compare(method, reference):  # a sentence worded by the ratio, from the same run
    ratio = timings[method].median / timings[reference].median
    if ratio <= 1:
        return f"{PHRASES[method]} is {1 / ratio:.1f}x faster than {PHRASES[reference]}"
    return f"{PHRASES[method]} takes {ratio:.1f}x the time of {PHRASES[reference]}"


print(compare("vmap", "loop"))
print(compare("vmap", "batched"))
if "vmap, fused CPU kernel" in timings:
    print(compare("vmap, fused CPU kernel", "vmap") + " on the math backend")

# %%
# Bars are medians; whiskers run from the first to the third quartile of the blocks. The loop
# pays each operation's fixed cost (Python, the dispatcher, on a GPU a kernel launch) once per
# sequence, probably most of its time at this size; ``vmap`` and the batched backward, once.
drawn = [name for name in PHRASES if name in timings]  # the batched backward last
times = torch.tensor([timings[name].times for name in drawn], dtype=torch.float64) * 1e3
low, medians, high = times.quantile(torch.tensor([0.25, 0.5, 0.75]).double(), dim=1)
fig, ax = plt.subplots(figsize=(7, 2.6), layout="constrained")
ax.barh(drawn, medians, xerr=torch.stack([medians - low, high - medians]),
        color=[METHOD_COLORS[name.split(",")[0]] for name in drawn],
        hatch=["//" if "," in name else "" for name in drawn])  # fmt: skip
ax.invert_yaxis()
ax.set_xlabel(f"median time for {len(time_seqs)} sequences (ms)")
ax.set_title(f"{device.type.upper()}: {compare('vmap', 'loop')}")
plt.show()

# %%
# What to remember
# ----------------
# * ``vmap(grad(loss of one sequence))`` over :func:`~torch.func.functional_call`, the keyword
#   inputs as ``kwargs``, the loss over real targets only: a padded sequence's gradient is its own.
# * :class:`~torch.nn.TransformerEncoder` fails under ``vmap`` at its nested-tensor check
#   (pytorch#149609): the fast path off skips it (here ``mask_check=False`` too). ``randomness=``.
# * Pin ``SDPBackend.MATH`` (the fused CPU kernel runs once per sequence); FlexAttention: no vmap.
# * Embeddings: a dense B × vocabulary × width gradient; tied, one name; ``sparse=True`` fails.
# * Memory: B × P floats. ``chunk_size``, a subset of the parameters, or norms only.
