"""Prefill/decode disaggregation: a request prefilled on one replica (its first token sampled there), its K/V
moved, decoded on another. Real engines in one process are token-identical to one engine and to transformers
(chunked prefill on the prefill side, preemption on the decode side), bf16 meets the closeness standard, the
decode side's prefix cache still hits; simulated, the transfer takes what its link says, a full decode replica
keeps requests waiting, every registered router serves either pool, and the command line composes it all."""

from __future__ import annotations

import pytest

from nanovllm.allocator import prefix_block_keys
from nanovllm.cluster.config import ClusterConfig
from nanovllm.cluster.disaggregated import DisaggregatedCluster, pool_routers
from nanovllm.cluster.kv_transfer import KV_TRANSFERS, KVTransferError
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload
from nanovllm.router import ROUTERS
from nanovllm.sampling import SamplingParams

TOKEN_COST = {"name": "sim", "step_time": "token_cost"}
SIM_ENGINE = dict(num_kv_blocks=64, max_num_seqs=8, dtype="bfloat16")
LINK = {"name": "link", "bandwidth": 1.0e9, "latency": 1.0e-3}


def real_cluster(prefill: dict, decode: dict, router="round_robin", transfer=None):
    """One prefill and one decode engine on the default model in this process (they share its weights)."""
    from nanovllm.engine.engine import LLMEngine

    base = dict(num_kv_blocks=256, max_model_len=1024, warmup=False)
    engines = [LLMEngine(EngineConfig(**{**base, **options}), allocator="prefix") for options in (prefill, decode)]
    prefill_router, decode_router = pool_routers(router)
    return DisaggregatedCluster(engines[:1], engines[1:], prefill_router, decode_router,
                                KV_TRANSFERS.build(transfer) if transfer is not None else None)


def generate(cluster, prompts, params):
    """Every prompt at once through the cluster's engine-like interface; the ended requests in prompt order."""
    requests = [cluster.make_request(prompt, params, request_id=str(i)) for i, prompt in enumerate(prompts)]
    for request in requests:
        cluster.add_request(request)
    steps = []
    while cluster.has_unfinished():
        steps.append(cluster.step().record)
    return requests, steps


def test_float32_disaggregated_is_token_identical_to_one_engine_and_transformers(llm, parity_prompts, hf_greedy):
    """Chunked prefill on the prefill replica (32-token chunks) and preemptions on the small decode replica."""
    from conftest import PARITY_MAX_TOKENS

    cluster = real_cluster(dict(max_num_batched_tokens=32), dict(num_kv_blocks=40, max_num_seqs=16))
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_MAX_TOKENS)
    requests, steps = generate(cluster, parity_prompts, params)
    alone = llm.generate(parity_prompts, params, use_tqdm=False)
    assert [r.output_token_ids for r in requests] == [o.token_ids for o in alone] == hf_greedy
    handed = [r for r in requests if r.handoff is not None]
    assert len(handed) >= len(requests) - 1   # all but one that ends at its first token (EOS)
    assert all(r.handoff.prefill_replica == 0 and r.replica == 1 and r.handoff.num_bytes > 0 for r in handed)
    assert any(s["replica"] == 0 and 0 < s["num_prefill_tokens"] <= 32 for s in steps)
    assert max(len(p) for p in parity_prompts) > 32                     # so long prompts came in chunks
    assert sum(s["num_preempted"] for s in steps if s["replica"] == 1) > 0   # and the decode side preempted
    assert not any(s["num_prefill_tokens"] > 32 for s in steps if s["replica"] == 0)


