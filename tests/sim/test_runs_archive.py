"""The simulator's calibration runs are kept as one archive per dtype (experiments/results/sim_runs_D.tar.xz),
recorded with its SHA-256 in the shipped profile; unpacking it gives the runs the profile names, and the profile's
own command, run on them, gives the profile back. No model is loaded."""

from __future__ import annotations

import io
import shlex
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from nanovllm.harness.sim import calibrate, runs_archive
from nanovllm.harness.sim.step_time import CalibratedStepTime, shipped_profiles

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("bfloat16", "float32")


def _runs(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for name, text in {"runs/a/steps.jsonl": '{"x": 1}\n', "runs/a/.hydra/config.yaml": "a: 1\n",
                       "runs/b/metrics.json": "{}\n", "runs/p.yaml": "k: v\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_pack_is_deterministic_and_unpacks_to_the_same_files(tmp_path) -> None:
    root = _runs(tmp_path)
    first = runs_archive.pack(root, ["runs"], tmp_path / "one.tar.xz")
    (root / "runs" / "a" / "steps.jsonl").touch()  # a newer mtime changes nothing
    assert runs_archive.pack(root, ["runs"], tmp_path / "two.tar.xz") == first
    assert (tmp_path / "one.tar.xz").read_bytes() == (tmp_path / "two.tar.xz").read_bytes()
    dest = tmp_path / "dest"
    assert runs_archive.ensure_extracted(tmp_path / "one.tar.xz", dest, sha256=first) == dest
    files = sorted(p.relative_to(dest).as_posix() for p in (dest / "runs").rglob("*") if p.is_file())
    assert files == ["runs/a/.hydra/config.yaml", "runs/a/steps.jsonl", "runs/b/metrics.json", "runs/p.yaml"]
    for name in files:
        assert (dest / name).read_bytes() == (root / name).read_bytes()
    # Unpacked once: the stamp says so, and a run added since is left alone.
    (dest / "runs" / "c").mkdir()
    (dest / "runs" / "a" / "steps.jsonl").write_text("edited\n")
    runs_archive.ensure_extracted(tmp_path / "one.tar.xz", dest)
    assert (dest / "runs" / "a" / "steps.jsonl").read_text() == "edited\n" and (dest / "runs" / "c").is_dir()


def test_an_archive_that_is_not_the_recorded_one_is_refused(tmp_path) -> None:
    runs_archive.pack(_runs(tmp_path), ["runs"], tmp_path / "a.tar.xz")
    with pytest.raises(ValueError, match="has SHA-256 .*, but the profile records 00"):
        runs_archive.ensure_extracted(tmp_path / "a.tar.xz", tmp_path / "dest", sha256="00")
    assert not (tmp_path / "dest").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        runs_archive.ensure_extracted(tmp_path / "missing.tar.xz")


def test_a_member_outside_the_destination_is_refused(tmp_path) -> None:
    with tarfile.open(tmp_path / "bad.tar.xz", "w:xz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    with pytest.raises(Exception):
        runs_archive.ensure_extracted(tmp_path / "bad.tar.xz", tmp_path / "dest")
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.parametrize("dtype", DTYPES)
def test_record_runs_archive_changes_only_that_key(tmp_path, dtype) -> None:
    shipped = shipped_profiles()[dtype]
    lines = shipped.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("runs_archive:"))
    without = tmp_path / "p.yaml"
    without.write_text("".join(lines[:start] + lines[start + 3:]))
    entry = runs_archive.runs_archive(shipped)
    runs_archive.record_runs_archive(without, entry["file"], entry["sha256"])
    assert without.read_text() == shipped.read_text()  # inserted where calibrate writes it
    runs_archive.record_runs_archive(without, "other.tar.xz", "ab")  # replaced in place
    assert runs_archive.runs_archive(without) == {"file": "other.tar.xz", "sha256": "ab"}
    assert len(without.read_text().splitlines()) == len(lines)
    # The loader reads a profile with the key as before.
    model = CalibratedStepTime(profile=shipped, dtype=dtype)
    assert model.predict({name: 1 for name in ("num_prefill_tokens", "num_decode_seqs", "num_sampled",
                                               "context_tokens", "attn_pairs")}, 0.0) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_shipped_profile_comes_back_from_its_archive_and_command(tmp_path, monkeypatch, dtype) -> None:
    """A fresh clone has the archive and the profile only; the profile's own command unpacks the runs it names
    from the archive it records (checked against the SHA-256) and fits the same profile."""
    shipped = shipped_profiles()[dtype]
    profile = yaml.safe_load(shipped.read_text())
    entry = profile["runs_archive"]
    assert entry["file"] == f"experiments/results/sim_runs_{dtype}.tar.xz"
    assert runs_archive.file_sha256(ROOT / entry["file"]) == entry["sha256"]
    clone = tmp_path / "clone"
    out = clone / shipped.relative_to(ROOT)
    out.parent.mkdir(parents=True)
    shutil.copy(shipped, out)
    (clone / entry["file"]).parent.mkdir(parents=True)
    shutil.copy(ROOT / entry["file"], clone / entry["file"])
    monkeypatch.chdir(clone)
    argv = shlex.split(profile["command"])
    assert argv[:3] == ["python", "-m", "nanovllm.harness.sim.calibrate"]
    calibrate.main(argv[3:])
    assert all((clone / run / "steps.jsonl").is_file() for run in profile["runs"])
    again = yaml.safe_load(out.read_text())
    assert list(again) == list(profile)
    for key, value in profile.items():
        if key in ("coefficients", "fit", "intercept", "step_gap"):
            assert again[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
        else:
            assert again[key] == value, key
