"""
Troubleshooting, part 6: installs and versions, functorch leftovers, tracing and export
=======================================================================================

Is ``torch.func`` in this install, and which ``functorch`` is it? Then what older code meets in
PyTorch 2.13: an old ``functorch`` beside torch, moved names, ``functorch._C``, ``functorch.dim``,
``functorch.compile``, a compiled ``vjp_fn``, ``torch.jit.trace`` of a transform, and
``torch.export`` of ``vmap`` and ``grad``. Titles begin with the error's first words in 2.13,
alphabetically, what raises nothing last; each entry asserts the problem and checks its fix.
Old names' replacements: :ref:`sphx_glr_auto_examples_guides_plot_functorch_migration.py`.
"""

import importlib.metadata as metadata
import json
import shutil
import sys
import tempfile
import textwrap
import warnings
from importlib import import_module
from importlib.util import cache_from_source
from pathlib import Path
from subprocess import PIPE, Popen

import functorch
import functorch.compile as old_compile
import matplotlib.pyplot as plt
import torch
from functorch.dim import dims
from torch import nn
from torch._dynamo.exc import Unsupported
from torch._dynamo.utils import counters
from torch.func import grad, hessian, jacrev, vjp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
f64 = {"device": device, "dtype": torch.float64}
checked = {}  # check -> (relative error, bound), for the figure


def expect(kind, call, *words):
    """call() must raise exactly ``kind``, its message holding every word."""
    try:
        call()
    except kind as err:
        text = " ".join(str(err).split())
        assert type(err) is kind and all(w in text for w in words), (type(err), text)
        start = text.find(words[0])  # show the message from the first word checked
        shown = ("..." if start else "") + textwrap.shorten(text[start:], 90)
        print(f"  {kind.__name__} as expected: {shown}")
        return
    raise AssertionError(f"{kind.__name__} expected; nothing was raised")


def close(label, got, want, bound):
    """Per tensor: the largest gap over the reference's largest entry, at most bound."""
    pairs = [(got, want)] if torch.is_tensor(got) else list(zip(got, want, strict=True))
    worst = 0.0
    for mine, truth in pairs:
        assert mine.shape == truth.shape, (label, mine.shape, truth.shape)
        gap = (mine.double() - truth.double()).abs().max() / truth.abs().max()
        assert gap <= bound, f"{label}: error {gap:.1e} > bound {bound:.0e}"
        worst = max(worst, gap.item())
    margin = f"{bound / worst:.0f}x under it" if worst else "exact"
    print(f"  {label}: error {worst:.1e} (bound {bound:.0e}, {margin})")
    checked[label] = (worst, bound)


# %%
# Is torch.func in this install? Which functorch is it?
# -----------------------------------------------------
# ``torch.func`` is part of ``torch``: nothing else to install. To check a build or container,
# import it and run a transform on a known case, here ``vmap(grad(sin)) = cos``.
angles = torch.linspace(-3, 3, 13, **f64)
close("vmap(grad(sin)) = cos", vmap(grad(torch.sin))(angles), angles.cos(), 1e-15)

# %%
# ``functorch`` comes in the same wheel, at torch's version. The test that caught each layout
# below: ``torch`` is the only distribution that provides ``functorch``, and every
# ``functorch`` file that torch's file list (its ``RECORD``) names is on disk.
owners = metadata.packages_distributions()["functorch"]
ours = [file for file in metadata.files("torch") if file.parts[0] == "functorch"]
print(f"functorch: from {owners}, version {functorch.__version__}, {len(ours)} files")
assert owners == ["torch"] and functorch.__version__ == torch.__version__
assert Path("functorch/__init__.py") in ours and all(f.locate().exists() for f in ours)

