"""``load_model``: resolve a model name or path, build the model, load its weights."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from vpage.distributed.parallel_state import tp_rank
from vpage.model_executor.config import ModelConfig
from vpage.model_executor.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from vpage.model_executor.loader.gguf_config import hf_config_from_gguf
from vpage.model_executor.loader.gguf_file import GgufFile
from vpage.model_executor.loader.gguf_weights import gguf_tensor_types, iterate_gguf
from vpage.model_executor.layers.quantization import GgufQuantConfig, QuantConfig
from vpage.model_executor.loader.safetensors_weights import has_tensor, iterate_safetensors, safetensors_files
from vpage.model_executor.models import architecture_of, get_model_class
from vpage.model_executor.layers.rotary import rope_max_positions
from vpage.model_executor.models.llama import LlamaForCausalLM, head_size_of, num_kv_heads_of, rope_settings
from vpage.tokenizer import get_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
QUANTIZATION_MODES = ("auto", "none")
logger = logging.getLogger("vpage")


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs around it."""

    model: LlamaForCausalLM  # call model(batch, kv_caches), then model.compute_logits
    config: ModelConfig
    tokenizer: Any  # transformers tokenizer; None for a folder that ships none
    device: torch.device
    hf_config: Any  # the transformers config the model was built from


@dataclass
class _Source:
    """Where the weights are: a Hugging Face folder, or a GGUF file (``gguf_file`` set)."""

    folder: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        """The GGUF file, or the folder."""
        return self.folder / self.gguf_file if self.gguf_file else self.folder


