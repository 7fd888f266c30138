"""
Troubleshooting, part 19: a float argument per sample, non-tensor aux, a patched BatchNorm
==========================================================================================

Three questions, re-run on torch 2.13: ``vmap`` over a library function that takes a Python
number, such as one rotation angle per image (pytorch/vision#6524); ``grad`` with a non-tensor
auxiliary output (pytorch#159667); and what ``replace_all_batch_norm_modules_`` changes in
training and evaluation (pytorch#85533). Each: the message asserted, the cause, and the fix
checked against a closed form, a loop, or ordinary autograd. Part 1: :doc:`plot_troubleshooting`.
"""

import copy
import math
import textwrap
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.func import replace_all_batch_norm_modules_ as patch_batch_norms
from torch.optim.swa_utils import update_bn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
in64 = {"dtype": torch.float64, "device": device}


def message_of(call, *args, kind=RuntimeError):
    """Runs call(*args), which must raise exactly ``kind``; returns its message, printed."""
    try:
        call(*args)
    except kind as refusal:
        assert type(refusal) is kind, type(refusal)
        print(f"  {kind.__name__}: {textwrap.shorten(str(refusal), 180)}")
        return str(refusal)
    raise AssertionError(f"torch {torch.__version__}: {call} raised nothing")


def close_to(label, got, want, bound):
    """Asserts the largest gap over the largest entry of want is at most bound; prints it."""
    assert got.shape == want.shape, (label, tuple(got.shape), tuple(want.shape))
    gap = (got - want).abs().max().item() / want.abs().max().item()
    print(f"  {label}: gap {gap:.1e} (bound {bound:.0e})")
    assert gap <= bound, f"{label}: {gap:.1e} is over {bound:.0e}"


# %%
# vmap: It looks like you're calling .item() on a Tensor: a float argument per sample
# -----------------------------------------------------------------------------------
# In pytorch/vision#6524 a user wanted ``vmap(rotate)(images, angles)``, one angle per image. Under
# ``vmap`` each sample's angle is a batched 0-d tensor. torchvision's ``rotate`` refused it
# ("TypeError: Argument angle should be int or float"), and a wrapper calling ``rotate(image,
# angle.item())`` raised this ``RuntimeError``; so does any function that turns the angle into a
# number (``math.radians``, ``float()``). The fix: write the per-sample part with tensor operations
# and run the batch in one call; for a rotation, one affine matrix per image from the angles, then
# ``F.affine_grid`` and ``F.grid_sample`` on the whole batch. ``affine_grid`` measures both axes
# from −1 to 1, so the matrix is written in pixel units, or a rotation of a non-square image would
# also stretch it. ``rotate`` below stands in for a library's. References: ``torch.rot90`` for
# quarter turns of square images; for a 24 × 40 image, ``torch.flip`` for a half turn, and a
# centred round blob, which any rotation leaves as it was (but for interpolation).
def rotate(image, angle: float):  # library-style: the angle must be a Python number
    if not isinstance(angle, (int, float)):
        raise TypeError("Argument angle should be int or float")
    radians = math.radians(angle)
    cos, sin = math.cos(radians), math.sin(radians)
    tall = image.shape[-2] / image.shape[-1]  # height over width: pixel units
    theta = torch.tensor([[cos, -sin * tall, 0.0], [sin / tall, cos, 0.0]], **in64)
    grid = F.affine_grid(theta[None], [1, *image.shape], align_corners=False)
    return F.grid_sample(image[None], grid, align_corners=False)[0]


images = torch.randn(4, 1, 16, 16, **in64)
quarter_turns = torch.tensor([0.0, 90.0, 180.0, 270.0], **in64)
said = message_of(vmap(rotate), images, quarter_turns, kind=TypeError)
assert said == "Argument angle should be int or float", said
for as_number in (lambda a: a.item(), float, math.radians):
    said = message_of(
        vmap(lambda im, a, to=as_number: rotate(im, to(a))), images, quarter_turns
    )
    assert said.startswith("vmap: It looks like you're calling .item() on a Tensor"), (
        said
    )