def test_bfloat16_disaggregated_meets_the_closeness_standard(llm):
    from nanovllm.validate import PromptAgreement

    cluster = real_cluster(dict(dtype="bfloat16"), dict(dtype="bfloat16"))
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?"]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    fast, _ = generate(cluster, prompts, params)
    reference = llm.generate(prompts, params, use_tqdm=False)

    def top5(logprobs):
        return [{t for t, lp in entry.items() if lp.rank <= 5} for entry in logprobs]

    agreements = [PromptAgreement(q, f.output_token_ids, a.token_ids, top5(f.logprobs), top5(a.logprobs))
                  for q, a, f in zip(questions, reference, fast)]
    assert all(r.close for r in agreements), [(r.prompt, r.ours, r.reference) for r in agreements]
    assert sum(r.matching_prefix for r in agreements) >= 12


def test_the_decode_sides_prefix_cache_still_hits_and_the_bytes_are_the_prompts_blocks(llm):
    cluster = real_cluster({}, {})
    prompt = llm.engine.tokenizer.encode("The history of the Roman Empire spans many centuries, and " * 4)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first, _ = generate(cluster, [prompt], params)
    again, steps = generate(cluster, [prompt], params)
    assert again[0].output_token_ids == first[0].output_token_ids == llm.generate(
        [prompt], params, use_tqdm=False)[0].token_ids
    decode_hits = sum(s["prefix_hit_tokens"] for s in steps if s["replica"] == 1)
    assert decode_hits == (len(prompt) - 1) // 16 * 16 > 0   # every full block but the one holding the last token
    engine = cluster.replicas[0].engine
    assert first[0].handoff.num_bytes == engine.allocator.blocks_for(len(prompt)) * engine.kv_block_bytes


# A shared-store transfer that loses the store's second block of every prompt between the prefill's write and
# the decode replica's read (as another replica evicting it would).
class LosesSecondBlock(KV_TRANSFERS.get("shared_store")):   # type: ignore[misc]
    def send_request(self, engine, request, data):
        handle = super().send_request(engine, request, data)
        if handle["blocks"] >= 2:
            offload = engine.offload
            tier = offload.tiers[offload.tier_index("shared")]
            key = self._blocks(request, engine.config.block_size, 2)[1][0]
            tier.path_of(key).unlink()
        return handle


