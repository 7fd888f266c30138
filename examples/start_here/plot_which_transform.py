"""
Which transform do I need?
==========================

Start from what you want to compute, and this page gives the ``torch.func`` recipe for it:
per-sample gradients, a tall and a wide Jacobian, a Hessian, a Hessian-vector product, a batch
of Jacobians, per-sample Jacobians with respect to parameters and the neural tangent kernel
they build, an ensemble of models, and many Jacobian-vector products at one point. Each runs
on one small classifier, is checked against a reference that does not use it (plain autograd
or a closed form) and names the page that teaches it; at the end, all are timed and counted.
"""

# %%
# A model, and one gradient per example
# -------------------------------------
# Two facts explain most recipes below. ``vmap(f)(x)`` computes what stacking ``f(x_i)`` over
# ``x.unbind(0)`` would, in one call. ``jacrev`` builds a Jacobian from one vector-Jacobian
# product per output (row), ``jacfwd`` from one Jacobian-vector product per input (column),
# all rows or columns in one ``vmap``-ed call; ``jacrev``'s ``chunk_size=`` bounds the memory.
# Other questions have pages of their own: :doc:`parameter subsets and mixed derivatives
# <../models_as_functions/plot_choosing_what_to_differentiate>`, :doc:`GRU and LSTM
# <../per_sample_gradients/plot_per_sample_grads_recurrent>`, :doc:`transformers
# <../per_sample_gradients/plot_per_sample_grads_transformer>`, :doc:`MAML
# <../models_as_functions/plot_maml>`, :doc:`physics <../science/plot_forces_and_laplacians>`,
# :doc:`a solver's answer <../science/plot_implicit_differentiation>`, :doc:`forward mode or
# the double-backward trick <../jacobians_and_curvature/plot_jvp_forward_mode>`.
import warnings
from collections import OrderedDict

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.patches import Patch
from torch import nn
from torch.func import (
    functional_call,
    grad,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    stack_module_state,
    vjp,
    vmap,
)
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


def classifier():
    encoder = nn.Sequential(
        nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()
    )
    return nn.Sequential(OrderedDict(encoder=encoder, head=nn.Linear(256, 10)))


model = classifier().to(device)
batch_size = 32
inputs = torch.randn(batch_size, 16, device=device)
labels = torch.randint(0, 10, (batch_size,), device=device)
named = dict(model.named_parameters())
params = {name: p.detach() for name, p in named.items()}
recipes = {}  # recipe name -> a call of it, timed at the end


# %%
# *Taught in* :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_per_sample_grads.py`.
# ``grad`` of one example's loss, mapped over the batch with ``vmap``; the parameters are
# shared (``in_dims=None``). The reference is a loop of ``torch.autograd.grad``, one example at
# a time, compared parameter by parameter, by name.
def sample_loss(p, x, y):
    return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])


per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))
per_sample = per_sample_grads(params, inputs, labels)


def relative_error(result, reference):
    return ((result - reference).norm() / reference.norm()).item()


losses = [F.cross_entropy(model(x[None]), y[None]) for x, y in zip(inputs, labels)]
rows = [torch.autograd.grad(loss, list(named.values())) for loss in losses]
loop_grads = dict(zip(named, map(torch.stack, zip(*rows))))
assert per_sample.keys() == loop_grads.keys()
errors = {n: relative_error(per_sample[n], loop_grads[n]) for n in named}
print(f"per-sample gradients: worst relative error {max(errors.values()):.1e}")
assert max(errors.values()) < 1e-5, errors
recipes["per-sample gradients"] = lambda: per_sample_grads(params, inputs, labels)

