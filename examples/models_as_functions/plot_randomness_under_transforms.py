"""
Randomness under the transforms: dropout, sampling and the ``randomness`` flag
==============================================================================

Under :func:`~torch.func.vmap` one call of a function stands for a whole batch, so a random
operation inside it (dropout, added noise, sampling) raises a question: does each sample get
its own draw, or do they share one? This page gives each sample its own dropout mask, checked
against the same masks applied by hand; runs the three ``randomness`` settings; finds which
transforms take the flag and what it means for a Jacobian; computes the Hessian of a model
with dropout in the two honest ways; makes draws reproducible (per-sample gradients that match
a loop); and samples one value per row, checked against the probabilities.
"""

# %%
# Setup
# -----
import copy
import inspect
import itertools

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, hessian, jacfwd, jacrev, jvp, linearize, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"vmap": "#009E73", "batched": "#666666"}

# %%
# The recipe: ``randomness="different"`` draws a mask per sample
# --------------------------------------------------------------
# A layer with dropout on its input, written for one sample. It also returns the mask it used
# (the entries dropout kept, nonzero after it), so that the result can be checked.
# ``vmap(..., randomness="different")`` runs it on 512 samples at once, each with its own mask
# (as for the members of an ensemble with dropout:
# :ref:`sphx_glr_auto_examples_models_as_functions_plot_model_ensembling.py`).
drop = 0.3  # the probability that dropout zeroes an entry
n_in, n_out = 64, 16
weight = torch.randn(n_out, n_in, device=device) / n_in**0.5
inputs = torch.randn(512, n_in, device=device)


def noisy_layer(x):
    dropped = F.dropout(x, drop)  # training=True is F.dropout's default
    return torch.tanh(weight @ dropped), dropped != 0


out, kept = vmap(noisy_layer, randomness="different")(inputs)

# %%
# Three checks. Every sample's mask is its own (no two of the 512 rows agree); the fraction
# dropped is ``drop`` within five binomial standard errors; and each output equals the layer
# computed by hand, in a Python loop, with that sample's mask and dropout's 1/(1 − p) scaling.
distinct = len(torch.unique(kept.float(), dim=0))
print(f"{distinct} distinct masks for {len(inputs)} samples")
assert distinct == len(inputs)
rate = 1 - kept.float().mean().item()
std_error = (drop * (1 - drop) / kept.numel()) ** 0.5
print(f"dropped {rate:.4f} of entries against p = {drop}: {abs(rate - drop) / std_error:.1f}"
      " standard errors off (bound 5)")  # fmt: skip
assert abs(rate - drop) < 5 * std_error
by_hand = torch.stack(
    [torch.tanh(weight @ (x * m / (1 - drop))) for x, m in zip(inputs, kept)]
)
error = (out - by_hand).abs().max().item()
print(f"vmap against the masks applied by hand: max error {error:.1e} (bound 2e-6)")
assert error < 2e-6


# %%
# The three settings
# ------------------
# ``randomness="error"``, the default, refuses any random operation, so that nobody gets one
# behaviour by accident. ``"same"`` draws once and broadcasts the draw over the batch. The
# pitfalls page shows both briefly
# (:ref:`sphx_glr_auto_examples_guides_plot_pitfalls.py`); here are the exact messages.
def raises_runtime_error(thunk, fragment):
    """Run thunk; it must raise RuntimeError whose first line holds fragment."""
    try:
        thunk()
    except RuntimeError as err:
        first_line = str(err).splitlines()[0]
        assert fragment in first_line, first_line
        print(f"RuntimeError: {first_line}")
        return
    raise AssertionError(f"no RuntimeError ({fragment!r})")


raises_runtime_error(lambda: vmap(noisy_layer)(inputs), "randomness error mode")
out_same, kept_same = vmap(noisy_layer, randomness="same")(inputs)
assert (kept_same == kept_same[0]).all(), "'same' gave the samples different masks"
shared = torch.tanh((inputs * kept_same[0] / (1 - drop)) @ weight.T)
torch.testing.assert_close(out_same, shared)
print("randomness='same': one mask, shared by all", len(inputs), "samples")

