"""
Troubleshooting, part 4: custom operators, compiled and scripted code, where code runs
======================================================================================

After :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting.py`,
:ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_arguments.py` and
:ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_libraries.py`: custom operators (C++
ones too), ``torch.compile``, TorchScript, ``inference_mode``, ``autocast``, other devices.
Titles begin with the error's first words as PyTorch 2.13 prints them, alphabetically; what
raises nothing comes last. Each entry asserts the problem and checks its fix on a reference.
"""

import inspect
import json
import mmap
import sys
import textwrap
import warnings
from pathlib import Path
from subprocess import PIPE, Popen

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.autograd.functional import jacobian
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vmap
from torch.jit.frontend import NotSupportedError

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
wide = {"device": device, "dtype": torch.float64}
results = {}  # fix -> (relative error, bound), for the figure


def refuses(call, kind, *words):  # call() must raise exactly kind, with all the words
    try:
        call()
    except kind as raised:
        said = " ".join(str(raised).split())
        assert type(raised) is kind and all(w in said for w in words), said[:400]
        shown = textwrap.shorten(said.split(' File "')[0], 120)  # no path to a source
        print(f"{kind.__name__} as expected: {shown}")
        return
    raise AssertionError(f"expected {kind.__name__}; the call raised nothing")


def matches(fix, got, want, bound):
    """Per tensor: largest gap over the reference's largest entry, below ``bound``."""
    pairs = [(got, want)] if torch.is_tensor(got) else list(zip(got, want, strict=True))
    errors = []
    for mine, truth in ((a.detach().double(), b.detach().double()) for a, b in pairs):
        assert mine.shape == truth.shape, (fix, mine.shape, truth.shape)
        errors.append(((mine - truth).abs().max() / truth.abs().max()).item())
        assert errors[-1] < bound, f"{fix}: error {errors[-1]:.1e} >= {bound:.0e}"
    margin = f"{bound / max(errors):.0f}x under it" if max(errors) else "exact"
    print(f"  {fix}: error {max(errors):.1e} (bound {bound:.0e}, {margin})")
    results[fix] = (max(errors), bound)


# %%
# Batching rule not implemented for ...; the fallback path doesn't work on out= or view ops
# -----------------------------------------------------------------------------------------
# A ``RuntimeError`` when an operator without a batching rule writes into an argument (``out=``,
# a custom operator with ``mutates_args``) or returns a view: vmap's fallback, one call per
# sample, cannot. ``t.view(torch.uint8)`` raised it before 2.13 (pytorch#180727); not now.
samples = torch.randn(6, 4, device=device)
as_bytes = vmap(lambda s: s.view(torch.uint8))(samples)
assert torch.equal(as_bytes, samples.view(torch.uint8))  # the thread's case
# Compiles that can break their process run in a child process (CPU), beside the page: section 6.
FOURTH = """
import json, torch
from torch.func import grad, hessian, jacrev
from torch._dynamo import exc, utils
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
x = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
def attempt(fn, **options):  # the result, or the error's type, first line, an internal assert
    try:
        return torch.compile(fn, **options)(x).tolist()
    except (exc.TorchRuntimeError, exc.BackendCompilerFailed) as e:  # any other fails the child
        return [type(e).__name__, str(e).splitlines()[0], "INTERNAL ASSERT" in str(e)]
print(json.dumps({"weights": [p.tolist() for p in m.parameters()],  # in this order:
    "hessian(hessian)": attempt(hessian(hessian(m)), fullgraph=True),
    "then grad(m)": attempt(grad(lambda v: m(v).sum()), fullgraph=True),
    "jacrev x4": attempt(jacrev(jacrev(jacrev(jacrev(m)))), fullgraph=True, backend="aot_eager"),
    "no fullgraph": attempt(hessian(hessian(m))),
    "graphs compiled": utils.counters["stats"]["unique_graphs"]}))
"""
child = Popen([sys.executable, "-c", FOURTH], stdout=PIPE, stderr=PIPE, text=True)
to_sine = lambda s: torch.sin(s, out=torch.empty_like(s))  # noqa: E731
refuses(lambda: vmap(to_sine)(samples), RuntimeError, "sin.out;", "on out= or view")


