"""GgufFile reads what gguf-py's reader reads, and a GGUF file's tokenizer loads as
AutoTokenizer loads it; damaged files are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from model_fixtures import save_tiny_gguf, save_tiny_model
from vpage.model_executor.loader import default_model
from vpage.model_executor.loader.gguf_config import hf_config_from_gguf
from vpage.model_executor.loader.gguf_file import GgufFile
from vpage.tokenizer import get_tokenizer

TEXTS = ["the quick brown fox", "  héllo wörld 日本語 🎉\n\tdone", "<s>special</s> tokens"]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """kind -> a tiny model's GGUF file (float32 tensors; a byte-level BPE vocabulary)."""
    root = tmp_path_factory.mktemp("ggufs")
    paths = {}
    for kind in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        folder = root / kind
        hf = save_tiny_model(kind, folder)
        paths[kind] = root / f"{kind}.gguf"
        save_tiny_gguf(hf, folder, paths[kind])
    return paths


def assert_same_as_gguf_py(path):
    import gguf

    ours, theirs = GgufFile(path), gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == int(ref.tensor_type) and mine.shape == tuple(int(d) for d in ref.shape)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data)


def test_default_model_reads_as_gguf_py_reads_it():
    assert_same_as_gguf_py(default_model.default_model_path())


def test_tiny_files_read_as_gguf_py_reads_them(tiny_ggufs):
    for path in tiny_ggufs.values():
        assert_same_as_gguf_py(path)


def assert_same_tokenizer(path):
    from transformers import AutoTokenizer

    ours = get_tokenizer(path.parent, path.name, hf_config_from_gguf(GgufFile(path)))
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert (ours.bos_token_id, ours.eos_token_id, ours.chat_template) == (auto.bos_token_id, auto.eos_token_id,
                                                                           auto.chat_template)


def test_default_model_tokenizer_is_autotokenizers():
    assert_same_tokenizer(default_model.default_model_path())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_family_tokenizers_are_autotokenizers(tiny_ggufs, kind):
    assert_same_tokenizer(tiny_ggufs[kind])


def test_damaged_files_name_themselves(tiny_ggufs, tmp_path):
    data = tiny_ggufs["llama"].read_bytes()
    cases = {
        "empty.gguf": b"",
        "magic.gguf": b"GGUX" + data[4:],
        "version.gguf": data[:4] + (9).to_bytes(4, "little") + data[8:],
        "header.gguf": data[:300],  # cut inside the metadata
        "data.gguf": data[:-100],  # the last tensor's bytes cut short
    }
    for name, content in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=name):
            GgufFile(bad)
