"""``validate_output``: run nano-vllm and transformers on the same prompts (greedy, same dtype) and compare token
by token, under one of the project's two correctness standards:

- exact: the float32 reference path (torch attention, HF's unfused projections) must be token-identical;
- close (vLLM's standard for fast paths: bfloat16, fused projections, the cpu kernel): tokens agree up to the
  first divergence, and there each side's token is among the other's top-5 logprobs.

The reference configuration is checked against the exact standard, every other one against the close one
(``--standard`` overrides). The check a user runs before trusting any timing on a new model or plugin.

    python -m nanovllm.validate [--model PATH] [--prompts FILE] [--max-tokens N] [--dtype bfloat16] ...
    python -m nanovllm.validate --quantization int8|gguf [--dtype bfloat16] ...

A third standard holds quantized weights (``--quantization``): perplexity on a held-out text within a stated
margin of the dense path's, with greedy agreement against the dense path reported.

FILE holds one prompt per line (``.txt``) or a JSON list of strings or chat conversations (``.json``).
Exits non-zero when a prompt fails the standard.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from nanovllm.chat_template import chat_token_ids
from nanovllm.config import torch_dtype

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Write a short poem about the sea.",
    "In a distant future, humanity has spread across the stars, and",
]


TOP_K = 5  # vLLM's closeness test: each side's token within the other's top 5 at the first divergence
EXACT, CLOSE = "exact", "close"
STANDARDS = {
    EXACT: "exact: token-identical to transformers",
    CLOSE: f"close (vLLM's): tokens equal up to the first divergence, there each side's token in the other's "
           f"top-{TOP_K} logprobs",
}


@dataclass
class PromptAgreement:
    prompt: str
    ours: list[int]
    reference: list[int]
    ours_top: list[set[int]] | None = None        # per generated position, our top-k token ids
    reference_top: list[set[int]] | None = None   # the same from transformers

    @property
    def close(self) -> bool:
        """vLLM's standard: identical, or at the first divergence each token is in the other's top-k."""
        if self.identical:
            return True
        d = self.matching_prefix
        if d >= min(len(self.ours), len(self.reference)) or self.ours_top is None or self.reference_top is None:
            return False
        return self.ours[d] in self.reference_top[d] and self.reference[d] in self.ours_top[d]

    def meets(self, standard: str) -> bool:
        return self.identical if standard == EXACT else self.close

    @property
    def matching_prefix(self) -> int:
        n = 0
        for a, b in zip(self.ours, self.reference):
            if a != b:
                break
            n += 1
        return n

    @property
    def identical(self) -> bool:
        return self.ours == self.reference


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return PromptAgreement("", a, b).matching_prefix


SIGN_TEST_ALPHA = 0.01


@dataclass
class AgreementSignTest:
    """Whether a fast path's greedy output stays with the exact model at least as long as a peer's does (the
    peer: transformers in the same reduced dtype), prompt by prompt. ``longer`` / ``shorter`` / ``ties``: prompts
    where ours agrees with the exact tokens for more / fewer / as many tokens as the peer's; ``p_value``: the
    one-sided sign test's chance of so many ``shorter`` among the untied prompts if ours were no worse."""

    longer: int
    shorter: int
    ties: int
    p_value: float

    @property
    def passed(self) -> bool:
        return self.p_value >= SIGN_TEST_ALPHA


def agreement_sign_test(ours: list[list[int]], peer: list[list[int]], exact: list[list[int]]) -> AgreementSignTest:
    """The guard against vacuous closeness, measured on the machine it runs on: vLLM's top-5 standard checks
    only the first divergence, so a path that diverged early on every prompt could still pass it. Rule: our
    tokens stay with the exact (float32) reference at least as long as the peer's reduced-precision tokens do,
    unless a one-sided sign test over the prompts rejects that at ``SIGN_TEST_ALPHA`` (p < 0.01). No threshold
    is tuned to a CPU: both sides round on the same machine, with its own kernels (AMX or not)."""
    diffs = [common_prefix(o, e) - common_prefix(p, e) for o, p, e in zip(ours, peer, exact, strict=True)]
    longer, shorter = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    untied = longer + shorter
    p_value = sum(math.comb(untied, k) for k in range(shorter, untied + 1)) / 2 ** untied
    return AgreementSignTest(longer, shorter, len(diffs) - untied, p_value)