# %%
# A tall Jacobian: few inputs, many outputs
# -----------------------------------------
# *Taught in* :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_jacobians_hessians.py`.
# The 256 features with respect to one input of 16 numbers. ``jacfwd`` pushes 16 tangents,
# ``jacrev`` pulls 256 cotangents; the arithmetic this costs each is counted at the end. The
# reference is ``torch.autograd.functional.jacobian``, a loop of backward passes.
x0 = inputs[0]
tall_reference = torch.autograd.functional.jacobian(model.encoder, x0)
for transform in (jacfwd, jacrev):
    tall = transform(model.encoder)(x0)
    print(f"tall Jacobian {tuple(tall.shape)} by {transform.__name__}: relative error "
          f"{relative_error(tall, tall_reference):.1e}")  # fmt: skip
    assert relative_error(tall, tall_reference) < 1e-5
recipes["tall Jacobian, jacfwd"] = lambda: jacfwd(model.encoder)(x0)
recipes["tall Jacobian, jacrev"] = lambda: jacrev(model.encoder)(x0)

# %%
# A wide Jacobian: many inputs, few outputs
# -----------------------------------------
# *Taught in* the same page. The 10 logits with respect to the head's parameters (a weight of
# 10 × 256 and a bias of 10): ``jacrev`` pulls 10 cotangents, ``jacfwd`` pushes one tangent per
# parameter. The head is linear, so the Jacobian has a closed form: logit ``i`` depends on
# weight ``[i, k]`` through ``features[k]``, and on bias ``[i]`` with slope 1.
features = model.encoder(x0).detach()
head_params = {name: p.detach() for name, p in model.head.named_parameters()}


def head_logits(p, f):
    return functional_call(model.head, p, (f,))


eye = torch.eye(10, device=device)
wide_reference = {"weight": torch.einsum("ij,k->ijk", eye, features), "bias": eye}
for transform in (jacrev, jacfwd):
    wide = transform(head_logits)(head_params, features)
    assert wide.keys() == wide_reference.keys()
    difference = max((wide[n] - wide_reference[n]).abs().max().item() for n in wide)
    print(f"wide Jacobian by {transform.__name__}, weight and bias: largest difference "
          f"from the closed form {difference:.1e}")  # fmt: skip
    assert difference < 1e-6, transform
recipes["wide Jacobian, jacrev"] = lambda: jacrev(head_logits)(head_params, features)
recipes["wide Jacobian, jacfwd"] = lambda: jacfwd(head_logits)(head_params, features)


# %%
# A Hessian
# ---------
# *Taught in* the same page. The loss's second derivatives with respect to one input:
# ``hessian`` is ``jacfwd(jacrev(...))``, forward over reverse. The reference,
# ``torch.autograd.functional.hessian``, differentiates twice in reverse mode.
def input_loss(x):
    return F.cross_entropy(model(x[None]), labels[:1])


input_hessian = hessian(input_loss)(x0)
hessian_reference = torch.autograd.functional.hessian(input_loss, x0)
hessian_error = relative_error(input_hessian, hessian_reference)
print(f"Hessian {tuple(input_hessian.shape)}: relative error {hessian_error:.1e}")
assert hessian_error < 1e-5
recipes["Hessian"] = lambda: hessian(input_loss)(x0)


# %%
# A Hessian-vector product
# ------------------------
# *Taught in* :doc:`../jacobians_and_curvature/plot_hessian_vector_products`.
# The Hessian of the loss with respect to the head's parameters, times a vector, without
# forming the Hessian: ``jvp`` of ``grad``, forward over reverse. On a linear head it has a
# closed form: with probabilities ``p`` and the logits' change ``d = V f + v_b``, the logits'
# curvature gives ``h = p * d - p (p · d)``, and the product is ``(outer(h, f), h)``.
def head_loss(p):
    return F.cross_entropy(head_logits(p, features)[None], labels[:1])


def hvp(p, v):
    return jvp(grad(head_loss), (p,), (v,))[1]


