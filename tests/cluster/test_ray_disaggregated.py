"""Prefill/decode disaggregation on real processes: a prefill and a decode replica in Ray actors, the K/V moved
between them through shared memory (and through Ray's object store), generate what one engine does; a transfer
that fails is recomputed by the decode replica (the same tokens), frees blocks on both sides and the rest go on; a
dead decode replica fails what it held with the reason; nothing is left behind (no Ray process once the module's
one Ray instance stops, no shared-memory file)."""

from __future__ import annotations

import glob
import os
import time

import pytest

from helpers import SMALL
from test_ray_cluster import PROMPTS, local_ray, tiny_engine, tiny_model  # noqa: F401 -- fixtures

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

LONG_PROMPT = "In a distant kingdom, beyond the seven mountains and the great silver river, " * 5  # > 64 tokens: 5+ blocks

# A real shared-memory transfer that refuses K/V of 4 blocks or more on arrival (fault injection in the
# decode replica's process, where a lost segment or a dead sender shows up).
FAILING_TRANSFER = '''
from nanovllm.cluster.kv_transfer import KVTransferError, SharedMemoryTransfer, register_kv_transfer

@register_kv_transfer("refuses_long")
class RefusesLong(SharedMemoryTransfer):
    def receive(self, handle):
        if handle["shape"][2] >= 4:
            self.discard(handle)
            raise KVTransferError("injected: K/V of 4 blocks or more are refused")
        return super().receive(handle)
'''


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/nanovllm-kv-*"))


def run(cluster, prompts, params):
    """The prompts at once through the cluster's engine-like interface; the ended requests in prompt order."""
    requests = [cluster.make_request(p, params) for p in prompts]
    for request in requests:
        cluster.add_request(request)
    while cluster.has_unfinished():
        cluster.step()
    return requests


@pytest.fixture(scope="module")
def pd_llm(tmp_path_factory, local_ray, tiny_engine):
    """The module cluster, on the module's Ray instance (``local_ray`` checks that no Ray process is left)."""
    from nanovllm import LLM

    plugin = tmp_path_factory.mktemp("plugins") / "refuses_long.py"
    plugin.write_text(FAILING_TRANSFER)
    files = shm_files()
    llm = LLM(cluster=dict(prefill_replicas=1, decode_replicas=1, kv_transfer="refuses_long"),
              plugins=[str(plugin)], allocator="prefix", **tiny_engine)
    yield llm
    llm.close()
    assert shm_files() <= files


@pytest.fixture(scope="module")
def alone(tiny_engine):
    from nanovllm import LLM

    return LLM(allocator="prefix", **tiny_engine)


def test_the_ray_object_store_moves_the_kv_as_well(alone, local_ray, tiny_engine):
    """First: its cluster closed (its actors stopped) before the module cluster holds the cores."""
    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(cluster=dict(prefill_replicas=1, decode_replicas=1, kv_transfer="ray"), allocator="prefix",
             **tiny_engine) as llm:
        served = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in served] == [o.token_ids for o in alone.generate(PROMPTS, params, use_tqdm=False)]
    assert all(o.metrics.kv_transfer_bytes > 0 for o in served)


def test_one_prefill_and_one_decode_process_generate_what_one_engine_does(pd_llm, alone):
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    served = pd_llm.generate(PROMPTS, params, use_tqdm=False)
    reference = alone.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in served] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in served] == [o.finish_reason for o in reference]
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]   # the tiny model's, float32 K and V
    block_bytes = 2 * SMALL["num_hidden_layers"] * 16 * SMALL["num_key_value_heads"] * head_dim * 4
    for output in served:
        blocks = -(-len(output.prompt_token_ids) // 16)
        assert output.metrics.kv_transfer_bytes == blocks * block_bytes
        assert 0 < output.metrics.kv_transfer_time < 5.0
    assert [r.num_routed for r in pd_llm.engine.replicas] == [4, 4]


def test_a_failed_transfer_is_recomputed_on_the_decode_side_frees_blocks_on_both_sides_and_the_rest_go_on(
        pd_llm, alone):
    """The decode replica refuses the long prompt's K/V (``refuses_long``): it computes that prompt itself, so the
    request still ends with what one engine generates, its record saying the transfer failed."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    requests = run(pd_llm.engine, [LONG_PROMPT, *PROMPTS], params)
    failed = requests[0]
    assert failed.handoff.failed and [r.handoff.failed for r in requests[1:]] == [False] * len(PROMPTS)
    reference = alone.generate([LONG_PROMPT, *PROMPTS], params, use_tqdm=False)
    assert [r.output_token_ids for r in requests] == [o.token_ids for o in reference]
    assert all(r.error is None for r in requests)
    # Both replicas hold no block once it is over (cached prefix blocks count as free).
    states = [ray.get(replica.actor.run.remote([], None)) for replica in pd_llm.engine.replicas]
    assert all(s["state"]["num_free_blocks"] == s["state"]["num_total_blocks"] for s in states)


def test_a_dead_decode_replica_fails_what_it_held_with_the_reason_and_nothing_is_lost(pd_llm):
    """Last test of the module cluster: it loses its decode replica."""
    from nanovllm import SamplingParams

    cluster = pd_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)   # the tiny model steps fast
    requests = [cluster.make_request(p, params) for p in PROMPTS]
    for request in requests:
        cluster.add_request(request)
    ended = []
    killed = False
    deadline = time.monotonic() + 120
    while cluster.has_unfinished() and time.monotonic() < deadline:
        if not cluster.wait_for_step(0.05):
            continue
        output = cluster.step()
        ended += output.finished
        if not killed and output.record["replica"] == 1:
            cluster.kill_replica(1)
            killed = True
    assert killed and sorted(r.request_id for r in ended) == sorted(r.request_id for r in requests)
    reasons = {r.error.split(":")[0] if r.error.startswith("replica") else r.error for r in requests}
    assert "replica 1 died" in reasons
    assert reasons <= {"replica 1 died", "no live decode replica is left to hand the request off to"}
    # What arrives now cannot be decoded anywhere: it fails after its prefill, naming why.
    (late,) = run(cluster, ["Hello there"], SamplingParams(temperature=0.0, max_tokens=4))
    assert late.error == "no live decode replica is left to hand the request off to"
