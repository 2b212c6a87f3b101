"""KV tiers on the simulator (issue 57): the same tier and offload-policy classes run payload-free, moves cost
simulated time on each tier's link, a ``shared`` store makes one replica's prefix a hit on another, routers see
tier-aware matches, per-tier figures reach records and summaries, and the multi-turn working set is set by its
option. Fast: the default model's config, no weights, a token-cost step time."""

from __future__ import annotations

import json

import pytest
import yaml

from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.engine.kv_offload import CachedPrefix
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.sim.calibrate import compute_seconds, fit_profile
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.simulate import Simulation, tier_links
from nanovllm.harness.sim.step_time import working_steps
from nanovllm.harness.workload.config import LengthDist, MultiTurnWorkloadConfig
from nanovllm.harness.workload.generate import generate_workload
from nanovllm.kv_tiers.disk import DiskTier
from nanovllm.kv_tiers.host import HostTier
from nanovllm.kv_tiers.shared import _SIMULATED_STORES, SharedTier
from nanovllm.request import Request
from nanovllm.router import ReplicaView
from nanovllm.sampling import SamplingParams
from nanovllm.serving.step_records import StepKeeper, StepRecords
from routers.cache_aware import CacheAware

OVERHEAD = 0.01   # seconds per step, whatever the batch: every second beyond it is a tier move
STEP_TIME = {"name": "token_cost", "step_overhead": OVERHEAD, "time_per_token": 0.0}
LINKS = {"host": {"bandwidth": 1e9, "latency": 1e-3}, "disk": {"bandwidth": 1e8, "latency": 5e-3},
         "shared": {"bandwidth": 5e8, "latency": 2e-3}}
HARDWARE = Hardware(name="test", peak_flops={"bfloat16": 1e15}, memory_bandwidth=1e12, memory_bytes=8e10,
                    kv_tier_links=LINKS)


def simulation(kv_offload, num_kv_blocks=24, allocator="prefix", **engine) -> Simulation:
    config = EngineConfig(dtype="bfloat16", num_kv_blocks=num_kv_blocks, max_num_seqs=4, kv_offload=kv_offload,
                          **engine)
    return Simulation.build(config, STEP_TIME, allocator=allocator, hardware=HARDWARE)


def sessions(tokenizer, rate=4.0, working_set=None, num_sessions=6, turns=3, seed=0):
    return generate_workload(MultiTurnWorkloadConfig(
        num_sessions=num_sessions, request_rate=rate, turns=LengthDist(kind="fixed", mean=turns, max=64),
        user_len=LengthDist(kind="fixed", mean=48, max=4096), reply_len=LengthDist(kind="fixed", mean=8, max=64),
        think_time_s=0.5, working_set_tokens=working_set, seed=seed), tokenizer)


def test_simulated_tiers_are_the_real_classes_without_payload():
    sim = simulation({"name": "host", "capacity": 1 << 26, "below": {"name": "disk", "capacity": 1 << 28}})
    tiers = sim.engine.offload.tiers
    assert [type(t) for t in tiers] == [HostTier, DiskTier]
    assert all(not t.context.payload for t in tiers)
    assert not tiers[1].directory.exists()   # a simulated disk writes no file
    result = sim.serve(sessions(sim.engine.tokenizer))
    host, disk = result.summary["kv_tiers"]["host"], result.summary["kv_tiers"]["disk"]
    assert host["blocks_written"] > 0 and host["hit_tokens"] + disk["hit_tokens"] > 0
    assert all(r["finish_reason"] == "length" for r in result.requests)


def test_every_step_pays_its_moves_on_each_tiers_link():
    """duration = the step-time model's + per tier that moved: latency + bytes / bandwidth (host over its link,
    disk over its own): nothing overlaps, as in the real engine, whose copies run inside the step."""
    sim = simulation({"name": "host", "capacity": 1 << 22, "below": {"name": "disk", "capacity": 1 << 28}})
    result = sim.serve(sessions(sim.engine.tokenizer))
    moved = 0
    for step in result.steps:
        if step["num_prefill_tokens"] + step["num_decode_seqs"] == 0:
            continue
        expected = OVERHEAD
        for name, counts in step["kv_tiers"].items():
            nbytes = counts["bytes_loaded"] + counts["bytes_written"]
            if nbytes:
                expected += LINKS[name]["latency"] + nbytes / LINKS[name]["bandwidth"]
                moved += 1
        assert step["duration"] == pytest.approx(expected, rel=1e-9)
    summary = result.summary["kv_tiers"]
    assert moved > 0 and summary["disk"]["bytes_loaded"] > 0
    # Load time is the reading share of each tier's link time: the slow disk link dominates per byte.
    for name in ("host", "disk"):
        per_byte = summary[name]["load_seconds"] / summary[name]["bytes_loaded"]
        assert per_byte >= 1 / LINKS[name]["bandwidth"]
    assert summary["disk"]["load_seconds"] / summary["disk"]["bytes_loaded"] > \
        summary["host"]["load_seconds"] / summary["host"]["bytes_loaded"]


