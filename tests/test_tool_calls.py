"""Tool calls read from chat replies (router/tool_calls.py): the request's tools and tool choice, the
hermes parser over whole and streamed text, and the constraints of "required" and a named function."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from router.errors import InvalidRequestError
from router.tool_calls import ToolCallStream, ToolRequest, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _run(request: ToolRequest, text: str, pieces: list[str] | None = None) -> tuple[str, list, list, list]:
    """Feed ``text`` whole or in ``pieces``: (content deltas joined, the calls assembled from their streamed
    deltas, whole calls, content of the whole reply)."""
    stream = ToolCallStream(request)
    content, deltas = "", []
    for piece in pieces if pieces is not None else [text]:
        c, d = stream.add(piece)
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    return content + c, _assembled(deltas + d), stream.calls, stream.content


def _assembled(deltas: list[dict]) -> list[dict]:
    """Calls from streamed deltas as a client puts them together: the first of an index opens the call
    (id, type, name), the rest extend its arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def _random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _names_and_args(calls: list) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("seed", range(8))
def test_hermes_calls_are_the_same_whole_and_streamed_in_any_pieces(seed: int) -> None:
    auto = parse_tools({"tools": [WEATHER, TIME]}, "hermes")
    assert auto is not None and auto.choice == "auto" and auto.constraint() is None
    whole = _run(auto, HERMES)
    streamed = _run(auto, HERMES, _random_pieces(HERMES, seed))
    expected = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    for content, deltas, calls, total in (whole, streamed):
        assert content == total == "Let me check.\n"
        assert _names_and_args(calls) == expected and _names_and_args(deltas) == expected
        assert [c["index"] for c in calls] == [0, 1] and all(
            c["id"].startswith("chatcmpl-tool-") for c in calls
        )


def test_hermes_text_that_is_not_a_call_stays_content() -> None:
    auto = parse_tools({"tools": [WEATHER]}, "hermes")
    assert auto is not None
    plain = "No tools needed: 1 < 2 and <tool is not a call."
    assert _run(auto, plain, _random_pieces(plain, 1))[0] == plain
    broken = "Try <tool_call>{not json}</tool_call> done"
    content, deltas, calls, _ = _run(auto, broken, _random_pieces(broken, 2))
    assert content == broken and not deltas and not calls
    unclosed = 'x <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'  # cut at the end
    content, _, calls, _ = _run(auto, unclosed, _random_pieces(unclosed, 3))
    assert content == "x " and _names_and_args(calls) == [("get_weather", {"city": "Rome"})]


def test_required_reads_the_array_and_named_streams_the_arguments() -> None:
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}, "none")
    assert required is not None
    text = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Lima"}}]'
    content, deltas, calls, _ = _run(required, text, _random_pieces(text, 4))
    assert content == "" and _names_and_args(calls) == [("get_time", {}), ("get_weather", {"city": "Lima"})]
    assert _names_and_args(deltas) == _names_and_args(calls)
    cut = '[{"name":"get_time","param'  # max_tokens cut it: no call, the text as content
    assert _run(required, cut)[:3] == (cut, [], [])
    named = parse_tools(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "hermes",
    )
    assert named is not None and named.function == "get_weather"
    args = '{"city":"Kyiv","days":3}'
    pieces = ["", *_random_pieces(args, 5)]  # an empty delta first (a model still thinking) opens nothing
    content, assembled, calls, _ = _run(named, args, pieces)
    assert content == "" and _names_and_args(calls) == [("get_weather", {"city": "Kyiv", "days": 3})]
    assert assembled == calls
    stream = ToolCallStream(named)
    deltas = [d for piece in pieces for d in stream.add(piece)[1]]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["function"]["arguments"] == pieces[1]
    assert "".join(d["function"]["arguments"] for d in deltas) == args and len(deltas) == len(pieces) - 1


