"""The API page: each ``torch.func`` function that the examples use, with its mini-gallery.

The ``torch-func-api`` directive goes through ``torch.func.__all__`` and keeps the functions
that at least one example calls, as sphinx-gallery's backreferences record. For each it writes
a heading, the first line of its docstring, a link to PyTorch's reference and a
``minigallery`` of the examples that use it. The page grows by itself as examples are added.
"""

import inspect
import re
from pathlib import Path

import torch
import torch.func
from docutils.parsers.rst import Directive


def full_names(name):
    """The names an example's use of torch.func.<name> is recorded under.

    Some functions are also exported from torch itself (torch.func.vmap is torch.vmap), and
    sphinx-gallery records them under that shorter name.
    """
    names = [f"torch.func.{name}"]
    if getattr(torch, name, None) is getattr(torch.func, name):
        names.append(f"torch.{name}")
    return names


def used_functions(backreferences_dir):
    """{name: the full names that examples use it by}, for the torch.func functions in use."""

    def recorded(full):
        record = Path(backreferences_dir) / f"{full}.examples"
        return record.is_file() and bool(record.read_text(encoding="utf-8").strip())

    used = {}
    for name in sorted(torch.func.__all__):
        records = [full for full in full_names(name) if recorded(full)]
        if records:
            used[name] = records
    return used


# Our one-line descriptions; a function without one shows its docstring's first sentence.
DESCRIPTIONS = {
    "functional_call": "Run a module with the parameters and buffers you pass instead of its "
    "own, which turns a module into a pure function of its weights.",
    "functionalize": "Rewrite a function's in-place operations as out-of-place ones, with "
    "the same result.",
    "grad": "The gradient of a scalar function, as a new function of the same arguments.",
    "grad_and_value": "Like grad, but also returns the function's value, from the same "
    "forward pass.",
    "hessian": "The Hessian of a function, computed as forward mode over reverse mode.",
    "jacfwd": "The Jacobian in forward mode: one Jacobian-vector product per input.",
    "jacrev": "The Jacobian in reverse mode: one vector-Jacobian product per output.",
    "jvp": "The function's value and its Jacobian times a tangent vector, in forward mode.",
    "linearize": "The function's value and a function that applies its Jacobian at that "
    "point to any tangent, without re-running the forward pass.",
    "rearrange": "Reorder, merge and split a tensor's dimensions with an einops-style "
    "pattern.",
    "replace_all_batch_norm_modules_": "Stop every batch-norm layer of a module from "
    "tracking running statistics, in place, so that it runs under vmap.",
    "stack_module_state": "Stack the parameters and buffers of several models of one "
    "architecture, for running them together under vmap.",
    "vjp": "The function's value and a function that multiplies vectors by its Jacobian "
    "from the left.",
    "vmap": "Vectorise a function written for one sample so that it runs on a whole batch.",
}


def summary(name):
    """Our description, else the docstring's first sentence, cross-references as code."""
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    doc = inspect.getdoc(getattr(torch.func, name)) or ""
    paragraph = doc.strip().split("\n\n")[0].replace("\n", " ")
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    return re.sub(r":[\w:]+:`~?([^`<]+?)(?: <[^>]+>)?`", r"``\1``", sentence)


class TorchFuncApi(Directive):
    has_content = False

    def run(self):
        env = self.state.document.settings.env
        conf = env.config.sphinx_gallery_conf
        backreferences = Path(env.srcdir) / conf["backreferences_dir"]
        used = used_functions(backreferences)
        if not used:
            raise self.error("no example uses any torch.func function: nothing to list")
        lines = []
        for name, records in used.items():
            lines += [
                f"``{name}``",
                "-" * (len(name) + 4),
                "",
                f":func:`{records[-1]}`: {summary(name)}",
                "",
                f".. minigallery:: {' '.join(records)}",
                "",
            ]
        self.state_machine.insert_input(lines, source="torch-func-api")
        return []


def setup(app):
    app.add_directive("torch-func-api", TorchFuncApi)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