def test_a_profile_fitted_on_runs_with_tiers_measures_their_links_and_prices_moves_on_them(tmp_path):
    """Calibration takes each step's tier moves (load and write seconds) out of the time its terms are fitted
    to and fits each tier's link from them; a simulation on that profile, with no hardware, prices the same
    moves on the links it measured. Here the "measured" run is a simulated one on known links, so the fit must
    find them and the second run must step as the first."""
    offload = {"name": "host", "capacity": 1 << 22, "below": {"name": "disk", "capacity": 1 << 28}}
    first = simulation(offload)
    measured = first.serve(sessions(first.engine.tokenizer))
    steps = working_steps(measured.steps)
    assert all(compute_seconds(step) == pytest.approx(OVERHEAD, rel=1e-9) for step in steps)
    profile = fit_profile(steps, metadata={"dtype": "bfloat16"})
    assert set(profile["kv_tier_links"]) == {"host", "disk"}
    for name, link in profile["kv_tier_links"].items():
        assert link["bandwidth"] == pytest.approx(LINKS[name]["bandwidth"], rel=1e-6)
        assert link["latency"] == pytest.approx(LINKS[name]["latency"], rel=1e-6, abs=1e-12)
    assert profile["intercept"] == pytest.approx(OVERHEAD, rel=1e-6)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    config = EngineConfig(dtype="bfloat16", num_kv_blocks=24, max_num_seqs=4, kv_offload=offload)
    again = Simulation.build(config, "calibrated", profile=str(path), allocator="prefix")   # no hardware
    assert tier_links(None, again.model) == profile["kv_tier_links"]
    replayed = again.serve(sessions(again.engine.tokenizer))
    assert [s["duration"] for s in working_steps(replayed.steps)] == \
        pytest.approx([s["duration"] for s in steps], rel=1e-6)
    assert replayed.summary["kv_tiers"]["disk"]["load_seconds"] == \
        pytest.approx(measured.summary["kv_tiers"]["disk"]["load_seconds"], rel=1e-6)
    # A hardware description's links, where it gives any, come first.
    assert tier_links(HARDWARE, again.model) == LINKS
    no_disk = {name: link for name, link in profile["kv_tier_links"].items() if name != "disk"}
    path.write_text(yaml.safe_dump({**profile, "kv_tier_links": no_disk}))
    with pytest.raises(ValueError, match="no link for KV tier.*disk.*calibrate on runs that use"):
        Simulation.build(config, "calibrated", profile=str(path), allocator="prefix")


def test_tiers_turn_recomputed_turns_into_hits_and_int8_holds_more_blocks():
    none = simulation(None).serve(sessions(simulation(None).engine.tokenizer))
    host = simulation({"name": "host", "capacity": 1 << 24}).serve(sessions(simulation(None).engine.tokenizer))
    assert host.summary["kv_tiers"]["host"]["hit_tokens"] > 0
    assert sum(r["num_cached_tokens"] for r in host.requests) > sum(r["num_cached_tokens"] for r in none.requests)
    for record in host.requests:   # per request: its cached tokens split by tier add up
        assert sum(record["cached_tokens_by_tier"].values()) == record["num_cached_tokens"]
    assert all(r["cached_tokens_by_tier"] is None for r in none.requests)
    small = {"name": "host", "capacity": 1 << 21}
    auto = simulation(small).serve(sessions(simulation(None).engine.tokenizer)).summary["kv_tiers"]["host"]
    int8 = simulation({**small, "kv_dtype": "int8"}).serve(
        sessions(simulation(None).engine.tokenizer)).summary["kv_tiers"]["host"]
    assert int8["blocks"] > auto["blocks"]   # 8-bit entries: more of them in the same bytes


