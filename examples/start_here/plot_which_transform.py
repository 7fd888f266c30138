"""
Which transform do I need?
==========================

Start from what you want to compute; this page gives the ``torch.func`` recipe for it, runs
it on one common model, checks it against a plain reference, and measures its time and peak
memory in the same run, so that the costs can be compared. Each section names the page that
teaches the recipe in depth.

The model is a small classifier: an encoder from 16 input features to a 256-dimensional
representation, and a linear head to 10 classes. The recipes: per-sample gradients, a tall
and a wide Jacobian, a Hessian, a Hessian-vector product, a batch of Jacobians, per-sample
Jacobians with respect to parameters, the neural tangent kernel, an ensemble, and many
Jacobian-vector products at one point with ``linearize``.
"""

# %%
# Where this page ran
# -------------------
# We use the GPU when there is one and seed the random number generator.
import copy
import ctypes
import gc
import os
import platform
import re
import statistics
import warnings
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
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
# timings do not depend on what the process did before. Without glibc the cell changes
# nothing and says so.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # from glibc's <malloc.h>


def glibc():
    """The C library, if it is glibc (whose mallopt we call), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


def keep_freed_memory():
    """Reuse freed memory instead of returning it to the kernel; False without glibc."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))


allocator_pinned = keep_freed_memory()
print(
    "allocator: glibc keeps freed memory for reuse"
    if allocator_pinned
    else "allocator: not glibc, left as it is (timings may vary more between runs)"
)

# %%
# Timing and memory helpers
# -------------------------
# Medians over interleaved rounds of :class:`torch.utils.benchmark.Timer` after untimed
# calls; peak memory from the allocator's record of one call on a GPU, and on a Linux CPU from
# the rise of the process's peak resident memory during one call (with freed memory returned
# to the kernel meanwhile, so that resident memory follows the live tensors). Matrix products
# run in full float32 precision.
torch.set_float32_matmul_precision("highest")


def median_times_ms(methods, rounds=7, min_run_time=0.05):
    """Median time of each method in ``{name: fn}``, in ms, round after round."""
    for fn in methods.values():
        for _ in range(3):
            fn()
    timers = {
        name: benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
        for name, fn in methods.items()
    }
    rounds_ms = {name: [] for name in methods}
    for _ in range(rounds):
        for name, timer in timers.items():
            blocks = timer.blocked_autorange(min_run_time=min_run_time)
            rounds_ms[name].append(blocks.median * 1e3)
    return {name: statistics.median(times) for name, times in rounds_ms.items()}


def cuda_peak_bytes(fn):
    """Peak of live CUDA memory during fn(), from the allocator's record of this call."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(
        context=None, clear_history=True, max_entries=1_000_000
    )
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live = peak = 0
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live += event["size"]
            peak = max(peak, live)
        elif event["action"] == "free_completed":
            live -= event["size"]
    return peak


def cpu_peak_bytes(fn):
    """Rise of the process's resident memory during fn(), or None where Linux cannot say."""
    status, clear_refs = Path("/proc/self/status"), Path("/proc/self/clear_refs")
    if not (allocator_pinned and status.exists()):
        return None

    def resident(field):
        text = status.read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) << 10

    libc = glibc()
    libc.mallopt(
        M_MMAP_MAX, 65536
    )  # glibc's defaults, held fixed: freed memory goes back
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    libc.malloc_trim(0)
    try:
        clear_refs.write_text("5")  # reset the peak to the current resident size
        start = resident("VmRSS")
        fn()
        return resident("VmHWM") - start
    except OSError:
        return None
    finally:
        keep_freed_memory()


def peak_mib(fn):
    # Garbage from earlier cells, if collected during the call, would hide part of its peak.
    gc.collect()
    peak = cuda_peak_bytes(fn) if device.type == "cuda" else cpu_peak_bytes(fn)
    return None if peak is None else peak / 2**20


def relative_error(result, reference):
    return ((result - reference).norm() / reference.norm()).item()


