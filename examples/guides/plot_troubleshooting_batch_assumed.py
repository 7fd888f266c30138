"""
Troubleshooting, part 15: code written for a batch, run on one sample under vmap
================================================================================

Inside ``vmap`` a function sees one sample: its tensors have lost the batch dimension, and a
comparison holds one truth value per sample, where Python wants one. Model code written for a
batch breaks on both: ``BatchNorm2d`` asks for a batch dimension and ``Conv1d`` for a length,
``nn.Flatten()`` and ``x.view(x.size(0), -1)`` flatten the wrong dimensions, ``dim=1`` names
another axis, ``x.size(0)`` is no longer the batch size, and Python's ``not``, ``and``,
``bool()``, ``any()`` or ``max()`` ask a tensor for one truth value. The recipe first (a batch of
one inside the function, checked), then each error by its first words, asserted, with its fix.
Part 1: :doc:`plot_troubleshooting`; what ``vmap`` maps: :doc:`../start_here/plot_what_vmap_maps`.
"""

import copy

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
torch.backends.cudnn.allow_tf32 = False  # GPU convolutions in float32, for the checks
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")


def gap_of(got, want):
    """The largest gap over the largest reference entry."""
    assert got.shape == want.shape, f"{got.shape} vs {want.shape}"
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def agrees(label, got, want, bound):
    gap = gap_of(got, want)
    assert gap <= bound, f"{label}: off by {gap:.1e}"  # NaN fails too
    print(f"  {label}: off by {gap:.1e} (bound {bound:.0e})")


# %%
# The recipe: a batch of one inside the function
# ----------------------------------------------
# A classifier written for batches of images ``(N, 1, 8, 8)``, as most are: ``BatchNorm2d``
# (here in eval mode, with running statistics), ``nn.Flatten()``, which keeps dimension 0 for
# the batch, and ``log_softmax`` over ``dim=1``, the classes. Under ``vmap`` the model sees one
# image ``(1, 8, 8)``. Rather than rewrite the model, give it what it was written for: inside
# the function, ``unsqueeze(0)`` turns the sample into a batch of one, and the loss takes a
# batch of one label. The per-sample gradients are checked, parameter by parameter, against a
# loop of ``torch.autograd.grad`` over single images through a float64 copy of the model.


def drawn_statistics(norm):
    """Running statistics and an affine map far from a new layer's, drawn; eval mode."""
    nn.init.normal_(norm.running_mean), nn.init.uniform_(norm.running_var, 0.5, 2.0)
    nn.init.uniform_(norm.weight, 0.5, 1.5), nn.init.normal_(norm.bias)
    return norm.eval()


classifier = nn.Sequential(
    nn.Conv2d(1, 4, 3, padding=1), drawn_statistics(nn.BatchNorm2d(4)), nn.ReLU(),
    nn.Flatten(), nn.Linear(4 * 8 * 8, 10), nn.LogSoftmax(dim=1),
).to(device).eval()  # fmt: skip
images = torch.randn(16, 1, 8, 8, device=device)
labels = torch.randint(0, 10, (16,), device=device)
weights = {name: w.detach() for name, w in classifier.named_parameters()}
buffers = dict(classifier.named_buffers())


def loss_of_one(params, image, label):
    batch_of_one = image.unsqueeze(0)  # (1, 1, 8, 8): what the model was written for
    log_probs = functional_call(classifier, (params, buffers), (batch_of_one,))
    shapes_inside.append((tuple(image.shape), tuple(log_probs.shape)))
    return F.nll_loss(log_probs, label.unsqueeze(0))


shapes_inside = []  # what the function sees under vmap: one image, no batch dimension
per_sample = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(weights, images, labels)
print("inside vmap: image, log-probabilities", *shapes_inside[0])
assert shapes_inside == [((1, 8, 8), (1, 10))]  # a batch of one in, a batch of one out