# %%
# Checked with pip on 2026-11-26, not run by this page: ``pip install functorch`` fetches
# functorch 2.0.0, a wheel with no module, only metadata requiring ``torch>=2.0,<2.1``; beside
# torch 2.13, ``pip install --dry-run functorch`` would install torch 2.0.1 in its place. For
# Python 3.11 and newer pip sees only 2.0.0, 1.13.1 and 1.13.0 (so old requirements install); for
# 3.7 to 3.10 also the standalone 0.2.1, 0.2.0, 0.1.1, 0.1.0 (0.2.0's wheel requires torch 1.12;
# from 1.13 functorch is in torch's wheel). So drop ``functorch`` from requirements, pin ``torch``.
# A child beside us imports an old functorch: first on the path (``pip install --user``,
# ``PYTHONPATH``) without its ``_C``; in torch's folder, torch upgraded over it; after ``pip
# uninstall functorch``; after torch is reinstalled (in a copy of our site, linked).
assert not "2.0" <= torch.__version__ < "2.1"  # functorch 2.0.0 would replace it
site, folder = Path(torch.__file__).parents[1], Path(tempfile.mkdtemp())
subs = "", "_src/", "compile/", "experimental/"  # 0.2.0's files that torch 2.13 has too
shared = [f"functorch/{sub}__init__.py" for sub in subs]
for where in ("user", "site"):  # functorch 0.2.0's metadata; its RECORD: those files
    info = folder / where / "functorch-0.2.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Name: functorch\nVersion: 0.2.0\n")
    (info / "RECORD").write_text("".join(f"{file},,\n" for file in shared))
for entry in site.iterdir():  # all linked but functorch, a real folder the child edits
    if entry.name != "functorch":
        (folder / "site" / entry.name).symlink_to(entry)
shutil.copytree(site / "functorch", folder / "site/functorch")
(folder / "user/functorch").mkdir()
(folder / "user/functorch/__init__.py").write_text("import torch\nfrom . import _C\n")
STALE = """
import importlib.util, importlib.metadata as md, json, os, shutil, sys
site, folder = sys.argv[1:]; states = []
def state():  # import functorch afresh, twice, then the test above
    importlib.invalidate_caches(); said = []
    for line in ("from functorch import grad", "from functorch.compile import aot_function"):
        [sys.modules.pop(name) for name in list(sys.modules) if name[:9] == "functorch"]
        try: exec(line); said.append("")
        except ImportError as err: said.append(str(err))
    files = [f for f in md.files("torch") if f.parts[0] == "functorch"]
    lost = sorted(str(f) for f in files if not f.locate().exists())
    states.append([sorted(md.packages_distributions()["functorch"]), lost, said]); return states
sys.path.insert(0, folder + "/user"); state()
sys.path[:] = [folder + "/site" if path == site else path for path in sys.path[1:]]
old = state() and md.distribution("functorch")
for file in old.files:  # pip uninstall: its RECORD's files, their .pyc, a folder left empty
    path = file.locate(); path.unlink(); os.remove(importlib.util.cache_from_source(path))
    if not any(f.is_file() for f in path.parent.rglob("*")): shutil.rmtree(path.parent)
shutil.rmtree(old.locate_file("functorch-0.2.0.dist-info")); state()
# pip install --force-reinstall torch: its files back
shutil.copytree(f"{site}/functorch", f"{folder}/site/functorch", dirs_exist_ok=True)
print(json.dumps(state()))
"""
child = Popen([sys.executable, "-c", STALE, str(site), str(folder)], stdout=PIPE)

# %%
# _autograd_grad with lost grad_fn linkage: torch.compile of a vjp_fn alone
# -------------------------------------------------------------------------
# A ``torch._dynamo.exc.Unsupported`` from ``torch.compile(vjp_fn, fullgraph=True)``, where
# ``vjp_fn`` comes from :func:`~torch.func.vjp` outside the compiled code. pytorch#172386
# reported all-zero gradients there, silently; 2.13 raises this in a fresh process (once one
# ``vjp_fn`` ran compiled without ``fullgraph``, later ones run eager, raising nothing, until
# ``torch.compiler.reset()``: checked apart), and without ``fullgraph`` breaks the graph
# (counted), running the eager ``vjp_fn``, right. The fix, as dynamo's hint says: compile a
# function that calls both. Reference: ``Wᵀ((1 − tanh²(Wz)) ⊙ v)``. (``aot_eager``: no codegen.)
W, z, v = torch.randn(3, 4, **f64), torch.randn(4, **f64), torch.randn(3, **f64)
field = lambda point: torch.tanh(W @ point)  # noqa: E731
pull = W.T @ ((1 - field(z) ** 2) * v)
_, vjp_fn = vjp(field, z)
whole = torch.compile(vjp_fn, backend="aot_eager", fullgraph=True)
expect(Unsupported, lambda: whole(v), "lost grad_fn linkage", "silently produces zero")
breaks = counters["graph_break"].total()
with_break = torch.compile(vjp_fn, backend="aot_eager")(v)
close("vjp_fn alone, graph break", with_break, [pull], 1e-15)
assert counters["graph_break"].total() == breaks + 1


@torch.compile(backend="aot_eager", fullgraph=True)  # a graph break would raise
def pulled_back(point, cotangent):
    _, pullback = vjp(field, point)
    return pullback(cotangent)[0]