def rotate_batch(images, angles):  # the fix: the angles stay a tensor
    radians = torch.deg2rad(angles)
    cos, sin, zero = radians.cos(), radians.sin(), torch.zeros_like(radians)
    tall = images.shape[-2] / images.shape[-1]  # height over width: pixel units
    theta = torch.stack([cos, -sin * tall, zero, sin / tall, cos, zero], 1).view(
        -1, 2, 3
    )
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, align_corners=False)


rotated = rotate_batch(images, quarter_turns)
by_rot90 = torch.stack([torch.rot90(im, k, dims=(1, 2)) for k, im in enumerate(images)])
close_to("quarter turns, against torch.rot90", rotated, by_rot90, 1e-14)
angles = torch.tensor([12.5, -40.0, 63.0, 150.0], **in64)
loop = torch.stack([rotate(im, a) for im, a in zip(images, angles.tolist())])
close_to("any angles, against a loop of rotate(image, float)", rotate_batch(images, angles),
       loop, 1e-14)  # fmt: skip
wide = torch.randn(2, 1, 24, 40, **in64)
half_turns = rotate_batch(wide, torch.tensor([180.0, 180.0], **in64))
close_to(
    "24 × 40, half turns, against torch.flip", half_turns, wide.flip(-2, -1), 3e-14
)
rows, cols = torch.meshgrid(torch.arange(24.0, **in64) - 11.5, torch.arange(40.0, **in64) - 19.5,
                            indexing="ij")  # fmt: skip
blob = torch.exp(-(rows**2 + cols**2) / (2 * 4.0**2)).expand(3, 1, 24, 40)
turned_blobs = rotate_batch(blob, torch.tensor([37.0, -75.0, 120.0], **in64))
close_to("24 × 40, a round blob turned, against itself", turned_blobs, blob, 2e-2)
# ``rotate_batch`` called on one sample maps too, but 2.13 has no batching rule for
# ``affine_grid``'s operator: ``vmap`` runs it one sample at a time, with a warning. The batched
# call above avoids that loop.
one_sample = lambda im, a: rotate_batch(im[None], a[None])[0]  # noqa: E731
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always", category=UserWarning)
    mapped = vmap(one_sample)(images, angles)
close_to("vmap of the tensor version", mapped, loop, 1e-14)
slow = {str(w.message).split("rule for ")[1].split(".")[0] for w in warned
        if "not yet implemented the batching rule" in str(w.message)}  # fmt: skip
print(f"  slow fallbacks under vmap: {sorted(slow)}")
assert slow == {"aten::affine_grid_generator"}, slow

# %%
# An arrow makes the rotations visible: each image of the batch, turned by its own angle in the
# one batched call.
axis = torch.linspace(-1, 1, 64, **in64)
grid_y, grid_x = torch.meshgrid(axis, axis, indexing="ij")
shaft = (grid_x > -0.7) & (grid_x < 0.3) & (grid_y.abs() < 0.12)
head = (grid_x >= 0.3) & (grid_y.abs() < 0.7 - grid_x)
arrow = (shaft | head).double()  # points right, at 0°
arrows = arrow.expand(4, 1, 64, 64)
turned = rotate_batch(arrows, angles)
fig, axes = plt.subplots(1, 4, figsize=(8, 2.3), layout="constrained")
for ax, picture, angle in zip(axes, turned[:, 0].cpu(), angles.tolist()):
    ax.imshow(picture, cmap="Greys", vmin=0, vmax=1)
    ax.set(title=f"{angle:g}°", xticks=[], yticks=[])
fig.suptitle("rotate_batch: one angle per image, one call")
plt.show()