def test_the_constraints_compile_and_hold_the_shapes_the_parser_reads() -> None:
    tools = {"tools": [WEATHER, TIME]}
    required = parse_tools({**tools, "tool_choice": "required"}, "hermes")
    named = parse_tools(
        {**tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "hermes"
    )
    assert required is not None and named is not None
    for request in (required, named):
        spec = request.constraint()
        assert spec is not None and spec.disable_any_whitespace
        assert llguidance.LLMatcher.validate_grammar(spec.grammar_source()) == ""
    schema = json.loads(required.constraint().json)  # type: ignore[union-attr]
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert schema["minItems"] == 1 and names == [["get_weather"], ["get_time"]]
    assert json.loads(named.constraint().json) == {"type": "object", "properties": {}}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "parser", "message"),
    [
        ({"tool_choice": "auto"}, "hermes", "tool_choice needs tools"),
        ({"tools": [{"type": "function"}]}, "hermes", r"tools\[0\] must be"),
        ({"tools": [WEATHER, WEATHER]}, "hermes", "two functions named"),
        ({"tools": [WEATHER]}, "none", "--tool-call-parser none"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "hermes", "tool_choice must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "hermes",
         "not among the tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(body, parser: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        parse_tools(body, parser)
    assert err.value.param in ("tools", "tool_choice")
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}, "none") is not None  # no parsing needed


LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; {"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize("seed", range(6))
def test_llama3_json_calls_are_the_same_whole_and_streamed(seed: int) -> None:
    auto = parse_tools({"tools": [WEATHER, TIME]}, "llama3_json")
    assert auto is not None and auto.parser == "llama3_json"
    expected = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    for text in (LLAMA, LLAMA.removeprefix("<|python_tag|>"), "\n" + LLAMA):
        for content, deltas, calls, total in (_run(auto, text), _run(auto, text, _random_pieces(text, seed))):
            assert content == total == "" and _names_and_args(calls) == expected == _names_and_args(deltas)
    one = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": False}, "llama3_json")
    assert one is not None and _names_and_args(_run(one, LLAMA)[2]) == expected[:1]


def test_llama3_json_replies_that_are_not_calls_are_content() -> None:
    auto = parse_tools({"tools": [WEATHER]}, "llama3_json")
    assert auto is not None
    stream = ToolCallStream(auto)
    assert stream.add("It is ") == ("It is ", [])  # prose passes through at once
    assert stream.add("sunny {really}") == ("sunny {really}", []) and stream.finish() == ("", [])
    for text in (
        '{"city": "no name"}',
        '{"city": "x"}; {"name": "get_weather", "parameters": {}}',
        "<|python_tag|>nope",
    ):
        content, deltas, calls, _ = _run(auto, text, _random_pieces(text, 1))
        assert content == text and not deltas and not calls
    # Cut short after its call opened (max_tokens): the call keeps what was written (OpenAI's rule).
    cut = '{"name": "get_weather", "parameters": {"city": "Os'
    for content, assembled, calls, _ in (_run(auto, cut), _run(auto, cut, _random_pieces(cut, 1))):
        assert content == "" and [c["function"] for c in calls] == [
            {"name": "get_weather", "arguments": '{"city": "Os'}
        ] == [c["function"] for c in assembled]


TYPED = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "budget": {"type": "number"},
                "flexible": {"type": "boolean"},
                "stops": {"type": "array", "items": {"type": "string"}},
                "prefs": {"type": "object"},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}