wide_model = copy.deepcopy(classifier).double()  # reference: one image at a time
for name, p in wide_model.named_parameters():
    loop = []
    for image, label in zip(images.double(), labels):
        loss = F.nll_loss(wide_model(image[None]), label[None])
        loop.append(torch.autograd.grad(loss, p)[0])
    agrees(f"per-sample gradient, {name:8}", per_sample[name], torch.stack(loop), 1e-6)
    summed = F.nll_loss(wide_model(images.double()), labels, reduction="sum")
    agrees("  their sum, against the batch's", per_sample[name].sum(0),
           torch.autograd.grad(summed, p)[0], 1e-5)  # fmt: skip

# %%
# The loss written for a batch, mapped as it is, passes ``Conv2d`` (which also takes an unbatched
# ``(C, H, W)``) and stops at ``BatchNorm2d``, which does not:


def refused(kind, words, call):
    """call() must raise exactly kind with words in its message; prints and returns it."""
    try:
        call()
    except kind as caught:  # any other type stops the page with its own error
        said = " ".join(f"{caught}".split())
        assert type(caught) is kind and words in said, f"{caught!r}"
        print(f"  {kind.__name__}: {said[:96]}")
        return said
    raise AssertionError(f"torch {torch.__version__}: no {kind.__name__}, {words}")


def loss_as_written(params, images, labels):  # under vmap: one image, one label
    return F.nll_loss(functional_call(classifier, (params, buffers), (images,)), labels)


as_written = vmap(grad(loss_as_written), in_dims=(None, 0, 0))
refused(ValueError, "expected 4D input", lambda: as_written(weights, images, labels))
seen = {}  # what vmap did to each piece of code as written, for the table at the end

# %%
# expected 4D input (got 3D input)
# --------------------------------
# A ``ValueError`` from ``BatchNorm2d`` (``BatchNorm1d`` says "expected 2D or 3D input (got 1D
# input)"): the layer checks ``input.dim()``, and under ``vmap`` that is one sample's rank. The
# batch of one above is the fix in eval mode with running statistics. In train mode it raises
# "Batch norm got a batched tensor as input while the running_mean ..." (asserted; under
# ``grad``, "... would mutate a captured Tensor", part 1). Without running statistics
# (``track_running_stats=False``, functorch#867) even eval mode normalises by the batch's
# statistics, and a batch of one by the sample's own: another function (asserted below; for the
# batched network's derivatives, take diagonal blocks as for point clouds below). The pitfalls
# page's `section 6 <plot_pitfalls.html#batchnorm-what-each-remedy-computes>`__ compares remedies.
maps = torch.randn(12, 4, 8, 8, device=device)
image_norm = classifier[1]  # the BatchNorm2d
refused(ValueError, "expected 4D input (got 3D input)", lambda: vmap(image_norm)(maps))
seen["BatchNorm2d on (C, H, W)"] = "raises"  # its fix: the recipe above


def by_formula(layer, x):
    """Eval mode's formula in float64, for x with its channels along dimension 1."""
    per_channel = (-1,) + (1,) * (x.dim() - 2)
    mean, var, scale, shift = (t.double().view(per_channel) for t in (
        layer.running_mean, layer.running_var, layer.weight, layer.bias))  # fmt: skip
    return (x.double() - mean) / (var + layer.eps).sqrt() * scale + shift


def batch_of_one(layer):
    return lambda sample: layer(sample.unsqueeze(0)).squeeze(0)


training = nn.BatchNorm2d(4).to(device)  # train mode, running statistics: the default
refused(RuntimeError, "Batch norm got a batched tensor as input while the running_mean",
        lambda: vmap(batch_of_one(training))(maps))  # fmt: skip
untracked = nn.BatchNorm2d(4, track_running_stats=False).to(device).eval()
offsets = maps + 2 * torch.randn(12, 1, 1, 1, device=device)  # samples of unlike means
off = gap_of(vmap(batch_of_one(untracked))(offsets), untracked(offsets).double())
print(f"  no running statistics, batch of one against the batch: off by {off:.2f}")
assert off > 0.1
features = torch.randn(16, 6, device=device)
feature_norm = drawn_statistics(nn.BatchNorm1d(6).to(device))
refused(ValueError, "expected 2D or 3D input (got 1D input)",
        lambda: vmap(feature_norm)(features))  # fmt: skip
