"""The fast path's fused C++ kernels against the torch code they replace (same math, float32 inside), for every
kernel build (ISA level) this CPU supports (the ``compiled`` fixture); and the kernel cache and its build lock."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanovllm import kernels, machine
from nanovllm.models.llama import RMSNorm, apply_rotary
from tests.conftest import KERNEL_BUILDS

REPO = Path(__file__).resolve().parents[2]


def _norm_with_random_weight(dtype: torch.dtype, dim: int = 96) -> RMSNorm:
    """The reference RMSNorm module with a random (not all-ones) weight, in ``dtype``."""
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_module(dtype, compiled):
    torch.manual_seed(0)
    norm = _norm_with_random_weight(dtype)
    x = (torch.randn(37, 96) * 3).to(dtype)
    expected = norm(x)
    got = compiled.rms_norm(x, norm.weight, norm.eps)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_projection_views(dtype, compiled):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 11, 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q_view, k_view, v_view = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q_view.reshape(tokens, heads, dim), k_view.reshape(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected_q, expected_k = apply_rotary((cos[:, None].to(dtype), sin[:, None].to(dtype)), q.clone(), k.clone())
    v_before = v_view.clone()
    compiled.rotary_(q, k, cos.contiguous(), sin.contiguous())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(q.float(), expected_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), expected_k.float(), atol=tol, rtol=tol)
    assert torch.equal(v_view, v_before)  # v, beside q and k in the same buffer, is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_then_normalizes_like_the_two_torch_steps(dtype, compiled):
    torch.manual_seed(2)
    norm = _norm_with_random_weight(dtype)
    residual, delta = (torch.randn(19, 96) * 3).to(dtype), torch.randn(19, 96).to(dtype)
    expected_sum = residual + delta
    expected = norm(expected_sum)
    got = compiled.add_rms_norm_(residual, delta, norm.weight, norm.eps)
    assert torch.equal(residual, expected_sum)  # the add is torch's, rounding included
    if dtype == torch.bfloat16:  # one rounding per step, as transformers' module does: bitwise the same
        assert torch.equal(got, expected)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_a_fused_gate_up_block(dtype, compiled):
    torch.manual_seed(3)
    gate_up = (torch.randn(13, 2 * 40) * 4).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = compiled.silu_and_mul(gate_up)
    assert got.shape == (13, 40)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="2 \\* width"):
        compiled.silu_and_mul(gate_up[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_greedy_sample_is_argmax_and_flags_nan_and_inf_rows(dtype, vocab, compiled):
    """One pass per row: torch.argmax's token (first index on ties), and a flag for NaN / +inf rows; -inf is a
    legitimate logit. 16-lane chunks plus a tail (vocab 1000, 7), and the plain loop (float16)."""
    torch.manual_seed(vocab)
    logits = (torch.randn(9, vocab) * 4).to(dtype)
    logits[1, vocab // 2] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[3, :] = float("-inf")
    logits[3, vocab // 3] = 0.0                      # one finite value among -inf
    logits[4, :] = 1.0                               # all tied: the first index
    logits[5, vocab - 1] = 1e4                       # the maximum in the tail
    logits[6, 0] = float("-inf")
    tokens, bad = compiled.greedy_sample(logits)
    assert bad.tolist() == [False, True, True, False, False, False, False, False, False]
    expected = logits.float().argmax(dim=-1)
    assert tokens[~bad].tolist() == expected[~bad].tolist()
    assert tokens[4] == 0 and tokens[5] == vocab - 1 and tokens[3] == vocab // 3


@pytest.mark.parametrize("k", [576, 100, 64, 33])
@pytest.mark.parametrize("n", [960, 37])
def test_gemv_matches_a_float_matmul_and_packed_linear_uses_it_for_few_rows(k, n, compiled):
    """The few-row bf16 GEMV (K and N tails included) against float32 math on the same bf16 inputs; and
    PackedLinear gives the same result whether a batch goes through it (1-2 rows) or oneDNN (3+ rows)."""
    from nanovllm.models.fast_path import PackedLinear, can_prepack

    torch.manual_seed(k + n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n).bfloat16()
    x = torch.randn(5, k).bfloat16()
    expected = x.float() @ weight.float().T + bias.float()
    # The GEMV needs the bf16 dot-product instruction: its build has it, every lower build refuses.
    assert compiled.gemv_available() == (compiled.isa == "avx512_bf16")
    if compiled.gemv_available():
        for rows in (1, 2, 5):
            got = compiled.gemv_bf16(x[:rows], weight, bias)
            torch.testing.assert_close(got.float(), expected[:rows], atol=2e-2, rtol=1e-2)
    else:  # no AVX-512 BF16: the kernel refuses, and PackedLinear (below) uses oneDNN for every row count
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            compiled.gemv_bf16(x[:1], weight, bias)
    if can_prepack(weight):
        packed = PackedLinear(weight, bias, kernels=compiled)
        few, many = packed(x[:2]), packed(x)
        assert few.shape == (2, n) and many.shape == (5, n)
        torch.testing.assert_close(few.float(), many[:2].float(), atol=2e-2, rtol=1e-2)




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (33, 30)])
def test_brgemm_linear_matches_a_float_matmul_at_every_row_block(n, k, dtype, compiled):
    """oneDNN's brgemm micro-kernel through nano-vllm's loop, against float32 math on the same inputs: a tail
    block of output features (37, 33), an odd number of 32-feature blocks, 1 row, a few, a row block of a
    multiple of 16 rows and a remainder (47), and two row blocks (300 > 256 rows). float32 is exact to rounding;
    bf16 to its output rounding. Runs in every build: the loop only calls torch's brgemm, which oneDNN compiles
    for the CPU. bf16 needs AMX or AVX-512 BF16: elsewhere both calls refuse with the reason (torch's brgemm
    would abort the process)."""
    from nanovllm.models.fast_path import PackedLinear

    torch.manual_seed(n + k)
    weight = (torch.randn(n, k) / k ** 0.5).to(dtype)
    bias = torch.randn(n).to(dtype)
    if dtype == torch.bfloat16 and not compiled.brgemm_bf16_available():
        with pytest.raises(RuntimeError, match="needs AMX or AVX-512 BF16"):
            compiled.pack_brgemm_weight(weight)
        blocks = torch.zeros((n + 31) // 32, k * 32, dtype=dtype)
        with pytest.raises(RuntimeError, match="needs AMX or AVX-512 BF16"):
            compiled.brgemm_linear(torch.randn(1, k).to(dtype), blocks, None, n)
        return
    packed = compiled.pack_brgemm_weight(weight)
    assert packed.shape == ((n + 31) // 32, k * 32) and packed.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for rows in (1, 3, 16, 47, 300):   # 47 = 32 + 15 and 300 = 256 + 32 + 12: the two calls of a row block
        x = torch.randn(rows, k).to(dtype)
        expected = x.float() @ weight.float().T + bias.float()
        got = compiled.brgemm_linear(x, packed, bias.float(), n)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), expected, **tol)
        no_bias = compiled.brgemm_linear_op(x, packed, None, n)  # the operator the linears call
        torch.testing.assert_close(no_bias.float(), expected - bias.float(), **tol)
    linear = PackedLinear(weight, bias, kernels=compiled)
    x = torch.randn(2, 3, k).to(dtype)  # leading dimensions pass through
    torch.testing.assert_close(linear(x).float(), (x.float() @ weight.float().T + bias.float()), **tol)


def test_brgemm_linear_refuses_mismatched_inputs(compiled):
    weight = torch.randn(64, 32)
    packed = compiled.pack_brgemm_weight(weight)
    with pytest.raises(RuntimeError, match="in_features or out_features"):
        compiled.brgemm_linear(torch.randn(2, 48), packed, None, 64)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        compiled.brgemm_linear(torch.randn(2, 32).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="even in_features"):
        compiled.pack_brgemm_weight(torch.randn(64, 33).bfloat16())


@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (16, 33), (1, 7)])
def test_bf16_fma_linear_matches_a_float_matmul_at_every_row_group(n, k, compiled):
    """bf16 weights widened to float32 in registers (AVX2's bf16 linear) against float32 math on the same inputs:
    feature tails (37, 1), K tails (33, 7), every row-group size (1-6 rows, 8 = 4 + 4, 13 = 5 + 4 + 4), a second
    row tile (70, 130 > 64). Bias or none. Builds without AVX2 refuse with the reason."""
    from nanovllm.models.fast_path import PackedLinear, linear_kernel

    torch.manual_seed(n + k)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n)
    packed = compiled.pack_bf16_fma_weight(weight)
    assert packed.shape == ((n + 15) // 16, k * 16) and packed.dtype == torch.bfloat16
    if not compiled.bf16_fma_available():
        assert compiled.isa == "scalar"
        with pytest.raises(RuntimeError, match="no AVX2"):
            compiled.bf16_fma_linear(torch.randn(1, k).bfloat16(), packed, None, n)
        return
    for rows in (1, 2, 3, 4, 5, 6, 8, 13, 70, 130):
        x = torch.randn(rows, k).bfloat16()
        expected = x.float() @ weight.float().T
        got = compiled.bf16_fma_linear(x, packed, bias, n)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # float32 sums in another order, then one rounding to bf16: within bf16's half ulp and a little more.
        torch.testing.assert_close(got.float(), expected + bias, atol=2e-2, rtol=8e-3)
        no_bias = compiled.bf16_fma_linear_op(x, packed, None, n)  # the operator the linears call
        torch.testing.assert_close(no_bias.float(), expected, atol=2e-2, rtol=8e-3)
    if linear_kernel(torch.bfloat16) == "bf16-fma":  # this CPU's fast path runs it: PackedLinear stores it so
        linear = PackedLinear(weight, bias.bfloat16(), kernels=compiled)
        assert linear.kernel == "bf16-fma"
        x = torch.randn(2, 3, k).bfloat16()  # leading dimensions pass through
        torch.testing.assert_close(linear(x).float(), x.float() @ weight.float().T + bias.bfloat16().float(),
                                   atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("build", [build for build in KERNEL_BUILDS if build != "scalar"])
def test_bf16_fma_linear_rounds_to_bf16_as_torch_does(build):
    """With K = 1 each output is one float32 product plus the bias, so the kernel's float32 result is torch's to
    the bit, and the outputs must equal torch's bf16 rounding exactly: ties to even (bf16 x bf16 products are exact
    in float32, and many land on a tie), infinities, and NaN from the input. Every build with AVX2 (the scalar
    build has no such kernel; the test above checks that it refuses)."""
    compiled = kernels.load(build)
    torch.manual_seed(3)
    n = 64
    weight = torch.randn(n, 1).bfloat16()
    bias = torch.randn(n).bfloat16().float()  # a bf16 value in float32: the sum x w + b rounds once, in float32
    x = torch.randn(40, 1).bfloat16()
    x[0, 0], x[1, 0], x[2, 0] = float("nan"), float("inf"), 3e38  # NaN, inf, and a finite sum past bf16's range
    got = compiled.bf16_fma_linear(x, compiled.pack_bf16_fma_weight(weight), bias, n)
    expected = (x.float() * weight.float().T + bias).bfloat16()
    ties = ((x.float() * weight.float().T + bias).view(torch.int32) & 0xFFFF) == 0x8000
    assert ties.sum() > 0  # the case that tells round-half-even from round-half-up is exercised
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])


def test_bf16_fma_linear_refuses_mismatched_inputs(compiled):
    weight = torch.randn(64, 32).bfloat16()
    packed = compiled.pack_bf16_fma_weight(weight)
    with pytest.raises(RuntimeError, match="in_features"):
        compiled.bf16_fma_linear(torch.randn(2, 48).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="x must be a 2-D bfloat16"):
        compiled.bf16_fma_linear(torch.randn(2, 32), packed, None, 64)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        compiled.bf16_fma_linear(torch.randn(2, 32).bfloat16(), packed, torch.randn(64).bfloat16(), 64)
    with pytest.raises(RuntimeError, match="weight must be a 2-D bfloat16"):
        compiled.pack_bf16_fma_weight(torch.randn(64, 32))


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16", "avx512", "avx2", "scalar"])
def test_each_isa_level_names_its_linear_kernel(isa):
    """bf16 runs brgemm on AMX tiles only, the GEMV + oneDNN pair with AVX-512 BF16, oneDNN on AVX-512 without
    BF16, nano-vllm's float32-FMA kernel on AVX2 (oneDNN has no bf16 there), oneDNN at the scalar level; float32
    runs brgemm wherever oneDNN has JIT kernels (not the scalar level, which caps them off)."""
    from nanovllm.models.fast_path import linear_kernel

    bf16 = {"amx": "brgemm", "avx512_bf16": "onednn+gemv", "avx2": "bf16-fma"}.get(isa, "onednn")
    assert linear_kernel(torch.bfloat16, isa) == bf16
    assert linear_kernel(torch.float32, isa) == ("onednn" if isa == "scalar" else "brgemm")


# -- the cache and its build lock ------------------------------------------------------------------------------

def _start_build(cache, level: str = "scalar") -> subprocess.Popen:
    """A process that loads (so builds, in an empty ``cache``) the kernels of ``level``, in its own session so
    the test can kill it with its compiler children."""
    env = {**os.environ, "NANOVLLM_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", f"from nanovllm import kernels; kernels.load({level!r})"],
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the build process ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> str:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    return stderr


def test_a_build_killed_mid_way_does_not_block_the_next_start(tmp_path):
    """The old failure: a build killed mid-way left torch's lock file, and every later start slept on it. Now
    the builders' lock is an OS lock, gone with its holder: the next start takes it at once, without waiting,
    clears torch's stale file and builds."""
    build_dir = tmp_path / "extensions" / kernels.build_name("scalar")
    torch_lock = build_dir / "lock"
    first = _start_build(tmp_path)
    try:
        _wait_for(torch_lock.exists, first, "compiler run (torch's lock file)")
    finally:
        _kill(first)
    assert torch_lock.exists()  # what the killed build leaves behind
    left = torch_lock.stat()
    second = _start_build(tmp_path)
    try:
        # It proceeds: torch's lock is recreated by the second build (a new file) or the build is done.
        def rebuilding() -> bool:
            try:
                now = torch_lock.stat()
            except FileNotFoundError:
                return (build_dir / f"{build_dir.name}.so").exists()
            return (now.st_ino, now.st_mtime_ns) != (left.st_ino, left.st_mtime_ns)

        _wait_for(rebuilding, second, "new build after the killed one")
    finally:
        stderr = _kill(second)
    assert "waiting for another process" not in stderr


