"""Sampling parameters and the sampler that turns logits into next tokens."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from nanovllm import kernels
from nanovllm.outputs import Logprob


GREEDY_BELOW_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names and meanings).

    ``temperature=0`` is greedy; ``top_k=-1`` and ``top_p=1`` disable those filters. ``seed`` gives the request
    its own random stream, so its output does not depend on what it was batched with.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = field(default=None)
    seed: int | None = None
    logprobs: int | None = None     # return the top-k log-probabilities of every generated token (and its own)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field and what is allowed (bools are not numbers here).
        ``max_logprobs``: the engine's cap on ``logprobs`` (``LLMEngine.make_request`` passes it)."""
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.stop_token_ids is not None and not (
                isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0 (top-k per token), got {self.logprobs!r}")
        if max_logprobs is not None and self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({max_logprobs}; raise the engine option max_logprobs), "
                             f"got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        # Like vLLM, a temperature below 1e-5 is greedy: dividing logits by it would overflow to inf.
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


# What the sampler returns for a row whose logits are not finite (NaN or +inf): no token is drawn from garbage;
# the scheduler fails that request with NON_FINITE_REASON and the rest of the batch goes on.
INVALID_TOKEN = -1
NON_FINITE_REASON = "the model produced non-finite logits (NaN or +inf); no token was sampled"


class Sampler:
    """Batched sampling: greedy rows take the argmax; the others are scaled by temperature, filtered by top-k
    and top-p, and drawn with their request's generator (or the engine's). A row with a NaN or +inf logit gets
    ``INVALID_TOKEN`` instead of a token (-inf is a legitimate "never this token")."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[int]:
        next_tokens, bad = greedy_tokens(logits)
        bad_rows = bad.tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy and not bad_rows[i]]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._probabilities(logits[rows].float(), [params[i] for i in random_rows])
            for j, i in enumerate(random_rows):
                next_tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
        return next_tokens.masked_fill(bad, INVALID_TOKEN).tolist()

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # float32 explicitly: a valid temperature may be a Python int past int64 (e.g. 2**63), which an inferred
        # integer tensor cannot hold.
        temperature = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32,
                                   device=logits.device).unsqueeze(1)
        logits = logits / temperature
        top_k = [p.top_k for p in params]
        if any(k > 0 for k in top_k):
            # Keep, per row, the logits at least as large as that row's k-th largest.
            # Clamped in Python: a top_k past int64 is valid (it keeps every token) but no tensor holds it.
            vocab = logits.shape[1]
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
            limited = k < vocab
            if limited.any():
                # The k-th largest value from topk over the largest k: sorting the whole vocabulary per row
                # costs far more. A row that keeps every token has -inf as its bound, which masks nothing.
                k_max = int(k[limited].max())
                kth = logits.topk(k_max, dim=-1).values.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1))
                kth = kth.masked_fill(~limited.unsqueeze(1), float("-inf"))
                logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=logits.device)
        if (top_p < 1).any():
            # Nucleus: drop tokens once the probability mass before them already reaches top_p.
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= top_p.unsqueeze(1)
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` [rows, vocab]: the argmax (first index on ties) as int64, and whether the row holds
    a NaN or +inf logit. On CPU one C++ pass over the logits in their own dtype (``nanovllm/csrc/sampling.cpp``);
    elsewhere, or if the kernels cannot be built, the same in torch ops."""
    if logits.device.type == "cpu" and logits.dim() == 2:
        kernels = _cpu_kernels()
        if kernels is not None:
            return kernels.greedy_sample(logits)
    logits = logits.float()
    bad = (logits.isnan() | (logits == float("inf"))).any(dim=-1)
    return logits.masked_fill(bad.unsqueeze(1), 0.0).argmax(dim=-1), bad


@functools.cache
def _cpu_kernels():
    """The compiled CPU kernels, or None where they cannot be built (the torch ops above then do the work; the
    failed build is not retried on every step)."""
    try:
        return kernels.load()
    except RuntimeError:
        return None


def top_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list[dict[int, Logprob] | None]:
    """Per row with ``ks[i]`` set: the ``ks[i]`` most likely tokens and the sampled one, with their
    log-probabilities under the model's raw distribution (before temperature and filters, as vLLM reports them)
    and 1-based ranks. Rows with ``ks[i] is None`` get None."""
    wanted = {i: k for i, k in enumerate(ks) if k is not None}
    rows = list(wanted)
    result: list[dict[int, Logprob] | None] = [None] * len(ks)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    k_max = max(wanted.values())
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    sampled = torch.tensor([tokens[i] for i in rows], device=logits.device)
    sampled_values = logprobs.gather(1, sampled[:, None])[:, 0]
    sampled_ranks = (logprobs > sampled_values[:, None]).sum(dim=-1) + 1
    for j, i in enumerate(rows):
        entry = {int(t): Logprob(float(v), rank + 1)
                 for rank, (t, v) in enumerate(zip(top_ids[j, : wanted[i]].tolist(), top_values[j, : wanted[i]].tolist()))}
        entry.setdefault(tokens[i], Logprob(float(sampled_values[j]), int(sampled_ranks[j])))
        result[i] = entry
    return result
