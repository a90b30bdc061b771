"""Loading a pooling model: which architectures pool, the model with its weights (packed for
the CPU matmul), its tokenizer, its pooling and its context limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vpage.distributed import parallel_state
from vpage.model_executor.layers.linear import pack_dense_weights
from vpage.model_executor.loader.default_model import DEFAULT_MODEL_NAME
from vpage.model_executor.loader.model_loader import (_resolve_dtype, load_hf_config,
                                                      model_has_tokenizer, resolve_device, resolve_model_source)
from vpage.model_executor.loader.safetensors_weights import iterate_safetensors, safetensors_files
from vpage.model_executor.models import get_model_class
from vpage.pooling.models import ENCODER_ARCHITECTURES, EncoderModel, encoder_architecture
from vpage.pooling.st_config import PoolerConfig, max_seq_length, read_pooler_config
from vpage.tokenizer import get_tokenizer

RUNNERS = ("auto", "generate", "pooling")
# vLLM's default pooling of an encoder embedding model without a sentence-transformers config.
_ENCODER_DEFAULT = PoolerConfig("CLS", True)
_DECODER_DEFAULT = PoolerConfig("LAST", True)  # vLLM's for a decoder run as an embedding model


@dataclass
class LoadedPoolingModel:
    """A pooling model ready to run and what the engine needs around it."""

    # model(batch, rows) -> hidden states; with a head also classify(first) -> logits
    model: nn.Module
    architecture: str
    hf_config: Any
    tokenizer: Any  # None for a folder without one
    device: torch.device
    dtype: torch.dtype
    pooler: PoolerConfig  # a classification model pools through its head: the first token (CLS) or the mean
    max_model_len: int
    num_labels: Optional[int]  # classification models only


def pooling_architectures() -> list[str]:
    return sorted(ENCODER_ARCHITECTURES)


def resolve_runner(model: Optional[str], runner: str) -> str:
    """"generate" or "pooling": ``runner`` itself, or for "auto" "pooling" when the model's
    architecture is one of ``pooling_architectures()`` or a decoder's base model without a
    language-model head (``Qwen3Model``: what sentence-transformers saves), as vLLM decides by
    the architecture's name; a ``*ForCausalLM`` generates. ValueError for another runner name."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if runner != "auto":
        return runner
    if model is None or model == DEFAULT_MODEL_NAME or str(model).endswith(".gguf"):
        return "generate"
    source = resolve_model_source(model)
    if source.gguf_file:
        return "generate"
    hf_config = load_hf_config(model)
    if encoder_architecture(hf_config):
        return "pooling"
    archs = getattr(hf_config, "architectures", None) or [""]
    return "pooling" if archs[0].endswith("Model") and decoder_class(hf_config) else "generate"


def _cannot_pool(path: Any, hf_config: Any, decoder: bool) -> ValueError:
    archs = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")]
    why = ("is a decoder without a sentence-transformers config (modules.json) saying how it pools; "
           "pooler_config={'pooling_type': 'LAST'} embeds with its last token" if decoder else
           "is not a pooling architecture")
    return ValueError(f"{path}: this model cannot pool: {archs[0]!r} {why}; the pooling architectures are "
                      f"{pooling_architectures()} and vpage's decoders with a sentence-transformers config "
                      "(runner='generate' serves the decoders)")


def decoder_class(hf_config: Any) -> Optional[type]:
    """vpage's decoder class for the config's architecture (``XForCausalLM``, or the base
    ``XModel`` an embedding checkpoint names), None when there is none."""
    for name in (getattr(hf_config, "architectures", None) or [])[:1]:
        try:
            return get_model_class(name)
        except ValueError:
            return None
    return None


def decoder_pooler(model: Optional[str], override: Optional[dict] = None, classifier: bool = False) -> PoolerConfig:
    """How a decoder pools on the paged engine (runner "pooling"): its sentence-transformers
    config or ``override`` (EngineArgs.pooler_config), last-token pooling only (the engine
    keeps no hidden state of the tokens before the last); a classifier of next-token logits
    (``token_classifier``) reads the last token without a sentence-transformers config.
    ValueError naming the path for a model that cannot pool so."""
    source = resolve_model_source(model)
    hf_config = load_hf_config(model)
    if not source.gguf_file and encoder_architecture(hf_config):
        raise ValueError(f"{source.path}: {encoder_architecture(hf_config)} is an encoder: it pools on "
                         "vpage.pooling.PoolingEngine (LLM and vpage serve choose it), not LLMEngine")
    decoder = None if source.gguf_file else decoder_class(hf_config)
    if classifier and decoder is not None:
        return PoolerConfig("LAST", False)
    if decoder is None or not ((source.folder / "modules.json").is_file() or override):
        raise _cannot_pool(source.path, hf_config, decoder is not None)
    pooler = read_pooler_config(source.folder, _DECODER_DEFAULT, override)
    if pooler.pooling_type != "LAST":
        raise ValueError(f"{source.path}: a decoder pools its last token (pooling_type LAST); {pooler.pooling_type} "
                         "pooling needs the hidden states of every prompt token, which the paged engine does not keep")
    return pooler


