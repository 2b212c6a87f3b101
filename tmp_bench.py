import time, sys
from nanovllm.config import EngineConfig
from nanovllm.cluster.config import ClusterConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.workload import generate_workload, SyntheticWorkloadConfig, LengthDist
n=int(sys.argv[1]); rate=float(sys.argv[2]); router=sys.argv[3]
t=time.perf_counter()
sc = ServedCluster.simulated(ClusterConfig(replicas=64), router, {"name":"sim","step_time":"calibrated"}, None, EngineConfig(num_kv_blocks=1024, max_num_seqs=64, dtype="bfloat16"))
t1=time.perf_counter(); c1=time.process_time()
wl = generate_workload(SyntheticWorkloadConfig(num_requests=n, request_rate=rate, input_len=LengthDist(kind='uniform', mean=128, range_ratio=0.5), output_len=LengthDist(kind='uniform', mean=16, range_ratio=0.5)), sc.engine.tokenizer)
t2=time.perf_counter()
res = sc.serve(wl)
t3=time.perf_counter(); c3=time.process_time()
print(f"build {t1-t:.1f}s workload {t2-t1:.1f}s serve {t3-t2:.1f}s cpu {c3-c1:.1f}s steps {len(res.steps)} imb {res.summary['load_imbalance_mean']:.3f}")
