"""The KV-transfer seam of prefill/decode disaggregation: how one request's prompt K/V (``Runner.read_kv``'s
tensor: [layers, 2, blocks, block_size, kv_heads, head_dim], the request's blocks only) gets from the process of
the prefill replica that computed it to the process of the decode replica that generates the rest.

What the cluster calls, and when (``nanovllm.cluster.disaggregated``):

1. ``send(request_id, data)``: in the prefill replica's process, right after the step that sampled the
   request's first token read its blocks (and freed them there). Returns a small picklable handle that travels
   to the decode replica with the request.
2. ``receive(handle)``: in the decode replica's process, when the request arrives there; returns the tensor
   (a copy the sender's side no longer needs). It raises ``KVTransferError`` when the K/V cannot be had (the
   sender died, the segment is gone): that request fails with the reason, the others go on.
3. ``discard(handle)``: instead of ``receive``, for a request that ended in between (aborted, its decode replica
   died): free what ``send`` holds.
4. ``modelled_time(num_bytes)``: in a simulated cluster, instead of moving anything: ``latency +
   num_bytes / bandwidth`` seconds (the link's figures: measured on this machine for the real transfers, or a
   preset such as ``nvlink``, ``infiniband``, ``ethernet``; ``conf/kv_transfer/``).

The cluster calls ``send_request(engine, request, data)`` and ``receive_request(engine, request, handle)``; they
call ``send`` and ``receive`` unless a transfer needs the replica's engine (its KV tiers) and the request (its
tokens), as ``shared_store`` does. ``receive_request`` may return fewer blocks than were sent (a prefix of them):
the decode replica computes the rest (``fit_handoff``). ``check(config)`` runs before any replica starts.

Built-ins: ``shared_memory`` (a file in ``/dev/shm`` per request: one copy in, one copy out; the default),
``ray`` (Ray's object store: ``ray.put`` in the prefill actor, ``ray.get`` in the decode actor), ``shared_store``
(the replicas' shared KV store, ``kv_offload=shared``: the prefill writes the prompt's blocks there, the decode
replica reads them back from its own tier), ``local`` (one process: the tensor is handed over as is) and ``link``
(simulated only: a named link's figures). Measured side by side on this machine in
``experiments/bench_kv_transfer.py``; docs/disaggregation.md says why shared memory is the default.
"""

from __future__ import annotations

import abc
import itertools
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from nanovllm.allocator import prefix_block_key
from nanovllm.engine.kv_offload import check_kv_offload
from nanovllm.registry import Registry

if TYPE_CHECKING:
    from nanovllm.config import EngineConfig
    from nanovllm.engine.engine import LLMEngine
    from nanovllm.engine.kv_offload import KVOffload
    from nanovllm.request import KVHandoff, Request


class KVTransferError(RuntimeError):
    """A request's K/V could not be moved (its request fails with this message; the others go on)."""