_HF_OVERRIDE_KEYS = {"architectures", "classifier_from_token", "is_original_qwen3_reranker"}


def token_classifier(model: Optional[str], hf_overrides: Optional[dict]) -> Optional[tuple[tuple[int, ...], bool]]:
    """vLLM's ``hf_overrides`` that make a causal LM a classifier of its next-token logits
    (Qwen3-Reranker: ``{"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}``): the token ids
    whose logits are the classes, and whether two of them give one score, sigmoid(logit of the
    second - logit of the first). None without overrides; ValueError for overrides vpage does not
    apply or tokens that are not single tokens of the vocabulary."""
    if not hf_overrides:
        return None
    unknown = set(hf_overrides) - _HF_OVERRIDE_KEYS
    archs = hf_overrides.get("architectures") or []
    tokens = hf_overrides.get("classifier_from_token")
    if unknown or not tokens or not all(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"hf_overrides: vpage applies {sorted(_HF_OVERRIDE_KEYS)} to make a causal LM a classifier "
                         "of its next-token logits (architectures '*ForSequenceClassification' and "
                         f"classifier_from_token), got {hf_overrides}")
    binary = bool(hf_overrides.get("is_original_qwen3_reranker", False))
    if binary and len(tokens) != 2:
        raise ValueError("is_original_qwen3_reranker scores with two tokens (classifier_from_token: [no, yes])")
    tokenizer = get_tokenizer(resolve_model_source(model).folder)
    ids = tuple(int(tokenizer.convert_tokens_to_ids(t)) for t in tokens)
    bad = [t for t, i in zip(tokens, ids) if i == tokenizer.unk_token_id or i is None or i < 0]
    if bad:
        raise ValueError(f"classifier_from_token {bad} are not tokens of this model's vocabulary")
    return ids, binary


def is_encoder(model: Optional[str]) -> bool:
    """Whether ``model`` is one of ``pooling_architectures()`` (else a decoder, or nothing that pools)."""
    if model is None or model == DEFAULT_MODEL_NAME or resolve_model_source(model).gguf_file:
        return False
    return encoder_architecture(load_hf_config(model)) is not None


def load_pooling_model(model: Optional[str], dtype: str = "auto", device: str = "auto",
                       pooler_override: Optional[dict] = None) -> LoadedPoolingModel:
    """Loads a Hugging Face folder (safetensors, float32, bfloat16 or float16; float16 runs as
    bfloat16 on the CPU) of one of ``pooling_architectures()``. ``max_model_len`` is the
    positions the model has (less RoBERTa's ``pad_token_id + 1`` offset), capped at a
    sentence-transformers ``max_seq_length``. ValueError naming the path for another
    architecture, a GGUF file, or a broken checkpoint; FileNotFoundError for missing files."""
    source = resolve_model_source(model)
    hf_config = load_hf_config(model)
    architecture = None if source.gguf_file else encoder_architecture(hf_config)
    if architecture is None:
        raise _cannot_pool(source.path, hf_config, False)
    torch_device = resolve_device(device)
    torch_dtype = _resolve_dtype(dtype, hf_config, source, torch_device)
    try:
        with parallel_state.single_rank(), torch.device(torch_device):
            net = EncoderModel(hf_config, torch_dtype, ENCODER_ARCHITECTURES[architecture])
        net.load_weights(iterate_safetensors(safetensors_files(source.folder)))
    except ValueError as e:
        raise ValueError(f"{source.path}: {e}") from e
    net.eval()
    if torch_device.type == "cpu":
        pack_dense_weights(net)
    tokenizer = get_tokenizer(source.folder) if model_has_tokenizer(model) else None
    max_len = int(hf_config.max_position_embeddings) - net.position_offset
    if max_seq_length(source.folder):
        max_len = min(max_len, max_seq_length(source.folder))
    if net.head is not None:  # the first token's hidden state, or the mean (a head's ``pooling``)
        pooler = PoolerConfig(getattr(net.head, "pooling", "CLS"), False)
    else:
        pooler = read_pooler_config(source.folder, _ENCODER_DEFAULT, pooler_override)
    return LoadedPoolingModel(net, architecture, hf_config, tokenizer, torch_device, torch_dtype, pooler, max_len,
                              net.num_labels)
