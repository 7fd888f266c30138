"""
Private training with DP-SGD on scikit-learn's digits
=====================================================

DP-SGD trains a model whose weights reveal little about any one training example: each step
clips each example's gradient, adds Gaussian noise and averages; an accountant turns that into
a privacy budget ``(ε, δ)``. Here: the step with ``vmap(grad(...))``, checked against Opacus;
training on digits against plain SGD and clipping alone; ε, and its bound recomputed.
"""

# %%
# Setup
# -----
import copy
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.func import functional_call, grad, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")

# %%
# The recipe: one DP-SGD step
# ---------------------------
# Per-sample gradients from ``vmap(grad(...))``, each scaled by ``min(1, C / ‖gᵢ‖)``, summed,
# plus noise of standard deviation ``σ·C``, over the *expected* batch size (Abadi et al., 2016):
# the size of a random batch depends on who is in it, so dividing by it would reveal them.
CLIP_NORM, SIGMA, LEARNING_RATE, EXPECTED_BATCH = 1.0, 1.0, 0.5, 64


def dp_sgd_step(net, x, y, generator, sigma=SIGMA, clip_norm=CLIP_NORM):
    params = {name: p.detach() for name, p in net.named_parameters()}

    def one_example_loss(params, x, y):
        return F.cross_entropy(functional_call(net, params, (x[None],)), y[None])

    grads = vmap(grad(one_example_loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    factors = (clip_norm / norms).clamp(max=1.0)
    drawn = []  # the noise actually added, for the log
    with torch.no_grad():
        for p, g in zip(net.parameters(), grads.values()):
            clipped_sum = torch.einsum("b,b...->...", factors, g)
            noise = torch.normal(0.0, sigma * clip_norm, p.shape,
                                 generator=generator, device=device)  # fmt: skip
            p -= LEARNING_RATE * (clipped_sum + noise) / EXPECTED_BATCH
            drawn.append(noise.flatten())
    return norms, torch.cat(drawn).std().item() / clip_norm  # σ as applied


# %%
# The check: Opacus' ``DPOptimizer`` on a batch of 37, not the expected 64, noise from the same
# generator state, and a clipping norm that clips some of the samples: each update must agree.
def make_mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10)).to(device)  # fmt: skip


net = make_mlp()
x, y = torch.rand(37, 64).to(device), torch.arange(37, device=device) % 10
opacus_net = GradSampleModule(copy.deepcopy(net))  # per-sample gradients by hooks
warnings.filterwarnings("ignore", "Full backward hook is firing")  # expected with hooks
noise = torch.Generator(device=device).manual_seed(1)
optimizer = DPOptimizer(torch.optim.SGD(opacus_net.parameters(), lr=LEARNING_RATE),
                        noise_multiplier=SIGMA, max_grad_norm=1.9, generator=noise,
                        expected_batch_size=EXPECTED_BATCH)  # fmt: skip
start = {name: p.detach().clone() for name, p in net.named_parameters()}
F.cross_entropy(opacus_net(x), y).backward()
optimizer.step()
norms, _ = dp_sgd_step(net, x, y, noise.manual_seed(1), clip_norm=1.9)  # same noise
assert (norms > 1.9).any() and (norms < 1.9).any()
for (name, ours), theirs in zip(net.named_parameters(), opacus_net.parameters()):
    error = ((ours - theirs).norm() / (theirs - start[name]).norm()).item()
    print(f"{name}: dp_sgd_step's update vs Opacus' step, relative error {error:.1e}")
    assert error < 1e-5, name

# %%
# The data: scikit-learn's digits
# -------------------------------
# 1,797 images of handwritten digits, 8×8 pixels, ten classes, shipped inside scikit-learn; a
# fifth is held out for testing. The pixels are scaled by their known range (0 to 16), not by
# a mean and standard deviation of the training images: those would be a release from the
# private data that the privacy budget below does not cover. Each step's batch is a Poisson
# sample: every training image is in it with probability ``q``, the expected batch over N.
from sklearn.datasets import load_digits

digits = load_digits()
features = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16
labels = torch.tensor(digits.target, device=device)
is_test = torch.randperm(len(labels)).to(device) < len(labels) // 5
x_train, y_train = features[~is_test], labels[~is_test]
x_test, y_test = features[is_test], labels[is_test]
SAMPLE_RATE = EXPECTED_BATCH / len(x_train)


