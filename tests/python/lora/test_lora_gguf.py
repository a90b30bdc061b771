"""LoRA adapters as llama.cpp's GGUF files (convert_lora_to_gguf.py's layout: Q/K rows of B
interleaved), on a Hugging Face base and on GGUF bases (float, and Q8_0 with the adapter in
float beside the integer matmul)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gguf_writer import write_gguf_lora
from lora_fixtures import MAX_TOKENS, PROMPTS, make_lora_setup
from model_fixtures import save_tiny_gguf, tiny_hf_config
from quant_fixtures import quantized_rows
from vpage import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf")
    base, folders, expected = make_lora_setup(root)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base)
    save_tiny_gguf(hf, Path(base), root / "base-f32.gguf")
    rng = np.random.default_rng(0)
    save_tiny_gguf(hf, Path(base), root / "base-q8.gguf",
                   lambda name, w: (quantized_rows("Q8_0", w, rng), gguf.GGMLQuantizationType.Q8_0)
                   if w.ndim == 2 and "embed" not in name else None)
    adapters = {}
    for name in ("qv8", "all4rs"):
        adapters[name] = str(root / f"{name}.gguf")
        write_gguf_lora(Path(folders[name]), Path(adapters[name]), tiny_hf_config("llama"))
    return root, base, folders, adapters, expected


def _tokens(llm: LLM, lora) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=lora)]


def test_gguf_adapter_on_hf_and_gguf_bases(gguf_setup):
    root, base, folders, adapters, expected = gguf_setup
    for model in (base, str(root / "base-f32.gguf")):
        llm = LLM(model, dtype="float32", kv_cache_memory=0.01, enable_lora=True, max_loras=2)
        assert _tokens(llm, LoRARequest("qv8-gguf", 1, adapters["qv8"])) == expected["qv8"], model
        assert _tokens(llm, LoRARequest("qv8", 2, folders["qv8"])) == expected["qv8"], model
        assert _tokens(llm, None) == expected[None], model


def test_quantized_base_runs_adapters_beside_the_integer_matmul(gguf_setup):
    root, _, folders, adapters, _ = gguf_setup
    llm = LLM(str(root / "base-q8.gguf"), kv_cache_memory=0.01, enable_lora=True, max_loras=2)
    model = llm.engine.core.executor.driver_worker.loaded.model
    lora = LoRARequest("all4rs", 1, adapters["all4rs"])
    loop = _tokens(llm, lora)
    assert model._cpu_decoder[1] is not None  # the C++ layer loop ran it
    model.use_cpu_decoder = False
    assert _tokens(llm, lora) == loop  # the Python layers: the same kernels, the same tokens
    assert _tokens(llm, None) != loop


def test_gguf_file_that_is_no_adapter_is_refused(gguf_setup):
    root, base, _, _, _ = gguf_setup
    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, enable_lora=True)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        llm.engine.add_lora(LoRARequest("model", 1, str(root / "base-f32.gguf")))
    with pytest.raises(ValueError, match="no such GGUF file|not a readable"):
        llm.engine.add_lora(LoRARequest("missing", 2, str(root / "missing.gguf")))
