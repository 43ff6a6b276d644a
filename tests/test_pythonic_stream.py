"""The pythonic tool-call parser as it streams (router/tool_calls.py, router/tool_call_blocks.py's
PythonicCall): each call opens at its head with its name, its arguments then grow delta by delta, and put
together they are the whole reply's arguments, json.dumps' form of what Python reads in the call."""

from __future__ import annotations

import random

import pytest

from router.tool_calls import ToolCallStream, ToolRequest, _pythonic_calls, parse_tools
from tests.test_json_stream import python_text, python_value
from tests.test_tool_calls import TIME, TYPED, _assembled, _deltas_by_piece, _random_pieces, _run

NAMES = ["get_weather", "f", "_x1", "météo", "ﬁle_search"]  # ﬁ: Python reads the name as "file_search"
KEYS = ["city", "unit", "n", "é", "_", "data2", "ﬁle"]


def _auto(parallel: bool = True) -> ToolRequest:
    auto = parse_tools({"tools": [TYPED, TIME], "parallel_tool_calls": parallel}, "pythonic")
    assert auto is not None
    return auto


def _space(rng: random.Random) -> str:
    return rng.choice(["", "", " ", "\n", "\n    "])


def _reply(rng: random.Random) -> str:
    """A reply of random pythonic calls, as a model may write them (Llama 4's markers sometimes)."""
    calls = []
    for _ in range(rng.randrange(1, 4)):
        keys = rng.sample(KEYS, rng.randrange(len(KEYS) - 2))
        arguments = [f"{k}{_space(rng)}={_space(rng)}{python_text(python_value(rng), rng)}" for k in keys]
        trailing = "," if arguments and rng.random() < 0.2 else ""
        calls.append(f"{rng.choice(NAMES)}({_space(rng)}{(',' + _space(rng)).join(arguments)}{trailing})")
    text = "[" + _space(rng) + ("," + _space(rng)).join(calls) + _space(rng) + "]"
    if rng.random() < 0.3:
        text = "<|python_start|>" + text + "<|python_end|>"
    return rng.choice(["", " ", "\n"]) + text + rng.choice(["", "\n"])


def _fed(request: ToolRequest, pieces: list[str], whole: bool = False) -> tuple[str, list[dict], list[dict]]:
    """Content and tool-call deltas of a reply fed in ``pieces``, and its whole calls. ``whole``: as for a
    reply that is not streamed."""
    stream = ToolCallStream(request, whole=whole)
    content, deltas = "", []
    for piece in pieces:
        c, d = stream.add(piece)
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    return content + c, deltas + d, stream.calls


@pytest.mark.parametrize("seed", range(6))
def test_streamed_calls_equal_the_whole_parse_in_any_pieces(seed: int) -> None:
    """Random calls (names, nested values, strings with quotes, escapes and unicode, Python's and JSON's
    names) in one piece, one character at a time and in random pieces: each call opens with a delta of its
    own (its name, arguments ""), and its argument deltas put together are what the whole-reply parser makes
    of it (json.dumps of the keyword arguments)."""
    rng = random.Random(seed)
    auto, checked = _auto(), 0
    for _ in range(40):
        text = _reply(rng)
        expected = _pythonic_calls(text)
        if expected is None:  # """ where two adjacent strings met: not Python
            continue
        checked += 1
        small, i = [], 0
        while i < len(text):
            j = i + rng.randrange(1, 6)
            small.append(text[i:j])
            i = j
        for pieces in ([text], list(text), _random_pieces(text, rng.randrange(1000)), small):
            content, deltas, calls = _fed(auto, pieces)
            assert content == ""
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
            if len(pieces) == 1:
                continue
            assembled = _assembled(deltas)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in assembled] == expected
            openings = [d for d in deltas if "id" in d]
            assert [d["function"]["arguments"] for d in openings] == [""] * len(expected), ascii(text)
            assert [d["index"] for d in openings] == list(range(len(expected)))
            assert [d["id"] for d in openings] == [c["id"] for c in calls]
    assert checked > 30


