"""
The empirical neural tangent kernel of a small CNN
==================================================

The empirical neural tangent kernel (NTK) of a network compares two inputs through its
parameters: ``Θ(x₁, x₂) = J(x₁) J(x₂)ᵀ``, with ``J(x)`` the Jacobian of the outputs with respect
to all P parameters. It says how a gradient step on one input moves the outputs on another.
This page computes it for a small CNN by contracting per-sample Jacobians (the full kernel, its
trace or its diagonal) and by NTK-vector products (``vjp`` then ``jvp``, the full kernel),
checks every entry against float64 loop Jacobians, and measures when the products save memory.
Bounding the memory of Jacobians is on
:ref:`sphx_glr_auto_examples_models_as_functions_plot_memory_control.py`.
"""

# %%
# The recipe: contract per-sample Jacobians
# -----------------------------------------
# ``jacrev`` builds all rows of a Jacobian at once, by ``vmap`` of one ``vjp`` over the unit
# vectors of the output; ``vmap`` over the images gives each image's (10, p) Jacobian per
# parameter tensor. The kernel sums over the parameter
# tensors the products of the two sides' Jacobians. The einsum string picks the variant: the
# **full** kernel (N₁, N₂, 10, 10), its **trace** (N₁, N₂), or its **diagonal** (N₁, N₂, 10).
import copy
import ctypes
import gc
import json
import platform
import tempfile
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
# float32 convolutions are checked against float64: no TF32 on GPUs
torch.backends.cudnn.allow_tf32 = False
CONTRACTIONS = {
    "full": "naf,mbf->nmab",
    "trace": "naf,maf->nm",
    "diagonal": "naf,maf->nma",
}


def ntk_by_contraction(net, params, images_1, images_2, variant="full"):
    def outputs_of_one(params, image):
        return functional_call(net, params, (image.unsqueeze(0),)).squeeze(0)

    per_sample = vmap(jacrev(outputs_of_one), in_dims=(None, 0))
    jacobians_1 = per_sample(params, images_1).values()  # each (N₁, 10, *shape)
    jacobians_2 = per_sample(params, images_2).values()
    return sum(torch.einsum(CONTRACTIONS[variant], j1.flatten(2), j2.flatten(2))
               for j1, j2 in zip(jacobians_1, jacobians_2))  # fmt: skip


# %%
# A small CNN, and the check against float64 loop Jacobians
# ---------------------------------------------------------
# Two 3×3 convolutions on 12×12 images, a max-pool, a linear layer to 10 outputs; ``width``
# sets the channels. The reference runs autograd on a float64 copy, one backward pass per image
# and output, each a row of ``J[n]`` (10, P). Every entry of each variant must match the same
# variant of ``J₁ J₂ᵀ``, within a bound relative to the largest entry. (Symmetry would not do:
# the kernel of a batch with itself stays symmetric when the einsum swaps two indices.)
class SmallConvNet(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, batch):
        hidden = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(batch)))), 2)
        return self.fc(hidden.flatten(start_dim=1))


def loop_jacobians(net, images):
    net64, rows = copy.deepcopy(net).double(), []
    for image in images.double():
        for output in net64(image.unsqueeze(0))[0]:
            grads = torch.autograd.grad(
                output, list(net64.parameters()), retain_graph=True
            )
            rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows).view(len(images), 10, -1)  # (N, 10, P)


def check_entries(name, kernel, expected):
    scale = expected.abs().max().item()
    error = (kernel.double() - expected).abs().max().item() / scale
    print(f"{name:38s} largest entry error / largest entry: {error:.1e} (bound 1e-05)")
    torch.testing.assert_close(kernel.double(), expected, rtol=0, atol=1e-5 * scale)


model = SmallConvNet().to(device)
params = {name: w.detach() for name, w in model.named_parameters()}
images_1, images_2 = (torch.randn(n, 1, 12, 12, device=device) for n in (8, 6))
jacobians_2 = loop_jacobians(model, images_2)  # (6, 10, P), reused below
reference = torch.einsum("naf,mbf->nmab", loop_jacobians(model, images_1), jacobians_2)
references = {"full": reference, "diagonal": reference.diagonal(dim1=2, dim2=3)}
references["trace"] = references["diagonal"].sum(-1)
print(f"P = {sum(p.numel() for p in params.values()):,} parameters, 10 outputs")
for variant in CONTRACTIONS:
    kernel = ntk_by_contraction(model, params, images_1, images_2, variant)
    check_entries(
        f"contraction, {variant} {tuple(kernel.shape)}", kernel, references[variant]
    )

