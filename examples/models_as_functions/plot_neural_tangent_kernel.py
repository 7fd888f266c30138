"""
The empirical neural tangent kernel, and Jacobians that fit in memory
=====================================================================

The empirical neural tangent kernel (NTK) of a network ``f(θ, x)`` compares two inputs
through the parameters: ``Θ(x₁, x₂) = J(x₁) J(x₂)ᵀ``, where ``J(x)`` is the Jacobian of the
outputs with respect to the parameters. It describes how a gradient step on one input moves
the outputs on another, and it is the kernel of the linearised network. This page computes it
for a small CNN two ways (contracting per-sample Jacobians, and NTK-vector products that never
hold a Jacobian), with its trace and diagonal variants, checks both against loop-computed
Jacobians in float64, and times them. Then it turns to what makes Jacobians fail in practice,
running out of memory: ``chunk_size`` on ``jacrev`` and on ``vmap`` as curves of memory and
time, a rule for choosing a chunk size from the memory you have (checked against a
measurement), and :func:`~torch.func.linearize` for reusing one linearisation across many
Jacobian-vector products.
"""

# %%
# Where this page ran
# -------------------
# We use the GPU when there is one and seed the random number generator.
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
from torch.func import functional_call, jacrev, jvp, linearize, vjp, vmap
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
# On NVIDIA GPUs, cuDNN runs float32 convolutions in TF32 by default, with a 10-bit mantissa.
# The checks on this page compare float32 results with float64 ones, so we ask cuDNN for full
# float32; on a CPU the setting changes nothing.
torch.backends.cudnn.allow_tf32 = False


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
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's <malloc.h>


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
# calls. Peak memory of one call: on a GPU from the CUDA allocator's record of the call; on a
# CPU with glibc from malloc's own count of the bytes it has handed out, read after every
# tensor operation of the call by a ``TorchDispatchMode`` (a hook that sees each operation;
# it lives in ``torch.utils._python_dispatch``, a private module). Matrix products run in full
# float32 precision.
torch.set_float32_matmul_precision("highest")


def median_times_ms(methods, rounds=7, min_run_time=0.05, warmup=3):
    """Median time of each method in ``{name: fn}``, in ms, round after round."""
    for fn in methods.values():
        for _ in range(warmup):
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


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): the heap's counters, in bytes."""

    _fields_ = [
        (field, ctypes.c_size_t)
        for field in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                      "fsmblks", "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


class PeakLiveMemory(TorchDispatchMode):
    """Reads malloc's count of live bytes (heap chunks in use plus mmapped blocks) after
    every tensor operation run under it, and keeps the highest."""

    def __init__(self, mallinfo2):
        super().__init__()
        self.mallinfo2 = mallinfo2
        self.peak = self.live_bytes()

    def live_bytes(self):
        info = self.mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.live_bytes())
        return result


def cpu_peak_bytes(fn):
    """Peak of live malloc'd memory during fn(), above where it started; None without
    glibc 2.33's mallinfo2. Unlike resident memory, this does not depend on what earlier
    cells left in the heap: it counts what is allocated, not which pages are touched."""
    libc = glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = MallInfo2  # a struct returned by value
    tracker = PeakLiveMemory(mallinfo2)
    start = tracker.peak
    with tracker:
        fn()
    return tracker.peak - start


def peak_mib(fn):
    # Garbage from earlier cells, if collected during the call, would hide part of its peak.
    gc.collect()
    peak = cuda_peak_bytes(fn) if device.type == "cuda" else cpu_peak_bytes(fn)
    return None if peak is None else peak / 2**20


# %%
# A small CNN
# -----------
# Two 3×3 convolutions on 12×12 single-channel images, a max-pool and a linear layer to 10
# outputs. ``width`` sets the channels, so that we can vary the number of parameters P later.


class SmallCNN(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, images):
        hidden = F.relu(self.conv1(images))
        hidden = F.max_pool2d(F.relu(self.conv2(hidden)), 2)
        return self.fc(hidden.flatten(start_dim=1))


