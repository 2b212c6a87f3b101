"""Many engines behind one router: ``Cluster`` (the engine-like facade the serving loops drive), its replicas
(``LocalReplica``: an engine in this process, e.g. a simulated one) and the cluster's virtual clock."""

from nanovllm.cluster.cluster import Cluster, ClusterClock
from nanovllm.cluster.replica import LocalReplica

__all__ = ["Cluster", "ClusterClock", "LocalReplica"]
