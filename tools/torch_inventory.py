"""Write an intersphinx inventory of PyTorch's public API, from the installed torch, offline.

`make inventory` runs this. The site's build never fetches anything, so instead of
downloading PyTorch's objects.inv, this script lists the public names of the modules the
examples draw on, with the URLs that PyTorch's documentation gives them, and writes them with
sphobjinv to docs/_inventories/torch.inv. Run it again after changing the torch pin.

PyTorch's URL scheme: most functions and classes have a page of their own under generated/,
named after the object; a few modules document everything on one page, with the full name as
the anchor.
"""

import argparse
import inspect
import sys
from pathlib import Path

import sphobjinv as soi
import torch

REPO = Path(__file__).resolve().parent.parent

# Modules whose members each have a page under generated/, and the page of the module itself.
GENERATED = {
    "torch": "torch.html",
    "torch.func": "func.api.html",
    "torch.nn": "nn.html",
    "torch.nn.functional": "nn.functional.html",
    "torch.linalg": "linalg.html",
    "torch.autograd": "autograd.html",
    "torch.autograd.functional": "autograd.html",
    "torch.cuda": "cuda.html",
    "torch.backends": "backends.html",
    "torch.profiler": "profiler.html",
}
# Modules documented on a single page: module page, and members anchored by full name.
SINGLE_PAGE = {
    "torch.testing": "testing.html",
    "torch.utils.benchmark": "benchmark_utils.html",
}


def public_members(module_name):
    """(name, kind) for the public functions and classes a module exports."""
    module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
    names = getattr(module, "__all__", None) or [
        n for n in dir(module) if not n.startswith("_")
    ]
    for name in sorted(set(names)):
        obj = getattr(module, name, None)
        if inspect.isclass(obj):
            yield name, "class"
        elif callable(obj):
            yield name, "function"


def tensor_methods():
    for name in sorted(dir(torch.Tensor)):
        if not name.startswith("_") and callable(getattr(torch.Tensor, name, None)):
            yield name


def build_inventory():
    inventory = soi.Inventory()
    inventory.project = "PyTorch"
    inventory.version = torch.__version__.split("+")[0]

    def add(name, role, uri):
        inventory.objects.append(
            soi.DataObjStr(
                name=name, domain="py", role=role, priority="1", uri=uri, dispname="-"
            )
        )

    for module, page in GENERATED.items():
        add(module, "module", f"{page}#module-{module}")
        for name, kind in public_members(module):
            full = f"{module}.{name}"
            add(full, kind, f"generated/{full}.html#{full}")
    for module, page in SINGLE_PAGE.items():
        add(module, "module", f"{page}#module-{module}")
        for name, kind in public_members(module):
            full = f"{module}.{name}"
            add(full, kind, f"{page}#{full}")
    add("torch.Tensor", "class", "tensors.html#torch.Tensor")
    for name in tensor_methods():
        full = f"torch.Tensor.{name}"
        add(full, "method", f"generated/{full}.html#{full}")
    return inventory


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", type=Path, default=REPO / "docs" / "_inventories" / "torch.inv"
    )
    args = parser.parse_args()
    inventory = build_inventory()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    text = inventory.data_file(contract=True)
    soi.writebytes(args.output, soi.compress(text))
    print(
        f"wrote {len(inventory.objects)} names from torch {torch.__version__} "
        f"to {args.output.relative_to(REPO)}"
    )


if __name__ == "__main__":
    main()