# %%
# The common model, and what each recipe will record
# --------------------------------------------------
# Every recipe below registers its ``torch.func`` call under a short name, with the check
# it passed. After all of them, one timing run measures every recipe together.
class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()
        )
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.encoder(x))


model = Classifier().to(device)
batch_size = 32
inputs = torch.randn(batch_size, 16, device=device)
labels = torch.randint(0, 10, (batch_size,), device=device)
params = {name: p.detach() for name, p in model.named_parameters()}
head_params = {name: p.detach() for name, p in model.head.named_parameters()}
print(f"{sum(p.numel() for p in params.values()):,} parameters, batch of {batch_size}")
recipes = {}  # name -> (fn, what it computes)

# %%
# One gradient per example
# ------------------------
# *Taught in* :doc:`plot_per_sample_grads`. ``vmap(grad(loss))`` over the batch, with the
# parameters shared (``in_dims=None``).


def sample_loss(p, x, y):
    return F.cross_entropy(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))


per_sample_fn = vmap(grad(sample_loss), in_dims=(None, 0, 0))
per_sample = per_sample_fn(params, inputs, labels)
for name in params:
    loop = torch.stack(
        [grad(sample_loss)(params, x, y)[name] for x, y in zip(inputs, labels)]
    )
    assert relative_error(per_sample[name], loop) < 1e-5, name
recipes["per-sample gradients"] = partial(per_sample_fn, params, inputs, labels)

# %%
# A tall Jacobian: few inputs, many outputs
# -----------------------------------------
# *Taught in* :doc:`plot_jacobians_hessians`. The representation (256 numbers) with respect to
# one input (16 numbers). Forward mode, ``jacfwd``, needs one pass per *input*, 16 of them;
# reverse mode, ``jacrev``, one per output, 256. That count is the rule of thumb; at sizes this
# small, fixed costs per call can decide instead, so both are timed below (the Jacobians page
# measures where the two cross over).
x0 = inputs[0]
tall = jacfwd(model.encoder)(x0)
torch.testing.assert_close(tall, torch.autograd.functional.jacobian(model.encoder, x0))
recipes["tall Jacobian (jacfwd)"] = partial(jacfwd(model.encoder), x0)
recipes["tall Jacobian (jacrev)"] = partial(jacrev(model.encoder), x0)
print("tall Jacobian:", tuple(tall.shape))

# %%
# A wide Jacobian: many inputs, few outputs
# -----------------------------------------
# *Taught in* :doc:`plot_jacobians_hessians`. The 10 logits with respect to the head's 2,570
# parameters: reverse mode, ``jacrev``, needs one pass per *output*, 10 of them; forward mode
# would need 2,570. Both are timed below.
features = model.encoder(x0).detach()


def head_logits(p):
    return functional_call(model.head, p, (features,))


wide = jacrev(head_logits)(head_params)
torch.testing.assert_close(
    wide["weight"], torch.einsum("ij,k->ijk", torch.eye(10, device=device), features)
)
recipes["wide Jacobian (jacrev)"] = partial(jacrev(head_logits), head_params)
recipes["wide Jacobian (jacfwd)"] = partial(jacfwd(head_logits), head_params)
print("wide Jacobian of the head's weight:", tuple(wide["weight"].shape))

# %%
# A Hessian
# ---------
# *Taught in* :doc:`plot_jacobians_hessians`. The loss's second derivatives with respect to
# one input: ``hessian`` is ``jacfwd(jacrev(...))``, forward over reverse.


def input_loss(x):
    return F.cross_entropy(model(x.unsqueeze(0)), labels[:1])


input_hessian = hessian(input_loss)(x0)
reference = torch.autograd.functional.hessian(input_loss, x0)
assert relative_error(input_hessian, reference) < 1e-5
recipes["Hessian"] = partial(hessian(input_loss), x0)
print("Hessian with respect to the input:", tuple(input_hessian.shape))