# %%
# ``"same"`` has a limit dropout does not show: a random operation whose *parameters* are
# batched (a probability per sample for :func:`torch.bernoulli` or :func:`torch.multinomial`,
# a mean per sample for :func:`torch.normal`) raises: not implemented in this release.
# :func:`torch.randn_like` and :func:`torch.rand` read only a shape, and share one draw.
probs = torch.rand(8, 5, device=device)
for name, op in [
    ("bernoulli", torch.bernoulli),
    ("multinomial", lambda q: torch.multinomial(q, 1)),
    ("normal", lambda q: torch.normal(q, 1.0)),
]:
    print(f"{name}, 'same':", end=" ")
    same_draw = vmap(op, randomness="same")
    raises_runtime_error(lambda: same_draw(probs), "same randomness")  # noqa: B023
uniform = lambda q: torch.rand(5, device=device)  # noqa: E731
for name, op in [("randn_like", torch.randn_like), ("rand", uniform)]:
    drawn = vmap(op, randomness="same")(probs)
    assert (drawn == drawn[0]).all(), name
    print(f"{name}, 'same': runs, one draw for all {len(drawn)} rows")

# %%
# Which transforms take ``randomness=``
# -------------------------------------
# :func:`~torch.func.jacfwd` pushes every basis direction through the function at once, with
# ``vmap``, so it calls the random operation under ``vmap`` and takes the flag too.
# :func:`~torch.func.jacrev` runs the function once and maps only the backward pass, which
# draws nothing; :func:`~torch.func.hessian` is ``jacfwd(jacrev(f))`` without the flag.
ops = (vmap, jacfwd, jacrev, hessian, grad, jvp)
takes = {t.__name__: "randomness" in inspect.signature(t).parameters for t in ops}
print("takes randomness=:", takes)
assert [name for name, flag in takes.items() if flag] == ["vmap", "jacfwd"]

# %%
# A float64 layer with dropout, 12 inputs to 12 outputs, and its Jacobian in the input:
# ``jacrev`` runs with no flag; ``jacfwd`` and ``hessian`` raise the error above.
n = 12
mix = torch.randn(n, n, device=device, dtype=torch.float64)
point = torch.randn(n, device=device, dtype=torch.float64)


def small_layer(u):
    dropped = F.dropout(u, drop)
    return torch.tanh(mix @ dropped), dropped != 0


jac_rev, mask_rev = jacrev(small_layer, has_aux=True)(point)
summed = lambda u: small_layer(u)[0].sum()  # noqa: E731
for transform in (jacfwd, hessian):
    raises_runtime_error(lambda: transform(summed)(point), "randomness error mode")  # noqa: B023

# %%
# :func:`~torch.func.linearize` takes no flag and raises nothing, but is silently wrong here: its
# tangent function draws a new mask at each call, unrelated to the mask of the output it returns.
ones = torch.ones(64, device=device, dtype=torch.float64)
masked, tangent_fn = linearize(lambda u: F.dropout(u, 0.5), ones)
first, second = tangent_fn(ones), tangent_fn(ones)
print(
    f"linearize: {(first != 0).ne(masked != 0).sum()} of 64 entries off the output's mask"
)
assert (first != 0).ne(masked != 0).any() and (first != 0).ne(second != 0).any()


# %%
# The reference is by hand: the Jacobian of ``tanh(W (u ⊙ m) / (1 − p))`` for a fixed mask
# ``m`` is ``diag(1 − y²) W diag(m) / (1 − p)``, written for many masks at once: here all
# 2¹² = 4096 of them. A Jacobian "of one draw" must equal one of these.
def jacobians_by_hand(masks):
    scaled = masks / (1 - drop)
    y = torch.tanh((point * scaled) @ mix.T)
    return (1 - y**2)[:, :, None] * mix * scaled[:, None, :]


every_mask = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), device=device)
every_jacobian = jacobians_by_hand(every_mask.double())


def nearest_draw(jac):
    """Index of the mask whose Jacobian is nearest to jac, and the relative distance."""
    gaps = (every_jacobian - jac).flatten(1).norm(dim=1) / jac.norm()
    return gaps.argmin().item(), gaps.min().item()


# %%
# With ``"same"``, every basis direction sees one mask: the result is the Jacobian of one draw
# of the function, the mask the function reports. With ``"different"``, each direction draws
# its own mask, and column *j* is the derivative along *j* of draw *j*. ``jacfwd`` returns the
# first direction's auxiliary output only, so the per-column masks come from the same
# computation spelled out: ``vmap`` of :func:`~torch.func.jvp` over the basis vectors.
jac_same, mask_same = jacfwd(small_layer, has_aux=True, randomness="same")(point)


