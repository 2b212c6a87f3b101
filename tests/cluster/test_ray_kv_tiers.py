"""KV tiers on real replicas (Ray actors): the driver's views of each replica carry the same tier-aware prefix
matches its own scheduler computes (the pool, then its host tier, then the shared store, which one replica's
blocks reach for both), so ``cache_aware`` prefers the replica whose pool holds a prefix; and prefill/decode
disaggregation through the shared store (``kv_transfer=shared_store``) generates what one engine does. No Ray
process (the module's one Ray instance, ``local_ray``, stopped after its tests) and no store file is left
afterwards."""

from __future__ import annotations

import os

import pytest

from helpers import SMALL
from test_ray_cluster import local_ray, tiny_model  # noqa: F401 -- fixtures

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

# One float32 block (K and V of 16 tokens) of the tiny model the replicas run: what they do with their tiers
# does not depend on the model, and each actor loads it in a fraction of the default model's time.
BLOCK_BYTES = (SMALL["num_hidden_layers"] * 2 * 16 * SMALL["num_key_value_heads"]
               * SMALL["hidden_size"] // SMALL["num_attention_heads"] * 4)
ENGINE = dict(num_kv_blocks=16, max_model_len=256, warmup=False, allocator="prefix")
TEXTS = ["In a distant kingdom, beyond the seven mountains and the great silver river, lived a wise old queen. ",
         "The history of the Roman Empire spans many centuries, and its roads still cross the continent today. ",
         "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside every green leaf. "]


@pytest.fixture(scope="module")
def engine(tiny_model) -> dict:
    return dict(ENGINE, model=str(tiny_model))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_shared")
    yield path
    assert not list(path.rglob("*.kv")), "the replicas' shared blocks outlived the cluster (persist=false)"


@pytest.fixture
def tiered_llm(store, local_ray, engine):
    """Two replicas with tiers on the module's Ray instance; closed after its test (a cluster still running would
    hold the CPUs the next test's actors need)."""
    from nanovllm import LLM

    # A small pool, a host tier of 3 blocks written through, the shared store below it (what host evicts).
    llm = LLM(cluster=dict(replicas=2), router="round_robin", **engine,
              kv_offload=dict(name="host", capacity=3 * BLOCK_BYTES, policy="write_through",
                              below=dict(name="shared", path=str(store), store="views")))
    yield llm
    llm.close()


def test_ray_views_carry_each_replicas_tier_aware_prefix_matches(tiered_llm):
    from nanovllm import SamplingParams
    from routers.cache_aware import CacheAware

    cluster = tiered_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompts = [TEXTS[0] * 6, "Hi", TEXTS[1] * 6, "Hey", TEXTS[2] * 6, "Yo"]   # round robin: the long ones on 0
    for i in range(0, len(prompts), 2):   # one after another, so the later prompts push the first out of the pool
        tiered_llm.generate(prompts[i:i + 2], params, use_tqdm=False)
    assert [r.num_routed for r in cluster.replicas] == [3, 3]
    for text in (TEXTS[0] * 6, TEXTS[2] * 6):
        probe = cluster.make_request(text, params)
        views = [replica.view(probe, cluster._prefix_match) for replica in cluster.replicas]
        own = ray.get([r.actor.cached_prefix_by_tier.remote(probe.token_ids) for r in cluster.replicas])
        assert [view.prefix_match_by_tier for view in views] == own   # the mirror is each scheduler's answer
        full = (len(probe.token_ids) - 1) // 16 * 16
        assert int(views[0].prefix_match_tokens) == full > 0        # replica 0 computed it: pool, host, store
        assert own[1]["primary"] == own[1]["host"] == 0 < own[1]["shared"]   # replica 1: in the store only
        assert views[1].prefix_match_local_tokens == 0
        if text == TEXTS[0] * 6:   # long left replica 0's host tier: all of it reached the store
            assert own[1]["shared"] == full
        cluster._last_keys = (None, [])
    # The first prompt left replica 0's pool and host tier for the store; the last one is still in its pool.
    first, last = (ray.get(cluster.replicas[0].actor.cached_prefix_by_tier.remote(
        cluster.make_request(text, params).token_ids)) for text in (TEXTS[0] * 6, TEXTS[2] * 6))
    assert first["shared"] > 0 and last["primary"] > 0
    router = CacheAware()
    probe = cluster.make_request(TEXTS[2] * 6 + "Why?", params)
    views = [replica.view(probe, cluster._prefix_match) for replica in cluster.replicas]
    assert router.route(probe, views, 0.0) == 0                     # its pool has it: cache_aware prefers it


def test_ray_replicas_report_which_tier_each_requests_cached_tokens_came_from(tiered_llm):
    """A request that ended in an actor comes back to the driver with its cached tokens split by tier (what its
    request record says), not only their sum: a prompt run again after its blocks left the pool is served from
    the host tier or the shared store, and the split adds up to ``num_cached_tokens``."""
    from nanovllm import SamplingParams

    cluster = tiered_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2)
    ended = []

    def serve(texts):
        for text in texts:
            cluster.add_request(cluster.make_request(text, params))
        while cluster.has_unfinished():
            ended.extend(cluster.step().finished)
    serve([TEXTS[0] * 6, TEXTS[1] * 6])
    serve([TEXTS[2] * 6, TEXTS[1] * 5, TEXTS[2] * 5])   # round robin: 0, 1, 0, 1, 0
    serve([TEXTS[0] * 6])   # on replica 1, whose pool never held it: replica 0 wrote it through to the store
    assert all(r.num_cached_tokens_by_tier is not None for r in ended)
    for request in ended:
        assert sum(request.num_cached_tokens_by_tier.values()) == request.num_cached_tokens
    again = ended[-1]
    assert again.replica == 1 and again.num_cached_tokens_by_tier["shared"] > 0


def test_prefill_and_decode_replicas_hand_the_kv_over_through_the_shared_store(store, local_ray, engine):
    from nanovllm import LLM, SamplingParams

    from test_ray_cluster import PROMPTS

    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = PROMPTS + [TEXTS[1] * 2]
    shared = dict(name="shared", path=str(store), store="pd")
    llm = LLM(cluster=dict(prefill_replicas=1, decode_replicas=1, kv_transfer="shared_store"), **engine,
              kv_offload=shared)
    try:
        served = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    alone = LLM(**engine).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in served] == [o.token_ids for o in alone]
    for output in served:   # every prompt's blocks moved, none lost on the way
        assert output.metrics.kv_transfer_bytes == -(-len(output.prompt_token_ids) // 16) * BLOCK_BYTES