def load_prompts(path: str | Path | None, tokenizer) -> list[tuple[str, list[int]]]:
    """(label, token ids) per prompt from a .txt (one per line) or .json (strings or chat conversations)."""
    if path is None:
        items: list = DEFAULT_PROMPTS
    else:
        path = Path(path)
        text = path.read_text()
        items = json.loads(text) if path.suffix == ".json" else [line for line in text.splitlines() if line.strip()]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append((item, tokenizer.encode(item)))
        else:
            messages = item["messages"] if isinstance(item, dict) else item
            prompts.append((messages[-1]["content"], chat_token_ids(tokenizer, messages)))
    return prompts


def reference_greedy(model, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """transformers ``generate``, greedy, one prompt at a time (no padding, so nothing perturbs its arithmetic):
    the reference every parity check compares against. Outputs end with EOS when generation stopped on it."""
    import torch

    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids], device=model.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else None, do_sample=False,
                pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0,
            )
            outputs.append(generated[0, len(ids):].tolist())
    return outputs


def reference_greedy_top(model, prompts: list[list[int]], max_tokens: int,
                         k: int = TOP_K) -> list[tuple[list[int], list[set[int]]]]:
    """Like ``reference_greedy``, plus the top-``k`` token ids of the raw logits at every generated position."""
    import torch

    results = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0,
            )
            tokens = generated.sequences[0, len(ids):].tolist()
            tops = [set(step[0].float().topk(k).indices.tolist()) for step in generated.logits]
            results.append((tokens, tops))
    return results


def is_reference_config(llm) -> bool:
    """Whether an engine runs the exact reference path: float32, unfused projections, torch attention, a
    float32 KV cache (an 8-bit one is held to the close standard)."""
    engine = llm.engine
    return (engine.config.dtype == "float32" and not engine.config.fast_path
            and engine.runner.backend.registered_name == "torch" and engine.config.kv_cache_dtype == "auto")


@dataclass
class ValidationReport:
    standard: str                   # EXACT or CLOSE
    results: list[PromptAgreement]
    num_preemptions: int = 0        # in our engine's run (a tiny num_kv_blocks forces them)
    max_step_tokens: int = 0        # the most tokens one step computed (max_num_batched_tokens chunks prefills)

    @property
    def passed(self) -> bool:
        return all(r.meets(self.standard) for r in self.results)


def validate_output(
    model: str | None = None,
    prompts: str | Path | list[list[int]] | None = None,
    max_tokens: int = 32,
    dtype: str = "float32",
    standard: str | None = None,
    references: list[tuple[list[int], list[set[int]]]] | None = None,
    **llm_options,
) -> ValidationReport:
    """Greedy generation from nano-vllm (all prompts in one ``generate`` call) and from transformers ``generate``
    in the same dtype (one prompt at a time, unpadded); returns the per-prompt comparison and the standard it
    is held to (``standard=None``: exact for the reference path, close for every fast path). ``prompts`` may
    be token-id lists; ``references`` reuses ``reference_greedy_top`` results already computed for them."""
    # torch, transformers and the engine only when a check runs (this module stays light for --help).
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM, SamplingParams

    if standard not in (None, EXACT, CLOSE):
        raise ValueError(f"standard must be {EXACT!r}, {CLOSE!r} or None (decide from the path), got {standard!r}")
    llm = LLM(model=model, dtype=dtype, **llm_options)
    standard = standard or (EXACT if is_reference_config(llm) else CLOSE)
    if isinstance(prompts, list):
        pairs = [(llm.tokenizer.decode(ids), ids) for ids in prompts]
    else:
        pairs = load_prompts(prompts, llm.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP_K)
    outputs = llm.generate([ids for _, ids in pairs], params, use_tqdm=False)
    if references is None:
        reference_model = AutoModelForCausalLM.from_pretrained(
            llm.engine.model_dir, dtype=torch_dtype(dtype), trust_remote_code=False, use_safetensors=True)
        references = reference_greedy_top(reference_model.eval(), [ids for _, ids in pairs], max_tokens)
    results = [
        PromptAgreement(label, output.token_ids, ref_tokens,
                        [{t for t, lp in entry.items() if lp.rank <= TOP_K} for entry in output.logprobs or []],
                        ref_top)
        for (label, _), output, (ref_tokens, ref_top) in zip(pairs, outputs, references)
    ]
    steps = llm.last_steps
    return ValidationReport(standard, results, sum(s["num_preempted"] for s in steps),
                            max((s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps), default=0))


