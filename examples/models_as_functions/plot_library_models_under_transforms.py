"""
Models from libraries under the transforms: graph layers, ODE solvers, pruned modules
=====================================================================================

Library code meets :func:`~torch.func.vmap`, :func:`~torch.func.jacfwd` and
:func:`~torch.func.functional_call` in ways its authors did not plan for. Plain-torch stand-ins
(the libraries are not installed here) copy what matters of PyTorch Geometric's graph layers,
torchdiffeq's ``odeint``, pruned and parametrized layers: what runs, what fails, why, and fixes.
"""

# %%
# Setup
# -----
import copy
import functools
import textwrap
import warnings

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, grad, jacfwd, jacrev, stack_module_state, vmap
from torch.nn.utils import prune
from torch.nn.utils.parametrizations import weight_norm

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
METHOD_COLORS = {"vmap": "#009E73", "loop": "#D55E00"}


def verify(label, got, want, bound):
    """Relative error of a pair, or of each pair of two lists, in float64, asserted below bound."""
    pairs = zip(got, want) if isinstance(got, list) else [(got, want)]
    errors = [(torch.linalg.vector_norm(a.double().cpu() - b.double().cpu())
               / torch.linalg.vector_norm(b.double().cpu())).item() for a, b in pairs]  # fmt: skip
    worst = max(errors)
    room = "all exact" if worst == 0 else f"{bound / worst:.0f}x below"
    print(f"{label}: worst of {len(errors)}: {worst:.1e} (bound {bound:.0e}, {room})")
    assert worst < bound, f"{label}: error {worst:.2e} over {bound:.0e}"


# %%
# A graph convolution: ``jacrev`` and ``jacfwd`` on one graph
# -----------------------------------------------------------
# The stand-in follows PyTorch Geometric's (PyG's) ``GCNConv`` where it matters: a boolean mask
# drops the graph's self loops and one per node is added (``add_remaining_self_loops``); each
# node's degree ``d`` sums the edge weights, ``ones(E)`` by default, by target (``gcn_norm``);
# the messages ``x_j W / √(d_i d_j)`` are summed by target; ``tanh`` follows. Both sums are PyG's
# ``scatter`` as written there: ``src.new_zeros(size).scatter_add_(0, index, src)``.
NODES, FEATURES, GRAPHS = 6, 4, 5
edges = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 2], [1, 2, 3, 4, 5, 0, 3, 5]]).to(device)
mixing = torch.randn(FEATURES, FEATURES, device=device) / 2
nodes = torch.randn(NODES, FEATURES, device=device)


def scatter_sum(src, index, size):  # PyG's scatter(..., reduce="sum") along dim 0
    index = index.view(-1, *[1] * (src.dim() - 1)).expand_as(src)
    return src.new_zeros(size, *src.shape[1:]).scatter_add_(0, index, src)


def gcn_layer(x, edge_index, weight, edge_weight=None, self_loops=True, normalize=True):
    n = x.shape[0]
    if self_loops:
        keep = edge_index[0] != edge_index[1]
        loops = torch.arange(n, device=x.device).repeat(2, 1)
        edge_index = torch.cat([edge_index[:, keep], loops], dim=1)
    source, target = edge_index
    messages = (x @ weight)[source]
    if normalize:
        if edge_weight is None:
            edge_weight = torch.ones(edge_index.shape[1], device=x.device)
        degree = scatter_sum(edge_weight, target, n)
        scale = degree.pow(-0.5).masked_fill(degree == 0, 0)
        messages = (scale[source] * edge_weight * scale[target])[:, None] * messages
    return torch.tanh(scatter_sum(messages, target, n))


by_jacrev = jacrev(gcn_layer)(nodes, edges, mixing)  # as for any function
by_jacfwd = jacfwd(gcn_layer)(nodes, edges, mixing)


