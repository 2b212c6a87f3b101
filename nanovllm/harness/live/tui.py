"""``live=tui``: the essentials of a run in the terminal, for headless sessions (rich ``Live``).

Counts of running / waiting / preempted requests, a sparkline of the batch size, a KV usage bar, the output
throughput and running TTFT/TPOT percentiles, and with KV tiers (``kv_offload``) one line of each tier's
figures. The logger only appends each step and request to bounded buffers; rich's own refresh thread draws the
panel ``1000 / update_ms`` times a second, so the engine never waits on the terminal.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from nanovllm.harness.live.feed import TierTotals
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.metrics import tpot_s, ttft_s

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[int], top: int) -> str:
    """One character per value, scaled to ``top``."""
    top = max(top, 1)
    return "".join(SPARKS[min(len(SPARKS) - 1, round(v / top * (len(SPARKS) - 1)))] for v in values)


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p90, p99 = np.percentile(np.asarray(values) * 1000, [50, 90, 99])
    return f"p50 {p50:.0f}  p90 {p90:.0f}  p99 {p99:.0f} ms"


class TuiView:
    """The panel's state; ``__rich__`` renders it (called from rich's refresh thread)."""

    def __init__(self, max_num_seqs: int, num_requests: int, history: int = 60,
                 tier_capacities: Mapping[str, int | None] | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_requests = num_requests
        self.tier_capacities = dict(tier_capacities or {})   # KV tier -> its bytes, for the fraction held
        self.tiers = TierTotals()
        self.batch: deque[int] = deque(maxlen=history)
        self.last_step: dict[str, Any] | None = None
        self.preemptions = 0
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.done = 0
        self.failed = 0
        self.recent: deque[tuple[float, int]] = deque(maxlen=400)  # (step end, tokens sampled)

    def add_step(self, step: dict) -> None:
        self.last_step = step
        self.batch.append(step["num_running"])
        self.preemptions += step["num_preempted"]
        self.recent.append((step["start_time"] + step["duration"], step.get("num_sampled", 0)))
        self.tiers.add([step])

    def add_request(self, record: dict) -> None:
        if record["error"] is not None:
            self.failed += 1
            return
        self.done += 1
        for values, metric in ((self.ttfts, ttft_s), (self.tpots, tpot_s)):
            value = metric(record)
            if value is not None:
                values.append(value)

    def throughput(self, window: float = 2.0) -> float:
        recent = list(self.recent)  # one atomic copy: the engine's thread appends while rich's thread draws
        if len(recent) < 2:
            return 0.0
        end = recent[-1][0]
        inside = [(t, n) for t, n in recent if t > end - window]
        span = end - min(t for t, _ in inside) if len(inside) > 1 else 0.0
        return sum(n for _, n in inside[1:]) / span if span > 0 else 0.0

    def __rich__(self) -> Panel:
        s = self.last_step
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        if s is None:
            return Panel("waiting for the first step ...", title="nano-vllm live")
        table.add_row("step", f"{s['step']}   t = {s['start_time'] + s['duration']:.1f} s")
        table.add_row("requests", f"running {s['num_running']}  waiting {s['num_waiting']}  "
                                  f"preempted {self.preemptions} (total)  finished {self.done}"
                                  f"{f' / {self.num_requests}' if self.num_requests else ''}  failed {self.failed}")
        table.add_row("batch size", Text(sparkline(list(self.batch), self.max_num_seqs), style="cyan")
                      + Text(f"  (max_num_seqs {self.max_num_seqs})"))
        total = max(s["kv_blocks_total"], 1)
        bar = ProgressBar(total=total, completed=s["kv_blocks_used"], width=40)
        table.add_row("KV blocks", Group(bar, Text(f"{s['kv_blocks_used']} used, {s.get('kv_blocks_cached', 0)} "
                                                   f"cached, {s['kv_blocks_free']} free of {total}")))
        table.add_row("throughput", f"{self.throughput():.1f} output tok/s")
        table.add_row("TTFT", _percentiles(self.ttfts))
        table.add_row("TPOT", _percentiles(self.tpots))
        if self.tiers.counts:
            table.add_row("KV tiers", "  |  ".join(self._tier_text(name) for name in list(self.tiers.counts)))
        return Panel(table, title="nano-vllm live")


    def _tier_text(self, name: str) -> str:
        f = self.tiers.figures(name, self.tier_capacities.get(name))
        share = f" {f['fraction']:.0%}" if f["fraction"] is not None else ""
        rate = f"{f['hit_rate']:.2f}" if f["hit_rate"] is not None else "-"
        return (f"{name}: {f['blocks']:.0f} blocks ({f['mib']:.1f} MiB{share})  hit rate {rate}  "
                f"loaded {f['blocks_loaded']:.0f} ({f['mib_loaded']:.1f} MiB)  written {f['blocks_written']:.0f}")


class TuiLogger(RunLogger):
    """Shows a ``TuiView`` of the run in a rich ``Live`` display from ``start`` to ``finish``."""

    def __init__(self, engine: Any, num_requests: int, update_ms: int = 500, console: Console | None = None) -> None:
        offload = engine.offload
        self.view = TuiView(engine.config.max_num_seqs, num_requests,
                            tier_capacities=None if offload is None else offload.capacities())
        self.update_ms = update_ms
        self.console = console
        self._live: Live | None = None

    def start(self, run_dir: Path, config: dict, group: str | None = None, name: str | None = None) -> None:
        self._live = Live(self.view, console=self.console, refresh_per_second=1000 / self.update_ms,
                          transient=False)
        self._live.start()

    def log_step(self, step: Mapping[str, Any]) -> None:
        self.view.add_step(step)

    def log_request(self, record: Mapping[str, Any]) -> None:
        self.view.add_request(record)

    def finish(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live.console.line()  # the summary printed next starts on its own line
            self._live = None