agrees("BatchNorm1d on (C,), batch of one", vmap(batch_of_one(feature_norm))(features),
       by_formula(feature_norm, features), 1e-6)  # fmt: skip
seen["BatchNorm1d on (C,)"] = "raises"

# %%
# ``BatchNorm1d`` takes either ``(N, C)`` or ``(N, C, L)``, so a signal sample ``(C, L)`` passes
# its check and is read as ``N=C`` rows of ``L`` features. With ``C != L`` that stops at
# "running_mean should contain 16 elements not 8"; with ``C == L`` nothing stops it, and the
# entry at position ``l`` of every channel is normalised with channel ``l``'s statistics.
# ``GroupNorm`` reads a ``(C, H, W)`` sample the same way, as ``C`` samples of ``H`` channels:
# only size checks stop it (affine weights, groups dividing ``H``), so without an affine map
# (``F.group_norm``, ``affine=False``) it can run, and is wrong. The batch of one is right here.
signal_norm = drawn_statistics(nn.BatchNorm1d(8).to(device))
long_signals = torch.randn(16, 8, 16, device=device)  # 8 channels of length 16
refused(RuntimeError, "running_mean should contain 16 elements not 8",
        lambda: vmap(signal_norm)(long_signals))  # fmt: skip
agrees("BatchNorm1d on (C, L), C != L, batch of one", vmap(batch_of_one(signal_norm))(
    long_signals), by_formula(signal_norm, long_signals), 1e-6)  # fmt: skip
square_signals = torch.randn(16, 8, 8, device=device)  # 8 channels of length 8
want = by_formula(signal_norm, square_signals)
off = gap_of(vmap(signal_norm)(square_signals), want)
print(f"  BatchNorm1d under vmap, C == L: no error, off by {off:.2f} of the largest")
assert off > 0.1
agrees("BatchNorm1d on (C, L), batch of one", vmap(batch_of_one(signal_norm))(square_signals),
       want, 1e-6)  # fmt: skip
seen.update({"BatchNorm1d on (C, L), C != L": "raises",
             "BatchNorm1d on (C, L), C == L": "wrong"})  # fmt: skip
groups = nn.GroupNorm(2, 4).to(device)
nn.init.uniform_(groups.weight, 0.5, 1.5), nn.init.normal_(groups.bias)
refused(RuntimeError, "Expected weight to be a vector of size equal to the number of channels",
        lambda: vmap(groups)(maps))  # fmt: skip
wide_groups = [t.detach().double() for t in (groups.weight, groups.bias)]
agrees("GroupNorm, batch of one", vmap(batch_of_one(groups))(maps),
       F.group_norm(maps.double(), 2, *wide_groups), 1e-6)  # fmt: skip
off = gap_of(vmap(lambda m: F.group_norm(m, 2))(maps), F.group_norm(maps.double(), 2))
print(f"  F.group_norm (no affine) under vmap: no error, off by {off:.2f}")
assert off > 0.1
seen["GroupNorm on (C, H, W)"], seen["F.group_norm on (C, H, W)"] = "raises", "wrong"

# %%
# mat1 and mat2 shapes cannot be multiplied
# -----------------------------------------
# A ``RuntimeError`` from the ``Linear`` after a flatten. ``nn.Flatten()`` starts at
# ``start_dim=1`` and ``x.view(x.size(0), -1)`` keeps dimension 0, both to spare the batch; on
# one sample ``(4, 8, 8)`` they keep the channels instead, and hand the ``Linear`` a ``(4, 64)``
# matrix. Under ``vmap`` the message counts the batch in: ``12*4 = 48`` rows of 64, against the
# weight's 256 inputs. Flatten from the end (``nn.Flatten(-3)``, ``x.flatten(-3)``), which means
# the same with or without a batch, or use the batch of one.
head = nn.Linear(4 * 8 * 8, 10).to(device)
refused(RuntimeError, "mat1 and mat2 shapes cannot be multiplied (48x64 and 256x10)",
        lambda: vmap(nn.Sequential(nn.Flatten(), head))(maps))  # fmt: skip