# %%
# The check can fail where symmetry cannot: swap the two output indices in the einsum (an easy
# slip). The kernel of a batch with itself still equals its transpose, but the entries do not
# match the reference.
CONTRACTIONS["slipped"] = "naf,mbf->nmba"
slipped_self = ntk_by_contraction(model, params, images_1, images_1, "slipped")
torch.testing.assert_close(slipped_self, slipped_self.permute(1, 0, 3, 2))
print("the slipped kernel of batch 1 with itself is symmetric")
try:
    slipped = ntk_by_contraction(model, params, images_1, images_2, "slipped")
    check_entries("slipped output indices", slipped, reference)
except AssertionError as failure:
    print("the entry check fails:", str(failure).splitlines()[2])
else:
    raise AssertionError("the entry-by-entry check missed swapped output indices")
del CONTRACTIONS["slipped"]


# %%
# The second way: NTK-vector products
# -----------------------------------
# The kernel applied to a vector ``u`` (one number per output of batch 2) is
# ``Θ u = J₁ (J₂ᵀ u)``: a ``vjp`` on batch 2, then a ``jvp`` on batch 1. One such product
# holds no Jacobian. The whole kernel needs every unit vector ``u``, ``N₂·10`` of them, and
# then it does hold one: ``vmap(vjp_fn)`` over all unit vectors *is* ``J₂ᵀ``, ``N₂·10``
# parameter-sized rows, checked here against the loop Jacobians of batch 2. ``vmap`` over the
# ``jvp`` then pushes all those rows through batch 1 at once, so its tangent activations grow
# with the number of rows; the memory section measures that.
def pull_back(net, params, images):
    """J(images)ᵀ as one parameter dict, N·10 rows per tensor: vmap of one vjp."""
    _, vjp_fn = vjp(lambda p: functional_call(net, p, (images,)), params)
    count = len(images) * 10
    unit_vectors = torch.eye(count, device=images.device).view(count, -1, 10)
    return vmap(vjp_fn)(unit_vectors)[0]


def push_forward(net, params, images, rows):
    """J(images) t for every row t of ``rows``, all at once: vmap of one jvp."""

    def one_row(tangent):
        outputs = partial(functional_call, net, args=(images,))
        return jvp(outputs, (params,), (tangent,))[1]

    return vmap(one_row)(rows)  # (rows, N, 10)


def ntk_by_products(net, params, images_1, images_2):
    products = push_forward(net, params, images_1, pull_back(net, params, images_2))
    return products.view(len(images_2), 10, len(images_1), 10).permute(2, 0, 3, 1)


check_entries("ntk-vector products, full",
              ntk_by_products(model, params, images_1, images_2), reference)  # fmt: skip
pulled_back = pull_back(model, params, images_2)
stacked_rows = torch.cat([g.flatten(start_dim=1) for g in pulled_back.values()], dim=1)
check_entries("vmap(vjp_fn) over unit vectors = J₂ᵀ", stacked_rows,
              jacobians_2.flatten(0, 1))  # fmt: skip

# %%
# One product, ``Θ u``, for a random ``u``, against the reference kernel applied to ``u``:
u = torch.randn(len(images_2), 10, device=device)


def ntk_times(net, params, images_1, images_2, u):
    _, vjp_fn = vjp(lambda p: functional_call(net, p, (images_2,)), params)
    pulled = vjp_fn(u)  # J₂ᵀ u: one parameter-shaped vector
    return jvp(lambda p: functional_call(net, p, (images_1,)), (params,), pulled)[1]


check_entries("one product Θ u", ntk_times(model, params, images_1, images_2, u),
              torch.einsum("nmab,mb->na", reference, u.double()))  # fmt: skip