compiled_before = counters["stats"]["unique_graphs"]
close("vjp and vjp_fn compiled together", pulled_back(z, v), pull, 1e-15)
assert counters["stats"]["unique_graphs"] == compiled_before + 1

# %%
# cannot import name ... from 'functorch': old functorch files, moved names
# -------------------------------------------------------------------------
# An ``ImportError`` from ``import functorch`` or ``from functorch import ...``. An old functorch
# beside torch 2.13 gives, in the child (printed): first on the path, without its compiled ``_C``,
# "cannot import name '_C' from partially initialized module 'functorch'" (its ``__init__.py``
# imports torch, then ``_C``; a real ``_C`` built for another torch gives "undefined symbol",
# functorch#979), naming the stand-in's folder here, site-packages in pytorch#100571. In torch's
# folder, torch upgraded over it, it imports, with two owners; ``pip uninstall functorch`` then
# deletes the files both wheels list (0.2.0's wheel read), the ``__init__.py`` of ``functorch``,
# ``_src``, ``compile``, ``experimental``: "(unknown location)" for ``functorch``, a namespace
# package now, and "No module named 'functorch.compile'". The first section's test fails in all
# three. The fix: ``pip uninstall functorch``, then reinstall the same torch build from its index
# (replayed here): ``pip install --force-reinstall --no-deps torch==<version> --index-url <index>``,
# for ``+cpu`` https://download.pytorch.org/whl/cpu (PyTorch's install selector). Checked with pip
# on 2026-11-26, not run by this page: PyPI has no ``+cpu`` build of 2.13.0; its ``torch==2.13.0``
# is, on Linux, the CUDA build. Names gone in 2.13 raise it too (asserted): use ``torch.func.vmap``,
# ``torch.func.linearize``, ``functorch.compile.aot_function``; ``clear_compile_cache`` is gone.
said = child.communicate(timeout=120)[0]
shutil.rmtree(folder)  # removes the links, not what they point to
assert child.returncode == 0, said
steps = dict(zip(("on path", "beside", "uninstalled", "reinstalled"), json.loads(said)))
for step, (owned, lost, said) in steps.items():  # lost: .py files (their .pyc unlisted)
    said = " / ".join(dict.fromkeys(s or "imports" for s in said))  # grad / compile
    print(f"  {step}: {owned}, lost {[n for n in lost if n[-3:] == '.py']}: {said}")
owned, lost, errors = zip(*steps.values())
assert owned == (["functorch", "torch"],) * 2 + (["torch"],) * 2, owned
assert lost == ([], [], sorted(shared + [*map(cache_from_source, shared)]), []), lost
partial = "cannot import name '_C' from partially initialized module 'functorch'"
assert all(e.startswith(partial) and f"{folder}/user" in e for e in errors[0]), errors
gone = "cannot import name 'grad' from 'functorch' (unknown location)"
no_compile = "No module named 'functorch.compile'"
assert errors[1:] == (["", ""], [gone, no_compile], ["", ""]), errors
for module, name in [("functorch._src.vmap", "vmap"), ("functorch", "linearize"),
                     ("functorch._src.aot_autograd", "aot_function"),
                     ("functorch.compile", "clear_compile_cache")]:  # fmt: skip
    moved = f"cannot import name '{name}' from '{module}'"
    expect(ImportError, lambda m=module, n=name: exec(f"from {m} import {n}"), moved)

