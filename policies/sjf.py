"""Shortest job first, with a choice of how a job's length is known, and an aging bound.

Classic SJF minimises mean latency when lengths are known; real systems predict them (Qiu et al., "Efficient
Interactive LLM Serving with Proxy-Model-based Sequence Length Prediction", 2024; Fu et al., "Efficient LLM
Scheduling by Learning to Rank", NeurIPS 2024). ``predictor`` chooses the output-length estimate:

* ``oracle``: ``max_tokens`` (with ``ignore_eos`` workloads, the true length: the bound a predictor can reach);
* ``prompt_length``: ``output_per_prompt_token * prompt length`` (longer questions, longer answers);
* ``client_history``: the mean output length of this client's finished requests (all clients' mean before the
  client has any, ``max_tokens`` before anyone finished);
* ``"module:function"`` or, from Python, any callable ``f(request) -> predicted output tokens``.

A job's remaining work is its uncomputed prompt tokens plus its predicted output tokens not yet generated.
SJF starves long jobs under load; a request that has waited longer than ``max_wait`` seconds goes ahead of
every non-starving one, oldest first (``max_wait=inf``, the default, is pure SJF).

A waiting request's key is fixed but for that promotion, at a known time (``waiting_key = "timed"``), with the
``oracle`` and ``prompt_length`` predictors. ``client_history`` learns from every finished request and a custom
predictor may read anything, so with those the waiting queue is re-sorted every step (``"dynamic"``, O(n log n)
per step); a subclass whose predictor is a pure function of the request can declare ``waiting_key = "timed"``."""

from __future__ import annotations

import importlib
import math
from collections import defaultdict
from typing import Callable

from nanovllm import Policy, Request, RequestStatus, a_hair_before, register_policy

PREDICTORS = ("oracle", "prompt_length", "client_history")
FIXED_PREDICTORS = ("oracle", "prompt_length")   # their estimate of a waiting request never changes
Predictor = Callable[[Request], float]


@register_policy("sjf")
class ShortestJobFirst(Policy):
    """Admit the request with the least predicted remaining work first; ties by arrival. Under memory pressure
    the running request with the most predicted remaining work is preempted."""

    def __init__(self, predictor: str | Predictor = "oracle", max_wait: float = math.inf,
                 output_per_prompt_token: float = 1.0) -> None:
        if not (isinstance(max_wait, (int, float)) and max_wait > 0):
            raise ValueError(f"scheduler.max_wait must be > 0 seconds (inf: no aging), got {max_wait!r}")
        if not (isinstance(output_per_prompt_token, (int, float)) and math.isfinite(output_per_prompt_token)
                and output_per_prompt_token >= 0):
            raise ValueError("scheduler.output_per_prompt_token must be a finite number >= 0, "
                             f"got {output_per_prompt_token!r}")
        self.max_wait = max_wait
        self.output_per_prompt_token = output_per_prompt_token
        self.predictor_name = predictor if isinstance(predictor, str) else getattr(predictor, "__name__", "callable")
        self._fixed_predictor = isinstance(predictor, str) and predictor in FIXED_PREDICTORS
        # See the module docstring: a fixed predictor's key changes only with waiting time (aging). Only for this
        # class's own ranking: a subclass with a priority of its own keeps what it declares, or Policy's exact
        # "dynamic" when it declares nothing.
        if type(self).priority is ShortestJobFirst.priority:
            self.waiting_key = "timed" if self._fixed_predictor else "dynamic"
        self._predict = self._resolve(predictor)
        self._history: dict[str, list[int]] = defaultdict(list)

    def _resolve(self, predictor: str | Predictor) -> Predictor:
        if callable(predictor):
            return predictor
        builtin = {"oracle": lambda r: r.max_tokens,
                   "prompt_length": lambda r: self.output_per_prompt_token * r.num_prompt_tokens,
                   "client_history": self._from_history}
        if predictor in builtin:
            return builtin[predictor]
        if isinstance(predictor, str) and ":" in predictor:
            module, _, name = predictor.partition(":")
            try:
                function = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"scheduler.predictor={predictor!r}: cannot import it ({exc})") from None
            if callable(function):
                return function
        raise ValueError(f"scheduler.predictor must be one of {', '.join(PREDICTORS)}, a 'module:function' "
                         f"path or a callable, got {predictor!r}")

    def _from_history(self, request: Request) -> float:
        own = self._history.get(request.client_id or "default")
        if own:
            return sum(own) / len(own)
        everyone = [n for lengths in self._history.values() for n in lengths]
        return sum(everyone) / len(everyone) if everyone else request.max_tokens

    def predicted_output_len(self, request: Request) -> float:
        """The predictor's estimate for ``request``; a predictor that fails or returns a non-number raises a
        ValueError naming it."""
        try:
            value = self._predict(request)
        except Exception as exc:
            raise ValueError(f"scheduler.predictor={self.predictor_name!r} raised on request "
                             f"{request.request_id!r}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"scheduler.predictor={self.predictor_name!r} must return a number of tokens >= 0, "
                             f"got {value!r} for request {request.request_id!r}")
        return value

    def priority(self, request: Request, now: float):
        starving = request.status is not RequestStatus.RUNNING and now - request.arrival_time > self.max_wait
        if starving:
            return (0, 0.0, request.arrival_time)
        remaining_output = max(self.predicted_output_len(request) - request.num_output_tokens, 0)
        remaining_prompt = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        return (1, remaining_prompt + remaining_output, request.arrival_time)

    def priority_changes_at(self, request: Request, now: float) -> float | None:
        """A waiting request's key changes once, when it has waited ``max_wait``, and never again."""
        if math.isinf(self.max_wait) or now - request.arrival_time > self.max_wait:
            return None
        return a_hair_before(request.arrival_time + self.max_wait, request.arrival_time, self.max_wait)

    def on_finish(self, request: Request, now: float) -> None:
        if request.num_output_tokens:
            self._history[request.client_id or "default"].append(request.num_output_tokens)
