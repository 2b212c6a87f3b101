"""``copy_kv_blocks`` (``csrc/kv_copy.cpp``), the copy of a KV-tier load into the paged pool, in every kernel build
this CPU runs (the ``compiled`` fixture): bit for bit the numpy path it replaces (``copy_runs_numpy``) and each
block where ``block_ids`` puts it, for float32, bfloat16 and packed 8-bit caches, runs ascending, descending and
alone, from a strided view of a tier's slab and into a pool whose lines are not aligned; which layouts it takes;
and ``ModelRunner.write_kv`` taking it, or numpy without it."""

from __future__ import annotations

import pytest
import torch

from nanovllm import kernels
from nanovllm.engine import model_runner
from nanovllm.engine.model_runner import ModelRunner, copy_runs_kernel, copy_runs_numpy, kernel_copy_fits

LAYERS = 3
# (dtype, block shape): float32 and bf16 blocks of 16 tokens x 3 heads x 8; an 8-bit cache's packed rows (bytes:
# head_dim + 4 of scale); and rows of 15 bytes, so pieces start and end inside lines.
LAYOUTS = {
    "float32": (torch.float32, (16, 3, 8)),
    "bfloat16": (torch.bfloat16, (16, 3, 8)),
    "int8": (torch.uint8, (16, 2, 12)),
    "odd_bytes": (torch.uint8, (3, 5)),
}
# Pool block ids of one load: one run up, one down, blocks alone, and all of them mixed (more pieces than the
# kernel copies side by side, of different lengths).
BLOCK_IDS = {
    "ascending": [4, 5, 6, 7, 8],
    "descending": [9, 8, 7, 6],
    "single": [12, 3, 17],
    "mixed": [2, 3, 4, 5, 11, 10, 9, 15, 0, 19, 18, 7],
}
POOL_BLOCKS = 20


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaN patterns included for the floats: the copy is of bytes)."""
    size = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).view(dtype).view(shape)


def _slab_view(block: tuple[int, ...], dtype: torch.dtype, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` blocks as a host tier hands them out: slots 5 .. 5 + n - 1 of a larger slab, a strided view."""
    slab = _random((LAYERS, 2, n + 9, *block), dtype, generator)
    return slab[:, :, 5:5 + n]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("ids", list(BLOCK_IDS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_kernel_copies_as_the_numpy_path_bit_for_bit(compiled, layout, ids):
    dtype, block = LAYOUTS[layout]
    block_ids = BLOCK_IDS[ids]
    generator = torch.Generator().manual_seed(len(block_ids))
    pool = _random((LAYERS, 2, POOL_BLOCKS, *block), dtype, generator)
    src = _slab_view(block, dtype, len(block_ids), generator)
    assert not src.is_contiguous() and kernel_copy_fits(pool, src)
    by_numpy, by_kernel = pool.clone(), pool.clone()
    copy_runs_numpy(by_numpy, src, block_ids)
    copy_runs_kernel(compiled, by_kernel, src, block_ids)
    assert torch.equal(_bytes(by_kernel), _bytes(by_numpy))
    # And the blocks are where block_ids says, the rest of the pool untouched.
    expected = pool.clone()
    for k, block_id in enumerate(block_ids):
        expected[:, :, block_id] = src[:, :, k]
    assert torch.equal(_bytes(by_kernel), _bytes(expected))


@pytest.mark.parametrize("offset", [1, 3, 40])
def test_a_pool_and_a_source_off_line_boundaries_copy_whole(compiled, offset):
    """Heads and tails of pieces that start inside a cache line go through ordinary stores."""
    generator = torch.Generator().manual_seed(offset)
    shape = (LAYERS, 2, POOL_BLOCKS, 40, 7)   # 280-byte blocks
    storage = _random((torch.Size(shape).numel() + offset,), torch.uint8, generator)
    pool = storage[offset:].view(shape)
    src = _random((LAYERS, 2, 6, 40, 7), torch.uint8, generator)
    src_storage = _random((src.numel() + offset,), torch.uint8, generator)
    shifted = src_storage[offset:].view(src.shape)
    block_ids = [1, 2, 3, 14, 13, 7]
    assert pool.data_ptr() % 64 and shifted.data_ptr() % 64
    for source in (src, shifted):
        expected = pool.clone()
        copy_runs_numpy(expected, source, block_ids)
        copy_runs_kernel(compiled, pool, source, block_ids)
        assert torch.equal(pool, expected)


def test_the_build_names_the_store_path_the_dispatch_gives_it(compiled):
    assert compiled.kv_copy_isa() == kernels.kv_copy_variant(compiled.isa)


def test_layouts_the_kernel_does_not_take_are_refused():
    pool = torch.zeros(LAYERS, 2, POOL_BLOCKS, 16, 3, 8)
    fits = torch.zeros(LAYERS, 2, 4, 16, 3, 8)
    assert kernel_copy_fits(pool, fits)
    assert not kernel_copy_fits(pool, torch.zeros(LAYERS, 2, 4, 16, 8, 3).transpose(-1, -2))  # a block not contiguous
    assert not kernel_copy_fits(pool, torch.zeros(LAYERS, 2, 4, 16, 3, 4))   # another block shape
    assert not kernel_copy_fits(pool, torch.zeros(LAYERS + 1, 2, 4, 16, 3, 8))   # other layers
    assert not kernel_copy_fits(pool, torch.zeros(LAYERS, 2, 4, 16, 3, 8, dtype=torch.float64))  # element size
    assert not kernel_copy_fits(pool, pool[:, :, 2:6])   # the pool's own blocks: overlapping copies
    assert not kernel_copy_fits(pool.to("meta"), fits.to("meta"))


def test_a_run_out_of_range_is_an_error_not_a_write(compiled):
    pool = torch.zeros(LAYERS, 2, POOL_BLOCKS, 16, 3, 8)
    src = torch.ones(LAYERS, 2, 2, 16, 3, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        compiled.copy_kv_blocks(pool, src, torch.tensor([[0, POOL_BLOCKS - 1, 2, 0]]))
    with pytest.raises(RuntimeError, match="out of range"):
        compiled.copy_kv_blocks(pool, src, torch.tensor([[1, 0, 2, 0]]))
    assert not pool.any()


def _runner(pool: torch.Tensor) -> ModelRunner:
    """A ModelRunner with only a KV cache: what write_kv reads."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.kv_cache = torch.device("cpu"), pool
    return runner


class _Spy:
    """A kernels module whose copy_kv_blocks counts its calls and runs the real one."""

    def __init__(self, compiled: kernels.Kernels) -> None:
        self.compiled, self.calls = compiled, 0

    def copy_kv_blocks(self, pool: torch.Tensor, src: torch.Tensor, runs: torch.Tensor) -> None:
        self.calls += 1
        self.compiled.copy_kv_blocks(pool, src, runs)


@pytest.mark.parametrize("layout", ["bfloat16", "int8"])
def test_write_kv_copies_through_the_kernel_and_through_numpy_without_it(compiled, monkeypatch, layout):
    dtype, block = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(7)
    pool = _random((LAYERS, 2, POOL_BLOCKS, *block), dtype, generator)
    data = _slab_view(block, dtype, 9, generator)
    block_ids = BLOCK_IDS["mixed"][:7]
    expected = pool.clone()
    for k, block_id in enumerate(block_ids):
        expected[:, :, block_id] = data[:, :, 2 + k]
    spy = _Spy(compiled)
    monkeypatch.setattr(model_runner, "_copy_kernels", lambda: spy)
    with_kernel = pool.clone()
    _runner(with_kernel).write_kv(block_ids, data, 2)
    assert spy.calls == 1 and torch.equal(_bytes(with_kernel), _bytes(expected))
    monkeypatch.setattr(model_runner, "_copy_kernels", lambda: None)
    without = pool.clone()
    _runner(without).write_kv(block_ids, data, 2)
    assert torch.equal(_bytes(without), _bytes(expected))