direction = {name: torch.randn_like(p) for name, p in head_params.items()}
product = hvp(head_params, direction)
probs = head_logits(head_params, features).softmax(-1)
change = direction["weight"] @ features + direction["bias"]
curved = probs * change - probs * (probs @ change)
hvp_reference = {"weight": torch.outer(curved, features), "bias": curved}
for name in hvp_reference:
    error = relative_error(product[name], hvp_reference[name])
    print(f"HVP, {name}: relative error {error:.1e}")
    assert error < 1e-5, name
recipes["Hessian-vector product"] = lambda: hvp(head_params, direction)


# %%
# A Jacobian for every sample of a batch
# --------------------------------------
# *Taught in* :doc:`../jacobians_and_curvature/plot_batch_jacobians_hessians`.
# ``vmap(jacrev(f))``: one 10 × 16 Jacobian of the logits for each input. The reference is
# ``torch.autograd.functional.jacobian``, one sample at a time, for all samples.
batch_jacobians = vmap(jacrev(model))(inputs)
loop_jacobians = torch.stack(
    [torch.autograd.functional.jacobian(model, x) for x in inputs]
)
batch_error = max(map(relative_error, batch_jacobians, loop_jacobians))
print(f"batch Jacobians {tuple(batch_jacobians.shape)}: worst sample {batch_error:.1e}")
assert batch_error < 1e-5
recipes["batch Jacobians"] = lambda: vmap(jacrev(model))(inputs)


# %%
# Per-sample Jacobians with respect to the parameters, and the NTK
# ----------------------------------------------------------------
# *Taught in*
# :ref:`sphx_glr_auto_examples_jacobians_and_curvature_plot_per_sample_param_jacobians.py`
# and :ref:`sphx_glr_auto_examples_models_as_functions_plot_neural_tangent_kernel.py`.
# ``vmap(jacrev(...))`` over samples, differentiating the head's log-probabilities with respect
# to its parameters. Contracting two samples' Jacobians over the parameters gives the empirical
# neural tangent kernel, a 10 × 10 block per pair of samples. Both have closed forms: log
# ``p_i`` has slope ``δ_ik - p_k`` in logit ``k``, which has slope ``f`` in weight row ``k`` and
# 1 in bias ``k``; block ``(a, b)`` is ``(f_a · f_b + 1)(δ_ij - p_b[i] - p_a[j] + p_a · p_b)``.
def head_log_probs(p, f):
    return head_logits(p, f).log_softmax(-1)


batch_features = model.encoder(inputs).detach()
param_jacobians = vmap(jacrev(head_log_probs), in_dims=(None, 0))


def ntk(p, f):
    jac = param_jacobians(p, f)
    flat = torch.cat([j.flatten(start_dim=2) for j in jac.values()], dim=2)
    return torch.einsum("aip,bjp->abij", flat, flat)


p_b = head_logits(head_params, batch_features).softmax(-1)  # (sample, class)
slope = eye - p_b[:, None, :]  # [sample, i, k]
weight_jac = torch.einsum("bik,bl->bikl", slope, batch_features)
jac_reference = {"weight": weight_jac, "bias": slope}
torch.testing.assert_close(param_jacobians(head_params, batch_features), jac_reference)
kernel = ntk(head_params, batch_features)
gram, overlap = batch_features @ batch_features.T + 1, p_b @ p_b.T
blocks = eye - p_b[None, :, :, None] - p_b[:, None, None, :] + overlap[:, :, None, None]
kernel_reference = gram[:, :, None, None] * blocks
print(f"NTK {tuple(kernel.shape)}: relative error "
      f"{relative_error(kernel, kernel_reference):.1e}")  # fmt: skip
torch.testing.assert_close(kernel, kernel_reference)  # every entry of every block
head_batch = (head_params, batch_features)
recipes["per-sample parameter Jacobians"] = lambda: param_jacobians(*head_batch)
recipes["NTK (full blocks)"] = lambda: ntk(*head_batch)

