"""
From functorch to ``torch.func``
================================

``functorch`` was the library in which PyTorch's function transforms grew up; since PyTorch
2.0 they live in :mod:`torch.func`, and most of functorch's names are deprecated. This page
takes each old name, shows the code you may have, and gives its ``torch.func`` equivalent.
PyTorch 2.13 still ships ``functorch`` as a thin compatibility package, so on this page the
old code *runs* too: each "before" is executed, its deprecation warning printed, and each
"after" is checked against it. When a later release deletes the old names, the "before"
cells here will fail, and the "after" cells are what you should already be using.

You will learn what replaces ``make_functional`` and ``make_functional_with_buffers``
(:func:`~torch.func.functional_call`), ``combine_state_for_ensemble``
(:func:`~torch.func.stack_module_state`), the transforms themselves, ``functorch.compile``
(``torch.compile``), ``functorch.einops.rearrange`` and ``functionalize``.
"""

# %%
# Where this page ran
# -------------------
# The page times one comparison (an ensemble), so it says what it ran on. We use the GPU when
# there is one and seed the random number generator.
import copy
import ctypes
import os
import platform
import re
import statistics
import textwrap
import warnings
from pathlib import Path

import functorch
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, nop
from functorch.einops import rearrange as functorch_rearrange
from torch import nn
from torch.func import (
    functional_call,
    functionalize,
    grad,
    grad_and_value,
    rearrange,
    stack_module_state,
    vmap,
)
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


def describe_hardware():
    """One line naming the processor or GPU, torch's version and its thread count."""
    if device.type == "cuda":
        name = f"GPU: {torch.cuda.get_device_name(device)}"
    else:
        cpuinfo = Path("/proc/cpuinfo")  # Linux names the CPU model here
        model = (
            re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
            if cpuinfo.exists()
            else None
        )
        cpu = model.group(1) if model else (platform.processor() or platform.machine())
        name = f"CPU: {cpu}, {os.cpu_count()} cores"
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


print(describe_hardware())

# One colour per method, the same on every page of this site: colour-blind-safe hues from
# Okabe and Ito's palette and Tol's. Black is kept for guides: thresholds, fits, markers.
METHOD_COLORS = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "batched": "#666666",
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
    "sum trick": "#CC79A7",
    "vmap chunked": "#44AA99",
    "compiled": "#117733",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
    "ghost clipping": "#CC6677",
    "book-keeping": "#6699CC",
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
    "GGN": "#EE8866",
    "ntk-vector products": "#5D69B1",
    "linearize": "#CC3311",
}

# %%
# Pinning the memory allocator's policy
# -------------------------------------
# As on every page of this site, glibc is asked to keep freed memory for reuse, so that the
# timing below does not depend on what the process did before. Without glibc the cell
# changes nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


