"""The Responses API's pieces (router/responses.py): a Responses request as a chat request, and the
machine that turns a chat stream's events into output items and Responses events. The endpoint itself is
tested over the real mesh in test_router_e2e.py and test_reasoning_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest

from router.errors import InvalidRequestError
from router.responses import ResponseStream, parse_responses


def _chunk(finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 4},
}


def test_a_request_becomes_the_chat_request_it_means() -> None:
    req = parse_responses({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 9, "temperature": 0.2, "top_k": 5,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        "store": True, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"],
    })  # fmt: skip
    chat = req.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]  # fmt: skip
    assert (
        chat["max_tokens"] == 9 and chat["temperature"] == 0.2 and chat["top_k"] == 5 and chat["model"] == "m"
    )
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                "strict": True}}]  # fmt: skip
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert "store" not in chat and "include" not in chat
    assert (
        req.echo["store"] is True  # kept for previous_response_id (the router answers false without a store)
        and req.echo["metadata"] == {"k": "v"}
        and req.echo["max_output_tokens"] == 9
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "background": "yes"}, "background"),
        ({"input": 5}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input"),
        ({"input": [{"type": "file_search_call"}]}, "input"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "text": "json"}, "text"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_responses(body)
    assert err.value.param == param


def test_the_stream_makes_items_in_the_order_the_reply_wrote_them() -> None:
    out = ResponseStream("resp_1", "m", {"store": False})
    events = out.start()
    events += out.add(_chunk(reasoning_content="Let me see. "))
    events += out.add(_chunk(reasoning_content="Two calls.", content="Calling."))
    events += out.add(_chunk(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": 1}'}}]))  # fmt: skip
    events += out.add(_chunk(tool_calls=[{"index": 1, "id": "call_b", "type": "function",
                                          "function": {"name": "g", "arguments": "{"}}]))  # fmt: skip
    events += out.add(_chunk(tool_calls=[{"index": 1, "function": {"arguments": "}"}}]))  # a named call grows
    events += out.add(_chunk(finish="tool_calls"))
    events += out.finish(USAGE)
    whole = out.response()
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, first, second = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see. Two calls."}]
    assert message["content"][0]["text"] == "Calling." and message["status"] == "completed"
    assert (first["call_id"], first["name"], first["arguments"]) == ("call_a", "f", '{"a": 1}')
    assert (second["call_id"], second["name"], second["arguments"]) == ("call_b", "g", "{}")
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    assert whole["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    # Each item is closed before the next opens, and the deltas rebuild each item's final text.
    opened: list[int] = []
    for e in events:
        if e["type"] == "response.output_item.added":
            assert not opened or opened[-1] == -1
            opened.append(e["output_index"])
        elif e["type"] == "response.output_item.done":
            assert opened[-1] == e["output_index"]
            opened.append(-1)
    deltas = {kind: "".join(e["delta"] for e in events if e["type"] == kind) for kind in (
        "response.reasoning_text.delta", "response.output_text.delta", "response.function_call_arguments.delta")}  # fmt: skip
    assert deltas == {"response.reasoning_text.delta": "Let me see. Two calls.",
                      "response.output_text.delta": "Calling.",
                      "response.function_call_arguments.delta": '{"a": 1}{}'}  # fmt: skip
    assert events[-1]["response"]["output"] == whole["output"]


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    out = ResponseStream("resp_2", "m", {})
    out.start()
    out.add(_chunk(content="Half a sen"))
    events = out.add(_chunk(finish="length")) + out.finish(USAGE)
    whole = out.response()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"


def test_the_in_process_store_keeps_the_latest_and_forgets_the_expired() -> None:
    import asyncio

    from router.response_store import MemoryResponseStore, StoredResponse

    async def run() -> None:
        store = MemoryResponseStore(max_stored=2, ttl_s=60)
        for i in range(3):
            await store.put(StoredResponse({"id": f"r{i}"}, [{"role": "user", "content": str(i)}]))
        assert await store.get("r0") is None  # the oldest went first
        assert (await store.get("r2")).messages == [{"role": "user", "content": "2"}]
        assert await store.delete("r1") and not await store.delete("r1") and await store.get("r1") is None
        brief = MemoryResponseStore(max_stored=2, ttl_s=0.01)
        await brief.put(StoredResponse({"id": "x"}, []))
        await asyncio.sleep(0.05)
        assert await brief.get("x") is None  # expired

    asyncio.run(run())


def test_a_continued_request_puts_the_stored_conversation_first() -> None:
    """previous_response_id: the stored messages, then the previous output (reasoning items dropped,
    function calls as the assistant's tool calls), then this input; this request's instructions lead, the
    previous ones are not inherited; what is stored next is the whole conversation without instructions."""
    from router.response_store import StoredResponse

    previous = StoredResponse(
        response={"id": "resp_1", "output": [
            {"type": "reasoning", "id": "rs", "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ]},
        messages=[{"role": "user", "content": "Hello"}],
    )  # fmt: skip
    req = parse_responses({"instructions": "Now terse.", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "42"}]})  # fmt: skip
    req.continue_from(previous)
    messages = req.chat_body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "assistant", "tool"]
    assert messages[0]["content"] == "Now terse." and messages[3]["tool_calls"][0]["id"] == "c1"
    stored = req.record({"id": "resp_2"})
    assert [m["role"] for m in stored.messages] == ["user", "assistant", "assistant", "tool"]


def test_input_items_keep_the_input_with_ids() -> None:
    """What GET /v1/responses/{id}/input_items lists: a string input as one user message, items as given
    (their ids kept), each given an id where it has none."""
    assert [(i["type"], i["role"], i["content"]) for i in parse_responses({"input": "hi"}).input_items] == [
        ("message", "user", [{"type": "input_text", "text": "hi"}])
    ]
    items = parse_responses({"input": [
        {"role": "user", "content": "a", "id": "msg_mine"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "1"},
    ]}).input_items  # fmt: skip
    assert (
        items[0]["id"] == "msg_mine"
        and items[1]["id"].startswith("fc_")
        and items[2]["id"].startswith("fco_")
    )
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]


def test_a_background_request_is_echoed_and_its_stream_starts_queued() -> None:
    req = parse_responses({"input": "x", "background": True})
    assert req.background and req.echo["background"] is True and req.echo["store"] is True
    assert parse_responses({"input": "x"}).echo["background"] is False
    out = ResponseStream("resp_3", "m", req.echo, status="queued")
    created, in_progress = out.start()
    assert created["response"]["status"] == "queued" and in_progress["response"]["status"] == "in_progress"
    (failed,) = out.fail("server_error", "boom")
    assert failed["type"] == "response.failed" and out.response()["status"] == "failed"
    assert out.response()["error"] == {"code": "server_error", "message": "boom"}


def test_replace_active_writes_only_while_queued_or_in_progress() -> None:
    """What keeps a background response's cancellation and completion from overwriting one another."""
    import asyncio

    from router.response_store import MemoryResponseStore, StoredResponse

    async def run() -> None:
        store = MemoryResponseStore(max_stored=4, ttl_s=60)
        assert not await store.replace_active(
            StoredResponse({"id": "r", "status": "in_progress"}, [])
        )  # none
        await store.put(StoredResponse({"id": "r", "status": "queued"}, []))
        assert await store.replace_active(StoredResponse({"id": "r", "status": "in_progress"}, []))
        assert await store.replace_active(StoredResponse({"id": "r", "status": "cancelled"}, []))
        assert not await store.replace_active(StoredResponse({"id": "r", "status": "completed"}, []))
        assert (await store.get("r")).response["status"] == "cancelled"

    asyncio.run(run())