def resolve_model_source(model: str | None) -> _Source:
    """Map a model argument (None/"smollm2", a folder, or a .gguf file) to its files."""
    if model is None or model == DEFAULT_MODEL_NAME:
        path = default_model_path()
        return _Source(path.parent, path.name)
    path = Path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be .gguf (or pass a Hugging Face folder)")
        return _Source(path.parent, path.name)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder or GGUF file (vpage never downloads models)")
    if (path / "config.json").is_file():
        return _Source(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _Source(path, ggufs[0].name)
    raise FileNotFoundError(f"{path}: neither config.json nor exactly one .gguf file in this folder")


def _load_hf_config(source: _Source, reader: Any) -> Any:
    """The transformers config: from GGUF metadata (``reader``) or the folder's config.json."""
    from transformers import AutoConfig

    if reader is not None:
        return hf_config_from_gguf(reader)
    try:
        return AutoConfig.from_pretrained(str(source.folder), local_files_only=True)
    except Exception as e:  # transformers raises many types for bad or missing files
        raise ValueError(f"{source.path}: cannot read model config ({type(e).__name__}: {e})") from e


def resolve_device(device: str) -> torch.device:
    """"auto" is CUDA when a device is usable, else the CPU; ValueError for anything but
    auto/cpu/cuda, or for cuda without a device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def _resolve_dtype(dtype: str, hf_config: Any, source: _Source, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype (GGUF: float32 on CPU, bfloat16 on GPU); float16
    becomes bfloat16 on CPU, where half-precision matmuls are slow."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if source.gguf_file:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    stored = _DTYPES.get(str(stored).removeprefix("torch."), torch.float32)
    return torch.bfloat16 if stored == torch.float16 and device.type == "cpu" else stored


def _max_model_len(hf_config: Any) -> int:
    """``max_position_embeddings`` (stretched by dynamic NTK or YaRN rope scaling); a sliding
    window does not cap it (the kernels apply the window, the block manager frees the blocks
    before it)."""
    return rope_max_positions(int(getattr(hf_config, "max_position_embeddings", 2048)), rope_settings(hf_config)[1])


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _eos_token_ids(hf_config: Any, source: _Source, tokenizer_eos: list[int]) -> list[int]:
    """End-of-sequence ids from the config, generation_config.json and the tokenizer's."""
    ids = _as_list(getattr(hf_config, "eos_token_id", None))
    gen_path = source.folder / "generation_config.json"
    if not source.gguf_file and gen_path.is_file():
        ids += _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
    return sorted(set(ids + tokenizer_eos))


def _tokenizer_eos_from_files(source: _Source, reader: Any) -> Optional[list[int]]:
    """The tokenizer's EOS id read from the files, without loading the tokenizer: a GGUF file's
    ``tokenizer.ggml.eos_token_id``, or tokenizer_config.json's ``eos_token`` looked up among
    tokenizer.json's tokens. [] when the model ships no tokenizer; None when the files alone
    cannot tell (a special_tokens_map.json, no tokenizer.json, an EOS it does not list)."""
    if reader is not None:
        eos = reader.metadata.get("tokenizer.ggml.eos_token_id")
        return None if eos is None else [int(eos)]
    folder = source.folder
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return []
    config_path, vocab_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if (folder / "special_tokens_map.json").is_file() or not vocab_path.is_file() or not config_path.is_file():
        return None
    eos = json.loads(config_path.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    spec = json.loads(vocab_path.read_text())
    for token in spec.get("added_tokens", []):
        if token.get("content") == eos:
            return [int(token["id"])]
    found = (spec.get("model") or {}).get("vocab", {})
    return [int(found[eos])] if isinstance(found, dict) and eos in found else None


def model_has_tokenizer(model: str | None) -> bool:
    """Whether ``model`` ships a tokenizer (a GGUF file always does)."""
    source = resolve_model_source(model)
    return bool(source.gguf_file) or any((source.folder / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(model: str | None = None) -> Any:
    """The tokenizer of ``model`` (None when it ships none), without its weights."""
    source = resolve_model_source(model)
    reader = GgufFile(source.path) if source.gguf_file else None
    return _load_tokenizer(source, _load_hf_config(source, reader))


def _quant_config(reader: Any, model_class: type[LlamaForCausalLM], quantization: str,
                  device: torch.device) -> QuantConfig:
    """Which weights the model keeps in their GGUF block format: those ``GgufQuantConfig``
    takes, for a GGUF file loaded with quantization "auto" on the CPU; none otherwise."""
    if reader is None or quantization != "auto" or device.type != "cpu":
        return QuantConfig()
    return GgufQuantConfig.from_tensor_types(gguf_tensor_types(reader, model_class.arch.gguf),
                                             model_class.arch.param_for)


def _weights(source: _Source, hf_config: Any, reader: Any,
             model_class: type[LlamaForCausalLM]) -> Iterator[tuple[str, Any]]:
    if reader is not None:
        return iterate_gguf(reader, source.path, model_class.arch.gguf, hf_config.num_attention_heads,
                            num_kv_heads_of(hf_config))
    return iterate_safetensors(safetensors_files(source.folder))


def _load_tokenizer(source: _Source, hf_config: Any) -> Any:
    if source.gguf_file or any((source.folder / f).is_file() for f in _TOKENIZER_FILES):
        return get_tokenizer(source.folder, source.gguf_file, hf_config)
    return None


def load_hf_config(model: str | None = None) -> Any:
    """The transformers config of ``model`` without loading its weights (to validate options)."""
    source = resolve_model_source(model)
    reader = GgufFile(source.path) if source.gguf_file else None
    return _load_hf_config(source, reader)


def load_model(model: str | None = None, dtype: str = "auto", device: str = "auto",
               quantization: str = "auto", with_tokenizer: bool = True, pooling: bool = False) -> LoadedModel:
    """Load a model for inference.

    model: None or "smollm2" (the default SmolLM2-135M-Instruct GGUF), a Hugging Face
    folder (config.json + safetensors, sharded or not), or a .gguf file (or a folder
    holding exactly one). dtype: auto|float32|bfloat16|float16 (with quantized weights, the
    activation dtype). device: auto|cpu|cuda. quantization: "auto" keeps a GGUF file's
    Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights quantized on the CPU (matmuls dequantize inside
    the kernel); "none" (and any CUDA load) dequantizes every weight to dtype.
    ``pooling=True`` (runner "pooling") ties the LM head to the embeddings when the checkpoint
    has none, so a base model's checkpoint (Qwen3-Embedding's) loads. ``with_tokenizer=False`` leaves ``LoadedModel.tokenizer`` None (the engine-core process of
    a server handles no text): the tokenizer's EOS id is then read from its files where they
    tell it, and the tokenizer is loaded only to read it where they do not.
    Under tensor parallelism (``vpage.distributed.parallel_state``) the model is this rank's
    shard; quantized weights stay quantized where the shard keeps whole GGUF blocks, and a
    row-parallel layer whose columns per rank would cut blocks is dequantized (rank 0 logs
    one warning naming those layers). Raises FileNotFoundError for missing files and ValueError for corrupt files,
    unsupported architectures or options; the message names the path.
    """
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    source = resolve_model_source(model)
    torch_device = resolve_device(device)
    reader = GgufFile(source.path) if source.gguf_file else None
    hf_config = _load_hf_config(source, reader)
    if pooling and reader is None and not has_tensor(safetensors_files(source.folder), "lm_head.weight"):
        hf_config.tie_word_embeddings = True  # a base model's checkpoint: embeddings read no logits
    architecture = architecture_of(hf_config)
    model_class = get_model_class(architecture)
    torch_dtype = _resolve_dtype(dtype, hf_config, source, torch_device)
    try:
        quant = _quant_config(reader, model_class, quantization, torch_device)
        with torch.device(torch_device):
            net = model_class(hf_config, torch_dtype, quant)
        cut_blocks = quant.cut_blocks_message()
        if cut_blocks and tp_rank() == 0:
            logger.warning("%s", cut_blocks)
        net.load_weights(_weights(source, hf_config, reader, model_class))
    except ValueError as e:
        if str(source.path) in str(e):  # already names the file
            raise
        raise ValueError(f"{source.path}: {e}") from e
    net.eval()
    tokenizer, tokenizer_eos = None, None if with_tokenizer else _tokenizer_eos_from_files(source, reader)
    if tokenizer_eos is None:
        tokenizer = _load_tokenizer(source, hf_config)
        tokenizer_eos = _as_list(tokenizer.eos_token_id) if tokenizer is not None else []
        if not with_tokenizer:
            tokenizer = None
    config = ModelConfig(
        architecture=architecture,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=num_kv_heads_of(hf_config),
        head_size=head_size_of(hf_config),
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
        max_model_len=_max_model_len(hf_config),
        dtype=torch_dtype,
        eos_token_ids=_eos_token_ids(hf_config, source, tokenizer_eos),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
    )
    return LoadedModel(net, config, tokenizer, torch_device, hf_config)
