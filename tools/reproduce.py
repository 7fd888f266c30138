"""Run each example's downloaded script in fresh processes; compare its ratios with the page.

`make reproduce` calls this after `make html`. For every example it takes the Python script
that the built site offers for download, runs it RUNS times, each in a new interpreter, and
reads every ratio it prints (a number followed by "x", such as "2.07x" or "2.07 x"). It prints,
for each ratio, the value on the built page beside the spread of the fresh runs, and writes the
same report to a file. Before each run it also measures how fast one thread runs a matrix
product and how much the other threads speed it up (and a large write, which memory bandwidth
limits), and the machine's own ratio between two kinds of work that the pages compare (many
small operations, bound by per-call overhead, against one matrix product, bound by arithmetic),
and during each run it reads how much CPU time the host of a virtual machine took away (steal),
because on a shared machine the cores come and go, and with them every timing. It is a
report, not a test: timings never fail it. It exits non-zero only when it cannot do its job (no
built site, a script that fails).
"""

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bs4 import BeautifulSoup

REPO = Path(__file__).resolve().parent.parent
RATIO = re.compile(r"(\d+(?:\.\d+)?) ?x\b")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
TOLERANCE = (
    0.25  # a ratio is flagged when a fresh run or the page is this far from the median
)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def ratios(text):
    """{(label, occurrence): (ratio, line)} for every "N.NNx" in printed output.

    A ratio's label is its line up to the ratio, with every number blanked and its spacing
    folded, so the same ratio matches across runs whose timings (or whose words after it, such
    as "met" and "missed") differ; repeated labels are told apart by order.
    """
    found, seen = {}, {}
    for line in text.splitlines():
        for match in RATIO.finditer(line):
            key = " ".join(NUMBER.sub("#", line[: match.start()]).split())
            seen[key] = seen.get(key, 0) + 1
            label = line[: match.start()] + "□" + line[match.end(1) :]
            found[(key, seen[key])] = (float(match.group(1)), label.strip())
    return found


def median_seconds(stmt, num_threads, **names):
    """Median seconds of ``stmt`` on ``num_threads`` threads, by torch's benchmark timer."""
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt, globals=names, num_threads=num_threads)
    return timer.blocked_autorange(min_run_time=0.2).median


def one_and_all_threads(stmt, **names):
    """Median seconds of ``stmt`` on one thread and on all of torch's threads."""
    import torch

    return [median_seconds(stmt, n, **names) for n in (1, torch.get_num_threads())]


def matmul_speeds():
    """A 512×512 matrix product's speed on one thread (GFLOP/s), and how many times faster
    it runs on all threads than on one."""
    import torch

    one, every = one_and_all_threads("a @ a", a=torch.randn(512, 512))
    return 2 * 512**3 / one / 1e9, one / every


def write_speedup():
    """How many times faster all threads fill 256 MiB of memory the process holds than one
    thread does. Writing is bound by memory bandwidth, not arithmetic: a speed-up near one
    means one core already drew all the bandwidth that the machine gave at that moment."""
    import torch

    held = torch.zeros(64 << 20)  # 256 MiB of float32, larger than any CPU cache
    one, every = one_and_all_threads("held.fill_(1.0)", held=held)
    return one / every


def overhead_against_arithmetic():
    """Time of 100 small additions (each a few microseconds of per-call overhead in Python and
    PyTorch's dispatcher) divided by the time of one 512×512 matrix product, on all threads.
    A page that compares a Python loop with a batched call compares these two kinds of work,
    so where this ratio moves between runs, such a page's ratios move with it."""
    import torch

    threads = torch.get_num_threads()
    small = median_seconds(
        "for _ in range(100): x.add(1.0)", threads, x=torch.randn(16)
    )
    return small / median_seconds("a @ a", threads, a=torch.randn(512, 512))


def spread_of(values):
    """Largest distance of a value from the values' median, as a share of that median."""
    median = statistics.median(values)
    return max(abs(v - median) for v in values) / median if median else 0.0


