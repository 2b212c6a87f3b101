"""A W8A8 int8 checkpoint of the default model in the compressed-tensors format, for vLLM's CPU int8 path.

vLLM's CPU build runs int8 weights with dynamic per-token int8 activations (``CompressedTensorsW8A8Int8``)
only from a checkpoint saved that way; none exists offline for SmolLM2. This writes one from the dense cached
weights with the same weight scheme as nano-vllm's ``quantization=int8`` (symmetric, one scale per output
channel, round to nearest), so ``bench_vs_vllm.py --paths int8-bf16`` compares the two engines' int8 paths on the
same int8 weights. The LM head (tied to the embedding) stays dense, as vLLM's int8 schemes leave it. Imports
torch, safetensors and the standard library only, so either virtualenv can run it:

    python experiments/make_w8a8_checkpoint.py OUT_DIR [--model DENSE_HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The decoder layers' linear weights, quantized; everything else is copied as it is.
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight")

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales [N, 1]: codes = round(w / scale), scale = max|w| / 127 per output row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def write_checkpoint(dense_dir: Path, out_dir: Path) -> int:
    """Write the W8A8 checkpoint of ``dense_dir`` to ``out_dir``; returns the number of quantized weights."""
    tensors = load_file(str(dense_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    quantized = 0
    for name, tensor in tensors.items():
        if name.endswith(LINEAR_SUFFIXES):
            codes, scale = quantize_per_channel(tensor)
            out[name] = codes
            out[name[: -len("weight")] + "weight_scale"] = scale.to(tensor.dtype)
            quantized += 1
        else:
            out[name] = tensor.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in dense_dir.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy2(extra, out_dir / extra.name)
    return quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", type=Path, default=None,
                        help="dense HF directory (default: nano-vllm's cached SmolLM2-135M, found by importing it)")
    args = parser.parse_args()
    dense = args.model
    if dense is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from nanovllm.models.loader import resolve_model

        dense = resolve_model()
    if not (dense / "model.safetensors").exists():
        parser.error(f"--model: {dense} has no model.safetensors")
    count = write_checkpoint(dense, args.out_dir)
    print(f"wrote {args.out_dir}: {count} int8 linear weights (per-channel scales), the rest as in {dense}")


if __name__ == "__main__":
    main()