def test_each_call_opens_at_its_head_and_its_arguments_stream() -> None:
    """A call opens once its name and the start of its first keyword value are read, long before it ends; a
    long string argument then comes in many deltas; the second call opens after the first's ")"."""
    text = (
        '<|python_start|>[get_weather(city="' + "Paris " * 20 + '\\u00e9 \\"q\\"", unit=\'c\'), '
        "get_time()]<|python_end|>"
    )
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    per_piece = _deltas_by_piece(_auto(), pieces)
    opened = [i for i, ds in enumerate(per_piece) for d in ds if "id" in d]
    head = '[get_weather(city="'
    assert (
        len(opened) == 2
        and head in "".join(pieces[: opened[0] + 1])
        and head not in "".join(pieces[: opened[0]])
    )
    first = per_piece[opened[0]]
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""} and first[0]["type"] == "function"
    assert first[1]["index"] == 0 and first[1]["function"]["arguments"].startswith('{"city": "')
    assert sum(1 for ds in per_piece[: opened[1]] if ds) > 20
    assert per_piece[opened[1]][0]["function"] == {"name": "get_time", "arguments": ""}
    deltas = [d for ds in per_piece for d in ds]
    assert (
        [(c["function"]["name"], c["function"]["arguments"]) for c in _assembled(deltas)]
        == [
            ("get_weather", '{"city": "' + "Paris " * 20 + 'é \\"q\\"", "unit": "c"}'),
            ("get_time", "{}"),
        ]
        == _pythonic_calls(text)
    )


def test_a_reply_cut_short_keeps_what_was_written() -> None:
    """max_tokens cut the reply after a call opened: the calls keep what was written (OpenAI's rule, as the
    other parsers'); cut before its head is known, the reply is read whole: content."""
    for text, expected in (
        ('[get_weather(city="Par', [("get_weather", '{"city": "Par')]),
        ('[get_weather(city="Paris"', [("get_weather", '{"city": "Paris"')]),
        ("[f(a=1, b=[1, 2", [("f", '{"a": 1, "b": [1, 2')]),
        ("[f(a=1), g(b=True, c=(", [("f", '{"a": 1}'), ("g", '{"b": true, "c": ')]),
        ("<|python_start|>[f(n=12", [("f", '{"n": 12')]),  # a number at the end is whole
    ):
        for pieces in ([text], list(text), _random_pieces(text, 3)):
            content, deltas, calls = _fed(_auto(), pieces)
            assert (
                content == ""
                and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
            )
            if len(pieces) > 1:
                assembled = _assembled(deltas)
                assert [(c["function"]["name"], c["function"]["arguments"]) for c in assembled] == expected
    for text in ("[get_weather(ci", "[get_weather(", "<|python_start|>[", "["):
        assert _fed(_auto(), list(text)) == (text, [], [])


def test_text_that_starts_with_a_bracket_stays_content_once() -> None:
    """A reply that opens with "[" is held until its first call's head is read (llama3_json's rule): one that
    is not a call is given whole at its end as content, once; prose before a list passes through at once."""
    for text in (
        "[see the docs](https://example.com) for more.",
        "[1, 2, 3] are the numbers.",
        "[Note] get_weather(city='Oslo') is how to call it.",
        "[get_weather('Oslo')]",  # a positional argument
        "[get_weather(city=here)]",  # a name, not a literal
        "[get_weather.now()]",
        "[]",
        "<|python_start|>not a list<|python_end|>",
    ):
        for pieces in ([text], list(text), _random_pieces(text, 4)):
            stream = ToolCallStream(_auto())
            parts = [stream.add(piece) for piece in pieces] + [stream.finish()]
            assert "".join(c for c, _ in parts) == text and not any(d for _, d in parts), text
            assert stream.content == text
    stream = ToolCallStream(_auto())
    assert stream.add("Sure: [get_weather(") == ("Sure: [get_weather(", [])  # not a reply of calls
    assert stream.add('city="Oslo")]') == ('city="Oslo")]', []) and stream.finish() == ("", [])