HELD_OUT_TEXT = Path(__file__).with_name("data") / "held_out.txt"
# The quantized standard: perplexity on the held-out text at most this much above the dense path's (relative),
# measured on SmolLM2-135M's 523 held-out tokens against the dense weights of the same file (docs/quantization.md):
# int8 W8A8 -0.25% (float32) / +0.45% (bfloat16), GGUF Q4_1 on its own blocks +0.39% / +0.79%. Each margin sits
# a little above the worst of its two.
QUANTIZED_PPL_MARGIN = {"int8": 0.015, "gguf": 0.015}


@dataclass
class QuantizedReport:
    """A quantized path against the dense one (same model file, same activation dtype): perplexity on the
    held-out text, which the standard bounds, and the greedy agreement on the prompts, which it reports."""

    quantization: str
    perplexity: float
    dense_perplexity: float
    results: list[PromptAgreement]  # ours = quantized, reference = dense, with both sides' top-5

    @property
    def margin(self) -> float:
        return QUANTIZED_PPL_MARGIN[self.quantization]

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.dense_perplexity

    @property
    def passed(self) -> bool:
        return self.perplexity_ratio <= 1 + self.margin

    @property
    def token_agreement(self) -> float:
        """The share of generated tokens before the first divergence from the dense path, over all prompts."""
        total = sum(max(len(r.ours), len(r.reference)) for r in self.results)
        return sum(r.matching_prefix for r in self.results) / max(total, 1)


