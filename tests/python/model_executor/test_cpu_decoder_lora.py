"""LoRA in the C++ layer loop (models/cpu_decoder.py): a tiny random Llama whose four
projections in every layer carry slot tables of three adapters of different ranks runs a batch
mixing sequences of each adapter and of none, over prefill, a mixed chunk-and-decode step and
decode; each sequence's hidden states equal those of the Python layers on a copy of the model
with that sequence's adapter merged into the weights (W + B @ A)."""

from __future__ import annotations

import torch

from model_fixtures import PagedKVCache, save_tiny_model
from vpage import ops
from vpage.model_executor import ForwardBatch, load_model
from vpage.model_executor.layers.linear import pack_dense_weights

_RANKS = (4, 1, 8)  # slot -> rank
_SEQ_SLOTS = {0: 0, 1: 1, 2: 2, 3: -1}  # sequence -> its adapter slot (-1: the base model)
_STEPS = [
    {0: list(range(3, 10)), 1: list(range(20, 23)), 2: list(range(30, 41)), 3: list(range(50, 55))},
    {2: list(range(60, 64)), 0: [70], 1: [71], 3: [72]},
    {0: [80], 1: [81], 2: [82], 3: [83]},
]


def _projections(layer) -> dict[str, tuple]:
    """A layer's projections and their output slices' rows."""
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = attn.num_heads * attn.head_size, attn.num_kv_heads * attn.head_size
    inter = mlp.intermediate_size
    return {"qkv": (attn.qkv_proj, [q, kv, kv]), "o": (attn.o_proj, [attn.o_proj.weight_shape[0]]),
            "gate_up": (mlp.gate_up_proj, [inter, inter]), "down": (mlp.down_proj, [mlp.down_proj.weight_shape[0]])}


def _random_adapters(net, gen: torch.Generator) -> dict:
    """(layer, projection) -> per slot (A [slices * rank, in], [B_j [rows_j, rank]]), float32."""
    adapters = {}
    for i, layer in enumerate(net.model.layers):
        for name, (module, slices) in _projections(layer).items():
            cols = module.weight_shape[1]
            adapters[i, name] = [(torch.randn(len(slices) * rank, cols, generator=gen) * 0.1,
                                  [torch.randn(rows, rank, generator=gen) * 0.1 for rows in slices])
                                 for rank in _RANKS]
    return adapters


def _attach_tables(net, adapters: dict) -> list:
    """Each projection's ``lora_table`` (and ``lora_dtype``) of its packed adapters; returns the
    packed tensors, which must outlive the tables."""
    keep = []
    for i, layer in enumerate(net.model.layers):
        for name, (module, _) in _projections(layer).items():
            rows = []
            for a, bs in adapters[i, name]:
                packed_a, packed_b = ops.pack_dense_weight(a), [ops.pack_dense_weight(b) for b in bs]
                keep += [packed_a, *packed_b]
                pointers = [p.data_ptr() for p in packed_b] + [0] * (3 - len(packed_b))
                rows.append([packed_a.data_ptr(), *pointers, a.shape[0] // len(bs)])
            module.lora_table = torch.tensor(rows, dtype=torch.int64)
            module.lora_dtype = torch.float32
    return keep


def _merge(net, adapters: dict, slot: int) -> None:
    """W += B @ A, slice by slice, for slot's adapter (before packing)."""
    with torch.no_grad():
        for i, layer in enumerate(net.model.layers):
            for name, (module, slices) in _projections(layer).items():
                a, bs = adapters[i, name][slot]
                rank, start = _RANKS[slot], 0
                for j, (rows, b) in enumerate(zip(slices, bs)):
                    module.weight[start:start + rows] += b @ a[j * rank:(j + 1) * rank]
                    start += rows


def _run(net, config, steps: list[dict], slots: dict) -> dict:
    """Each sequence's hidden rows per step, with lora_token_slots from ``slots``."""
    cache = PagedKVCache(config, seed=5)
    rows: dict = {seq: [] for seq in slots}
    for chunks in steps:
        batch: ForwardBatch = cache.step(chunks)
        token_slots = [slots[seq] for seq, tokens in chunks.items() for _ in tokens]
        batch.lora_token_slots = torch.tensor(token_slots, dtype=torch.int32)
        hidden = net(batch, cache.caches)
        starts = batch.query_start_loc.tolist()
        for index, seq in enumerate(chunks):
            rows[seq].append(hidden[starts[index]:starts[index + 1]])
    return rows


def test_cpu_decoder_lora_matches_merged_weights(tmp_path):
    save_tiny_model("llama", tmp_path / "llama", hidden_size=128, intermediate_size=160)
    loaded = load_model(str(tmp_path / "llama"), dtype="float32", device="cpu")
    net, config = loaded.model, loaded.config
    adapters = _random_adapters(net, torch.Generator().manual_seed(0))
    pack_dense_weights(net)
    keep = _attach_tables(net, adapters)
    mixed = _run(net, config, _STEPS, _SEQ_SLOTS)
    assert net._cpu_decoder[1] is not None and keep  # the loop ran, with the tables
    for seq, slot in _SEQ_SLOTS.items():
        reference = load_model(str(tmp_path / "llama"), dtype="float32", device="cpu").model
        if slot >= 0:
            _merge(reference, adapters, slot)
        pack_dense_weights(reference)
        reference.use_cpu_decoder = False
        alone = _run(reference, config, [{seq: chunks[seq]} for chunks in _STEPS if seq in chunks], {seq: -1})
        for got, want in zip(mixed[seq], alone[seq]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if slot >= 0:  # the adapter changed the result
            base = _run(net, config, [{seq: chunks[seq]} for chunks in _STEPS if seq in chunks], {seq: -1})
            assert (mixed[seq][0] - base[seq][0]).abs().max() > 1e-2