def make_images(count, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 1, 12, 12, generator=generator).to(device)


model = SmallCNN().to(device)
params = {name: p.detach() for name, p in model.named_parameters()}
num_params = sum(p.numel() for p in params.values())
num_outputs = 10
print(f"CNN: P = {num_params:,} parameters, {num_outputs} outputs")


def outputs_fn(params, images):
    return functional_call(model, params, (images,))


# %%
# The reference: Jacobians from a loop, in float64
# ------------------------------------------------
# One backward pass per sample and per output, with ordinary autograd on a float64 copy of
# the model, flattened over the parameters: ``J[n]`` has shape (10, P). The kernel is then a
# plain product of two such matrices, block by block.


def loop_jacobians(images):
    model.double()
    weights = list(model.parameters())
    rows = []
    for image in images.double():
        outputs = model(image.unsqueeze(0))[0]
        per_output = [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(out, weights, retain_graph=True)
                ]
            )
            for out in outputs
        ]
        rows.append(torch.stack(per_output))
    model.float()
    return torch.stack(rows)  # (N, 10, P)


images_a, images_b = make_images(8, seed=1), make_images(6, seed=2)
jacobians_a, jacobians_b = loop_jacobians(images_a), loop_jacobians(images_b)
reference_ntk = torch.einsum("naf,mbf->nmab", jacobians_a, jacobians_b)
print(f"reference kernel: {tuple(reference_ntk.shape)} = (N₁, N₂, outputs, outputs)")

# %%
# Way 1: contract per-sample Jacobians
# ------------------------------------
# ``vmap(jacrev(...))`` gives every sample's Jacobian with respect to every parameter tensor,
# as on the per-sample Jacobians page. The kernel sums, over all parameter tensors, the
# products of the two sides' Jacobians. The einsum string picks the variant:
#
# * the **full** kernel keeps both output indices, ``(N₁, N₂, 10, 10)``;
# * the **trace** sums the matching outputs, ``Σₐ Jₐ(x₁)·Jₐ(x₂)``, one number per pair;
# * the **diagonal** keeps the matching outputs apart, ``(N₁, N₂, 10)``.
CONTRACTIONS = {
    "full": "naf,mbf->nmab",
    "trace": "naf,maf->nm",
    "diagonal": "naf,maf->nma",
}


def sample_outputs(params, image):
    return outputs_fn(params, image.unsqueeze(0)).squeeze(0)


def per_sample_jacobians(params, images, chunk_size=None):
    jacobians = vmap(jacrev(sample_outputs), (None, 0), chunk_size=chunk_size)(
        params, images
    )
    return [j.flatten(start_dim=2) for j in jacobians.values()]  # each (N, 10, p_i)


def ntk_by_contraction(params, images_1, images_2, variant="full"):
    jacobians_1 = per_sample_jacobians(params, images_1)
    jacobians_2 = per_sample_jacobians(params, images_2)
    return sum(
        torch.einsum(CONTRACTIONS[variant], j1, j2)
        for j1, j2 in zip(jacobians_1, jacobians_2)
    )


# %%
# Way 2: NTK-vector products
# --------------------------
# The kernel applied to a vector needs no Jacobian: ``Θ u = J₁ (J₂ᵀ u)`` is a vector-Jacobian
# product on the second batch followed by a Jacobian-vector product on the first. Feeding in
# every unit vector ``u`` (one per output of the second batch, ``N₂·10`` of them, batched
# with ``vmap``) recovers the whole kernel, and at no point is a (10, P) Jacobian stored: the
# largest object is ``N₂·10`` parameter-sized vectors.


