"""Server pieces without a server: API keys and tenant salts, engine health, request parsing."""

from __future__ import annotations

import time

import pytest

from vpage.engine import EngineArgs
from vpage.engine.core_client import EngineCoreClient
from vpage.entrypoints.openai.auth import ApiKeys, cache_salt
from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body


def test_api_keys_compare_keys_and_name_tenants(tmp_path):
    assert ApiKeys.from_options(None, None).tenant(None) is None  # no keys: open
    single = ApiKeys.from_options("sekret", None)
    assert single.tenant("Bearer sekret") is None
    for header in (None, "", "Bearer", "Bearer sekret2", "Basic sekret", "Bearer \udcff"):
        with pytest.raises(ApiError) as err:
            single.tenant(header)
        assert err.value.status == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\nalice ka\nbob kb\n")
    many = ApiKeys.from_options("shared", str(keys))
    assert (many.tenant("Bearer ka"), many.tenant("Bearer kb"), many.tenant("bearer shared")) == ("alice", "bob", None)
    keys.write_text("alice\n")
    with pytest.raises(ValueError, match="TENANT KEY"):
        ApiKeys.from_options(None, str(keys))


def test_cache_salts_keep_tenants_apart():
    salts = {cache_salt(t, c) for t in (None, "alice", "bob") for c in (None, "x")}
    assert len(salts) == 6 and cache_salt(None, None) is None


def test_health_reports_a_dead_or_silent_engine():
    client = EngineCoreClient(EngineArgs())
    assert client.health(stall_s=60) is None
    client.last_message = time.monotonic() - 100
    assert "not reported" in client.health(stall_s=60)
    client.dead_reason = "the engine-core process exited (code -9)"
    assert client.health(stall_s=60) == client.dead_reason


def test_request_models_are_strict_and_bounded():
    ok = parse_body(b'{"prompt": [[1, 2], [3]], "temperature": 1, "stop": "x", "cache_salt": "s"}', CompletionRequest)
    assert ok.prompt_list() == [[1, 2], [3]] and ok.temperature == 1.0 and ok.stop == "x"
    chat = parse_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                      b'{"type": "text", "text": "b"}]}], "unknown_field": 1}', ChatCompletionRequest)
    assert chat.messages[0].text() == "ab"
    for raw, param in [(b'{"prompt": "x", "top_k": 2147483648}', "top_k"), (b'{"prompt": "x", "echo": 1}', "echo"),
                       (b'{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
                       (b'{"prompt": [true]}', "prompt"), (b'{"prompt": "x", "stop": ["a"] }', None)]:
        if param is None:
            parse_body(raw, CompletionRequest)
            continue
        with pytest.raises(ApiError) as err:
            parse_body(raw, CompletionRequest)
        assert err.value.status == 400 and err.value.param == param
