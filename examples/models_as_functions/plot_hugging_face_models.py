"""
Hugging Face models: per-example gradients, padding masks and tied weights
==========================================================================

Per-example gradients of a tiny ``transformers`` BERT classifier on a padded batch, by
``vmap(grad(loss))`` over :func:`~torch.func.functional_call` with the model's keyword inputs,
checked tensor by tensor against a float64 loop. Then why a 2-D ``attention_mask`` fails under
:func:`~torch.func.vmap` in transformers 5.24, why eager attention fixes GPT-2 but not BERT,
which 4-D mask a causal model needs, GPT-2's tied embedding under ``functional_call``, and what
differentiating only the head and the LayerNorms saves. The models are built from a config,
with random weights: nothing is downloaded.
"""

# %%
# Setup: a tiny BERT classifier built from a config
# -------------------------------------------------
# ``from_pretrained`` would load real weights into the same classes; the code below does not
# change. Evaluation mode turns dropout off (with it on, ``vmap`` needs ``randomness=``).
import copy
import functools
import traceback

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import transformers
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
VOCAB, LABELS, LONGEST, PAD = 100, 3, 12, 0
bert_config = transformers.BertConfig(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=LONGEST, num_labels=LABELS, pad_token_id=PAD,
)  # fmt: skip
bert = transformers.BertForSequenceClassification(bert_config).to(device).eval()
attention = bert.config._attn_implementation  # sdpa: scaled_dot_product_attention
print(f"transformers {transformers.__version__}, attention: {attention}")

lengths = [12, 3, 7, 12, 5, 9, 2, 10]  # real tokens per example; the rest is padding
input_ids = torch.full((len(lengths), LONGEST), PAD)
keep = torch.zeros_like(input_ids)  # Hugging Face's 2-D attention_mask: 1 = real
for row, length in enumerate(lengths):
    input_ids[row, :length], keep[row, :length] = torch.randint(1, VOCAB, (length,)), 1
labels = torch.randint(0, LABELS, (len(lengths),))
batch = input_ids, keep, labels = [t.to(device) for t in (input_ids, keep, labels)]


# %%
# The recipe: a 4-D additive mask, the inputs as ``kwargs``
# ---------------------------------------------------------
# ``vmap`` hands the loss one example without its batch dimension, so the loss adds a batch of
# one (``[None]``) and passes the keyword inputs through ``functional_call(..., kwargs=...)``.
# The mask goes in 4-D, shape (1, 1, 1, length): 0 where a key is attended, the dtype's lowest
# value where it is padding. transformers passes a 4-D mask on as given
# (``_preprocess_mask_arguments`` in ``masking_utils.py``), so the check that fails under
# ``vmap`` on a 2-D mask (next sections) never runs. It also replaces the model's whole mask:
# right for BERT, which attends both ways; a causal model needs more (the GPT-2 section).
# ``SDPBackend.MATH`` keeps attention on the backend with batching rules (fused kernels:
# :ref:`the transformer page
# <sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_transformer.py>`).
def additive_mask(real):  # (length,) of 1 and 0 -> (1, 1, 1, length) of 0 and min
    lowest = torch.finfo(torch.float32).min
    return torch.where(real.bool(), 0.0, lowest)[None, None, None, :]


def example_loss(params, ids, real, label, net=bert, mask_of=additive_mask):
    inputs = dict(input_ids=ids[None], attention_mask=mask_of(real), labels=label[None])
    with sdpa_kernel(SDPBackend.MATH):
        return functional_call(net, params, args=(), kwargs=inputs).loss


per_example = vmap(grad(example_loss), in_dims=(None, 0, 0, 0))
weights = {name: p.detach() for name, p in bert.named_parameters()}
grads = per_example(weights, *batch)
print(f"{len(weights)} tensors, {sum(w.numel() for w in weights.values()):,} parameters;",
      "classifier.weight", tuple(weights["classifier.weight"].shape), "->",
      tuple(grads["classifier.weight"].shape))  # fmt: skip