QWEN3_CODER = (
    "I will plan it.\n<tool_call>\n<function=plan_trip>\n<parameter=city>\n12 Rue de l'Été\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=budget>\n99.5\n</parameter>\n<parameter=flexible>\nTrue\n"
    '</parameter>\n<parameter=stops>\n["Lyon", "Nice"]\n</parameter>\n<parameter=prefs>\n{\'train\': True}\n'
    "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=untyped>\n42\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize("seed", range(6))
def test_qwen3_coder_calls_are_typed_by_the_schema_whole_and_streamed(seed: int) -> None:
    auto = parse_tools({"tools": [TYPED, TIME]}, "qwen3_coder")
    assert auto is not None and auto.parser == "qwen3_coder"
    args = {
        "city": "12 Rue de l'Été",  # a string stays text (digits and quotes too)
        "days": 3,
        "budget": 99.5,
        "flexible": True,
        "stops": ["Lyon", "Nice"],
        "prefs": {"train": True},  # not JSON (quotes, True): read as a Python literal
        "note": None,
        "untyped": "42",  # a parameter the schema does not type stays text (vLLM's rule)
    }
    expected = [("plan_trip", args), ("get_time", {})]
    for content, deltas, calls, total in (
        _run(auto, QWEN3_CODER),
        _run(auto, QWEN3_CODER, _random_pieces(QWEN3_CODER, seed)),
    ):
        assert content == total == "I will plan it.\n"
        assert _names_and_args(calls) == expected == _names_and_args(deltas)


def test_qwen3_coder_values_that_do_not_parse_stay_text_and_broken_blocks_stay_content() -> None:
    auto = parse_tools({"tools": [TYPED]}, "qwen3_coder")
    assert auto is not None
    text = (
        "<tool_call>\n<function=plan_trip>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=prefs>\n{'train': true}\n</parameter>\n<parameter=flexible>\nmaybe\n</parameter>\n"
        "<parameter=city>\nOslo"  # cut short: the value ends with the text
    )
    content, _, calls, _ = _run(auto, text, _random_pieces(text, 7))
    assert content == "" and _names_and_args(calls) == [
        ("plan_trip", {"days": "three", "prefs": "{'train': true}", "flexible": "maybe", "city": "Oslo"})
    ]
    broken = "Look: <tool_call>\nno function here\n</tool_call> done"
    content, deltas, calls, _ = _run(auto, broken, _random_pieces(broken, 8))
    assert content == broken and not deltas and not calls


PYTHONIC = (
    '[plan_trip(city="Oslo", days=2, flexible=true, stops=["Bergen"], prefs={"train": None}), get_time()]'
)


@pytest.mark.parametrize("seed", range(6))
def test_pythonic_calls_are_the_same_whole_and_streamed(seed: int) -> None:
    auto = parse_tools({"tools": [TYPED, TIME]}, "pythonic")
    assert auto is not None and auto.parser == "pythonic"
    expected = [
        (
            "plan_trip",
            {"city": "Oslo", "days": 2, "flexible": True, "stops": ["Bergen"], "prefs": {"train": None}},
        ),
        ("get_time", {}),
    ]
    for text in (PYTHONIC, f"<|python_start|>{PYTHONIC}<|python_end|>", f"\n {PYTHONIC}\n"):
        for content, deltas, calls, total in (_run(auto, text), _run(auto, text, _random_pieces(text, seed))):
            assert content == total == "" and _names_and_args(calls) == expected == _names_and_args(deltas)
    one = parse_tools({"tools": [TYPED, TIME], "parallel_tool_calls": False}, "pythonic")
    assert one is not None and _names_and_args(_run(one, PYTHONIC)[2]) == expected[:1]


def test_pythonic_replies_that_are_not_calls_are_content() -> None:
    auto = parse_tools({"tools": [TYPED]}, "pythonic")
    assert auto is not None
    stream = ToolCallStream(auto)
    assert stream.add("It is ") == ("It is ", [])  # prose passes through at once
    assert stream.add("[sunny]") == ("[sunny]", []) and stream.finish() == ("", [])
    for text in (
        "[see the docs](https://example.com)",
        "[plan_trip('Oslo')]",  # a positional argument: no name to give it
        "[plan_trip(city=place)]",  # a name, not a literal
        "[plan_trip(**opts)]",
        "[plan_trip(city=b'x')]",  # bytes have no JSON form
        "[plan_trip(city=x.y)]",
        "[plan_trip.go()]",
        "<|python_start|>plan_trip()",
        "[]",
    ):
        content, deltas, calls, _ = _run(auto, text, _random_pieces(text, 2))
        assert content == text and not deltas and not calls, text


def _deltas_by_piece(request: ToolRequest, pieces: list[str]) -> list[list[dict]]:
    """The tool-call deltas each piece (then the finish) returns."""
    stream = ToolCallStream(request)
    return [stream.add(piece)[1] for piece in pieces] + [stream.finish()[1]]


def test_hermes_arguments_stream_as_they_are_written() -> None:
    """The call opens once its name is read, long before its block closes; its arguments come in many
    deltas, in json.dumps' form, and put together they are the whole reply's call."""
    auto = parse_tools({"tools": [WEATHER, TIME]}, "hermes")
    assert auto is not None
    args = {"city": "Oslo " * 20 + 'é 😀 " \\ \n', "days": 2, "extra": [1.50, True, None, {"a": []}]}
    text = 'Sure.<tool_call>\n{"name": "get_weather",\n "arguments": ' + json.dumps(args, ensure_ascii=True,
           indent=1) + "}\n</tool_call>"  # fmt: skip
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    per_piece = _deltas_by_piece(auto, pieces)
    opened = next(i for i, d in enumerate(per_piece) if d)
    head = '"arguments":'
    assert head in "".join(pieces[: opened + 1]) and head not in "".join(
        pieces[:opened]
    )  # opened at its head
    assert per_piece[opened][0]["function"]["name"] == "get_weather"
    growing = [i for i, d in enumerate(per_piece) if d and i > opened]
    assert len(growing) > 40 and growing[-1] < len(pieces) - 2  # the arguments were whole before the block
    deltas = [d for ds in per_piece for d in ds]
    whole = _run(auto, text)
    assert [c["function"] for c in _assembled(deltas)] == [c["function"] for c in whole[1]] and [
        c["function"] for c in whole[2]
    ] == [{"name": "get_weather", "arguments": json.dumps(args, ensure_ascii=False)}]
    assert {d["id"] for d in deltas if "id" in d} == {c["id"] for c in _assembled(deltas)}  # one id a call


def _hermes_reply(rng: random.Random, calls: list[tuple[str, object]]) -> str:
    out = rng.choice(["", "Let me see. "])
    for name, args in calls:
        out += "<tool_call>" + rng.choice(["", "\n"]) + json.dumps(
            {"name": name, rng.choice(["arguments", "parameters"]): args},
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 2]),
            separators=rng.choice([None, (",", ":")]),
        ) + rng.choice(["", "\n"]) + "</tool_call>" + rng.choice(["", "\n"])  # fmt: skip
    return out