def poisson_batch(generator):
    chosen = torch.rand(len(x_train), generator=generator, device=device) < SAMPLE_RATE
    return x_train[chosen], y_train[chosen]


print(f"{len(x_train)} training and {len(x_test)} test images, q = {SAMPLE_RATE:.4f}")

# %%
# Training: plain SGD, clipping only, DP-SGD
# ------------------------------------------
# Three runs from the same initial weights, each with the same Poisson batches, learning rate
# and number of steps: plain SGD (the batch's mean gradient), clipping without noise
# (``σ = 0``), and DP-SGD. The middle run separates what clipping does from what the noise
# adds; this is one seed, and the gap between the two private runs is not read from it (it
# takes several seeds). The noise comes from a seeded generator so that the page is
# reproducible; real DP training needs noise nobody can predict (Opacus:
# ``PrivacyEngine(secure_mode=True)``). Each run logs every step it takes: the σ of the noise
# the step drew (its standard deviation over C) and the batch's size, for the accounting below.
EPOCHS = 15
STEPS_PER_EPOCH = len(x_train) // EXPECTED_BATCH


def plain_sgd_step(net, x, y, generator, sigma):  # generator and sigma: unused
    grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    with torch.no_grad():
        for p, g in zip(net.parameters(), grads):
            p -= LEARNING_RATE * g
    return None, 0.0  # no noise


def train(step, sigma):
    """Test accuracy after each epoch of a fresh model trained with step; the steps' log."""
    torch.manual_seed(0)
    net = make_mlp()
    batches = torch.Generator(device=device).manual_seed(0)  # the same in every run
    noise = torch.Generator(device=device).manual_seed(1)
    accuracies, log = [], []
    for _ in range(EPOCHS):
        for _ in range(STEPS_PER_EPOCH):
            batch_x, batch_y = poisson_batch(batches)
            _, applied = step(net, batch_x, batch_y, noise, sigma=sigma)
            log.append((applied, len(batch_x)))
        with torch.no_grad():
            accuracies.append((net(x_test).argmax(1) == y_test).float().mean().item())
    return accuracies, log


steps = {  # each run's step and its σ
    "plain SGD": (plain_sgd_step, None),
    "clipping only": (dp_sgd_step, 0.0),
    "DP-SGD": (dp_sgd_step, SIGMA),
}
runs, logs = {}, {}
for name, (step, sigma) in steps.items():
    runs[name], logs[name] = train(step, sigma)
for name, accuracies in runs.items():
    print(f"{name:13s} test accuracy after {EPOCHS} epochs: {accuracies[-1]:.3f}")

# %%
# In this run, DP-SGD stays far above chance (0.1), and at the same learning rate clipping costs
# accuracy against plain SGD: it shrinks each update (DP-SGD usually retunes the rate).
assert runs["DP-SGD"][-1] > 0.8
assert runs["clipping only"][-1] < runs["plain SGD"][-1]

# %%
# The privacy budget
# ------------------
# Opacus' RDP accountant bounds the Rényi divergence of the subsampled Gaussian mechanism at
# a list of orders ``α``, adds it up over the steps, and converts the sum to ``(ε, δ)``. For
# an integer order the bound has a closed form (Mironov et al., 2019):
# ``log Σₖ C(α, k) (1 − q)^(α−k) qᵏ exp((k² − k) / (2σ²)) / (α − 1)`` per step, turned into
# ε by Balle et al.'s (2020) conversion, as Opacus does. We evaluate it over the integer
# orders 2 to 63 and compare with the accountant restricted to the same orders. This is the
# same bound written out again from the same q, σ and number of steps, so agreement checks
# only how the accountant was called and converts, not the bound itself, nor its inputs. The
# inputs are checked against the DP-SGD run's log: the accountant's history must hold the run's
# number of steps and σ, the noise each step drew must have that σ (and none without σ), and
# the batches' sizes must fit
# Poisson sampling at rate q (mean within 5 standard errors of N·q, variance within 40% of
# N·q·(1 − q); its standard error is printed). δ is chosen below one over N.
import math