def test_swap_preemption_loads_back_instead_of_recomputing():
    """Memory pressure: a pool of 10 blocks for 4 sequences growing past it (no prefix cache: what a victim
    computed is either recomputed or swapped)."""
    from nanovllm.harness.workload.config import SyntheticWorkloadConfig

    def run(mode):
        sim = simulation({"name": "host", "capacity": 1 << 26}, num_kv_blocks=10, allocator="paged",
                         preemption_mode=mode)
        work = generate_workload(SyntheticWorkloadConfig(
            num_requests=12, request_rate=float("inf"), input_len=LengthDist(kind="fixed", mean=24, max=4096),
            output_len=LengthDist(kind="fixed", mean=40, max=4096), ignore_eos=True), sim.engine.tokenizer)
        return sim.serve(work).summary
    recompute, swap = run("recompute"), run("swap")
    assert recompute["num_preemptions"] > 0 and swap["num_preemptions"] > 0
    assert swap["swapped_tokens"] > 0 and recompute["swapped_tokens"] == 0
    assert swap["recomputed_tokens"] < recompute["recomputed_tokens"]
    assert swap["kv_tiers"]["host"]["blocks_loaded"] > 0 and swap["kv_tiers"]["host"]["load_seconds"] > 0


def _cluster(kv_offload, router="round_robin", replicas=2):
    config = EngineConfig(dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4, kv_offload=kv_offload)
    return ServedCluster.simulated(ClusterConfig(replicas=replicas), router,
                                   {"name": "sim", "step_time": "token_cost", "step_overhead": OVERHEAD,
                                    "time_per_token": 0.0}, None, config, allocator="prefix")


def test_a_prefix_computed_on_one_replica_is_a_hit_on_another_through_the_shared_store():
    """Round robin sends a session's consecutive turns to different replicas: only a shared store has the
    previous turn's prefix where the next one lands."""
    host = _cluster({"name": "host", "capacity": 1 << 26, "policy": "write_through"})
    shared = _cluster({"name": "shared", "capacity": 1 << 26, "policy": "write_through"})
    work = sessions(host.engine.replicas[0].engine.tokenizer, rate=2.0, num_sessions=4, turns=4)
    by_host, by_shared = host.serve(work), shared.serve(work)
    assert by_shared.summary["kv_tiers"]["shared"]["hit_tokens"] > 0
    cached = {name: sum(r["num_cached_tokens"] for r in run.requests)
              for name, run in (("host", by_host), ("shared", by_shared))}
    assert cached["shared"] > cached["host"]
    moved = {r["replica"] for r in by_shared.requests if (r["cached_tokens_by_tier"] or {}).get("shared")}
    assert moved == {0, 1}   # each replica loaded blocks the other one wrote
    stores = [t for t in (r.engine.offload.tiers[0] for r in shared.engine.replicas)]
    assert all(isinstance(t, SharedTier) for t in stores) and len({t.store for t in stores}) == 1
    assert stores[0].store.startswith("sim-")   # a store of this run's own
    for replica in shared.engine.replicas:
        replica.engine.close()
    assert (stores[0].store, stores[0].context.namespace) not in _SIMULATED_STORES


def test_the_live_dashboard_draws_a_clusters_tiers_as_its_summary_counts_them(tmp_path):
    """``live=web`` on a simulated cluster with a host tier over a shared store: ``engine.json`` names each
    tier's capacity (the host tiers' together, the store's once), and the dashboard's tier row, built from the
    run's files, ends where the run's summary does: each replica's host tier summed, the shared store's largest
    view, the same moves and hit rates (nothing was preempted, so every prompt token was admitted once)."""
    from helpers import serve_with_live_loggers
    from nanovllm.harness.live.web import RunDashboard

    served = _cluster({"name": "host", "capacity": 1 << 22, "policy": "write_through",
                       "below": {"name": "shared", "capacity": 1 << 26}})
    work = sessions(served.engine.replicas[0].engine.tokenizer, rate=2.0, num_sessions=4, turns=4)
    result = serve_with_live_loggers(served, work, tmp_path)
    capacities = {"host": 2 << 22, "shared": 1 << 26}
    assert json.loads((tmp_path / "engine.json").read_text())["kv_tiers"] == capacities
    view = RunDashboard(tmp_path)
    view.layout()
    view.update()
    summary = result.summary["kv_tiers"]
    assert result.summary["num_preemptions"] == 0 and summary["shared"]["blocks_loaded"] > 0
    assert view.tier_section.visible and sorted(view.tier_srcs) == ["host", "shared"]
    for name, totals in summary.items():
        figures = view.tier_totals.figures(name, capacities[name])
        assert figures["blocks"] == totals["blocks"] and figures["mib"] == totals["bytes"] / 2**20
        assert figures["mib_loaded"] == totals["bytes_loaded"] / 2**20
        assert figures["blocks_written"] == totals["blocks_written"]
        assert figures["hit_rate"] == pytest.approx(totals["hit_rate"])
        source = view.tier_srcs[name].data
        assert source["blocks"][-1] == totals["blocks"] and source["fraction"][-1] == totals["bytes"] / capacities[name]
        assert sum(source["blocks_loaded"]) == totals["blocks_loaded"]


