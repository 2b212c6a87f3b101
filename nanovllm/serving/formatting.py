"""The one formatter of table values (console summaries, sweep tables, HTML report): numbers to text with a
caller-chosen float format, a marker for missing values, and escaping for markdown cells."""

from __future__ import annotations

from typing import Any


def format_value(value: Any, float_format: str = ".4g", missing: str = "n/a", markdown: bool = False) -> str:
    """``value`` as table text: floats with ``float_format``, ``None`` as ``missing``, anything else as
    ``str``; ``markdown`` escapes pipes and folds newlines so the cell cannot break its table."""
    if value is None:
        return missing
    text = format(value, float_format) if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ") if markdown else text