# %%
# The reference, a closed form: ``Â[i, j]`` counts the edges ``j → i`` (by a Python loop), self
# loops replaced by one per node; ``P = D^-½ Â D^-½``, ``D`` its row sums; the layer is
# ``tanh(P X W)``, so ``∂out[i, a] / ∂x[j, b] = (1 − out[i, a]²) P[i, j] W[b, a]``; a plain sum
# has ``P = Â``, every edge counted. (pyg-team/pytorch_geometric#7564 saw ``jacfwd`` fail on a
# ``MessagePassing`` layer in 2023; its script runs with PyG 2.8.1 and torch 2.13, checked.)
def closed_form(x, edge_index, weight, gcn=True):  # output, Jacobian; float64, CPU
    adjacency = torch.eye(len(x), dtype=torch.float64) * gcn
    for j, i in edge_index.T.tolist():
        adjacency[i, j] += i != j or not gcn  # GCN: own loops give way to added ones
    scale = adjacency.sum(1).rsqrt() if gcn else adjacency.new_ones(len(x))
    hop, weight = scale[:, None] * adjacency * scale, weight.double().cpu()
    out = torch.tanh(hop @ x.double().cpu() @ weight)
    return out, torch.einsum("ia,ij,ba->iajb", 1 - out**2, hop, weight)


exact = closed_form(nodes, edges, mixing)[1]
verify("jacrev, jacfwd on one graph", [by_jacrev, by_jacfwd], [exact, exact], 1e-6)

# %%
# Many graphs, one ``edge_index``: ``vmap`` works
# -----------------------------------------------
# Graphs that share their edges (one mesh, many fields on it) map with ``in_dims=None`` for the
# ``edge_index``: messages carry the batch, so ``src.new_zeros`` makes a batched buffer; degrees,
# from ``ones(E)`` and an unbatched index, are one tensor for all. So pytorch/functorch#1113's
# ``vmap(jacrev(gcn))(x, edge_index)``, whose default ``in_dims=0`` maps the ``edge_index`` too (a
# ``ValueError``), runs with ``in_dims=(0, None)`` in ``eval()`` mode (its dropout needs
# ``randomness=`` in training; checked with PyG, not here):
batch = torch.randn(GRAPHS, NODES, FEATURES, device=device)
wanted = [closed_form(x, edges, mixing) for x in batch]
for k, fn in enumerate([gcn_layer, jacfwd(gcn_layer), jacrev(gcn_layer)]):
    got = vmap(fn, in_dims=(0, None, None))(batch, edges, mixing)
    label = ["outputs", "vmap(jacfwd)", "vmap(jacrev)"][k]
    verify(f"one edge_index, {label}", list(got), [w[min(k, 1)] for w in wanted], 1e-6)


# %%
# Each graph its own edges: what fails, what runs
# -----------------------------------------------
# An ``edge_index`` per graph (``in_dims=0``) batches the index. Plain message passing runs: the
# messages ``(x W)[source]`` carry the batch, so ``new_zeros(...).scatter_add_`` sums each graph
# into its own buffer. Two steps fail: a boolean mask that differs by graph (to drop self loops)
# would give each graph its own edge count, which no batched tensor holds; degrees summed from
# ``ones(E)`` build an unbatched buffer for a batched index. In PyG 2.8.1 (checked on the CPU)
# ``GraphConv``, ``SAGEConv`` (mean; max without torch-scatter), ``GINConv``, ``TransformerConv``
# and ``GATConv(add_self_loops=False)`` run, outputs, ``vmap(jacfwd)`` and ``vmap(jacrev)`` equal to
# a loop's; ``GCNConv``, ``ChebConv`` and ``GATConv`` fail on the mask, ``GCNConv`` without loops on
# ``gcn_norm``'s degrees. The stand-in fails both ways and, as a plain sum (no loops, no degrees),
# runs: checked against the closed form.
def must_fail(kind, words, fn, *args):
    """fn(*args) must raise exactly `kind` with `words` in its message; print the message."""
    try:
        fn(*args)
    except kind as err:
        assert type(err) is kind and words in str(err), f"{type(err).__name__}: {err}"
        said = textwrap.shorten(f"{kind.__name__}: {err}", 330, placeholder=" ...")
        print(textwrap.fill(said, 96, initial_indent="  ", subsequent_indent="    "))
        return
    raise AssertionError(f"no {kind.__name__} saying {words!r}")


