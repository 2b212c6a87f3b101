"""The policy-library study: every registered policy on two workloads (shared prefixes; bursty with priorities
and per-request SLOs), with the hash prefix cache and the radix cache, and its results table.

    python experiments/policy_library.py                 # model-free, ~1 minute on 2 CPU cores
    python -m nanovllm.run -m +experiment=policy_library # the same grid on the real engine (Hydra multirun)

This script drives the real ``Scheduler``, policies and allocators without the model
(``nanovllm.harness.scheduler_sim``): a step lasts 16 ms plus 1 ms per token it computes, so long prefills make
long steps as on real hardware, and every number is reproducible on any machine. The workloads, engine
limits and policy options come from the same Hydra files as the multirun (``conf/workload/shared_prefix.yaml``,
``conf/workload/bursty_slo.yaml``, ``conf/experiment/policy_library.yaml``, ``conf/scheduler/*.yaml``). The table
goes to stdout and to ``experiments/results/policy_library.md``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from nanovllm import POLICIES
from nanovllm.harness.scheduler_sim import make_request, simulate
from nanovllm.harness.workload import SyntheticWorkloadConfig, generate_workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "policy_library.md"
WORKLOADS = ("shared_prefix", "bursty_slo")
ALLOCATORS = ("prefix", "radix")
SEED = 0
STEP_OVERHEAD, SECONDS_PER_TOKEN = 16, 0.001


def _load(path: Path) -> dict:
    """A conf file as a plain dict, its ``${seed}`` resolved and Hydra's ``defaults`` list dropped."""
    node = OmegaConf.merge(OmegaConf.create({"seed": SEED}), OmegaConf.create({"node": OmegaConf.load(path)}))
    data = OmegaConf.to_container(node, resolve=True)["node"]
    data.pop("defaults", None)
    return data


class _TokenIds:
    """What the synthetic generator needs of a tokenizer for random prompts: the vocabulary size and the ids
    it must not emit (SmolLM2's 49,152 ids; its first 17 are special)."""

    vocab_size = 49152
    all_special_ids = list(range(17))


def _requests(workload: str):
    cfg = SyntheticWorkloadConfig(**{k: v for k, v in _load(ROOT / "conf" / "workload" / f"{workload}.yaml").items()
                                     if k not in ("input_len", "output_len")},
                                  **{k: _dist(v) for k, v in _load(ROOT / "conf" / "workload" /
                                                                    f"{workload}.yaml").items()
                                     if k in ("input_len", "output_len")})
    return [make_request(w.request_id, w.prompt, w.max_tokens, arrival=w.arrival_time, priority=w.priority,
                         client_id=w.client_id, slo_ttft=w.ttft_slo_ms / 1000, slo_e2el=w.e2el_slo_ms / 1000)
            for w in generate_workload(cfg, _TokenIds())]


def _dist(values: dict):
    from nanovllm.harness.workload import LengthDist
    return LengthDist(**values)


def _policy_spec(name: str) -> dict:
    path = ROOT / "conf" / "scheduler" / f"{name}.yaml"
    return _load(path) if path.exists() else {"name": name}


def _row(workload: str, allocator: str, policy: str, run) -> dict:
    done = run.done()
    ttft = np.array([r.first_token_time - r.arrival_time for r in done]) * 1000
    tpot = np.array([(r.finish_time - r.first_token_time) / (r.num_output_tokens - 1) for r in done
                     if r.num_output_tokens > 1]) * 1000
    good = sum(r.first_token_time - r.arrival_time <= r.slo_ttft and r.finish_time - r.arrival_time <= r.slo_e2el
               for r in done)
    duration = max(r.finish_time for r in run.requests) - min(r.arrival_time for r in run.requests)
    return dict(
        workload=workload, allocator=allocator, policy=policy,
        throughput=sum(r.num_output_tokens for r in done) / duration,
        ttft_p50=np.percentile(ttft, 50), ttft_p99=np.percentile(ttft, 99),
        tpot_p50=np.percentile(tpot, 50), tpot_p99=np.percentile(tpot, 99),
        goodput=good / len(run.requests), failed=len(run.requests) - len(done),
        hit_rate=sum(r.num_cached_tokens for r in done) / sum(r.num_prompt_tokens for r in done),
        preemptions=sum(r.num_preemptions for r in run.requests),
        recomputed=sum(r.num_recomputed_tokens for r in run.requests),
        evictions=run.scheduler.allocator.num_evictions,
    )


def study() -> list[dict]:
    engine = _load(ROOT / "conf" / "experiment" / "policy_library.yaml")["engine"]
    rows = []
    for workload in WORKLOADS:
        for allocator in ALLOCATORS:
            for policy in POLICIES.names():
                run = simulate(_policy_spec(policy), _requests(workload), allocator=allocator,
                               num_blocks=engine["num_kv_blocks"], block_size=16,
                               max_num_seqs=engine["max_num_seqs"],
                               max_num_batched_tokens=engine["max_num_batched_tokens"], clock="tokens",
                               step_overhead=STEP_OVERHEAD, time_per_token=SECONDS_PER_TOKEN)
                rows.append(_row(workload, allocator, policy, run))
    return rows


def table(rows: list[dict]) -> str:
    header = ("| workload | allocator | policy | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput "
              "| failed | hit rate | preemptions | recomputed tok | evictions |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['allocator']} | {r['policy']} | {r['throughput']:.0f} "
                     f"| {r['ttft_p50']:,.0f} / {r['ttft_p99']:,.0f} | {r['tpot_p50']:.0f} / {r['tpot_p99']:.0f} "
                     f"| {r['goodput']:.2f} | {r['failed']} | {r['hit_rate']:.2f} | {r['preemptions']} "
                     f"| {r['recomputed']} | {r['evictions']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    text = table(study())
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
