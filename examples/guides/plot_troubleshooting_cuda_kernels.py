"""
Troubleshooting, part 8: errors only CUDA raises, from cuDNN RNNs and fused attention
=====================================================================================

Three errors that torch.func transforms raised on an H100 with torch 2.11, in calls the CPU runs:
an attention mask that ``vmap`` does not map, Jacobian rows through ``nn.RNN`` or ``nn.GRU``,
and ``jacrev`` or per-sample gradients of an ``nn.LSTM``. Each section runs a small version of
what users reported: on CUDA it asserts torch 2.11's error or, where this torch runs the call,
checks the result and says so; on the CPU it checks that the call runs. Then the fixes, checked
against float64 loops on the CPU, and their costs. Titles: the message's first words, A to Z.
Part 1: :doc:`plot_troubleshooting`; part 7: :doc:`plot_troubleshooting_indices_and_batched_grads`.
"""

import copy
import re
import textwrap
import warnings
from contextlib import nullcontext
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.patches import Patch
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.benchmark import Measurement, Timer

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
on_cuda = device.type == "cuda"
where = torch.cuda.get_device_name() if on_cuda else "CPU"  # named with the timings
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
cudnn_rnns = on_cuda and torch.backends.cudnn.is_available()  # RNNs call cuDNN there
torch.backends.cudnn.allow_tf32 = False  # cuDNN's float32 without TF32; CPU: no-op
METHOD_COLORS = {"vmap": "#009E73", "vmap fallback": "#DDCC77", "loop": "#D55E00"}
F32_BOUND = 5e-6  # float32 results against float64 references, relative