# %%
# The kernel matrix
# -----------------
# The trace kernel of 24 images with each other: its diagonal is each image's squared Jacobian
# norm, and the off-diagonal entries say how much a step that fits one image moves the outputs
# on another.
gallery = torch.randn(24, 1, 12, 12, device=device)
trace_kernel = ntk_by_contraction(model, params, gallery, gallery, "trace")
fig, ax = plt.subplots(figsize=(4.6, 3.8), layout="constrained")
image = ax.imshow(trace_kernel.cpu(), cmap="viridis")
fig.colorbar(image, ax=ax, label="trace of Θ(xᵢ, xⱼ)")
ax.set_xlabel("image j")
ax.set_ylabel("image i")
ax.set_title("Empirical NTK (trace) of the small CNN")
plt.show()


# %%
# How fast is it, and how much memory does it take?
# -------------------------------------------------
# We time the full kernel both ways with :class:`torch.utils.benchmark.Timer`, over at least
# five blocks each (median and IQR over the blocks), and measure each call's peak memory above
# what was live before: on a GPU from the CUDA allocator's count of requested bytes, on a CPU from
# :class:`torch.profiler.profile`, which records every allocation and the total allocated after
# it, counted from the call's first allocation. Batch 1 has 8 images; batch 2, the one the
# products pull back, has 8 or 1. As the width grows, P grows faster than it, towards its
# square as the second convolution's weights take over, and the activations in proportion to it.
#
# Each call allocates and frees memory (its peak is printed). On a CPU, under Linux with glibc,
# we first ask ``malloc`` to keep freed memory for reuse, so that a call's time does not depend
# on what ran before it in the same process (:doc:`/reading-timings` says why).
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    libc = ctypes.CDLL(None)
    M_MMAP_MAX, M_TRIM_THRESHOLD = -4, -1  # glibc's <malloc.h>
    for option, value in [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)]:
        assert libc.mallopt(option, value), option


def peak_mib(fn):
    gc.disable()  # a collection during the call could free older garbage and hide its peak
    try:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_stats()["requested_bytes.all.current"]
            fn()
            peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
            return (peak - held) / 2**20
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as rec:
            fn()
    finally:
        gc.enable()
    with tempfile.TemporaryDirectory() as trace_dir:
        trace_file = Path(trace_dir, "allocations.json")
        rec.export_chrome_trace(str(trace_file))
        events = json.loads(trace_file.read_text())["traceEvents"]
    allocations = [e["args"] for e in events if e.get("name") == "[memory]"]
    # The running total carries over what earlier recordings saw allocated but not freed:
    # measure from the first allocation's total less its own bytes.
    start = allocations[0]["Total Allocated"] - allocations[0]["Bytes"]
    return (max(a["Total Allocated"] for a in allocations) - start) / 2**20


def time_and_peak(call):
    timer = benchmark.Timer(stmt="call()", globals={"call": call},
                            num_threads=torch.get_num_threads())  # fmt: skip
    times = timer.blocked_autorange(min_run_time=0.1)
    while len(times.times) < 5:  # a slow call fills few blocks: add blocks of one call
        times = benchmark.Measurement.merge([times, timer.timeit(1)])[0]
    return times, peak_mib(call)


def ms(times):
    iqr = times.iqr * 1e3  # in ms: one decimal, or two significant digits below 0.1 ms
    spread = f"{iqr:.1f}" if iqr >= 0.1 else f"{iqr:.2g}"
    return f"{times.median * 1e3:6.1f} ms (IQR {spread} ms, {len(times.times)} blocks)"