def sequence_perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``token_ids`` under ``llm``'s model, teacher-forced in one prefill
    through its own attention backend and KV cache (blocks from 0: call it on an engine that holds no request)."""
    import torch  # deferred with the engine, as in validate()

    from nanovllm.attention.base import AttentionMetadata

    runner = llm.engine.runner
    block_size = runner.block_size
    num_blocks = -(-len(token_ids) // block_size)
    if llm.engine.scheduler.running or llm.engine.scheduler.waiting:
        raise RuntimeError("sequence_perplexity needs an idle engine: it writes the KV cache from block 0")
    if num_blocks > runner.kv_cache.shape[2]:
        raise ValueError(f"the text ({len(token_ids)} tokens) needs {num_blocks} KV blocks; the engine has "
                         f"{runner.kv_cache.shape[2]}")
    ids = torch.tensor(token_ids, dtype=torch.long)
    meta = AttentionMetadata(query_lens=[len(token_ids)], seq_lens=[len(token_ids)],
                             block_tables=[list(range(num_blocks))],
                             slot_mapping=torch.arange(len(token_ids), dtype=torch.long), block_size=block_size)
    with torch.inference_mode():
        runner.backend.plan(meta)
        hidden = runner.model(ids, torch.arange(len(token_ids)), runner.backend)
        logits = runner.model.compute_logits(hidden[:-1]).float()
        nll = torch.nn.functional.cross_entropy(logits, ids[1:])
    return math.exp(nll.item())


def validate_quantized(quantization: str, model: str | None = None, prompts: str | Path | None = None,
                       max_tokens: int = 32, dtype: str = "bfloat16", text: str | Path | None = None,
                       **llm_options) -> QuantizedReport:
    """The quantized standard: ``quantization``'s perplexity on the held-out text (``text``, default
    ``nanovllm/data/held_out.txt``) within ``QUANTIZED_PPL_MARGIN`` of the dense path's in the same ``dtype``,
    and its greedy tokens on the prompts compared with the dense path's (agreement reported, with vLLM's top-5
    closeness at the first divergence)."""
    from nanovllm import LLM, SamplingParams  # deferred with torch, as in validate()

    if quantization not in QUANTIZED_PPL_MARGIN:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZED_PPL_MARGIN)}, got {quantization!r}")
    reports = {}
    for name, quant in (("dense", None), ("quantized", quantization)):
        llm = LLM(model=model, dtype=dtype, quantization=quant, **llm_options)
        ids = llm.tokenizer.encode(Path(text or HELD_OUT_TEXT).read_text())
        ppl = sequence_perplexity(llm, ids)
        pairs = load_prompts(prompts, llm.tokenizer)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP_K)
        outputs = llm.generate([p for _, p in pairs], params, use_tqdm=False)
        tops = [[{t for t, lp in entry.items() if lp.rank <= TOP_K} for entry in o.logprobs or []] for o in outputs]
        reports[name] = (ppl, pairs, [o.token_ids for o in outputs], tops)
        del llm
    (dense_ppl, pairs, dense_tokens, dense_tops), (ppl, _, tokens, quant_tops) = reports["dense"], reports["quantized"]
    results = [PromptAgreement(label, ours, ref, our_top, ref_top) for (label, _), ours, ref, our_top, ref_top
               in zip(pairs, tokens, dense_tokens, quant_tops, dense_tops)]
    return QuantizedReport(quantization, ppl, dense_ppl, results)


def print_quantized(report: QuantizedReport) -> None:
    print(f"standard: quantized ({report.quantization}): held-out perplexity at most "
          f"{100 * report.margin:.1f}% above the dense path's")
    print(f"perplexity {report.perplexity:.3f} vs dense {report.dense_perplexity:.3f}: "
          f"{100 * (report.perplexity_ratio - 1):+.2f}% ({'OK' if report.passed else 'FAIL'})")
    for i, r in enumerate(report.results):
        status = "OK  " if r.identical else "NEAR" if r.close else "DIFF"
        print(f"{status} prompt {i}: {r.matching_prefix}/{max(len(r.ours), len(r.reference))} tokens agree with "
              f"the dense path  {r.prompt[:60]!r}")
    print(f"greedy agreement with the dense path: {100 * report.token_agreement:.1f}% of tokens before the first "
          f"divergence; {sum(r.close for r in report.results)}/{len(report.results)} prompts close (top-{TOP_K})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--prompts", default=None, help=".txt (one per line) or .json file of prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="float32 (default, the exact reference) or bfloat16")
    parser.add_argument("--fuse-projections", choices=("auto", "true", "false"), default="auto",
                        help="fused q/k/v and gate/up (auto: unless float32)")
    parser.add_argument("--standard", choices=(EXACT, CLOSE), default=None,
                        help="default: exact for the reference path, close for any fast path")
    parser.add_argument("--scheduler", default="fcfs")
    parser.add_argument("--allocator", default="paged")
    parser.add_argument("--attention", default="torch", help="torch (the reference, default), cpu, auto, ...")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="small values force preemption")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="small values chunk prefills")
    parser.add_argument("--quantization", choices=tuple(QUANTIZED_PPL_MARGIN), default=None,
                        help="check quantized weights against the dense path (the quantized standard)")
    args = parser.parse_args(argv)
    fuse = {"auto": None, "true": True, "false": False}[args.fuse_projections]
    if args.quantization is not None:
        try:
            quantized = validate_quantized(args.quantization, args.model, args.prompts, args.max_tokens,
                                           dtype=args.dtype, attention=args.attention, block_size=args.block_size)
        except (ValueError, KeyError, FileNotFoundError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print_quantized(quantized)
        return 0 if quantized.passed else 1
    try:
        report = validate_output(
            args.model, args.prompts, args.max_tokens, dtype=args.dtype, standard=args.standard,
            scheduler=args.scheduler, allocator=args.allocator, attention=args.attention,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens, fuse_projections=fuse,
        )
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"standard: {STANDARDS[report.standard]}")
    print(f"engine: {report.num_preemptions} preemptions, at most {report.max_step_tokens} tokens per step")
    for i, r in enumerate(report.results):
        status = "OK  " if r.identical else "NEAR" if r.meets(report.standard) else "DIFF"
        print(f"{status} prompt {i}: {r.matching_prefix}/{max(len(r.ours), len(r.reference))} tokens agree  "
              f"{r.prompt[:60]!r}")
    identical = sum(r.identical for r in report.results)
    passing = sum(r.meets(report.standard) for r in report.results)
    print(f"{identical}/{len(report.results)} prompts token-identical to transformers; "
          f"{passing}/{len(report.results)} meet the {report.standard} standard")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