def ntk_by_products(params, images_1, images_2):
    _, vjp_fn = vjp(lambda p: outputs_fn(p, images_2), params)
    count = len(images_2) * num_outputs
    unit_vectors = torch.eye(count, device=device).view(
        count, len(images_2), num_outputs
    )
    pulled_back = vmap(vjp_fn)(unit_vectors)[0]  # J₂ᵀ u: parameter-shaped, one per u

    def pushed_forward(tangent):
        return jvp(lambda p: outputs_fn(p, images_1), (params,), (tangent,))[1]

    products = vmap(pushed_forward)(pulled_back)  # (N₂·10, N₁, 10)
    products = products.view(len(images_2), num_outputs, len(images_1), num_outputs)
    return products.permute(2, 0, 3, 1)  # (N₁, N₂, 10, 10)


# %%
# Checking both ways and all three variants
# -----------------------------------------
# Every result is compared, on its own, with the float64 reference, and each variant with the
# variant taken from the reference's full kernel. A kernel is also symmetric: the kernel of a
# batch with itself must equal its transpose. The bound, 1e-5 relative, leaves room for
# float32's rounding over P terms and is far below what a wrong index or a missing parameter
# tensor would cause.
def relative_error(result, reference):
    return ((result.double() - reference).norm() / reference.norm()).item()


reference_variants = {
    "full": reference_ntk,
    "trace": reference_ntk.diagonal(dim1=2, dim2=3).sum(-1),
    "diagonal": reference_ntk.diagonal(dim1=2, dim2=3),
}
results = {
    f"contraction, {variant}": (
        ntk_by_contraction(params, images_a, images_b, variant),
        variant,
    )
    for variant in CONTRACTIONS
}
results["ntk-vector products, full"] = (
    ntk_by_products(params, images_a, images_b),
    "full",
)
for name, (kernel, variant) in results.items():
    error = relative_error(kernel, reference_variants[variant])
    print(f"{name:27s} {tuple(kernel.shape)!s:16s} relative error {error:.1e}")
    assert kernel.shape == reference_variants[variant].shape, name
    assert error < 1e-5, f"{name}: relative error {error:.2e}"
self_kernel = ntk_by_contraction(params, images_a, images_a)
torch.testing.assert_close(self_kernel, self_kernel.permute(1, 0, 3, 2))
print("the kernel of a batch with itself is symmetric")

# %%
# The check can fail: swap the two output indices of the full kernel (an easy slip in the
# ``permute`` above) and the off-diagonal output blocks no longer match.
swapped = results["ntk-vector products, full"][0].transpose(2, 3)
swapped_error = relative_error(swapped, reference_ntk)
print(f"output indices swapped: relative error {swapped_error:.2f}")
assert swapped_error > 1e-2

# %%
# The kernel matrix
# -----------------
# The trace kernel of 24 images with each other: its diagonal is each image's squared
# Jacobian norm, and the off-diagonal entries say how much a step that fits one image moves
# the outputs on another.
gallery = make_images(24, seed=3)
trace_kernel = ntk_by_contraction(params, gallery, gallery, "trace")
fig, ax = plt.subplots(figsize=(4.6, 3.8), layout="constrained")
image = ax.imshow(trace_kernel.cpu(), cmap="viridis")
fig.colorbar(image, ax=ax, label="trace of Θ(xᵢ, xⱼ)")
ax.set_xlabel("image j")
ax.set_ylabel("image i")
ax.set_title("Empirical NTK (trace) of the small CNN")
plt.show()

# %%
# Which way wins, and when
# ------------------------
# The contraction stores ``(N₁ + N₂)·10·P`` numbers and then does ``N₁·N₂·100·P``
# multiply-adds. The products store ``N₂·10·P`` numbers and run ``N₂·10`` batched
# Jacobian-vector products, each a forward pass over the first batch. So the contraction
# grows with P only through one big matrix product, while the products pay a forward pass
# per output of the second batch. We time both at growing width (P) for two batches of 8.
widths = [8, 16, 32]
sweep_images_a, sweep_images_b = make_images(8, seed=4), make_images(8, seed=5)
checked_model = model
for width in widths:
    model = SmallCNN(width).to(device)
    sweep_params = {name: p.detach() for name, p in model.named_parameters()}
    times = median_times_ms(
        {
            "contraction": partial(
                ntk_by_contraction, sweep_params, sweep_images_a, sweep_images_b
            ),
            "ntk-vector products": partial(
                ntk_by_products, sweep_params, sweep_images_a, sweep_images_b
            ),
        },
        rounds=3,
    )
    sweep_num_params = sum(p.numel() for p in sweep_params.values())
    print(
        f"P = {sweep_num_params:7,}: contraction {times['contraction']:7.2f} ms, "
        f"NTK-vector products {times['ntk-vector products']:7.2f} ms -> the products take "
        f"{times['ntk-vector products'] / times['contraction']:.2f}x the contraction's time"
    )
