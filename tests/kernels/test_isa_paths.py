"""Every lower ISA level this CPU supports, forced with ``NANOVLLM_CPU_ISA`` (the rest of the suite runs the
best one): the level really is in force (nano-vllm's kernel build, torch's ATen capability), the float32
reference path stays token-exact with transformers under it, and the bf16 fast path with the cpu attention
kernel meets the closeness standard. Each level runs in its own process, since torch reads its caps once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm import machine
from nanovllm.kernels import kernel_build

REPO = Path(__file__).resolve().parents[2]
LOWER_LEVELS = list(machine.supported_isas()[1:])
ATEN_CAPABILITY = {"avx512_bf16": "AVX512", "avx512": "AVX512", "avx2": "AVX2", "scalar": "DEFAULT"}

# warmup=False: the engine's warm-up only times batch shapes (tests/engine/test_warmup.py tests it) and changes no
# output, yet under the scalar level's bf16 matmuls its 256-token prefill alone took most of this test's time.
CHECK = """
import json
import torch
from nanovllm import kernels, machine
from nanovllm.validate import validate_output
exact = validate_output(max_tokens=12, attention="torch", num_kv_blocks=64, max_model_len=512, warmup=False)
close = validate_output(max_tokens=12, dtype="bfloat16", attention="cpu", num_kv_blocks=64, max_model_len=512,
                        warmup=False)
print(json.dumps({"isa": machine.selected_isa(), "kernel": kernels.load().isa,
                  "aten": torch.backends.cpu.get_cpu_capability(),
                  "exact": [exact.standard, exact.passed], "close": [close.standard, close.passed]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", LOWER_LEVELS)
def test_a_forced_lower_level_runs_and_meets_both_standards(level):
    env = {**os.environ, "NANOVLLM_CPU_ISA": level, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"] == level and result["kernel"] == kernel_build(level)
    assert result["aten"] == ATEN_CAPABILITY[level]
    assert result["exact"] == ["exact", True]
    assert result["close"] == ["close", True]


def test_a_level_the_cpu_lacks_or_a_misspelt_one_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("NANOVLLM_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="NANOVLLM_CPU_ISA='avx9' is not an ISA level"):
        machine.selected_isa()
    missing = [level for level in machine.ISA_LEVELS if level not in machine.supported_isas()]
    for level in missing:
        monkeypatch.setenv("NANOVLLM_CPU_ISA", level)
        with pytest.raises(ValueError, match="does not support it"):
            machine.selected_isa()


def test_levels_follow_the_cpu_flags():
    avx512 = machine.REQUIRED_FLAGS["avx512"]
    every_flag = avx512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}
    assert machine.supported_isas(frozenset()) == ("scalar",)
    if machine.platform.machine().lower() not in ("x86_64", "amd64"):
        # The SIMD levels are x86-64 ones: elsewhere every flag set runs the portable build.
        assert machine.supported_isas(every_flag) == ("scalar",)
        return
    assert machine.supported_isas(frozenset({"avx2", "fma", "f16c"})) == ("avx2", "scalar")
    assert machine.supported_isas(avx512) == ("avx512", "avx2", "scalar")
    assert machine.supported_isas(every_flag) == machine.ISA_LEVELS
    # The avx512_bf16 build's int8 dot products are VNNI instructions: a CPU without VNNI does not get it.
    assert machine.supported_isas(avx512 | {"avx512_bf16"}) == ("avx512", "avx2", "scalar")
