"""The issue-14 mutation audit, by hand: apply each realistic one-line bug, run the tests that must catch it.

Each ``Mutation`` names a file, the exact original snippet (which must occur once), the mutated snippet and the
test node ids that must fail on it. The audit copies the repository's tracked files to a temporary directory
once, checks that the named tests pass there unmutated (the baseline), then for each mutation writes the
mutated file into the copy, runs the named tests in a fresh ``python -m pytest`` (with ``PYTHONPATH`` at the
copy, so the copy's code is imported, never the checkout's), and restores the file. The working tree is never
written. A mutation is *caught* when pytest reports failing tests (exit status 1); a pass, or any other status
(a collection error, no tests run), is *NOT caught*.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python experiments/mutation_audit.py            # all mutations
    ... experiments/mutation_audit.py --only prefix-whole-prompt vtc-weights-swapped          # some of them
    ... experiments/mutation_audit.py --skip-model     # leave out mutations whose tests load the model
    ... experiments/mutation_audit.py --fast-set       # also run the whole fast test set on each mutation

Exit status 0 when every mutation run was caught, 1 otherwise. ``--markdown`` prints the table of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The fast tier of the subjects `make mutate` runs too (see pyproject's [tool.mutmut]): no test there loads the model.
FAST_SET = ["tests/policies", "tests/allocators", "tests/engine/test_scheduler.py", "tests/engine/test_sampling.py",
            "tests/engine/test_abort.py", "-m", "not slow"]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str                               # relative to the repository root
    edits: tuple[tuple[str, str], ...]      # (original snippet, mutated snippet); each original occurs once
    tests: tuple[str, ...]                  # node ids that must fail on the mutation
    needs_model: bool = False


def _one(name: str, path: str, original: str, mutated: str, *tests: str, needs_model: bool = False) -> Mutation:
    return Mutation(name, path, ((original, mutated),), tests, needs_model)


MUTATIONS: list[Mutation] = [
    # -- priority: the victim
    _one("priority-victim-most-urgent", "policies/priority.py",
         "victim = max(running, key=lambda r: (r.priority, r.arrival_time))",
         "victim = min(running, key=lambda r: (r.priority, r.arrival_time))",
         "tests/policies/test_policies.py::test_priority_preempts_the_least_urgent_latest_running_request"),
    _one("priority-victim-earliest-arrival", "policies/priority.py",
         "victim = max(running, key=lambda r: (r.priority, r.arrival_time))",
         "victim = max(running, key=lambda r: (r.priority, -r.arrival_time))",
         "tests/policies/test_policies.py::test_priority_preempts_the_least_urgent_latest_running_request"),
    _one("priority-preempts-for-an-equal", "policies/priority.py",
         "victim.priority > waiting.priority", "victim.priority >= waiting.priority",
         "tests/policies/test_policies.py::test_priority_preempts_the_least_urgent_latest_running_request"),
    _one("default-victim-most-urgent", "nanovllm/policy.py",
         "return max(candidates, key=lambda r: (self.priority(r, now), r.arrival_time))",
         "return min(candidates, key=lambda r: (self.priority(r, now), r.arrival_time))",
         "tests/policies/test_policies.py::test_priority_preempts_the_least_urgent_latest_running_request"),
    # -- prefix cache
    _one("prefix-whole-prompt", "allocators/prefix.py",
         "max_blocks = (request.num_tokens - 1) // self.block_size",
         "max_blocks = request.num_tokens // self.block_size",
         "tests/allocators/test_allocators.py::test_prefix_cache_never_matches_a_whole_prompt_and_takes_hit_blocks_out_of_the_free_pool[prefix]"),
    _one("radix-whole-prompt", "allocators/radix.py",
         "for i in range((request.num_tokens - 1) // self.block_size):",
         "for i in range(request.num_tokens // self.block_size):",
         "tests/allocators/test_allocators.py::test_prefix_cache_never_matches_a_whole_prompt_and_takes_hit_blocks_out_of_the_free_pool[radix]"),
    _one("prefix-hit-left-evictable", "allocators/prefix.py",
         "            if self._ref_count[block] == 0:\n                self.eviction.pin(block)",
         "            if self._ref_count[block] < 0:\n                self.eviction.pin(block)",
         "tests/allocators/test_allocators.py::test_prefix_cache_never_matches_a_whole_prompt_and_takes_hit_blocks_out_of_the_free_pool[prefix]",
         "tests/allocators/test_allocators.py::test_a_matched_block_is_never_evicted_for_another_request[prefix]"),
    _one("radix-hit-left-evictable", "allocators/radix.py",
         "                self.eviction.pin(node.block)",
         "                self.eviction.hit(node.block)",
         "tests/allocators/test_allocators.py::test_a_matched_block_is_never_evicted_for_another_request[radix]"),
    # -- admission
    _one("watermark-ignored", "nanovllm/engine/scheduler.py",
         "reserve = self.watermark_blocks if self.running else 0", "reserve = 0",
         "tests/engine/test_scheduler.py::test_admission_keeps_the_watermark_free_while_others_run"),
    _one("admission-after-memory-preemption", "nanovllm/engine/scheduler.py",
         "        budget = self._schedule_running(out, budget, now)\n"
         "        # After a preemption for memory, admitting new work would only thrash the cache (vLLM does the same).\n"
         "        if len(out.preempted) == num_policy_preemptions:",
         "        budget = self._schedule_running(out, budget, now)\n"
         "        # After a preemption for memory, admitting new work would only thrash the cache (vLLM does the same).\n"
         "        if True:",
         "tests/engine/test_scheduler.py::test_no_admission_in_a_step_that_preempted_for_memory"),
    # -- preemption
    _one("preemption-keeps-computed-tokens", "nanovllm/engine/scheduler.py",
         "        self.allocator.free(request)\n        request.num_computed_tokens = 0\n        request.num_preemptions",
         "        self.allocator.free(request)\n        request.num_preemptions",
         "tests/engine/test_scheduler.py::test_memory_pressure_preempts_the_latest_arrival_which_forgets_its_work_and_recomputes_it_all"),
    # -- sampling
    Mutation("temperature-after-filters", "nanovllm/sampling.py",
             (("        logits = logits / temperature\n        top_k = ", "        top_k = "),
              ("        return logits.softmax(dim=-1)\n", "        return (logits / temperature).softmax(dim=-1)\n")),
             ("tests/engine/test_sampling.py::test_temperature_scales_logits_before_top_p_filters_them",)),
    _one("top-p-keeps-one-too-few", "nanovllm/sampling.py",
         "drop_sorted = mass_before >= top_p.unsqueeze(1)",
         "drop_sorted = sorted_probs.cumsum(dim=-1) >= top_p.unsqueeze(1)",
         "tests/engine/test_sampling.py::test_top_k_and_top_p_restrict_the_support",
         "tests/engine/test_sampling.py::test_temperature_scales_logits_before_top_p_filters_them"),
    _one("top-k-drops-the-kth", "nanovllm/sampling.py",
         "logits = logits.masked_fill(logits < kth, float(\"-inf\"))",
         "logits = logits.masked_fill(logits <= kth, float(\"-inf\"))",
         "tests/engine/test_sampling.py::test_top_k_and_top_p_restrict_the_support"),
    # -- stop logic
    _one("stop-ids-ignored-under-ignore-eos", "nanovllm/request.py",
         "if params.stop_token_ids and last in params.stop_token_ids:",
         "if not params.ignore_eos and params.stop_token_ids and last in params.stop_token_ids:",
         "tests/engine/test_sampling.py::test_stop_token_ids_stop_even_when_eos_is_ignored"),
    _one("max-tokens-off-by-one", "nanovllm/request.py",
         "if self.num_output_tokens >= params.max_tokens", "if self.num_output_tokens > params.max_tokens",
         "tests/engine/test_sampling.py::test_a_request_stops_at_exactly_max_tokens_or_max_model_len"),
    # -- policies
    _one("vtc-weights-swapped", "policies/fair.py",
         "weight = self.output_weight if is_decode else self.input_weight",
         "weight = self.input_weight if is_decode else self.output_weight",
         "tests/policies/test_policies.py::test_vtc_charges_prompt_tokens_at_input_weight_and_decodes_at_output_weight"),
    _one("mlfq-quantum-ignored", "policies/mlfq.py",
         "int(math.log2(1 + service / self.quantum))", "int(math.log2(1 + service / 64))",
         "tests/policies/test_policies.py::test_mlfq_levels_follow_the_quantum_are_capped_and_reset_on_finish"),
    _one("sjf-ignores-generated-tokens", "policies/sjf.py",
         "remaining_output = max(self.predicted_output_len(request) - request.num_output_tokens, 0)",
         "remaining_output = self.predicted_output_len(request)",
         "tests/policies/test_policies.py::test_sjf_remaining_work_counts_uncomputed_prompt_and_generated_tokens_and_floors_each_part_at_zero"),
    _one("lpm-ignores-the-cache", "policies/lpm.py",
         "return (1, -self.cached_prefix_len(request), request.arrival_time)",
         "return (1, 0, request.arrival_time)",
         "tests/policies/test_policy_effects.py"),
    # -- the chunk boundary after a recompute (the model runner decides which rows sample)
    _one("sample-at-every-chunk-past-the-prompt", "nanovllm/engine/model_runner.py",
         "if end == request.num_tokens:", "if end >= request.num_prompt_tokens:",
         "tests/engine/test_engine.py::test_chunked_recompute_after_preemption_matches_transformers", needs_model=True),
]


def _copy_repository(destination: Path) -> None:
    """The tracked files plus untracked, not-ignored ones (what a commit of the working tree would hold)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _pytest(copy: Path, targets: list[str], log: Path) -> int:
    environment = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *targets]
    with log.open("w") as out:
        return subprocess.run(command, cwd=copy, env=environment, stdout=out, stderr=subprocess.STDOUT).returncode


