"""The collectives of one tensor-parallel engine, over a process group of its own.

Not torch.distributed's global default group: that exists once per process, and an engine must not claim it
(a second engine, or the user's own distributed code, would find it taken). The group's ranks rendezvous
through a ``TCPStore`` that rank 0 (the driver) hosts on localhost; gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist


class _Collectives(Protocol):
    """The two collectives this module asks of a c10d backend (``ProcessGroupGloo`` or ``ProcessGroupNCCL``).

    Both are pybind methods of ``torch._C._distributed_c10d.Backend`` at run time, but torch's stubs declare them
    only on ``ProcessGroup``; hence the casts where the backends are built."""

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> dist.Work: ...

    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
                  input_tensors: Sequence[torch.Tensor]) -> dist.Work: ...


class Communicator:
    """``all_reduce`` (sum, in place) and ``all_gather`` among the ranks of one tensor-parallel model."""

    def __init__(self, backend: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            # torch stub gap: the stubs make ``options`` required; the pybind constructor defaults it.
            nccl = dist.ProcessGroupNCCL(self.store, rank, world)  # type: ignore[call-arg]
            self.group = cast(_Collectives, nccl)
        else:
            self.group = cast(_Collectives, dist.ProcessGroupGloo(self.store, rank, world, timeout))
        self.rank, self.world = rank, world

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor]).wait()

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.group.allgather([parts], [tensor]).wait()