def along(direction):
    _, derivative, mask = jvp(small_layer, (point,), (direction,), has_aux=True)
    return derivative, mask


basis = torch.eye(n, device=device, dtype=torch.float64)
torch.manual_seed(1)
columns, column_masks = vmap(along, randomness="different")(basis)
jac_mixed = columns.T
torch.manual_seed(1)
jac_different, aux = jacfwd(small_layer, has_aux=True, randomness="different")(point)
torch.testing.assert_close(jac_different, jac_mixed)
assert torch.equal(aux, column_masks[0]), "jacfwd's aux is not the first direction's"

# %%
# The checks: ``jacrev`` and ``"same"`` each equal the Jacobian of the mask they report
# (and of no other of the 4096), while no mask at all gives the ``"different"`` result,
# though each of its columns is right for its own draw.
for name, jac, mask in [("jacrev", jac_rev, mask_rev), ("'same'", jac_same, mask_same)]:
    index, gap = nearest_draw(jac)
    print(f"{name}: nearest of 4096 draws at relative distance {gap:.1e} (bound 1e-14)")
    assert gap < 1e-14 and torch.equal(every_mask[index].bool(), mask)
own = jacobians_by_hand(column_masks.double())[torch.arange(n), :, torch.arange(n)]
column_error = (own.T - jac_mixed).abs().max().item()
print(f"'different': column j against draw j's Jacobian, max error {column_error:.1e}"
      " (bound 1e-14)")  # fmt: skip
assert column_error < 1e-14
column_draws = len(torch.unique(column_masks.float(), dim=0))
print(f"'different': {column_draws} masks for {n} columns")
_, gap = nearest_draw(jac_different)
print(f"'different': nearest of 4096 draws at distance {gap:.2f} (bound > 0.05)")
assert gap > 0.05

# %%
# (pytorch#92283.) On CUDA only, as its fix (pytorch#92975) says, ``jacfwd(jacrev(f),
# randomness="different")`` once lost the batch dimension after dropout on an input not
# differentiated. The reported case, ``x + dropout(y).mean(1)``, here: a zero Hessian in x.
x3, y3 = torch.randn(3, device=device), torch.randn(1, 3, device=device)
plus_noise = lambda x, y: x + F.dropout(y, 0.3).mean(1)  # noqa: E731
for setting in ("same", "different"):
    hess = jacfwd(jacrev(plus_noise), randomness=setting)(x3, y3)
    assert hess.shape == (3, 3, 3) and (hess == 0).all(), setting
print("pytorch#92283's case: a (3, 3, 3) Hessian of zeros under both settings")

# %%
# Hessians of a model with dropout
# --------------------------------
# A Hessian of a *random* function is not defined; two honest things are. ``model.eval()``
# turns dropout off: the deterministic function. Or fix the mask: pass it in explicitly, or
# let ``randomness="same"`` draw one for every direction (with a seed to repeat it). The
# references are float64 ``torch.autograd.functional.hessian``, on a float64 copy.
hidden = 16
net = nn.Sequential(
    nn.Linear(4, hidden), nn.Tanh(), nn.Dropout(drop), nn.Linear(hidden, 1)
).to(device)  # fmt: skip
net64 = copy.deepcopy(net).double()
x0 = torch.randn(4, device=device)


def relative_gap(result, reference):
    return ((result.double() - reference).norm() / reference.norm()).item()


def with_mask(layers, x, mask):  # the model with an explicit dropout mask
    return layers[3](layers[:2](x) * mask / (1 - drop)).squeeze()


def scalar_model(x):  # the model as is, and the mask its dropout drew
    dropped = net[2](net[:2](x))
    return net[3](dropped).squeeze(), dropped != 0