model = checked_model  # outputs_fn runs the global model: back to the one checked above

# %%
# The ratios above are this machine's answer at these sizes; a GPU, on which kernels this
# small leave most of the chip idle, can give the opposite one. The counts say where it moves:
# the contraction's cost is one large matrix product and its memory is the Jacobians, so it
# gains as P grows while they fit; the products never hold a Jacobian, so they are the way
# out when the Jacobians do not fit, and the cheaper way when only a few kernel-vector
# products are needed (an iterative solver on the kernel), since each costs one ``vjp`` and
# one ``jvp``.

# %%
# Memory: ``chunk_size`` on ``jacrev``
# ------------------------------------
# ``jacrev`` computes a Jacobian by mapping a ``vjp`` over all unit vectors of the output,
# and ``vmap`` batches them: every intermediate of the backward pass is held once *per output
# row, all at the same time*. That is what makes ``jacrev`` and ``hessian`` run out of memory,
# and it bites hardest where the intermediates are much larger than the Jacobian itself. (For
# Jacobians with respect to the *parameters*, as above, each row is P numbers and the result
# itself dominates: chunking cannot shrink the result.)
#
# Our example is shaped like a transformer block: a sequence of 32 tokens of 16 features, an
# MLP applied to every token (16 → 512 → 512 → 4, ``tanh``), then a linear layer that mixes
# the tokens. Its Jacobian is (4, 32) outputs by (32, 16) inputs, 256 KiB; but each of its 128
# backward passes carries (32, 512) activations through the MLP.
#
# ``jacrev(f, chunk_size=c)`` maps ``c`` rows at a time and concatenates them. We measure
# peak memory and time against ``c`` and check every chunked Jacobian against the unchunked
# one.


class TokenMixer(nn.Module):
    def __init__(self, tokens=32, features=16, hidden=512, outputs=4):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(features, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, outputs),
        )
        self.mix = nn.Linear(tokens, tokens)

    def forward(self, sequence):  # (tokens, features) -> (outputs, tokens)
        return self.mix(self.mlp(sequence).T)


mixer = TokenMixer().to(device)
sequences = torch.randn(8, 32, 16, generator=torch.Generator().manual_seed(6)).to(
    device
)


def input_jacobian(sequence, chunk_size=None):
    return jacrev(mixer, chunk_size=chunk_size)(sequence)  # (4, 32, 32, 16)


with torch.no_grad():  # the parameters are fixed here; jacrev differentiates the input
    full_jacobian = input_jacobian(sequences[0])
    jacrev_chunks = [1, 4, 16, 64, 128]  # 128 rows: the last is no chunking at all
    jacrev_curve = {}
    for chunk_size in jacrev_chunks:
        call = partial(input_jacobian, sequences[0], chunk_size)
        torch.testing.assert_close(
            call(), full_jacobian, msg=f"chunk_size={chunk_size}"
        )
        jacrev_curve[chunk_size] = (
            median_times_ms({"jacrev": call}, rounds=3, warmup=1)["jacrev"],
            peak_mib(call),
        )
print(f"the Jacobian itself: {full_jacobian.numel() * 4 / 2**10:.0f} KiB")
for chunk_size, (milliseconds, peak) in jacrev_curve.items():
    shown = "n/a" if peak is None else f"{peak:6.1f} MiB"
    print(f"jacrev chunk_size={chunk_size:3d}: {milliseconds:6.1f} ms, peak {shown}")