refused(RuntimeError, "mat1 and mat2 shapes cannot be multiplied (48x64 and 256x10)",
        lambda: vmap(lambda m: head(m.view(m.size(0), -1)))(maps))  # fmt: skip
wide_head = copy.deepcopy(head).double()
reference = torch.stack([wide_head(m.double().reshape(-1)) for m in maps])  # a loop
from_the_end = nn.Sequential(nn.Flatten(-3), head)  # flattens C, H, W, batch or not
agrees("nn.Flatten(-3) under vmap", vmap(from_the_end)(maps), reference, 3e-6)
agrees("nn.Flatten(-3) on the batch", from_the_end(maps), reference, 3e-6)
agrees("x.flatten(-3)", vmap(lambda m: head(m.flatten(-3)))(maps), reference, 3e-6)
seen["nn.Flatten(), x.view(x.size(0), -1)"] = "raises"

# %%
# Dimension out of range (expected to be in range of [-1, 0], but got 1)
# ----------------------------------------------------------------------
# An ``IndexError`` from ``log_softmax(dim=1)``, ``softmax``, ``argmax`` or a sum over ``dim=1``:
# a classifier's logits are ``(N, classes)`` on a batch and ``(classes,)`` on one sample, which
# has no dimension 1. Count from the end, ``dim=-1``: the classes are the last dimension both
# ways.
logits = torch.randn(16, 10, device=device)
refused(IndexError, "Dimension out of range (expected to be in range of [-1, 0], but got 1)",
        lambda: vmap(nn.LogSoftmax(dim=1))(logits))  # fmt: skip
agrees("log_softmax(dim=-1) under vmap", vmap(lambda z: z.log_softmax(dim=-1))(logits),
       torch.stack([z.double().log_softmax(0) for z in logits]), 1e-6)  # fmt: skip
seen["log_softmax(dim=1) on (classes,)"] = "raises"

# %%
# No error: ``dim=1`` names another axis
# --------------------------------------
# Where one sample still has two or more dimensions, ``dim=1`` exists and nothing is raised. A
# segmentation model's logits are ``(N, classes, H, W)``, normalised over the classes with
# ``dim=1``; on one sample ``(classes, H, W)`` the same call normalises over the rows ``H``, and
# every per-sample gradient built on it is wrong. ``dim=-3`` names the classes both ways.
pixel_logits = torch.randn(16, 3, 8, 8, device=device)
as_written = pixel_logits.log_softmax(dim=1)  # on the batch: over the classes
off = gap_of(vmap(lambda z: z.log_softmax(dim=1))(pixel_logits), as_written.double())
print(f"  log_softmax(dim=1) under vmap: no error, off by {off:.2f} of the largest")
assert off > 0.1
per_pixel = torch.stack([z.double().log_softmax(dim=0) for z in pixel_logits])  # a loop
agrees("log_softmax(dim=-3) under vmap", vmap(lambda z: z.log_softmax(dim=-3))(pixel_logits),
       per_pixel, 1e-6)  # fmt: skip
seen["log_softmax(dim=1) on (C, H, W)"] = "wrong"

# %%
# No error: ``x.size(0)`` is not the batch size
# ---------------------------------------------
# A mean written as ``loss.sum() / x.size(0)`` (or ``len(x)``) divides by the batch size on a
# batch, and on one sample by its first dimension: here the 5 features. Nothing is raised, and
# every per-sample gradient is 1/5 of the sample's own. A per-sample loss is one sample's: divide
# by nothing (a mean's reduction and per-sample gradients: pitfalls, section 8).
inputs, targets, coef = (torch.randn(*n, device=device) for n in ((16, 5), (16,), (5,)))


def mean_as_written(w, x, t):
    return ((x @ w - t) ** 2).sum() / x.size(0)  # on a batch: the mean over samples


scaled = vmap(grad(mean_as_written), in_dims=(None, 0, 0))(coef, inputs, targets)
loop = torch.stack([2 * (x @ coef - t) * x for x, t in zip(inputs, targets)]).double()
agrees("loss / x.size(0): no error; each gradient times 5", 5 * scaled, loop, 1e-6)
agrees("the sample's own loss, nothing divided",
       vmap(grad(lambda w, x, t: (x @ w - t) ** 2), in_dims=(None, 0, 0))(coef, inputs, targets),
       loop, 1e-6)  # fmt: skip