own_edges = torch.randint(0, NODES, (GRAPHS, 2, edges.shape[1]), device=device)
for self_loops, words in [(True, "Attempting to batch over indexing with a boolean mask"),
                          (False, "scatter_add_(self, *extra_args) is not possible")]:  # fmt: skip
    layer_fn = functools.partial(gcn_layer, self_loops=self_loops)
    per_graph = vmap(layer_fn, in_dims=(0, 0, None))
    must_fail(RuntimeError, words, per_graph, batch, own_edges, mixing)
plain = functools.partial(gcn_layer, self_loops=False, normalize=False)
wanted = [closed_form(x, e, mixing, gcn=False) for x, e in zip(batch, own_edges)]
for k, (label, fn) in enumerate([("outputs", plain), ("vmap(jacrev)", jacrev(plain))]):
    got = vmap(fn, in_dims=(0, 0, None))(batch, own_edges, mixing)
    verify(f"own edges, plain sum, {label}", list(got), [w[k] for w in wanted], 1e-6)

# %%
# The fixes: batched edge weights, or one big graph
# -------------------------------------------------
# ``GCNConv`` takes ``edge_weight`` and ``add_self_loops=False``: add the loops yourself with a
# fixed shape and pass weights per graph, so every source carries the batch. Own loops weigh zero
# here, as in ``GCNConv`` on unweighted graphs (given an ``edge_weight``, PyG moves a node's own
# loop's weight to its added loop; ``improved=True`` gives the others 2). Or do as PyG's ``Batch``:
# one big graph of disconnected copies (indices offset by ``g · NODES``); as none reaches another,
# one ``jacfwd`` with respect to a shift added to each gives all their Jacobians (one size only).
# ``ChebConv`` (it always removes loops) and ``GATConv`` (no edge weight) need the big graph.
loops = torch.arange(NODES, device=device).repeat(2, 1).expand(GRAPHS, 2, NODES)
edge_weights = torch.cat([(own_edges[:, 0] != own_edges[:, 1]).float(),
                          torch.ones(GRAPHS, NODES, device=device)], dim=1)  # fmt: skip
weighted = (batch, torch.cat([own_edges, loops], dim=2), mixing, edge_weights)
no_mask, dims = functools.partial(gcn_layer, self_loops=False), (0, 0, None, 0)
offsets = torch.arange(GRAPHS, device=device)[:, None, None] * NODES
big_edges = (own_edges + offsets).transpose(0, 1).reshape(2, -1)


def big_graph(shift):  # every graph at once, each moved by the same shift
    out = gcn_layer((batch + shift).reshape(-1, FEATURES), big_edges, mixing)
    return out.view(GRAPHS, NODES, -1)


zero = torch.zeros(NODES, FEATURES, device=device)
wanted = [closed_form(batch[g], own_edges[g], mixing) for g in range(GRAPHS)]
for label, got in [
    ("edge weights, outputs", vmap(no_mask, in_dims=dims)(*weighted)),
    ("edge weights, vmap(jacfwd)", vmap(jacfwd(no_mask), in_dims=dims)(*weighted)),
    ("big graph, outputs", big_graph(zero)),
    ("big graph, jacfwd", jacfwd(big_graph)(zero)),
]:
    want = [w["jacfwd" in label] for w in wanted]
    verify(f"own edges, {label}", list(got), want, 1e-6)

