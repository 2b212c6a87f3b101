"""The kill rate of the last ``make mutate`` (mutmut 3.x) per module, read from mutmut's ``mutants/**.meta`` files.

Killed counts mutants a test failed on, and those that made the tests time out (a hang is detected, not missed);
survived counts mutants every covering test passed on, and those no test covers. Not-checked mutants (a run
cut short) are reported apart and left out of the rate. ``--survivors`` lists the surviving mutant names
(``mutmut show NAME`` prints the diff of one)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KILLED = {1, 3, 24, -24, 36, 152, 255, 37}     # failed tests, pytest internal error, timeouts, type check
SURVIVED = {0, 5, 33}                          # passed, or no test covers the mutated code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=Path, default=Path("mutants"), help="mutmut's work directory")
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants")
    args = parser.parse_args()
    metas = sorted(args.mutants.rglob("*.py.meta"))
    if not metas:
        raise SystemExit(f"error: no mutmut results under {args.mutants}/ (run `make mutate` first)")
    total_killed = total_checked = 0
    survivors: list[str] = []
    print(f"{'module':34s} {'mutants':>7s} {'checked':>7s} {'killed':>6s} {'survived':>8s} {'kill rate':>9s}")
    for meta in metas:
        codes: dict[str, int | None] = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if not codes:
            continue
        killed = sum(code in KILLED for code in codes.values())
        survived = [name for name, code in codes.items() if code in SURVIVED]
        checked = killed + len(survived)
        other = sum(code is not None and code not in KILLED | SURVIVED for code in codes.values())
        survivors += survived
        total_killed, total_checked = total_killed + killed, total_checked + checked
        rate = f"{100 * killed / checked:8.1f}%" if checked else "        -"
        module = str(meta.relative_to(args.mutants))[: -len(".py.meta")].replace("/", ".")
        print(f"{module:34s} {len(codes):7d} {checked:7d} {killed:6d} {len(survived):8d} {rate}"
              + (f"  ({other} suspicious/segfault)" if other else ""))
    if total_checked:
        print(f"{'all checked':34s} {'':7s} {total_checked:7d} {total_killed:6d} {total_checked - total_killed:8d} "
              f"{100 * total_killed / total_checked:8.1f}%")
    if args.survivors:
        print("\n".join(["", "survivors:", *sorted(survivors)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
