"""How many torch threads one sweep job may use, from the Hydra launcher that runs it.

Hydra's basic launcher runs jobs one after another, so each job keeps torch's default (every core). Launchers that
run jobs side by side would oversubscribe the CPU if every job did that: on a small machine competing OpenMP
threads spin and slow each step many times over. So each job takes its fair share:

- ``joblib`` (``hydra.launcher.n_jobs=N``): ``cores // N`` threads (N = -1 means every core, -2 all but one, as
  joblib counts);
- ``submitit_local`` / ``submitit_slurm``: ``hydra.launcher.cpus_per_task`` when set (what SLURM grants the job),
  else one thread, since all of a local array's jobs start at once;
- ``ray``: ``hydra.launcher.ray.remote.num_cpus`` when set (what Ray reserves for the task), else one thread.

Never fewer than one. :func:`threads_for_job` is pure (config in, number out) so it is tested without launching.
"""

from __future__ import annotations

import os
from typing import Any, Mapping


def threads_for_job(launcher: Mapping[str, Any], cores: int | None = None) -> int | None:
    """Torch intra-op threads for one job run by ``launcher`` (Hydra's ``hydra.launcher`` node), or None to leave
    torch's default (the basic launcher, which runs one job at a time)."""
    cores = cores or os.cpu_count() or 1
    target = str(launcher.get("_target_", "")).lower()
    if "joblib" in target:
        return max(1, cores // _joblib_workers(int(launcher.get("n_jobs", -1)), cores))
    if "submitit" in target:
        return max(1, int(launcher.get("cpus_per_task") or 1))
    if "ray" in target:
        remote = (launcher.get("ray") or {}).get("remote") or {}
        return max(1, int(remote.get("num_cpus") or 1))
    return None


def _joblib_workers(n_jobs: int, cores: int) -> int:
    """joblib's own reading of ``n_jobs``: a positive count, or -1 for every core, -2 for all but one, ..."""
    if n_jobs == 0:
        raise ValueError("hydra.launcher.n_jobs must not be 0 (joblib: a positive count, or -1 for every core)")
    return n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)


def apply_fair_share(launcher: Mapping[str, Any]) -> int | None:
    """Set torch's intra-op threads for this job from its launcher; return the number set (None: untouched)."""
    threads = threads_for_job(launcher)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return threads