from opacus.accountants import RDPAccountant

DELTA = 1e-5
num_steps = EPOCHS * STEPS_PER_EPOCH
accountant = RDPAccountant()
for _ in range(num_steps):
    accountant.step(noise_multiplier=SIGMA, sample_rate=SAMPLE_RATE)
dp_sigmas, dp_sizes = zip(*logs["DP-SGD"])  # each step's noise, measured
assert accountant.history == [(SIGMA, SAMPLE_RATE, len(dp_sigmas))], accountant.history
off = max(abs(applied / SIGMA - 1) for applied in dp_sigmas)
print(f"noise drawn in each DP-SGD step: σ within {off:.1%} of the accountant's")
assert off < 0.03, "a step drew noise of another σ than the accountant counts"
assert all(applied == 0.0 for applied, _ in logs["clipping only"]), "noise without σ"
sizes = torch.tensor(dp_sizes, dtype=torch.float64)
n_q, n_q_p = len(x_train) * SAMPLE_RATE, len(x_train) * SAMPLE_RATE * (1 - SAMPLE_RATE)
z_mean = (sizes.mean().item() - n_q) / math.sqrt(n_q_p / len(sizes))
var_ratio = sizes.var().item() / n_q_p
print(
    f"DP-SGD run: {len(sizes)} steps at σ = {SIGMA}; batch sizes' mean "
    f"{sizes.mean():.2f} vs N·q = {n_q:.0f} ({z_mean:+.1f} standard errors), variance "
    f"{var_ratio:.2f}x N·q·(1 − q) (standard error {math.sqrt(2 / (len(sizes) - 1)):.2f})"
)
assert abs(z_mean) < 5, "the batches do not fit the sample rate q"
assert abs(var_ratio - 1) < 0.4, "the batch sizes do not vary as Poisson sampling's do"


def closed_form_epsilon(q, sigma, steps, delta, orders):
    best = math.inf
    for alpha in orders:
        log_terms = torch.tensor([
            math.log(math.comb(alpha, k)) + (alpha - k) * math.log1p(-q)
            + k * math.log(q) + (k * k - k) / (2 * sigma**2)
            for k in range(alpha + 1)
        ], dtype=torch.float64)  # fmt: skip
        rdp = steps * torch.logsumexp(log_terms, 0).item() / (alpha - 1)
        epsilon = rdp - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, epsilon + math.log((alpha - 1) / alpha))
    return best


integer_orders = list(range(2, 64))
ours = closed_form_epsilon(SAMPLE_RATE, SIGMA, num_steps, DELTA, integer_orders)
theirs = accountant.get_epsilon(delta=DELTA, alphas=integer_orders)
epsilon = accountant.get_epsilon(delta=DELTA)  # Opacus' default orders, fractional too
print(
    f"{num_steps} steps, q = {SAMPLE_RATE:.4f}, σ = {SIGMA}, C = {CLIP_NORM}: "
    f"ε = {epsilon:.3f} at δ = {DELTA:g} (1/N = {1 / len(x_train):.1e}); integer orders "
    f"only: accountant {theirs:.4f}, closed form {ours:.4f} "
    f"(relative difference {abs(ours / theirs - 1):.1e})"
)
assert abs(ours / theirs - 1) < 1e-13

# %%
# ε also depends on the accountant. Opacus' ``PrivacyEngine`` uses the PRV accountant by
# default; here it gives the same training a smaller ε. ``make_private`` wraps a model, an
# optimizer and a data loader (with Poisson sampling) into the pieces built by hand above,
# and ``make_private_with_epsilon`` picks σ for a target ε.
from opacus.accountants import PRVAccountant

prv = PRVAccountant()
for _ in range(num_steps):
    prv.step(noise_multiplier=SIGMA, sample_rate=SAMPLE_RATE)
prv_epsilon = prv.get_epsilon(delta=DELTA)
print(f"the same steps, PRV accountant: ε = {prv_epsilon:.3f} (RDP: {epsilon:.3f})")
assert prv_epsilon < epsilon

# %%
# ε covers what the training steps reveal about the training images: the model's weights
# at every step. It does not cover choices made by looking at the private data, such as
# picking the learning rate or the number of epochs by their test accuracy.