class KVTransfer(abc.ABC):
    """Moves a request's K/V between replica processes; see the module docstring for when each method runs.

    ``bandwidth`` (bytes/s) and ``latency`` (s): the link a simulated cluster models this transfer with."""

    registered_name: str = "custom"
    moves_between_processes: bool = True   # False: only within one process (``local``, ``link``)
    # What a simulated cluster models this transfer with when no bandwidth/latency is given: a real transfer's
    # figures as ``experiments/bench_kv_transfer.py`` measured them (docs/disaggregation.md says on which CPU).
    measured_bandwidth: float | None = None
    measured_latency: float | None = None
    # The KV tier link (``hardware.kv_tier_links``) a simulated cluster prices this transfer on, if any.
    tier_link: str | None = None

    def __init__(self, bandwidth: float | None = None, latency: float | None = None) -> None:
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"kv_transfer.bandwidth must be > 0 bytes/s, got {bandwidth!r}")
        if latency is not None and not latency >= 0:
            raise ValueError(f"kv_transfer.latency must be >= 0 s, got {latency!r}")
        self.bandwidth = bandwidth if bandwidth is not None else self.measured_bandwidth
        self.latency = latency if latency is not None else self.measured_latency

    @abc.abstractmethod
    def send(self, request_id: str, data: torch.Tensor) -> Any:
        """In the prefill replica's process: make ``data`` available to another process; a picklable handle."""

    @abc.abstractmethod
    def receive(self, handle: Any) -> torch.Tensor:
        """In the decode replica's process: the tensor ``send`` was given (``KVTransferError`` if it is lost)."""

    def discard(self, handle: Any) -> None:
        """Free what ``send`` holds for a request that will not be received."""

    def check(self, config: "EngineConfig") -> None:
        """Before any replica starts: raise ``ValueError`` naming the field when the replicas' settings cannot
        carry this transfer. Default: any settings."""

    def send_request(self, engine: "LLMEngine", request: "Request", data: torch.Tensor) -> Any:
        """In the prefill replica's process, the cluster's call: ``send`` (``engine`` is that replica's engine,
        ``request`` the request handed off, ``data`` its prompt's blocks)."""
        return self.send(request.request_id, data)

    def receive_request(self, engine: "LLMEngine", request: "Request", handle: Any) -> torch.Tensor:
        """In the decode replica's process, the cluster's call: ``receive`` (``engine`` is that replica's engine).
        May return a prefix of the blocks sent; the decode replica computes the rest."""
        return self.receive(handle)

    def modelled_time(self, num_bytes: int) -> float:
        """Seconds a simulated transfer of ``num_bytes`` takes on this transfer's link."""
        if self.bandwidth is None:
            raise ValueError(f"kv_transfer {self.registered_name!r} has no bandwidth to simulate with: set "
                             "kv_transfer.bandwidth (bytes/s) and kv_transfer.latency (s), or pick a link preset "
                             "(kv_transfer=nvlink, infiniband, ethernet)")
        return (self.latency or 0.0) + num_bytes / self.bandwidth


KV_TRANSFERS: Registry[KVTransfer] = Registry("kv_transfer", base=KVTransfer,
                                              builtin_packages=("nanovllm.cluster.kv_transfer",))


def register_kv_transfer(name: str) -> Callable[[type[KVTransfer]], type[KVTransfer]]:
    """Class decorator registering a ``KVTransfer`` subclass under ``name`` (``kv_transfer=<name>``)."""
    return KV_TRANSFERS.register(name)


@register_kv_transfer("local")
class LocalTransfer(KVTransfer):
    """One process (an in-process cluster): the tensor itself is the handle; nothing is copied."""

    moves_between_processes = False

    def send(self, request_id: str, data: torch.Tensor) -> Any:
        return data

    def receive(self, handle: Any) -> torch.Tensor:
        return handle


@register_kv_transfer("link")
class SimulatedLink(LocalTransfer):
    """A link a simulated cluster models (``bandwidth``, ``latency``); in one process it hands tensors over as
    ``local`` does. The presets in ``conf/kv_transfer/`` (nvlink, infiniband, ethernet) are this class."""