# %%
# Memory: ``chunk_size`` on ``vmap``
# ----------------------------------
# One Jacobian per sequence of a batch of 8 is ``vmap(jacrev(f))``, and the same holds one
# level up: ``vmap`` runs every sequence's 128 backward passes at once.
# ``vmap(..., chunk_size=c)`` runs ``c`` sequences at a time.
with torch.no_grad():
    full_batch_jacobian = vmap(jacrev(mixer))(sequences)
    vmap_chunks = [1, 2, 4, 8]
    vmap_curve = {}
    for chunk_size in vmap_chunks:
        call = partial(vmap(jacrev(mixer), chunk_size=chunk_size), sequences)
        torch.testing.assert_close(
            call(), full_batch_jacobian, msg=f"vmap chunk_size={chunk_size}"
        )
        vmap_curve[chunk_size] = (
            median_times_ms({"vmap": call}, rounds=3, warmup=1)["vmap"],
            peak_mib(call),
        )
for chunk_size, (milliseconds, peak) in vmap_curve.items():
    shown = "n/a" if peak is None else f"{peak:6.1f} MiB"
    print(f"vmap chunk_size={chunk_size:3d}: {milliseconds:7.1f} ms, peak {shown}")

# %%
# Choosing a chunk size from the memory you have
# ----------------------------------------------
# Peak memory is, to a good approximation, a fixed part (the inputs, the result, the forward
# pass) plus a part per unit vector in flight: ``peak(c) ≈ base + c · per_row``. Two
# measurements give both numbers, and then the largest chunk that fits a budget ``M`` is
# ``c = ⌊(M − base) / per_row⌋``. Two things to keep in mind: the per-row part is measured, not
# derived (it depends on which intermediates the backward pass keeps), and the budget must
# leave room for whatever else is alive. We fit the rule on ``jacrev``'s two extreme chunk
# sizes, ask it for the chunk that fits a budget of a third of the unchunked peak, and measure
# that chunk.
if jacrev_curve[jacrev_chunks[0]][1] is not None:
    small_c, large_c = jacrev_chunks[0], jacrev_chunks[-1]
    small_peak, large_peak = jacrev_curve[small_c][1], jacrev_curve[large_c][1]
    per_row = (large_peak - small_peak) / (large_c - small_c)
    base = small_peak - per_row * small_c
    budget = large_peak / 3
    chosen = int((budget - base) // per_row)
    predicted = base + per_row * chosen
    chosen_call = partial(input_jacobian, sequences[0], chosen)
    with torch.no_grad():
        chosen_call()  # a first call at a new chunk size sets things up once; not counted
        measured = peak_mib(chosen_call)
    print(
        f"fit: base {base:.1f} MiB + {per_row:.3f} MiB per row; budget {budget:.0f} MiB "
        f"-> chunk_size={chosen}"
    )
    print(
        f"chunk_size={chosen}: predicted peak {predicted:.0f} MiB, measured "
        f"{measured:.0f} MiB ({measured / budget:.2f} of the budget)"
    )
    assert measured <= 1.1 * budget, "the rule's chunk size does not fit its budget"
    assert abs(measured - predicted) < 0.2 * predicted, "the linear rule is off"
else:
    chosen = None
    print("peak memory is measured on CUDA and on Linux CPUs only")


# %%
# ``linearize``: one linearisation, many Jacobian-vector products
# ----------------------------------------------------------------
# ``jvp(f, (θ,), (t,))`` runs the forward pass of ``f`` every time it is called, alongside
# the tangent. When the same ``θ`` meets many tangents one after another (an iterative solver,
# a Krylov method on the kernel), :func:`~torch.func.linearize` runs ``f`` once, records the
# linear map ``t ↦ J t`` as a graph with the forward pass's values folded in, and returns a
# function that evaluates only that map. The cost: the time to trace it, once, and the memory
# of the values it keeps for as long as the function lives. (Tracing folds constants, and
# torch's FX prints a harmless warning about it, which we silence.)
batch = make_images(64, seed=7)  # the CNN's outputs on 64 images, at fixed parameters


def batch_outputs(p):
    return outputs_fn(p, batch)


def make_linearized():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        return linearize(batch_outputs, params)[1]


tangents = [{name: torch.randn_like(p) for name, p in params.items()} for _ in range(3)]
linearized = make_linearized()
for tangent in tangents:
    torch.testing.assert_close(
        linearized(tangent), jvp(batch_outputs, (params,), (tangent,))[1]
    )
print("the linearised function agrees with jvp on 3 random tangents")

linearize_ms = median_times_ms(
    {
        "trace": make_linearized,
        "jvp": lambda: jvp(batch_outputs, (params,), (tangents[0],)),
        "linearized": lambda: linearized(tangents[0]),
    },
    rounds=3,
)
saving_ms = linearize_ms["jvp"] - linearize_ms["linearized"]
print(
    f"linearize once: {linearize_ms['trace']:.1f} ms; then each product "
    f"{linearize_ms['linearized']:.2f} ms against {linearize_ms['jvp']:.2f} ms for jvp"
)
if saving_ms > 0:
    break_even = linearize_ms["trace"] / saving_ms
    print(f"linearize pays for itself after about {break_even:.0f} products")
else:
    break_even = None
    print("here a linearised product is no faster than jvp: linearize does not pay")
tracing_peak = peak_mib(make_linearized)
if tracing_peak is not None:
    print(
        f"tracing it takes a peak of {tracing_peak:.1f} MiB above what was live before"
    )

# %%
# The second figure: on the left, the two ``chunk_size`` curves, time against peak memory;
# on the right, the total time of K Jacobian-vector products with ``jvp`` and with
# ``linearize``, whose lines cross at the break-even point.
fig, (ax_chunk, ax_linear) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
for label, curve, color in [
    ("jacrev chunk_size", jacrev_curve, METHOD_COLORS["jacrev"]),
    ("vmap chunk_size", vmap_curve, METHOD_COLORS["vmap chunked"]),
]:
    if curve[next(iter(curve))][1] is None:
        continue
    ax_chunk.plot([peak for _, peak in curve.values()], [ms for ms, _ in curve.values()],
                  marker="o", color=color, label=label)  # fmt: skip
    for chunk_size, (milliseconds, peak) in curve.items():
        ax_chunk.annotate(str(chunk_size), (peak, milliseconds), textcoords="offset points",
                          xytext=(3, 3), fontsize=8)  # fmt: skip
ax_chunk.set_xscale("log")
ax_chunk.set_yscale("log")
ax_chunk.set_xlabel("peak memory (MiB)")
ax_chunk.set_ylabel("time (ms)")
ax_chunk.set_title("chunk_size: memory against time")
ax_chunk.legend(fontsize=8)
counts = torch.arange(0, 201)
ax_linear.plot(counts, counts * linearize_ms["jvp"], color=METHOD_COLORS["ntk-vector products"],
               label="jvp each time")  # fmt: skip
ax_linear.plot(counts, linearize_ms["trace"] + counts * linearize_ms["linearized"],
               color=METHOD_COLORS["linearize"], label="linearize once, then products")  # fmt: skip
ax_linear.set_xlabel("number of Jacobian-vector products")
ax_linear.set_ylabel("total time (ms)")
ax_linear.set_title("jvp or linearize")
ax_linear.legend(fontsize=8)
plt.show()

# %%
# What to take away
# -----------------
# * The empirical NTK is a contraction of per-sample parameter Jacobians; when those do not
#   fit, NTK-vector products give the same kernel, or its action on a vector, without them.
# * ``jacrev`` and ``vmap`` hold the intermediates of every row or sample they map at once;
#   ``chunk_size`` trades time for that memory, and a chunk size can be chosen from two
#   measurements and the memory you have.
# * ``linearize`` trades one trace, and the memory of its kept values, for cheaper
#   Jacobian-vector products at a fixed point.
