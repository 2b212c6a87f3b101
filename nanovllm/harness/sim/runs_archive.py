"""Run records kept as one compressed archive per study, unpacked on demand.

A calibration study's runs (hundreds of small ``steps.jsonl`` / ``requests.jsonl`` / ``metrics.json`` files) are
stored as one ``.tar.xz``, not as tracked files. Its members are paths relative to the archive's own directory
(``sim_runs/bfloat16/calib_chat_seed1/steps.jsonl`` in ``experiments/results/sim_runs_bfloat16.tar.xz``), so it
unpacks next to itself into the directories the profiles and tables name. A profile fitted on such runs records
the archive's file name and SHA-256 (``runs_archive: {file, sha256}``); unpacking checks the archive against it.

    pack(root, members, archive)            # deterministic: same files, same bytes, same SHA-256
    ensure_extracted(archive, sha256=...)   # unpack once (a stamp remembers which archive), then reuse
    runs_archive(profile) / record_runs_archive(profile, file, sha256)
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import re
import tarfile
from pathlib import Path
from typing import Any, Iterable

import yaml

KEY = "runs_archive"


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path, members: Iterable[str]) -> list[str]:
    """Every regular file under ``root / member`` for each member, as sorted POSIX paths relative to ``root``."""
    found = set()
    for member in members:
        path = root / member
        if path.is_file():
            found.add(Path(member).as_posix())
        elif path.is_dir():
            found.update(p.relative_to(root).as_posix() for p in path.rglob("*") if p.is_file())
        else:
            raise FileNotFoundError(f"{path} does not exist")
    return sorted(found)


def pack(root: str | Path, members: Iterable[str], archive: str | Path) -> str:
    """Write ``archive`` (``.tar.xz``) holding every file under ``root / member`` for each of ``members`` at its
    path relative to ``root``; returns the archive's SHA-256. The bytes depend only on the files' paths and
    contents (sorted, no times, owners or modes), so packing the same runs again gives the same archive."""
    root, archive = Path(root), Path(archive)
    tmp = archive.with_name(archive.name + ".tmp")
    with open(tmp, "wb") as raw, tarfile.open(fileobj=raw, mode="w:xz", format=tarfile.GNU_FORMAT, preset=9) as tar:
        for name in _files(root, members):
            data = (root / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, archive)
    digest = file_sha256(archive)
    if root.resolve() == archive.parent.resolve():  # the files packed are what unpacking it there would give
        _stamp(archive, root).write_text(digest + "\n")
    return digest


def _stamp(archive: Path, dest: Path) -> Path:
    return dest / f".{archive.name}.sha256"


def ensure_extracted(archive: str | Path, dest: str | Path | None = None, *, sha256: str | None = None) -> Path:
    """Unpack ``archive`` into ``dest`` (default: the archive's directory) unless the stamp there says this very
    archive was unpacked already; returns ``dest``. ``sha256``: the digest the archive must have (a profile's
    ``runs_archive``), else ``ValueError``. Unpacking overwrites the files the archive holds and leaves others
    (runs made since) alone; only regular files inside ``dest`` are unpacked (tarfile's ``data`` filter)."""
    archive = Path(archive)
    dest = Path(dest) if dest is not None else archive.parent
    if not archive.is_file():
        raise FileNotFoundError(f"run archive {archive} does not exist")
    digest = file_sha256(archive)
    if sha256 is not None and digest != sha256:
        raise ValueError(f"run archive {archive} has SHA-256 {digest}, but the profile records {sha256}: the "
                         "archive is not the one the profile was fitted on")
    stamp = _stamp(archive, dest)
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / f".{archive.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process unpacks; the others wait, then see its stamp
        if not (stamp.is_file() and stamp.read_text().strip() == digest):
            with tarfile.open(archive, mode="r:xz") as tar:
                _extract_files(tar, dest)
            stamp.write_text(digest + "\n")
    return dest


def _extract_files(tar: tarfile.TarFile, dest: Path) -> None:
    """Every member of ``tar`` into ``dest``, refusing anything but regular files and directories inside it."""
    if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
        tar.extractall(dest, filter="data")
        return
    root = dest.resolve()
    for member in tar.getmembers():
        target = (dest / member.name).resolve()
        if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
            raise ValueError(f"run archive member {member.name!r} is not a file inside {dest}")
    tar.extractall(dest)


def runs_archive(profile: str | Path | dict) -> dict[str, Any] | None:
    """A profile's ``runs_archive`` (``{"file": ..., "sha256": ...}``), or None when it records none."""
    data = profile if isinstance(profile, dict) else yaml.safe_load(Path(profile).read_text(encoding="utf-8"))
    entry = data.get(KEY) if isinstance(data, dict) else None
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)):
        raise ValueError(f"{profile}: {KEY} must be a mapping with a file and a sha256, got {entry!r}")
    return entry


def record_runs_archive(profile: str | Path, file: str, sha256: str) -> None:
    """Set ``runs_archive: {file, sha256}`` in a profile YAML, leaving every other line as it is: the key is
    replaced where it is, or else inserted after ``command`` (where ``calibrate`` writes it)."""
    path = Path(profile)
    text = path.read_text(encoding="utf-8")
    block = yaml.safe_dump({KEY: {"file": file, "sha256": sha256}}, sort_keys=False)
    lines = text.splitlines(keepends=True)
    top = [i for i, line in enumerate(lines) if re.match(r"[^\s#-][^:]*:", line)]

    def end_of(i: int) -> int:  # the line after key i's value
        later = [j for j in top if j > i]
        return later[0] if later else len(lines)

    keys = {lines[i].split(":", 1)[0]: i for i in top}
    if KEY in keys:
        start = keys[KEY]
        lines[start:end_of(start)] = [block]
    else:
        at = end_of(keys["command"]) if "command" in keys else len(lines)
        lines[at:at] = [block]
    new = "".join(lines)
    expected = {**yaml.safe_load(text), KEY: {"file": file, "sha256": sha256}}
    if yaml.safe_load(new) != expected:  # never write a profile that reads back differently
        raise ValueError(f"{path}: could not set {KEY} without changing other keys")
    path.write_text(new, encoding="utf-8")
