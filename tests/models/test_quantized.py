"""Quantized weights (``quantization="int8"`` / ``"gguf"``): the kernel against an integer emulation in torch on
every kernel build this CPU runs, the GGUF blocks against gguf-py's own dequantization and transformers' row
order, the config's refusals, and (slow) the engine on the default model against the quantized standard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import random_quant_linear
from nanovllm.config import EngineConfig
from nanovllm import machine
from nanovllm.models.gguf_model import GGUFWeights
from nanovllm.models.quantized import FORMAT_IDS, QuantLinear, dequantize, int8_kernel


def _quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: x rounded to int8 codes times their scale, per token and 32 values."""
    rows, k = x.shape
    groups = x.float().reshape(rows, -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # 127 / amax as the kernel divides (torch's scalar / tensor multiplies by the reciprocal: a rounding apart)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    return (torch.round(groups * inv) * (amax / 127)).reshape(rows, k)


def _two_digit_activations(x: torch.Tensor, digits: int = 2) -> torch.Tensor:
    """What the AMX int8 kernel multiplies by: per token, d (p1 + p2 / 256) with d = max|x| / 127,
    p1 = round(x / d) and p2 = round(256 x / d) - 256 p1 (at most 127); with one digit, d p1."""
    flat = x.float()
    amax = flat.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    p1 = torch.round(flat * inv)
    if digits == 1:
        return p1 * (amax / 127)
    p2 = (torch.round(flat * (inv * 256)) - 256 * p1).clamp(max=127)
    return (p1 + p2 / 256) * (amax / 127)


def _activations_multiplied(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """What an int8 ``layer`` multiplies its weights by: its digits per token on the tiles, int8 codes per token
    and 32 values on every other kernel."""
    return _two_digit_activations(x, layer.activation_digits) if layer.per_token_activations else _quantize_activations(x)


@pytest.fixture
def at_build_level(monkeypatch, kernel_isa) -> str:
    """The level in force pinned to the kernel build's own (``NANOVLLM_CPU_ISA``): on an AMX CPU the
    avx512_bf16 build then dispatches int8 to its VNNI kernel, not the tiles, so that kernel is tested there too."""
    monkeypatch.setenv(machine.ISA_ENV, kernel_isa)
    return kernel_isa


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("k", [96, 224])
def test_quant_linear_is_the_integer_dot_product_of_the_codes(compiled, fmt, dtype, rows, k):
    generator = torch.Generator().manual_seed(rows)
    # A partial tile of output features; 3 blocks (a pair and the odd one) and 7 (two pairs in the unrolled
    # 512-bit loop, then a pair and the odd one).
    n = 21
    layer = random_quant_linear(fmt, n, k, generator)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    y = compiled.quant_linear(x, layer.qweight, layer.scales, layer.mins, bias, FORMAT_IDS[fmt])
    reference = _quantize_activations(x) @ layer.dequantize().T + bias.float()
    assert y.dtype == dtype and y.shape == (rows, n)
    # float32: only the order of float additions differs; bfloat16: one rounding of the output.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.float() - reference).abs().max() <= tolerance * reference.abs().max()


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
@pytest.mark.parametrize("n, k", [(21, 96), (100, 224), (128, 64)])
def test_q4_interleaved_by_16_features_is_the_integer_dot_product_of_the_codes(compiled, fmt, dtype, rows, n, k):
    """Where the build has it (VNNI in avx512_bf16, AVX2 in avx2 and avx512), Q4 layers store their blocks
    interleaved by 16 features and run q4x16_linear: every row-group shape (1, 2, 3 and 4 rows a pass, then the
    rest), a partial last 16-feature block and 64-feature item (21, 100), whole ones (128); the scalar build
    keeps the plain layout."""
    generator = torch.Generator().manual_seed(rows + n)
    plain = random_quant_linear("q4_1", n, k, generator)
    mins = plain.mins if fmt == "q4_1" else (plain.scales.float() * -8).half()
    layer = QuantLinear(fmt, plain.qweight, plain.scales, mins, None, k, compiled)
    if not compiled.q4x16_available():
        assert layer.kernel == "vector"
        with pytest.raises(RuntimeError, match="no AVX2"):
            compiled.q4x16_linear(torch.randn(1, k), plain.qweight, plain.scales, mins, None, n)
        return
    assert layer.kernel == "q4x16" and "interleaved by 16 features" in layer.kernel_name()
    dense = QuantLinear(fmt, plain.qweight, plain.scales, mins, None, k, None).dequantize()
    assert torch.equal(layer.dequantize(), dense)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    layer.bias = torch.randn(n, generator=generator).to(dtype)
    y = layer(x)
    reference = _quantize_activations(x) @ dense.T + layer.bias.float()
    assert y.dtype == dtype and y.shape == (rows, n)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.float() - reference).abs().max() <= tolerance * reference.abs().max()


def test_q4_layers_give_back_their_blocks_rows_and_fusions_in_either_layout(compiled):
    """Whichever layout the build stores (interleaved by 16 features where it has AVX2, plain in scalar), the
    blocks, single rows (the embedding's lookups) and fused projections come back as stored."""
    generator = torch.Generator().manual_seed(5)
    plain = [random_quant_linear("q4_1", n, 64, generator) for n in (8, 40)]
    stored = [QuantLinear("q4_1", p.qweight, p.scales, p.mins, None, 64, compiled) for p in plain]
    layout = "q4x16" if compiled.q4x16_available() else "vector"
    assert all(t.kernel == layout for t in stored)
    if layout == "q4x16":
        assert stored[1].qweight.shape == (4, 2 * 256)  # 40 features padded to one 64-feature item, 2 K blocks
    for p, t in zip(plain, stored):
        assert all(torch.equal(a, b) for a, b in zip(t.canonical(), (p.qweight, p.scales, p.mins)))
    rows = torch.tensor([39, 0, 17])
    assert all(torch.equal(a, b) for a, b in zip(stored[1].canonical(rows), plain[1].canonical(rows)))
    fused = QuantLinear.concat(stored)
    assert fused.kernel == layout and torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in plain]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33, 70])