def test_once_a_call_opened_the_reply_is_calls() -> None:
    """After the first call opened, what does not go on as calls is not read (llama3_json's rule): text after
    the list, a value that is not a literal (its call's arguments stop where they are)."""
    cases = (
        ("[get_time()] and then some text", [("get_time", "{}")]),
        ("[f(a=1, b=here, c=2), g()]", [("f", '{"a": 1, "b": ')]),
        ("[f(a=1)] [g(b=2)]", [("f", '{"a": 1}')]),
    )
    for text, expected in cases:
        for pieces in ([text], list(text)):
            content, _, calls = _fed(_auto(), pieces)
            assert (
                content == ""
                and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
            )


def test_a_whole_reply_whose_call_breaks_after_it_opened_is_content() -> None:
    """Not streamed, nothing went out yet: the reply is read whole at its end, as calls when it is only
    calls, else as content (streamed, the calls that opened stay: the test above)."""
    for text in ("[f(a=1, b=here, c=2), g()]", "[get_time()] and then some text", "[f(a=1)] [g(b=2)]"):
        for pieces in ([text], list(text)):
            content, _, calls = _fed(_auto(), pieces, whole=True)  # a whole reply reads no deltas
            assert (content, calls) == (text, []), text
    cut = "[get_weather(city='Oslo'), get_time(zone='Europe/Os"  # cut short inside its last call
    content, _, calls = _fed(_auto(), [cut], whole=True)
    assert content == "" and [c["function"]["arguments"] for c in calls] == [
        '{"city": "Oslo"}',
        '{"zone": "Europe/Os',
    ]
    text = "[get_weather(city='Oslo'), get_time()]"
    for pieces in ([text], list(text)):
        content, _, calls = _fed(_auto(), pieces, whole=True)
        streamed = _fed(_auto(), [text])[2]
        assert content == "" and [c["function"] for c in calls] == [c["function"] for c in streamed]
        assert [c["function"]["arguments"] for c in calls] == ['{"city": "Oslo"}', "{}"]


def test_one_call_only_without_parallel_tool_calls() -> None:
    text = "[get_weather(city='Oslo'), get_time(), f(x=[1])]"
    for pieces in ([text], list(text)):
        content, deltas, calls = _fed(_auto(parallel=False), pieces)
        assert content == "" and [c["function"]["arguments"] for c in calls] == ['{"city": "Oslo"}']
        assert {d["index"] for d in deltas} == {0}
    assert [c["function"]["name"] for c in _run(_auto(), text)[2]] == ["get_weather", "get_time", "f"]


@pytest.mark.parametrize("seed", range(3))
def test_any_text_gives_the_same_content_and_calls_in_any_pieces(seed: int) -> None:
    """Replies broken at random (a character put in, taken out, the rest cut off): in one piece, a character
    at a time or in random pieces, the same content and calls; a reply without calls is all content, once."""
    rng = random.Random(seed)
    for _ in range(150):
        text = _reply(rng)
        for _ in range(rng.randrange(1, 4)):
            i, ch = rng.randrange(len(text) + 1), rng.choice("[](){}'\"\\,=:x1 .-\nTrue")
            text = rng.choice([text[:i] + ch + text[i:], text[:i] + text[i + 1 :], text[:i]])
        results = []
        for pieces in ([text], list(text), _random_pieces(text, seed) if len(text) > 1 else [text]):
            content, deltas, calls = _fed(_auto(), pieces)
            whole = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            if len(pieces) > 1:
                assert [
                    (c["function"]["name"], c["function"]["arguments"]) for c in _assembled(deltas)
                ] == whole
            results.append((content, whole))
        assert results[0] == results[1] == results[2], ascii(text)
        assert results[0][0] == ("" if results[0][1] else text), ascii(text)