raises_runtime_error(lambda: hessian(lambda x: net(x).squeeze())(x0), "randomness")
net.eval(), net64.eval()
in_eval = hessian(lambda x: net(x).squeeze())(x0)
eval_ref = torch.autograd.functional.hessian(lambda x: net64(x).squeeze(), x0.double())
net.train(), net64.train()
mask = torch.rand(hidden, device=device) >= drop  # drawn once, outside
explicit = hessian(with_mask, argnums=1)(net, x0, mask)
same = jacfwd(jacrev(scalar_model, has_aux=True), has_aux=True, randomness="same")
torch.manual_seed(7)
by_same, mask_same = same(x0)
torch.manual_seed(7)
assert torch.equal(same(x0)[0], by_same), "the seed did not repeat the draw"
by_revrev, mask_revrev = jacrev(jacrev(scalar_model, has_aux=True), has_aux=True)(x0)
for name, result, m in [
    ("eval()", in_eval, None),
    ("explicit mask", explicit, mask),
    ("jacfwd(jacrev), 'same'", by_same, mask_same),
    ("jacrev(jacrev), no flag", by_revrev, mask_revrev),
]:
    reference = eval_ref
    if m is not None:
        fixed = lambda x: with_mask(net64, x, m.double())  # noqa: E731, B023
        reference = torch.autograd.functional.hessian(fixed, x0.double())
    gap = relative_gap(result, reference)
    print(f"Hessian, {name}: relative error {gap:.1e} against float64 (bound 1e-6)")
    assert gap < 1e-6, name

# %%
# Reproducibility: seeds, loops and explicit masks
# ------------------------------------------------
# The same seed before two calls gives the same draws: ``vmap`` draws from the global
# generator like any other code.
torch.manual_seed(3)
first = vmap(noisy_layer, randomness="different")(inputs)[1]
torch.manual_seed(3)
assert torch.equal(first, vmap(noisy_layer, randomness="different")(inputs)[1])
print("the same seed, twice: identical masks")

# %%
# Does ``vmap`` draw the numbers a Python loop over the samples would, from the same seed?
# Only by accident of the generator. On CPU this build matched the loop for dropout, uniform
# and Bernoulli draws, and for normal draws on rows of 64 but not of 10 (asserted on CPU
# only); on another device the table below says what it found.
agree = {}
for length, (name, op) in itertools.product(
    (10, 64),
    [
        ("dropout", lambda v: F.dropout(v, drop)),
        ("rand_like", torch.rand_like),
        ("randn_like", torch.randn_like),
        ("bernoulli", lambda v: torch.bernoulli(v.sigmoid())),
    ],
):
    rows = torch.randn(8, length, device=device)
    torch.manual_seed(4)
    batched_draw = vmap(op, randomness="different")(rows)
    torch.manual_seed(4)
    agree[name, length] = torch.equal(batched_draw, torch.stack([op(v) for v in rows]))
    print(f"{name:10s} rows of {length}: {'matches' if agree[name, length] else 'differs from'}"
          " a loop")  # fmt: skip
if device.type != "cuda":  # what this page measured on CPU
    assert agree["dropout", 10] and not agree["randn_like", 10]

# %%
# So when per-sample gradients must match a loop exactly (to test them, or to replay a
# training step), draw the masks yourself, outside, and pass them in with the samples:
# nothing random is left inside the transforms. The reference: one
# :func:`torch.autograd.grad` per sample, with the same mask.
params = {
    "w1": torch.randn(n_in, hidden, device=device) / n_in**0.5,
    "b1": torch.zeros(hidden, device=device),
    "w2": torch.randn(hidden, 1, device=device) / hidden**0.5,
}
targets = torch.randn(len(inputs), 1, device=device)
masks = torch.rand(len(inputs), hidden, device=device) >= drop


def masked_loss(params, x, y, mask):
    h = torch.tanh(x @ params["w1"] + params["b1"]) * mask / (1 - drop)
    return (h @ params["w2"] - y).square().sum()


per_sample_grads = vmap(grad(masked_loss), in_dims=(None, 0, 0, 0))
per_sample = per_sample_grads(params, inputs, targets, masks)
leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
looped = [
    torch.autograd.grad(masked_loss(leaves, x, y, m), list(leaves.values()))
    for x, y, m in zip(inputs, targets, masks)
]
for i, name in enumerate(params):
    reference = torch.stack([g[i] for g in looped])
    gap = relative_gap(per_sample[name], reference.double())
    print(f"per-sample gradient {name} against the loop: {gap:.1e} (bound 1e-6)")
    assert gap < 1e-6, name

# %%
# Sampling one value per row
# --------------------------
# The samplers that refused ``"same"`` run under ``"different"``, with a draw per row. A
# categorical distribution per row (4 rows, 5 categories), 20 000 draws per row with
# :func:`torch.multinomial` under ``vmap``; and the same without ``vmap``: ``multinomial`` on
# the (4, 5) matrix of probabilities already samples each row on its own.
categories, draws = 5, 20_000
table = torch.rand(4, categories, device=device) + 0.2
table /= table.sum(dim=1, keepdim=True)