seen["loss / x.size(0)"] = "wrong"

# %%
# Expected 2D (unbatched) or 3D (batched) input to conv1d, but got input of size: [3]
# -----------------------------------------------------------------------------------
# A ``RuntimeError`` when ``vmap`` maps over the *points* of a point cloud that a ``Conv1d`` model
# reads as ``(3, P)``: coordinates as channels, points along the length, as in PointNet
# (pytorch#121261, ``vmap(jacfwd(model), in_dims=-1)``, for each point's derivatives). Mapping
# over the last dimension leaves each call one point, ``(3,)``, and ``conv1d`` needs at least
# ``(channels, length)``. Make the point a signal of length one, ``p.unsqueeze(-1)``, and take
# that length back off the output. The reference is the Jacobian of the whole cloud in float64:
# with kernel size 1 each output depends on its own point, and its diagonal blocks are the
# per-point Jacobians.
pointnet = nn.Sequential(nn.Conv1d(3, 16, 1), nn.Tanh(), nn.Conv1d(16, 2, 1)).to(device)
cloud = torch.randn(3, 50, device=device)  # 50 points, x-y-z as channels
refused(RuntimeError, "Expected 2D (unbatched) or 3D (batched) input to conv1d, but got "
        "input of size: [3]", lambda: vmap(jacrev(pointnet), in_dims=-1)(cloud))  # fmt: skip


def one_point(point):  # (3,) -> a signal (3, 1) -> (2, 1) -> (2,)
    return pointnet(point.unsqueeze(-1)).squeeze(-1)


per_point = vmap(jacrev(one_point), in_dims=-1)(cloud)  # (50, 2, 3)
wide_pointnet = copy.deepcopy(pointnet).double()
whole = torch.autograd.functional.jacobian(wide_pointnet, cloud.double())
blocks = whole.diagonal(dim1=1, dim2=3).permute(2, 0, 1)  # point i's rows, point i's
agrees("per-point Jacobians, point as a length-1 signal", per_point, blocks, 1e-6)
others = whole.clone()
others.diagonal(dim1=1, dim2=3).zero_()  # keep only other points' blocks
print(f"  kernel size 1: {int(others.count_nonzero())} nonzero entries off own blocks")
assert others.count_nonzero() == 0  # each output depends on its own point only
seen["Conv1d over points, in_dims=-1"] = "raises"

# %%
# That model also normalised over the points (``InstanceNorm1d``, ``LayerNorm``), and
# PointNet max-pools over them. Then each point's output depends on every point, one point alone
# has another output or none, and mapping over points must hold the other points fixed. What is
# wanted is still the diagonal block: point *i*'s output in point *i*'s coordinates, the others
# fixed. ``jacrev`` of the whole cloud gives every block at once (one reverse pass per output
# entry; a result of ``outputs × P × 3 × P`` numbers); keep the diagonal. The reference moves one
# point at a time, in float64.
normed = nn.Sequential(nn.Conv1d(3, 16, 1), nn.InstanceNorm1d(16), nn.Tanh(),
                       nn.Conv1d(16, 2, 1)).to(device)  # fmt: skip
full = jacrev(normed)(cloud)  # (2, 50, 3, 50)
wide_normed = copy.deepcopy(normed).double()
wide_full = torch.autograd.functional.jacobian(wide_normed, cloud.double())
agrees("jacrev of the whole cloud, normalised", full, wide_full, 1e-6)
own = wide_full.diagonal(dim1=1, dim2=3).abs().sum()
coupled = ((wide_full.abs().sum() - own) / own).item()
print(f"  normalised: other points' blocks sum to {coupled:.2f} of the own blocks")
assert coupled > 0.1
own_point = full.diagonal(dim1=1, dim2=3).permute(2, 0, 1)  # (50, 2, 3), as above


