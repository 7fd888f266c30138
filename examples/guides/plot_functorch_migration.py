"""
From functorch to ``torch.func``
================================

PyTorch's function transforms grew up in ``functorch``; since PyTorch 2.0 they live in
:mod:`torch.func`. This page runs the functorch names most often found in older code (torch
2.13 still ships them; most warn, some do not) and gives each its ``torch.func`` replacement,
checked against a reference that uses neither (a closed form, each module alone, eager code).
"""

# %%
# Running the old code
# --------------------
# Each "before" runs inside ``old_code``, which records its warnings. Where the page names a
# replacement, the deprecation warning must name the same one; else there must be none.
import copy
import re
import warnings

import functorch
import functorch.experimental
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, nop
from functorch.einops import rearrange as functorch_rearrange
from torch import nn
from torch._dynamo.utils import counters
from torch.autograd import functional as AF
from torch.func import functional_call, functionalize, grad, grad_and_value, vmap
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


def old_code(call, replacement=None):
    """call()'s result, after checking the deprecation warning it raises, if any."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    found = [" ".join(str(w.message).split()) for w in caught]
    assert all(w.category is FutureWarning for w in caught), found
    assert bool(found) == bool(replacement), found  # a warning only where one is named
    assert all(f"Please use `{replacement}`" in m for m in found), found
    print(f"FutureWarning: {re.search(r'`functorch.*?instead', found[0]).group()}"
          if found else "no warning")  # fmt: skip
    return result


plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
inputs = torch.randn(5, 8, device=device)

# %%
# ``make_functional`` → ``functional_call``
# -----------------------------------------
# **Before**: ``make_functional`` split a module into a stateless copy and a tuple of its
# parameters, and the copy took the tuple as its first argument.
old_fmodel, old_params = old_code(
    lambda: functorch.make_functional(plain), "torch.func.functional_call"
)
torch.testing.assert_close(old_fmodel(old_params, inputs), plain(inputs))

# %%
# **After**: the module stays as it is, and :func:`~torch.func.functional_call` runs it with a
# dictionary of tensors in place of its own, keyed by parameter name.
plain_params = {name: p.detach() for name, p in plain.named_parameters()}
new_output = functional_call(plain, plain_params, (inputs,))
torch.testing.assert_close(new_output, plain(inputs))
print("functional_call: the same output as the module itself")


# %%
# Gradients with respect to the parameters
# ----------------------------------------
# ``grad`` returns the gradient in the structure of its input: here a dictionary with the same
# names, where old code got a tuple in the order of ``parameters()`` (``functorch.grad`` is
# ``torch.func.grad`` behind a warning). The reference: the gradient of ``sum(output²)`` by
# hand for Linear, ReLU, Linear, compared name by name, so a missing or extra tensor fails.
def squared_output(p):
    return functional_call(plain, p, (inputs,)).square().sum()


new_grads = grad(squared_output)(plain_params)
old_tuple = old_code(
    lambda: functorch.grad(lambda p: old_fmodel(p, inputs).square().sum())(old_params),
    "torch.func.grad",
)
old_dict = old_code(
    lambda: functorch.grad(squared_output)(plain_params), "torch.func.grad"
)
assert type(old_tuple) is tuple and type(old_dict) is dict
old_grads = dict(zip(plain_params, old_tuple, strict=True))

w1, b1, w2, b2 = (p.double() for p in plain_params.values())  # float64 reference
x64 = inputs.double()
before_relu = x64 @ w1.T + b1
hidden = before_relu.relu()
d_output = 2 * (hidden @ w2.T + b2)
d_before_relu = (d_output @ w2) * (before_relu > 0)
closed_form = {
    "0.weight": d_before_relu.T @ x64,
    "0.bias": d_before_relu.sum(0),
    "2.weight": d_output.T @ hidden,
    "2.bias": d_output.sum(0),
}
assert new_grads.keys() == old_grads.keys() == old_dict.keys() == closed_form.keys()
for name, expected in closed_form.items():
    errors = [
        ((grads[name].double() - expected).norm() / expected.norm()).item()
        for grads in (new_grads, old_grads, old_dict)
    ]
    print(f"{name:8s} relative error, new, old tuple, old dict: "
          f"{errors[0]:.1e}, {errors[1]:.1e}, {errors[2]:.1e} (bound 1e-6)")  # fmt: skip
    assert max(errors) < 1e-6, (name, errors)

# %%
# A training step
# ---------------
# **Before**: a hand-written SGD step rebuilt the parameter tuple by position. **After**: a
# dictionary by name, which ``functional_call`` takes as it is. The reference: ``optim.SGD``.
lr = 0.1
old_stepped = tuple(p - lr * g for p, g in zip(old_params, old_tuple))
new_stepped = {name: p - lr * new_grads[name] for name, p in plain_params.items()}
stepped = copy.deepcopy(plain)
optimizer = torch.optim.SGD(stepped.parameters(), lr=lr)
stepped(inputs).square().sum().backward()
optimizer.step()
for (name, p), old in zip(stepped.named_parameters(), old_stepped, strict=True):
    torch.testing.assert_close(new_stepped[name], p.detach())
    torch.testing.assert_close(old, p.detach())
print("one SGD step, by name and by position: the same as torch.optim.SGD")


# %%
# ``make_functional_with_buffers`` → ``functional_call`` with buffers
# -------------------------------------------------------------------
# **Before**: buffers (here BatchNorm's running statistics, in evaluation mode) came back as a
# second tuple. A few training batches give each model running statistics of its own.
@torch.no_grad()
def train_batches(module, batches=3):
    for _ in range(batches):
        module.train()(torch.randn(32, 8, device=device))
    return module.eval()


model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
model = train_batches(model.to(device))
old_fmodel_b, old_params_b, old_buffers = old_code(
    lambda: functorch.make_functional_with_buffers(model), "torch.func.functional_call"
)
old_output = old_fmodel_b(old_params_b, old_buffers, inputs)
torch.testing.assert_close(old_output, model(inputs))

# %%
# **After**: pass a pair of dictionaries (or one merged dictionary) to ``functional_call``.
# Here the buffers come from a copy trained on more batches: the output must be the copy's.
later = train_batches(copy.deepcopy(model), batches=30)
bn_params = {name: p.detach() for name, p in model.named_parameters()}
buffers = dict(later.named_buffers())
new_output = functional_call(model, (bn_params, buffers), (inputs,))
torch.testing.assert_close(new_output, later(inputs))
gap = (later(inputs) - model(inputs)).abs().max().item()
print(f"functional_call with {len(buffers)} buffers: the output of their module "
      f"(which differs from the template's own by up to {gap:.2f})")  # fmt: skip
assert gap > 1e-2  # the buffers matter

# %%
# ``combine_state_for_ensemble`` → ``stack_module_state``
# -------------------------------------------------------
# **Before**: models of one architecture became one functional model with stacked parameters
# and buffers, and ``vmap`` ran them all at once. The reference for both: each member alone.
members = [copy.deepcopy(model) for _ in range(8)]
for p in [p for member in members for p in member.parameters()]:
    p.data.normal_()
members = [train_batches(member) for member in members]  # buffers of their own
old_fmodel_e, old_params_e, old_buffers_e = old_code(
    lambda: functorch.combine_state_for_ensemble(members),
    "torch.func.stack_module_state",
)
old_run_all = vmap(old_fmodel_e, in_dims=(0, 0, None))
old_ensemble = old_run_all(old_params_e, old_buffers_e, inputs)

# %%
# **After**: :func:`~torch.func.stack_module_state` stacks the state into dictionaries, and
# ``functional_call`` runs a template of the architecture with each member's slice. The
# template lives on the ``"meta"`` device: it holds shapes, not memory (its weights go unused).
stacked_params, stacked_buffers = torch.func.stack_module_state(members)
template = copy.deepcopy(model).to("meta")


def run_member(member_params, member_buffers, x):
    return functional_call(template, (member_params, member_buffers), (x,))


run_all = vmap(run_member, in_dims=(0, 0, None))  # the state stacked, the input shared
ensemble = run_all(stacked_params, stacked_buffers, inputs)
for member, new, old in zip(members, ensemble, old_ensemble, strict=True):
    torch.testing.assert_close(new, member(inputs))
    torch.testing.assert_close(old, member(inputs))
print(f"stack_module_state: {len(members)} models in one call, each as if run alone")


# %%
# ``functorch.vmap``, ``grad_and_value`` and the other transforms → ``torch.func``
# --------------------------------------------------------------------------------
# **Before**: ``from functorch import vmap, grad, jacrev, jacfwd, hessian, vjp, jvp,
# grad_and_value``. **After**: the same names and arguments from ``torch.func`` (``vmap`` also
# as ``torch.vmap``, the name the warning gives). The old names are thin wrappers that warn and
# call the new ones (``torch/_functorch/deprecated.py``), so results are bitwise equal
# (asserted to record it; closed forms check the numbers). ``functorch.experimental``'s
# ``chunk_vmap(f, chunks=n)`` (no warning) becomes ``vmap`` with ``chunk_size = ceil(B / n)``:
# n counts pieces, not rows (5 rows in 2 chunks: 3 rows, then 2). ``grad_and_value`` returns
# the value with the gradient, from one forward pass; for ``L(w) = Σ softplus(X w)`` the
# gradient is ``Xᵀ sigmoid(X w)``. The value's bound, 8 float32 epsilons, holds on 300 draws.
def softplus_loss(w):
    return F.softplus(inputs @ w).sum()


weights = torch.randn(8, device=device)
new_grad, new_value = grad_and_value(softplus_loss)(weights)
old_grad, old_value = old_code(
    lambda: functorch.grad_and_value(softplus_loss)(weights),
    "torch.func.grad_and_value",
)
assert torch.equal(new_grad, old_grad) and torch.equal(new_value, old_value)
x64, w64 = inputs.double(), weights.double()  # the closed form, in float64
grad_error = (new_grad - x64.T @ torch.sigmoid(x64 @ w64)).norm() / new_grad.norm()
draws = torch.randn(300, 8, device=device)
values = vmap(grad_and_value(softplus_loss))(draws)[1]
exact_values = torch.log1p(torch.exp(draws.double() @ x64.T)).sum(1)
value_error = ((values - exact_values).abs() / exact_values).max()
value_bound = 8 * torch.finfo(torch.float32).eps
print(f"grad_and_value: relative errors {grad_error:.1e} (gradient, bound 1e-6), "
      f"{value_error:.1e} (value, worst of {len(draws)}, bound {value_bound:.1e})")  # fmt: skip
assert grad_error < 1e-6 and value_error < value_bound

weight_rows = torch.randn(5, 8, device=device)
new_rows = vmap(grad(softplus_loss))(weight_rows)
old_rows = old_code(
    lambda: functorch.vmap(grad(softplus_loss))(weight_rows), "torch.vmap"
)
assert torch.equal(new_rows, old_rows)
rows_reference = torch.sigmoid(weight_rows.double() @ x64.T) @ x64
rows_error = ((new_rows - rows_reference).norm() / rows_reference.norm()).item()
print(f"vmap(grad): relative error {rows_error:.1e} (bound 1e-6)")
assert rows_error < 1e-6
chunk_vmap, calls = functorch.experimental.chunk_vmap, []  # one call per chunk
counted = lambda w: calls.append(1) or grad(softplus_loss)(w)  # noqa: E731
old_chunks = old_code(lambda: chunk_vmap(counted, chunks=2)(weight_rows))
new_chunks = vmap(counted, chunk_size=-(-len(weight_rows) // 2))(weight_rows)
assert len(calls) == 4 and torch.equal(old_chunks, new_chunks), calls  # 2 chunks each
torch.testing.assert_close(new_chunks, new_rows)


# %%
# ``torch.autograd.functional`` → ``torch.func``
# ----------------------------------------------
# Code of that era often used :mod:`torch.autograd.functional` too: ``jacobian`` becomes
# ``jacrev`` (or ``jacfwd``), ``hessian`` keeps its name, ``vjp(f, x, v)`` becomes ``vjp(f, x)``
# (a function to call on ``v``), ``jvp(f, x, t)`` becomes ``jvp(f, (x,), (t,))``, and
# ``hvp(f, x, t)`` is ``jvp`` of ``grad``. With ``σ = sigmoid(X w)``, the Jacobian of
# ``softplus(X w)`` is ``diag(σ) X`` and the Hessian of its sum ``Xᵀ diag(σ(1 − σ)) X``: both
# forms, and functorch's (its hvp: ``jacrev`` of ``grad``, times ``t``), are checked on these.
def features(w):
    return F.softplus(inputs @ w)


loss, w = softplus_loss, weights
t, c = torch.randn(8, device=device), torch.randn(5, device=device)
sig, t64, c64 = torch.sigmoid(x64 @ w64), t.double(), c.double()
hessian64 = x64.T @ ((sig * (1 - sig))[:, None] * x64)
old_forms = {
    "jacobian": AF.jacobian(features, w),
    "hessian": AF.hessian(loss, w),
    "vjp": AF.vjp(features, w, c)[1],
    "jvp": AF.jvp(features, w, t)[1],
    "hvp": AF.hvp(loss, w, t)[1],
}
new_forms = {
    "jacobian": torch.func.jacrev(features)(w),
    "hessian": torch.func.hessian(loss)(w),
    "vjp": torch.func.vjp(features, w)[1](c)[0],
    "jvp": torch.func.jvp(features, (w,), (t,))[1],
    "hvp": torch.func.jvp(grad(loss), (w,), (t,))[1],
}
functorch_forms = {
    "jacobian": old_code(lambda: functorch.jacfwd(features)(w), "torch.func.jacfwd"),
    "hessian": old_code(lambda: functorch.hessian(loss)(w), "torch.func.hessian"),
    "vjp": old_code(lambda: functorch.vjp(features, w)[1](c)[0], "torch.func.vjp"),
    "jvp": old_code(lambda: functorch.jvp(features, (w,), (t,))[1], "torch.func.jvp"),
    "hvp": old_code(lambda: functorch.jacrev(grad(loss))(w) @ t, "torch.func.jacrev"),
}
closed_forms = {
    "jacobian": sig[:, None] * x64,
    "hessian": hessian64,
    "vjp": x64.T @ (sig * c64),
    "jvp": sig * (x64 @ t64),
    "hvp": hessian64 @ t64,
}
for name, exact in closed_forms.items():  # second derivatives round σ(1 − σ) too
    bound = 1e-5 if name in ("hessian", "hvp") else 1e-6
    trio = old_forms[name], new_forms[name], functorch_forms[name]
    errors = [((r.double() - exact).norm() / exact.norm()).item() for r in trio]
    print(f"{name:8s} relative error, autograd.functional, torch.func, functorch: "
          f"{', '.join(f'{e:.1e}' for e in errors)} (bound {bound:.0e})")  # fmt: skip
    assert max(errors) < bound, (name, errors)


# %%
# ``functorch.compile`` → ``torch.compile``
# -----------------------------------------
# **Before**: ``functorch.compile.aot_function(fn, fw_compiler)`` traced a function ahead of
# time, forward and backward, and handed the graphs to a compiler you chose; ``nop`` runs the
# traced graph as it is. It still runs, with no deprecation warning, but PyTorch's migration
# guide calls functorch.compile unsupported as a frontend and points to ``torch.compile``. Both
# are checked against the eager function, the old one's backward against a closed form.
def smooth(x):
    return torch.sin(x) * torch.exp(-x.square())


points = torch.linspace(-3, 3, 101, device=device, requires_grad=True)
old_compiled = old_code(lambda: aot_function(smooth, nop))
values = old_compiled(points)
(slope,) = torch.autograd.grad(values.sum(), points)
x = points.detach()
torch.testing.assert_close(values.detach(), smooth(x))
expected_slope = (torch.cos(x) - 2 * x * torch.sin(x)) * (-x * x).exp()
slope_error = ((slope - expected_slope).norm() / expected_slope.norm()).item()
print(f"aot_function: the slope's relative error {slope_error:.1e} (bound 1e-6)")
assert slope_error < 1e-6

# %%
# **After**: ``torch.compile(fn)`` does the tracing, the backward graph and the code
# generation; call it around the transforms, not inside them (pitfall 12 of
# :ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`). Checked here on the forward pass,
# with dynamo's count of the graphs it compiled (a count kept for the whole process).
graphs = counters["stats"]["unique_graphs"]
new_compiled = torch.compile(smooth)
torch.testing.assert_close(new_compiled(points.detach()), smooth(points.detach()))
assert counters["stats"]["unique_graphs"] == graphs + 1, "dynamo compiled no graph"
print("aot_function(nop) and torch.compile (one graph): both equal the eager function")

# %%
# ``functorch.einops.rearrange`` → ``torch.func.rearrange``
# ---------------------------------------------------------
# The einops-style ``rearrange`` moved too; the old name is the new function itself and raises
# no warning, so only the import changes. The reference: ``permute`` and ``reshape``.
assert functorch_rearrange is torch.func.rearrange
feature_maps = torch.randn(2, 3, 4, 5, device=device)
pattern = "b c h w -> b (h w) c"
old_rearranged = old_code(lambda: functorch_rearrange(feature_maps, pattern))
rearranged = torch.func.rearrange(feature_maps, pattern)
expected = feature_maps.permute(0, 2, 3, 1).reshape(2, 20, 3)
torch.testing.assert_close(rearranged, expected)
torch.testing.assert_close(old_rearranged, expected)
print("rearrange:", tuple(feature_maps.shape), "->", tuple(rearranged.shape))


# %%
# ``functorch.functionalize`` → ``torch.func.functionalize``
# ----------------------------------------------------------
# :func:`~torch.func.functionalize` removes mutation from a function: in-place operations,
# even through a view, become out-of-place ones with the same result, as ``make_fx`` traces
# show. (``functorch.experimental``'s ``functionalize``, ``jacfwd``, ``jvp``, ``hessian`` and
# ``replace_all_batch_norm_modules_`` are ``torch.func``'s own functions and do not warn;
# ``functorch.make_fx`` is ``make_fx``. ``functionalize`` under ``vmap``: the pitfalls page.)
def triple_first_half(x):
    y = x.clone()
    y[: len(y) // 2].mul_(3)  # an in-place write through a view
    return y


def traced_ops(fn, x):
    graph = make_fx(fn)(x)
    return graph, [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


def in_place(ops):
    return [op for op in ops if op.split(".")[1].endswith("_")]


line = torch.linspace(-3, 3, 100, device=device)
graph, ops = traced_ops(triple_first_half, line)
print("before:", ops)
assert in_place(ops) == ["aten.mul_.Tensor"]
graph, ops = traced_ops(functionalize(triple_first_half), line)
print(graph.code.strip())
assert not in_place(ops) and "aten.mul.Tensor" in ops, ops
old_graph, old_ops = old_code(
    lambda: traced_ops(functorch.functionalize(triple_first_half), line),
    "torch.func.functionalize",
)
assert not in_place(old_ops), old_ops
for name in "functionalize jacfwd jvp hessian replace_all_batch_norm_modules_".split():
    assert getattr(functorch.experimental, name) is getattr(torch.func, name), name
assert functorch.make_fx is make_fx
expected = torch.cat([3 * line[:50], line[50:]])
for traced in (graph, old_graph):
    torch.testing.assert_close(traced(line), expected)
torch.testing.assert_close(functionalize(triple_first_half)(line), expected)
print("functionalize: the in-place mul_ became mul, with the same result")

# %%
# How fast is it?
# ---------------
# One vmapped call replaces a Python loop over the ensemble's members. Which is faster depends
# on the hardware and the members' size; :class:`torch.utils.benchmark.Timer` times both (on
# a CPU, on all threads) after a warm-up: the median, interquartile range (IQR) and blocks.
ensemble_calls = {
    "loop": lambda: [member(inputs) for member in members],
    "vmap": lambda: run_all(stacked_params, stacked_buffers, inputs),
}
timings, threads = {}, torch.get_num_threads()
for method, call in ensemble_calls.items():
    call()  # a warm-up
    timer = benchmark.Timer("call()", globals={"call": call}, num_threads=threads)
    m = timings[method] = timer.blocked_autorange(min_run_time=0.5)
    n = len(m.times)
    spread = f"IQR {m.iqr * 1e3:.2g} ms, {n} blocks" if n > 1 else "measured once"
    print(f"{method}: {m.median * 1e3:.3g} ms on {device.type} ({spread})")
ratio = timings["loop"].median / timings["vmap"].median
slow, fast = ("the loop", "vmap") if ratio >= 1 else ("vmap", "the loop")
print(f"{slow} takes {max(ratio, 1 / ratio):.2f}x the time of {fast}")

# %%
# The figure: the members along one input direction, from one ``vmap`` call; and the times.
METHOD_COLORS = {"loop": "#D55E00", "vmap": "#009E73"}
along = torch.linspace(-2, 2, 50, device=device)
curves = run_all(stacked_params, stacked_buffers, along[:, None].expand(50, 8)).detach()
fig, (ax, ax_time) = plt.subplots(1, 2, figsize=(8, 3), layout="constrained")
for curve in curves[..., 0].cpu():
    ax.plot(along.cpu(), curve, color=METHOD_COLORS["vmap"], alpha=0.6)
ax.set(xlabel="input along (1, …, 1)", ylabel="output 1", title="each member, one call")
medians = [timings[method].median * 1e3 for method in METHOD_COLORS]
ax_time.bar(list(METHOD_COLORS), medians, color=list(METHOD_COLORS.values()))
ax_time.set_ylabel(f"median time (ms), {device.type.upper()}")
plt.show()

# %%
# What to remember
# ----------------
# - ``make_functional(_with_buffers)`` → ``functional_call(module, (params, buffers), args)``.
# - ``combine_state_for_ensemble`` → ``stack_module_state``, with a ``"meta"`` template.
# - ``grad`` returns the structure it is given: pass named parameters as a dictionary, and
#   match gradients by name, not by position.
# - The transforms, ``rearrange`` and ``functionalize`` keep their names under ``torch.func``;
#   ``chunk_vmap`` becomes ``vmap(chunk_size=)``; ``functorch.compile``, ``torch.compile``.
