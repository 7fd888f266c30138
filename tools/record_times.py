"""Record each example's run time from the last full build, for `make record-times`.

`make html SHARD=i/N` balances the shards by these times. They come from sphinx-gallery's
execution-times page of the last build (docs/sg_execution_times.rst), which keeps the last
measured time of an example that a later build skipped by its MD5. Record them after a full
`make html` on the hardware the shards will run on, and say which in the header.
"""

import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "sphinxext"))
import torch  # noqa: E402
from gallery_shards import REPO, TIMES, examples, times_from_execution_page  # noqa: E402

PAGE = REPO / "docs" / "sg_execution_times.rst"


def cpu_model():
    """The processor's name, as Linux reports it, else the platform's word for it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def main():
    if not PAGE.is_file():
        sys.exit(f"error: no {PAGE.relative_to(REPO)}: run a full `make html` first")
    times = times_from_execution_page(PAGE.read_text(encoding="utf-8"))
    missing = [name for name in examples() if name not in times]
    if missing:
        sys.exit(
            "error: the last build has no time for "
            + ", ".join(missing)
            + ": run a full "
            "`make html` (no EXAMPLE=, no SHARD=) first"
        )
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"{os.cpu_count()} CPU cores ({cpu_model()})"
    )
    lines = [
        "# Seconds each example took in a full `make html`, longest first; `make record-times`",
        "# writes this file and `make html SHARD=i/N` balances the shards by it.",
        f"# {datetime.date.today()}, {device}, torch {torch.__version__}",
    ]
    for name, seconds in sorted(times.items(), key=lambda item: (-item[1], item[0])):
        if name in examples():
            lines.append(f"{max(seconds, 0.01):8.2f} {name}")  # a time, however short
    TIMES.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {TIMES.relative_to(REPO)}: {len(lines) - 3} examples")


if __name__ == "__main__":
    main()
