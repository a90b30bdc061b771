"""Reading a LoRA adapter in llama.cpp's GGUF format (``convert_lora_to_gguf.py``):
``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``, and per targeted
tensor ``blk.N.<name>.weight.lora_a`` (A ``[r, in]``) and ``.lora_b`` (B ``[out, r]``), in the
base model's GGUF names, Q/K rows of B interleaved per head as the converter does for the base
weights. The scaling is ``alpha / r`` (1 when alpha is 0), as llama.cpp applies it."""

from __future__ import annotations

import re
from typing import Any

import torch

from vpage.lora.peft_adapter import PeftAdapter
from vpage.model_executor.loader.gguf_file import GgufFile
from vpage.model_executor.loader.gguf_weights import hf_tensor_name, unpermute_rotary_rows
from vpage.model_executor.models.arch import GgufArch

_LORA = re.compile(r"^(blk\.\d+\.\w+\.weight)\.lora_([ab])$")
_HF_MODULE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")


def is_gguf_adapter(path: str) -> bool:
    return path.endswith(".gguf")


def load_gguf_adapter(path: str, arch: GgufArch | None, hf_config: Any) -> PeftAdapter:
    """The adapter in GGUF file ``path`` for a base model of GGUF architecture ``arch`` (its
    tensor names and Q/K interleave) with ``hf_config``'s heads. FileNotFoundError for a
    missing file; ValueError for a file that is no LoRA adapter of this architecture."""
    from gguf.quants import dequantize

    try:
        reader = GgufFile(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"LoRA adapter {path!r}: no such GGUF file") from None
    meta = reader.metadata
    if meta.get("general.type") != "adapter" or str(meta.get("adapter.type", "")).lower() != "lora":
        raise ValueError(f"LoRA adapter {path!r} is a GGUF file but no LoRA adapter (general.type "
                         f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})")
    if arch is None or meta.get("general.architecture") != arch.name:
        raise ValueError(f"LoRA adapter {path!r} is for GGUF architecture {meta.get('general.architecture')!r}; "
                         f"the base model's is {None if arch is None else arch.name!r}")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    heads = {"q_proj": hf_config.num_attention_heads,
             "k_proj": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = _LORA.match(tensor.name)
        hf_name = hf_tensor_name(match.group(1), arch) if match else None
        module = _HF_MODULE.match(hf_name) if hf_name else None
        if module is None:
            raise ValueError(f"LoRA adapter {path!r} has a tensor vpage cannot apply: {tensor.name!r}")
        layer, name = int(module.group(1)), module.group(2)
        w = dequantize(tensor.data, tensor.tensor_type)
        if match.group(2) == "b" and arch.permuted_qk and name in heads:
            w = unpermute_rotary_rows(w, heads[name])
        pairs.setdefault((layer, name), {}).update({match.group(2): torch.from_numpy(w.copy()).float()})
    modules = {}
    for (layer, name), pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {name} lacks lora_{({'a', 'b'} - set(pair)).pop()}")
        a, b = pair["a"], pair["b"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {name} has lora_a {tuple(a.shape)} and lora_b "
                             f"{tuple(b.shape)}, not [r, in] and [out, r]")
        scaling = alpha / a.shape[0] if alpha else 1.0
        modules[(layer, name)] = (a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} has no lora_a / lora_b tensors")
    return PeftAdapter(path, modules)