@register_kv_transfer("shared_memory")
class SharedMemoryTransfer(KVTransfer):
    """A file in shared memory (``directory``, ``/dev/shm`` where there is one) per request: the prefill process
    writes the K/V into it; the decode process reads it into a tensor of its own and unlinks it. Processes on one
    machine only."""

    measured_bandwidth, measured_latency = 7.1e8, 8.4e-4   # AMD EPYC (AVX2), 2 cores, 18.9 GB/s copy

    def __init__(self, bandwidth: float | None = None, latency: float | None = None,
                 directory: str | None = None) -> None:
        super().__init__(bandwidth, latency)
        shm = Path("/dev/shm")
        self.directory = Path(directory) if directory else (shm if shm.is_dir() else Path(tempfile.gettempdir()))
        self._ids = itertools.count()

    def send(self, request_id: str, data: torch.Tensor) -> Any:
        path = self.directory / f"nanovllm-kv-{os.getpid()}-{next(self._ids)}"
        # write(2) into tmpfs, not a fresh mapping: faulting in a new shared mapping page by page is several times
        # slower.
        raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            with open(path, "wb") as file:
                file.write(raw.data)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise KVTransferError(f"kv transfer (shared_memory): writing {path} failed: {exc}") from exc
        return {"path": str(path), "shape": tuple(data.shape), "dtype": str(data.dtype).removeprefix("torch.")}

    def receive(self, handle: Any) -> torch.Tensor:
        path = Path(handle["path"])
        shape, dtype = handle["shape"], getattr(torch, handle["dtype"])
        data = torch.empty(shape, dtype=dtype)
        raw = data.reshape(-1).view(torch.uint8).numpy()
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size != raw.nbytes:
                    raise KVTransferError(f"kv transfer (shared_memory): {path} holds {size} bytes, not the "
                                          f"{raw.nbytes} of the {tuple(shape)} {handle['dtype']} K/V sent")
                file.readinto(raw.data)
        except FileNotFoundError:
            raise KVTransferError(f"kv transfer (shared_memory): {path} is gone (its sender died or it was "
                                  "discarded)") from None
        finally:
            path.unlink(missing_ok=True)
        return data

    def discard(self, handle: Any) -> None:
        Path(handle["path"]).unlink(missing_ok=True)