@pytest.mark.parametrize("n, k", [(21, 96), (100, 224), (128, 64)])
def test_int8_interleaved_by_16_features_gives_the_row_kernels_integer_sums(compiled, at_build_level, dtype, rows,
                                                                            n, k):
    """i8x16_linear (int8 weights as unsigned w + 128, interleaved by 16 features; VNNI in the avx512_bf16 build,
    AVX2's multiply by nibble-split codes in the avx2 and avx512 builds) against the row kernel (quant_linear) on
    the same codes and activations: every row-group shape (1-4 rows a pass, then the rest; AVX2's second tile of 64
    rows), partial last 16-feature blocks and 64-feature items (21, 100), whole ones (128), codes at -127 and 127
    (the correction for the unsigned weights). The first and last rows' first block is all 127 and all -127 codes
    against weight rows of 127 and -127: AVX2's int16 sums at their largest (8 steps of 2 x 255 x 8 = 32640). Its
    codes and scales come back as stored, single rows and fused. The scalar build keeps the row kernel and
    refuses the call. Each build runs at its own level, so the dispatch (``int8_kernel``) picks this kernel on
    an AMX CPU too."""
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=generator)
    weight[0, :32] = weight[0].abs().max()  # saturated codes: 127, and -127 below
    weight[1, :32] = -weight[1].abs().max()
    plain = QuantLinear.from_dense_int8(weight, None, None)
    plain.kernels = compiled  # the row kernel, on this build
    layer = QuantLinear("int8", plain.qweight, plain.scales, None, None, k, compiled)
    x = torch.randn(rows, k, generator=generator)
    x[0, :32], x[-1, :32] = 1.0, -1.0  # every code 127 (high nibble 8), or -127 (-8), in the first block
    x = x.to(dtype)
    assert layer.kernel == int8_kernel(compiled)
    if not compiled.i8x16_available():
        with pytest.raises(RuntimeError, match="no AVX2"):
            compiled.i8x16_linear(x, plain.qweight, plain.scales, None, n)
        return
    assert layer.kernel == "i8x16" and "interleaved by 16 features" in layer.kernel_name()
    assert layer.qweight.shape == (-(-n // 64) * 4, k // 32 * 512)
    assert torch.equal(layer.codes(), plain.qweight) and torch.equal(layer.canonical()[1], plain.scales)
    picked = torch.tensor([n - 1, 0, 1])
    assert all(torch.equal(a, b) for a, b in zip(layer.canonical(picked)[:2], plain.canonical(picked)[:2]))
    assert QuantLinear.concat([layer, layer]).kernel == "i8x16"
    assert torch.equal(QuantLinear.concat([layer, layer]).codes(), torch.cat([plain.qweight, plain.qweight]))
    bias = torch.randn(n, generator=generator).to(dtype)
    layer.bias = plain.bias = bias
    y, expected = layer(x), plain(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    # The same integer sums; only the order of the float block sums (and, in bf16, the output rounding) differs.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    reference = _quantize_activations(x) @ plain.dequantize().T + bias.float()
    assert (y.float() - reference).abs().max() <= (1e-4 if dtype == torch.float32 else 1e-2) * reference.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_quantized_layers_reuse_their_scratch_across_shapes_and_growth(compiled, fmt):
    """A quantized linear's activation codes and scales live in per-thread scratch (nanovllm/csrc/scratch.h),
    reused by every later call: calls that alternate two K (kept shapes), then a batch larger than any before (the
    buffers grow and old views are dropped), then the first shapes again, each give what the layer gave alone, and
    what the activations its kernel multiplies by (``_activations_multiplied``) give."""
    generator = torch.Generator().manual_seed(7)
    layers = {k: random_quant_linear(fmt, 48, k, generator, compiled) for k in (64, 160)}
    assert fmt != "int8" or all(layer.kernel == int8_kernel(compiled) for layer in layers.values())
    inputs = [torch.randn(rows, k, generator=generator) for rows, k in
              [(3, 64), (3, 160), (3, 64), (300, 160), (3, 160), (5, 64)]]
    alone = [layers[x.shape[1]](x).clone() for x in inputs]  # each right after a call of another shape
    again = [layers[x.shape[1]](x) for x in reversed(inputs)]
    assert all(torch.equal(a, b) for a, b in zip(alone, reversed(again)))
    reference = [_activations_multiplied(x, layers[x.shape[1]]) @ layers[x.shape[1]].dequantize().T
                 for x in inputs]
    assert all((a - r).abs().max() <= 1e-4 * r.abs().max() for a, r in zip(alone, reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layers_over_long_rows_give_the_scalar_builds_sums_in_tiles_and_with_stolen_work(compiled, dtype,
                                                                                              monkeypatch):
    """K = 8224 (257 blocks of 32: 32 groups of eight and one more; an all-zero block among them): the
    quantizer's eight-blocks-at-once path and its per-block rest, against the scalar build's per-block loop (same
    codes and scales, so the same integer sums). 70 rows at this K are three tiles of the VNNI kernel's rows (28
    a tile, two of the AVX2 kernel's 64); 4 threads on a machine with fewer cores (63 feature blocks) finish their
    ranges at different times, and the ones done first take work items from the back of the others' (TileRanges,
    which x16_gemm and x16_gemm_avx2 share). Every int8 kernel this build dispatches to runs: the row kernel, the
    interleaved one at the build's own level, and where the level in force takes the tiles, the AMX kernel, held
    to its own activations (two digits per token: five tiles of rows, K padded to 8256)."""
    from nanovllm import kernels

    rows, n, k = 70, 1000, 8224
    generator = torch.Generator().manual_seed(8224)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator)
    x[3, 64:96] = 0.0  # an all-zero block: scale 0, codes 0
    x[5, :256] *= 50.0  # blocks of another scale within one group of eight
    x = x.to(dtype)
    scalar = QuantLinear.from_dense_int8(weight, None, None)
    scalar.kernels = kernels.load("scalar")
    row_kernel = QuantLinear("int8", scalar.qweight, scalar.scales, None, None, k, None)
    row_kernel.kernels = compiled
    # Every kernel the dispatch gives this build: at the level in force (the tiles, on an AMX CPU) and at the
    # build's own level (its vector kernel), each once.
    in_force = int8_kernel(compiled)
    with monkeypatch.context() as pinned:
        pinned.setenv(machine.ISA_ENV, compiled.isa)
        at_build_level = int8_kernel(compiled)
        own = QuantLinear("int8", scalar.qweight, scalar.scales, None, None, k, compiled)
    kernels_run = list(dict.fromkeys([row_kernel.kernel, in_force, at_build_level]))
    layers = [row_kernel]
    if in_force not in (row_kernel.kernel, at_build_level):
        layers.append(QuantLinear("int8", scalar.qweight, scalar.scales, None, None, k, compiled))
    if at_build_level != row_kernel.kernel:
        layers.append(own)
    assert [layer.kernel for layer in layers] == kernels_run
    dense = scalar(x).float()
    per_token = _two_digit_activations(x).double() @ scalar.dequantize().double().T
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        results = [(layer, layer(x).float()) for layer in layers for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    for layer, y in results:
        reference = per_token.float() if layer.per_token_activations else dense
        assert (y - reference).abs().max() <= tolerance * reference.abs().max(), layer.kernel


def test_the_amx_kernel_gives_the_row_kernels_sums_where_both_codes_are_exact():
    """Where every token's values are whole multiples of its max|x| / 127 and every group of 32 holds that max,
    the tiles' two digits (the second all zero) and the row kernel's per-32 codes are the same integers: the AMX
    kernel then gives the row kernel's output, up to the order of float additions. Runs where the level in force
    takes the tiles; elsewhere the dispatch says why not."""
    from nanovllm import kernels

    compiled = kernels.load()
    if int8_kernel(compiled) != "amx":
        assert not (machine.selected_isa() == "amx" and "amx_int8" in machine.cpu_flags()
                    and compiled.int8_amx_available())
        return
    generator = torch.Generator().manual_seed(11)
    rows, n, k = 20, 40, 224
    codes = torch.randint(-127, 128, (rows, k), generator=generator).float()
    codes.view(rows, k // 32, 32)[:, :, 0] = 127.0  # every group's max is the token's
    x = codes * torch.rand(rows, 1, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    tiles = QuantLinear.from_dense_int8(weight, None, compiled)
    row_kernel = QuantLinear.from_dense_int8(weight, None, None)
    row_kernel.kernels = compiled
    assert tiles.kernel == "amx" and row_kernel.kernel == "vector"
    y, expected = tiles(x), row_kernel(x)
    assert (y - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 70])
@pytest.mark.parametrize("n, k", [(21, 96), (100, 224), (128, 64)])
def test_q8_0_interleaved_by_16_features_gives_the_row_kernels_integer_sums(compiled, dtype, rows, n, k):
    """q8x16_linear (GGUF Q8_0 codes as i8x16 stores them, fp16 block scales as q4x16 does; the avx2 and avx512
    builds) against the row kernel on the same blocks: 1-2 rows a pass, a second tile of 64 rows, partial last
    16-feature blocks and 64-feature items, codes at -128 and 127 (AVX2's largest byte pairs: |w| = 128 stays
    unsigned); its codes and scales come back as stored, single rows (the tied embedding's lookups) and fused.
    Other builds keep the row kernel and refuse the call."""
    generator = torch.Generator().manual_seed(rows * 7 + n)
    plain = random_quant_linear("q8_0", n, k, generator)
    plain.qweight[0, :32], plain.qweight[1, :32] = 127, -128
    plain.kernels = compiled  # the row kernel, on this build
    layer = QuantLinear("q8_0", plain.qweight, plain.scales, None, None, k, compiled)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    if not compiled.q8x16_available():
        assert layer.kernel == "vector"
        with pytest.raises(RuntimeError, match="no AVX2 interleaved kernels"):
            compiled.q8x16_linear(x, plain.qweight, plain.scales, None, n)
        return
    assert layer.kernel == "q8x16" and "interleaved by 16 features" in layer.kernel_name()
    assert layer.qweight.shape == (-(-n // 64) * 4, k // 32 * 512)
    assert all(torch.equal(a, b) for a, b in zip(layer.canonical()[:2], (plain.qweight, plain.scales)))
    picked = torch.tensor([n - 1, 0, 1])
    assert all(torch.equal(a, b) for a, b in zip(layer.canonical(picked)[:2], plain.canonical(picked)[:2]))
    fused = QuantLinear.concat([layer, layer])
    assert fused.kernel == "q8x16" and torch.equal(fused.codes(), torch.cat([plain.qweight, plain.qweight]))
    bias = torch.randn(n, generator=generator).to(dtype)
    layer.bias = plain.bias = bias
    y, expected = layer(x), plain(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    reference = _quantize_activations(x) @ plain.dequantize().T + bias.float()
    assert (y.float() - reference).abs().max() <= (1e-4 if dtype == torch.float32 else 1e-2) * reference.abs().max()


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("n, k", [(21, 96), (48, 64), (40, 224)])
def test_int8_amx_linear_is_the_integer_dot_product_of_its_digits(compiled, digits, dtype, rows, n, k):
    """On every build: where the CPU and OS run AMX-INT8 tiles (the avx512_bf16 build on an AMX CPU), the
    kernel's output in one and two digits per token over whole and partial tiles of rows (from 16 rows on,
    padded ones), an odd number of 16-feature blocks and a partial last one (21, 40), K a multiple of 64 and not
    (96, 224: padded); elsewhere it refuses to run, saying why."""
    generator = torch.Generator().manual_seed(rows + n)
    plain = QuantLinear.from_dense_int8(torch.randn(n, k, generator=generator), None, None)
    packed = compiled.pack_int8_amx(plain.qweight)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    if not compiled.int8_amx_available():
        with pytest.raises(RuntimeError, match="has no AMX-INT8 tiles"):
            compiled.int8_amx_linear(x, packed, plain.scales, bias, n)
        return
    y = compiled.int8_amx_linear(x, packed, plain.scales, bias, n, digits)
    reference = _two_digit_activations(x, digits).double() @ plain.dequantize().double().T + bias.double()
    assert y.dtype == dtype and y.shape == (rows, n)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.double() - reference).abs().max() <= tolerance * reference.abs().max()


def test_each_int8_projection_takes_its_activation_digits():
    """A model made int8 gives each projection the digits ``INT8_ACTIVATION_DIGITS`` names (the LM head two); on
    the tiles each layer multiplies by its own digits, and the profile's kernel name says how many. (That the C++
    decoder stack runs the same layers bitwise as the Python loop is tests/models/test_decoder_stack.py's.)"""
    import transformers

    from nanovllm.models.llama import LlamaForCausalLM
    from nanovllm.models.quantized import INT8_ACTIVATION_DIGITS

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, max_positions=64).use_fast_path("int8")
    for layer in model.layers:
        for name, linear in [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]:
            assert linear.activation_digits == INT8_ACTIVATION_DIGITS[name]
    assert [head.activation_digits for head in model.lm_head_layers()] == [2]
    generator = torch.Generator().manual_seed(1)
    for layer in model.linear_layers() + model.lm_head_layers():
        assert layer.kernel == int8_kernel(model.kernels)
        if layer.kernel != "amx":
            continue
        assert ("two digits" if layer.activation_digits == 2 else "one digit") in layer.kernel_name()
        x = torch.randn(7, layer.in_features, generator=generator)
        expected = _two_digit_activations(x, layer.activation_digits).double() @ layer.dequantize().double().T
        assert (layer(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_int8_layers_take_the_tiles_on_the_amx_level_and_give_back_their_codes():
    from nanovllm import kernels

    compiled = kernels.load()
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    plain = QuantLinear.from_dense_int8(weight, None, None)
    stored = QuantLinear.from_dense_int8(weight, None, compiled)
    expected = int8_kernel(compiled)
    on_tiles = expected == "amx"
    assert plain.kernel == "vector" and stored.kernel == expected
    if on_tiles:
        assert stored.qweight.dtype == torch.uint8 and stored.qweight.shape == (3, 128 * 16)  # K padded to 128
        assert "AMX-INT8" in stored.kernel_name()
    assert torch.equal(stored.codes(), plain.qweight)
    assert torch.equal(stored.dequantize(), plain.dequantize())
    assert torch.equal(QuantLinear.concat([stored, stored]).codes(), torch.cat([plain.qweight, plain.qweight]))


def test_int8_amx_linear_refuses_a_weight_of_another_shape(compiled):
    packed = compiled.pack_int8_amx(QuantLinear.from_dense_int8(torch.randn(32, 64), None, None).qweight)
    scales = torch.ones(32)
    if not compiled.int8_amx_available():
        with pytest.raises(RuntimeError, match="has no AMX-INT8 tiles"):
            compiled.int8_amx_linear(torch.randn(2, 64), packed, scales, None, 32)
        return
    with pytest.raises(RuntimeError, match="does not match K or N"):
        compiled.int8_amx_linear(torch.randn(2, 128), packed, scales, None, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        compiled.int8_amx_linear(torch.randn(2, 64).half(), packed, scales, None, 32)
    with pytest.raises(RuntimeError, match="digits must be 1 or 2, got 3"):
        compiled.int8_amx_linear(torch.randn(2, 64), packed, scales, None, 32, 3)


def test_quant_linear_refuses_shapes_and_dtypes_it_cannot_run(compiled):
    layer = random_quant_linear("q4_1", 8, 64, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        compiled.quant_linear(torch.randn(2, 48), layer.qweight, layer.scales, layer.mins, None, 2)
    with pytest.raises(RuntimeError, match="q4 needs float16 mins"):
        compiled.quant_linear(torch.randn(2, 64), layer.qweight, layer.scales, None, None, 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        compiled.quant_linear(torch.randn(2, 64).half(), layer.qweight, layer.scales, layer.mins, None, 2)


def test_int8_weights_are_within_half_a_step_of_the_dense_ones():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    layer = QuantLinear.from_dense_int8(weight, None, None)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert layer.qweight.dtype == torch.int8 and layer.scales.shape == (64,)
    assert ((layer.dequantize() - weight).abs() <= step / 2 + 1e-7).all()
    assert layer.num_bytes == 64 * 128 + 64 * 4


def test_fusing_quantized_projections_concatenates_their_rows():
    generator = torch.Generator().manual_seed(2)
    parts = [random_quant_linear("q4_1", n, 64, generator) for n in (8, 4, 4)]
    fused = QuantLinear.concat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="share their format"):
        QuantLinear.concat([parts[0], random_quant_linear("q8_0", 4, 64, generator)])


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]], architecture: str = "qwen2") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for name, (array, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            data = array
        elif kind in ("Q8_0", "Q4_0", "Q4_1"):
            data = gguf.quants.quantize(array, qtype)
        else:  # a type gguf-py cannot quantize: its blocks' bytes, zero (only the type is read)
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(array.shape, qtype), dtype=np.uint8)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class _Config:
    num_attention_heads = 4
    num_key_value_heads = 2


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_each_gguf_block_type_reads_as_gguf_py_dequantizes_it(tmp_path, kind):
    import gguf

    weight = np.random.default_rng(3).standard_normal((24, 64)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, {"blk.0.ffn_down.weight": (weight, kind), "blk.0.ffn_down.bias": (weight[:, 0].copy(), "F32")})
    weights = GGUFWeights(path, _Config(), None)
    layer = weights.linear("blk.0.ffn_down.weight", "blk.0.ffn_down.bias")
    expected = gguf.quants.dequantize(gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind]),
                                      gguf.GGMLQuantizationType[kind])
    assert layer.fmt == kind.lower() and layer.out_features == 24 and layer.in_features == 64
    assert np.allclose(layer.dequantize().numpy(), expected, rtol=0, atol=1e-6)
    assert torch.equal(layer.bias, torch.from_numpy(weight[:, 0]))
    # 4.5-5 bits per weight (Q4) or 8.5 (Q8_0), as in the file: the blocks are split, never widened.
    bits = layer.num_bytes * 8 / weight.size
    assert bits == {"Q8_0": 8.5, "Q4_0": 5.0, "Q4_1": 5.0}[kind]


def test_llama_q_and_k_rows_are_put_back_in_transformers_order(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = np.random.default_rng(4).standard_normal((32, 64)).astype(np.float32)
    path = tmp_path / "llama.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (weight, "Q8_0"), "blk.0.attn_k.weight": (weight[:16], "Q8_0"),
                       "blk.0.attn_v.weight": (weight[:16], "Q8_0")}, architecture="llama")
    weights = GGUFWeights(path, _Config(), None)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    for name, rows in (("attn_q", 32), ("attn_k", 16), ("attn_v", 16)):
        gguf_order = GGUFWeights(path, _Config(), None)
        gguf_order.architecture = "qwen2"  # no reordering: the file's own rows
        plain = gguf_order.linear(f"blk.0.{name}.weight").dequantize().numpy()
        expected = processor.process(plain, f"blk.0.{name}.weight").weights
        assert np.array_equal(weights.linear(f"blk.0.{name}.weight").dequantize().numpy(), expected)
        if name != "attn_v":
            assert not np.array_equal(expected, plain)  # the reordering really happened


def test_a_gguf_with_blocks_the_kernel_does_not_run_is_refused_by_tensor(tmp_path):
    weight = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    path = tmp_path / "k_quant.gguf"
    _write_gguf(path, {"blk.0.ffn_up.weight": (weight, "Q6_K")})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' is Q6_K: use quantization=None"):
        GGUFWeights(path, _Config(), None).check_types()


@pytest.mark.parametrize("options, message", [
    ({"quantization": "int4"}, "quantization must be None or one of int8, gguf"),
    ({"quantization": "int8", "device": "cuda"}, "device must be 'cpu'"),
    ({"quantization": "gguf", "tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
    ({"quantization": "int8", "fuse_projections": False}, "fuse_projections must be true or None"),
])
def test_bad_quantization_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_quantization_implies_the_fast_path_even_in_float32():
    assert EngineConfig(quantization="int8").fast_path and not EngineConfig().fast_path


def test_gguf_quantization_needs_a_gguf_file(tmp_path):
    from nanovllm.models.loader import gguf_source

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        gguf_source(tmp_path)
    assert gguf_source(None).suffix == ".gguf"


def test_dequantize_unpacks_low_nibbles_first():
    codes = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # low nibble 1, high nibble 2
    w = dequantize("q4_1", codes, torch.ones(1, 1).half(), torch.zeros(1, 1).half())
    assert w[0, :16].tolist() == [1.0] * 16 and w[0, 16:].tolist() == [2.0] * 16


# ---- the engine on the default model (slow) ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_gguf_engine_runs_the_files_blocks_and_no_dense_weight(llm):
    from nanovllm import LLM, SamplingParams
    from nanovllm.profile import format_kernels

    quantized = LLM(quantization="gguf", num_kv_blocks=64, max_model_len=512)
    model = quantized.engine.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    assert not any(t.is_meta for t in tensors)
    assert all(isinstance(m, QuantLinear) for m in model.linear_layers())
    assert {m.fmt for m in model.linear_layers()} == {"q4_1"} and model.lm_head_chunks[0].fmt == "q8_0"
    weight_bytes = sum(m.num_bytes for m in model.linear_layers()) + model.lm_head_chunks[0].num_bytes
    dense_bytes = sum(p.numel() * 4 for p in llm.engine.runner.model.parameters())
    assert weight_bytes < 0.25 * dense_bytes  # 4-5 bits a weight against float32's 32
    # What the monitor's MBU counts a step as streaming: these blocks, not float32 weights.
    from nanovllm.serving.monitor import ModelCost

    assert model.streamed_weights()[0] == weight_bytes == ModelCost.from_model(model).weight_bytes
    # The simulator's cost of the same run, from the file's header alone: the same bytes, and in memory the
    # file's tensors (the Q8_0 embedding is the tied head), not a dense embedding.
    unbuilt = ModelCost.from_hf_config(model.config, torch.float32, quantization="gguf")
    assert unbuilt.weight_bytes == weight_bytes and unbuilt.int8_matmuls
    assert weight_bytes < unbuilt.weight_memory_bytes < 1.01 * weight_bytes
    assert ModelCost.from_model(model).weight_memory_bytes == pytest.approx(unbuilt.weight_memory_bytes, rel=0.005)
    table = format_kernels(model, [1, 16])
    compiled = quantized.engine.runner.model.kernels
    layers = "q4x16_linear q4_1 int8-dot" if compiled.q4x16_available() else "quant_linear q4_1 int8-dot"
    lm_head = "q8x16_linear q8_0 int8-dot" if compiled.q8x16_available() else "quant_linear q8_0 int8-dot"
    assert layers in table and lm_head in table
    out = quantized.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                             use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and "Paris" in out.text


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_quantized_weights_meet_the_quantized_standard(llm, parity_prompts, quantization):
    from nanovllm.validate import validate_quantized

    report = validate_quantized(quantization, prompts=None, max_tokens=16, dtype="float32",
                                num_kv_blocks=96, max_model_len=1024)
    assert report.passed, (report.perplexity, report.dense_perplexity)
    assert report.perplexity != report.dense_perplexity  # the quantized path really ran
    # At each prompt's first divergence both tokens are in the other side's top-5 (vLLM's standard). How long
    # greedy tokens agree before that is reported, not bounded: it follows the machine's float rounding and the
    # kernel's activation scheme (docs/quantization.md has it per CPU kind).
    assert all(r.close for r in report.results), [(r.prompt, r.matching_prefix) for r in report.results]


@pytest.mark.slow
def test_a_gguf_run_needs_only_the_files_config_and_tokenizer_not_its_dense_conversion(tmp_path):
    from transformers import AutoTokenizer

    from nanovllm.models.loader import _gguf_cache_dir, _metadata_dir, default_gguf_path, resolve_model

    gguf = default_gguf_path()
    metadata = _metadata_dir(gguf, tmp_path / "metadata")
    assert (metadata / "config.json").is_file() and not list(metadata.glob("*.safetensors"))
    text = "<|im_start|>user\nThe capital of France is<|im_end|>"
    dense = resolve_model(gguf)
    assert AutoTokenizer.from_pretrained(metadata).encode(text) == AutoTokenizer.from_pretrained(dense).encode(text)
    # With the dense conversion already cached, a gguf run takes that directory (same config and tokenizer).
    assert resolve_model(gguf, weights=False) == _gguf_cache_dir(gguf) == dense


def test_a_profile_of_dense_weights_says_so_for_a_quantized_simulated_run(tmp_path, monkeypatch):
    from nanovllm.harness.sim import this_machine
    from nanovllm.harness.sim.step_time import CalibratedStepTime

    monkeypatch.setenv(this_machine.PROFILES_ENV, str(tmp_path))  # the shipped profile, not a cached one
    assert CalibratedStepTime(dtype="float32").quantization_warning() is None
    warning = CalibratedStepTime(dtype="float32", quantization="gguf").quantization_warning()
    assert warning is not None and "engine.quantization=none, this run uses gguf" in warning
    assert "--this-machine --dtype float32" in warning and warning.endswith("--quantization gguf`)")


def test_a_run_records_its_quantization_for_calibration(tmp_path):
    import json

    from nanovllm.harness.sim.calibrate import run_setup

    (tmp_path / "config.json").write_text(json.dumps({"engine": {"dtype": "float32", "quantization": "int8"}}))
    assert run_setup(tmp_path)["quantization"] == "int8"
