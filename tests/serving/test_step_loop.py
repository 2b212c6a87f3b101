"""One step loop: ``LLM.generate``, the Hydra serving loop (``serve``) and the HTTP server's engine thread
(``EngineLoop``) keep their books through the same ``StepLoop``, so the same requests on the same engine give the
same request and step records, whichever drives them. On the simulator: a virtual clock makes every time exact."""

from __future__ import annotations

import asyncio

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.engine.protocol import EngineClient
from nanovllm.engine.sim_runner import simulated_engine
from nanovllm.harness.serving import serve
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.server.engine_loop import EngineLoop

# (prompt length, max_tokens): prompts longer than the step budget are chunked, and the small KV cache preempts.
SHAPES = [(40, 12), (9, 30), (70, 5), (23, 17), (5, 25), (52, 9)]


def _engine(num_kv_blocks: int) -> EngineClient:
    config = EngineConfig(num_kv_blocks=num_kv_blocks, block_size=8, max_num_seqs=3, max_num_batched_tokens=32)
    # Step time grows with the batch, so the records' times depend on what each step ran.
    return simulated_engine(config, lambda features, now: 0.002 + 1e-4 * features["num_prefill_tokens"]
                            + 5e-4 * features["num_decode_seqs"])


def _prompt(i: int, length: int) -> list[int]:
    return [(17 * i + 3 * j) % 5000 + 10 for j in range(length)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _by_llm(num_kv_blocks: int) -> tuple[list, list]:
    llm = LLM.from_engine(_engine(num_kv_blocks))
    llm.generate([_prompt(i, n) for i, (n, _) in enumerate(SHAPES)], [_params(m) for _, m in SHAPES],
                 use_tqdm=False)
    return llm.last_requests, llm.last_steps


def _by_serve(num_kv_blocks: int) -> tuple[list, list]:
    engine = _engine(num_kv_blocks)
    workload = [WorkloadRequest(arrival_time=0.0, prompt=_prompt(i, n), max_tokens=m, ignore_eos=True,
                                request_id=str(i)) for i, (n, m) in enumerate(SHAPES)]
    result = serve(engine, workload, progress=False, clock=engine.runner.clock)
    return result.requests, result.steps


def _by_server_thread(num_kv_blocks: int) -> tuple[list, list]:
    engine = _engine(num_kv_blocks)

    async def run() -> EngineLoop:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        queues = []
        for i, (n, m) in enumerate(SHAPES):
            queue: asyncio.Queue = asyncio.Queue()
            loop.submit(loop.make_request(_prompt(i, n), _params(m), request_id=str(i)), queue)
            queues.append(queue)
        loop.start()
        for queue in queues:   # every request's stream, to its final delta
            final = False
            while not final:
                final = (await asyncio.wait_for(queue.get(), timeout=60))[1].final
        await asyncio.to_thread(loop.stop)
        return loop

    loop = asyncio.run(run())
    return loop.records, loop.steps


@pytest.mark.parametrize("num_kv_blocks", [12, 64], ids=["preempting", "roomy"])
def test_the_three_drivers_keep_the_same_records(num_kv_blocks: int) -> None:
    requests, steps = _by_llm(num_kv_blocks)
    assert sorted(r["request_id"] for r in requests) == [str(i) for i in range(len(SHAPES))]
    assert all(r["finish_reason"] == "length" for r in requests)
    assert [r["num_output_tokens"] for r in sorted(requests, key=lambda r: int(r["request_id"]))] == \
        [m for _, m in SHAPES]
    if num_kv_blocks == 12:
        assert sum(s["num_preempted"] for s in steps) > 0   # the small cache does preempt: that path is compared too
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for driver in (_by_serve, _by_server_thread):
        other_requests, other_steps = driver(num_kv_blocks)
        assert other_requests == requests, driver.__name__
        assert other_steps == steps, driver.__name__