# %%
# The check: a float64 loop over the examples, unpadded
# -----------------------------------------------------
# The reference runs a float64 copy of the model on each example alone, cut to its real length
# and without any mask, computes the loss from the logits itself (not ``labels=``) and calls
# :func:`torch.autograd.grad` once per example. Each tensor is compared on its own, by the
# worst relative error ``‖g_b − r_b‖ / ‖r_b‖`` over the examples ``b``. The key biases are the
# exception: a key bias adds one number to a whole row of scores, which the softmax ignores, so
# their exact gradient is zero (below 1e-15 of the example's whole gradient in float64); for
# them the error is measured against the norm of the example's whole gradient.
def float64_loop(net, rows, loss_of):
    net64, found = copy.deepcopy(net).double(), []
    for row in rows:
        found.append(torch.autograd.grad(loss_of(net64, row), list(net64.parameters())))
    names = [name for name, _ in net64.named_parameters()]
    return {name: torch.stack(g) for name, g in zip(names, zip(*found))}


def bert_loss(net, row):
    logits = net(input_ids=input_ids[row, None, : lengths[row]]).logits
    return F.cross_entropy(logits, labels[row, None])


def errors_per_tensor(got, want):
    whole = torch.cat([w.flatten(1) for w in want.values()], dim=1).norm(dim=1)
    errors = {}
    for name, w in want.items():
        miss = (got[name].double() - w).flatten(1).norm(dim=1)
        size = w.flatten(1).norm(dim=1)
        if name.endswith("key.bias"):
            assert (size < 1e-15 * whole).all(), f"{name}: not zero"
            size = whole
        errors[name] = (miss / size).max().item()
    return errors


def within(what, errors, bound):
    name = max(errors, key=errors.get)
    print(f"{what}: worst {name}, {errors[name]:.1e} (bound {bound:.0e}, "
          f"margin {bound / errors[name]:.0f}x)")  # fmt: skip
    too_far = {n: f"{e:.1e}" for n, e in errors.items() if not e < bound}
    assert not too_far, f"{what}: above {bound:.0e}: {too_far}"


reference = float64_loop(bert, range(len(lengths)), bert_loss)
recipe_errors = errors_per_tensor(grads, reference)
within("recipe vs float64 loop", recipe_errors, 5e-6)

# %%
# Two ways to get it silently wrong, both run under ``vmap`` without complaint: no mask at all
# (padding is then attended), and a *boolean* 4-D mask with eager attention. Scaled dot-product
# attention reads ``True`` as "attend"; the eager attention adds the mask to the scores, so
# ``True`` adds 1 and ``False`` adds 0: real keys get e times padding's weight, and padding stays
# in. The additive float mask is right with both (the eager twin: ``set_attn_implementation``).
bert_eager = copy.deepcopy(bert)
bert_eager.set_attn_implementation("eager")


def grads_with(net, mask_of=additive_mask):
    loss = functools.partial(example_loss, net=net, mask_of=mask_of)
    return vmap(grad(loss), in_dims=(None, 0, 0, 0))(weights, *batch)


wrong = {
    "no attention_mask": (bert, lambda real: None),
    "boolean 4-D mask, eager": (bert_eager, lambda real: real.bool()[None, None, None]),
}
wrong_errors = {}
for what, (net, mask_of) in wrong.items():
    wrong_errors[what] = errors_per_tensor(grads_with(net, mask_of), reference)
    print(f"{what}: worst error {max(wrong_errors[what].values()):.2f}")
    assert max(wrong_errors[what].values()) > 1e-2, what
eager_errors = errors_per_tensor(grads_with(bert_eager), reference)
within("eager, additive mask", eager_errors, 5e-6)

# %%
# Each tensor's worst error over the eight examples, against the float64 loop. Rows marked ``*``
# are the key biases, whose error is relative to the whole gradient (their exact gradient is 0).
METHOD_COLORS = {"vmap": "#009E73"}
short = [n.replace("bert.", "").replace("encoder.layer.", "") + " *" * n.endswith("key.bias")
         for n in recipe_errors]  # fmt: skip