WAITING = "waiting for another process's kernel build"


def _wait_under_held_lock(tmp_path, build_dir: Path, then=lambda waiter: None) -> list[str]:
    """Hold ``build_dir``'s build lock (as a builder would), start a process that loads the scalar kernels, wait
    until it says it is waiting, run ``then(waiter)`` with the lock still held, kill it; its stderr lines."""
    with kernels._build_lock(build_dir / "build.lock"):
        waiter = _start_build(tmp_path)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(waiter.stderr), daemon=True)
        reader.start()
        try:
            _wait_for(lambda: any(WAITING in line for line in lines), waiter, "waiting message")
            then(waiter)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(waiter.pid, signal.SIGKILL)
            waiter.wait(timeout=60)
            reader.join(timeout=60)
    return lines


def test_a_start_that_waits_for_another_build_says_so_once(tmp_path):
    """While another process holds the build lock (here: this test), a start waits, and says so once, however
    long it waits (here: until it has said so, and two seconds more)."""
    build_dir = tmp_path / "extensions" / kernels.build_name("scalar")
    build_dir.mkdir(parents=True)

    def still_waiting_two_seconds_later(waiter: subprocess.Popen) -> None:
        time.sleep(2)
        assert waiter.poll() is None  # still waiting: the lock is held

    lines = _wait_under_held_lock(tmp_path, build_dir, still_waiting_two_seconds_later)
    assert sum(WAITING in line for line in lines) == 1, lines