@pytest.mark.parametrize("seed", range(4))
def test_hermes_streamed_calls_equal_whole_ones_for_any_arguments(seed: int) -> None:
    rng = random.Random(seed)
    auto = parse_tools({"tools": [WEATHER, TIME]}, "hermes")
    assert auto is not None
    for _ in range(60):
        calls = [
            (rng.choice(["get_weather", "get_time"]), {
                "city": "".join(rng.choice('ab"\\\n</>é😀 ') for _ in range(rng.randrange(12))),
                "days": rng.choice([0, -3, 2.5, 1e300, None, True]),
                "stops": [rng.random() for _ in range(rng.randrange(3))],
            })
            for _ in range(rng.randrange(1, 3))
        ]  # fmt: skip
        text = _hermes_reply(rng, calls)
        whole = _run(auto, text)
        streamed = _run(auto, text, _random_pieces(text, rng.randrange(1000)))
        expected = [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
        for _content, assembled, whole_calls, _ in (whole, streamed):
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == expected
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in assembled] == expected
        assert whole[0] == streamed[0] == ("Let me see. " if text.startswith("Let") else "")


def test_hermes_blocks_read_whole_cut_short_or_one_call_only() -> None:
    auto = parse_tools({"tools": [WEATHER, TIME]}, "hermes")
    assert auto is not None
    # The keys in another order: not read as it streams, but the block is still a call at its end.
    text = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    per_piece = _deltas_by_piece(auto, _random_pieces(text, 3))
    assert not any(per_piece[:-2]) and _names_and_args(_run(auto, text)[2]) == [
        ("get_weather", {"city": "Oslo"})
    ]
    # Arguments written as a JSON string are given as that string's text, as a whole reply gives them.
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    for _content, assembled, calls, _ in (_run(auto, text), _run(auto, text, _random_pieces(text, 4))):
        assert (
            [c["function"]["arguments"] for c in calls]
            == ['{"city": "Rome"}']
            == [c["function"]["arguments"] for c in assembled]
        )
    # Cut short by max_tokens after the call opened: the call keeps what was written (as OpenAI's does).
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Ber'
    for content, assembled, calls, _ in (_run(auto, text), _run(auto, text, _random_pieces(text, 5))):
        assert content == "" and [c["function"] for c in calls] == [
            {"name": "get_weather", "arguments": '{"city": "Ber'}
        ] == [c["function"] for c in assembled]
    # parallel_tool_calls false: the second block gives nothing, not even content.
    one = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": False}, "hermes")
    assert one is not None
    for content, assembled, calls, _ in (_run(one, HERMES), _run(one, HERMES, _random_pieces(HERMES, 6))):
        assert content == "Let me check.\n" and _names_and_args(calls) == [
            ("get_weather", {"city": "Oslo", "days": 2})
        ]
        assert _names_and_args(assembled) == _names_and_args(calls)