fig, ax = plt.subplots(figsize=(7, 7.5), layout="constrained")
ax.scatter(list(recipe_errors.values()), short, color=METHOD_COLORS["vmap"], s=18,
           label="vmap, 4-D additive mask (the recipe)", zorder=3)  # fmt: skip
for (what, errors), marker in zip(wrong_errors.items(), ["x", "+"]):
    ax.scatter(errors.values(), short, color="black", marker=marker, s=22, label=what)
ax.axvline(5e-6, color="black", linestyle="--", linewidth=1, label="the recipe's bound")
ax.set(xscale="log", xlabel="worst relative error over the examples, against float64")
ax.tick_params(axis="y", labelsize=6)
ax.invert_yaxis()
fig.legend(loc="outside lower center", ncol=2, fontsize="small")
ax.set_title(f"{device.type.upper()}: a tiny BERT's per-example gradients")
plt.show()


# %%
# The error a user hits first: a 2-D ``attention_mask``
# -----------------------------------------------------
# Passing the batch's own 2-D mask, as one would to the model, raises inside transformers.
# ``first_failure`` runs a call that must raise ``vmap``'s data-dependent-control-flow
# ``RuntimeError`` and returns the names of the last frames of its traceback.
def first_failure(call, frames=2):
    try:
        call()
    except RuntimeError as raised:
        assert "It looks like you're either (1) calling .item()" in str(raised), raised
        print(f"  RuntimeError: {str(raised).split(' or (2)')[0]} ...")
        where = traceback.extract_tb(raised.__traceback__)[-frames:]
        places = [f"{frame.filename.split('/')[-1]}:{frame.name}" for frame in where]
        print("  raised in", " -> ".join(places))
        return [frame.name for frame in where]
    raise AssertionError("no RuntimeError was raised")


print("BERT, sdpa attention, 2-D mask:")
frames = first_failure(lambda: grads_with(bert, lambda r: r[None]))
assert frames == ["sdpa_mask", "_ignore_bidirectional_mask_sdpa"], frames

# %%
# The cause, in ``masking_utils.py``: before building the 4-D mask, ``sdpa_mask`` asks
# ``_ignore_bidirectional_mask_sdpa`` whether it may skip it, so that PyTorch can pick a fused
# kernel, and that function tests ``padding_mask.all()``: a Python ``if`` on a tensor's values,
# which ``vmap`` cannot answer for a whole batch. It runs whatever the values are, padded or not.
#
# **Eager attention does not fix BERT.** MadryLab/trak#78 (2024) switched its BERT example to
# ``attn_implementation="eager"`` to avoid this. In 5.24, ``create_bidirectional_mask`` asks for
# the skip with either implementation, and ``eager_mask`` builds its mask by calling
# ``sdpa_mask``, which runs the same test. (The keyword goes to ``from_pretrained``,
# ``from_config`` or the config; a built model takes ``set_attn_implementation``.)
print("BERT, eager attention, 2-D mask:")
frames = first_failure(lambda: grads_with(bert_eager, lambda r: r[None]), frames=3)
assert frames == ["eager_mask", "sdpa_mask", "_ignore_bidirectional_mask_sdpa"], frames

# %%
# GPT-2: a causal model, padded on the left
# -----------------------------------------
# With ``sdpa``, ``create_causal_mask`` fails on a 2-D mask at a similar test,
# ``_ignore_causal_mask_sdpa`` (it calls ``fast_all(padding_mask)``). With eager attention,
# ``eager_mask`` turns the causal skip off and ``create_causal_mask`` does not ask for the other:
# no test runs. The rows are padded on the *left*: on the right, the causal mask already hides
# padding from every real token, and a check could not see the padding mask. ``position_ids``
# count real tokens only, as in the unpadded reference. ``labels=`` gets the inputs (the model
# shifts them), -100 where the token before is not real; ``loss_type`` silences a warning.
gpt2_config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=LONGEST, bos_token_id=1,
                                      eos_token_id=1)  # fmt: skip