# %%
# A Hessian-vector product
# ------------------------
# *Taught in* :doc:`plot_hessian_vector_products`. The Hessian of the loss with respect to the
# head's parameters, times a vector, without forming the Hessian: ``jvp`` of ``grad`` (forward over
# reverse). The check forms the Hessian, which is small for the head alone.


def head_loss(p):
    return F.cross_entropy(functional_call(model.head, p, (features.unsqueeze(0),)),
                           labels[:1])  # fmt: skip


direction = {name: torch.randn_like(p) for name, p in head_params.items()}


def hvp(p, v):
    return jvp(grad(head_loss), (p,), (v,))[1]


product = hvp(head_params, direction)
flat = torch.cat([p.flatten() for p in head_params.values()])
sizes = [p.numel() for p in head_params.values()]


def flat_loss(theta):
    weight, bias = theta.split(sizes)
    as_dict = {"weight": weight.view(10, 256), "bias": bias}
    return head_loss(as_dict)


dense = hessian(flat_loss)(flat) @ torch.cat([v.flatten() for v in direction.values()])
assert (
    relative_error(torch.cat([product[n].flatten() for n in head_params]), dense) < 1e-4
)
recipes["Hessian-vector product"] = partial(hvp, head_params, direction)
print("HVP agrees with the dense Hessian times the vector")

# %%
# A Jacobian for every sample of a batch
# --------------------------------------
# *Taught in* :doc:`plot_batch_jacobians_hessians`. ``vmap(jacrev(f))``: one (10 × 16)
# Jacobian of the logits with respect to each input.
batch_jacobians = vmap(jacrev(model))(inputs)
for b in (0, batch_size - 1):
    torch.testing.assert_close(batch_jacobians[b], jacrev(model)(inputs[b]))
recipes["batch Jacobians"] = partial(vmap(jacrev(model)), inputs)
print("batch of Jacobians:", tuple(batch_jacobians.shape))


# %%
# Per-sample Jacobians with respect to the parameters, and the NTK
# ----------------------------------------------------------------
# *Taught in* :doc:`plot_per_sample_param_jacobians` and :doc:`plot_neural_tangent_kernel`.
# ``vmap(jacrev(...))`` over samples,
# differentiating the logits with respect to the head's parameters; contracting two samples'
# Jacobians over the parameters gives the empirical neural tangent kernel, here its trace over
# the logits: a (B × B) matrix.
def sample_head_logits(p, x):
    return functional_call(model.head, p, (x,))


batch_features = model.encoder(inputs).detach()
param_jacobians_fn = vmap(jacrev(sample_head_logits), in_dims=(None, 0))
param_jacobians = param_jacobians_fn(head_params, batch_features)


def ntk_trace(p, x):
    jac = param_jacobians_fn(p, x)
    flat_jac = torch.cat([j.flatten(start_dim=2) for j in jac.values()], dim=2)
    return torch.einsum("aip,bip->ab", flat_jac, flat_jac)


kernel = ntk_trace(head_params, batch_features)
direct = sum(
    (jacrev(sample_head_logits)(head_params, batch_features[0])[n].flatten()
     * jacrev(sample_head_logits)(head_params, batch_features[1])[n].flatten()).sum()
    for n in head_params
)  # fmt: skip
torch.testing.assert_close(kernel[0, 1], direct)
recipes["per-sample parameter Jacobians"] = partial(
    param_jacobians_fn, head_params, batch_features
)
recipes["NTK (trace)"] = partial(ntk_trace, head_params, batch_features)
print("NTK trace:", tuple(kernel.shape))

# %%
# An ensemble of models in one call
# ---------------------------------
# *Taught in* :doc:`plot_model_ensembling`. :func:`~torch.func.stack_module_state` stacks
# eight models' weights; ``vmap`` over ``functional_call`` runs all eight at once on the same
# batch.
members = [Classifier().to(device) for _ in range(8)]
stacked, buffers = stack_module_state(members)
template = copy.deepcopy(members[0]).to("meta")