# %%
# An ensemble of models in one call
# ---------------------------------
# *Taught in* :ref:`sphx_glr_auto_examples_models_as_functions_plot_model_ensembling.py`.
# :func:`~torch.func.stack_module_state` stacks eight models' weights; ``vmap`` over
# ``functional_call`` runs all eight on the same batch. Each member, run alone, is the reference.
members = [classifier().to(device) for _ in range(8)]
stacked, stacked_buffers = stack_module_state(members)
template = classifier().to("meta")  # shapes only: its own weights are never used


def run_member(p, b, x):
    return functional_call(template, (p, b), (x,))


ensemble = vmap(run_member, in_dims=(0, 0, None))
outputs = ensemble(stacked, stacked_buffers, inputs)
for member, member_output in zip(members, outputs, strict=True):
    torch.testing.assert_close(member_output, member(inputs))
print(f"ensemble outputs {tuple(outputs.shape)}: each equals its member run alone")
recipes["ensemble of 8"] = lambda: ensemble(stacked, stacked_buffers, inputs)

# %%
# Many Jacobian-vector products at one point
# ------------------------------------------
# *Taught in* :ref:`sphx_glr_auto_examples_models_as_functions_plot_neural_tangent_kernel.py`.
# :func:`~torch.func.linearize` returns the output at ``x0`` and a function that applies the
# Jacobian at ``x0`` to any tangent. PyTorch's documentation says it evaluates the model twice
# (once for the output, once to trace the products into a graph); a forward hook counts the
# model's calls, and the arithmetic, first call included, is counted at the end. The two
# combine: ``vmap(jvp_at_x0)`` pushes all tangents through the linearized function in one call.
# The reference is ``torch.autograd``'s Jacobian times each tangent; ``vjp`` checks the
# transpose, ``⟨u, J t⟩ = ⟨Jᵀ u, t⟩``. (linearize's tracer warns about an internal constant.)
warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
model_calls = []
hook = model.register_forward_hook(lambda *_: model_calls.append(1))
_, jvp_at_x0 = linearize(model, x0)
print(f"linearize called the model {len(model_calls)} times")
assert len(model_calls) == 2
tangents = torch.randn(16, 16, device=device)


def jvp_of(t):
    return jvp(model, (x0,), (t,))[1]


recipes["16 JVPs, loop of jvp"] = lambda: torch.stack([jvp_of(t) for t in tangents])
recipes["16 JVPs, linearize"] = lambda: torch.stack([jvp_at_x0(t) for t in tangents])
recipes["16 JVPs, vmap(jvp)"] = lambda: vmap(jvp_of)(tangents)
recipes["16 JVPs, vmap(linearize)"] = lambda: vmap(jvp_at_x0)(tangents)
jvp_reference = tangents @ torch.autograd.functional.jacobian(model, x0).T
products = {}
calls = {"loop of jvp": 16, "linearize": 0, "vmap(jvp)": 1, "vmap(linearize)": 0}
for method, expected_calls in calls.items():
    model_calls.clear()
    products[method] = recipes[f"16 JVPs, {method}"]()
    error = relative_error(products[method], jvp_reference)
    print(f"{method}: {len(model_calls)} model calls, relative error {error:.1e}")
    assert len(model_calls) == expected_calls, (method, len(model_calls))
    assert error < 1e-5, (method, error)
hook.remove()
_, pullback = vjp(model, x0)
u = torch.randn(10, device=device)
torch.testing.assert_close(products["linearize"] @ u, tangents @ pullback(u)[0])


# %%
# How fast is it, and how much arithmetic?
# ----------------------------------------
# Each recipe is timed with :class:`torch.utils.benchmark.Timer` (median and IQR over its
# blocks) and its result's bytes counted. A dispatch mode adds up torch's FLOP formulas
# (``FlopCounterMode``'s: matrix products, none for elementwise operations) over the operations
# that run, below the transforms: a product under ``vmap`` counts once, as the batched product
# that runs (the profiler would add the transform's operation). ``FlopCounterMode`` itself,
# whose module tracking hooks into autograd, fails under ``jacrev``.
class CountFlops(TorchDispatchMode):
    total = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        formula = flop_registry.get(op.overloadpacket)
        self.total += formula(*args, **(kwargs or {}), out_val=out) if formula else 0
        return out


