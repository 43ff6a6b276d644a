"""The streamed JSON canonicaliser of tool-call arguments (router/json_stream.py): in any pieces, it writes
what json.dumps(json.loads(text), ensure_ascii=False) writes, and stops where the text is not JSON."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from router.json_stream import CanonicalJson


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