def test_qwen3_coder_string_values_stream_as_they_are_written() -> None:
    """A string parameter (source code, say) streams character by character, held back only where it could
    be the end of the value or its last newline; typed values and null come whole; the parts put together
    are the whole reply's arguments."""
    auto = parse_tools({"tools": [TYPED, TIME]}, "qwen3_coder")
    assert auto is not None
    code = 'if a < b and c > d:\n    print("<parameter", x</param)\n\n'
    text = (
        "<tool_call>\n<function=plan_trip>\n<parameter=city>\n" + code + "\n</parameter>\n"
        "<parameter=days>\n12\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
        "<parameter=untyped>\nnullable\n</parameter>\n</function>\n</tool_call>"
    )
    expected = {"city": code, "days": 12, "note": None, "untyped": "nullable"}
    pieces = list(text)
    per_piece = _deltas_by_piece(auto, pieces)
    value_start = text.index(code)
    growing = [i for i, d in enumerate(per_piece) if d]
    assert [d["function"] for d in per_piece[growing[0]]] == [
        {"name": "plan_trip", "arguments": ""},  # the call opens on its own delta
        {"arguments": "{"},
    ]
    assert text[: growing[0] + 1].endswith("<function=plan_trip>")  # the call opens with its head
    inside = [i for i in growing if value_start <= i < value_start + len(code)]
    assert len(inside) > len(code) // 2  # most characters as they came (not those that could be a tag)
    arguments = "".join(d["function"]["arguments"] for ds in per_piece for d in ds)
    whole = _run(auto, text)
    assert arguments == whole[2][0]["function"]["arguments"] == json.dumps(expected, ensure_ascii=False)
    assert [c["function"] for c in _assembled([d for ds in per_piece for d in ds])] == [
        c["function"] for c in whole[1]
    ]
    # A value that is null is not streamed as a string first; one cut short ends with the text.
    for seed in range(4):
        cut = "<tool_call>\n<function=plan_trip>\n<parameter=note>\nNULL \n</parameter>\n<parameter=city>\nOs"
        content, assembled, calls, _ = _run(auto, cut, _random_pieces(cut, seed))
        assert [c["function"]["arguments"] for c in calls] == ['{"note": null, "city": "Os"}']
        assert assembled[0]["function"]["arguments"] == calls[0]["function"]["arguments"]


