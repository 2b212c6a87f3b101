"""The driver of a tensor-parallel engine: rank 0 of ``tensor_parallel_size`` ranks, in the engine's process.

``TensorParallelRunner`` (``runner=tp``, or ``real`` with ``tensor_parallel_size > 1``) is a ``ModelRunner``
(same interface for the engine) whose model is rank 0's shard. It
starts ranks 1..N-1 as worker processes (``worker.py``) over ``torch.distributed`` (gloo on CPU, NCCL on CUDA:
rank r on ``cuda:r``), sends each of them every step's flat batch through a pipe, runs the same forward pass
itself, and samples from the all-gathered logits. The scheduler, policy and allocator run once, in the engine.

Threads: on CPU each rank (the driver included) runs ``cores // N`` torch threads, so N ranks never
oversubscribe the machine. Sizes: at most one rank per CPU core (per GPU on CUDA), and at most one per KV head
(``nanovllm.models.parallel``); anything else is a ``ValueError`` before a process starts.

Lifetime: workers are daemonic children that also die with the driver (PDEATHSIG); ``close()`` stops them,
and a finalizer does the same when the runner is collected or the interpreter exits (normally, on an
exception or on Ctrl-C). A worker that dies makes the next step raise :class:`WorkerDiedError` naming it,
instead of hanging: the driver checks the workers before each step, and a collective whose peer is gone fails.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import time
import weakref
from typing import Any

import torch

from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.runner import RunnerContext, register_runner
from nanovllm.engine.tp.worker import WorkerArgs, connect, worker_main
from nanovllm.models.parallel import ParallelLMHead, check_tensor_parallel_size, head_shard, shard_model
from nanovllm.request import Request

# How long a rank may wait in a collective (or the driver for the workers to load) before failing.
COLLECTIVE_TIMEOUT_S = 300.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run another step."""


# A worker exits with this status when it finds itself re-running the main script's top level (see below).
MAIN_GUARD_STATUS = 86
MAIN_GUARD_MESSAGE = (
    "tensor_parallel_size > 1 starts worker processes, and each one imports the main script again: the code "
    "that builds the engine must not run when it is imported. Put it under `if __name__ == \"__main__\":` "
    "(https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods)")


