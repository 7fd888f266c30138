"""
Jacobians and Hessians: ``jacrev``, ``jacfwd`` and ``hessian``
==============================================================

A Jacobian collects the derivative of every output with respect to every input. Autograd's
``backward`` gives one row of it per pass (a vector-Jacobian product), so the classic recipe
loops over rows. ``torch.func`` vectorises that loop with ``vmap``, and offers two engines:
reverse mode, ``jacrev``, with one pass per output, and forward mode, ``jacfwd``, with one pass
per input. On this page you will compute a Jacobian three ways and check each against the
formula, learn which engine wins for tall and for wide Jacobians, find where they cross over
on the machine that built the page, and compute Hessians by composing the two.
"""

# %%
# Where this page ran
# -------------------
# The timings below depend on the hardware, so we print it. We pick the GPU when there is one
# and seed the generator so every run sees the same weights and inputs.
import os
import platform
import re
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev, vjp, vmap
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


def median_ms(fn, min_run_time=0.3):
    """Median time of ``fn()`` in milliseconds, using all of torch's threads."""
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


# %%
# The function and its exact Jacobian
# -----------------------------------
# One dense layer with a ``tanh``: *f(W, b, x) = tanh(W x + b)*. It is small enough to
# differentiate by hand, which gives an independent reference for every check on this page:
#
# .. code-block:: text
#
#    ∂f_i/∂x_k  = (1 − f_i²) W_ik
#    ∂f_i/∂b_j  = (1 − f_i²) δ_ij
#    ∂f_i/∂W_jk = (1 − f_i²) δ_ij x_k


def layer(weight, bias, x):
    return torch.tanh(F.linear(x, weight, bias))


def exact_input_jacobian(weight, bias, x):
    y = layer(weight, bias, x)
    return (1 - y**2)[:, None] * weight


size = 16
weight = torch.randn(size, size, device=device) / size**0.5
bias = torch.randn(size, device=device)
x = torch.randn(size, device=device)
reference = exact_input_jacobian(weight, bias, x)
print("Jacobian shape (outputs, inputs):", tuple(reference.shape))

# %%
# Way 1: row by row with ``autograd.grad``
# ----------------------------------------
# Backpropagating the unit vector ``e_i`` from the output gives row ``i`` of the
# Jacobian: ``e_iᵀ J``. One backward pass per output, in a Python loop, keeping the
# graph alive between passes.


def jacobian_row_by_row(weight, bias, x):
    x = x.detach().requires_grad_()
    y = layer(weight, bias, x)
    unit_vectors = torch.eye(y.numel(), device=y.device)
    rows = [torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in unit_vectors]
    return torch.stack(rows)


row_by_row = jacobian_row_by_row(weight, bias, x)
torch.testing.assert_close(row_by_row, reference)

# %%
# Way 2: ``vmap`` over ``vjp``
# ----------------------------
# :func:`~torch.func.vjp` returns a function that computes ``vᵀ J`` for any ``v``.
# Instead of calling it once per unit vector, :func:`~torch.func.vmap` calls it once with all of
# them stacked: the whole identity matrix goes through a single, batched backward pass.
_, vjp_fn = vjp(partial(layer, weight, bias), x)
(vmapped_vjp,) = vmap(vjp_fn)(torch.eye(size, device=device))
torch.testing.assert_close(vmapped_vjp, reference)

# %%
# Way 3: ``jacrev``
# -----------------
# :func:`~torch.func.jacrev` packages exactly that recipe. ``argnums=2`` picks the argument to
# differentiate, here ``x``.
jacobian_x = jacrev(layer, argnums=2)(weight, bias, x)
torch.testing.assert_close(jacobian_x, reference)
print("row by row, vmap(vjp) and jacrev all match the formula")

# %%
# ``argnums`` also takes a tuple. With respect to the weight the Jacobian has shape
# ``(outputs, *weight.shape)``, and with respect to the bias ``(outputs, *bias.shape)``.
jacobian_weight, jacobian_bias = jacrev(layer, argnums=(0, 1))(weight, bias, x)
print(
    "d f / d weight:",
    tuple(jacobian_weight.shape),
    "  d f / d bias:",
    tuple(jacobian_bias.shape),
)
slope = 1 - layer(weight, bias, x) ** 2
identity = torch.eye(size, device=device)
torch.testing.assert_close(
    jacobian_weight, torch.einsum("i,ij,k->ijk", slope, identity, x)
)
torch.testing.assert_close(jacobian_bias, torch.diag(slope))