def frequencies(samples):  # (rows, draws) category indices -> (rows, categories)
    return F.one_hot(samples, categories).double().mean(dim=1)


per_row = lambda q: torch.multinomial(q, draws, replacement=True)  # noqa: E731
sampled = {
    "vmap": frequencies(vmap(per_row, randomness="different")(table)),
    "batched": frequencies(torch.multinomial(table, draws, replacement=True)),
}
truth = table.double()
bar_error = (truth * (1 - truth) / draws).sqrt()  # the standard error of each frequency
for method, freq in sampled.items():
    worst = ((freq - truth).abs() / bar_error).max().item()
    print(f"multinomial, {method}: worst frequency {worst:.1f} SE off (bound 5)")
    assert worst < 5, method

# %%
# :func:`torch.bernoulli` with a rate per row and :func:`torch.normal` with a mean per row:
# each row's rate and mean against its own, and two rows' draws uncorrelated.
rates = torch.tensor([0.05, 0.3, 0.5, 0.9], device=device)
coins = vmap(lambda r: torch.bernoulli(r.expand(draws)), randomness="different")(rates)
coin_error = (rates * (1 - rates) / draws).sqrt()
worst = ((coins.mean(dim=1) - rates).abs() / coin_error).max().item()
print(f"bernoulli per row: worst rate {worst:.1f} standard errors off (bound 5)")
assert worst < 5
means = torch.tensor([-1.0, 0.0, 2.0, 5.0], device=device)
normal_row = lambda mu: torch.normal(mu.expand(draws), 1.0)  # noqa: E731
noise = vmap(normal_row, randomness="different")(means)
worst = ((noise.mean(dim=1) - means).abs() / draws**-0.5).max().item()
print(f"normal per row: worst mean {worst:.1f} standard errors off (bound 5)")
assert worst < 5
corr, corr_bound = torch.corrcoef(noise)[0, 1].item(), 5 * draws**-0.5
print(f"correlation of rows 0 and 1: {corr:.4f} (independent: bound {corr_bound:.4f})")
assert abs(corr) < corr_bound

# %%
# The figure: the first 24 samples' masks under ``"same"`` and ``"different"`` (dark: dropped);
# each sampled frequency's distance from its probability, in standard errors (bound 5: black).
fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), layout="constrained",
                         width_ratios=[1, 1, 1.6])  # fmt: skip
for ax, masks_shown, title in [
    (axes[0], kept_same, "randomness='same'"),
    (axes[1], kept, "randomness='different'"),
]:
    ax.imshow(masks_shown[:24].cpu(), cmap="gray", aspect="auto")
    ax.set(title=title, xlabel="feature", ylabel="sample")
cells = torch.arange(table.numel()).float()
for offset, (method, freq) in zip((-0.2, 0.2), sampled.items()):
    z_scores = ((freq - truth) / bar_error).flatten().cpu()
    axes[2].bar(cells + offset, z_scores, width=0.4, color=METHOD_COLORS[method],
                label=method)  # fmt: skip
for level in (-5, 5):
    axes[2].axhline(level, color="black", linestyle="--", linewidth=1)
axes[2].set(title=f"multinomial, {draws} draws per row", ylim=(-6, 6),
            xlabel="row × category (4 × 5 cells)", ylabel="(frequency − p) / SE")  # fmt: skip
axes[2].legend(fontsize=8, loc="lower right")
plt.show()

# %%
# What to remember
# ----------------
# * Dropout or sampling under ``vmap`` needs ``randomness=``: ``"different"`` for a draw per
#   sample (training), ``"same"`` for one draw shared by the batch; ``"error"`` is the default.
# * ``vmap`` and ``jacfwd`` take the flag; ``jacrev`` needs none; ``hessian`` has none, so use
#   ``jacfwd(jacrev(f), randomness="same")`` or ``jacrev(jacrev(f))``.
# * A Jacobian or Hessian is of one function: ``model.eval()``, an explicit mask, or
#   ``"same"``. Under ``"different"`` each column is of its own draw.
# * A seed repeats ``vmap``'s draws, but not necessarily a loop's: to match a loop, draw the
#   masks outside and pass them in.
# * Samplers with per-row parameters raise under ``"same"``; ``torch.multinomial`` on a (B, K)
#   matrix samples each row without ``vmap``.
