import cProfile, pstats, sys
from nanovllm.config import EngineConfig
from nanovllm.cluster.config import ClusterConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.workload import generate_workload, SyntheticWorkloadConfig
sc = ServedCluster.simulated(ClusterConfig(replicas=64), "round_robin", {"name":"sim","step_time":"calibrated"}, None, EngineConfig(num_kv_blocks=1024, max_num_seqs=64, dtype="bfloat16"))
wl = generate_workload(SyntheticWorkloadConfig(num_requests=5000, request_rate=400), sc.engine.tokenizer)
pr=cProfile.Profile(); pr.enable(); res = sc.serve(wl); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