# %%
# What privacy costs in time
# --------------------------
# One step of each run on the same Poisson batch, on a throwaway model, timed with
# ``torch.utils.benchmark`` on all threads: the median over at least five blocks, with the
# IQR and the number of blocks (the timer's block-size estimate runs the step first, as a
# warm-up). A DP-SGD step computes per-sample gradients, their norms and a clipped, noised
# sum; which of these costs most is not measured here. The sibling page,
# :ref:`sphx_glr_auto_examples_per_sample_gradients_plot_dp_sgd_ghost_norms.py`, clips
# without forming per-sample gradients and times that against ``vmap``.
from torch.utils import benchmark

timing_batch = poisson_batch(torch.Generator(device=device).manual_seed(2))
all_threads = torch.get_num_threads()
step_times = {}
for name, (step, sigma) in steps.items():
    step_globals = {"step": step, "net": make_mlp(), "x": timing_batch[0], "sigma": sigma,
                    "y": timing_batch[1], "noise": torch.Generator(device=device)}  # fmt: skip
    step_timer = benchmark.Timer(
        "step(net, x, y, noise, sigma)", globals=step_globals, num_threads=all_threads
    )
    timed = step_timer.blocked_autorange(min_run_time=0.5)
    while len(timed.times) < 5:  # a busy machine fills few blocks: add blocks of ~50 ms
        block = step_timer.timeit(max(1, round(0.05 / timed.median)))
        timed = benchmark.Measurement.merge([timed, block])[0]
    step_times[name] = timed
    print(
        f"{name:13s} one step on {len(timing_batch[0])} images: {timed.median * 1e3:.2f} "
        f"ms (IQR {timed.iqr * 1e3:.3g} ms over {len(timed.times)} blocks), "
        f"{timed.median / step_times['plain SGD'].median:.2f}x plain SGD's time"
    )

# %%
# The figure shows each run's test accuracy after every epoch (one seed), and its step time.
# Plain SGD takes the batched gradient; both private runs take per-sample gradients with vmap.
METHOD_COLORS = {"batched": "#666666", "vmap": "#009E73"}
styles = {
    "plain SGD": dict(color=METHOD_COLORS["batched"], marker="o"),
    "clipping only": dict(color=METHOD_COLORS["vmap"], marker="s", linestyle="--"),
    "DP-SGD": dict(color=METHOD_COLORS["vmap"], marker="o"),
}
fig, (ax_acc, ax_time) = plt.subplots(
    1, 2, figsize=(9, 3.6), layout="constrained", width_ratios=[2, 1]
)
for name, accuracies in runs.items():
    label = name + (f" (ε = {epsilon:.1f}, δ = {DELTA:g})" if name == "DP-SGD" else "")
    ax_acc.plot(range(1, EPOCHS + 1), accuracies, label=label, **styles[name])
ax_acc.axhline(0.1, color="black", linestyle=":", linewidth=1, label="chance")
ax_acc.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
ax_acc.legend(loc="lower right")
ax_time.barh(
    list(step_times),
    [t.median * 1e3 for t in step_times.values()],
    xerr=[t.iqr * 1e3 / 2 for t in step_times.values()],  # a line as long as the IQR
    color=[styles[name]["color"] for name in step_times],
)
ax_time.set(xlabel="time per step (ms), median and IQR")
ax_time.invert_yaxis()
fig.suptitle("Digits: plain SGD, clipping only, and DP-SGD")
plt.show()

# %%
# What to remember
# ----------------
# * A DP-SGD step: per-sample gradients with ``vmap(grad(...))``, each scaled by
#   ``min(1, C / ‖gᵢ‖)``, summed, plus ``N(0, σ²C²)`` noise, divided by the *expected* batch.
# * Check the training loop's own step against Opacus' ``DPOptimizer`` on a batch whose size
#   differs from the expected one, comparing each parameter's update.
# * A ``σ = 0`` run separates clipping from noise; at one learning rate clipping cost accuracy,
#   as it shrinks the updates. Judge what the noise adds over several seeds, not from one run.
# * ε covers only what touches the private data inside the accounted steps: normalise with
#   public constants. Check the accountant's history against the steps the training logged.
