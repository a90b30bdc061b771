"""vpage.ops.trusted_arguments: the layer ops skip their checks inside it (on this thread
only), results are unchanged, and a model checks its first layer and its KV caches."""

from __future__ import annotations

import threading

import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_model
from vpage import ops
from vpage.model_executor import load_model


def test_checks_skipped_only_inside_and_restored():
    x = torch.randn(3, 8)
    weight = torch.ones(8)
    with pytest.raises(TypeError):
        ops.rms_norm(torch.empty(3, 8, dtype=torch.float64), x, weight, 1e-6)
    seen = []
    with ops.trusted_arguments():
        assert not ops._checking()
        other = threading.Thread(target=lambda: seen.append(ops._checking()))
        other.start()
        other.join()
        with pytest.raises(RuntimeError):
            with ops.trusted_arguments():
                raise RuntimeError("inner")
        assert not ops._checking()  # the outer block is still trusted
    assert seen == [True]  # another thread keeps checking
    assert ops._checking()


def test_trusted_results_equal_checked():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    gate_up = torch.randn(5, 96, generator=gen)
    qweight = torch.randint(0, 256, (24, ops.quant_row_bytes("Q8_0", 64)), dtype=torch.uint8, generator=gen)
    qweight.view(24, -1, 34)[:, :, :2] = torch.tensor([0, 60], dtype=torch.uint8)  # finite float16 scales

    def run():
        out, silu = torch.empty(5, 64), torch.empty(5, 48)
        ops.rms_norm(out, x, weight, 1e-6)
        ops.silu_and_mul(silu, gate_up)
        return out, silu, ops.quant_matmul(x, qweight, "Q8_0", 24, 64)

    checked = run()
    with ops.trusted_arguments():
        trusted = run()
    for a, b in zip(checked, trusted):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(str(folder), dtype="float32", device="cpu")


def test_model_checks_first_layer_and_caches(tiny):
    cache = PagedKVCache(tiny.config, block_size=8)
    batch = cache.step({0: [5, 6, 7]})
    with pytest.raises(ValueError, match="layer 1's KV cache"):
        tiny.model(batch, [cache.caches[0], (cache.caches[1][0][:-1], cache.caches[1][1])])
    with pytest.raises(TypeError):  # layer 0's ops still check (a float64 cache)
        tiny.model(batch, [(k.double(), v.double()) for k, v in cache.caches])
    assert ops._checking()  # nothing leaks out of the model's trusted block
    hidden = tiny.model(batch, cache.caches)
    assert hidden.shape == (3, tiny.config.hidden_size) and torch.isfinite(hidden).all()