gpt2 = transformers.GPT2LMHeadModel(gpt2_config).to(device).eval()
gpt2.loss_type = "ForCausalLM"
gpt2_eager = copy.deepcopy(gpt2)
gpt2_eager.set_attn_implementation("eager")
left_ids, left_keep = (
    torch.stack([r.roll(-n) for r, n in zip(t, lengths)]) for t in batch[:2]
)


def sequence_loss(params, ids, real, net, mask_of):
    targets = torch.where((real * F.pad(real[:-1], (1, 0))).bool(), ids, -100)[None]
    positions = (real.cumsum(0) - 1).clamp(min=0)[None]
    inputs = dict(input_ids=ids[None], attention_mask=mask_of(real), position_ids=positions,
                  labels=targets)  # fmt: skip
    with sdpa_kernel(SDPBackend.MATH):
        return functional_call(net, params, args=(), kwargs=inputs).loss


def lm_grads_of(net, mask_of=lambda real: real[None]):
    loss = functools.partial(sequence_loss, net=net, mask_of=mask_of)
    return vmap(grad(loss), in_dims=(None, 0, 0))(lm_weights, left_ids, left_keep)


def next_token_loss(net, row):
    ids = input_ids[row, None, : lengths[row]]
    return F.cross_entropy(net(input_ids=ids).logits[0, :-1], ids[0, 1:])


lm_weights = {name: p.detach() for name, p in gpt2.named_parameters()}
lm_reference = float64_loop(gpt2, range(len(lengths)), next_token_loss)
print("GPT-2, sdpa attention, 2-D mask:")
frames = first_failure(lambda: lm_grads_of(gpt2))
assert frames == ["sdpa_mask", "_ignore_causal_mask_sdpa"], frames
lm_errors = errors_per_tensor(lm_grads_of(gpt2_eager), lm_reference)
within("GPT-2, eager attention, 2-D mask, vs float64", lm_errors, 5e-6)


# %%
# **A 4-D mask replaces the causal mask too.** transformers returns it as given and adds no
# triangle, so BERT's (1, 1, 1, length) mask lets each GPT-2 token see the later ones, silently.
# A causal model needs (1, 1, length, length): a key is kept if it is real and not after the
# query. With it, the default ``sdpa`` model works under ``vmap``. Dropping the mask (eager) lets
# real tokens see the left padding, which the check catches.
def causal_mask(real):  # -> (1, 1, length, length): keep real keys not after the query
    kept = torch.ones(len(real), len(real), dtype=torch.bool, device=real.device).tril()
    return additive_mask(kept & real.bool())[0]


within("GPT-2, sdpa, causal 4-D mask, vs float64",
       errors_per_tensor(lm_grads_of(gpt2, causal_mask), lm_reference), 5e-6)  # fmt: skip
for what, net, mask_of in [("BERT's (1, 1, 1, L) mask, sdpa", gpt2, additive_mask),
                           ("no mask, eager", gpt2_eager, lambda real: None)]:  # fmt: skip
    worst = max(errors_per_tensor(lm_grads_of(net, mask_of), lm_reference).values())
    print(f"GPT-2, {what}: worst error {worst:.2f}")
    assert worst > 1e-2, what
# The reference takes its loss from the logits: ``labels=`` gives float32 even from a float64
# model (``ForCausalLMLoss`` in ``loss/loss_utils.py`` starts with ``logits.float()``).
by_labels = copy.deepcopy(gpt2).double()(input_ids=input_ids[:1], labels=input_ids[:1])
assert by_labels.loss.dtype == torch.float32, by_labels.loss.dtype


