"""Assemble the gallery from the shards' outputs, for `make merge FROM=folder`.

FROM holds one folder per shard, each a copy of that shard's docs/auto_examples after
`make html SHARD=i/N`. An example belongs to the shard that executed it: sphinx-gallery writes
an example's `.py.md5` only when it ran and passed. For each example this copies that shard's
page source, downloads, MD5, cached time and names, and figures into docs/auto_examples. The
Sphinx build that follows then skips every example by its MD5 and so executes none.

It fails, naming the examples, when no shard ran an example (its shard failed, or its output
was not downloaded into FROM) or when two did (build each shard from a clean checkout).
"""

import argparse
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GALLERY = REPO / "docs" / "auto_examples"


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def example_files(gallery, section, stem):
    """The files sphinx-gallery wrote for one example: page, downloads, caches, figures."""
    own = sorted((gallery / section).glob(f"{stem}.*"))
    figure = re.compile(rf"sphx_glr_{re.escape(stem)}_(\d{{3}}|thumb)[_.]")
    images = gallery / section / "images"
    figures = sorted(p for p in images.rglob("*.png") if figure.match(p.name))
    return own + figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="folder with one folder per shard")
    parser.add_argument("--gallery", type=Path, default=GALLERY)
    parser.add_argument("--examples", type=Path, default=REPO / "examples")
    args = parser.parse_args()

    source, gallery = args.source.resolve(), args.gallery.resolve()
    if source == gallery or gallery in source.parents or source in gallery.parents:
        fail(f"FROM='{args.source}' overlaps {gallery}, which the merge replaces")
    if list(args.source.glob("*/plot_*.py.md5")):
        fail(
            f"'{args.source}' holds one gallery, not one folder per shard: put each shard's "
            f"docs/auto_examples in a folder of its own, e.g. {args.source}/shard-1"
        )
    shards = (
        sorted(p for p in args.source.glob("*") if p.is_dir())
        if args.source.is_dir()
        else []
    )
    if not shards:
        fail(
            f"no shard outputs in '{args.source}': it should hold one folder per shard, "
            "each a copy of docs/auto_examples from `make html SHARD=i/N`"
        )
    sources = sorted(args.examples.glob("*/plot_*.py"))
    owners = {
        source: [
            s
            for s in shards
            if (s / source.parent.name / f"{source.name}.md5").is_file()
        ]
        for source in sources
    }
    missing = [source for source, found in owners.items() if not found]
    twice = {source: found for source, found in owners.items() if len(found) > 1}
    problems = [
        f"no shard in '{args.source}' ran examples/{s.parent.name}/{s.name} "
        "(its shard failed, or its output was not downloaded)"
        for s in missing
    ] + [
        f"examples/{s.parent.name}/{s.name} was run by more than one shard: "
        + ", ".join(p.name for p in found)
        + " (build each shard from a clean checkout)"
        for s, found in twice.items()
    ]
    if problems:
        fail("cannot merge the shards:\n  " + "\n  ".join(problems))

    shutil.rmtree(args.gallery, ignore_errors=True)
    counts = {shard.name: 0 for shard in shards}
    for source, (shard,) in owners.items():
        for path in example_files(shard, source.parent.name, source.stem):
            target = args.gallery / path.relative_to(shard)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        counts[shard.name] += 1
    print(
        f"merged {len(sources)} examples from {len(shards)} shards: "
        + ", ".join(f"{name} ({count})" for name, count in counts.items())
    )


if __name__ == "__main__":
    main()