@torch.library.custom_op("vendor::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, factor: float) -> None:
    x.mul_(factor)  # in place, as an extension's kernel that updates a buffer


def doubled(s):
    copy = s.clone()
    scale_(copy, 2.0)
    return copy


refuses(lambda: vmap(doubled)(samples), RuntimeError, "scale_;", "on out= or view")
# The fixes: the out-of-place operator; for your own operator, a rule: the whole batch at once.
matches("out of place", vmap(torch.sin)(samples), samples.sin(), 1e-6)
scale_.register_vmap(lambda info, in_dims, x, factor: (scale_(x, factor), None))
matches("register_vmap, in place", vmap(doubled)(samples), 2 * samples, 1e-6)

# %%
# Batching rule not implemented for aten::is_nonzero. We could not generate a fallback
# ------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``torch._vmap_internals._vmap``, the older ``vmap`` with which
# ``torch.autograd.functional`` maps the backward (``vectorize=True``), and that pytorch-minimize
# calls directly (rfeinman/pytorch-minimize #33). It cannot batch an ``if`` on a tensor
# (``is_nonzero``). An ``if`` in the forward passes; one in a backward hook clipping a row's norm to
# 1 fails (:func:`~torch.func.jacrev`: part 1's data-dependent error).


def scaled_sine(x, clip=lambda g: g / g.norm() if g.norm() > 1 else g):
    y = torch.sin(x)
    if y.requires_grad:
        y.register_hook(clip)  # runs in the backward pass
    return scales * y


point, batched = torch.tensor([0.4, -1.1, 2.0], **wide), {"vectorize": True}
scales = torch.tensor([3.0, 0.5, 2.0], **wide)  # rows of these norms reach the hook
branchy = lambda x: x.sin() if x.sum() > 0 else x.cos()  # noqa: E731
diagonal = torch.diag(point.cos())  # sum > 0 here: the Jacobian of sin
matches("if, vectorize", jacobian(branchy, point, **batched), diagonal, 1e-14)
refuses(lambda: jacobian(scaled_sine, point, **batched), RuntimeError, "is_nonzero")
refuses(lambda: jacrev(scaled_sine)(point), RuntimeError, "data-dependent control flow")
# The fix: no if on a batched value (clamp, torch.where); reference: diag(min(s, 1) cos x).
clipped = torch.diag(scales.clamp(max=1) * point.cos())
clamped = lambda x: scaled_sine(x, lambda g: g / g.norm().clamp_min(1))  # noqa: E731
matches("hook's clamp, vectorize", jacobian(clamped, point, **batched), clipped, 1e-14)
matches("hook's clamp, jacrev", jacrev(clamped)(point), clipped, 1e-14)
matches("hook's if, loop", jacobian(scaled_sine, point), clipped, 1e-14)

# %%
# Batching rule not implemented for vendor::gate. We could not generate a fallback
# --------------------------------------------------------------------------------
# A ``RuntimeError`` from ``vmap`` of a third-party operator (``torch.library.custom_op``, as a
# C++/CUDA extension registers kernels) that takes or returns a list of tensors: no rule, and the
# fallback takes no lists. Here ``vendor::gate``, tanh(a) σ(b), and its backward operator.


@torch.library.custom_op("vendor::gate", mutates_args=())
def gate(pair: list[torch.Tensor]) -> torch.Tensor:
    return torch.tanh(pair[0]) * torch.sigmoid(pair[1])


@torch.library.custom_op("vendor::gate_backward", mutates_args=())
def gate_backward(pair: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    t, s = torch.tanh(pair[0]), torch.sigmoid(pair[1])
    return [g * (1 - t * t) * s, g * t * s * (1 - s)]


gate.register_autograd(  # as the library registers it
    lambda ctx, g: (gate_backward(list(ctx.saved_tensors), g),),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs[0]),
)
As, Bs = torch.randn(2, 5, 3, **wide)
gated = lambda a, b: gate([a, b])  # noqa: E731
refuses(lambda: vmap(gated)(As, Bs), RuntimeError, "vendor::gate. We could not")
leaves = [t.clone().requires_grad_() for t in (As, Bs)]
loop = torch.stack([gate([a, b]) for a, b in zip(*leaves)])  # the reference: a loop
plain = torch.tanh(leaves[0]) * torch.sigmoid(leaves[1])  # in PyTorch's own operators
loop_grads = torch.autograd.grad(plain.sum(), leaves)  # for the gradients
# Fix 1: one call on the batch, outside vmap (samples do not mix: the sum's gradient is theirs).
matches("one call on the batch", gate(leaves), loop, 1e-14)
whole_grads = torch.autograd.grad(gate(leaves).sum(), leaves)
matches("its gradient", whole_grads, loop_grads, 1e-14)


# Fix 2: a rule. It sees each input's batch dimension (None: not batched) and moves it to the
# front; an unbatched input broadcasts in these elementwise operators.
def batch_in_front(tensors, dims):
    return [t if d is None else t.movedim(d, 0) for t, d in zip(tensors, dims)]


gate.register_vmap(lambda info, dims, pair: (gate(batch_in_front(pair, dims[0])), 0))
matches("gate's register_vmap", vmap(gated)(As, Bs), loop, 1e-14)
shared = torch.stack([gate([a, Bs[0]]) for a in As])  # a batched in dim 1, b shared
matches("in_dims=(1, None)", vmap(gated, (1, None))(As.mT, Bs[0]), shared, 1e-14)
# torch.func.grad refuses the registered autograd in 2.13 (part 2's setup_context error,
# pytorch#168393, where a later comment reports PR #184974's fix, after 2.13, wrong when
# nested). An autograd.Function (:doc:`plot_extending_torch_func`) can call both operators, the
# backward one under no_grad (recorded, it raises the same error).
by_sample = lambda fn: vmap(grad(lambda a, b: fn(a, b).sum(), argnums=(0, 1)))  # noqa: E731
refuses(lambda: by_sample(gated)(As, Bs), RuntimeError, "setup_context")


class Gate(torch.autograd.Function):
    generate_vmap_rule = True  # vmap's rule, generated from the staticmethods
    forward = staticmethod(gated)
    setup_context = staticmethod(lambda ctx, ins, out: ctx.save_for_backward(*ins))

    @staticmethod
    def backward(ctx, g):
        with torch.no_grad():  # the backward operator, unrecorded
            return tuple(gate_backward(list(ctx.saved_tensors), g))


# Then the backward operator meets the message (NVIDIA/cuEquivariance#95). Fix 3: its rule.
refuses(lambda: by_sample(Gate.apply)(As, Bs), RuntimeError, "gate_backward. We could")


@gate_backward.register_vmap
def _(info, in_dims, pair, g):
    a, b, g = batch_in_front([*pair, g], [*in_dims[0], in_dims[1]])
    return gate_backward([a, b], g), [0, 0]


matches("Function, two rules", by_sample(Gate.apply)(As, Bs), loop_grads, 1e-14)
# First derivatives only: the no_grad makes the second zero, silently.
assert not jacrev(jacrev(lambda a: Gate.apply(a, Bs[0]).sum()))(As[0]).any()

# %%
# cannot use C++ torch::autograd::Function with functorch transforms (vmap, grad, vjp, etc)
# -----------------------------------------------------------------------------------------
# A ``RuntimeError`` under a transform from an extension's C++ ``torch::autograd::Function``.
# Before this check, ``vmap`` of one dropped its output's ``grad_fn``, silently (pytorch#102720,
# closed by PR #103957, which added the check). This page compiles no C++ (an extension built
# with ``load_inline`` shows the error), so it checks the wheel: ``Function<T>::apply`` in the
# installed ``custom_function.h`` runs the check before it makes the graph node, and
# ``torch_cpu`` holds the message. The fix: the maths in Python, an ``autograd.Function`` with
# rules or a ``torch.library`` operator with ``register_autograd`` and ``register_vmap`` (the
# section above). Both keep ``grad_fn`` under ``vmap``: ``backward()`` gives the loop's.
torch_dir = Path(torch.__file__).parent
header = (torch_dir / "include/torch/csrc/autograd/custom_function.h").read_text()
apply = header[header.index("auto Function<T>::apply(") :]
assert 0 < apply.index("checkSupportsCppAutogradFunction()") < apply.index("CppNode<T>")
message = b"cannot use C++ torch::autograd::Function with functorch transforms"
with next((torch_dir / "lib").glob("*torch_cpu.*")).open("rb") as library:
    with mmap.mmap(library.fileno(), 0, access=mmap.ACCESS_READ) as image:
        assert image.find(message) >= 0
for name, fn in {"Function": Gate.apply, "custom operator": gated}.items():
    fresh = [t.clone().requires_grad_() for t in (As, Bs)]
    vmap(fn)(*fresh).sum().backward()
    matches(f"vmap({name}), backward()", [t.grad for t in fresh], loop_grads, 1e-14)

# %%
# Inference tensors cannot be saved for backward
# ----------------------------------------------
# A ``RuntimeError`` from autograd under ``torch.inference_mode``, where PyTorch Lightning runs
# ``validate``, ``test`` and ``predict``, when a step takes gradients, as MAML does
# (Lightning-AI/pytorch-lightning #20181). There ``autograd.grad`` finds no graph (part 1's "element
# 0 ..."), even in ``enable_grad()``; in ``inference_mode(False)`` it does, but cannot save the
# inference batch.
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(**wide)
detached = {name: p.detach() for name, p in net.named_parameters()}


def squared_error(module, p, x, y):
    return (functional_call(module, p, (x,)).squeeze(-1) - y).square().mean()


def autograd_step(x, y):
    loss = squared_error(net, dict(net.named_parameters()), x, y)
    return torch.autograd.grad(loss, [*net.parameters()])


with torch.inference_mode():  # as in validation_step
    xs, ys = torch.randn(16, 4, **wide), torch.randn(16, **wide)
    refuses(lambda: autograd_step(xs, ys), RuntimeError, "does not require grad")
    with torch.enable_grad():
        refuses(lambda: autograd_step(xs, ys), RuntimeError, "does not require grad")
    with torch.inference_mode(False):
        refuses(lambda: autograd_step(xs, ys), RuntimeError, "Inference tensors cannot")
        cloned = autograd_step(xs.clone(), ys.clone())  # fix 1: normal tensors
    by_func = grad(squared_error, 1)(net, detached, xs, ys)  # fix 2: torch.func
with torch.no_grad():  # Lightning's Trainer(inference_mode=False); fix 2 too
    under_no_grad = grad(squared_error, 1)(net, detached, xs, ys)
reference = autograd_step(xs.clone(), ys.clone())  # outside both modes
matches("inference_mode(False), clone", cloned, reference, 1e-14)
matches("torch.func.grad, inference mode", by_func.values(), reference, 1e-14)
matches("torch.func.grad, no_grad", under_no_grad.values(), reference, 1e-14)

# %%
# RuntimeError when making fake tensor call
# -----------------------------------------
# A ``torch._dynamo.exc.TorchRuntimeError`` from :func:`torch.compile` of ``hessian(hessian(m))``,
# an MLP's fourth derivatives (pytorch#154284), on an internal assert in dynamo's fake-tensor
# pass; without ``fullgraph=True``, the same error. A compile of ``grad(m)`` right after it, in
# the same process, failed too (``BackendCompilerFailed``): hence the child process. The fix:
# reverse mode only (pytorch#183015's workaround for a like crash), ``jacrev`` four times, which
# compiles with ``fullgraph=True`` (a graph break would raise) under the ``aot_eager`` backend,
# dynamo and AOTAutograd, where ``hessian``'s nesting fails (Inductor's code generation is left
# out to keep the page fast); or eager code. Reference: f(x) = V tanh(W x + c) + d has the
# fourth derivatives Σₕ Vₖₕ tanh⁗(zₕ) Wₕᵢ Wₕⱼ Wₕₗ Wₕₘ.
out, log = child.communicate(timeout=300)
assert child.returncode == 0, log[-2000:]  # the child's last words, if it failed
report = json.loads(out)
for name in ("hessian(hessian)", "no fullgraph", "then grad(m)"):
    print(f"the child, {name}: {report[name]}")
failure = ["TorchRuntimeError", "RuntimeError when making fake tensor call", True]
assert report["hessian(hessian)"] == report["no fullgraph"] == failure
assert report["then grad(m)"][0] == "BackendCompilerFailed"
assert report["graphs compiled"] == 1  # jacrev x4's, the one compile that did not fail
W, c, V, d = (torch.tensor(p, **wide) for p in report["weights"])
x4 = torch.tensor([0.3, -0.2, 0.5], **wide)
t = torch.tanh(W @ x4 + c)
tanh4 = 8 * t * (2 - 3 * t**2) * (1 - t**2)  # tanh's fourth derivative
fourth = torch.einsum("kh,h,hi,hj,hl,hm->kijlm", V, tanh4, W, W, W, W)
matches("jacrev x4 compiled", torch.tensor(report["jacrev x4"], **wide), fourth, 1e-14)
mlp = lambda x: torch.tanh(W @ x + c) @ V.T + d  # noqa: E731
matches("hessian(hessian), eager", hessian(hessian(mlp))(x4), fourth, 1e-14)

# %%
# (No error) jacfwd(jacfwd(f)) through a custom autograd.Function returns zeros
# -----------------------------------------------------------------------------
# Forward mode over forward mode through an ``autograd.Function``'s ``jvp`` staticmethod gives a
# zero second derivative, silently, though the ``jvp`` uses PyTorch operators on inputs saved with
# ``save_for_forward`` (pytorch#197867, open). ``Cube`` is x³: derivatives 3x², 6x, 6.


class Cube(torch.autograd.Function):
    generate_vmap_rule = True  # vmap's rule, generated from the staticmethods
    forward = staticmethod(lambda x: x * x * x)
    jvp = backward = staticmethod(lambda ctx, t: 3 * ctx.saved_tensors[0] ** 2 * t)

    @staticmethod
    def setup_context(ctx, ins, out):
        ctx.save_for_forward(*ins)  # for jvp
        ctx.save_for_backward(*ins)


x3, cube = torch.tensor(0.7, **wide), Cube.apply
print(f"jacfwd(jacfwd): {jacfwd(jacfwd(cube))(x3).item()}; 6x is {6 * x3.item():.1f}")
assert jacfwd(jacfwd(cube))(x3) == 0  # the silent zero
# The fix: no forward level over the jvp rule's output: jacrev innermost (hessian), or jacrev
# over jacfwd, which differentiates the jvp's operators (so keep them differentiable ones).
nestings = {  # name: (nesting, closed form)
    "jacrev(jacfwd)": (jacrev(jacfwd(cube)), 6 * x3),
    "hessian, jacfwd(jacrev)": (hessian(cube), 6 * x3),
    "jacfwd(jacfwd(jacrev))": (jacfwd(jacfwd(jacrev(cube))), 6 + 0 * x3),
}
for name, (nested, exact) in nestings.items():
    matches(name, nested(x3), exact, 1e-14)

# %%
# (No error) torch.jit.script of a vmap or grad made outside it: the untransformed function
# -----------------------------------------------------------------------------------------
# pytorch#101241 (open): a scripted function calling a ``vmap`` (or ``grad``) built outside it
# returns what eager code does not, silently. TorchScript reads the callee's source with
# ``inspect``, which follows the wrapper's ``__wrapped__`` to the function inside (checked), and
# compiles that function, untransformed. Its global names are looked up in the wrapper's module, so
# one it uses may fail instead ("undefined value torch" below). Calling ``vmap`` itself in scripted
# code does not compile either; TorchScript is deprecated in 2.13. The fix: transforms in Python,
# eager or compiled (:doc:`plot_compile_and_transforms`); the issue's ``vmap`` over the vectors
# stays, and its ``fork`` per layer becomes a Python loop over the layers.


def row_total(row):
    return row.sum()


def row_norm(row):
    return torch.linalg.vector_norm(row)


def scripted_call(mapped):  # a scripted function that calls mapped, built outside it
    def call(rows: torch.Tensor):
        return mapped(rows)

    return torch.jit.script(call)


grid = torch.arange(6.0, **wide).reshape(2, 3)
with warnings.catch_warnings(record=True, action="always") as deprecations:
    per_row = scripted_call(vmap(row_total))
print(f"eager: {vmap(row_total)(grid).tolist()}; scripted: {per_row(grid).tolist()}")
for transform in (vmap, grad):  # scripted: the untransformed sum, silently
    assert torch.equal(scripted_call(transform(row_total))(grid), grid.sum())
    assert inspect.getsource(transform(row_total)) == inspect.getsource(row_total)
said = [str(w.message) for w in deprecations if w.category is DeprecationWarning]
assert any("torch.compile" in s and "torch.export" in s for s in said), said
refuses(lambda: scripted_call(vmap(row_norm)), RuntimeError, "undefined value torch")
refuses(lambda: scripted_call(vmap), NotSupportedError, "keyword-only arguments")
matches("vmap, eager", vmap(row_total)(grid), grid @ grid.new_ones(3), 1e-14)

# %%
# (No error) vmap of nn.Linear under torch.autocast returns float32, not the low precision
# ----------------------------------------------------------------------------------------
# Under :class:`torch.autocast` (bfloat16 on the CPU, float16 on CUDA) ``nn.Linear`` returns the
# low precision, ``vmap`` of it float32 (pytorch#192617): on the CPU, bit for bit, the product in
# bfloat16 plus the bias in float32, so the bias is probably added after the autocast product.
# The values agree with a loop within the rounding. The fix: cast the output.
low = torch.bfloat16 if device.type == "cpu" else torch.float16
layer = nn.Linear(4, 3).to(device)
inputs = torch.randn(8, 4, device=device)
with torch.autocast(device.type, dtype=low):
    mapped, batch_out = vmap(layer)(inputs), layer(inputs)
    one_by_one = torch.stack([layer(row) for row in inputs])
print(f"vmap: {mapped.dtype}; one sample: {one_by_one.dtype}; all: {batch_out.dtype}")
assert mapped.dtype == torch.float32 and one_by_one.dtype == batch_out.dtype == low
product = inputs.to(low) @ layer.weight.to(low).T
assert device.type != "cpu" or torch.equal(mapped, product.float() + layer.bias)
cast = mapped.to(low)  # the fix
assert cast.dtype == one_by_one.dtype
matches("vmap(layer) under autocast, cast", cast, one_by_one, 2e-2)

# %%
# Where the code runs: C++ programs, and devices other than the CPU and CUDA
# --------------------------------------------------------------------------
# ``torch.func`` has no public C++ API: no header of the wheel's C++ frontend names ``vmap``,
# ``jacrev`` or ``jacfwd``. A libtorch program (pytorch#106455) loops over
# ``torch::autograd::grad``, or leaves that step to Python. This site runs on the CPU and CUDA only.
# pytorch#140704 reports ``vmap`` of ``F.mse_loss`` failing on Apple's MPS ("mse_loss_out_mps:
# target and input tensors must have identical shapes"); PR #140869 says it fixes that issue (not
# checked here, without an MPS device). Where it fails: that step on the CPU, the loss in
# elementwise operators, a loop.
frontend = sorted((torch_dir / "include/torch/csrc/api/include").rglob("*.h"))
names = ("vmap", "jacrev", "jacfwd")
naming = [h for h in frontend if any(name in h.read_text() for name in names)]
print(f"{len(frontend)} headers of the C++ frontend; {len(naming)} name a transform")
assert frontend and not naming

# %%
# Every fix against its reference
# -------------------------------
# Each check's relative error (grey; an exact match at 1e-18) against its bound (black).
labels, (errs, limits) = list(results), zip(*results.values())
fig, ax = plt.subplots(figsize=(7, 9), layout="constrained")
ax.barh(labels, [max(err, 1e-18) for err in errs], color="0.65")
ax.scatter(limits, labels, marker="|", s=180, color="black")
ax.set(xscale="log", xlim=(1e-19, 1), xlabel="largest error / largest reference entry")
ax.set_title(f"Each fix against its bound ({len(labels)} checks, {device.type})")
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# * An extension's operator gets no batching rule: ``register_vmap`` on it and on its backward
#   operator, or one call on the whole batch. In 2.13 ``torch.func.grad`` refuses a custom
#   operator's registered autograd: call the operators from an ``autograd.Function``. A C++
#   ``torch::autograd::Function`` raises under the transforms: rewrite it in Python.
# * A forward level over an ``autograd.Function``'s ``jvp`` rule (``jacfwd(jacfwd)``) gives zeros,
#   silently: nest ``jacrev`` innermost (``hessian``) or outside (``jacrev(jacfwd)``).
# * TorchScript compiles a ``vmap`` built outside it as the plain function, silently: keep
#   transforms in Python, eager or compiled, and loop over layers in Python, not ``fork``.
# * ``hessian(hessian)`` fails to compile: ``jacrev`` four times compiles, or run it eagerly.
# * ``torch.func.grad`` works under ``inference_mode``, ``autograd.grad`` does not. The older
#   ``vectorize=True`` path fails on an ``if`` in the backward (a hook): ``clamp`` instead.
#   ``vmap`` of ``nn.Linear`` under autocast returns float32: cast it if the dtype matters.