# %%
# Expected tensors, got unsupported type <class 'str'>: has_aux with strings or numbers
# -------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``grad(f, has_aux=True)`` when the auxiliary output holds anything but
# tensors: a string, an ``int`` or a ``float``, even inside a dict (pytorch#159667; part 1 shows
# the ``float`` case). Each leaf of the auxiliary output must be a tensor. The fixes: numbers as
# tensors (``torch.tensor(step)``), and other objects kept outside the function, written to a list
# or dict it closes over (never a tensor made inside: it would escape the transform). JAX's eager
# ``grad`` passes any auxiliary value through; checked below when JAX is installed. Reference: the
# gradient of Σ wᵢ² · cᵢ, 2 w ⊙ c, by hand.
scales, weights = torch.rand(5, **in64), torch.randn(5, **in64)


def loss_with(aux):
    def loss(w):
        value = (w.square() * scales).sum()
        return value, aux(value)

    return loss


for aux, kind in [(lambda v: "converged", "str"), (lambda v: {"step": 3}, "int")]:
    said = message_of(grad(loss_with(aux), has_aux=True), weights)
    assert said.startswith(
        f"Expected tensors, got unsupported type <class '{kind}'>"
    ), said
try:
    import jax
except ImportError:  # JAX is optional: the comparison only
    jax = None
if jax is not None:
    jax_aux = jax.grad(lambda a: (a**2, "converged"), has_aux=True)(2.0)[1]
    print(f"  JAX {jax.__version__}, grad with has_aux: aux {jax_aux!r}")
    assert jax_aux == "converged", jax_aux
notes = []  # non-tensors leave through the closure


def as_tensors(value):
    notes.append("converged" if value < 100 else "not yet")
    return {"loss": value, "step": torch.tensor(3)}


gradient, aux = grad(loss_with(as_tensors), has_aux=True)(weights)
close_to("gradient beside tensor aux", gradient, 2 * weights * scales, 1e-15)
close_to(
    "aux loss, against the loss outside",
    aux["loss"],
    (weights**2 * scales).sum(),
    1e-15,
)
assert aux["step"].item() == 3 and notes == ["converged"], (aux, notes)
print(f"  aux: loss {aux['loss'].item():.3f}, step {aux['step'].item()}; notes {notes}")

# %%
# (No error) replace_all_batch_norm_modules\_: what it changes in training and in evaluation
# ------------------------------------------------------------------------------------------
# A question left in pytorch#85533: does patching BatchNorm for ``torch.func`` change training,
# or only evaluation? ``jacrev`` of a training-mode BatchNorm over a batch raises part 1's
# "would mutate a captured Tensor": the module adds one to its ``num_batches_tracked`` counter in
# place (the ``aten::add_`` the message names). :func:`torch.func.replace_all_batch_norm_modules_`
# removes the counter and the running statistics (all ``None``, ``track_running_stats``
# ``False``). Training is unchanged: the output still uses the batch's mean and variance.
# Evaluation changes: with no running statistics, an evaluation-mode module also normalises with
# the batch's own statistics, so its output depends on the batch. And a model trained through
# the patched copy collects no running statistics: before inference, estimate them (below), or
# pass the buffers in (part 1). References: the unpatched module in
# training mode, its Jacobian row by row with ``torch.autograd.grad``, and the statistics of the
# training data computed by hand.
net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
net, batch = net.to(**in64), torch.randn(6, 3, **in64)
net_weights = {name: p.detach() for name, p in net.named_parameters()}
said = message_of(jacrev(lambda p: functional_call(net, p, (batch,))), net_weights)
assert "would mutate a captured Tensor" in said and "aten::add_" in said, said
patched = copy.deepcopy(net)
patch_batch_norms(patched)
norm = patched[1]
assert norm.running_mean is None and norm.running_var is None, norm
assert norm.num_batches_tracked is None and not norm.track_running_stats, norm
unpatched = copy.deepcopy(net).train()
close_to("patched, training mode, against unpatched", patched(batch), unpatched(batch),
         1e-15)  # fmt: skip
