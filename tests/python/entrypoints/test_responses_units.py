"""The Responses API's parts without a server: the store's bound and tenants, and requests made
into chat conversations (function calls of one turn in one assistant message, instructions not
carried over, the history never changed)."""

from __future__ import annotations

import pytest

from vpage.entrypoints.openai.protocol import ApiError
from vpage.entrypoints.responses.convert import assistant_message, chat_request, conversation
from vpage.entrypoints.responses.protocol import ResponsesRequest
from vpage.entrypoints.responses.store import ResponseStore, StoredResponse


def _stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id}, [{"role": "user", "content": response_id}])


def test_store_keeps_the_most_recently_used_within_its_bound_per_tenant():
    store = ResponseStore(max_responses=2)
    store.put("a", _stored("r1"))
    store.put("a", _stored("r2"))
    assert store.get("a", "r1") is not None  # r1 is now the most recently used
    store.put("b", _stored("r3"))
    assert len(store) == 2 and store.get("a", "r2") is None and store.get("a", "r1") is not None
    assert store.get("a", "r3") is None and store.get("b", "r3") is not None  # another tenant's is not visible
    assert store.delete("b", "r3") and not store.delete("b", "r3")
    none = ResponseStore(max_responses=0)
    none.put(None, _stored("r1"))
    assert len(none) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_responses=-1)


def test_conversation_of_items_and_history():
    history = [{"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}]
    req = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "25"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": "Use celsius."}]})
    messages = conversation(req, history)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "system"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"] and len(history[1]["tool_calls"]) == 1
    assert messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "25"}
    chat = chat_request(req, messages)
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Be brief."
    assert [m.role for m in chat.messages[1:]] == ["user", "assistant", "tool", "tool", "system"]


def test_requests_the_chat_pipeline_cannot_carry_are_400():
    for body in ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
                 {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
                 {"input": "hi", "tools": [{"type": "file_search"}]},
                 {"input": "hi", "truncation": "auto"},
                 {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}):
        req = ResponsesRequest.model_validate(body)
        with pytest.raises(ApiError) as info:
            chat_request(req, conversation(req, []))
        assert info.value.status == 400


def test_output_items_become_the_assistant_message_of_the_next_turn():
    items = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
             {"type": "message", "content": [{"type": "output_text", "text": "Let me check."}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}]
    assert assistant_message(items) == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}