METHODS = {"jacrev": ntk_by_contraction, "ntk-vector products": ntk_by_products}
METHOD_COLORS = {"jacrev": "#0072B2", "ntk-vector products": "#5D69B1"}
widths, sweep = [8, 16, 32], []
for batch_2_size in [8, 1]:
    sweep_images_1 = torch.randn(8, 1, 12, 12, device=device)
    sweep_images_2 = torch.randn(batch_2_size, 1, 12, 12, device=device)
    for width in widths:
        net = SmallConvNet(width).to(device)
        net_params = {name: p.detach() for name, p in net.named_parameters()}
        num_params = sum(p.numel() for p in net_params.values())
        row = {"N₂": batch_2_size, "P": num_params}
        for method, ntk in METHODS.items():
            call = partial(ntk, net, net_params, sweep_images_1, sweep_images_2)
            row[method] = time_and_peak(call)
        (jac_time, jac_mib), (ntk_time, ntk_mib) = (
            row["jacrev"],
            row["ntk-vector products"],
        )
        jacobian_2_mib = batch_2_size * 10 * num_params * 4 / 2**20
        r = ntk_time.median / jac_time.median
        pace = (
            f"take {r:.2f}x the time of" if r >= 1 else f"are {1 / r:.2f}x faster than"
        )
        print(f"N₂={batch_2_size} P={num_params:6,}: jacrev {ms(jac_time)} {jac_mib:5.1f} MiB"
              f" | products {ms(ntk_time)} {ntk_mib:5.1f} MiB (J₂: {jacobian_2_mib:4.1f} MiB)\n"
              f"    the products {pace} jacrev; {ntk_mib / jac_mib:.2f}x its memory")  # fmt: skip
        sweep.append(row)

# %%
# The products build ``J₂`` (its size is printed beside their peak), then push its rows through
# batch 1; the contraction builds both batches' Jacobians. Both steps of the products carry every
# row through every image of a batch at once (80 rows by 8 images at the widest), where the
# contraction carries each image's 10 rows through that image alone. On the widest network, with
# batch 1 on both sides, we measure each step alone: the pull-back, and the push-forward (of rows
# computed beforehand, so not counted) of the first 10 rows and of all 80. If every row's tangent
# activations are held at once, each added row adds at least the tangents of the second
# convolution's input and output for the 8 images: both are live while it runs.
rows = pull_back(net, net_params, sweep_images_1)
push_peak = {}
for count in (10, 80):
    first_rows = {name: r[:count] for name, r in rows.items()}
    push_peak[count] = peak_mib(
        partial(push_forward, net, net_params, sweep_images_1, first_rows)
    )
pull_peak = peak_mib(partial(pull_back, net, net_params, sweep_images_1))
whole_peak = peak_mib(
    partial(ntk_by_products, net, net_params, sweep_images_1, sweep_images_1)
)
j2_mib = 80 * num_params * 4 / 2**20  # the widest network's J₂ for 8 images
w = net.conv1.out_channels  # conv2's tangent input: (w, 10, 10); output: (2w, 8, 8)
per_row_mib = 8 * (w * 10 * 10 + 2 * w * 8 * 8) * 4 / 2**20  # for 8 images
growth = push_peak[80] - push_peak[10]
print(f"pull-back {pull_peak:.1f} MiB (J₂ {j2_mib:.1f} MiB); push-forward "
      f"{push_peak[10]:.1f} MiB for 10 rows, {push_peak[80]:.1f} MiB for 80; "
      f"both together {whole_peak:.1f} MiB")  # fmt: skip
steps = {"the pull-back": pull_peak, "J₂ plus the push-forward": j2_mib + push_peak[80]}
larger = max(steps, key=steps.get)
print(f"the larger step is {larger}; the whole call's peak is "
      f"{whole_peak / steps[larger]:.2f}x its peak")  # fmt: skip
bound = 70 * per_row_mib
print(f"push-forward, 10 to 80 rows: +{growth:.1f} MiB; 70 rows of conv2's tangent input"
      f" and output: {bound:.1f} MiB ({growth / bound:.2f}x, bound 1)")  # fmt: skip
assert growth >= bound, "the push-forward held fewer rows at once"

# %%
# So with ``N₂ = N₁`` the products save one of the two Jacobians but carry all rows at once in
# both steps. The printed lines name the step with the larger peak, and say whether it alone
# accounts for the whole call's peak (on a CPU it did). On a GPU, a library's scratch memory
# inside an operation can come on top and dominate the peak; the steps measured alone show which
# one holds it. When batch 2 is small, the products hold one small Jacobian and the contraction
# still holds batch 1's. We assert, at every width, that the products take more memory than the
# contraction with 8 images in batch 2, and that the ratio drops with one image; and that with one
# image they take less at the widest network. So: pull back the *smaller* batch (swap the roles
# and transpose the kernel if need be).
memory_ratio = {
    (r["N₂"], r["P"]): r["ntk-vector products"][1] / r["jacrev"][1] for r in sweep
}
for size in {r["P"] for r in sweep}:
    assert memory_ratio[8, size] > 1, size
    assert memory_ratio[1, size] < memory_ratio[8, size], size
