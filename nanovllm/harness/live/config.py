"""``live.*``: whether and how a run is watched while it runs (the Hydra group ``conf/live/``)."""

from __future__ import annotations

from dataclasses import dataclass

LIVE_MODES = ("off", "web", "tui")


@dataclass
class LiveConfig:
    """``mode``: ``off`` (default), ``web`` (Bokeh dashboard at ``http://host:port/``) or ``tui`` (terminal)."""

    mode: str = "off"
    host: str = "127.0.0.1"     # the dashboard binds here; 0.0.0.0 exposes it to the network (only if you mean it)
    port: int = 5006            # 0 = any free port (printed at start)
    update_ms: int = 500        # how often the dashboard (or terminal view) redraws
    snapshot_every: int = 2     # steps between KV block-ownership snapshots (blocks.jsonl)
    keep_open: bool = True      # web, single run: keep serving after the run ends until Ctrl-C

    def __post_init__(self) -> None:
        if self.mode not in LIVE_MODES:
            raise ValueError(f"live.mode must be one of {', '.join(LIVE_MODES)}, got {self.mode!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"live.port must be in 0..65535, got {self.port}")
        if self.update_ms < 100:
            raise ValueError(f"live.update_ms must be >= 100, got {self.update_ms}")
        if self.snapshot_every < 1:
            raise ValueError(f"live.snapshot_every must be >= 1, got {self.snapshot_every}")