# %%
# How much the vectorised versions save at this size:
jacobian_times_ms = {
    "row by row": median_ms(lambda: jacobian_row_by_row(weight, bias, x)),
    "vmap(vjp)": median_ms(
        lambda: vmap(vjp(partial(layer, weight, bias), x)[1])(identity)
    ),
    "jacrev": median_ms(lambda: jacrev(layer, argnums=2)(weight, bias, x)),
}
for method, ms in jacobian_times_ms.items():
    print(
        f"{method:10s} {ms:6.3f} ms  ({jacobian_times_ms['row by row'] / ms:.1f}x vs row by row)"
    )

# %%
# Forward or reverse mode?
# ------------------------
# Reverse mode builds the Jacobian from vector-Jacobian products, one per **output**; forward
# mode (:func:`~torch.func.jacfwd`) builds it from Jacobian-vector products, one per **input**.
# Both batch their passes with ``vmap``, but the batch is as large as the number of rows or
# columns. So a *tall* Jacobian (many outputs, few inputs) favours ``jacfwd``, and a *wide* one
# (few outputs, many inputs) favours ``jacrev``. Both agree with the formula:


def random_layer(inputs, outputs):
    return (
        torch.randn(outputs, inputs, device=device) / inputs**0.5,
        torch.randn(outputs, device=device),
        torch.randn(inputs, device=device),
    )


def time_both_modes(inputs, outputs):
    args = random_layer(inputs, outputs)
    return {
        "jacfwd": median_ms(lambda: jacfwd(layer, argnums=2)(*args)),
        "jacrev": median_ms(lambda: jacrev(layer, argnums=2)(*args)),
    }


for inputs, outputs in [(32, 2048), (2048, 32)]:
    args = random_layer(inputs, outputs)
    expected = exact_input_jacobian(*args)
    torch.testing.assert_close(jacfwd(layer, argnums=2)(*args), expected)
    torch.testing.assert_close(jacrev(layer, argnums=2)(*args), expected)

tall = time_both_modes(inputs=32, outputs=2048)
wide = time_both_modes(inputs=2048, outputs=32)
print(
    f"tall (32 in, 2048 out): jacfwd {tall['jacfwd']:.2f} ms, jacrev {tall['jacrev']:.2f} ms "
    f"-> jacfwd is {tall['jacrev'] / tall['jacfwd']:.1f}x faster"
)
print(
    f"wide (2048 in, 32 out): jacfwd {wide['jacfwd']:.2f} ms, jacrev {wide['jacrev']:.2f} ms "
    f"-> jacrev is {wide['jacfwd'] / wide['jacrev']:.1f}x faster"
)

# %%
# Where is the crossover?
# -----------------------
# Published tutorials stop at those two shapes. Here we sweep the shape instead: the Jacobian
# keeps 2¹⁶ entries while its aspect ratio (outputs / inputs) runs from 1/64 to 64,
# and we plot how much slower ``jacfwd`` is than ``jacrev``. Where the curve crosses 1 the two
# engines tie. In theory that is a square Jacobian; in practice each engine has its own
# per-pass cost, and the crossover lands wherever this hardware puts it.
input_sizes = [2048, 1024, 512, 256, 128, 64, 32]
aspect_ratios, fwd_over_rev = [], []
for inputs in input_sizes:
    outputs = 2**16 // inputs
    times = time_both_modes(inputs, outputs)
    aspect_ratios.append(outputs / inputs)
    fwd_over_rev.append(times["jacfwd"] / times["jacrev"])
    print(
        f"{inputs:5d} in, {outputs:5d} out: jacfwd / jacrev time = {fwd_over_rev[-1]:.2f}"
    )

# %%
# The crossover, by log-linear interpolation between the two sweep points around it:
crossing = next(
    (
        i
        for i in range(len(fwd_over_rev) - 1)
        if (fwd_over_rev[i] - 1) * (fwd_over_rev[i + 1] - 1) <= 0
    ),
    None,
)
if crossing is None:
    crossover = None
    print("no crossover inside the sweep: one engine wins at every shape here")
else:
    lo, hi = torch.tensor(fwd_over_rev[crossing : crossing + 2]).log()
    fraction = (0 - lo) / (hi - lo)
    crossover = (
        aspect_ratios[crossing]
        * (aspect_ratios[crossing + 1] / aspect_ratios[crossing]) ** fraction.item()
    )
    print(f"jacfwd and jacrev tie at about {crossover:.2g} outputs per input")

fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
ax.loglog(aspect_ratios, fwd_over_rev, "o-", color="#1b9e77", base=2)
ax.axhline(1, color="#888888", linestyle="--")
if crossover is not None:
    ax.axvline(
        crossover, color="#d95f02", linestyle=":", label=f"crossover ≈ {crossover:.2g}"
    )
    ax.legend(loc="upper left")
ax.set_xlabel("Jacobian aspect ratio: outputs / inputs (2**16 entries)")
ax.set_ylabel("time(jacfwd) / time(jacrev)")
ax.set_title(
    f"jacfwd vs jacrev time by Jacobian shape ({device.type.upper()}): above 1, jacrev wins"
)
ax.text(aspect_ratios[0], 1.05, "jacrev faster ↑", color="#555555", va="bottom")
ax.text(aspect_ratios[0], 0.95, "jacfwd faster ↓", color="#555555", va="top")
plt.show()

# %%
# Hessians: compositions of the two
# ---------------------------------
# A Hessian is the Jacobian of a Jacobian, so any pair of engines computes it.
# :func:`~torch.func.hessian` is ``jacfwd(jacrev(f))``: reverse mode inside, where the function
# maps many inputs to few outputs, and forward mode outside, where the inner Jacobian is tall.
# We compare it with the other orders for a layer with 512 inputs and 32 outputs, whose Hessian
# has shape (32, 512, 512). The exact Hessian is
# ``∂²f_i/∂x_k∂x_l = −2 f_i (1 − f_i²) W_ik W_il``,
# evaluated in float64 as the reference.
hess_weight, hess_bias, hess_x = random_layer(inputs=512, outputs=32)
y64 = layer(hess_weight.double(), hess_bias.double(), hess_x.double())
hessian_reference = torch.einsum(
    "i,ik,il->ikl", -2 * y64 * (1 - y64**2), hess_weight.double(), hess_weight.double()
)

hessian_methods = {
    "hessian = jacfwd(jacrev)": hessian(layer, argnums=2),
    "jacfwd(jacfwd)": jacfwd(jacfwd(layer, argnums=2), argnums=2),
    "jacrev(jacrev)": jacrev(jacrev(layer, argnums=2), argnums=2),
    "jacrev(jacfwd)": jacrev(jacfwd(layer, argnums=2), argnums=2),
}

# %%
# Every composition must match the exact Hessian. We measure the relative error of the float32
# result against the float64 formula; float32 rounding puts it near 1e-7, and the 1e-5 bound
# leaves room for accumulation over 512 inputs while still catching a wrong result.
hessian_times_ms = {}
for method, hessian_fn in hessian_methods.items():
    result = hessian_fn(hess_weight, hess_bias, hess_x)
    error = (
        (result.double() - hessian_reference).norm() / hessian_reference.norm()
    ).item()
    assert result.shape == (32, 512, 512) and error < 1e-5, (method, error)
    hessian_times_ms[method] = median_ms(
        partial(hessian_fn, hess_weight, hess_bias, hess_x)
    )
    print(
        f"{method:25s} relative error {error:.1e}   {hessian_times_ms[method]:7.2f} ms"
    )

fastest = min(hessian_times_ms, key=hessian_times_ms.get)
for method, ms in hessian_times_ms.items():
    print(f"{method:25s} {ms / hessian_times_ms[fastest]:.2f}x the time of {fastest}")

# %%
fig, ax = plt.subplots(figsize=(7, 2.8), layout="constrained")
bars = ax.barh(list(hessian_times_ms), list(hessian_times_ms.values()), color="#7570b3")
ax.bar_label(
    bars, labels=[f"{ms:.1f} ms" for ms in hessian_times_ms.values()], padding=4
)
ax.invert_yaxis()
ax.set_xlim(0, max(hessian_times_ms.values()) * 1.3)
ax.set_xlabel("median time (ms)")
ax.set_title("Hessian of a 512 → 32 layer, (32, 512, 512) entries")
plt.show()

# %%
# What to remember
# ----------------
# * ``jacrev`` costs about one backward pass per output, ``jacfwd`` one forward pass per input;
#   both run those passes as one vectorised batch.
# * Choose by shape: tall Jacobians favour ``jacfwd``, wide ones ``jacrev``. The sweep above
#   shows where the boundary lies on this page's hardware.
# * ``hessian`` is ``jacfwd(jacrev(...))``, the usual best choice for a scalar or
#   few-output function of many inputs.