# %%
# Cannot insert a Tensor that requires grad as a constant: torch.jit.trace of a transform
# ---------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``torch.jit.trace`` of :func:`~torch.func.jacrev` of a function with a
# vector output; of ``grad`` and ``hessian``, other messages (part 2 has an entry, for NumPy, on
# the ``grad`` one's: :ref:`sphx_glr_auto_examples_guides_plot_troubleshooting_arguments.py`).
# ``jacrev`` of a scalar function traced, and ``vmap(sin)``, each right at new inputs; a ``vmap``
# whose function passes sizes (``reshape`` here) traced with its batch size baked in: another
# size fails. Whether a transform traces depends on the function: do not count on it. TorchScript
# is deprecated (the warning is checked). The fixes: ``torch.compile``; ``make_fx``, a graph of
# ATen operators for these shapes (a captured tensor is its constant, the same object); or export
# of that graph (last entry). On the CPU. Reference: ∇ Σ tanh(Wz)² = Wᵀ(2t(1 − t²)), t = tanh(Wz).
Wc, zc, rows = W.cpu(), z.cpu(), torch.randn(6, 4, dtype=torch.float64)
other, Wo = torch.randn(4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
energy = lambda point, weight: torch.tanh(weight @ point).square().sum()  # noqa: E731
t = torch.tanh(Wo @ other)  # the closed form (above) at (other, Wo)
trace, pair, grad_other = torch.jit.trace, (zc, Wc), Wo.T @ (2 * t * (1 - t * t))
with warnings.catch_warnings(record=True, action="always") as said:
    expect(RuntimeError, lambda: trace(jacrev(torch.sin), zc), "Cannot insert a Tensor")
    expect(RuntimeError, lambda: trace(grad(energy), pair), "Cannot access data")
    expect(RuntimeError, lambda: trace(hessian(energy), pair), "Unsupported value kind")
    swap = trace(vmap(lambda r: r.reshape(2, 2).T.reshape(4)), torch.ones(3, 4))
    scalar_jacobian = trace(jacrev(energy), pair)  # traces: a scalar function
    sines = trace(vmap(torch.sin), rows[:3])
close("trace(jacrev), scalar", scalar_jacobian(other, Wo), grad_other, 1e-15)
close("trace(vmap(sin)), 6 rows", sines(rows), rows.sin(), 1e-15)
expect(RuntimeError, lambda: swap(torch.ones(6, 4)), "shape '[3, 2, 2]' is invalid")
said = [str(w.message) for w in said if w.category is DeprecationWarning]
assert any("torch.compile" in s and "torch.export" in s for s in said), said
compiled = torch.compile(grad(energy), backend="aot_eager", fullgraph=True)
close("torch.compile(grad)", compiled(other, Wo), grad_other, 1e-15)
graph = make_fx(grad(energy))(zc, Wc)
close("make_fx(grad), new inputs", graph(other, Wo), grad_other, 1e-15)
assert make_fx(grad(lambda p: energy(p, Wc)))(zc)._tensor_constant0 is Wc

# %%
# dimension row is unbound: functorch.dim's first-class dimensions
# ----------------------------------------------------------------
# A ``ValueError`` from reading a dimension's size before anything gives it one.
# ``functorch.dim`` (torchdim) still imports in 2.13, ported to Python (pytorch PR #160236);
# ``functorch._C``, its C++ core, is gone. ``dims()`` names its dimensions after the variables,
# and indexing a tensor with them binds their sizes. The fix: index first, or
# ``dims(sizes=[...])``. Reference: ``A @ B``.
A, B = torch.randn(3, 4, **f64), torch.randn(4, 5, **f64)
row, inner, col = dims(3)
expect(ValueError, lambda: row.size, "dimension row is unbound")
product = (A[row, inner] * B[inner, col]).sum(inner)  # binds 3, 4 and 5
print(f"  then {row!r}={row.size}, {inner!r}={inner.size}, {col!r}={col.size}")
close("dims: a matrix product", product.order(row, col), A @ B, 1e-15)
assert dims(sizes=[3]).size == 3  # bound before any indexing

# %%
# No module named 'functorch._C'
# ------------------------------
# A ``ModuleNotFoundError`` from ``import functorch._C``: 2.13 has none. functorch's README gave
# ``functorch._C._set_vmap_fallback_warning_enabled(False)`` to silence the warning ``vmap``
# prints for an operator without a batching rule (``torch.take`` here). The fixes: a warnings
# filter on its message, or that switch, private, in ``torch._C._functorch``. Reference: a loop.
expect(ModuleNotFoundError, lambda: import_module("functorch._C"), "No module named")
picks, table = torch.tensor([0, 2], device=device), torch.randn(5, 4, **f64)
switch = torch._C._functorch._set_vmap_fallback_warning_enabled  # private
drop = "performance drop"
for fix in ("none", "filter", "switch"):
    with warnings.catch_warnings(record=True, action="always") as said:
        warnings.filterwarnings("ignore" if fix == "filter" else "always", f".*{drop}")
        switch(fix != "switch")
        taken = vmap(lambda r: torch.take(r, picks))(table)
    switch(True)
    drops = sum(drop in str(w.message) for w in said)
    print(f"  fix {fix}: {drops} fallback warning(s)")
    assert (drops == 0) == (fix != "none"), [str(w.message) for w in said]
close("vmap(take), silenced", taken, torch.stack([r[picks] for r in table]), 0)

# %%
# Please convert all Tensors to FakeTensors first: functorch.compile
# ------------------------------------------------------------------
# An ``AssertionError`` from ``functorch.compile.aot_function`` (and ``memory_efficient_fusion``
# and ``nnc_jit``, built on it) of a function that uses a tensor it does not take as an argument:
# AOTAutograd traces with fake tensors and meets a real one. All these names still import, and
# run on tensors passed as arguments; those built on TorchScript warn that it is deprecated.
# ``aot_module`` lifts a module's parameters to inputs (printed). The fix, :func:`torch.compile`,
# lifts a captured tensor too (printed by a backend that records its graph's inputs). Reference:
# eager autograd. On the CPU (TorchScript).
Wp, xs = Wc.clone().requires_grad_(), torch.randn(2, 4, dtype=torch.float64)
captured = lambda x: torch.tanh(x @ Wp.T).sum()  # noqa: E731
passed = lambda x, weight: torch.tanh(x @ weight.T).sum()  # noqa: E731
reference = torch.autograd.grad(passed(xs, Wp), Wp)
aot, fake = old_compile.aot_function, "Please convert all Tensors to FakeTensors first"
for name, wrap in {
    "aot_function(nop)": lambda fn: aot(fn, old_compile.nop),
    "memory_efficient_fusion": old_compile.memory_efficient_fusion,
    "nnc_jit": old_compile.nnc_jit,
}.items():
    expect(AssertionError, lambda w=wrap: w(captured)(xs), fake)
    with warnings.catch_warnings(record=True, action="always") as said:
        slope = torch.autograd.grad(wrap(passed)(xs, Wp), Wp)
    jit = sum("`torch.jit" in str(w.message) for w in said)
    assert (jit > 0) == ("nop" not in name), name
    close(f"{name}, {jit} TorchScript warnings", slope, reference, 1e-15)
inputs_of = []


def recording(gm, example_inputs):  # a backend: note the graph's inputs, run it as is
    inputs_of.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
    return gm


layer = nn.Linear(4, 3).to(torch.float64)
old_compile.aot_module(layer, old_compile.make_boxed_compiler(recording))(xs)
print(f"  aot_module's graph inputs (weight, bias, x): {inputs_of[0]}")
output = torch.compile(captured, backend=recording, fullgraph=True)(xs)
print(f"  torch.compile's graph inputs (the captured weight, x): {inputs_of[-1]}")
assert len(inputs_of[0]) == 3 and len(inputs_of[-1]) == 2
close("torch.compile, captured", torch.autograd.grad(output, Wp), reference, 1e-15)

# %%
# vmap: It looks like you're calling .item() ..., in non-strict torch.export: indexing in vmap
# --------------------------------------------------------------------------------------------
# A ``RuntimeError`` from ``torch.export.export``, non-strict (2.13's default), of a module whose
# ``forward`` builds an attention mask with nested ``torch.vmap``, one per index (as Hugging
# Face's ``masking_utils`` does for custom mask functions), when the rule indexes a tensor with a
# mapped index (``keep[b, k]``). Eager code runs it. Non-strict export rewrites ``t[i]``, ``i`` a
# 0-d integer tensor, into ``select(t, 0, i.item())`` (2.13's ``torch/_export/non_strict_utils.py``)
# and ``i`` is batched. The fixes, both exported with dynamic lengths: ``strict=True`` (dynamo
# traces ``forward``; no code to change, so it suits a library's mask), or index outside the
# rule, broadcasting the padding. Reference: ``tril`` bands and the padding, broadcast.


class Masked(nn.Module):
    def __init__(self, rule, pad_outside):
        super().__init__()
        self.rule, self.pad_outside = rule, pad_outside

    def forward(self, scores, keep):
        b, t = (torch.arange(n, device=keep.device) for n in keep.shape)
        rule = self.rule  # vmap over b, q, k: a (B, T, T) grid of rule(b, q, k)
        for mapped in [(None, None, 0), (None, 0, None), (0, None, None)]:
            rule = vmap(rule, in_dims=(*mapped, None))
        allowed = rule(b, t, t, keep)
        if self.pad_outside:
            allowed = allowed & keep[:, None, :]
        return scores.masked_fill(~allowed, float("-inf"))


def banded(scores, keep):  # the reference: no vmap, no index
    ones = torch.ones(scores.shape[-2:], dtype=torch.bool)
    band = ones.tril() & ~ones.tril(-BAND)
    return scores.masked_fill(~(band & keep[:, None, :]), float("-inf"))


BAND = 3
in_rule = Masked(lambda b, q, k, keep: (k <= q) & (q - k < BAND) & keep[b, k], False)
outside = Masked(lambda b, q, k, keep: (k <= q) & (q - k < BAND), True)
scores, keep = torch.randn(2, 5, 5), torch.rand(2, 5) > 0.3
assert torch.equal(in_rule(scores, keep), banded(scores, keep))  # eager: right
export = torch.export.export
expect(RuntimeError, lambda: export(in_rule, (scores, keep)), "calling .item() on a")
length = torch.export.Dim("length", min=2, max=64)
shapes = {"scores": {1: length, 2: length}, "keep": {1: length}}
longer, keep7 = torch.randn(2, 7, 7), torch.rand(2, 7) > 0.3  # another length
fixes = {"strict=True": (in_rule, True), "index outside": (outside, False)}
for fix, (model, strict) in fixes.items():
    program = export(model, (scores, keep), dynamic_shapes=shapes, strict=strict)
    assert torch.equal(program.module()(longer, keep7), banded(longer, keep7)), fix
    print(f"  {fix}: exported, and equal to the reference at length 7")
    checked[f"export, {fix}, length 7 (equal)"] = (0.0, 0.0)  # torch.equal passed

# %%
# (No error) torch.export of a module that calls grad returns FakeTensors
# -----------------------------------------------------------------------
# ``torch.export.export`` of a ``forward`` that calls :func:`~torch.func.grad` (or ``vjp``)
# succeeds, and is wrong in 2.13: no node uses the inputs (what was traced from the example
# inputs became constants) and the program returns a ``FakeTensor``, a tensor without values.
# One sign: ``UserWarning``\ s that a lifted tensor requiring grad is made a constant.
# The fix: ``make_fx`` the transform, then export that graph of ATen operators.


class Forces(nn.Module):
    def forward(self, point, weight):
        return grad(energy)(point, weight)


with warnings.catch_warnings(record=True, action="always") as said:
    broken = export(Forces(), (zc, Wc))
    returned = broken.module()(other, Wo)
said = [str(w.message) for w in said if w.category is UserWarning]
print(f"  {len(said)} warnings: {textwrap.shorten(said[0], 90)}")
assert said and all("treat it as a constant tensor" in s for s in said), said
unused = [n.name for n in broken.graph.nodes if n.op == "placeholder" and not n.users]
print(f"  unused inputs: {unused}; {len(broken.constants)} constants; returns a "
      f"{type(returned).__name__}")  # fmt: skip
assert unused == ["point", "weight"] and type(returned).__name__ == "FakeTensor"
fixed = export(make_fx(grad(energy))(zc, Wc), (zc, Wc))
close("export(make_fx(grad))", fixed.module()(other, Wo), grad_other, 1e-15)

# %%
# Every fix against its reference
# -------------------------------
# Each check's relative error (dot; an exact match is drawn at 1e-18) and its bound (bar).
errors, bounds = ([max(x, 1e-18) for x in column] for column in zip(*checked.values()))
fig, ax = plt.subplots(figsize=(7.5, 6.5), layout="constrained")
ax.hlines(list(checked), 1e-19, bounds, color="0.75", linewidth=6)
ax.plot(errors, list(checked), "o", color="black")
ax.set(xscale="log", xlim=(1e-19, 1e-12), xlabel="largest error / largest true entry")
ax.set_title(f"{len(checked)} checks on {device.type}: error (dot) within bound (bar)")
ax.invert_yaxis()
plt.show()

# %%
# What to remember
# ----------------
# * ``torch.func`` and ``functorch`` come in the ``torch`` wheel; ``pip install functorch`` now
#   fetches 2.0.0, pinned to torch 2.0. Test: ``packages_distributions()["functorch"] ==
#   ["torch"]`` and torch's ``functorch`` files all on disk.
# * ``pip uninstall functorch`` deletes four of torch's ``functorch`` files (``functorch.compile``
#   goes): reinstall the same torch build after, from the index it came from.
# * Compile ``vjp`` with its ``vjp_fn``, not the ``vjp_fn`` alone. ``functorch.compile``'s
#   ``aot_function`` refuses captured tensors; ``torch.compile`` takes them.
# * ``torch.jit.trace`` of a transform may fail, or bake in sizes: do not rely on it. Export a
#   ``vmap`` that indexes with a mapped index with ``strict=True`` (or index outside the rule);
#   ``export`` of ``grad`` returns a ``FakeTensor`` without raising: export ``make_fx(grad(f))``.