# %%
# Tied weights: GPT-2's ``lm_head`` and ``wte``
# ---------------------------------------------
# GPT-2's output layer is its token table: ``lm_head.weight is transformer.wte.weight``.
# ``named_parameters()`` lists it once, under ``transformer.wte.weight``; ``state_dict()`` under
# both names. ``functional_call`` with ``tie_weights=True`` (the default) puts a tensor passed
# under one name in both places; with ``False`` only there, and the head keeps its own table.
# (Both names at once, as ``state_dict()`` gives them, raise a ``ValueError``: :ref:`troubleshooting
# <sphx_glr_auto_examples_guides_plot_troubleshooting.py>`; ``strict=`` and other names:
# :ref:`sphx_glr_auto_examples_models_as_functions_plot_functional_call_in_practice.py`.)
TABLE = "transformer.wte.weight"
assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
assert TABLE in lm_weights and "lm_head.weight" not in lm_weights
assert {TABLE, "lm_head.weight"} <= set(gpt2.state_dict())
print(f"named_parameters: {len(lm_weights)} tensors, one of them {TABLE}")
table = torch.randn(VOCAB, 32, device=device)
tied_copy, untied_copy = copy.deepcopy(gpt2_eager), copy.deepcopy(gpt2_eager)
tied_copy.lm_head.weight = tied_copy.transformer.wte.weight = torch.nn.Parameter(table)
untied_copy.transformer.wte.weight = torch.nn.Parameter(table)  # the head keeps its own
for tie, module in [(True, tied_copy), (False, untied_copy)]:
    out = functional_call(gpt2_eager, {TABLE: table}, (input_ids,), tie_weights=tie)
    gap = (out.logits - module(input_ids).logits).abs().max().item()
    print(f"tie_weights={tie}: largest gap to the module built that way {gap:.1e}")
    assert gap == 0, gap  # the same operations on the same values

# %%
# The gradient of the tied table is the sum of its two uses. In float64, on a batch loss: the
# tied gradient from ``grad``, and the two uses apart, by passing the table under both names
# with ``tie_weights=False``, one tensor each.
gpt2_eager64 = copy.deepcopy(gpt2_eager).double()
tied64 = {name: p.detach() for name, p in gpt2_eager64.named_parameters()}


def batch_loss(params, tie_weights=True):
    ids = input_ids[[0, 3]]  # the two examples without padding
    out = functional_call(gpt2_eager64, params, (ids,), tie_weights=tie_weights)
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


tied_grad = grad(batch_loss)(tied64)[TABLE]
apart = grad(functools.partial(batch_loss, tie_weights=False))(
    tied64 | {"lm_head.weight": tied64[TABLE].clone()})  # fmt: skip
both = apart[TABLE] + apart["lm_head.weight"]
gap = ((tied_grad - both).norm() / both.norm()).item()
print(f"tied gradient vs the two uses' sum: relative error {gap:.1e} (bound 1e-13)")
assert gap < 1e-13, gap


# %%
# Per-example gradients of a subset: the head and the LayerNorms
# ---------------------------------------------------------------
# A full per-example gradient is as large as the model (B × P floats); a common way down is to
# differentiate a few tensors. ``grad`` differentiates ``split_loss``'s first argument,
# ``trained``; ``functional_call`` merges the tuple ``(trained, frozen)`` into one dict (the
# names must be distinct), and the module supplies any name not given (more:
# :ref:`sphx_glr_auto_examples_models_as_functions_plot_choosing_what_to_differentiate.py`).
# So that a loss which drops ``frozen`` fails the check, every value here comes from a second
# model with other random weights (as a fine-tuned copy's would be), and so does the reference.
def in_head(name):
    return name.startswith(("classifier.", "bert.pooler."))


def in_subset(name):
    return in_head(name) or "LayerNorm" in name


def split_loss(trained, frozen, ids, real, label):
    return example_loss((trained, frozen), ids, real, label)


per_example_subset = vmap(grad(split_loss), in_dims=(None, None, 0, 0, 0))


