"""The KV transfers between two processes on this machine, side by side: what ``shared_memory`` and ``ray`` cost
to move one request's K/V from a prefill replica's process to a decode replica's.

    python experiments/bench_kv_transfer.py [--blocks 1,4,16,64] [--repeats 7] [--dtype bfloat16]

Two Ray actors on a local instance stand for the two replicas. For each size (blocks of the default model's K/V:
30 layers x 2 x 16 tokens x 3 KV heads x 64), the sender builds the tensor and times ``send``; the receiver
times ``receive`` (which hands back a tensor of its own, as the decode replica's engine then copies into its
cache). The time of one transfer is send + receive (the driver's hop between them is not counted: it carries a
handle of a few bytes). Medians over ``--repeats``; then ``latency + bytes / bandwidth`` is fitted to each
transfer by least squares: the figures ``conf/kv_transfer/<name>.yaml`` give a simulated cluster.
Writes ``experiments/results/kv_transfer.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanovllm import machine  # noqa: E402

OUT = ROOT / "experiments" / "results" / "kv_transfer.md"
GEOMETRY = (30, 2, None, 16, 3, 64)   # the default model's K/V: layers, K and V, blocks, block size, heads, dim


class Side:
    """One replica's process: sends or receives with the named transfer."""

    def __init__(self, name: str) -> None:
        import torch

        from nanovllm.cluster.kv_transfer import KV_TRANSFERS

        torch.set_num_threads(1)
        self.transfer = KV_TRANSFERS.build(name)

    def send(self, blocks: int, dtype: str) -> tuple[object, float, int]:
        import torch

        shape = tuple(blocks if size is None else size for size in GEOMETRY)
        data = torch.randn(shape).to(getattr(torch, dtype))
        started = time.perf_counter()
        handle = self.transfer.send("bench", data)
        return handle, time.perf_counter() - started, data.numel() * data.element_size()

    def receive(self, handle: object) -> float:
        started = time.perf_counter()
        data = self.transfer.receive(handle)
        elapsed = time.perf_counter() - started
        assert data.numel() > 0
        return elapsed


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of seconds = latency + bytes / bandwidth: (bandwidth bytes/s, latency s)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return 1.0 / slope, max(0.0, mean_y - slope * mean_x)


def measure(args: argparse.Namespace) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        actor = ray.remote(num_cpus=1)(Side)
        rows: dict[str, list[dict]] = {}
        for name in args.transfers.split(","):
            sender, receiver = actor.remote(name), actor.remote(name)
            rows[name] = []
            for blocks in map(int, args.blocks.split(",")):
                sends, receives = [], []
                nbytes = 0
                for _ in range(args.repeats):
                    handle, send_s, nbytes = ray.get(sender.send.remote(blocks, args.dtype))
                    sends.append(send_s)
                    receives.append(ray.get(receiver.receive.remote(handle)))
                send, receive = statistics.median(sends), statistics.median(receives)
                rows[name].append({"blocks": blocks, "bytes": nbytes, "send_s": send, "receive_s": receive,
                                   "total_s": send + receive, "gb_s": nbytes / (send + receive) / 1e9})
                print(name, rows[name][-1], flush=True)
            ray.kill(sender)
            ray.kill(receiver)
    finally:
        ray.shutdown()
    fits = {name: dict(zip(("bandwidth", "latency"), fit([(r["bytes"], r["total_s"]) for r in table])))
            for name, table in rows.items()}
    command = ("python experiments/bench_kv_transfer.py " +
               " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out"))
    return {"command": command, "header": machine.header(1), "dtype": args.dtype, "rows": rows, "fits": fits}


def report(data: dict) -> str:
    lines = ["# KV transfer between two processes on this machine", "", data["header"], "",
             f"Command: `{data['command']}`. One request's K/V of the default model in {data['dtype']}; send in "
             "one Ray actor, receive in another; medians.", "",
             "| transfer | blocks | MB | send ms | receive ms | total ms | GB/s |", "|---|---|---|---|---|---|---|"]
    for name, table in data["rows"].items():
        for row in table:
            lines.append(f"| {name} | {row['blocks']} | {row['bytes'] / 1e6:.2f} | {row['send_s'] * 1e3:.2f} | "
                         f"{row['receive_s'] * 1e3:.2f} | {row['total_s'] * 1e3:.2f} | {row['gb_s']:.2f} |")
    lines += ["", "Fitted `latency + bytes / bandwidth` (what `conf/kv_transfer/<name>.yaml` gives the simulator):",
              "", "| transfer | bandwidth GB/s | latency ms |", "|---|---|---|"]
    for name, figures in data["fits"].items():
        lines.append(f"| {name} | {figures['bandwidth'] / 1e9:.2f} | {figures['latency'] * 1e3:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transfers", default="shared_memory,ray")
    parser.add_argument("--blocks", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    data = measure(args)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    out.write_text(report(data), encoding="utf-8")
    print(report(data))


if __name__ == "__main__":
    main()