def moved(point, i):  # point i's outputs, with point i replaced and the others fixed
    rest = cloud.double()
    placed = torch.cat([rest[:, :i], point[:, None], rest[:, i + 1 :]], dim=1)
    return wide_normed(placed)[:, i]


one_at_a_time = torch.stack([torch.autograd.functional.jacobian(
    lambda p, i=i: moved(p, i), cloud[:, i].double()) for i in range(cloud.shape[1])])  # fmt: skip
agrees("diagonal blocks, others fixed", own_point, one_at_a_time, 1e-6)

# %%
# vmap: It looks like you're attempting to use a Tensor in some data-dependent control flow
# ------------------------------------------------------------------------------------------
# The pitfalls page's `section 2
# <plot_pitfalls.html#item-data-dependent-control-flow-and-leaving-torch>`__ raises this from
# ``if``. Python's other truth tests raise it too: ``not``, ``and``, ``or``, ``bool()``,
# ``any()``, ``all()``, ``max()``, ``min()``, ``in`` and ``assert`` each ask a tensor for one
# ``True`` or ``False``, and under ``vmap`` it holds one per sample. ``float()`` and ``int()``
# stop with the ``.item()`` message instead (so does ``in`` against a tensor, which calls
# ``.item()``). Each has a tensor operator that keeps one answer per sample: ``~`` (on bools; else
# ``logical_not``), ``&``, ``|``, ``.any()``, ``.all()``, :func:`torch.maximum`, ``==`` against
# candidates, and :func:`torch.where` to choose (under ``grad``, mind its branch not taken:
# :ref:`part 1 <sphx_glr_auto_examples_guides_plot_troubleshooting.py>`, this message's entry).
# Below, the Python form raises (asserted); the tensor form agrees with a loop of the Python form.
CONTROL = "data-dependent control flow"
ITEM = "calling .item() on a Tensor"
PAIRS = {  # Python's form, its tensor form, and the message the Python form raises
    "not": (lambda x: x if not x.sum() > 0 else -x,
            lambda x: torch.where(~(x.sum() > 0), x, -x), CONTROL),
    "and": (lambda x: x if x.sum() > 0 and x.max() < 2 else -x,
            lambda x: torch.where((x.sum() > 0) & (x.max() < 2), x, -x), CONTROL),
    "or": (lambda x: x if x.sum() > 0 or x.min() > -1 else -x,
           lambda x: torch.where((x.sum() > 0) | (x.min() > -1), x, -x), CONTROL),
    "bool()": (lambda x: x * bool(x.sum() > 0), lambda x: x * (x.sum() > 0), CONTROL),
    "any()": (lambda x: x if any(x > 1.5) else -x,
              lambda x: torch.where((x > 1.5).any(), x, -x), CONTROL),
    "all()": (lambda x: x if all(x > -1.5) else -x,
              lambda x: torch.where((x > -1.5).all(), x, -x), CONTROL),
    "max()": (lambda x: max(x.sum(), x.new_tensor(0.0)),
              lambda x: torch.maximum(x.sum(), x.new_tensor(0.0)), CONTROL),
    "in": (lambda x: x * (x.argmax() in (0, 1)),
           lambda x: x * (x.argmax() == torch.tensor([0, 1], device=x.device)).any(), CONTROL),
    "float()": (lambda x: x * float(x.sum()), lambda x: x * x.sum(), ITEM),
}  # fmt: skip
rows = torch.randn(64, 4, device=device)
for name, (python_form, tensor_form, words) in PAIRS.items():
    refused(RuntimeError, words, lambda f=python_form: vmap(f)(rows))
    seen[f"Python {name}"] = "raises"
    loop = torch.stack([torch.as_tensor(python_form(x.double())) for x in rows])
    agrees(f"{name} as tensor operators", vmap(tensor_form)(rows), loop, 1e-6)

# %%
# FlexAttention builds its masks this way: its ``create_mask`` and ``create_block_mask`` run
# your ``mask_mod`` under ``vmap`` over batch, heads, query and key positions, so ``not`` in a
# mask raises there too (meta-pytorch/attention-gym#110). Python's ``not`` cannot be overloaded:
# it always returns a ``bool``; ``~`` calls the tensor's ``__invert__``, which returns a tensor.
# The reference runs the Python form on one pair of positions at a time.
from torch.nn.attention.flex_attention import create_mask  # noqa: E402

