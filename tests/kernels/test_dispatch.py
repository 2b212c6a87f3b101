"""The CPU dispatch as each CPU kind this project's machines have shown would get it, on whatever CPU runs the
suite: the feature flags are pretended (``machine.cpu_flags`` monkeypatched), and the ISA level, kernel build,
linear kernels, int8 kernel and the bytes each layout stores follow from the same functions the engine calls.
So a run on an EPYC checks the AMX expectations' logic, and one on an AMX Xeon the EPYCs'. The second half
holds those pure functions to the real layers on every level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from nanovllm import kernels, machine
from nanovllm.models.fast_path import PackedLinear, can_prepack, linear_kernel, linear_weight_bytes
from nanovllm.models.quantized import QuantLinear, int8_kernel, int8_kernel_at, int8_weight_bytes

_BASE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"}
_AVX512 = {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd", "avx512ifma", "avx512vbmi"}
# /proc/cpuinfo flags of the three CPU kinds seen (the flags the dispatch reads, among others of theirs).
CPU_KINDS: dict[str, frozenset[str]] = {
    "xeon_amx": frozenset(_BASE | _AVX512 | {"avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
                                             "amx_int8"}),
    "epyc_avx512_bf16": frozenset(_BASE | _AVX512 | {"avx512_bf16", "avx512_vnni"}),
    "epyc_avx2": frozenset(_BASE),
}

# The tiny Llama of tests/serving/test_monitor.py (hidden 64, intermediate 160, 3 layers, 4 heads of 16, 2 KV
# heads, vocabulary 97) as the fast path stores it: fused qkv, o, fused gate_up, down per layer, then the head.
TINY_SHAPES = [(128, 64), (64, 64), (320, 64), (64, 160)] * 3 + [(97, 64)]

# What each kind gets: level, kernel build, bf16 and float32 linear kernels, int8 kernel, the store path of the
# pool's K/V copy (copy_kv_blocks), and the tiny model's streamed bytes in bf16 (brgemm pads the head's 97
# features to 128, bf16-fma to 112, oneDNN not at all) and in int8 (the tiles pad features to 16 and K to 64;
# i8x16 features to 64), codes plus float32 channel scales.
EXPECTED = {
    "xeon_amx": dict(levels=("amx", "avx512_bf16", "avx512", "avx2", "scalar"), level="amx", build="avx512_bf16",
                     bf16="brgemm", float32="brgemm", int8="amx", kv_copy="avx512", bf16_bytes=274_432,
                     int8_bytes=149_636),
    "epyc_avx512_bf16": dict(levels=("avx512_bf16", "avx512", "avx2", "scalar"), level="avx512_bf16",
                             build="avx512_bf16", bf16="onednn+gemv", float32="brgemm", int8="i8x16",
                             kv_copy="avx512", bf16_bytes=270_464, int8_bytes=144_640),
    "epyc_avx2": dict(levels=("avx2", "scalar"), level="avx2", build="avx2", bf16="bf16-fma", float32="brgemm",
                      int8="i8x16", kv_copy="avx2", bf16_bytes=272_384, int8_bytes=144_640),
}
# The K/V copy's store path at each level a kind can be forced down to (the scalar build: x86-64's SSE2).
LOWER_KV_COPY = {"avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": "sse2"}


@pytest.fixture
def pretend_cpu(monkeypatch):
    """Make the dispatch see the CPU kind it is given: its flags, an x86-64 machine, no forced level."""

    def pretend(kind: str) -> frozenset[str]:
        flags = CPU_KINDS[kind]
        monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
        monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
        monkeypatch.delenv(machine.ISA_ENV, raising=False)
        return flags

    return pretend


@pytest.mark.parametrize("kind", list(CPU_KINDS))
def test_each_cpu_kind_gets_its_level_kernels_and_byte_counts(pretend_cpu, kind):
    flags = pretend_cpu(kind)
    expected = EXPECTED[kind]
    level = machine.selected_isa()
    assert machine.supported_isas() == expected["levels"] and level == expected["level"]
    assert kernels.kernel_build(level) == expected["build"]
    assert linear_kernel(torch.bfloat16) == expected["bf16"]
    assert linear_kernel(torch.float32) == expected["float32"]
    assert int8_kernel_at(level, flags) == expected["int8"]
    assert kernels.kv_copy_variant(kernels.kernel_build(level)) == expected["kv_copy"]
    bf16 = sum(linear_weight_bytes(expected["bf16"], n, k, torch.bfloat16) for n, k in TINY_SHAPES)
    int8 = sum(int8_weight_bytes(expected["int8"], n, k) for n, k in TINY_SHAPES)
    assert (bf16, int8) == (expected["bf16_bytes"], expected["int8_bytes"])
    # Every lower level the kind can be forced to: none of them takes the tiles.
    for lower in expected["levels"][1:]:
        assert int8_kernel_at(lower, flags) == ("vector" if lower == "scalar" else "i8x16")
        assert kernels.kv_copy_variant(kernels.kernel_build(lower)) == LOWER_KV_COPY[lower]


def test_another_architecture_copies_kv_blocks_with_memcpy(pretend_cpu, monkeypatch):
    pretend_cpu("epyc_avx2")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    # Whatever level the dispatch picks there, and every level it would take, the copy has no x86 stores.
    for level in {machine.selected_isa(), *machine.supported_isas()}:
        assert kernels.kv_copy_variant(kernels.kernel_build(level)) == "memcpy"


def test_an_amx_cpu_without_amx_int8_runs_bf16_on_tiles_and_int8_on_vnni(pretend_cpu, monkeypatch):
    amx, vnni = EXPECTED["xeon_amx"], EXPECTED["epyc_avx512_bf16"]
    flags = pretend_cpu("xeon_amx") - {"amx_int8"}
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    # The level and the bf16 linears stay the AMX Xeon's; int8 takes the VNNI kernel, as on a CPU without tiles.
    assert machine.selected_isa() == amx["level"] and linear_kernel(torch.bfloat16) == amx["bf16"]
    assert int8_kernel_at(machine.selected_isa(), flags) == vnni["int8"]


def test_a_forced_level_is_what_the_dispatch_reads(pretend_cpu, monkeypatch):
    avx2, amx = EXPECTED["epyc_avx2"], EXPECTED["xeon_amx"]
    flags = pretend_cpu("xeon_amx")
    monkeypatch.setenv(machine.ISA_ENV, avx2["level"])  # the AMX Xeon forced down gets the AVX2 EPYC's kernels
    assert machine.selected_isa() == avx2["level"] and linear_kernel(torch.bfloat16) == avx2["bf16"]
    assert int8_kernel_at(machine.selected_isa(), flags) == avx2["int8"]
    pretend_cpu("epyc_avx2")
    monkeypatch.setenv(machine.ISA_ENV, amx["level"])
    with pytest.raises(ValueError, match="does not support it"):
        machine.selected_isa()


# -- the pure functions against the real layers, on every level this CPU runs ----------------------------------

@pytest.mark.parametrize("level", machine.supported_isas())
def test_the_real_layers_store_what_the_dispatch_says(monkeypatch, level):
    """At each level this CPU supports (forced in-process: the dispatch reads the level on every call), the
    layers built with that level's kernels run the kernel the pure mapping names and store the bytes it
    counts: dense bf16 and float32 layers (where the fast path packs them at all), and int8 ones."""
    monkeypatch.setenv(machine.ISA_ENV, level)
    compiled = kernels.load(level)
    assert compiled.isa == kernels.kernel_build(level)
    generator = torch.Generator().manual_seed(0)
    for n, k in [(97, 64), (64, 160)]:
        weight = torch.randn(n, k, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            if not can_prepack(weight.to(dtype), compiled):  # bf16 where neither oneDNN nor bf16-fma runs it
                continue
            layer = PackedLinear(weight.to(dtype), kernels=compiled)
            assert layer.kernel == linear_kernel(dtype, level)
            assert layer.num_bytes == linear_weight_bytes(layer.kernel, n, k, dtype)
        int8 = QuantLinear.from_dense_int8(weight, None, compiled)
        usable = int8_kernel_at(level, machine.cpu_flags())
        if usable == "amx" and not compiled.int8_amx_available():  # the OS refused this process the tiles
            usable = "i8x16"
        assert int8.kernel == int8_kernel(compiled) == usable
        assert int8.num_bytes == int8_weight_bytes(int8.kernel, n, k)