@pytest.mark.parametrize("policy", ["evict", "write_through"])
def test_the_shared_store_hands_the_kv_over_token_identical_to_one_engine(llm, parity_prompts, hf_greedy, tmp_path,
                                                                           policy):
    """kv_transfer=shared_store: the prefill writes the prompt's full blocks to the store (none of them again
    when its tier wrote them through) and its partial last block for the decode replica alone; the decode
    replica reads every one back through its shared tier; nothing is recomputed and no one-off block is left."""
    from conftest import PARITY_MAX_TOKENS

    store = dict(name="shared", path=str(tmp_path), store="pd", policy=policy)
    cluster = real_cluster(dict(kv_offload=store), dict(kv_offload=store), transfer="shared_store")
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_MAX_TOKENS)
    requests, steps = generate(cluster, parity_prompts, params)
    assert [r.output_token_ids for r in requests] == hf_greedy
    handed = [r for r in requests if r.handoff is not None]
    assert len(handed) >= len(requests) - 1 and not any(r.handoff.failed for r in handed)
    engine = cluster.replicas[0].engine
    for r in handed:   # the record's fields as with any transfer: the prompt's blocks moved, none recomputed
        assert r.handoff.num_tokens == len(r.prompt_token_ids) and r.handoff.loaded
        assert r.handoff.num_bytes == engine.allocator.blocks_for(len(r.prompt_token_ids)) * engine.kv_block_bytes
        assert r.handoff.decode_start_time is not None and r.handoff.transfer_time > 0
    decode = cluster.replicas[1].engine
    assert sum(r.num_recomputed_tokens for r in handed) == 0
    blocks = LosesSecondBlock._blocks
    stored = {key for r in handed for key, _ in blocks(r, 16, len(r.prompt_token_ids) // 16)}
    if policy == "write_through":   # and every prompt's blocks a prefix cache may match, as each prefill ends
        stored |= {key for r in requests for key in prefix_block_keys(r.prompt_token_ids, 16)}
    files = {int(f.stem, 16) for f in engine.offload.tiers[0].directory.glob("*.kv")}
    assert files == {key & 0xFFFFFFFFFFFFFFFF for key in stored}   # the full blocks; no partial block is left
    tails = sum(len(r.prompt_token_ids) % 16 > 0 for r in handed)   # partial last blocks, one-off
    assert engine.offload.stats["shared"].blocks_written == len(stored) + tails   # each once, by transfer or tier
    assert decode.offload.stats["shared"].blocks_loaded == sum(
        engine.allocator.blocks_for(len(r.prompt_token_ids)) for r in handed)


def test_a_block_the_shared_store_lost_is_recomputed_on_the_decode_side(llm, tmp_path):
    store = dict(name="shared", path=str(tmp_path), store="lost")
    cluster = real_cluster(dict(kv_offload=store), dict(kv_offload=store), transfer=LosesSecondBlock())
    prompt = llm.engine.tokenizer.encode("The history of the Roman Empire spans many centuries, and " * 4)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    [request], steps = generate(cluster, [prompt], params)
    assert request.output_token_ids == llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert request.handoff.num_tokens == 16 and not request.handoff.failed   # block 0 came; from block 1 on, computed
    assert request.num_recomputed_tokens == len(prompt) - 16   # the prompt past block 0, on the decode side


def test_the_shared_store_transfer_needs_a_shared_tier_naming_the_field(llm):
    with pytest.raises(ValueError, match="kv_offload must have a shared tier"):
        real_cluster({}, {}, transfer="shared_store")


def test_kv_that_do_not_fit_the_decode_replica_fail_that_request_with_the_reason(llm):
    """A decode replica of another block size cannot load the K/V: that request fails naming why."""
    cluster = real_cluster({}, dict(block_size=32))
    requests, _ = generate(cluster, ["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=6))
    assert requests[0].error.startswith("kv transfer: K/V of shape") and "block size" in requests[0].error


# -- simulated -------------------------------------------------------------------------------------------------

def workload(tokenizer, n=40, rate=40.0, prompt=256, output=16, seed=0):
    return generate_workload(SyntheticWorkloadConfig(
        num_requests=n, request_rate=rate, seed=seed, input_len=LengthDist(kind="uniform", mean=prompt,
                                                                           range_ratio=0.5),
        output_len=LengthDist(kind="fixed", mean=output)), tokenizer)


def simulated(prefill=1, decode=1, router="round_robin", transfer=LINK, overrides=None, **engine):
    config = ClusterConfig(prefill_replicas=prefill, decode_replicas=decode, kv_transfer=transfer,
                           replica_overrides=overrides or {})
    return ServedCluster.simulated(config, router, TOKEN_COST, None, EngineConfig(**{**SIM_ENGINE, **engine}))


def test_a_simulated_transfer_takes_latency_plus_bytes_over_bandwidth_one_at_a_time_per_link():
    served = simulated()
    result = served.serve(workload(served.engine.tokenizer, n=1))
    (record,) = result.requests
    assert record["kv_transfer_time"] == pytest.approx(1.0e-3 + record["kv_transfer_bytes"] / 1.0e9)
    assert record["kv_arrival_time"] == pytest.approx(record["first_token_time"] + record["kv_transfer_time"])
    assert record["prefill_replica"] == 0 and record["replica"] == 1
    # A burst: transfers out of the one prefill replica queue on its link, so none overlaps another.
    slow = simulated(transfer={**LINK, "bandwidth": 2.0e7})
    burst = slow.serve(workload(slow.engine.tokenizer, n=12, rate=1000.0)).requests
    spans = sorted((r["kv_arrival_time"] - r["kv_transfer_bytes"] / 2.0e7 - 1e-3, r["kv_arrival_time"])
                   for r in burst)
    assert all(start >= previous_end - 1e-9 for (_, previous_end), (start, _) in zip(spans, spans[1:]))
    assert max(r["kv_transfer_time"] for r in burst) > 2 * min(r["kv_transfer_time"] for r in burst)


def test_a_simulated_shared_store_transfer_is_priced_on_the_hardwares_shared_tier_link():
    import yaml

    from helpers import REPO

    hardware = yaml.safe_load((REPO / "conf/hardware/h100_sxm.yaml").read_text())
    link = hardware["kv_tier_links"]["shared"]
    config = ClusterConfig(prefill_replicas=1, decode_replicas=1, kv_transfer="shared_store")
    served = ServedCluster.simulated(config, "round_robin", TOKEN_COST, hardware,
                                     EngineConfig(**SIM_ENGINE, kv_offload="shared"))
    (record,) = served.serve(workload(served.engine.tokenizer, n=1)).requests
    assert record["kv_transfer_time"] == pytest.approx(link["latency"] + record["kv_transfer_bytes"] / link["bandwidth"])
    with pytest.raises(ValueError, match="kv_offload must have a shared tier"):
        ServedCluster.simulated(config, "round_robin", TOKEN_COST, hardware, EngineConfig(**SIM_ENGINE))


def test_a_decode_replica_without_free_blocks_keeps_requests_waiting_and_none_is_lost():
    served = simulated(decode=1, overrides={1: {"num_kv_blocks": 40}})
    result = served.serve(workload(served.engine.tokenizer, n=30, rate=200.0, output=48))
    assert len(result.requests) == 30 and all(r["error"] is None for r in result.requests)
    waits = [r["decode_start_time"] - r["kv_arrival_time"] for r in result.requests]
    assert max(waits) > 0.05   # some waited on the decode replica for blocks
    table = result.summary["per_replica"]
    assert table["1"]["peak_kv_usage"] > 0.9 and table["1"]["num_preemptions"] >= 0
    split = result.summary["disaggregation"]
    assert split["handed_off"] == 30 and split["decode_queue_p99_ms"] > 50


@pytest.mark.parametrize("name", ROUTERS.names())
def test_every_registered_router_serves_either_pool(name):
    served = simulated(prefill=2, decode=2, router={"name": "round_robin", "prefill": name, "decode": name})
    result = served.serve(workload(served.engine.tokenizer, n=24, rate=60.0))
    assert len(result.requests) == 24 and all(r["error"] is None for r in result.requests)
    assert {r["prefill_replica"] for r in result.requests} <= {0, 1}
    assert {r["replica"] for r in result.requests} <= {2, 3}
    assert served.cluster.router.registered_name == served.cluster.decode_router.registered_name == name


def test_the_summary_splits_ttft_and_counts_each_pools_work():
    served = simulated(prefill=1, decode=2)
    result = served.serve(workload(served.engine.tokenizer, n=40))
    split = result.summary["disaggregation"]
    records = result.requests
    assert split["kv_transfer_bytes_total"] == sum(r["kv_transfer_bytes"] for r in records)
    assert split["ttft_queue_p50_ms"] + split["ttft_prefill_p50_ms"] > 0
    assert 0 < split["prefill_pool_busy"] <= 1 and 0 < split["decode_pool_busy"] <= 1
    table = result.summary["per_replica"]
    assert table["0"]["requests"] == 40 == table["1"]["requests"] + table["2"]["requests"]
    assert [s["pool"] for s in result.summary["replica_settings"]] == ["prefill", "decode", "decode"]
    assert result.summary["kv_transfer"] == "link" and result.summary["router_decode"] == "round_robin"
    from nanovllm.harness.cluster import format_per_replica

    assert "disaggregated (1 prefill + 2 decode): p50 TTFT queue" in format_per_replica(result.summary)


def test_shared_memory_moves_the_bytes_and_leaves_no_file(tmp_path):
    import torch

    transfer = KV_TRANSFERS.build({"name": "shared_memory", "directory": str(tmp_path)})
    data = torch.randn(2, 2, 3, 4, 1, 8).to(torch.bfloat16)
    handle = transfer.send("r", data)
    assert torch.equal(transfer.receive(handle), data) and not list(tmp_path.iterdir())
    with pytest.raises(KVTransferError, match="is gone"):
        transfer.receive(handle)
    transfer.discard(transfer.send("s", data))
    assert not list(tmp_path.iterdir())


# -- the command line ----------------------------------------------------------------------------------------

def test_the_command_line_composes_pools_routers_and_a_link_preset():
    from test_cluster_sim import compose_run

    from nanovllm.harness.run import check_config
    from nanovllm.harness.runners import served_engine

    cfg = compose_run("runner=sim", "runner.step_time=token_cost", "cluster.prefill_replicas=1",
                      "cluster.decode_replicas=2", "router.prefill=least_loaded", "router.decode=cache_aware",
                      "kv_transfer=infiniband", "workload=synthetic", "workload.num_requests=20",
                      "workload.request_rate=20")
    checked = check_config(cfg)
    assert checked.cluster.replicas == 3 and checked.cluster.kv_transfer["bandwidth"] == 4.0e10
    served = served_engine(checked.runner, checked.hardware, checked.engine, cluster=checked.cluster,
                           router=checked.router, scheduler=checked.scheduler, allocator=checked.allocator,
                           attention=checked.attention)
    assert served.cluster.router.registered_name == "least_loaded"
    assert served.cluster.decode_router.registered_name == "cache_aware"
    result = served.serve(generate_workload(cfg.workload, served.engine.tokenizer))
    assert len(result.requests) == 20 and result.summary["disaggregation"]["handed_off"] > 0


@pytest.mark.parametrize("overrides, message", [
    (["runner=sim", "cluster.prefill_replicas=1"], r"needs both pools: cluster.prefill_replicas and "
                                                  r"cluster.decode_replicas >= 1 \(got 1 and 0\)"),
    (["runner=sim", "cluster.prefill_replicas=1", "cluster.decode_replicas=1", "cluster.replicas=3"],
     r"cluster.replicas=3 contradicts cluster.prefill_replicas \+ cluster.decode_replicas = 2"),
    (["runner=sim", "cluster.replicas=2", "router.prefill=least_loaded"],
     r"router.prefill routes a pool of prefill/decode disaggregation"),
    (["runner=sim", "cluster.prefill_replicas=1", "cluster.decode_replicas=1", "router.decode=nope"],
     r"unknown router 'nope'"),
    (["runner=sim", "cluster.prefill_replicas=1", "cluster.decode_replicas=1", "kv_transfer.bandwidth=-1"],
     r"kv_transfer.bandwidth must be > 0"),
])
def test_bad_disaggregation_options_fail_before_anything_loads_naming_the_field(overrides, message):
    from test_cluster_sim import compose_run

    from nanovllm.harness.run import check_config

    with pytest.raises((ValueError, KeyError), match=message):
        check_config(compose_run(*overrides))


def test_a_simulated_link_without_figures_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"has no bandwidth to simulate with: set kv_transfer.bandwidth"):
        simulated(transfer={"name": "link"})


def test_the_live_dashboard_draws_both_pools_replicas(tmp_path):
    """``live=web`` on a disaggregated cluster: every replica of both pools gets its line from ``steps.jsonl``."""
    import json

    from helpers import serve_with_live_loggers
    from nanovllm.harness.live.web import RunDashboard

    served = simulated(prefill=1, decode=2)
    result = serve_with_live_loggers(served, workload(served.engine.tokenizer, n=30), tmp_path)
    assert json.loads((tmp_path / "engine.json").read_text())["num_replicas"] == 3
    view = RunDashboard(tmp_path)
    view.layout()
    view.update()
    assert sorted(view.replica_srcs) == [0, 1, 2]
    for replica, source in view.replica_srcs.items():
        assert source.data["running"] == [s["num_running"] for s in result.steps if s["replica"] == replica]
