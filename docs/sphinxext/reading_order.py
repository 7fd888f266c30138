"""The gallery in reading order, for sphinx-gallery's ``within_subsection_order``.

The index page lists the examples in the order they teach in; the gallery follows it. An
example that the index does not list yet goes last, by name.
"""

import re
from pathlib import Path

INDEX = Path(__file__).resolve().parent.parent / "index.rst"


def listed_examples(index_text):
    """Example names in the order the index page links them."""
    return re.findall(r":doc:`auto_examples/(?:\w+/)*(plot_\w+)`", index_text)


class ReadingOrder:
    """Sort key: an example's position on the index page, then its file name."""

    def __init__(self, src_dir):
        self.order = listed_examples(INDEX.read_text(encoding="utf-8"))

    def __call__(self, filename):
        stem = Path(filename).stem
        rank = self.order.index(stem) if stem in self.order else len(self.order)
        return (rank, filename)

    def __repr__(self):
        # A stable repr, so that Sphinx does not see a changed config at every build.
        return "ReadingOrder"