def result_bytes(result):
    if isinstance(result, torch.Tensor):
        return result.numel() * result.element_size()
    parts = result.values() if isinstance(result, dict) else result
    return sum(map(result_bytes, parts))


def timed(call, blocks=5):
    timer = benchmark.Timer("call()", globals={"call": call}, num_threads=threads)
    measured = timer.blocked_autorange(min_run_time=0.2)
    while len(measured.times) < blocks:  # a slow call: one more block, for a spread
        extra = timer.timeit(measured.number_per_run)
        measured = benchmark.Measurement.merge([measured, extra])[0]
    return measured


parameter_count = sum(p.numel() for p in params.values())
assert result_bytes(per_sample) == batch_size * parameter_count * 4  # float32: 4 bytes
timings, flops, threads = {}, {}, torch.get_num_threads()
for name, call in recipes.items():
    with CountFlops() as counter:
        result = call()
    flops[name] = counter.total
    t = timings[name] = timed(call)
    iqr = f"{t.iqr * 1e3:.2f}" if t.iqr >= 1e-5 else f"{t.iqr * 1e3:.1g}"
    print(f"{name:30s} {t.median * 1e3:7.2f} ms (IQR {iqr} ms, "
          f"{len(t.times)} blocks) {flops[name] / 1e6:6.2f} MFLOP "
          f"{result_bytes(result) / 1024:7.1f} KiB")  # fmt: skip


# %%
# The counts can be checked, unlike the times: nine are asserted below to equal a closed form
# in passes through the layers, at ``2 · inputs · outputs`` FLOPs per layer and pass. Forward
# mode runs two passes more than its tangents: the primal one, and one through the zero
# tangent it materialises and multiplies for a tensor that has none (PyTorch issue #69687).
def pass_flops(*layers):
    return sum(2 * layer.in_features * layer.out_features for layer in layers)


encoder_pass = pass_flops(model.encoder[0], model.encoder[2])
head_pass, model_pass = pass_flops(model.head), encoder_pass + pass_flops(model.head)
head_size = sum(p.numel() for p in head_params.values())
(outputs_count, inputs_count), tangent_count = tall_reference.shape, len(tangents)
expected = {  # the primal or forward pass, one pass per vector, and the zero tangent's pass
    "tall Jacobian, jacfwd": (1 + inputs_count + 1) * encoder_pass,
    "tall Jacobian, jacrev": (1 + outputs_count) * encoder_pass,
    "wide Jacobian, jacrev": (1 + model.head.out_features) * head_pass,
    "wide Jacobian, jacfwd": (1 + head_size + 1) * head_pass,
    "ensemble of 8": 8 * batch_size * model_pass,
    "16 JVPs, loop of jvp": tangent_count * (1 + 1 + 1) * model_pass,
    "16 JVPs, linearize": tangent_count * model_pass,  # after its first call
    "16 JVPs, vmap(linearize)": tangent_count * model_pass,
    "16 JVPs, vmap(jvp)": (1 + tangent_count + 1) * model_pass,
}
for name, count in expected.items():
    assert flops[name] == count, f"{name}: counted {flops[name]:,}, expected {count:,}"
print(f"{len(expected)} FLOP counts equal their closed forms")
counts = [CountFlops() for _ in range(3)]  # linearize, its first call, a later call
with counts[0]:
    _, fresh_jvp = linearize(model, x0)
for counter, t in zip(counts[1:], tangents):
    with counter:
        fresh_jvp(t)
