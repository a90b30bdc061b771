"""The model's sampling defaults (``generation_config``): read from generation_config.json or
GGUF metadata, ignored with "vpage", overridden by explicit settings; and what ``vpage
generate`` sends for a chat model (its chat template) and with --no-chat-template."""

from __future__ import annotations

import dataclasses
import json

import pytest

from model_fixtures import save_tiny_model
from vpage import LLM, SamplingParams
from vpage.cli import _parser, _params
from vpage.cli import main as cli_main
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine
from vpage.model_executor.loader.generation_config import generation_defaults
from vpage.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A generation_config.json as Hugging Face writes it: the sampling keys among others.
_HF_GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6,
                         "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                         "max_new_tokens": 7, "transformers_version": "4.45.0"}
_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
             "max_tokens": 7}
_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant:{% endif %}")
_ENGINE = dict(dtype="float32", kv_cache_memory=0.01, block_size=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llama whose generation_config.json sets every sampling default vpage reads."""
    path = tmp_path_factory.mktemp("generation_config")
    save_tiny_model("llama", path, seed=5)
    (path / "generation_config.json").write_text(json.dumps(_HF_GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A tiny llama whose tokenizer has a chat template (so it is a chat model)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat")
    save_tiny_model("llama", path, seed=6)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def _write_gguf(path, fields: dict) -> None:
    """A GGUF file with metadata only (``fields``: key -> float or int), no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in fields.items():
        (writer.add_int32 if isinstance(value, int) else writer.add_float32)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_defaults_come_from_generation_config_json(folder):
    defaults = generation_defaults(str(folder))
    assert defaults == pytest.approx(_DEFAULTS)
    assert isinstance(defaults["top_k"], int) and isinstance(defaults["max_tokens"], int)
    assert generation_defaults(str(folder), "vpage") == {}


def test_only_the_keys_the_model_sets(tmp_path):
    save_tiny_model("llama", tmp_path, seed=1)  # transformers' own generation_config.json: token ids only
    assert generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": None}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.3}
    (tmp_path / "generation_config.json").unlink()
    assert generation_defaults(str(tmp_path)) == {}


def test_a_folder_given_as_generation_config(folder, tmp_path):
    save_tiny_model("llama", tmp_path, seed=1)
    assert generation_defaults(str(tmp_path), str(folder)) == pytest.approx(_DEFAULTS)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="generation_config.json does not exist"):
        generation_defaults(str(tmp_path), str(empty))
    with pytest.raises(ValueError, match="generation_config must be one of"):
        EngineArgs(generation_config="greedy")
    assert EngineArgs(generation_config=str(folder)).generation_config == str(folder)


def test_invalid_values_name_the_file(tmp_path):
    save_tiny_model("llama", tmp_path, seed=1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: invalid generation defaults.*top_p"):
        generation_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json: cannot read"):
        generation_defaults(str(tmp_path))


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "sampled.gguf"
    _write_gguf(path, {"general.sampling.temp": 0.5, "general.sampling.top_k": 40, "general.sampling.top_p": 0.95,
                       "general.sampling.min_p": 0.1, "general.sampling.penalty_repeat": 1.2,
                       "general.sampling.penalty_last_n": 64})
    assert generation_defaults(str(path)) == pytest.approx(
        {"temperature": 0.5, "top_k": 40, "top_p": 0.95, "min_p": 0.1, "repetition_penalty": 1.2})
    assert generation_defaults(str(path), "vpage") == {}
    bare = tmp_path / "bare.gguf"
    _write_gguf(bare, {})
    assert generation_defaults(str(bare)) == {}


def test_the_default_model_sets_no_sampling_defaults():
    # SmolLM2's GGUF carries no general.sampling.* keys: SamplingParams' (and the CLI's) own apply.
    assert generation_defaults(None) == {}


def test_llm_uses_the_defaults_unless_given_params(folder):
    def ends_by_eos_or_after(max_tokens: int, output) -> bool:
        return output.finish_reason == "stop" or (output.finish_reason == "length"
                                                   and len(output.token_ids) == max_tokens)

    prompt = [5, 9, 17]
    llm = LLM(str(folder), **_ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(**_DEFAULTS)
    assert ends_by_eos_or_after(7, llm.generate(prompt, use_tqdm=False)[0].outputs[0])
    explicit = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate(prompt, explicit, use_tqdm=False)[0].outputs[0].token_ids) == 3
    plain = LLM(str(folder), generation_config="vpage", **_ENGINE)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert ends_by_eos_or_after(16, plain.generate(prompt, use_tqdm=False)[0].outputs[0])  # SamplingParams' 16


def test_cli_sampling_flags_override_the_model_defaults(folder):
    def params(*flags: str) -> SamplingParams:
        args = _parser().parse_args(["generate", "x", "--model", str(folder), *flags])
        return dataclasses.replace(_params(args, generation_defaults(args.model, args.generation_config)),
                                   output_kind=RequestOutputKind.CUMULATIVE)

    assert params() == SamplingParams(**_DEFAULTS)
    assert params("--top-k", "5", "--max-tokens", "50", "--seed", "1") == \
        SamplingParams(**{**_DEFAULTS, "top_k": 5, "max_tokens": 50, "seed": 1})
    assert params("--temperature", "0") == SamplingParams(**{**_DEFAULTS, "temperature": 0.0})
    # Without the model's defaults: the CLI's own (greedy, 128 tokens), not SamplingParams' (1.0, 16).
    assert params("--generation-config", "vpage") == SamplingParams(temperature=0.0, max_tokens=128)
    assert params("--generation-config", "vpage", "--min-p", "0.2", "--temperature", "1") == \
        SamplingParams(temperature=1.0, min_p=0.2, max_tokens=128)
    for command in (["chat"], ["serve"]):
        assert _parser().parse_args(command + ["--generation-config", "vpage"]).generation_config == "vpage"


@pytest.fixture
def sent_prompts(monkeypatch):
    """The prompt token ids of every request the engine reports on."""
    sent: list[list[int]] = []
    step = LLMEngine.step

    def recording_step(self):
        outputs = step(self)
        sent.extend(o.prompt_token_ids for o in outputs if o.finished)
        return outputs

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    return sent


def test_cli_wraps_a_chat_models_prompt_in_its_chat_template(chat_folder, sent_prompts, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_folder))
    common = ["generate", "the quick brown fox", "--model", str(chat_folder), "--max-tokens", "2",
              "--kv-cache-memory", "0.01"]
    assert cli_main(common) == 0
    assert cli_main(common + ["--no-chat-template"]) == 0
    capsys.readouterr()
    wrapped = tokenizer("<s>user: the quick brown fox</s><s>assistant:", add_special_tokens=False).input_ids
    raw = tokenizer("the quick brown fox", add_special_tokens=False).input_ids
    assert wrapped[:2] != raw[:2]
    assert sent_prompts == [wrapped, raw]


def test_cli_continues_the_prompt_of_a_model_without_chat_template(folder, sent_prompts, capsys):
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(str(folder)).chat_template
    assert cli_main(["generate", "the quick brown fox", "--model", str(folder), "--kv-cache-memory", "0.01"]) == 0
    capsys.readouterr()
    raw = AutoTokenizer.from_pretrained(str(folder))("the quick brown fox", add_special_tokens=False).input_ids
    assert sent_prompts == [raw]