def test_a_library_another_process_is_still_linking_is_never_loaded(tmp_path):
    """The failure a fresh-cache suite run hit: one process found the .so another was still linking ("file too
    short") and loaded it. A .so without the build's ``built`` marker is a build in progress: a start waits for
    the builder's lock (and says so) instead of loading it."""
    name = kernels.build_name("scalar")
    build_dir = tmp_path / "extensions" / name
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"\x7fELF")  # what a half-written link leaves

    def still_waiting(waiter: subprocess.Popen) -> None:
        assert waiter.poll() is None

    lines = _wait_under_held_lock(tmp_path, build_dir, still_waiting)  # the builder, mid-link
    assert not any("file too short" in line or "could not build" in line for line in lines), lines


def test_bf16_brgemm_under_a_forced_lower_level_is_refused_not_an_abort():
    """``NANOVLLM_CPU_ISA=avx2`` caps oneDNN at AVX2 (``machine.apply_isa_cap``, at ``import nanovllm``), so
    oneDNN has no bf16 brgemm even on a CPU with AVX-512 BF16: the bf16 calls refuse with the reason, where they
    once let torch's brgemm abort the process. In a subprocess: the cap is read once, when oneDNN starts."""
    code = ("import torch\nfrom nanovllm import kernels\ncompiled = kernels.load()\n"
            "assert not compiled.brgemm_bf16_available()\n"
            "try:\n    compiled.pack_brgemm_weight(torch.zeros(64, 64, dtype=torch.bfloat16))\n"
            "except RuntimeError as exc:\n    print('refused:', exc)\n")
    env = {**os.environ, machine.ISA_ENV: "avx2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused:" in proc.stdout and "needs AMX or AVX-512 BF16" in proc.stdout


def test_the_unity_source_includes_every_kernel_source_once():
    """The extension compiles ``all_kernels.cpp`` alone: a source it does not include is never built, and a
    source listed in ``SOURCES`` but not included would change the cache key without changing the module."""
    import re

    included = re.findall(r'^#include "([^"]+\.cpp)"', kernels.UNITY_SOURCE.read_text(), flags=re.MULTILINE)
    on_disk = {p.name for p in kernels.CSRC.glob("*.cpp")} - {kernels.UNITY_SOURCE.name}
    assert sorted(included) == sorted(on_disk) == sorted(p.name for p in kernels.SOURCES)


def test_bad_isa_levels_are_clear_errors():
    with pytest.raises(ValueError, match="isa='avx9' is not an ISA level; choose one of amx, avx512_bf16"):
        kernels.load("avx9")
    unsupported = [level for level in machine.ISA_LEVELS if level not in machine.supported_isas()]
    for level in unsupported:
        with pytest.raises(ValueError, match=f"isa={level!r}: this CPU .* does not support it"):
            kernels.load(level)