def cpu_times():
    """The whole machine's CPU time counters from /proc/stat, or None where there is none."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    return [int(field) for field in stat.read_text().split("\n")[0].split()[1:]]


def steal_share(before, after):
    """Share of the CPU time in between that the host took from this virtual machine."""
    if before is None or after is None or len(before) < 8:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])  # user nice system idle iowait irq softirq steal
    return delta[7] / total if total else 0.0


def page_output(page):
    soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
    return "\n".join(
        pre.get_text() for pre in soup.select("div.sphx-glr-script-out pre")
    )


def run_script(script, workdir):
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        fail(f"{script.name} failed in a fresh process:\n{result.stderr[-3000:]}")
    return result.stdout


def report_example(example, site, runs, lines):
    pages = list((site / "auto_examples").rglob(f"{example}.html"))
    scripts = list((site / "_downloads").rglob(f"{example}.py"))
    if len(pages) != 1 or len(scripts) != 1:
        fail(f"{example}: no built page or download in {site}; run `make html` first")
    page = pages[0]
    on_page = ratios(page_output(page))
    fresh, speeds, speedups, write_speedups, steals = [], [], [], [], []
    machine_ratios = []
    with tempfile.TemporaryDirectory() as workdir:
        for run in range(runs):
            speed, speedup = matmul_speeds()
            speeds.append(speed)
            speedups.append(speedup)
            write_speedups.append(write_speedup())
            machine_ratios.append(overhead_against_arithmetic())
            started, counters = time.perf_counter(), cpu_times()
            fresh.append(ratios(run_script(scripts[0], workdir)))
            steals.append(steal_share(counters, cpu_times()))
            print(
                f"  {example}: fresh run {run + 1}/{runs} "
                f"({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
            )
    lines.append(
        f"\n{example}: {len(on_page)} ratios, {runs} fresh runs of its download"
    )
    lines.append(
        "  one thread, matrix product, GFLOP/s just before each run: "
        + " ".join(f"{s:.1f}" for s in speeds)
    )
    lines.append(
        "  all threads against one, matrix product, just before each run: "
        + " ".join(f"{s:.2f}x" for s in speedups)
    )
    lines.append(
        "  all threads against one, writing 256 MiB, just before each run: "
        + " ".join(f"{s:.2f}x" for s in write_speedups)
    )
    lines.append(
        "  the machine's own ratio, 100 small operations against one matrix product, "
        "just before each run: "
        + " ".join(f"{r:.2f}" for r in machine_ratios)
        + f" (spread {spread_of(machine_ratios):.0%})"
    )
    lines.append(
        "  CPU time the host took (steal) during each run: "
        + " ".join("n/a" if s is None else f"{s:.1%}" for s in steals)
    )
    lines.append(
        f"  {'page':>8} {'runs: min':>10} {'median':>8} {'max':>8} "
        f"{'spread':>7} {'run':>4} {'page vs':>8}  ratio (□ on the printed line)"
    )
    outside = 0
    for key, (page_value, label) in on_page.items():
        values = [run[key][0] for run in fresh if key in run]
        if len(values) < runs:
            lines.append(f"  {page_value:8.2f} {'missing in some runs':>49}  {label}")
            outside += 1
            continue
        median = statistics.median(values)
        farthest = max(range(runs), key=lambda i: abs(values[i] - median))
        spread = spread_of(values)
        page_off = (page_value - median) / median if median else 0.0
        flag = (
            ""
            if spread <= TOLERANCE and abs(page_off) <= TOLERANCE
            else "  <-- over ±25%"
        )
        outside += bool(flag)
        lines.append(
            f"  {page_value:8.2f} {min(values):10.2f} {median:8.2f} {max(values):8.2f} "
            f"{spread:6.0%} {farthest + 1:4d} {page_off:+8.0%}  {label[:90]}{flag}"
        )
    return len(on_page), outside, spread_of(machine_ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh runs per example")
    parser.add_argument(
        "--example", default="", help="one example, e.g. plot_per_sample_grads"
    )
    parser.add_argument("--site", type=Path, default=REPO / "_build" / "html")
    parser.add_argument(
        "--report", type=Path, help="also write the report to this file"
    )
    args = parser.parse_args()
    args.site = args.site.resolve()  # the runs start in a temporary folder

    known = sorted(p.stem for p in (REPO / "examples").rglob("plot_*.py"))
    if args.example and args.example not in known:
        fail(
            f"no example called {args.example!r}; the examples are: {', '.join(known)}"
        )
    if not (args.site / "auto_examples").is_dir():
        fail(f"no built site in {args.site}: run `make html` first")
    examples = [args.example] if args.example else known

    import torch  # only for the header: which torch the runs used

    lines = [
        f"make reproduce: {args.runs} fresh runs of each downloaded example script, "
        f"compared with the built pages, {datetime.date.today().isoformat()}",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"CUDA available: {torch.cuda.is_available()}",
        "spread: largest distance of a run from the runs' median; run: which run that was; "
        "page vs: the built page's value against that median",
        "one thread: a matrix product's speed on one core just before each run; lower than "
        "usual, the core was shared (on a virtual machine, possibly with another machine on "
        "the same physical core)",
        "all threads against one: a matrix product's speed-up from the other cores just before "
        "each run; well below the thread count, the cores were not all free (other work on "
        "this machine or its host)",
        "writing: the same for filling 256 MiB, which memory bandwidth limits; near 1x, one "
        "core already drew all the bandwidth the machine gave (on a virtual machine, the "
        "host's memory is shared with other machines)",
        "the machine's own ratio: 100 small additions (per-call overhead) against one 512×512 "
        "matrix product (arithmetic), on all threads; a page that compares a Python loop with "
        "a batched call compares these two kinds of work, so where this ratio moves by over "
        "±25%, such a page's ratios can be expected to move about as much",
        "steal: on a virtual machine, the share of CPU time during the run that the host gave "
        "to others (Linux's /proc/stat)",
    ]
    total = outside = machine_moved = 0
    for example in examples:
        counted, over, machine_spread = report_example(
            example, args.site, args.runs, lines
        )
        total, outside = total + counted, outside + over
        machine_moved += machine_spread > TOLERANCE
    lines.append(
        f"\n{total} ratios, {total - outside} within ±{TOLERANCE:.0%} over the fresh runs "
        f"and on the page, {outside} not"
    )
    lines.append(
        f"the machine's own ratio moved by more than ±{TOLERANCE:.0%} over the runs of "
        f"{machine_moved} of {len(examples)} examples"
    )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report, encoding="utf-8")
        print(f"report written to {args.report}")


if __name__ == "__main__":
    main()