# %%
# An ensemble of neural ODEs: ``vmap`` inside the vector field
# ------------------------------------------------------------
# Stand-ins for torchdiffeq's ``odeint``, by Heun's method: the fixed-step one writes each state
# into a ``torch.empty`` buffer, ``solution[j] = y``, as torchdiffeq's fixed-grid solvers do; the
# adaptive one steps by a Python ``if`` on its error's RMS norm, a tensor, as ``dopri5`` does (it
# raises the same error, first where it picks its initial step). ``vmap`` of either over the
# members' stacked ``Field`` weights fails:
MEMBERS, T_END, RTOL, ATOL = 4, 4.0, 1e-3, 1e-6


class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, t, y):  # a learnt flow plus a slow turn, so the paths curve
        return self.net(y) + 0.5 * torch.stack([-y[..., 1], y[..., 0]], dim=-1)


def heun(f, t, y, h):  # the new state, and its difference from Euler's
    k1 = f(t, y)
    k2 = f(t + h, y + h * k1)
    return y + h / 2 * (k1 + k2), h / 2 * (k2 - k1)


def odeint(func, y0, t):  # fixed steps along the grid t
    solution = torch.empty(len(t), *y0.shape, dtype=y0.dtype, device=y0.device)
    solution[0] = y = y0
    for j in range(1, len(t)):
        y = heun(func, t[j - 1], y, t[j] - t[j - 1])[0]
        solution[j] = y
    return solution


def odeint_adaptive(func, y0, t_end, h=0.1):  # y(t_end), and the times reached
    t, y, reached = 0.0, y0, [0.0]
    while t < t_end:
        h = min(h, t_end - t)
        y_next, error = heun(func, t, y, h)
        scale = ATOL + RTOL * torch.maximum(y.abs(), y_next.abs())
        ratio = (error / scale).pow(2).mean().sqrt()  # one norm over all of y
        if ratio <= 1:
            t, y = t + h, y_next
            reached.append(t)
        h *= min(5.0, max(0.2, 0.9 * ratio.item() ** -0.5))
    return y, reached


torch.manual_seed(7)  # the same fields on any device
fields = [Field().to(device) for _ in range(MEMBERS)]
field_params, _ = stack_module_state(fields)
field_template = copy.deepcopy(fields[0]).to("meta")
start, grid = torch.tensor([1.0, 0.0], device=device), torch.linspace(0, T_END, 81)


def field_call(params, t, y):  # one member's vector field, as a function of its tensors
    return functional_call(field_template, params, (t, y))


for solve, words in [
    (lambda p: odeint(functools.partial(field_call, p), start, grid),
     "inplace arithmetic(self, *extra_args) is not possible"),
    (lambda p: odeint_adaptive(functools.partial(field_call, p), start, T_END)[0],
     "data-dependent control flow"),
]:  # fmt: skip
    must_fail(RuntimeError, words, vmap(solve), field_params)


# %%
# The fixed-step solver writes a batched state into its unbatched buffer; the adaptive one asks
# Python for one branch where each member has its own error. The recipe keeps the solver:
# ``vmap`` only inside the vector field. Stack the members' states as the solver's batch, ``Y`` of
# shape ``(MEMBERS, 2)``, move each row by its own member's field, and solve once; autograd
# reaches the stacked weights. Reference: each member alone, its path and ``∇‖y(T)‖²``:
def ensemble_field(t, states):
    return vmap(field_call, in_dims=(0, None, 0))(field_params, t, states)


starts = start.expand(MEMBERS, 2)
paths = odeint(ensemble_field, starts, grid)  # (81, MEMBERS, 2)
alone = [odeint(field, start, grid) for field in fields]
verify("paths, one solve vs each member alone", list(paths.unbind(1)), alone, 1e-6)
stacked = torch.autograd.grad(paths[-1].pow(2).sum(), list(field_params.values()))
looped = [torch.autograd.grad(path[-1].pow(2).sum(), list(f.parameters()))
          for path, f in zip(alone, fields)]  # fmt: skip