def test_llama3_json_calls_stream_as_they_are_written() -> None:
    """llama3_json: each object's call opens at its name and its arguments stream, before the reply ends;
    a second object follows after its ';'; what follows the calls is not read; the whole reply is the
    same machine's."""
    auto = parse_tools({"tools": [WEATHER, TIME]}, "llama3_json")
    assert auto is not None
    args = {"city": "Oslo " * 12, "days": 2}
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(args)
        + '}; {"name": "get_time", "parameters": {}} and then'
    )
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    per_piece = _deltas_by_piece(auto, pieces)
    opened = [i for i, d in enumerate(per_piece) if any("id" in x for x in d)]
    assert len(opened) == 2 and opened[0] < len(pieces) // 3  # the first call opened early
    assert sum(1 for d in per_piece[: opened[1]] if d) > 10  # its arguments came in many deltas
    deltas = [d for ds in per_piece for d in ds]
    whole = _run(auto, text)
    expected = [("get_weather", json.dumps(args)), ("get_time", "{}")]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in _assembled(deltas)] == expected
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[2]] == expected and whole[
        0
    ] == ""


def test_required_calls_stream_as_the_constrained_array_is_written() -> None:
    """tool_choice "required": each object of the array opens its call at its name and streams its
    arguments; cut short after a call opened, the call keeps what was written."""
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}, "none")
    assert required is not None
    text = (
        '[{"name":"get_weather","parameters":{"city":"'
        + "Lima " * 10
        + '","days":3}},{"name":"get_time","parameters":{}}]'
    )
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    per_piece = _deltas_by_piece(required, pieces)
    opened = [i for i, d in enumerate(per_piece) if any("id" in x for x in d)]
    assert (
        len(opened) == 2 and opened[0] <= 12 and sum(1 for d in per_piece[: opened[1]] if d) > 8
    )  # at its head
    expected = [("get_weather", json.dumps({"city": "Lima " * 10, "days": 3})), ("get_time", "{}")]
    deltas = [d for ds in per_piece for d in ds]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in _assembled(deltas)] == expected
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in _run(required, text)[2]] == expected
    cut = '[{"name":"get_weather","parameters":{"city":"Li'
    content, assembled, calls, _ = _run(required, cut, _random_pieces(cut, 2))
    assert content == "" and [c["function"]["arguments"] for c in calls] == ['{"city": "Li'] == [
        c["function"]["arguments"] for c in assembled
    ]


def test_a_call_read_whole_does_not_take_the_next_blocks_arguments() -> None:
    """A block read whole at its end (its keys in another order) opens a call of its own; the next block,
    read as it streams, opens another (it once extended the first)."""
    auto = parse_tools({"tools": [WEATHER, TIME]}, "hermes")
    assert auto is not None
    text = (
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    )
    expected = [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "UTC"}')]
    for _, assembled, calls, _ in (_run(auto, text), _run(auto, text, _random_pieces(text, 9))):
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in assembled] == expected


def test_a_whole_llama3_json_reply_whose_call_breaks_is_content() -> None:
    """Not streamed, a reply whose call opened and then broke (a value that is not JSON) is content, as the
    whole-reply parse reads it; streamed, the call that opened stays."""
    auto = parse_tools({"tools": [WEATHER]}, "llama3_json")
    assert auto is not None
    broken = '{"name": "get_weather", "parameters": {"city": Oslo}}'
    whole = ToolCallStream(auto, whole=True)
    whole.add(broken)
    assert whole.finish() == (broken, []) and whole.content == broken and whole.calls == []
    content, _, calls, _ = _run(auto, broken)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    good = ToolCallStream(auto, whole=True)
    good.add(LLAMA)
    good.finish()
    assert _names_and_args(good.calls) == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