causal = lambda b, h, q, kv: q >= kv  # noqa: E731
above_diagonal_python = lambda b, h, q, kv: not causal(b, h, q, kv)  # noqa: E731


def inverted(mask_mod):  # the mask_mod that keeps what mask_mod drops
    return lambda b, h, q, kv: ~mask_mod(b, h, q, kv)


refused(RuntimeError, CONTROL,
        lambda: create_mask(above_diagonal_python, 1, 1, 16, 16, device=device))  # fmt: skip
mask = create_mask(inverted(causal), 1, 1, 16, 16, device=device)[0, 0]
by_pairs = [[above_diagonal_python(0, 0, q, k) for k in range(16)] for q in range(16)]
assert torch.equal(mask.cpu(), torch.tensor(by_pairs)), "the ~ mask differs"
print(f"  mask_mod with ~: equal to not, pair by pair ({int(mask.sum())} of 256 kept)")
seen["Python not in a FlexAttention mask_mod"] = "raises"

# %%
# ``assert`` on a tensor raises the same; check the whole batch before ``vmap``, outside the
# mapped function, where one answer is what you want.


def checked_inside(x):
    assert (x > -9).all(), "a value at or below -9"
    return x


refused(RuntimeError, CONTROL, lambda: vmap(checked_inside)(rows))
seen["Python assert"] = "raises"
assert bool((rows > -9).all()), "a value at or below -9"  # outside: one answer

# %%
# The table: what runs under vmap
# -------------------------------
# Each row as the page ran it: ``vmap`` on the code as written (raised, or gave a wrong result,
# each asserted above), and on its fix, each checked above against a loop or a formula. The
# Python ``assert`` has no tensor form here: it moves outside ``vmap``.
table = {row: (outcome, "right") for row, outcome in seen.items()}
table["Python assert"] = ("raises", "moved out")
shade = {"right": 0, "moved out": 0, "wrong": 1, "raises": 2}
fig, ax = plt.subplots(figsize=(6.5, 6.4), layout="constrained")
ax.imshow([[shade[c] for c in table[r]] for r in table], cmap="Greys", vmin=-0.5, vmax=3.5,
          aspect="auto")  # fmt: skip
for i, row in enumerate(table):
    for j, outcome in enumerate(table[row]):
        ax.text(j, i, outcome, ha="center", va="center", color="white" if outcome == "raises"
                else "black", fontsize=8)  # fmt: skip
ax.set_xticks(range(2), ("vmap, as written", "vmap, fixed"))
ax.set_yticks(range(len(table)), list(table), fontsize=8)
ax.set_title(f"Under vmap, torch {torch.__version__}")
plt.show()

# %%
# What to remember
# ----------------
# - Inside ``vmap`` a function sees one sample, without the batch dimension. Code written for a
#   batch runs as written (BatchNorm: eval mode, running statistics) if it gets a batch of one
#   (``x.unsqueeze(0)``) and takes the result's first entry (``squeeze(0)``).
# - Rank checks stop ``BatchNorm2d`` and ``Conv1d``; ``BatchNorm1d`` on ``(C, L)`` with ``C == L``
#   and ``GroupNorm`` without affine weights can run, wrong. So do a positive ``dim`` (count from
#   the end) and ``x.size(0)`` as a batch size (a sample's loss divides by nothing).
# - To map over the points of a ``Conv1d`` model, make each point a length-1 signal; if the model
#   normalises over points, take the diagonal blocks of the whole cloud's Jacobian instead.
# - Python's truth tests on a tensor (``if``, ``not``, ``and``, ``or``, ``bool``, ``any``,
#   ``max``, ``in``, ``assert``) raise the data-dependent control-flow error; write ``~``, ``&``,
#   ``|``, ``.any()``, ``torch.maximum``, ``==``, ``torch.where``; assert outside ``vmap``.