def _view(index, by_tier, free=10):
    def lookup(request):
        return CachedPrefix(dict(by_tier))
    return ReplicaView(index=index, alive=True, num_running=0, num_waiting=0, num_free_blocks=free,
                       num_total_blocks=64, block_size=16, num_queued_tokens=0, num_decoding=0, max_num_seqs=4,
                       max_num_batched_tokens=512, recent_ttft=None, recent_itl=None, num_routed=0,
                       prefix_lookup=lookup)


def test_cache_aware_prefers_a_primary_pool_and_balances_when_only_the_shared_store_has_it():
    request = Request("r", list(range(64)), SamplingParams(), 0.0)
    router = CacheAware()
    # Replica 1 holds the prefix in its pool, replica 0 only in the shared store: replica 1.
    views = [_view(0, {"primary": 0, "shared": 64}, free=50), _view(1, {"primary": 64, "shared": 0}, free=5)]
    assert [v.bind(request).prefix_match_by_tier for v in views][1] == {"primary": 64, "shared": 0}
    assert router.route(request, [v.bind(request) for v in views], 0.0) == 1
    # Both only in the shared store: any replica loads it as well, so the one with room gets it.
    views = [_view(0, {"primary": 0, "shared": 64}, free=5), _view(1, {"primary": 0, "shared": 64}, free=50)]
    assert router.route(request, [v.bind(request) for v in views], 0.0) == 1
    # Local host tiers count as this replica's own: replica 0's host tier wins over replica 1's room.
    views = [_view(0, {"primary": 16, "host": 48}, free=5), _view(1, {"primary": 0, "host": 0}, free=50)]
    assert router.route(request, [v.bind(request) for v in views], 0.0) == 0


def test_interval_records_sum_tier_counters_and_keep_the_last_occupancy():
    keeper = StepKeeper(StepRecords.parse("interval:10"))
    steps = [{"step": i, "start_time": float(i), "duration": 1.0, "num_running": 1, "num_waiting": 0,
              "kv_blocks_total": 0,
              "kv_tiers": {"host": {"hit_tokens": 16, "bytes_loaded": 100, "blocks": i, "bytes": 10 * i}}}
             for i in range(3)]
    out = [r for s in steps for r in keeper.offer(dict(s))] + keeper.flush()
    assert len(out) == 1
    assert out[0]["kv_tiers"]["host"] == {"hit_tokens": 48, "bytes_loaded": 300, "blocks": 2, "bytes": 20}
    assert steps[0]["kv_tiers"]["host"]["hit_tokens"] == 16   # the steps' own records are left as they were


def test_the_working_set_option_fixes_the_sessions_whatever_the_rate_and_tool_outputs_grow_prompts():
    tokenizer = simulation(None).engine.tokenizer
    slow, fast = (sessions(tokenizer, rate=rate, working_set=2000) for rate in (1.0, 8.0))
    ids = lambda work: {r.session_id for r in work}   # noqa: E731
    assert ids(slow) == ids(fast) and len(ids(slow)) == round(2000 / (3 * 48 + 2 * 8))
    assert max(r.arrival_time for r in fast) < max(r.arrival_time for r in slow)
    for work in (slow, fast):   # each session's turns in order, each prompt extending the previous one
        for session in ids(work):
            turns = [r for r in work if r.session_id == session]
            assert [r.request_id for r in turns] == sorted(r.request_id for r in turns)
            assert all(b.prompt[:len(a.prompt)] == a.prompt for a, b in zip(turns, turns[1:]))
    agent = generate_workload(MultiTurnWorkloadConfig(
        num_sessions=2, turns=LengthDist(kind="fixed", mean=3, max=8), user_len=LengthDist(kind="fixed", mean=8),
        reply_len=LengthDist(kind="fixed", mean=4), tool_output_len=LengthDist(kind="fixed", mean=200)), tokenizer)
    lengths = [len(r.prompt) for r in agent if r.session_id == "session0"]
    assert lengths == [8, 8 + 4 + 200 + 8, 8 + 2 * (4 + 200 + 8)]
