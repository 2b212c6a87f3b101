"""Workloads: what requests arrive, when, and how long they are.

Three sources, chosen by the config's ``name``:

* ``synthetic`` -- arrivals from a gamma process (``request_rate``, ``burstiness``, as in ``vllm bench serve``),
  prompt and output lengths from a :class:`LengthDist`, optional shared-prefix groups, priority classes and
  clients. Prompts are token ids, so a request's prompt length is exact.
* ``chat`` -- real-looking chat prompts from the small dataset shipped in ``nanovllm/data/chat_prompts.json``,
  templated with the model's chat template; requests end at EOS.
* ``trace`` -- replay a JSONL trace (with arrival times) or a ShareGPT JSON file (arrivals synthesised).

Every random choice comes from ``numpy.random.default_rng`` seeded by the config's ``seed`` -- one independent
stream per aspect (arrivals, lengths, prompts, ...), so changing e.g. the priority weights leaves the arrival
times and prompts of the same seed unchanged, and the global RNG state is never touched.

The config dataclasses double as Hydra structured configs (fields of simple types only). They validate
themselves when constructed; :func:`validate_workload_config` runs the same checks on an OmegaConf
``DictConfig`` with the same fields, and :func:`generate_workload` always calls it first.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "lognormal", "zipf")
PROMPT_KINDS = ("random", "text")
WORKLOAD_NAMES = ("synthetic", "chat", "trace")

# One RNG stream per aspect of a workload (see the module docstring for why).
_STREAMS = {"arrivals": 0, "input_len": 1, "output_len": 2, "prompts": 3, "prefix": 4, "priority": 5,
            "client": 6, "chat_pick": 7}


# --------------------------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------------------------

@dataclass
class WorkloadRequest:
    """One request of a workload: when it arrives (seconds from run start) and what it asks for."""

    arrival_time: float
    prompt: str | list[int]             # text, or token ids (synthetic and chat workloads give ids)
    max_tokens: int
    priority: int = 0
    client_id: str | None = None
    ignore_eos: bool = False
    request_id: str | None = None
    messages: list[dict] | None = None  # the chat it came from; `prompt` then holds the templated ids


@dataclass
class LengthDist:
    """A distribution of token lengths, always clipped to ``[min, max]``.

    * ``fixed``: always ``round(mean)``.
    * ``uniform``: integers in ``[mean*(1-range_ratio), mean*(1+range_ratio)]`` (like vllm bench's random data).
    * ``lognormal``: ``exp(N(mu, sigma))`` with ``mu`` chosen so the (unclipped) mean is ``mean``.
    * ``zipf``: ``round(s * k)`` with ``k ~ Zipf(alpha)`` (heavy tail: most requests short, a few very long);
      the scale ``s`` is solved so the mean *after* clipping is ``mean`` (some (alpha, mean, max) are
      unreachable -- alpha near 1 with a small mean -- and fail validation).
    """

    kind: str = "fixed"
    mean: float = 128
    range_ratio: float = 0.0
    sigma: float = 0.5
    alpha: float = 1.5
    min: int = 1
    max: int = 4096


@dataclass
class SyntheticWorkloadConfig:
    """Synthetic arrivals and lengths. ``request_rate=inf`` puts every arrival at t=0 (an offline batch)."""

    name: str = "synthetic"
    num_requests: int = 64
    request_rate: float = float("inf")
    burstiness: float = 1.0
    input_len: LengthDist = field(default_factory=LengthDist)
    output_len: LengthDist = field(default_factory=LengthDist)
    prompt_kind: str = "random"         # "random" token ids, or "text" cut from the chat dataset
    num_prefix_groups: int = 0          # >0: each prompt = one of these shared prefixes + its own suffix
    prefix_len: int = 0
    priority_classes: list[int] = field(default_factory=lambda: [0])
    priority_weights: list[float] = field(default_factory=lambda: [1.0])
    num_clients: int = 1
    client_rate_shares: list[float] | None = None  # None: every client gets an equal share
    ignore_eos: bool = True             # so each request really produces its sampled output length
    seed: int = 0

    def __post_init__(self) -> None:
        validate_workload_config(self)


@dataclass
class ChatWorkloadConfig:
    """Prompts from the shipped chat dataset, chat-templated; EOS ends requests naturally."""

    name: str = "chat"
    num_requests: int = 32
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_tokens: int = 128
    priority_classes: list[int] = field(default_factory=lambda: [0])
    priority_weights: list[float] = field(default_factory=lambda: [1.0])
    num_clients: int = 1
    client_rate_shares: list[float] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        validate_workload_config(self)


@dataclass
class TraceWorkloadConfig:
    """Replay a ``.jsonl`` trace (own arrival times) or a ShareGPT ``.json`` file (arrivals from ``request_rate``).

    ``time_scale`` multiplies arrival times (0.5 replays twice as fast; 0 sends everything at t=0).
    ``max_requests`` keeps the first N requests of the file. ``seed`` drives ShareGPT arrivals and the random
    tokens of ``prompt_len`` lines.
    """

    name: str = "trace"
    path: str = ""
    time_scale: float = 1.0
    max_requests: int | None = None
    default_output_len: int = 128       # for JSONL lines without output_len
    request_rate: float = float("inf")  # ShareGPT only: it has no timestamps
    burstiness: float = 1.0
    ignore_eos: bool = True             # replay the trace's output lengths exactly
    seed: int = 0

    def __post_init__(self) -> None:
        # The file may not exist yet when the config object is built; generate_workload checks it.
        validate_workload_config(self, check_files=False)


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------

def _bad(field_name: str, value: Any, allowed: str) -> ValueError:
    """An error naming the field (as a Hydra override would), the bad value and what is allowed."""
    return ValueError(f"workload.{field_name}={value!r} is invalid: {allowed}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(cfg: Any, name: str, lo: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise _bad(name, value, f"must be an integer >= {lo}")


def _check_arrivals(cfg: Any) -> None:
    rate, shape = cfg.request_rate, cfg.burstiness
    if not _is_number(rate) or math.isnan(rate) or rate <= 0:
        raise _bad("request_rate", rate, "must be > 0 requests/s, or inf to send every request at t=0")
    if not _is_number(shape) or not math.isfinite(shape) or shape <= 0:
        raise _bad("burstiness", shape, "must be a finite number > 0 (1 = Poisson, <1 burstier, >1 steadier)")


def _check_shares(field_name: str, shares: Sequence[float], expected_len: int, len_field: str) -> None:
    """Weights must match their classes one to one, be non-negative and not all zero."""
    if len(shares) != expected_len:
        raise _bad(field_name, shares, f"must have one weight per entry of {len_field} ({expected_len})")
    if any(not _is_number(w) or not math.isfinite(w) or w < 0 for w in shares):
        raise _bad(field_name, shares, "weights must be finite numbers >= 0")
    if sum(shares) <= 0:
        raise _bad(field_name, shares, "at least one weight must be > 0")


def _check_classes(cfg: Any) -> None:
    classes = list(cfg.priority_classes)
    if not classes or any(not isinstance(c, int) or isinstance(c, bool) for c in classes):
        raise _bad("priority_classes", classes, "must be a non-empty list of integers")
    _check_shares("priority_weights", list(cfg.priority_weights), len(classes), "priority_classes")
    _check_int(cfg, "num_clients", 1)
    shares = getattr(cfg, "client_rate_shares", None)
    if shares is not None:
        _check_shares("client_rate_shares", list(shares), cfg.num_clients, "num_clients")


def _check_length(dist: Any, where: str) -> None:
    kind = dist.kind
    if kind not in LENGTH_KINDS:
        raise _bad(f"{where}.kind", kind, f"must be one of {', '.join(LENGTH_KINDS)}")
    lo, hi, mean = dist.min, dist.max, dist.mean
    if not isinstance(lo, int) or lo < 1:
        raise _bad(f"{where}.min", lo, "must be an integer >= 1")
    if not isinstance(hi, int) or hi < lo:
        raise _bad(f"{where}.max", hi, f"must be an integer >= {where}.min ({lo}); the range is empty")
    if not _is_number(mean) or not lo <= mean <= hi:
        raise _bad(f"{where}.mean", mean, f"must lie in [{where}.min, {where}.max] = [{lo}, {hi}]")
    if kind == "uniform" and not (_is_number(dist.range_ratio) and 0 <= dist.range_ratio < 1):
        raise _bad(f"{where}.range_ratio", dist.range_ratio, "must be in [0, 1)")
    if kind == "lognormal" and not (_is_number(dist.sigma) and math.isfinite(dist.sigma) and dist.sigma >= 0):
        raise _bad(f"{where}.sigma", dist.sigma, "must be a finite number >= 0")
    if kind == "zipf":
        _check_zipf(dist, where)


def _check_zipf(dist: Any, where: str) -> None:
    if not (_is_number(dist.alpha) and math.isfinite(dist.alpha) and dist.alpha > 1):
        raise _bad(f"{where}.alpha", dist.alpha, "must be a finite number > 1 (Zipf needs alpha > 1)")
    if dist.min < dist.mean < dist.max:
        try:  # solving the scale now means an unreachable mean fails at config time, not mid-run
            _zipf_scale(float(dist.alpha), float(dist.mean), int(dist.min), int(dist.max))
        except ValueError as e:
            raise _bad(f"{where}.alpha", dist.alpha, str(e)) from None


def _check_seed(cfg: Any) -> None:
    _check_int(cfg, "seed", 0)  # numpy's SeedSequence rejects negative seeds


def _validate_synthetic(cfg: Any, check_files: bool) -> None:
    _check_int(cfg, "num_requests", 1)
    _check_arrivals(cfg)
    _check_length(cfg.input_len, "input_len")
    _check_length(cfg.output_len, "output_len")
    if cfg.prompt_kind not in PROMPT_KINDS:
        raise _bad("prompt_kind", cfg.prompt_kind, f"must be one of {', '.join(PROMPT_KINDS)}")
    _check_int(cfg, "num_prefix_groups", 0)
    _check_int(cfg, "prefix_len", 0)
    # A prefix length without groups (or groups without a prefix) is almost surely a typo: say so.
    if cfg.num_prefix_groups > 0 and cfg.prefix_len == 0:
        raise _bad("prefix_len", 0, "must be >= 1 when num_prefix_groups > 0")
    if cfg.prefix_len > 0 and cfg.num_prefix_groups == 0:
        raise _bad("num_prefix_groups", 0, "must be >= 1 when prefix_len > 0")
    _check_classes(cfg)
    _check_seed(cfg)


def _validate_chat(cfg: Any, check_files: bool) -> None:
    _check_int(cfg, "num_requests", 1)
    _check_arrivals(cfg)
    _check_int(cfg, "max_tokens", 1)
    _check_classes(cfg)
    _check_seed(cfg)


def _validate_trace(cfg: Any, check_files: bool) -> None:
    if not _is_number(cfg.time_scale) or not math.isfinite(cfg.time_scale) or cfg.time_scale < 0:
        raise _bad("time_scale", cfg.time_scale, "must be a finite number >= 0")
    if cfg.max_requests is not None:
        _check_int(cfg, "max_requests", 1)
    _check_int(cfg, "default_output_len", 1)
    _check_arrivals(cfg)
    _check_seed(cfg)
    if check_files:
        _check_trace_path(cfg.path)


def _check_trace_path(path: str) -> None:
    if not path:
        raise _bad("path", path, "a trace workload needs the path of a .jsonl trace or a ShareGPT .json file")
    p = Path(path).expanduser()
    if p.suffix not in (".jsonl", ".json"):
        raise _bad("path", path, "must end in .jsonl (trace with arrival times) or .json (ShareGPT)")
    if not p.is_file():
        raise _bad("path", path, "no such file")


_VALIDATORS: dict[str, Callable[[Any, bool], None]] = {
    "synthetic": _validate_synthetic, "chat": _validate_chat, "trace": _validate_trace,
}


def validate_workload_config(cfg: Any, check_files: bool = True) -> None:
    """Raise ``ValueError`` naming the field, its bad value and what is allowed, if ``cfg`` is invalid.

    ``cfg`` is one of the config dataclasses or a ``DictConfig`` with the same fields. ``check_files=False``
    skips the trace file's existence check (used while a config object is still being built).
    """
    name = cfg.name
    if name not in _VALIDATORS:
        raise _bad("name", name, f"must be one of {', '.join(WORKLOAD_NAMES)}")
    _VALIDATORS[name](cfg, check_files)


# --------------------------------------------------------------------------------------------------------------
# Random building blocks
# --------------------------------------------------------------------------------------------------------------

def _rng(seed: int, stream: str) -> np.random.Generator:
    """An independent generator for one aspect of the workload (same seed -> same stream)."""
    return np.random.default_rng([int(seed), _STREAMS[stream]])


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
        raise _bad("length.kind", dist.kind, f"must be one of {', '.join(LENGTH_KINDS)}")
    return np.clip(np.rint(raw), lo, hi).astype(np.int64)


def _sample_choice(values: Sequence[Any], weights: Sequence[float], n: int, rng: np.random.Generator) -> list:
    p = np.asarray(weights, dtype=np.float64)
    idx = rng.choice(len(values), size=n, p=p / p.sum())
    return [values[i] for i in idx]


def _sample_priorities(cfg: Any, n: int, rng: np.random.Generator) -> list[int]:
    return [int(c) for c in _sample_choice(list(cfg.priority_classes), list(cfg.priority_weights), n, rng)]


def _sample_clients(cfg: Any, n: int, rng: np.random.Generator) -> list[str]:
    """Each request's client, drawn with the configured shares; the overall arrival process is unchanged."""
    names = [f"client{i}" for i in range(cfg.num_clients)]
    shares = getattr(cfg, "client_rate_shares", None)
    return _sample_choice(names, list(shares) if shares is not None else [1.0] * len(names), n, rng)


# --------------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------------

def load_chat_prompts() -> list[list[dict]]:
    """The shipped chat dataset: a list of conversations, each a list of ``{"role", "content"}`` messages."""
    text = (importlib.resources.files("nanovllm") / "data" / "chat_prompts.json").read_text(encoding="utf-8")
    return [item["messages"] for item in json.loads(text)]


@functools.lru_cache(maxsize=1)
def _text_words() -> tuple[str, ...]:
    """Every word of the chat dataset, in order: the raw material of ``prompt_kind="text"`` prompts."""
    return tuple(w for conv in load_chat_prompts() for m in conv for w in m["content"].split())


def _normal_token_ids(tokenizer: Any) -> np.ndarray:
    """Vocabulary ids that are not special tokens (a random prompt must not contain BOS/EOS/pad)."""
    return np.setdiff1d(np.arange(tokenizer.vocab_size), np.asarray(tokenizer.all_special_ids, dtype=np.int64))


def _random_tokens(ids: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    return ids[rng.integers(0, len(ids), size=n)].tolist()


def _text_tokens(tokenizer: Any, n: int, rng: np.random.Generator) -> list[int]:
    """Exactly ``n`` token ids of readable text: words from a random point of the dataset, cut to length."""
    words = _text_words()
    start = int(rng.integers(len(words)))
    count = n  # a word is at least one token nearly always, so n words usually suffice; double if not
    while True:
        text = " ".join(words[(start + i) % len(words)] for i in range(count))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= n:
            return list(ids[:n])
        count *= 2


def chat_token_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """A conversation's prompt ids through the tokenizer's chat template, ready for the assistant's turn
    (transformers 5 may return a BatchEncoding/dict instead of a list)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


# --------------------------------------------------------------------------------------------------------------
# The three workloads
# --------------------------------------------------------------------------------------------------------------

def _synthetic_prompts(cfg: Any, tokenizer: Any, input_lens: np.ndarray) -> list[list[int]]:
    """Each prompt: an optional shared prefix (its group's) + its own suffix of the sampled input length."""
    rng = _rng(cfg.seed, "prompts")
    if cfg.prompt_kind == "text":
        make = functools.partial(_text_tokens, tokenizer)
    else:
        make = functools.partial(_random_tokens, _normal_token_ids(tokenizer))
    if cfg.num_prefix_groups == 0:
        return [make(int(n), rng) for n in input_lens]
    prefix_rng = _rng(cfg.seed, "prefix")
    prefixes = [make(cfg.prefix_len, prefix_rng) for _ in range(cfg.num_prefix_groups)]
    # Groups are picked at random (seeded) rather than round robin so their reuse distances vary, as in real
    # traffic; strict round robin is the worst case for an LRU prefix cache.
    groups = prefix_rng.integers(0, cfg.num_prefix_groups, size=len(input_lens))
    return [prefixes[g] + make(int(n), rng) for g, n in zip(groups, input_lens)]


def _synthetic_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    n = cfg.num_requests
    arrivals = sample_arrival_times(n, cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    input_lens = sample_lengths(cfg.input_len, n, _rng(cfg.seed, "input_len"))
    output_lens = sample_lengths(cfg.output_len, n, _rng(cfg.seed, "output_len"))
    prompts = _synthetic_prompts(cfg, tokenizer, input_lens)
    priorities = _sample_priorities(cfg, n, _rng(cfg.seed, "priority"))
    clients = _sample_clients(cfg, n, _rng(cfg.seed, "client"))
    return [
        WorkloadRequest(arrival_time=float(arrivals[i]), prompt=prompts[i], max_tokens=int(output_lens[i]),
                        priority=priorities[i], client_id=clients[i], ignore_eos=bool(cfg.ignore_eos))
        for i in range(n)
    ]


def _chat_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    n = cfg.num_requests
    convs = load_chat_prompts()
    pick = _rng(cfg.seed, "chat_pick")
    # Whole shuffled passes over the dataset: every conversation is used once before any repeats.
    order = np.concatenate([pick.permutation(len(convs)) for _ in range(-(-n // len(convs)))])[:n]
    arrivals = sample_arrival_times(n, cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    priorities = _sample_priorities(cfg, n, _rng(cfg.seed, "priority"))
    clients = _sample_clients(cfg, n, _rng(cfg.seed, "client"))
    return [
        WorkloadRequest(arrival_time=float(arrivals[i]), prompt=chat_token_ids(tokenizer, convs[j]),
                        max_tokens=int(cfg.max_tokens), priority=priorities[i], client_id=clients[i],
                        ignore_eos=False, messages=convs[j])
        for i, j in enumerate(order)
    ]


def _line_error(path: Path, lineno: int, what: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: {what}")


def _get_int(obj: dict, key: str, lo: int | None, path: Path, lineno: int, default: int | None = None) -> int:
    """An integer field of a trace line (``lo=None``: any integer)."""
    value = obj.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or (lo is not None and value < lo):
        allowed = "an integer" if lo is None else f"an integer >= {lo}"
        raise _line_error(path, lineno, f"'{key}' must be {allowed}, got {value!r}")
    return value


def _parse_trace_line(obj: Any, path: Path, lineno: int, cfg: Any, token_ids: np.ndarray,
                      rng: np.random.Generator) -> WorkloadRequest:
    """One JSONL object -> a request; every problem names the file and (1-based) line."""
    if not isinstance(obj, dict):
        raise _line_error(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    t = obj.get("arrival_time")
    if not _is_number(t) or not math.isfinite(t) or t < 0:
        raise _line_error(path, lineno, f"'arrival_time' must be a number of seconds >= 0, got {t!r}")
    if "prompt" in obj:
        prompt: str | list[int] = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise _line_error(path, lineno, f"'prompt' must be a non-empty string, got {prompt!r}")
    elif "prompt_len" in obj:
        prompt = _random_tokens(token_ids, _get_int(obj, "prompt_len", 1, path, lineno), rng)
    else:
        raise _line_error(path, lineno, "needs 'prompt' (text) or 'prompt_len' (number of random tokens)")
    client = obj.get("client_id")
    if client is not None and not isinstance(client, str):
        raise _line_error(path, lineno, f"'client_id' must be a string, got {client!r}")
    request_id = obj.get("request_id")
    return WorkloadRequest(
        arrival_time=float(t) * cfg.time_scale, prompt=prompt,
        max_tokens=_get_int(obj, "output_len", 1, path, lineno, default=cfg.default_output_len),
        priority=_get_int(obj, "priority", None, path, lineno, default=0), client_id=client,
        ignore_eos=bool(cfg.ignore_eos), request_id=None if request_id is None else str(request_id))


def read_jsonl_trace(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """Requests of a JSONL trace (blank lines skipped), in file order, at most ``cfg.max_requests``."""
    path = Path(cfg.path).expanduser()
    token_ids = _normal_token_ids(tokenizer)
    rng = _rng(cfg.seed, "prompts")
    out: list[WorkloadRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if cfg.max_requests is not None and len(out) >= cfg.max_requests:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _line_error(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
            out.append(_parse_trace_line(obj, path, lineno, cfg, token_ids, rng))
    return out


_HUMAN, _GPT = ("human", "user"), ("gpt", "assistant", "chatgpt")


def _sharegpt_pair(entry: Any, path: Path, index: int) -> tuple[str, str] | None:
    """(first human turn, the reply after it) of one ShareGPT entry; None when it has no such pair."""
    convs = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(convs, list):
        raise ValueError(f"{path}: entry {index} must be an object with a 'conversations' list")
    for turn, reply in zip(convs, convs[1:]):
        if not isinstance(turn, dict) or not isinstance(reply, dict):
            raise ValueError(f"{path}: entry {index}: each turn must be an object with 'from' and 'value'")
        if turn.get("from") in _HUMAN and reply.get("from") in _GPT:
            if isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str) and turn["value"]:
                return turn["value"], reply["value"]
            return None
    return None


def read_sharegpt(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """ShareGPT JSON: first human turn -> prompt, the reply's token count -> max_tokens; synthetic arrivals.

    Entries without a human turn followed by a reply are skipped (real ShareGPT dumps contain many);
    the first ``max_requests`` usable entries are kept, in file order.
    """
    path = Path(cfg.path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file must hold a JSON list of conversations")
    pairs: list[tuple[str, str]] = []
    for index, entry in enumerate(data):
        if cfg.max_requests is not None and len(pairs) >= cfg.max_requests:
            break
        pair = _sharegpt_pair(entry, path, index)
        if pair is not None:
            pairs.append(pair)
    arrivals = sample_arrival_times(len(pairs), cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    return [
        WorkloadRequest(arrival_time=float(t) * cfg.time_scale, prompt=prompt,
                        max_tokens=max(1, len(tokenizer.encode(reply, add_special_tokens=False))),
                        ignore_eos=bool(cfg.ignore_eos))
        for t, (prompt, reply) in zip(arrivals, pairs)
    ]


def _trace_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    read = read_jsonl_trace if Path(cfg.path).suffix == ".jsonl" else read_sharegpt
    requests = read(cfg, tokenizer)
    if not requests:  # an empty run would "succeed" with no numbers: almost surely the wrong file
        raise ValueError(f"{cfg.path}: the trace holds no usable requests")
    return requests


_GENERATORS: dict[str, Callable[[Any, Any], list[WorkloadRequest]]] = {
    "synthetic": _synthetic_workload, "chat": _chat_workload, "trace": _trace_workload,
}


def generate_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """Validate ``cfg`` and build its requests, sorted by arrival time (ties keep generation order).

    Requests without an id get their index in that order (``"0"``, ``"1"``, ...).
    """
    validate_workload_config(cfg)
    requests = sorted(_GENERATORS[cfg.name](cfg, tokenizer), key=lambda r: r.arrival_time)
    for i, req in enumerate(requests):
        if req.request_id is None:
            req.request_id = str(i)
    return requests