print(
    "allocator: glibc keeps freed memory for reuse"
    if keep_freed_memory()
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Running the old code
# --------------------
# ``run_deprecated`` runs a "before" cell, records the warnings it raises, and prints each
# distinct deprecation message once, in full.


def run_deprecated(fn):
    """fn()'s result; its deprecation warnings (FutureWarning) are printed, not raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    messages = dict.fromkeys(
        str(w.message) for w in caught if issubclass(w.category, FutureWarning)
    )
    for message in messages:
        print("FutureWarning:")
        print(textwrap.fill(" ".join(message.split()), width=88))
    return result, list(messages)


plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
model = (
    nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    .to(device)
    .eval()
)  # fmt: skip (with buffers: BatchNorm's running statistics)
inputs = torch.randn(5, 8, device=device)

# %%
# ``make_functional`` → ``functional_call``
# -----------------------------------------
# **Before**: ``make_functional`` split a module into a stateless copy and a tuple of its
# parameters, and the copy took the tuple as its first argument. (It refuses modules that have
# buffers; those needed the next section's function.)
(old_fmodel, old_params), messages = run_deprecated(
    lambda: functorch.make_functional(plain)
)
old_output = old_fmodel(old_params, inputs)
assert any("make_functional" in m for m in messages)

# %%
# **After**: the module stays as it is, and :func:`~torch.func.functional_call` runs it with
# a dictionary of tensors in place of its own, keyed by parameter name. Transforms take the
# dictionary as their argument: ``grad`` returns a dictionary of the same names.
plain_params = {name: p.detach() for name, p in plain.named_parameters()}
new_output = functional_call(plain, plain_params, (inputs,))
torch.testing.assert_close(new_output, old_output)
grads = grad(lambda p: functional_call(plain, p, (inputs,)).square().sum())(
    plain_params
)
old_grads, _ = run_deprecated(
    lambda: functorch.grad(lambda p: old_fmodel(p, inputs).square().sum())(old_params)
)
for (name, g), old_g in zip(grads.items(), old_grads):
    torch.testing.assert_close(g, old_g, msg=lambda m, name=name: f"{name}: {m}")
print("functional_call: same output and same gradients, now keyed by name")

# %%
# ``make_functional_with_buffers`` → ``functional_call`` with buffers
# -------------------------------------------------------------------
# **Before**: buffers (here BatchNorm's running statistics) came back as a second tuple.
(old_fmodel_b, old_params_b, old_buffers), messages = run_deprecated(
    lambda: functorch.make_functional_with_buffers(model)
)
old_output = old_fmodel_b(old_params_b, old_buffers, inputs)

# %%
# **After**: pass a pair of dictionaries (or one merged dictionary) to ``functional_call``.
params = {name: p.detach() for name, p in model.named_parameters()}
buffers = {name: b for name, b in model.named_buffers()}
new_output = functional_call(model, (params, buffers), (inputs,))
torch.testing.assert_close(new_output, old_output)
print(f"functional_call with {len(buffers)} buffers: same output")

# %%
# ``combine_state_for_ensemble`` → ``stack_module_state``
# -------------------------------------------------------
# **Before**: several models of the same architecture became one functional model with stacked
# parameters and buffers, and ``vmap`` ran all of them at once.
members = [copy.deepcopy(model) for _ in range(8)]
for member in members:
    for p in member.parameters():
        p.data.normal_()
(old_fmodel_e, old_params_e, old_buffers_e), messages = run_deprecated(
    lambda: functorch.combine_state_for_ensemble(members)
)
old_ensemble = vmap(old_fmodel_e, in_dims=(0, 0, None))(
    old_params_e, old_buffers_e, inputs
)

# %%
# **After**: :func:`~torch.func.stack_module_state` stacks the state into dictionaries, and
# ``functional_call`` runs a template of the architecture with each member's slice. The
# template lives on the ``"meta"`` device: it holds shapes, not memory, because its own
# weights are never used.
stacked_params, stacked_buffers = stack_module_state(members)
template = copy.deepcopy(members[0]).to("meta")


def run_member(member_params, member_buffers, x):
    return functional_call(template, (member_params, member_buffers), (x,))


ensemble = vmap(run_member, in_dims=(0, 0, None))(
    stacked_params, stacked_buffers, inputs
)
torch.testing.assert_close(ensemble, old_ensemble)
for member, output in zip(members, ensemble):
    torch.testing.assert_close(output, member(inputs))
print(f"stack_module_state: {len(members)} models in one call, each as if run alone")

# %%
# One vmapped call replaces a Python loop over the members. Whether it is faster depends on
# the hardware and the size of the members: on a GPU it saves a kernel launch per member and
# layer; on a CPU, for members this small, the gain can be small or negative. Timed here:
ensemble_fns = {
    "loop": lambda: [member(inputs) for member in members],
    "vmap": lambda: vmap(run_member, in_dims=(0, 0, None))(
        stacked_params, stacked_buffers, inputs
    ),
}
timers = {
    name: benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    for name, fn in ensemble_fns.items()
}
for fn in ensemble_fns.values():
    for _ in range(3):  # warm-up, untimed
        fn()
rounds_ms = {name: [] for name in ensemble_fns}
for _ in range(9):  # the two take turns, so a slow spell of the machine slows both
    for name, timer in timers.items():
        rounds_ms[name].append(timer.blocked_autorange(min_run_time=0.05).median * 1e3)
ensemble_ms = {name: statistics.median(times) for name, times in rounds_ms.items()}
print(
    f"loop over {len(members)} models {ensemble_ms['loop']:.3f} ms, vmap "
    f"{ensemble_ms['vmap']:.3f} ms: the loop takes "
    f"{ensemble_ms['loop'] / ensemble_ms['vmap']:.2f}x the time of vmap"
)

# %%
# ``functorch.vmap``, ``grad``, ``jacrev`` and the rest → ``torch.func``
# ----------------------------------------------------------------------
# **Before**: ``from functorch import vmap, grad, jacrev, jacfwd, hessian, vjp, jvp,
# grad_and_value``. **After**: the same names from ``torch.func``, with the same arguments.
# The old names are wrappers that forward to the new ones, so results are identical.
# ``grad_and_value`` returns the value with the gradient, from one forward pass.
weights = torch.randn(8, device=device)


def loss_of(w):
    return F.softplus(inputs @ w).sum()


new_grad, new_value = grad_and_value(loss_of)(weights)
(old_grad, old_value), _ = run_deprecated(
    lambda: functorch.grad_and_value(loss_of)(weights)
)
torch.testing.assert_close(new_grad, old_grad)
torch.testing.assert_close(new_value, loss_of(weights))
old_mapped, _ = run_deprecated(
    lambda: functorch.vmap(functorch.grad(loss_of))(weights.expand(3, 8))
)
torch.testing.assert_close(vmap(grad(loss_of))(weights.expand(3, 8)), old_mapped)
print("torch.func.grad_and_value, grad and vmap: identical to functorch's")

# %%
# ``functorch.compile`` → ``torch.compile``
# -----------------------------------------
# **Before**: ``functorch.compile.aot_function(fn, fw_compiler)`` traced a function ahead of
# time, forward and backward, and handed the graphs to a compiler you chose
# (``memory_efficient_fusion`` picked one for you). **After**: ``torch.compile(fn)`` does the
# tracing, the backward graph and the code generation, and composes with the transforms (see
# the pitfalls page). Here both run the same small function; the old one with ``nop``, a
# compiler that runs the traced graph as it is.


def smooth(x):
    return torch.sin(x) * torch.exp(-x.square())


points = torch.linspace(-3, 3, 101, device=device)
old_compiled = aot_function(smooth, nop)
new_compiled = torch.compile(smooth)
torch.testing.assert_close(old_compiled(points), smooth(points))
torch.testing.assert_close(new_compiled(points), smooth(points))
print("aot_function(nop) and torch.compile: both equal the eager function")

# %%
# ``functorch.einops.rearrange`` → ``torch.func.rearrange``
# ---------------------------------------------------------
# The einops-style ``rearrange`` moved too. Flattening channels and positions of a batch:
feature_maps = torch.randn(2, 3, 4, 5, device=device)
flattened = rearrange(feature_maps, "b c h w -> b (c h w)")
torch.testing.assert_close(flattened, feature_maps.flatten(start_dim=1))
torch.testing.assert_close(
    functorch_rearrange(feature_maps, "b c h w -> b (h w) c"),
    rearrange(feature_maps, "b c h w -> b (h w) c"),
)
print("rearrange:", tuple(feature_maps.shape), "->", tuple(flattened.shape))

# %%
# ``functorch.experimental.functionalize`` → ``torch.func.functionalize``
# -----------------------------------------------------------------------
# ``functionalize`` removes mutation from a function: in-place operations become out-of-place
# ones, with the same result. (Its use under ``vmap`` is on the pitfalls page.)


def scale_in_place(x):
    y = x.clone()
    y.mul_(3)
    return y


torch.testing.assert_close(functionalize(scale_in_place)(points), 3 * points)
old_functional, _ = run_deprecated(
    lambda: functorch.functionalize(scale_in_place)(points)
)
torch.testing.assert_close(old_functional, 3 * points)
print("functionalize: same result, no in-place operations")

# %%
# The figure: the ensemble of eight models, one curve per member along one input direction,
# computed in a single ``vmap`` call from the stacked state.
direction = torch.linspace(-2, 2, 50, device=device).unsqueeze(1) * torch.ones(
    1, 8, device=device
)
with torch.no_grad():
    curves = vmap(run_member, in_dims=(0, 0, None))(
        stacked_params, stacked_buffers, direction
    )[..., 0]
fig, (ax, ax_time) = plt.subplots(
    1, 2, figsize=(8, 3), layout="constrained", width_ratios=[2, 1]
)
for curve in curves.cpu():
    ax.plot(direction[:, 0].cpu(), curve, color=METHOD_COLORS["vmap"], alpha=0.6)
ax.set_xlabel("input along (1, …, 1)")
ax.set_ylabel("first output")
ax.set_title("8 ensemble members, one vmap call")
ax_time.bar(
    ["loop", "vmap"],
    [ensemble_ms["loop"], ensemble_ms["vmap"]],
    color=[METHOD_COLORS["loop"], METHOD_COLORS["vmap"]],
)
ax_time.set_ylabel("median time (ms)")
plt.show()