assert memory_ratio[1, max(r["P"] for r in sweep)] < 1

fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
for method, color in METHOD_COLORS.items():
    for batch_2_size, style in [(8, "-"), (1, "--")]:
        rows_drawn = [r for r in sweep if r["N₂"] == batch_2_size]
        for ax, pick in [
            (ax_time, lambda m: m[0].median * 1e3),
            (ax_memory, lambda m: m[1]),
        ]:
            ax.plot([r["P"] for r in rows_drawn], [pick(r[method]) for r in rows_drawn], style,
                    marker="o", color=color, label=f"{method}, N₂ = {batch_2_size}")  # fmt: skip
for ax, label in [(ax_time, "median time (ms)"), (ax_memory, "peak memory (MiB)")]:
    ax.set(xscale="log", yscale="log", xlabel="parameters P", ylabel=label)
ax_time.set_title("Full kernel, N₁ = 8: time")
ax_memory.set_title("Full kernel, N₁ = 8: peak memory")
ax_memory.legend(fontsize=8)
plt.show()


# %%
# Where the products do save memory: one ``Θ u``
# ----------------------------------------------
# An iterative solver on the kernel (conjugate gradients for kernel regression, a power
# iteration for its top eigenvalue) needs ``Θ u`` for one ``u`` at a time. Then one ``vjp`` and
# one ``jvp`` replace both Jacobians. We compare its peak memory and time with forming the
# kernel by contraction and multiplying, on the widest network, with 8 images on each side.
# (The product was checked entry by entry above.) Its peak must stay below the size of one
# batch's Jacobian, ``8·10·P`` floats.
def kernel_then_multiply():
    kernel = ntk_by_contraction(net, net_params, sweep_images_1, sweep_images_1)
    return torch.einsum("nmab,mb->na", kernel, u_wide)


u_wide = torch.randn(8, 10, device=device)
one_product = {
    "jacrev": kernel_then_multiply,
    "ntk-vector products": lambda: ntk_times(
        net, net_params, sweep_images_1, sweep_images_1, u_wide
    ),  # fmt: skip
}
torch.testing.assert_close(one_product["ntk-vector products"](), kernel_then_multiply(),
                           rtol=1e-4, atol=1e-4 * u_wide.abs().max().item())  # fmt: skip
measured = {}
for method, call in one_product.items():
    measured[method] = time_and_peak(call)
    print(f"Θ u by {method:19s}: {ms(measured[method][0])}, "
          f"peak {measured[method][1]:6.2f} MiB")  # fmt: skip
(jac_time, jac_mib), (ntk_time, ntk_mib) = measured.values()
widest_p = sum(p.numel() for p in net_params.values())
batch_jacobian_mib = len(sweep_images_1) * 10 * widest_p * 4 / 2**20
r = ntk_time.median / jac_time.median
pace = f"takes {r:.2f}x the time of" if r >= 1 else f"is {1 / r:.2f}x faster than"
print(f"one product {pace} the kernel route, with {ntk_mib / jac_mib:.3f}x its memory; "
      f"one batch's Jacobian is {batch_jacobian_mib:.2f} MiB")  # fmt: skip
assert ntk_mib < batch_jacobian_mib, "one NTK-vector product held a batch's Jacobian"

# %%
# What to remember
# ----------------
# * The empirical NTK is an einsum over ``vmap(jacrev(f))`` Jacobians, summed over parameter
#   tensors; the full kernel, its trace and its diagonal differ only in the einsum string.
# * Check a kernel entry by entry against float64 loop Jacobians: symmetry holds even when an
#   index is wrong, and the entry check caught a slipped index here.
# * The whole kernel by NTK-vector products holds ``J₂`` (``vmap(vjp_fn)`` over unit vectors is
#   ``J₂ᵀ``) and runs all its rows at once, in the pull-back and in the push-forward: here it
#   took less memory than the contraction with one image in batch 2, and more with eight.