def run_member(p, b, x):
    return functional_call(template, (p, b), (x,))


ensemble_fn = vmap(run_member, in_dims=(0, 0, None))
ensemble = ensemble_fn(stacked, buffers, inputs)
for member, output in zip(members, ensemble):
    torch.testing.assert_close(output, member(inputs))
recipes["ensemble of 8"] = partial(ensemble_fn, stacked, buffers, inputs)
print("ensemble outputs:", tuple(ensemble.shape))

# %%
# Many Jacobian-vector products at one point
# ------------------------------------------
# *Taught in* :doc:`plot_neural_tangent_kernel`. ``jvp`` re-runs the forward pass with every call.
# :func:`~torch.func.linearize` runs it once, and returns a function that applies the Jacobian at
# that point to any tangent: worth it when many tangents share one point. Its check is ``jvp``
# itself, and a second check asks ``vjp`` for the transposed product: ``⟨u, J t⟩ = ⟨Jᵀ u, t⟩``.
with warnings.catch_warnings():  # linearize's tracer warns about an internal constant
    warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
    _, jvp_at_x0 = linearize(model, x0)
tangents = torch.randn(16, 16, device=device)
linearized = vmap(jvp_at_x0)(tangents)
fresh = vmap(lambda t: jvp(model, (x0,), (t,))[1])(tangents)
torch.testing.assert_close(linearized, fresh)  # 16 tangents, mapped
_, pullback = vjp(model, x0)
u = torch.randn(10, device=device)
torch.testing.assert_close(
    (u * linearized[0]).sum(), (pullback(u)[0] * tangents[0]).sum()
)
recipes["16 JVPs (linearize)"] = lambda: [jvp_at_x0(t) for t in tangents]
recipes["16 JVPs (jvp)"] = lambda: [jvp(model, (x0,), (t,))[1] for t in tangents]
print("linearize and jvp agree on 16 tangents")

# %%
# Every recipe, timed and sized in one run
# ----------------------------------------
# All recipes take turns in the same timing rounds; then each one's peak memory is measured
# on its own. Three pairs compare the alternatives: ``jacfwd`` and ``jacrev`` for the tall and
# the wide Jacobian, and ``linearize`` against repeated ``jvp`` calls.
times = median_times_ms(recipes, rounds=5, min_run_time=0.1)
peaks = {name: peak_mib(fn) for name, fn in recipes.items()}
for name, ms in times.items():
    peak = "" if peaks[name] is None else f"{peaks[name]:8.2f} MiB"
    print(f"{name:32s} {ms:9.3f} ms {peak}")
print(
    "tall Jacobian: jacrev takes "
    f"{times['tall Jacobian (jacrev)'] / times['tall Jacobian (jacfwd)']:.2f}x the time "
    "of jacfwd"
)
print(
    "wide Jacobian: jacfwd takes "
    f"{times['wide Jacobian (jacfwd)'] / times['wide Jacobian (jacrev)']:.2f}x the time "
    "of jacrev"
)
print(
    "16 JVPs: repeated jvp takes "
    f"{times['16 JVPs (jvp)'] / times['16 JVPs (linearize)']:.2f}x the time of linearize"
)

# %%
# The figure shows the same times on a logarithmic axis; the bars of the pairs are coloured
# by the transform that does the work.
colours = {
    "(jacfwd)": METHOD_COLORS["jacfwd"],
    "(jacrev)": METHOD_COLORS["jacrev"],
    "Hessian": METHOD_COLORS["hessian"],
}
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
names = list(times)
ax.barh(
    names,
    [times[n] for n in names],
    color=[
        next((c for key, c in colours.items() if key in n), METHOD_COLORS["vmap"])
        for n in names
    ],
)
ax.invert_yaxis()
ax.set_xscale("log")
ax.set_xlabel(f"median time on {device.type.upper()} (ms, log scale)")
ax.set_title("One model, every recipe")
plt.show()
