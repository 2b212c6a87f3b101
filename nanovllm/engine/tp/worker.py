"""A tensor-parallel worker process: rank 1..N-1 of an engine with ``tensor_parallel_size=N``.

Contract with the driver (``runner.py``, rank 0): the worker loads the model, sends ``"loaded"`` on its pipe,
joins the engine's process group (``comm.py``) and takes its shard; then it obeys the driver's messages on the pipe, in order:
``("kv_cache", num_blocks, block_size, attention_spec)`` allocates its KV-cache shard (its own KV heads) and
builds its attention backend; ``("step", input_ids, positions, meta, sample_rows)`` runs the same forward pass
(and LM-head all-gather) as every other rank; ``("stop",)`` leaves. Step payloads are CPU tensors, moved to the
worker's device here. The scheduler, policy, allocator and sampler exist only in the driver.

Lifetime: the worker ignores Ctrl-C (the driver decides when to stop), asks the kernel to SIGTERM it if the
driver dies (Linux), and exits when the driver's pipe closes; any error is printed and ends the process with a
non-zero status, which the driver reports.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanovllm.attention.base import AttentionMetadata
from nanovllm.engine.tp.comm import Communicator


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker needs to build its shard; plain values, so it pickles into a spawned process."""

    rank: int
    world: int
    port: int                   # of the driver's TCPStore, where the ranks meet
    backend: str                # "gloo" or "nccl"
    hf_config: Any
    model_dir: str
    dtype: str
    device: str                 # this worker's device, e.g. "cpu" or "cuda:1"
    threads: int                # torch intra-op threads
    timeout_s: float            # a collective waiting longer than this fails instead of hanging


def run_shard_step(model, backend, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   sample_rows: torch.Tensor) -> torch.Tensor | None:
    """One step on one rank (driver and workers run exactly this): plan, forward, and the full logits of the
    sampled rows (None when no row samples; then no rank joins the all-gather)."""
    backend.plan(meta)
    hidden = model(input_ids, positions, backend)
    if sample_rows.numel() == 0:
        return None
    return model.lm_head_parallel(hidden.index_select(0, sample_rows))


def connect(args: WorkerArgs) -> Communicator:
    return Communicator(args.backend, args.port, args.rank, args.world, args.timeout_s)


def worker_main(args: WorkerArgs, conn) -> None:
    """Entry point of a spawned worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        _serve(args, conn)
    except EOFError:
        sys.exit(0)  # the driver went away: nothing left to serve
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def _serve(args: WorkerArgs, conn) -> None:
    # The model code (transformers, seconds) after worker_main ignores SIGINT: a Ctrl-C while a worker starts
    # stops the driver, which ends its workers, instead of printing a traceback from each.
    from nanovllm.attention.base import ATTENTION_BACKENDS
    from nanovllm.config import head_dim_of, torch_dtype
    from nanovllm.engine.kv_cache import allocate_kv_cache
    from nanovllm.models.loader import load_model
    from nanovllm.models.parallel import head_shard, shard_model

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch_dtype(args.dtype)
    full = load_model(args.hf_config, Path(args.model_dir), dtype, device)
    conn.send("loaded")
    model = shard_model(full, args.rank, args.world, connect(args))
    del full
    config = args.hf_config
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, args.rank, args.world)
    head_dim = head_dim_of(config)  # each layer's Attention.head_dim, as the driver sizes its cache
    backend = kv_cache = None
    with torch.inference_mode():
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "kv_cache":
                _, num_blocks, block_size, spec = message
                kv_cache, views = allocate_kv_cache(config.num_hidden_layers, num_blocks, block_size,
                                                    heads.num_kv_heads, head_dim, dtype, device)
                backend = ATTENTION_BACKENDS.build(spec, heads.num_heads, heads.num_kv_heads, head_dim,
                                                   head_dim ** -0.5)
                backend.bind_kv_caches(views)
            elif message[0] == "step":
                _, input_ids, positions, meta, sample_rows = message
                meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device))
                run_shard_step(model, backend, input_ids.to(device), positions.to(device), meta,
                               sample_rows.to(device))
    del kv_cache


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGTERM to this process when its parent (the driver) exits, however it exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
