"""The ``server.*`` options of ``python -m nanovllm.serve`` (``conf/server/default.yaml``), also the schema Hydra
checks them against at composition. Kept free of heavy imports: the harness's config schema reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    """Where the server listens and what it admits. Validated on construction (``ServerConfig(**cfg.server)``).

    ``api_key``: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>`` (401 otherwise).
    ``max_waiting``: requests that may wait for their first step at once; one more gets 503 with
    ``Retry-After`` (null: no limit). ``served_model_name``: the ``model`` clients name (null: the model
    directory's name). ``retry_after_s``: the ``Retry-After`` a 503 suggests. ``request_timeout``: seconds a
    request may take from its submission to its end unless it brings its own ``timeout`` (null: no limit); past
    it the request is aborted, its memory freed, and the client gets a 408 error object. ``drain_timeout``:
    seconds a stopping server (SIGTERM, Ctrl-C) lets its requests in flight run to their end before it aborts
    the rest (0: abort at once). ``records_window``: how many of the latest request and step records the server
    holds in memory (its run's files get every one, and the summary is kept in running aggregates), so its memory
    stays bounded however long it runs."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting: int | None = 1024
    served_model_name: str | None = None
    retry_after_s: int = 1
    request_timeout: float | None = None
    drain_timeout: float = 0.0
    records_window: int = 1000

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"server.host must be a host name or address, got {self.host!r}")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be an integer in [0, 65535] (0: any free port), got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string or null")
        if self.max_waiting is not None and (not _is_int(self.max_waiting) or self.max_waiting < 0):
            raise ValueError(f"server.max_waiting must be an integer >= 0 or null, got {self.max_waiting!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name):
            raise ValueError("server.served_model_name must be a non-empty string or null")
        if self.request_timeout is not None and (not _is_number(self.request_timeout) or self.request_timeout <= 0):
            raise ValueError(f"server.request_timeout must be seconds > 0 or null, got {self.request_timeout!r}")
        if not _is_number(self.drain_timeout) or self.drain_timeout < 0:
            raise ValueError(f"server.drain_timeout must be seconds >= 0, got {self.drain_timeout!r}")
        if not _is_int(self.records_window) or self.records_window < 1:
            raise ValueError(f"server.records_window must be an integer >= 1, got {self.records_window!r}")
        if not _is_int(self.retry_after_s) or self.retry_after_s < 1:
            raise ValueError(f"server.retry_after_s must be an integer >= 1, got {self.retry_after_s!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
