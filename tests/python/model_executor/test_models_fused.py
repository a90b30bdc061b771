"""Layers own their weight loading: a checkpoint whose q/k/v and gate/up tensors are stored
pre-fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``) loads into the same parameters, bit for
bit, as the separate tensors, on one rank and on each tensor-parallel rank's shard (KV heads
split or replicated); a quantized fused layer takes raw GGUF rows either way; rotating the
query and key heads apart equals rotating them together; bad tensors are refused by name."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_model
from vpage import ops
from vpage.distributed import parallel_state as ps
from vpage.model_executor import load_model
from vpage.model_executor.layers.parallel_linear import OutputRows
from vpage.model_executor.layers.quant_linear import QuantizedLinear
from vpage.model_executor.layers.weight_utils import QuantizedTensor

_PARTS = {"q_proj": ("qkv_proj", ["q_proj", "k_proj", "v_proj"]), "gate_proj": ("gate_up_proj", ["gate_proj", "up_proj"])}
_FOLLOWERS = {"k_proj", "v_proj", "up_proj"}


def _fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with q/k/v and gate/up concatenated along the rows under the fused names."""
    out = {}
    for name, tensor in tensors.items():
        module = name.split(".")[-2]
        if module in _FOLLOWERS:
            continue
        if module in _PARTS:
            fused, parts = _PARTS[module]
            tensor = torch.cat([tensors[name.replace(f".{module}.", f".{part}.")] for part in parts])
            name = name.replace(f".{module}.", f".{fused}.")
        out[name] = tensor
    return out


CASES = {
    "llama": ("llama", {}),
    "qwen2 (qkv bias)": ("qwen2", {}),
    "llama all biases, one kv head": ("llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
}


@pytest.fixture(scope="module", params=list(CASES))
def folders(request, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    kind, overrides = CASES[request.param]
    unfused = tmp_path_factory.mktemp("unfused")
    save_tiny_model(kind, unfused, **overrides)
    fused = tmp_path_factory.mktemp("fused")
    for f in unfused.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, fused / f.name)
    tensors = _fused(load_file(str(unfused / "model.safetensors")))
    assert any(".qkv_proj." in n for n in tensors) and not any(".k_proj." in n or ".up_proj." in n for n in tensors)
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    return unfused, fused


def _outputs(folder):
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    cache = PagedKVCache(loaded.config, seed=1)
    steps = [{0: list(range(3, 20)), 1: list(range(40, 47))}, {0: [5], 1: [6]}]
    return [loaded.model.compute_logits(loaded.model(cache.step(s), cache.caches)) for s in steps]


def test_fused_checkpoint_gives_the_same_outputs_bitwise(folders):
    unfused, fused = folders
    expected, got = _outputs(unfused), _outputs(fused)
    assert expected[0].abs().max() > 0.1
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_checkpoint_gives_the_same_tensor_parallel_shards(folders, rank):
    unfused, fused = folders
    ps.set_tensor_parallel_for_testing(rank, 2)
    try:
        shards = [dict(load_model(str(f), dtype="float32", device="cpu").model.named_parameters())
                  for f in (unfused, fused)]
    finally:
        ps.set_tensor_parallel_for_testing(0, 1)
    whole = dict(load_model(str(unfused), dtype="float32", device="cpu").model.named_parameters())
    assert shards[0].keys() == shards[1].keys()
    assert all(torch.equal(shards[0][n], shards[1][n]) for n in shards[0])
    # The shard really is a slice: half the query heads and of the MLP, the KV heads split or replicated.
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q_rows = whole["model.layers.0.self_attn.o_proj.weight"].shape[1] // 2
    assert torch.equal(shards[1][qkv][:q_rows], whole[qkv][rank * q_rows:(rank + 1) * q_rows])
    down = "model.layers.1.mlp.down_proj.weight"
    cols = whole[down].shape[1] // 2
    assert torch.equal(shards[1][down], whole[down][:, rank * cols:(rank + 1) * cols])


def test_quantized_fused_layer_loads_parts_or_fused_rows():
    rows = OutputRows.qkv(head_size=32, num_heads=4, num_kv_heads=2)
    gen = torch.Generator().manual_seed(0)
    row_bytes = ops.quant_row_bytes("Q8_0", 64)
    type_id = ops.QUANT_TYPES["Q8_0"][0]
    parts = {s: torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=gen)
             for s, n in zip("qkv", (128, 64, 64))}
    by_part = QuantizedLinear(64, rows.size, False, torch.float32, "Q8_0", rows)
    for s, data in parts.items():
        by_part.qweight.weight_loader(by_part.qweight, QuantizedTensor(data, type_id, 64), s)
    fused = QuantizedLinear(64, rows.size, False, torch.float32, "Q8_0", rows)
    fused.qweight.weight_loader(fused.qweight, QuantizedTensor(torch.cat(list(parts.values())), type_id, 64), None)
    assert torch.equal(by_part.qweight, fused.qweight) and torch.equal(fused.qweight[128:192], parts["k"])
    with pytest.raises(ValueError, match=r"ggml type 2, 64 columns\) does not match the quantized parameter \(Q8_0"):
        fused.qweight.weight_loader(fused.qweight, QuantizedTensor(parts["k"], 2, 64), "k")
    with pytest.raises(ValueError, match=r"does not match the quantized parameter"):
        fused.qweight.weight_loader(fused.qweight, torch.zeros(64, 64), "k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotating_q_and_k_apart_equals_rotating_them_together(dtype):
    from vpage.model_executor.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(64, 10000.0, None, 256)
    heads, kv_heads, n = 9, 3, 37
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * 64, generator=gen).to(dtype)
    batch = SimpleNamespace(positions=torch.randint(0, 256, (n,), generator=gen))  # all a static rope reads
    together, apart = qkv.clone(), qkv.clone()
    rotary.rotate_(together, batch, heads + kv_heads)
    q, k, _ = apart.split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)
    rotary.rotate_(q, batch, heads)
    rotary.rotate_(k, batch, kv_heads)
    assert not torch.equal(together, qkv) and torch.equal(together, apart)


def test_bad_tensors_are_refused_by_name(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    _, fused = folders
    folder = tmp_path / "bad"
    shutil.copytree(fused, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    good = tensors[name]
    for bad, message in ((good[:-1], rf"'{name}' has shape \({good.shape[0] - 1}, 64\), expected \({good.shape[0]}, "),
                         (None, r"lacks 3 tensors, e.g. for \['model.layers.1.self_attn.qkv_proj.weight'\]")):
        broken = {k: v for k, v in tensors.items() if k != name}
        if bad is not None:
            broken[name] = bad.contiguous()
        save_file(broken, str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            load_model(str(folder), device="cpu")
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_norm.weight' has no matching parameter"):
        load_model(str(folder), device="cpu")