def parts(chosen, values=weights):
    return ({n: w for n, w in values.items() if chosen(n)},
            {n: w for n, w in values.items() if not chosen(n)})  # fmt: skip


other = transformers.BertForSequenceClassification(bert_config).to(device).eval()
other_weights = {name: p.detach() for name, p in other.named_parameters()}
other_reference = float64_loop(other, range(len(lengths)), bert_loss)
subset_grads = per_example_subset(*parts(in_subset, other_weights), *batch)
want = {n: r for n, r in other_reference.items() if in_subset(n)}
within(f"subset ({len(want)} tensors)", errors_per_tensor(subset_grads, want), 5e-6)


# %%
# What a subset saves
# -------------------
# Three sets: all, the head and the LayerNorms, the head alone. The first LayerNorm's gradient
# needs the backward pass through every encoder layer; the head's (pooler, classifier) none.
# The result's size, B × P floats, is counted: that saving does not depend on the machine.
# :class:`torch.utils.benchmark.Timer` on all threads after a warm-up, 5 rounds, each set once a
# round in an order rotated each round; median and IQR over a set's blocks. The time saved can be
# within the noise here, so each ratio prints its range over the rounds, and if they disagree.
sets = {"all": lambda name: True, "head + LayerNorms": in_subset, "head": in_head}
timers = {what: benchmark.Timer("call()", num_threads=torch.get_num_threads(), globals={
    "call": functools.partial(per_example_subset, *parts(chosen), *batch)})
    for what, chosen in sets.items()}  # fmt: skip
blocks, order = {what: [] for what in sets}, list(sets)
for timer in timers.values():
    timer.timeit(1)  # warm-up
for _ in range(5):
    for what in order:
        blocks[what].append(timers[what].blocked_autorange(min_run_time=0.05))
    order = order[1:] + order[:1]
times = {what: benchmark.Measurement.merge(found)[0] for what, found in blocks.items()}
for what, chosen in sets.items():
    floats = len(lengths) * sum(w.numel() for n, w in weights.items() if chosen(n))
    print(f"{what:18s} result {floats:7,} floats: {times[what].median * 1e3:6.2f} ms "
          f"(IQR {times[what].iqr * 1e3:.3g} ms, {len(times[what].times)} blocks)")  # fmt: skip


def worded(what, than):
    x = times[what].median / times[than].median
    rounds = [a.median / b.median for a, b in zip(blocks[what], blocks[than])]
    said = [f"takes {x:.1f}x the time of", f"is {1 / x:.1f}x faster than"][x < 1]
    return (f"{what} {said} {than} (time ratio per round {min(rounds):.2f} to {max(rounds):.2f}"
            + (": the rounds disagree)" if min(rounds) < 1 < max(rounds) else ")"))  # fmt: skip


print(worded("head + LayerNorms", "all"))
print(worded("head", "all"))

# %%
# What to remember
# ----------------
# * Per-example gradients of a Hugging Face model: ``vmap(grad(loss))`` over
#   ``functional_call(model, params, args=(), kwargs=...)``, each input with ``[None]`` added.
# * A 2-D ``attention_mask`` fails under ``vmap``: transformers tests ``padding_mask.all()``
#   before building the mask. A 4-D additive float mask (0 or the dtype's minimum) skips it and
#   replaces the whole mask: (1, 1, 1, L) for BERT, (1, 1, L, L) with the causal triangle for
#   GPT-2 (without it, causality is silently lost).
# * ``attn_implementation="eager"`` fixes GPT-2, not BERT; a boolean 4-D mask under eager
#   attention is silently wrong. Check against a float64 loop (loss from the logits), on padding
#   the mask acts on: on the left for a causal model.
# * Tied weights: one name in ``named_parameters()``; ``functional_call`` uses it in both places,
#   and its gradient is the sum of both uses.
# * A subset shrinks the B × P result: ``grad`` differentiates its argument ``trained``;
#   ``functional_call`` merges ``(trained, frozen)``.