verify("d‖y(T)‖²/d weights, per member and tensor",
       [g[i] for g in stacked for i in range(MEMBERS)],
       [grads[k] for k in range(len(stacked)) for grads in looped], 3e-6)  # fmt: skip

# %%
# With adaptive steps the solver sees one state and one error norm over all of it (torchdiffeq's
# ``_rms_norm`` too): the members share one step size, and the hardest may get fewer steps than
# alone. To hold each to the tolerance, give torchdiffeq ``options={"norm": ...}``, say the largest
# row's RMS. (torchode keeps a norm and a step per row.) References: each member alone on the shared
# steps, and on its own, held to ``RTOL`` as a yardstick only (it bounds steps, not ends):
with torch.inference_mode():
    ends, shared = odeint_adaptive(ensemble_field, starts, T_END)
    shared_grid = torch.tensor(shared, dtype=torch.float64)
    on_shared = [odeint(f, start, shared_grid)[-1] for f in fields]
    own = [odeint_adaptive(f, start, T_END) for f in fields]
print(f"adaptive steps: {len(shared) - 1} shared; alone {[len(o[1]) - 1 for o in own]}")
verify("adaptive, one solve vs alone on the shared steps", list(ends), on_shared, 3e-6)
verify("adaptive, one solve vs alone, own steps", list(ends), [e for e, _ in own], RTOL)

# %%
# The step sizes: shared by the members in one solve (line), each member's own alone (dots).
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
for i, (_, reached) in enumerate(own):
    hide = "_" * i  # a label that starts with "_" stays out of the legend
    ax.plot(reached[1:], torch.tensor(reached).diff(), "o", ms=3,
            color=METHOD_COLORS["loop"], label=hide + "each member alone")  # fmt: skip
ax.plot(shared[1:], torch.tensor(shared).diff(), color=METHOD_COLORS["vmap"],
        label=f"{MEMBERS} members in one solve, vmap in the field")  # fmt: skip
ax.set(xlabel="t at the end of the step", ylabel="step size h", yscale="log",
       title="Adaptive steps: shared by the ensemble, and alone")  # fmt: skip
ax.legend()
plt.show()

# %%
# A module that holds the field and solves in a method (torchode's ``AutoDiffAdjoint``: ``solve``,
# no ``forward``) fails under ``functional_call``, which calls ``forward``. Adding one would not
# help: torchode then fails inside ``vmap`` (an in-place ``index_put_``; a shape mismatch when
# adaptive; checked with the library). The way out is the recipe above: ``vmap`` in the field.
must_fail(NotImplementedError, 'missing the required "forward" function',
          functional_call, nn.ModuleDict({"term": fields[0]}), {}, (start,))  # fmt: skip

# %%
# A pruned layer: the names, the hook, and ``deepcopy``
# -----------------------------------------------------
# ``prune.l1_unstructured`` reparametrizes a layer: the parameter becomes ``weight_orig``, a
# buffer ``weight_mask`` holds the mask, and a forward pre-hook sets ``weight = weight_orig ·
# weight_mask``, a plain attribute. ``functional_call`` given ``weight_orig`` runs the hook (the
# mask applied by hand agrees); a tensor passed as ``"weight"`` the hook overwrites, silently,
# unless ``strict=True`` asks for every name the layer has, and no other:
layer = nn.Linear(8, 3).to(device)
prune.l1_unstructured(layer, "weight", amount=0.5)
assert [n for n, _ in layer.named_parameters()] == ["bias", "weight_orig"]
inputs, targets = torch.randn(16, 8, device=device), torch.randn(16, 3, device=device)
other = torch.randn(3, 8, device=device)
by_hand = inputs @ (other * layer.weight_mask).T + layer.bias
masked = functional_call(layer, {"weight_orig": other}, inputs)
verify("weight_orig passed, the mask applied", masked, by_hand, 1e-6)
assert torch.equal(functional_call(layer, {"weight": other}, inputs), layer(inputs))
strict_call = functools.partial(functional_call, strict=True)
must_fail(RuntimeError, "Unexpected key(s): 'weight'.", strict_call, layer, {"weight": other},
          inputs)  # fmt: skip