def _apply(copy: Path, mutation: Mutation) -> str:
    """Write the mutated file into ``copy``; return its original text (to restore)."""
    target = copy / mutation.path
    original = text = target.read_text()
    for old, new in mutation.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"error: mutation {mutation.name!r}: its snippet occurs {count} times in "
                             f"{mutation.path} (it must occur exactly once):\n{old}")
        text = text.replace(old, new)
    target.write_text(text)
    return original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--skip-model", action="store_true", help="leave out mutations whose tests load the model")
    parser.add_argument("--fast-set", action="store_true", help="also run the whole fast test set per mutation")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    parser.add_argument("--markdown", action="store_true", help="print the result as a markdown table")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if (not args.only or m.name in args.only) and not (args.skip_model and m.needs_model)]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"error: --only: unknown mutation(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(m.name for m in MUTATIONS)}")
    rows: list[tuple[Mutation, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="mutation-audit-") as tmp:
        copy = Path(tmp)
        _copy_repository(copy)
        logs = copy / ".audit-logs"
        logs.mkdir()
        if not args.no_baseline:
            named = sorted({t for m in chosen for t in m.tests})
            status = _pytest(copy, named, logs / "baseline.log")
            if status != 0:
                sys.stdout.write((logs / "baseline.log").read_text()[-4000:])
                raise SystemExit(f"error: the named tests fail (status {status}) before any mutation: fix them first")
            print(f"baseline: {len(named)} named test targets pass unmutated", flush=True)
        for mutation in chosen:
            original = _apply(copy, mutation)
            started = time.perf_counter()
            try:
                log = logs / f"{mutation.name}.log"
                status = _pytest(copy, list(mutation.tests), log)
                verdict = "caught" if status == 1 else f"NOT caught (pytest status {status})"
                if args.fast_set:
                    fast = _pytest(copy, FAST_SET, logs / f"{mutation.name}.fast.log")
                    verdict += "; fast set: " + ("caught" if fast == 1 else f"NOT caught (status {fast})")
                if status not in (0, 1):
                    sys.stdout.write(log.read_text()[-2000:])
            finally:
                (copy / mutation.path).write_text(original)
            rows.append((mutation, verdict, time.perf_counter() - started))
            print(f"{mutation.name:40s} {verdict:28s} {rows[-1][2]:6.1f}s", flush=True)
    missed = [m.name for m, verdict, _ in rows if "NOT" in verdict]
    if args.markdown:
        print("\n| mutation | file | caught by | caught |\n|---|---|---|---|")
        for mutation, verdict, _ in rows:
            tests = ", ".join(f"`{t.split('::')[-1] if '::' in t else t}`" for t in mutation.tests)
            print(f"| {mutation.name} | `{mutation.path}` | {tests} | {verdict} |")
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations caught" + (f"; NOT caught: {', '.join(missed)}"
                                                                               if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