@register_kv_transfer("ray")
class RayObjectStoreTransfer(KVTransfer):
    """Ray's object store: ``ray.put`` in the prefill actor (owned by it), ``ray.get`` in the decode actor (a
    zero-copy read of shared memory on one node; pulled over the network from another). The object is lost if
    its owner (the prefill replica) dies first: the request then fails with Ray's reason."""

    measured_bandwidth, measured_latency = 1.11e9, 4.2e-3   # AMD EPYC (AVX2), 2 cores, 18.9 GB/s copy

    def send(self, request_id: str, data: torch.Tensor) -> Any:
        import ray

        # numpy has no bfloat16: the bytes travel as int16 (same size) and are viewed back on arrival.
        dtype = str(data.dtype).removeprefix("torch.")
        array = (data.view(torch.int16) if data.dtype == torch.bfloat16 else data).numpy()
        return {"ref": [ray.put(array)], "dtype": dtype}   # in a list: Ray must not resolve it on the way

    def receive(self, handle: Any) -> torch.Tensor:
        import ray
        from ray.exceptions import RayError

        try:
            array = ray.get(handle["ref"][0], timeout=60)
        except RayError as exc:
            raise KVTransferError(f"kv transfer (ray): the object is lost: {type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
        data = torch.from_numpy(array.copy())   # the store's buffer is read-only and freed with the ref
        return data.view(torch.bfloat16) if handle["dtype"] == "bfloat16" else data

    def discard(self, handle: Any) -> None:
        handle["ref"].clear()   # the last reference: the store frees the object


@register_kv_transfer("shared_store")
class SharedStoreTransfer(KVTransfer):
    """Through the replicas' shared KV store (``kv_offload=shared``, docs/kv_tiers.md): the prefill replica puts
    its prompt's full blocks in the store under their prefix keys (those already there, e.g. written through
    when the prefill completed, are not written again), so they are also prefix hits for every other replica;
    the prompt's partial last block goes under a key of its own for the decode replica alone (``put_once``).
    The decode replica reads them back through its own ``shared`` tier, in order, up to the first that is gone
    (another replica evicted it): it computes the tokens from there. Processes that reach the store's directory
    (one machine; several with a shared file system). Simulated: priced on ``hardware.kv_tier_links.shared``
    (the decode side's read; the prefill's write is its tier's write-through, charged to its steps)."""

    tier_link = "shared"

    def check(self, config: "EngineConfig") -> None:

        chain = check_kv_offload(config.kv_offload) or []
        if not any(node["name"] == "shared" for node in chain):
            raise ValueError("kv_transfer=shared_store hands the K/V over through the replicas' shared KV store: "
                             f"kv_offload must have a shared tier (kv_offload=shared), got {config.kv_offload!r}")

    def send(self, request_id: str, data: torch.Tensor) -> Any:
        raise KVTransferError("kv transfer (shared_store): needs the prefill replica's KV tiers (send_request)")

    def receive(self, handle: Any) -> torch.Tensor:
        raise KVTransferError("kv transfer (shared_store): needs the decode replica's KV tiers (receive_request)")

    @staticmethod
    def _store(engine: "LLMEngine") -> tuple["KVOffload", int]:
        offload = engine.offload
        index = offload.tier_index("shared") if offload is not None else None
        if offload is None or index is None:
            raise KVTransferError("kv transfer (shared_store): this replica has no shared KV tier (kv_offload)")
        return offload, index

    @staticmethod
    def _blocks(request: "Request", block_size: int, count: int) -> list[tuple[int, tuple[int, ...]]]:
        """(prefix key, tokens) of the prompt's first ``count`` full blocks (the last one too, which
        ``prefix_block_keys`` leaves out of a bare prompt: here the first output token follows it)."""
        prompt, blocks, key = request.prompt_token_ids, [], None
        for i in range(count):
            tokens = tuple(prompt[i * block_size:(i + 1) * block_size])
            key = prefix_block_key(key, tokens)
            blocks.append((key, tokens))
        return blocks

    def send_request(self, engine: "LLMEngine", request: "Request", data: torch.Tensor) -> Any:
        offload, index = self._store(engine)
        block_size = engine.config.block_size
        full = request.num_prompt_tokens // block_size
        written = offload.put_blocks(index, self._blocks(request, block_size, full), data[:, :, :full])
        tail = None
        if data.shape[2] > full:   # a partial last block: no prefix key; for this request's decode replica only
            key = int.from_bytes(os.urandom(8), "little") >> 1
            tokens = tuple(request.prompt_token_ids[full * block_size:])
            tier = offload.tiers[index]
            try:
                offload.put_once(index, key, tokens, data[:, :, full:])
            except OSError as exc:
                raise KVTransferError(f"kv transfer (shared_store): writing the last block failed: {exc}") from exc
            path = getattr(tier, "path_of", None)
            tail = {"key": key, "tokens": tokens, "path": str(path(key)) if path is not None else None}
            written += data[:, :, full:].numel() * data.element_size()
        return {"blocks": full, "tail": tail, "bytes_written": written}

    def receive_request(self, engine: "LLMEngine", request: "Request", handle: Any) -> torch.Tensor:
        offload, index = self._store(engine)
        blocks = offload.get_blocks(index, self._blocks(request, engine.config.block_size, handle["blocks"]))
        tail = handle["tail"]
        if tail is not None:
            data = offload.take_once(index, tail["key"], tuple(tail["tokens"]))
            if data is not None and len(blocks) == handle["blocks"]:
                blocks.append(data)
        if not blocks:
            raise KVTransferError("kv transfer (shared_store): the store no longer holds the prompt's first block")
        return torch.cat(blocks, dim=2)

    def discard(self, handle: Any) -> None:
        tail = handle["tail"] if isinstance(handle, dict) else None
        if tail is not None and tail["path"] is not None:
            Path(tail["path"]).unlink(missing_ok=True)


def fit_handoff(handoff: "KVHandoff", data: torch.Tensor, block_size: int) -> None:
    """Give ``handoff`` the K/V a transfer received: when it holds fewer blocks than were sent (a store lost the
    rest), only the tokens of the blocks it holds count as moved; the decode replica computes the others."""
    handoff.data = data
    if data.shape[2] * block_size < handoff.num_tokens:
        handoff.num_tokens = data.shape[2] * block_size
        handoff.num_bytes = data.numel() * data.element_size()


__all__ = ["KV_TRANSFERS", "KVTransfer", "KVTransferError", "fit_handoff", "register_kv_transfer"]