# %%
# Pruning computes ``weight`` with grad on, as each forward does: it is no leaf, so
# ``copy.deepcopy`` refuses it, and copying a pruned member into a ``stack_module_state``
# template fails, as functorch's ``make_functional`` did. The deprecated
# ``torch.nn.utils.weight_norm`` (a hook) fails the same way, and ignores a ``"weight"`` too:
must_fail(RuntimeError, "(graph leaves) support the deepcopy", copy.deepcopy, layer)
with warnings.catch_warnings(record=True):  # its FutureWarning, kept off the page
    old = torch.nn.utils.weight_norm(nn.Linear(8, 3).to(device))
must_fail(RuntimeError, "(graph leaves) support the deepcopy", copy.deepcopy, old)
assert torch.equal(functional_call(old, {"weight": other}, inputs), old(inputs))

# %%
# The fix: build the template afresh on the ``"meta"`` device; ``prune.identity`` gives it the
# names and hook (the stacked buffers replace its mask of ones). Built, not copied, it works for
# members pruned already (from a checkpoint). Or ``prune.remove`` first. Against each member:
pruned = [nn.Linear(8, 3).to(device) for _ in range(MEMBERS)]
for member in pruned:
    prune.l1_unstructured(member, "weight", amount=0.5)
pruned_template = prune.identity(nn.Linear(8, 3, device="meta"), "weight")
outs = vmap(functools.partial(functional_call, pruned_template), in_dims=(0, None))(
    stack_module_state(pruned), inputs)  # fmt: skip
verify("pruned, stacked vs alone", list(outs), [m(inputs) for m in pruned], 1e-6)


# %%
# Per-sample gradients of a pruned layer need no copy (``functional_call`` on the layer itself);
# they reach ``weight_orig`` through the mask, zero where it is (vs autograd, per sample). After
# ``prune.remove``, ``weight`` is a plain parameter: it copies, and pruned entries get gradients.
def per_sample_grads(module):
    def loss(weights, x, y):
        return (functional_call(module, weights, x) - y).pow(2).sum()

    weights = {n: p.detach() for n, p in module.named_parameters()}
    return vmap(grad(loss), in_dims=(None, 0, 0))(weights, inputs, targets)


sample_grads = per_sample_grads(layer)["weight_orig"]
one_by_one = [torch.autograd.grad((layer(x) - y).pow(2).sum(), layer.weight_orig)[0]
              for x, y in zip(inputs, targets)]  # fmt: skip
verify("per-sample grads of weight_orig", list(sample_grads), one_by_one, 1e-6)
mask = layer.weight_mask.clone()
assert torch.all(sample_grads[:, mask == 0] == 0), "a pruned entry got a gradient"
prune.remove(layer, "weight")
copy.deepcopy(layer)
freed = per_sample_grads(layer)["weight"][:, mask == 0]
print(f"after prune.remove: {(freed != 0).float().mean():.0%} of these gradients ≠ 0")
assert (freed != 0).any()

