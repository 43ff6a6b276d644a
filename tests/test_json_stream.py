"""The streamed canonicalisers of tool-call arguments (router/json_stream.py): in any pieces, CanonicalJson
writes what json.dumps(json.loads(text), ensure_ascii=False) writes, CanonicalPython what json.dumps writes of
the Python literal (as the pythonic parser reads a whole reply), and both stop where the text is not one."""

from __future__ import annotations

import ast
import json
import random
import unicodedata
from typing import Any

import pytest

from router.json_stream import CanonicalJson, CanonicalPython
from router.tool_calls import _literal


def _canonical(text: str, rng: random.Random | None = None) -> tuple[str, CanonicalJson]:
    """Feed ``text`` whole, or in random pieces of 1-4 characters."""
    machine, out, i = CanonicalJson(), "", 0
    while i < len(text):
        j = len(text) if rng is None else i + rng.randrange(1, 5)
        out += machine.feed(text[i:j])
        i = j
    return out + machine.finish(), machine


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([0, -7, 10**20, rng.randint(-(10**6), 10**6)])
    if kind == 1:
        return rng.choice([1.5, -0.0, 1e-7, 3.14159, 1e300, 2.5e-300, float("inf")])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return "".join(rng.choice('ab"\\\n\t\x01/é😀\u2028 ') for _ in range(rng.randrange(7)))
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice('k"\\é😀') for _ in range(rng.randrange(4))): _value(rng, depth + 1)
            for _ in range(rng.randrange(4))}  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_any_json_in_any_pieces_comes_out_as_json_dumps_writes_it(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        value = _value(rng)
        text = json.dumps(
            value,
            ensure_ascii=rng.random() < 0.5,  # \uXXXX escapes, surrogate pairs for 😀
            indent=rng.choice([None, 0, 2]),
            separators=rng.choice([None, (",", ":"), (" , ", " :\t")]),
        )
        expected = json.dumps(json.loads(text), ensure_ascii=False)
        for pieces in (None, rng):
            out, machine = _canonical(text, pieces)
            assert out == expected and machine.done and not machine.error, text


@pytest.mark.parametrize(
    ("text", "out", "done", "error", "rest"),
    [
        (r'"a\/b\ud83dx"', '"a/b\ud83dx"', True, False, ""),  # a lone surrogate stays, as json.loads keeps it
        (r'"\ud83d\ud83d\ude00"', '"\ud83d😀"', True, False, ""),
        ('{"a": 1} </tool_call>', '{"a": 1}', True, False, " </tool_call>"),  # what follows is left
        ("12 }", "12", True, False, " }"),
        ("-1.50", "-1.5", True, False, ""),  # a number at the very end is whole at finish
        ("[NaN, 1e400]", "[NaN, Infinity]", True, False, ""),
        ('{"a": "b\nc", "a": 2}', '{"a": "b\\nc", "a": 2}', True, False, ""),  # lenient where plain
        ('{"a": 1,, "b": 2}', '{"a": 1, ', False, True, ""),  # not JSON: the output stops
        ('{"a": tru}', '{"a": ', False, True, ""),
        (r'["\q"]', '["', False, True, ""),
        (r'"\ud83d\uZZ"', '"\ud83d', False, True, ""),
        ('{"a": [1, "b', '{"a": [1, "b', False, False, ""),  # cut short: what is settled
    ],
)
def test_edges(text: str, out: str, done: bool, error: bool, rest: str) -> None:
    for pieces in (None, random.Random(len(text))):
        got, machine = _canonical(text, pieces)
        assert (got, machine.done, machine.error, machine.rest) == (out, done, error, rest)


# ---- Python literals --------------------------------------------------------------------------------------
def _space(rng: random.Random) -> str:
    return rng.choice(["", "", " ", "\n  ", "\t"])


def _python_string(text: str, rng: random.Random) -> str:
    """``text`` as a Python string literal in one of the ways a model may write it: repr's, raw, triple
    quoted, or with any escape per character; sometimes as adjacent pieces (``"a" 'b'``)."""
    if len(text) > 1 and rng.random() < 0.2:
        cut = rng.randrange(1, len(text))
        return _python_string(text[:cut], rng) + rng.choice([" ", "\n", ""]) + _python_string(text[cut:], rng)
    quote = rng.choice("'\"")
    style = rng.randrange(4)
    if style == 0:
        return rng.choice(["", "u"]) + repr(text)
    if style == 1 and text.isprintable() and quote not in text and not text.endswith("\\"):
        return rng.choice("rR") + quote + text + quote  # raw: backslashes stay
    triple = style == 2
    out = ""
    for i, ch in enumerate(text):
        last_quote = ch == quote and (i == len(text) - 1 or text[i + 1] == quote)
        if ch == "\\" or ch == quote and (not triple or last_quote):
            out += "\\" + ch
            continue
        if ch == "\n" and triple:
            out += ch
            continue
        forms = [ch] if ch.isprintable() else []
        code = ord(ch)
        forms += [f"\\U{code:08x}"] + ([f"\\u{code:04x}"] if code < 0x10000 else [])
        if code < 256:
            forms += [f"\\x{code:02x}", f"\\{code:03o}"]
        if ch in "\n\t\r\b\f\a\v":
            forms.append(repr(ch)[1:-1])
        if unicodedata.name(ch, None):
            forms.append(f"\\N{{{unicodedata.name(ch)}}}")
        out += rng.choice(forms)
    return (quote * 3 if triple else quote) + out + (quote * 3 if triple else quote)


def python_text(value: Any, rng: random.Random, in_tuple: bool = False, key: bool = False) -> str:
    """``value`` written as Python source in random styles (the pythonic parser's tests use it too). A key
    is not put in parentheses (the machine does not read them there)."""
    if rng.random() < 0.05 and not key:
        return "(" + _space(rng) + python_text(value, rng, in_tuple) + _space(rng) + ")"  # a grouping
    if value is None or isinstance(value, bool):
        python = repr(value)
        return python if in_tuple else rng.choice([python, json.dumps(value)])  # a tuple is literal_eval's
    if isinstance(value, int):
        forms = [str(value), f"{value:_}", ("-" if value < 0 else "") + hex(abs(value))]
        return rng.choice(forms + (["- " + str(-value)] if value < 0 else []))
    if isinstance(value, float):
        return "-1e400" if value == float("-inf") else "1e400" if value == float("inf") else repr(value)
    if isinstance(value, str):
        return _python_string(value, rng)
    if isinstance(value, list):
        tuple_ = in_tuple or rng.random() < 0.25
        items = [_space(rng) + python_text(v, rng, tuple_) + _space(rng) for v in value]
        trailing = "," if tuple_ and len(value) == 1 or rng.random() < 0.2 and value else ""
        body = ",".join(items) + trailing + _space(rng)
        return "(" + body + ")" if tuple_ else "[" + body + "]"
    items = [
        _space(rng)
        + python_text(k, rng, in_tuple, key=True)
        + _space(rng)
        + ":"
        + _space(rng)
        + python_text(v, rng, in_tuple)
        for k, v in value.items()
    ]
    return "{" + ",".join(items) + ("," if value and rng.random() < 0.2 else "") + _space(rng) + "}"


def python_value(rng: random.Random, depth: int = 0) -> Any:
    """A value a pythonic call may give (a dict's keys: strings, numbers, booleans, None)."""
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([0, -7, 10**20, 31, rng.randint(-(10**6), 10**6)])
    if kind == 1:
        return rng.choice([1.5, -0.0, 1e-7, 3.14159, 1e300, float("inf"), 2.5e-300])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4):
        return "".join(
            rng.choice("ab'\"\\\n\t\x01/é😀\u2028 {[(#,)]}0\ud83d") for _ in range(rng.randrange(9))
        )
    if kind == 5:
        return [python_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = [rng.choice(["k", "ké", 'q"', "", 1, 2.5, None, False]) for _ in range(rng.randrange(4))]
    return {k: python_value(rng, depth + 1) for k in keys}


def _canonical_python(text: str, rng: random.Random | None = None) -> tuple[str, CanonicalPython]:
    machine, out, i = CanonicalPython(), "", 0
    while i < len(text):
        j = len(text) if rng is None else i + rng.randrange(1, 5)
        out += machine.feed(text[i:j])
        i = j
    return out + machine.finish(), machine


@pytest.mark.parametrize("seed", range(4))
def test_any_python_literal_in_any_pieces_comes_out_as_the_whole_parse_writes_it(seed: int) -> None:
    """What the pythonic parser makes of a whole reply's value (``_literal``, then json.dumps) is what the
    machine writes from the value's text, in any pieces."""
    rng = random.Random(seed)
    for _ in range(300):
        text = python_text(python_value(rng), rng)
        try:
            expected = json.dumps(_literal(ast.parse(text, mode="eval").body), ensure_ascii=False)
        except SyntaxError:  # """ where two adjacent strings met: not a literal
            continue
        for pieces in (None, rng):
            out, machine = _canonical_python(text, pieces)
            assert out == expected and machine.done and not machine.error, ascii(text)


@pytest.mark.parametrize(
    ("text", "out", "done", "error", "rest"),
    [
        ("'it\\'s' , x", '"it\'s"', True, False, ", x"),  # what follows is left
        ("12)", "12", True, False, ")"),
        ("-1.50", "-1.5", True, False, ""),  # a number at the very end is whole at finish
        ("'ab' ", '"ab"', True, False, ""),  # and so is a string
        ("[1, 2,]", "[1, 2]", True, False, ""),  # a trailing comma
        ("(1)", "1", True, False, ""),  # a grouping; (1,) is a tuple
        ("((1,), ())", "[[1], []]", True, False, ""),
        ("{1: 'a', 1: 'b'}", '{"1": "a", "1": "b"}', True, False, ""),  # a key given twice is kept twice
        ("[1,, 2]", "[1", False, True, ""),  # not a literal: the output stops
        ("{1, 2}", '{"1"', False, True, ""),  # a set has no JSON form
        ("[b'x']", "[", False, True, ""),
        ("[x]", "[", False, True, ""),
        ("'\\x4g'", '"', False, True, ""),
        ("'\\N{NO SUCH NAME}'", '"', False, True, ""),
        ("[1j]", "[", False, True, ""),
        ("{'a': [1, 'b", '{"a": [1, "b', False, False, ""),  # cut short: what is settled
        ("('long', 'tup", '["long", "tup', False, False, ""),
        ("('not yet known", "", False, False, ""),  # a tuple or a grouping: held
    ],
)
def test_python_edges(text: str, out: str, done: bool, error: bool, rest: str) -> None:
    for pieces in (None, random.Random(len(text))):
        got, machine = _canonical_python(text, pieces)
        assert (got, machine.done, machine.error, machine.rest) == (out, done, error, rest)
