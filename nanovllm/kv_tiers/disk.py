"""``disk``: K/V blocks as files under a directory, bounded in bytes, surviving the process.

One file per block, ``<path>/<namespace>/<key>.kv``: a header (the block's tokens, shape, dtype and a blake2b
digest of the payload) and the payload. A read checks the digest and the tokens, so a torn, corrupted or
colliding file is a miss, never wrong K/V. Files are written to a temporary name of the writing process and
renamed into place (atomic on POSIX), so two processes sharing the directory never see each other's partial
files; each process bounds what it writes and adopts (another process may delete a file this one indexed: a
miss). A restarted engine on the same model finds the files and starts warm. Temporary files of processes that
died are removed when a tier opens the directory; ``persist=False`` also removes this process's blocks at close.

Payload-free (the simulator, ``TierContext.payload`` False): no directory and no files; the blocks' shapes and
tokens sit in a dict (``_ghosts``) with the same capacity and eviction bookkeeping, and the time a real disk
would take is the simulated runner's (``hardware.kv_tier_links.disk``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path

import torch

from nanovllm.kv_tiers import KVTier, TierContext, Tokens, register_kv_tier

logger = logging.getLogger(__name__)

MAGIC = b"NVKV1"
_TMP = ".tmp-"


@register_kv_tier("disk")
class DiskTier(KVTier):
    """``path``: the directory (default: ``nanovllm-kv`` in the system's temporary directory); ``capacity``
    bytes of payload (default 8 GiB); ``eviction``, ``kv_dtype`` as every tier; ``persist``: keep the files
    at close (a restarted engine starts warm)."""

    def __init__(self, context: TierContext, capacity: int = 8 << 30, eviction: str = "lru",
                 kv_dtype: str = "auto", path: str | None = None, persist: bool = True) -> None:
        super().__init__(context, capacity, eviction, kv_dtype)
        root = Path(path) if path is not None else self.default_root()
        self.directory = root / context.namespace
        self.persist = persist
        self._written: set[int] = set()
        self._ghost_store: dict[int, tuple[Tokens, torch.Tensor]] = {}
        if not context.payload:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_dead_writers_files()
        # Warm start: what an earlier run left, oldest first, so the eviction order starts from their age.
        for file in sorted(self.directory.glob("*.kv"), key=lambda f: f.stat().st_mtime):
            try:
                self.contains(int(file.stem, 16))
            except (ValueError, OSError):
                continue

    @classmethod
    def default_root(cls) -> Path:
        """Where blocks go when ``path`` is not given."""
        return Path(tempfile.gettempdir()) / "nanovllm-kv"

    def _ghosts(self) -> dict[int, tuple[Tokens, torch.Tensor]]:
        """Payload-free mode's store: key -> (tokens, meta tensor). This tier's own; ``shared`` returns the one
        every replica in the process sees."""
        return self._ghost_store

    def path_of(self, key: int) -> Path:
        """The file ``key``'s block is stored in (whether or not it is there now)."""
        return self._file(key)

    def _file(self, key: int) -> Path:
        return self.directory / f"{key & 0xFFFFFFFFFFFFFFFF:016x}.kv"

    def _write(self, key: int, tokens: Tokens, data: torch.Tensor) -> int:
        if not self.context.payload:
            self._ghosts()[key] = (tokens, data)
            self._written.add(key)
            return data.numel() * data.element_size()
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"tokens": list(tokens), "shape": list(data.shape), "dtype": str(data.dtype),
                             "digest": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP}{os.getpid()}-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            os.replace(tmp, self._file(key))
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._written.add(key)
        return len(payload)

    def _read(self, key: int, tokens: Tokens | None) -> torch.Tensor | None:
        if not self.context.payload:
            stored = self._ghosts().get(key)
            return None if stored is None or (tokens is not None and stored[0] != tokens) else stored[1]
        try:
            raw = self._file(key).read_bytes()
        except OSError as exc:
            logger.warning("kv tier disk: block %s unreadable (%s); recomputing it", self._file(key).name,
                           type(exc).__name__)
            return None
        try:
            if raw[:len(MAGIC)] != MAGIC:
                raise ValueError("not a K/V block file")
            (length,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
            start = len(MAGIC) + 4 + length
            header = json.loads(raw[len(MAGIC) + 4:start])
            payload = raw[start:]
            if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["digest"]:
                raise ValueError("checksum mismatch")
        except (ValueError, KeyError, struct.error) as exc:
            logger.warning("kv tier disk: block %s is corrupt (%s); recomputing it", self._file(key).name, exc)
            return None
        if tokens is not None and tuple(header["tokens"]) != tokens:
            return None   # a key collision: another prefix's block
        dtype = getattr(torch, header["dtype"].removeprefix("torch."))
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header["shape"])

    def _remove(self, key: int) -> None:
        if not self.context.payload:
            self._ghosts().pop(key, None)
            self._written.discard(key)
            return
        self._file(key).unlink(missing_ok=True)
        self._written.discard(key)

    def _adopt(self, key: int) -> int | None:
        if not self.context.payload:
            stored = self._ghosts().get(key)
            return None if stored is None else stored[1].numel() * stored[1].element_size()
        try:
            with self._file(key).open("rb") as f:
                head = f.read(len(MAGIC) + 4)
                size = os.fstat(f.fileno()).st_size
            (length,) = struct.unpack("<I", head[len(MAGIC):])
        except (OSError, struct.error):
            return None
        return max(0, size - len(head) - length)   # the payload: what capacity counts

    def close(self) -> None:
        if not self.persist:
            for key in list(self._written):
                self.discard(key)

    def _remove_dead_writers_files(self) -> None:
        for tmp in self.directory.glob(f"{_TMP}*"):
            pid = tmp.name[len(_TMP):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
