"""A study the real engine cannot run here: fcfs vs priority vs sjf at 20,000 requests across rates past
saturation, on the calibrated simulator (one Hydra multirun), and its table.

    python experiments/sim_policies_vs_rate.py            # runs the sweep, then writes the table
    python experiments/sim_policies_vs_rate.py --table-only [--sweep-dir outputs/sim_policies_vs_rate]

The sweep is ``python -m nanovllm.run -m +experiment=sim_policies_vs_rate``
(conf/experiment/sim_policies_vs_rate.yaml); the table has the same columns as the real FCFS-vs-priority study
(``experiments/priority_vs_rate.py``, whose table code it reuses) and goes to
``experiments/results/sim_policies_vs_rate.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from priority_vs_rate import table  # noqa: E402  (the same table as the real study)

RESULTS = Path(__file__).parent / "results" / "sim_policies_vs_rate.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep-dir", type=Path, default=Path("outputs/sim_policies_vs_rate"))
    parser.add_argument("--table-only", action="store_true", help="only build the table from an existing sweep")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the sweep")
    args = parser.parse_args()
    note = ""
    if not args.table_only:
        command = [sys.executable, "-m", "nanovllm.run", "-m", "+experiment=sim_policies_vs_rate",
                   f"hydra.sweep.dir={args.sweep_dir}", *args.overrides]
        print("running:", " ".join(command), flush=True)
        start = time.perf_counter()
        subprocess.run(command, check=True)
        note = f"\nThe whole sweep took {time.perf_counter() - start:,.0f} s of wall time on the shared 2-core machine.\n"
    text = table(args.sweep_dir) + note
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