# %%
# A parametrized layer: pass the originals, not ``weight``
# --------------------------------------------------------
# ``torch.nn.utils.parametrize`` moves a parameter under ``parametrizations``: with
# ``weight_norm``, ``weight = g · v / ‖v‖`` row by row is a property, and ``g`` and ``v`` are
# ``parametrizations.weight.original0`` and ``original1``. Per-sample gradients with respect to
# them, against float64 autograd on the formula written by hand, sample by sample:
normed = weight_norm(nn.Linear(8, 3)).to(device)
normed.parametrizations.weight.original0.detach().mul_(2)  # as after training: g ≠ ‖v‖
names = [f"parametrizations.weight.original{k}" for k in (0, 1)] + ["bias"]
assert {n for n, _ in normed.named_parameters()} == set(names), "other names"
sample_grads = per_sample_grads(normed)
g, v, b = [normed.get_parameter(n).detach().double().requires_grad_() for n in names]
reference = []
for x, y in zip(inputs.double(), targets.double()):
    loss = (x @ (g * v / v.norm(dim=1, keepdim=True)).T + b - y).pow(2).sum()
    reference += torch.autograd.grad(loss, [g, v, b])
found = [sample_grads[n][i] for i in range(len(inputs)) for n in names]
verify("per-sample d loss/d (g, v, bias) vs float64 formula", found, reference, 3e-6)

# %%
# A tensor passed as ``"weight"`` goes through the property's setter, which writes its preimage
# into ``g`` and ``v`` in place (``right_inverse``), and the old weight's on the way out. Under
# ``grad`` that write raises; outside, the call runs, but ``v`` comes back as the old weight
# (``‖v‖ = g``), not as it was. (Without ``right_inverse``, a parametrization raises.)
must_fail(RuntimeError, "would mutate a captured Tensor",
          grad(lambda w: functional_call(normed, {"weight": w}, inputs).sum()), other)  # fmt: skip
v_before = normed.get_parameter(names[1]).detach().clone()
functional_call(normed, {"weight": other}, inputs)
v_moved = ((normed.get_parameter(names[1]) - v_before).norm() / v_before.norm()).item()
print(f"v moved by {v_moved:.2f} of its norm")
assert v_moved > 0.1, v_moved

# %%
# An ensemble of ``weight_norm`` layers: parametrizing gives each module a class of its own, so
# ``stack_module_state`` refuses them. Stack ``named_parameters()`` by hand; ``vmap`` then warns
# that ``aten::_weight_norm`` has no batching rule and runs a slower fallback. Against each member:
normed_members = [weight_norm(nn.Linear(8, 3)).to(device) for _ in range(MEMBERS)]
assert len({type(m) for m in normed_members}) == MEMBERS, "a class shared"
must_fail(RuntimeError, "Expected all models to be of the same class",
          stack_module_state, normed_members)  # fmt: skip
by_name = {n: torch.stack([m.get_parameter(n).detach() for m in normed_members])
           for n in names}  # fmt: skip
normed_template = copy.deepcopy(normed_members[0]).to("meta")
with warnings.catch_warnings(record=True) as fallback_warnings:
    warnings.filterwarnings("always")
    outs = vmap(functools.partial(functional_call, normed_template), in_dims=(0, None))(
        by_name, inputs)  # fmt: skip
assert any("aten::_weight_norm" in str(w.message) for w in fallback_warnings)
alone_normed = [m(inputs) for m in normed_members]
verify("weight_norm members, stacked by hand vs alone", list(outs), alone_normed, 1e-6)

# %%
# What to remember
# ----------------
# * PyG layers pass ``jacfwd``, ``jacrev`` and ``vmap`` over graphs sharing one ``edge_index``
#   (``in_dims=None``). Per graph, plain message passing runs; a self-loop mask or degrees from an
#   unbatched ``ones(E)`` fail: pass batched edge weights (loops added by hand), or one big graph.
# * Neural-ODE ensembles: put ``vmap`` inside the vector field and solve the stacked states once;
#   an adaptive torchdiffeq solver then gives all members one step size (torchode: one per row).
# * Pruned layers: pass ``weight_orig`` (``"weight"`` is ignored; ``strict=True`` raises); build
#   an ensemble's template on the ``"meta"`` device, then ``prune.identity``.
# * Parametrized layers: pass ``parametrizations.weight.original*``; ``"weight"`` raises under
#   ``grad`` and rewrites the originals outside it. To stack members, stack their parameters.