jacobian = jacrev(lambda p: functional_call(patched, p, (batch,)))(net_weights)
leaf = net[0].weight.detach().clone().requires_grad_()
outputs = functional_call(copy.deepcopy(net).train(), {"0.weight": leaf}, (batch,))
rows = [torch.autograd.grad(o, leaf, retain_graph=True)[0] for o in outputs.flatten()]
close_to("Jacobian, patched, against autograd rows", jacobian["0.weight"],
         torch.stack(rows).view(6, 2, 4, 3), 1e-14)  # fmt: skip
patched.eval()
assert not patched.training and not patched[1].training
close_to("patched, eval mode, against training mode", patched(batch), unpatched(batch),
         1e-15)  # fmt: skip
moved = (patched(batch[:3]) - patched(batch)[:3]).abs().max().item()
print(f"  patched, eval mode: the first 3 samples alone move by {moved:.2f}")
assert moved > 0.01, "eval-mode output did not depend on the batch"

# %%
# Estimating the statistics after training through the patched copy: load its weights into the
# original (an unpatched module, which has the buffers), then let
# ``torch.optim.swa_utils.update_bn`` run it over the data in training mode without
# gradients: it resets the statistics, averages them over the batches (``momentum=None``), and
# puts the module's ``momentum`` back. Reference: the mean and unbiased variance of the first
# layer's outputs over the data, by hand, averaged over batches of equal size as the module does.
data = torch.randn(5, 6, 3, **in64)  # five batches of six
trained = copy.deepcopy(patched).train()
optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
for step_batch in data:  # training through the copy
    optimizer.zero_grad(set_to_none=True)
    trained(step_batch).square().mean().backward()
    optimizer.step()
original = copy.deepcopy(net)
loaded = original.load_state_dict(
    trained.state_dict(), strict=False
)  # no statistics there
assert not loaded.unexpected_keys, loaded
assert set(loaded.missing_keys) == {
    "1.running_mean",
    "1.running_var",
    "1.num_batches_tracked",
}
for name, p in original.named_parameters():
    assert torch.equal(p, trained.get_parameter(name)), f"{name} not loaded"
    if name != "0.bias":  # the bias before the BatchNorm: the batch mean removes it
        assert not torch.equal(p, net.get_parameter(name)), f"{name} not trained"
with torch.set_grad_enabled(False):
    original(3 * torch.randn(6, 3, **in64) + 1)  # stale statistics, from other data
update_bn(data, original)
update_bn(data, trained)  # the patched copy: nothing to estimate, and no error
assert trained[1].running_mean is None, "update_bn gave the patched copy statistics"
assert original[1].momentum == 0.1, original[1].momentum  # put back
original.eval()  # for inference
hidden = torch.stack([original[0](b) for b in data]).detach()  # (batches, 6, 4)
close_to("running mean, against the data", original[1].running_mean, hidden.mean((0, 1)),
         1e-15)  # fmt: skip
close_to("running variance, against the data", original[1].running_var,
         hidden.var(1, correction=1).mean(0), 1e-15)  # fmt: skip
close_to("estimated model: alone or in the batch", original(batch[:3]), original(batch)[:3],
         1e-15)  # fmt: skip

# %%
# What to remember
# ----------------
# - ``vmap`` maps tensors: a library function that needs a Python number per sample raises the
#   ``.item()`` error. Compute the per-sample part with tensor operations (for rotations:
#   affine matrices, ``affine_grid``, ``grid_sample``) and run the batch in one call.
# - ``has_aux`` returns tensors only: numbers as tensors, other objects through a closure.
# - ``replace_all_batch_norm_modules_`` keeps training as it was and removes running
#   statistics, so evaluation then uses batch statistics too. After training through the patched
#   copy, load its weights into the unpatched module and estimate the statistics
#   (``torch.optim.swa_utils.update_bn``) before inference.
