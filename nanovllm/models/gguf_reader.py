"""The GGUF file format, read without building anything: its scalar metadata and its tensors, memory-mapped
(``read_gguf``), and what a Llama-family file's matmuls store (``gguf_stored_bytes``, for the cost model).
``quantization="gguf"`` builds the model from these tensors (``nanovllm.models.gguf_model``) over the quantized
layers of ``nanovllm.models.quantized``; this module needs neither torch nor the layers."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")     # the quantized GGUF tensor types quantization="gguf" runs
GGUF_DENSE_TYPES = ("F32", "F16", "BF16")


@dataclass
class GGUFTensor:
    name: str
    kind: str                  # GGML type name: Q4_1, F32, ...
    shape: tuple[int, ...]     # GGUF's order: the fastest-varying dimension (K of a weight) first
    data: np.ndarray           # its bytes in the file (memory-mapped, uint8), or the values of a dense type


# GGUF metadata value types (the GGUF spec) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_DENSE_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """The scalar metadata and the tensors of a GGUF file, the tensors memory-mapped. Array metadata (the
    tokenizer's vocabulary: ~100k strings here) is skipped, not decoded: gguf-py's reader decodes every value
    and takes seconds on it, longer than building the whole model."""
    # gguf (gguf-py) only for its type tables: imported when a file is read, not with the engine.
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = raw.data  # the map's memoryview
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"model={str(path)!r} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24

    def read(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, buf, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return value

    def read_string() -> str:
        nonlocal pos
        size = read("Q")
        pos += size
        return bytes(buf[pos - size:pos]).decode("utf-8", "replace")

    def skip_value(kind: int) -> object:
        nonlocal pos
        if kind == 8:
            return read_string()
        if kind == 9:
            element, count = read("I"), read("Q")
            if element in _SCALARS:
                pos += count * struct.calcsize("<" + _SCALARS[element])
            else:
                for _ in range(count):
                    skip_value(element)
            return None
        return read(_SCALARS[kind])

    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key = read_string()
        metadata[key] = skip_value(read("I"))
    infos = []
    for _ in range(num_tensors):
        name = read_string()
        dims = tuple(read("Q") for _ in range(read("I")))
        infos.append((name, dims, GGMLQuantizationType(read("I")), read("Q")))
    declared = metadata.get("general.alignment", 32)
    if not isinstance(declared, (int, float, str)):
        raise ValueError(f"model={str(path)!r}: general.alignment is {declared!r}, not a number")
    alignment = int(declared)
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims))
        data = raw[start + offset:start + offset + count // block * block_bytes]
        if qtype.name in _DENSE_NUMPY:
            data = data.view(_DENSE_NUMPY[qtype.name])
        tensors[name] = GGUFTensor(name, qtype.name, dims, data)
    del version
    return metadata, tensors


# The tensors of a Llama-family GGUF that run as matmuls (build_gguf_model's linears), per decoder block.
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_head_name(tensors) -> str:
    """The tensor a GGUF model's LM head runs: ``output.weight``, or the embedding it is tied to."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


def gguf_stored_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes, weights) of the matmul weights a forward pass over ``path``'s blocks streams -- the decoder
    layers' linears and the LM head (``output``, or the tied ``token_embd``), as the file stores them -- and the
    bytes of all its tensors: what ``quantization="gguf"`` holds in memory, read from the header alone. The
    simulator's cost model of a GGUF run (``ModelCost.from_hf_config``) takes them; a built model's own count
    (``LlamaForCausalLM.streamed_weights``) agrees."""
    _, tensors = read_gguf(path)
    head = gguf_head_name(tensors)
    matmuls = [tensor for name, tensor in tensors.items()
               if name == head or (name.startswith("blk.") and name.split(".")[-2] in _GGUF_LINEARS)]
    if not matmuls or head not in tensors:
        raise ValueError(f"{Path(path).name} has no Llama-family linears (blk.N.attn_q.weight, ...) and LM head")
    return (sum(t.data.nbytes for t in matmuls), sum(int(np.prod(t.shape)) for t in matmuls),
            sum(t.data.nbytes for t in tensors.values()))
