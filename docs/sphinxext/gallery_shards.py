"""Which examples a build executes: all, one (``EXAMPLE=``), or one shard of N (``SHARD=i/N``).

The shards are balanced by the examples' recorded run times (``docs/measured/example-times.txt``),
not by count: the longest example goes first to the shard with the least time so far (the
longest-processing-time rule). An example with no recorded time counts as the median of the others.

A merged build (``make merge``) executes nothing: sphinx-gallery skips every example whose MD5
matches the output a shard left, and ``refuse_to_execute``, a ``reset_modules`` hook that runs
only before an example executes, stops the build naming any example it would run.

Run as a script, it prints the plan (``python gallery_shards.py 3``), or checks a SHARD and an
EXAMPLE before a build (``--check 2/3 ""``), so that make reports a wrong one in one line.
"""

import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMES = REPO / "docs" / "measured" / "example-times.txt"


class ShardError(ValueError):
    """A SHARD, EXAMPLE or shard plan that cannot be built."""


def examples(root=REPO):
    """Every example's file name, as the gallery finds them (examples/<section>/plot_*.py)."""
    return sorted(path.name for path in (Path(root) / "examples").glob("*/plot_*.py"))


def read_times(path=TIMES):
    """{example file name: seconds} from the recorded times; lines starting with # are notes."""
    if not Path(path).is_file():
        raise ShardError(
            f"no recorded times at {path}: run a full `make html`, then make record-times"
        )
    times = {}
    for number, line in enumerate(
        Path(path).read_text(encoding="utf-8").splitlines(), 1
    ):
        if line.strip() and not line.startswith("#"):
            match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s+(plot_\w+\.py)\s*", line)
            if not match or float(match[1]) <= 0:
                raise ShardError(
                    f"{path}:{number}: expected 'SECONDS plot_name.py' with SECONDS > 0, "
                    f"got {line!r}: rewrite the file with make record-times"
                )
            times[match[2]] = float(match[1])
    return times


def times_from_execution_page(rst):
    """{example file name: seconds} from sphinx-gallery's sg_execution_times.rst."""
    rows = re.findall(
        r"\(``\.\./examples/(?:\w+/)*(plot_\w+\.py)``\)\s*\n\s*- (\d+):(\d+\.\d+)", rst
    )
    return {name: int(minutes) * 60 + float(sec) for name, minutes, sec in rows}


def parse_shard(text):
    """'2/3' -> (2, 3), or a ShardError that says what a shard looks like."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ShardError(
            f"SHARD={text!r} is not a shard: write SHARD=i/N with 1 <= i <= N, e.g. SHARD=2/3"
        )
    return int(match[1]), int(match[2])


def plan(names, times, count):
    """The examples split into `count` shards of nearly equal recorded time, longest first."""
    if count > len(names):
        raise ShardError(
            f"{count} shards for {len(names)} examples would leave a shard empty: "
            f"use at most {len(names)} shards"
        )
    known = [times[name] for name in names if name in times]
    default = statistics.median(known) if known else 1.0
    cost = {name: times.get(name, default) for name in names}
    shards = [[] for _ in range(count)]
    load = [0.0] * count
    for name in sorted(names, key=lambda name: (-cost[name], name)):
        lightest = load.index(min(load))
        shards[lightest].append(name)
        load[lightest] += cost[name]
    return [sorted(shard) for shard in shards], load


def shard_examples(shard, root=REPO, times_path=TIMES):
    """The file names of the examples that shard 'i/N' executes."""
    index, count = parse_shard(shard)
    shards, _ = plan(examples(root), read_times(times_path), count)
    if not shards[index - 1]:  # an empty pattern would match every example
        raise ShardError(f"shard {shard} has no examples: use fewer shards")
    return shards[index - 1]


def filename_pattern(example="", shard="", root=REPO, times_path=TIMES):
    """sphinx-gallery's filename_pattern: the examples this build executes."""
    example = example.removesuffix(".py")
    if example and shard:
        raise ShardError("give EXAMPLE= or SHARD=, not both")
    if example:
        chosen = [f"{example}.py"]
    elif shard:
        chosen = shard_examples(shard, root, times_path)
    else:
        return re.escape(os.sep) + "plot_"
    return "|".join(re.escape(os.sep + name) + "$" for name in chosen)


def refuse_to_execute(gallery_conf, fname):
    """In a merge (GALLERY_MERGE=1), running an example is an error that names it."""
    if os.environ.get("GALLERY_MERGE") == "1":
        raise ShardError(
            f"the merge would execute {fname}: no shard left its output with a matching MD5 "
            "(its shard failed, was not merged in, or ran another version of the source)"
        )


def main(args):
    """`--check SHARD EXAMPLE` (make's check before a build), or `COUNT` (make shards)."""
    if args[:1] == ["--check"]:
        filename_pattern(example=args[2], shard=args[1])
        return
    given = args[0] if args else "3"
    if not given.isdigit() or int(given) < 1:
        raise ShardError(
            f"SHARDS={given!r} is not a number of shards: write e.g. SHARDS=3"
        )
    count = int(given)
    shards, load = plan(examples(), read_times(), count)
    print(
        f"{count} shards, balanced by the recorded times in {TIMES.relative_to(REPO)}:"
    )
    for index, (shard, seconds) in enumerate(zip(shards, load), start=1):
        print(f"  SHARD={index}/{count}: {seconds:5.0f} s  {' '.join(shard)}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ShardError as error:
        sys.exit(f"error: {error}")
