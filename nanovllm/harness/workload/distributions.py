"""The random building blocks of a workload: arrival processes, length distributions, class draws.

Every random choice comes from ``numpy.random.default_rng`` seeded by the config's ``seed`` -- one independent
stream per aspect (arrivals, lengths, prompts, ...), so changing e.g. the priority weights leaves the arrival
times and prompts of the same seed unchanged, and the global RNG state is never touched."""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "lognormal", "zipf")

# One RNG stream per aspect of a workload (see the module docstring for why).
_STREAMS = {"arrivals": 0, "input_len": 1, "output_len": 2, "prompts": 3, "prefix": 4, "priority": 5,
            "client": 6, "chat_pick": 7, "turns": 8, "think_time": 9, "trace_blocks": 10,
            "tool_output_len": 11, "revisits": 12}


def _rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    """An independent generator for one aspect of the workload (same seed -> same stream). ``keys`` (integers
    >= 0) split a stream further: ``_rng(seed, "trace_blocks", hash_id)`` is one generator per trace block, so a
    block's tokens depend on its id alone, not on which request met it first."""
    return np.random.default_rng([int(seed), _STREAMS[stream], *(int(k) for k in keys)])


def sample_arrival_times(n: int, request_rate: float, burstiness: float,
                         rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of ``n`` requests: the first at t=0, then gamma-distributed gaps.

    Gaps ~ Gamma(shape=burstiness, scale=1/(request_rate*burstiness)), so the mean gap is 1/request_rate
    whatever the burstiness, and burstiness=1 is a Poisson process. The first request arrives at 0 rather
    than after a gap so a run never starts idle; ``n`` requests therefore span ``n-1`` gaps.
    """
    if math.isinf(request_rate) or n <= 1:
        return np.zeros(max(n, 0))
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _zipf_tail(alpha: float, n: np.ndarray) -> np.ndarray:
    """sum over k >= n of k**-alpha, for integers n >= 1 (exact head + Euler-Maclaurin tail; no scipy)."""
    m = 64
    cum = np.concatenate([[0.0], np.cumsum(np.arange(1, m + 1, dtype=np.float64) ** -alpha)])

    def asymptotic(x: np.ndarray) -> np.ndarray:  # accurate to ~x**(-alpha-3) once x > m
        return x ** (1 - alpha) / (alpha - 1) + 0.5 * x ** -alpha + alpha * x ** (-alpha - 1) / 12

    zeta = cum[m] + asymptotic(np.float64(m + 1))
    n = np.asarray(n, dtype=np.float64)
    head = zeta - cum[np.clip(n, 1, m + 1).astype(np.int64) - 1]
    return np.where(n <= m, head, asymptotic(np.maximum(n, m + 1)))


def _zipf_survival(scale: float, alpha: float, lo: int, hi: int) -> np.ndarray:
    """P(L > v) for v = lo..hi-1, where L = clip(round(scale*k), lo, hi) and k ~ Zipf(alpha).

    L > v exactly when k >= (v+0.5)/scale, so this is O(hi) work whatever the scale: even very heavy tails
    (alpha near 1, tiny scales) are exact. numpy's own zipf sampler is not usable there: it drops draws
    beyond int64, which for alpha=1.05 is over a tenth of the mass.
    """
    v = np.arange(lo, hi, dtype=np.float64)
    n = np.maximum(1.0, np.ceil((v + 0.5) / scale))
    return _zipf_tail(alpha, n) / _zipf_tail(alpha, np.array(1.0))


def _zipf_clipped_mean(scale: float, alpha: float, lo: int, hi: int) -> float:
    """E[L] = lo + sum_v P(L > v) (the tail-sum formula for an integer variable)."""
    return float(lo + _zipf_survival(scale, alpha, lo, hi).sum())


def _sample_zipf(dist: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    """Inverse-CDF sampling from the survival function: L = lo + #{v : P(L > v) > u}, u ~ U(0, 1)."""
    lo, hi, alpha, mean = int(dist.min), int(dist.max), float(dist.alpha), float(dist.mean)
    if mean <= lo or mean >= hi:  # the mean sits on a bound: every length must sit there too
        return np.full(n, lo if mean <= lo else hi, dtype=np.float64)
    survival = _zipf_survival(_zipf_scale(alpha, mean, lo, hi), alpha, lo, hi)
    # survival decreases with v, so -survival is sorted and searchsorted counts the v with survival > u.
    return lo + np.searchsorted(-survival, -rng.random(n), side="left").astype(np.float64)


@functools.lru_cache(maxsize=64)
def _zipf_scale(alpha: float, mean: float, lo: int, hi: int) -> float:
    """The scale giving clipped Zipf lengths the requested mean (bisection: the mean grows with the scale).

    Raises ValueError when even a vanishing scale leaves the mean above ``mean``: with alpha near 1 the tail
    is so heavy that the lengths clipped to ``hi`` alone outweigh it.
    """
    low, high = 1e-9, 2.0 * hi
    if _zipf_clipped_mean(low, alpha, lo, hi) > mean:
        raise ValueError(f"a Zipf({alpha}) length clipped to [{lo}, {hi}] cannot have mean {mean}; "
                         "raise alpha, raise mean or lower max")
    for _ in range(80):
        mid = math.sqrt(low * high)  # bisect in log space: the useful scales span orders of magnitude
        if _zipf_clipped_mean(mid, alpha, lo, hi) < mean:
            low = mid
        else:
            high = mid
    return high


def sample_lengths(dist: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` integer lengths from a :class:`LengthDist` (or a DictConfig with its fields), within [min, max]."""
    lo, hi, mean = int(dist.min), int(dist.max), float(dist.mean)
    if dist.kind == "fixed":
        raw = np.full(n, round(mean), dtype=np.float64)
    elif dist.kind == "uniform":
        a = max(lo, round(mean * (1 - dist.range_ratio)))
        b = min(hi, round(mean * (1 + dist.range_ratio)))
        raw = rng.integers(a, b + 1, size=n).astype(np.float64)
    elif dist.kind == "lognormal":
        sigma = float(dist.sigma)
        raw = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, size=n)  # E[exp(N(mu, s))] = exp(mu+s^2/2)
    elif dist.kind == "zipf":
        raw = _sample_zipf(dist, n, rng)
    else:
        raise ValueError(f"length kind must be one of {', '.join(LENGTH_KINDS)}, got {dist.kind!r}")
    return np.clip(np.rint(raw), lo, hi).astype(np.int64)


def _sample_choice(values: Sequence[Any], weights: Sequence[float], n: int, rng: np.random.Generator) -> list:
    p = np.asarray(weights, dtype=np.float64)
    idx = rng.choice(len(values), size=n, p=p / p.sum())
    return [values[i] for i in idx]


def _sample_priorities(cfg: Any, n: int, rng: np.random.Generator) -> list[int]:
    return [int(c) for c in _sample_choice(list(cfg.priority_classes), list(cfg.priority_weights), n, rng)]


def _slo_targets(cfg: Any, priority: int) -> dict[str, float | None]:
    """A request's own SLO targets: the entry of ``ttft_slo_ms`` / ``e2el_slo_ms`` for its priority class."""
    index = list(cfg.priority_classes).index(priority)
    return {key: (None if getattr(cfg, key, None) is None else float(getattr(cfg, key)[index]))
            for key in ("ttft_slo_ms", "e2el_slo_ms")}


def _sample_clients(cfg: Any, n: int, rng: np.random.Generator) -> list[str]:
    """Each request's client, drawn with the configured shares; the overall arrival process is unchanged."""
    names = [f"client{i}" for i in range(cfg.num_clients)]
    shares = getattr(cfg, "client_rate_shares", None)
    return _sample_choice(names, list(shares) if shares is not None else [1.0] * len(names), n, rng)
