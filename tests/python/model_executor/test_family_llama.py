"""The shared engine parity harness (family_parity.py) on the tiny random Llama: greedy
tokens equal transformers' with whole and chunked prefills, a second turn from the prefix
cache, recompute preemption and two tensor-parallel ranks."""

from __future__ import annotations

import pytest

from family_parity import assert_family_parity, engine_greedy, hf_greedy, setting_params
from model_fixtures import save_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny_model("llama", folder, seed=5)


@pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "preempt", "tp2"]))
def test_engine_matches_transformers(tiny, setting):
    folder, hf = tiny
    assert_family_parity(folder, hf, [setting], prompt_len=37)


def test_harness_sees_a_different_model(tiny, tmp_path):
    """The comparison can fail: another random model's tokens differ from these."""
    folder, hf = tiny
    other = tmp_path / "other"
    save_tiny_model("llama", other, seed=6)
    prompt = list(range(3, 40))
    assert engine_greedy(other, [prompt], 16, enable_prefix_caching=False) != [hf_greedy(hf, prompt, 16)]
