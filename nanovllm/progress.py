"""The one progress bar: finished requests, with output tokens/s in the postfix. ``LLM.generate`` and the
harness's serving loop both show it; it is silent when ``disable`` (sweeps, tests, a single request)."""

from __future__ import annotations

import time
from typing import Any

from tqdm.auto import tqdm


class RequestProgress:
    """A tqdm bar of finished requests. ``update`` takes running totals, not increments, because that is what
    a caller has at hand."""

    def __init__(self, total_requests: int, disable: bool = False, desc: str = "requests") -> None:
        self._bar = tqdm(total=total_requests, disable=disable, unit="req", desc=desc, dynamic_ncols=True)
        self._start = time.perf_counter()
        self.output_tokens_per_s = 0.0

    def update(self, finished_requests: int, output_tokens: int) -> None:
        """Set the bar to ``finished_requests`` done and the rate to ``output_tokens`` over elapsed time."""
        elapsed = time.perf_counter() - self._start
        self.output_tokens_per_s = output_tokens / elapsed if elapsed > 0 else 0.0
        # refresh=False: tqdm redraws at most every mininterval on its own; redrawing on every step would
        # cost more than a decode step of a tiny model.
        self._bar.set_postfix_str(f"{self.output_tokens_per_s:.1f} tok/s", refresh=False)
        self._bar.update(finished_requests - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "RequestProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
