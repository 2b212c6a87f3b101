"""How long a cold build of the CPU kernels takes (``nanovllm.kernels.load``), this tree beside another one.

    taskset -c 1 python experiments/bench_kernel_build.py --old-tree DIR [--levels avx2 scalar] [--rounds 2]

Each round builds each level from each tree in a fresh, empty cache (``NANOVLLM_CACHE`` a new temporary
directory) in a subprocess started in that tree, with ``MAX_JOBS=1`` (torch's ninja then compiles one unit at a
time, so the CPU seconds are the compiler's work, not how many cores it found). ``DIR`` is a checkout of another
commit (``git worktree add DIR REV``) sharing this tree's virtualenv. Prints per level and tree the wall and CPU
seconds of the build (the children's, from ``resource``), the median over rounds, and this tree / old as a ratio.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cold_build(tree: Path, level: str) -> tuple[float, float]:
    """(wall s, CPU s) of building ``level``'s kernels from ``tree`` into an empty cache."""
    with tempfile.TemporaryDirectory(prefix="nanovllm-build-") as cache:
        env = {**os.environ, "NANOVLLM_CACHE": cache, "MAX_JOBS": "1", "PYTHONPATH": str(tree)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"from nanovllm import kernels; kernels.load({level!r})"],
                       cwd=tree, env=env, check=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    from nanovllm import kernels, machine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="another checkout to build beside this one")
    parser.add_argument("--levels", nargs="+", default=None,
                        help="ISA levels to build (default: every level this CPU supports)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    # One level per build (``amx`` runs the ``avx512_bf16`` build).
    levels = args.levels or list({kernels.kernel_build(level): level for level in machine.supported_isas()})
    trees = {"this": REPO, **({"old": args.old_tree.resolve()} if args.old_tree else {})}
    print(f"CPU: {machine.cpu_model()}; levels {', '.join(levels)}; {args.rounds} round(s)", flush=True)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_index in range(args.rounds):
        for level in levels:
            for label, tree in trees.items():   # side by side: each level's builds follow one another
                wall, cpu = cold_build(tree, level)
                results.setdefault((level, label), []).append((wall, cpu))
                print(f"round {round_index + 1} {level:12s} {label:4s} wall {wall:6.1f} s  CPU {cpu:6.1f} s",
                      flush=True)
    print("\n| level | tree | wall s (median) | CPU s (median) | CPU this / old |\n| --- | --- | --- | --- | --- |")
    for level in levels:
        medians = {label: (statistics.median(w for w, _ in results[level, label]),
                           statistics.median(c for _, c in results[level, label])) for label in trees}
        for label in trees:
            ratio = f"{medians['this'][1] / medians['old'][1]:.2f}" if "old" in trees and label == "this" else ""
            print(f"| {level} | {label} | {medians[label][0]:.1f} | {medians[label][1]:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