passes = [counter.total // model_pass for counter in counts]
assert passes == [4, 3, 1], passes  # the output, then forward mode's three; folded once
end_to_end = passes[0] + passes[1] + (tangent_count - 1) * passes[2]
print(f"linearize, in model passes: {passes} to build, first call, later call; "
      f"{tangent_count} tangents end to end {end_to_end}, by vmap(jvp) "
      f"{flops['16 JVPs, vmap(jvp)'] // model_pass}")  # fmt: skip
pairs = [("tall Jacobian, jacrev", "tall Jacobian, jacfwd"),
         ("wide Jacobian, jacfwd", "wide Jacobian, jacrev")]  # fmt: skip
jvp_methods = ("loop of jvp", "vmap(jvp)", "vmap(linearize)")
pairs += [(f"16 JVPs, {m}", "16 JVPs, linearize") for m in jvp_methods]
for slow, fast in pairs:  # words chosen by the ratio, which may come out either way
    r = timings[slow].median / timings[fast].median
    pace = f"takes {r:.2f}x the time of" if r >= 1 else f"is {1 / r:.2f}x faster than"
    print(f"{slow} {pace} {fast.split(', ')[1]}, "
          f"with {flops[slow] / flops[fast]:.2f}x its FLOPs")  # fmt: skip

# %%
# The counts say which mode to pick for a Jacobian: the one that moves fewer vectors does less
# arithmetic, by the factor printed; at these sizes fixed costs per call can decide the time
# instead (the Jacobians page looks for a crossover). A loop of ``jvp`` runs three passes per
# tangent (primal, tangent, zero tangent), ``vmap(jvp)`` the primal and zero ones once for all.
# ``linearize`` runs four passes to build, three on its first call (torch.fx's constant
# folding), one on each later call; its rows time the later calls only, and the build also
# traces the function, probably worth many ``jvp``-s: it pays for tangents that come one at a time
# only when they are many. Known together: ``vmap(jvp)``. The figure's bars use a log axis.
METHOD_COLORS = {
    "vmap": "#009E73", "jacfwd": "#E69F00", "jacrev": "#0072B2", "hessian": "#56B4E9",
    "forward-over-reverse": "#EE3377", "loop": "#D55E00", "linearize": "#CC3311",
}  # fmt: skip
bar_method = dict.fromkeys(recipes, "vmap") | {  # the recipes not driven by vmap
    "tall Jacobian, jacfwd": "jacfwd", "tall Jacobian, jacrev": "jacrev",
    "wide Jacobian, jacrev": "jacrev", "wide Jacobian, jacfwd": "jacfwd",
    "Hessian": "hessian", "Hessian-vector product": "forward-over-reverse",
    "16 JVPs, loop of jvp": "loop", "16 JVPs, linearize": "linearize",
    "16 JVPs, vmap(linearize)": "linearize",
}  # fmt: skip
assert bar_method.keys() == recipes.keys()
fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
ax.barh(list(timings), [t.median * 1e3 for t in timings.values()], log=True,
        color=[METHOD_COLORS[bar_method[name]] for name in timings])  # fmt: skip
ax.invert_yaxis()
ax.set(xlabel=f"median time on {device.type.upper()} (ms, log scale)",
       title="One model, every recipe")  # fmt: skip
ax.legend(handles=[Patch(color=c, label=m) for m, c in METHOD_COLORS.items()],
          title="does the work", loc="center left", bbox_to_anchor=(1.01, 0.5))  # fmt: skip
plt.show()

# %%
# What to remember
# ----------------
# - Per example: ``vmap(grad(loss), in_dims=(None, 0, 0))``; check it by name against a loop.
# - Few inputs, many outputs: ``jacfwd``; few outputs: ``jacrev``. The FLOPs follow the vector
#   count; the time follows them only where the arithmetic outweighs fixed costs per call.
# - A Hessian-vector product is ``jvp(grad(f), (p,), (v,))``, with no Hessian formed.
# - ``linearize``: a build (passes, tracing), then cheap products; ``vmap(jvp)`` for known tangents.
# - Count FLOPs with a dispatch mode, below the transforms, and check the counts on known cases.