# %%
# attn_bias: wrong shape (batch dimension): an attention mask that vmap does not map
# ----------------------------------------------------------------------------------
# A ``RuntimeError`` from :func:`~torch.nn.functional.scaled_dot_product_attention` under ``vmap``
# when the queries are mapped and the mask is not: one mask shared by an ensemble's members
# (:func:`~torch.func.stack_module_state`, ``in_dims=None``; pytorch#151558), a mask made inside the
# mapped function with ``torch.ones`` (pytorch#161310), or per-sample gradients (vita-epfl/TAROT#3,
# whose reporter turned the flash and memory-efficient kernels off for the whole process:
# ``torch.backends.cuda.enable_flash_sdp(False)``, ``enable_mem_efficient_sdp(False)``). Here the
# per-sample case is ``vmap(grad(...))`` of ``functional_call`` with one mask for every sample.
class TwoHeadAttention(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads

    def forward(self, x, mask, causal=False):
        n, length, width = x.shape
        split = self.qkv(x).view(n, length, 3, self.heads, width // self.heads)
        q, k, v = split.permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
        return mixed.transpose(1, 2).reshape(n, length, width)


members = [TwoHeadAttention().to(device) for _ in range(3)]
member_weights, member_buffers = stack_module_state(members)
blank = TwoHeadAttention().to("meta")  # the structure; vmap brings the weights
member_out = lambda p, b, x, m: functional_call(blank, (p, b), (x, m))  # noqa: E731
member_loss = lambda p, b, x, m: member_out(p, b, x, m).pow(2).sum()  # noqa: E731
tokens = torch.randn(4, 8, 16, device=device)
keep = torch.rand(4, 1, 8, 8, device=device) > 0.3  # True: the query may see the key
keep[..., 0] = True  # every query sees at least one key
solo, fixed = members[0], keep[:1]  # one module; one mask for every sample
sample_attn = lambda p, x, m: functional_call(solo, p, (x[None], m)).pow(2).sum()  # noqa: E731
lower = lambda x: torch.ones(1, 1, 8, 8, dtype=torch.bool, device=x.device).tril()  # noqa: E731
made_inside = lambda x: solo(x[None], lower(x))[0]  # noqa: E731 (the mask made in the call)
causal_inside = lambda x: solo(x[None], None, causal=True)[0]  # noqa: E731 (the same, no mask)
both, solo_weights = (member_weights, member_buffers), dict(solo.named_parameters())
per_member = keep.expand(3, *keep.shape).contiguous()  # the mask, once per member
per_sample = fixed.expand(4, *fixed.shape).contiguous()  # once per sample
attn_calls = {  # label: (the call as written, mask unmapped; the second fix)
    "ensemble, vmap": (
        partial(vmap(member_out, (0, 0, None, None)), *both, tokens, keep),
        partial(vmap(member_out, (0, 0, None, 0)), *both, tokens, per_member)),
    "ensemble, vmap(grad)": (
        partial(vmap(grad(member_loss), (0, 0, None, None)), *both, tokens, keep),
        partial(vmap(grad(member_loss), (0, 0, None, 0)), *both, tokens, per_member)),
    "per-sample grads": (
        partial(vmap(grad(sample_attn), (None, 0, None)), solo_weights, tokens, fixed),
        partial(vmap(grad(sample_attn), (None, 0, 0)), solo_weights, tokens, per_sample)),
    "mask made inside": (
        partial(vmap(made_inside), tokens), partial(vmap(causal_inside), tokens)),
}  # fmt: skip


def raises(kind, words, call, label):  # exactly kind, its message holding words
    try:
        call()
    except kind as err:
        text = " ".join(f"{err}".split())
        assert type(err) is kind and words in text, f"{type(err).__name__}: {text}"
        print(f"  {label}: {kind.__name__}: {textwrap.shorten(text, 100)}")
        return
    raise AssertionError(f"{label}: no {kind.__name__} in torch {torch.__version__}")


def as_cpu64(result):  # a tensor, or a dict, list or tuple of them: float64, CPU
    parts = [result] if torch.is_tensor(result) else result
    parts = parts.values() if isinstance(parts, dict) else parts
    return [part.detach().to("cpu", torch.float64) for part in parts]


def matches(label, got, want, bound=F32_BOUND):  # each tensor: gap / its largest entry
    gaps = []
    for mine, truth in zip(as_cpu64(got), as_cpu64(want), strict=True):
        assert mine.shape == truth.shape, f"{label}: {mine.shape} for {truth.shape}"
        gaps.append(((mine - truth).abs().max() / truth.abs().max()).item())
        assert gaps[-1] <= bound, f"{label}: error {gaps[-1]:.1e} > {bound:.0e}"
    worst, tensors = max(gaps), f", worst of {len(gaps)}" if len(gaps) > 1 else ""
    under = f"{bound / worst:.0f}x under it" if worst else "exact"
    print(f"  {label}: error {worst:.1e} (bound {bound:.0e}, {under}{tensors})")


def fallbacks_in(call):  # runs call; its result, and the ops vmap's fallback ran
    with warnings.catch_warnings(record=True, action="always") as noted:
        result = call()
    said = [str(w.message) for w in noted]
    named = (re.search(r"batching rule for (aten::\w+)", text) for text in said)
    return result, sorted({hit.group(1) for hit in named if hit}) or ["none"]


def outcome(label, call, want, error, may_raise, ran_on_211=True):  # two outcomes
    kind, words = error  # its error where it raises, or a result equal to want
    try:
        result, fell_back = fallbacks_in(call)
    except kind as err:
        text = " ".join(f"{err}".split())
        assert may_raise and type(err) is kind and words in text, f"{label}: {text}"
        print(f"  {label}: {kind.__name__}: {textwrap.shorten(text, 90)}")
        return []
    matches(label, result, want)
    if may_raise:  # which calls the H100 ran with torch 2.11: the probe's list
        seen = "torch 2.11 raised it" if ran_on_211 else "not run with torch 2.11"
        print(f"    torch {torch.__version__} runs it here ({seen})")
    return fell_back


def on_cpu64(module):  # the reference's model: a float64 copy on the CPU
    return copy.deepcopy(module).to("cpu", torch.float64)


def one_by_one(outputs, wrt):  # the reference: one autograd.grad per output entry
    rows = [torch.autograd.grad(o, wrt, retain_graph=True) for o in outputs.flatten()]
    return [torch.stack(g).view(*outputs.shape, *g[0].shape) for g in zip(*rows)]


# The reference: loops over float64 copies (members, samples), autograd.grad for each
copies = [on_cpu64(member) for member in members]
solo64, tokens64, keep64 = copies[0], tokens.to("cpu", torch.float64), keep.cpu()
fixed64 = keep64[:1]
grads_of = lambda loss, twin: torch.autograd.grad(loss, list(twin.parameters()))  # noqa: E731
stacked = lambda rows: [torch.stack(per_name) for per_name in zip(*rows)]  # noqa: E731
by_member = [grads_of(twin(tokens64, keep64).pow(2).sum(), twin) for twin in copies]
by_sample = [grads_of(solo64(s[None], fixed64).pow(2).sum(), solo64) for s in tokens64]
truth = {
    "ensemble, vmap": torch.stack([twin(tokens64, keep64) for twin in copies]),
    "ensemble, vmap(grad)": stacked(by_member),
    "per-sample grads": stacked(by_sample),
    "mask made inside": torch.stack([solo64(s[None], lower(s))[0] for s in tokens64]),
}  # fmt: skip
bias_error = (RuntimeError, "attn_bias: wrong shape (batch dimension)")
for label, (as_written, _) in attn_calls.items():
    ran = label.startswith("ensemble")  # the H100 ran the ensemble's calls only
    fell_back = outcome(label, as_written, truth[label], bias_error, on_cuda, ran)
    if not on_cuda:  # no batching rule for the CPU's fused kernel: vmap loops over it
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in fell_back
        print(f"    vmap looped for: {', '.join(fell_back)}")

# %%
# The H100 with torch 2.11.0+cu130 raised it for the ensemble by default, under
# ``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)`` and for ``vmap(grad)``, with a boolean or a float
# mask (in float16 the message was "The expanded size of the tensor (12) must match the existing
# size (4)"; this page runs float32 only); the other two calls were not run there. Why, in pytorch
# PR #188764 (fixing #161310): vmap's rule for the memory-efficient kernel folds the mapped
# dimension into the batch of queries, keys and values (3 members × 4) but passed an unmapped mask
# on with its own batch (4), which the kernel checks. PR #176265 (open when this was written)
# names #151558. ``FLASH_ATTENTION`` and ``CUDNN_ATTENTION`` said "No available kernel" there even
# unmasked: they take no float32, not vmap's doing. On the CPU the fused kernel has no batching
# rule, so vmap calls it once per member or sample (asserted), with a mask as long as its batch.
#
# Two fixes, each checked in float32 against the loop (the H100 ran both for the ensemble's
# forward). The first, for every case: the MATH backend, whose matrix products vmap batches (no
# fallback: asserted), as ``with sdpa_kernel(SDPBackend.MATH):`` around the call as written. The
# second, where the mask is an input: map it like the queries, passed positionally (``in_dims``
# maps positional arguments only: a mask given by keyword reaches each member whole and fails
# further on, asserted with the CPU's float64 copies). For the ensemble,
# ``vmap(member_out, (0, 0, None, 0))(*both, tokens, keep.expand(3, *keep.shape).contiguous())``;
# per sample, ``in_dims=(None, 0, 0)`` and ``fixed.expand(4, *fixed.shape).contiguous()``. A causal
# mask made inside can go: ``is_causal=True`` without a mask gives the same (checked; not run on
# the H100). On CUDA the second runs under ``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)``.
for label, (as_written, fix_2) in attn_calls.items():
    with sdpa_kernel(SDPBackend.MATH):
        result, fell_back = fallbacks_in(as_written)
    matches(f"{label}, MATH backend", result, truth[label])
    assert fell_back == ["none"], fell_back
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if on_cuda else nullcontext():
        result, fell_back = fallbacks_in(fix_2)
    fix = "is_causal=True, no mask" if "inside" in label else "mask mapped"
    matches(f"{label}, {fix}", result, truth[label])
    print(f"    vmap's fallback ran: {', '.join(fell_back)}")
by_keyword = vmap(member_out, in_dims=(0, 0, None))  # no in_dims entry for m
mask_kw = partial(by_keyword, *stack_module_state(copies), tokens64, m=per_member.cpu())
raises(RuntimeError, "is invalid for input of size", mask_kw, "mask by keyword")

# %%
# Batching rule not implemented for aten::_cudnn_rnn_backward. We could not generate a fallback.
# ----------------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``torch.autograd.grad(..., is_grads_batched=True)`` with the rows of an
# identity, or from ``torch.vmap`` over ``autograd.grad`` (TorchJD's backward, for the Jacobian of
# several losses: TorchJD#220), through ``nn.RNN`` or ``nn.GRU`` on an H100 with torch
# 2.11.0+cu130 (the ``nn.LSTM`` call below was not run there). There the layers call cuDNN, whose
# backward, ``aten::_cudnn_rnn_backward``, has no batching rule, and vmap's fallback refuses an
# operator with a list of tensors among its arguments or results (as read in functorch's
# ``BatchedFallback.cpp``): this one takes the weights as a ``Tensor[]`` and returns one (its
# schema, printed). ``nn.LSTMCell``'s ``aten::lstm_cell`` takes a ``Tensor[]`` too, and on the CPU
# raises the same under ``torch.vmap`` and the older vmap of ``is_grads_batched`` (asserted).
#
# The fix, checked for each call, then the backward as before:
# ``with torch.backends.cudnn.flags(enabled=False): losses = model(x)[0].sum((1, 2))``. The
# forward picks the kernel and autograd records its backward then (on CUDA, cuDNN off around the
# backward alone is expected to raise; printed). ATen's own kernels run, whose backward vmap
# batches or loops over. The block turns cuDNN off for all in it, convolutions too: keep it to
# the recurrent layer (the H100 ran it around both passes, for ``nn.RNN``). TorchJD's documented
# ``parallel_chunk_size=1`` loops over ordinary backward passes, keeping cuDNN: both timed below.
kinds = (nn.RNN, nn.GRU, nn.LSTM)
rnn, gru, lstm = (kind(3, 4, batch_first=True).to(device) for kind in kinds)
sequences = torch.randn(2, 5, 3, device=device)
cudnn_off = partial(torch.backends.cudnn.flags, enabled=False)


def losses_jacobian(model, x, how, off_in=""):  # cuDNN off in "forward" or "backward"
    with cudnn_off() if off_in == "forward" else nullcontext():
        losses = model(x)[0].sum((1, 2))  # one loss per sequence
    params = list(model.parameters())
    eye = torch.eye(losses.numel(), dtype=losses.dtype, device=losses.device)
    with cudnn_off() if off_in == "backward" else nullcontext():
        if how == "is_grads_batched":
            return torch.autograd.grad(losses, params, eye, is_grads_batched=True)
        pull = lambda row: torch.autograd.grad(losses, params, row, retain_graph=True)  # noqa: E731
        return vmap(pull)(eye)


def losses_jacobian_loop(model, x):  # the reference: float64 copy, a grad per loss
    twin = on_cpu64(model)
    losses = twin(x.to("cpu", torch.float64))[0].sum((1, 2))
    return one_by_one(losses, list(twin.parameters()))


cudnn_error = (RuntimeError, "not implemented for aten::_cudnn_rnn_backward")
reported = [(rnn, "is_grads_batched"), (rnn, "torch.vmap"), (gru, "is_grads_batched")]
for model, how in [*reported, (lstm, "is_grads_batched")]:  # the last: not reported
    ran = model is not lstm  # the H100 ran the reported calls with torch 2.11
    label = f"nn.{type(model).__name__}, {how}"
    want, call = losses_jacobian_loop(model, sequences), partial(losses_jacobian, model)
    outcome(label, partial(call, sequences, how), want, cudnn_error, cudnn_rnns, ran)
    rows = call(sequences, how, off_in="forward")
    matches(f"  fix: cuDNN off in the forward, {label}", rows, want)
    if cudnn_rnns:  # the forward with cuDNN: its backward recorded, whatever the flags
        late = partial(call, sequences, how, off_in="backward")  # 2.11 did not run it
        outcome(f"  off in the backward, {label}", late, want, cudnn_error, True, False)
schema = torch.ops.aten._cudnn_rnn_backward.default._schema
lists = [a.name for a in schema.arguments if str(a.type) == "List[Tensor]"]
gives = [str(r.type) for r in schema.returns]
print(f"  aten::_cudnn_rnn_backward: List[Tensor] {lists} in; {', '.join(gives)} out")
assert lists and "List[Tensor]" in gives
cell_on_cpu = partial(vmap(nn.LSTMCell(3, 4)), sequences.cpu())  # aten::lstm_cell
no_fallback = "We could not generate a fallback"
raises(RuntimeError, no_fallback, cell_on_cpu, "nn.LSTMCell, CPU")
older_vmap = torch._vmap_internals._vmap(nn.LSTMCell(3, 4))  # is_grads_batched's
raises(RuntimeError, no_fallback, partial(older_vmap, sequences.cpu()), "older vmap")

# %%
# Cannot access data pointer of Tensor that doesn't have storage: recurrent layers' weights
# -----------------------------------------------------------------------------------------
# A ``RuntimeError`` on CUDA from ``jacrev`` of ``functional_call`` over ``nn.LSTM`` with respect
# to the parameters (pytorch#103161) and from ``vmap(grad)`` of per-sample losses, in eval mode
# too; ``jacrev`` with respect to the input raises ``NotImplementedError``: "Cannot access storage
# of TensorWrapper" (an H100 with torch 2.11.0+cu130). ``jacfwd`` raised the first there too; this
# page leaves it out, since on the CPU in float32 it fails another way (oneDNN's LSTM has no
# forward AD). The first comes from ``RNNBase.flatten_parameters``, shared by the three layers:
# given new weights, it packs them for cuDNN, first reading each one's ``data_ptr()`` if all are
# on CUDA and cuDNN takes them (as read in ``torch/nn/modules/rnn.py``; with cuDNN off it returns
# before). A transform's weights are wrappers without storage, whose ``data_ptr()`` raises this
# on the CPU too (asserted); reading a wrapper's storage raises the input's message (asserted),
# probably in the C++ LSTM's cuDNN path. Also seen: ``nn.GRU`` under ``vmap(grad)`` on the H100
# (:ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads_recurrent.py`), and a
# fused scripted function (part 5,
# :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_compiled_scripted_seeded.py`). The fix,
# checked for each call (the H100 ran the first two), for instance
# ``with torch.backends.cudnn.flags(enabled=False): jac = jacrev(summed)(params, sequences)``;
# vmap may then loop over some kernels (each device's list printed).
params = dict(lstm.named_parameters())
summed = lambda p, x: functional_call(lstm, p, (x,))[0].sum(1)  # noqa: E731 (2, 4)
sample_loss = lambda p, s: functional_call(lstm, p, (s[None],))[0].pow(2).sum()  # noqa: E731
lstm_calls = {
    "jacrev, parameters": partial(jacrev(summed), params, sequences),
    "vmap(grad), per sample": partial(vmap(grad(sample_loss), (None, 0)), params, sequences),
    "jacrev, input": partial(jacrev(lambda x: lstm(x)[0].sum(1)), sequences),
}  # fmt: skip
twin, sequences64 = on_cpu64(lstm), sequences.to("cpu", torch.float64)
twin_params, inputs64 = list(twin.parameters()), sequences64.clone().requires_grad_()
per_sample_losses = torch.stack([twin(s[None])[0].pow(2).sum() for s in sequences64])
expected = {
    "jacrev, parameters": one_by_one(twin(sequences64)[0].sum(1), twin_params),
    "vmap(grad), per sample": one_by_one(per_sample_losses, twin_params),
    "jacrev, input": one_by_one(twin(inputs64)[0].sum(1), inputs64),
}
pointerless = (RuntimeError, "data pointer of Tensor that doesn't have storage")
wrapper_storage = (NotImplementedError, "Cannot access storage of TensorWrapper")
for label, call in lstm_calls.items():
    error = wrapper_storage if label == "jacrev, input" else pointerless
    outcome(label, call, expected[label], error, cudnn_rnns)
    with torch.backends.cudnn.flags(enabled=False):  # the fix
        result, fell_back = fallbacks_in(call)
    matches(f"  fix: cuDNN off, {label}", result, expected[label])
    print(f"      vmap's fallback ran: {', '.join(fell_back)}")
if cudnn_rnns:  # eval mode: the same call
    lstm.eval()
    wanted = expected["jacrev, parameters"]
    outcome("eval mode", lstm_calls["jacrev, parameters"], wanted, pointerless, True)
    lstm.train()
bias_on_cpu = params["bias_ih_l0"].detach().cpu()  # a weight, read under grad
reads_pointer = lambda w: w.sum() + 0 * w.data_ptr()  # noqa: E731
raises(*pointerless, partial(grad(reads_pointer), bias_on_cpu), "data_ptr()")
reads_storage = lambda w: w.sum() + 0 * len(w.untyped_storage())  # noqa: E731
raises(*wrapper_storage, partial(grad(reads_storage), bias_on_cpu), "untyped_storage()")

# %%
# Choosing a fix: what each costs
# -------------------------------
# Each fix timed on the device printed, after a warm-up, on all threads, its result checked
# first against a float64 loop. The ensemble (3 members, 64 sequences of 8 tokens): the MATH
# backend, a mask per member, a loop over the members. The Jacobian of 16 sequences' losses
# through a wider ``nn.RNN``: ``torch.vmap`` over ``autograd.grad`` with cuDNN off in the
# forward, against 16 backward passes with the default kernels (cuDNN's on CUDA), as TorchJD's
# ``parallel_chunk_size=1`` runs them (its changelog, 0.4.0; ``backward``'s docs); on the CPU,
# without cuDNN, the batched call against the loop. ``nn.LSTM`` with cuDNN off makes vmap loop
# over some kernels (the lists above), so a loop may cost less there (not timed). Colours: did
# vmap batch or fall back to its loop. The times hold for these sizes and device.
crowd = torch.randn(64, 8, 16, device=device)
crowd_keep = torch.rand(64, 1, 8, 8, device=device) > 0.3
crowd_keep[..., 0] = True
crowd_masks = crowd_keep.expand(3, *crowd_keep.shape).contiguous()
crowd64 = crowd.to("cpu", torch.float64)
wide = nn.RNN(8, 32, batch_first=True).to(device)
streams = torch.randn(16, 20, 8, device=device)
shared_mask = vmap(member_out, in_dims=(0, 0, None, None))  # in_dims None: shared
math_backend = sdpa_kernel(SDPBackend.MATH)(shared_mask)  # the block, as a decorator
mask_each = vmap(member_out, in_dims=(0, 0, None, 0))  # a mask per member: in_dims 0
ENSEMBLE, JACOBIAN = "ensemble of 3 attention modules", "Jacobian of 16 losses, nn.RNN"
fixes = {  # panel -> [(fix, the method its colour names, the call)]
    ENSEMBLE: [
        ("vmap, MATH backend", "vmap", partial(math_backend, *both, crowd, crowd_keep)),
        ("vmap, a mask per member", "vmap", partial(mask_each, *both, crowd, crowd_masks)),
        ("loop over the members", "loop",
         lambda: torch.stack([member(crowd, crowd_keep) for member in members])),
    ],
    JACOBIAN: [
        ("vmap, cuDNN off (forward)", "vmap",
         partial(losses_jacobian, wide, streams, "torch.vmap", off_in="forward")),
        ("loop of backward passes", "loop",
         lambda: one_by_one(wide(streams)[0].sum((1, 2)), list(wide.parameters()))),
    ],
}  # fmt: skip
truths = {ENSEMBLE: torch.stack([twin(crowd64, crowd_keep.cpu()) for twin in copies])}
truths[JACOBIAN] = losses_jacobian_loop(wide, streams)
timed, drawn, threads = {}, {}, torch.get_num_threads()
print(f"Timed on {where}, {threads} threads")
for panel, entries in fixes.items():
    print(panel)
    for name, method, call in entries:
        result, fell_back = fallbacks_in(call)  # the warm-up; vmap's warnings caught
        matches(name, result, truths[panel])
        looped = method == "vmap" and fell_back != ["none"]
        drawn[panel, name] = "vmap fallback" if looped else method
        timer = Timer("call()", globals={"call": call}, num_threads=threads)
        with warnings.catch_warnings(action="ignore"):  # vmap's fallback warnings
            took = timer.blocked_autorange(min_run_time=0.3)
            while len(took.times) < 5:  # a slow call fills few blocks: 5, for a spread
                took = Measurement.merge([took, timer.timeit(took.number_per_run)])[0]
        timed[panel, name] = took
        spread = f"IQR {took.iqr * 1e3:.3g} ms, {len(took.times)} blocks"
        print(f"    {took.median * 1e3:.3f} ms ({spread}), as {drawn[panel, name]}")
pairs = [(ENSEMBLE, "vmap, MATH backend", "vmap, a mask per member"),
         (ENSEMBLE, "vmap, a mask per member", "loop over the members"),
         (JACOBIAN, "vmap, cuDNN off (forward)", "loop of backward passes")]  # fmt: skip
for panel, *pair in pairs:  # worded so that the printed ratio is 1 or more
    slower, faster = sorted(pair, key=lambda name: -timed[panel, name].median)
    ratio = timed[panel, slower].median / timed[panel, faster].median
    print(f'  "{slower}" takes {ratio:.2f}x the time of "{faster}"')

# %%
# The times: each bar a median, its whisker the interquartile range.
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
for ax, (panel, entries) in zip(axes, fixes.items()):
    took = [timed[panel, name] for name, _, _ in entries]
    medians = np.array([t.median for t in took]) * 1e3
    quartiles = np.array([np.quantile(t.times, [0.25, 0.75]) for t in took]).T * 1e3
    colors = [METHOD_COLORS[drawn[panel, name]] for name, _, _ in entries]
    names, whiskers = [n for n, _, _ in entries], np.abs(quartiles - medians)
    ax.barh(names, medians, color=colors, xerr=whiskers, ecolor="black")
    ax.set(title=panel, xlabel=f"ms per call, {where}")
    ax.invert_yaxis()
keys = [Patch(color=METHOD_COLORS[m], label=m) for m in sorted(set(drawn.values()))]
fig.legend(handles=keys, loc="outside lower center", ncols=len(keys))
fig.suptitle(f"What each fix costs per call on {where}: median and IQR")
plt.show()

# %%
# What to remember
# ----------------
# * These errors come from paths only CUDA takes: cuDNN's recurrent kernels (and the check for
#   them in ``flatten_parameters``), and the memory-efficient attention kernel's batching rule
#   (the CPU's kernel has none: vmap loops). When only the GPU fails, run the code on the CPU.
# * To batch backward passes through ``nn.RNN``, ``nn.GRU`` or ``nn.LSTM``, run the forward in
#   ``cudnn.flags(enabled=False)``, or loop (TorchJD's ``parallel_chunk_size=1``), keeping cuDNN.
# * For an attention mask that vmap does not map, ``SDPBackend.MATH`` fixed every case here; a
#   mask mapped like the queries, passed positionally, fixed those where it is an input.
# * Check a GPU fix against a float64 loop on the CPU (here in float32), and build such pages on
#   CUDA too: a torch release that fixes or moves an error then shows up.