def exit_if_bootstrapping() -> None:
    """In a spawned worker that is still importing the parent's main script (a script without the
    ``if __name__ == "__main__":`` guard builds an engine at its top level, so the worker would build one too):
    exit at once with ``MAIN_GUARD_STATUS``, which the parent turns into one error naming the fix."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(MAIN_GUARD_STATUS)


def check_parallel_resources(world: int, device: str) -> None:
    """Raise ``ValueError`` when the machine has fewer CPU cores (or GPUs, on CUDA) than ``world`` ranks."""
    if torch.device(device).type == "cuda":
        gpus = torch.cuda.device_count()
        if world > gpus:
            raise ValueError(f"tensor_parallel_size ({world}) needs {world} GPUs but {gpus} are visible")
        return
    cores = os.cpu_count() or 1
    if world > cores:
        raise ValueError(f"tensor_parallel_size ({world}) needs one CPU core per worker but this machine has "
                         f"{cores}; use at most {cores}")


@register_runner("tp")
class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel model; see the module docstring."""

    def __init__(self, context: RunnerContext) -> None:
        """Start ranks 1..N-1 (``N = tensor_parallel_size``), load rank 0's shard here, connect them. The
        shards are cut from the unfused projections, so tensor-parallel runs never take the fast layouts."""
        exit_if_bootstrapping()
        config, hf_config, attention = context.config, context.hf_config, context.attention
        world, device, dtype, model_dir = config.tensor_parallel_size, config.device, config.dtype, context.model_dir
        check_tensor_parallel_size(hf_config.num_attention_heads, hf_config.num_key_value_heads, world)
        check_parallel_resources(world, device)
        if not isinstance(attention, (str, dict)) and not hasattr(attention, "keys"):
            raise ValueError("tensor_parallel_size > 1 needs attention as a registered name or {name: ...} "
                             "mapping: each worker builds its own backend for its heads")
        self.world = world
        self.attention_spec = attention if isinstance(attention, str) else dict(attention)
        on_cuda = torch.device(device).type == "cuda"
        threads = 1 if on_cuda else max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        common = dict(world=world, port=_free_port(),
                      backend="nccl" if on_cuda else "gloo", hf_config=hf_config, model_dir=str(model_dir),
                      dtype=dtype, threads=threads, timeout_s=COLLECTIVE_TIMEOUT_S)
        self._workers, self._pipes = _start_workers(common, device)
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, self._pipes)
        try:
            rank0 = dataclasses.replace(config, device="cuda:0" if on_cuda else device, fuse_projections=False)
            super().__init__(dataclasses.replace(context, config=rank0))
            self._wait_until_loaded()
            self.comm = connect(WorkerArgs(rank=0, device=str(self.device), **common))
        except BaseException:
            self.close()
            raise
        from nanovllm.models.llama import LlamaForCausalLM  # here, as in the worker: this module imports light

        shard = shard_model(self.model, 0, world, self.comm)
        assert isinstance(shard, LlamaForCausalLM)  # a shallow copy of the loaded model, of its class
        head = shard.lm_head_parallel
        assert isinstance(head, ParallelLMHead)
        # The inherited execute asks the model for logits: here they are the all-gathered vocabulary shards
        # (an instance attribute shadowing the method; setattr, as mypy refuses assignments to a method).
        setattr(shard, "compute_logits", head.forward)
        self.model = shard
        heads = head_shard(hf_config.num_attention_heads, hf_config.num_key_value_heads, 0, world)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's, for its cache

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers]

    def init_kv_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend | None,
                      graphs: Any = None) -> None:
        """Every rank allocates its KV-cache shard (its own KV heads); tensor-parallel steps run eagerly (no
        CUDA graphs)."""
        self._send(("kv_cache", num_blocks, block_size, self.attention_spec))
        super().init_kv_cache(num_blocks, block_size, backend)

    def _prepare(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor, list[list[int]]]:
        """The step's flat batch, built once here and sent to every worker before this rank runs it; the
        inherited ``execute`` then runs the shard (its collectives pair with the workers') and samples (and
        verifies proposals, which only this rank reads)."""
        prepared = super()._prepare(scheduled)
        input_ids, positions, meta, _, sample_rows, _ = prepared
        self._send(("step", input_ids.cpu(), positions.cpu(), _on_cpu(meta), sample_rows.cpu()))
        return prepared

    def execute(self, scheduled: list[tuple[Request, int]]):
        try:
            return super().execute(scheduled)
        except RuntimeError as exc:
            if isinstance(exc, WorkerDiedError):
                raise
            raise self._failure(exc) from exc

    def close(self) -> None:
        """Stop the workers (idempotent); the engine cannot run steps afterwards."""
        self._finalizer()

    # -- the workers -----------------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._check_workers()
        try:
            for pipe in self._pipes:
                pipe.send(message)
        except OSError as exc:
            raise self._failure(exc) from exc

    def _check_workers(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self._workers, start=1) if not p.is_alive()]
        if dead:
            self.close()
            if any(p.exitcode == MAIN_GUARD_STATUS for _, p in dead):
                raise RuntimeError(MAIN_GUARD_MESSAGE)
            raise WorkerDiedError("tensor-parallel worker " + ", ".join(
                f"rank {rank} (pid {p.pid}) exited with status {p.exitcode}" for rank, p in dead
            ) + "; the engine cannot continue (its traceback, if any, is above)")

    def _failure(self, exc: BaseException) -> BaseException:
        """A failed collective: name the worker that died if one did (wait briefly for its exit to show)."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and all(p.is_alive() for p in self._workers):
            time.sleep(0.05)
        try:
            self._check_workers()
        except WorkerDiedError as died:
            return died
        return exc

    def _wait_until_loaded(self) -> None:
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        for rank, pipe in enumerate(self._pipes, start=1):
            while not pipe.poll(0.1):
                self._check_workers()
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} did not load the model within "
                                          f"{COLLECTIVE_TIMEOUT_S:.0f} s")
            try:
                pipe.recv()
            except EOFError as exc:  # it died while loading
                raise self._failure(exc) from None


def _start_workers(common: dict, device: str) -> tuple[list, list]:
    ctx = mp.get_context("spawn")  # never fork a process that holds torch threads (or CUDA)
    workers, pipes = [], []
    for rank in range(1, common["world"]):
        ours, theirs = ctx.Pipe()
        worker_device = f"cuda:{rank}" if torch.device(device).type == "cuda" else device
        args = WorkerArgs(rank=rank, device=worker_device, **common)
        process = ctx.Process(target=worker_main, args=(args, theirs), name=f"nanovllm-tp{rank}", daemon=True)
        process.start()
        theirs.close()
        workers.append(process)
        pipes.append(ours)
    return workers, pipes


def _stop_workers(workers: list, pipes: list) -> None:
    """Ask each worker to stop, then make sure: SIGTERM whatever has not left within a few seconds."""
    for pipe in pipes:
        try:
            pipe.send(("stop",))
        except OSError:
            continue  # already gone
    deadline = time.monotonic() + 5.0
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(5.0)
    for pipe in pipes:
        pipe.close()


def _on_cpu(meta):
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cpu())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
