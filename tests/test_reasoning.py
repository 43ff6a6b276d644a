"""Reasoning split from chat replies (router/reasoning.py): whole and streamed in any pieces alike, by the
qwen3 and deepseek_r1 rules."""

from __future__ import annotations

import random

import pytest

from router.reasoning import ReasoningStream


def _run(parser: str, text: str, pieces: list[str] | None = None) -> tuple[str, str, str]:
    """(reasoning deltas joined, content deltas joined, the stream's whole reasoning)."""
    stream = ReasoningStream(parser)
    reasoning, content = "", ""
    for piece in pieces if pieces is not None else [text]:
        r, c = stream.add(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c, stream.reasoning


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 10))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


CASES = [
    # (text, qwen3's (reasoning, content), deepseek_r1's)
    ("<think>\nweigh a < b</think>\n\nThe answer.", ("\nweigh a < b", "The answer."), ("\nweigh a < b", "The answer.")),
    ("\n<think>x</think>y", ("x", "y"), ("x", "y")),
    ("no thinking here", ("", "no thinking here"), ("no thinking here", "")),
    ("step one</think>done", ("", "step one</think>done"), ("step one", "done")),
    ("<think>cut short by max_to", ("cut short by max_to", ""), ("cut short by max_to", "")),
    ("<thi", ("", "<thi"), ("<thi", "")),
    ("<think></think>\n\n", ("", ""), ("", "")),
    ("", ("", ""), ("", "")),
]  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("text", "qwen3", "deepseek"), CASES)
def test_reasoning_and_content_are_the_same_whole_and_streamed(seed: int, text: str, qwen3, deepseek) -> None:
    for parser, expected in (("qwen3", qwen3), ("deepseek_r1", deepseek)):
        whole = _run(parser, text)
        streamed = _run(parser, text, _pieces(text, seed))
        assert whole[:2] == streamed[:2] == expected, (parser, text)
        assert whole[2] == streamed[2] == expected[0]


def test_nothing_that_could_be_a_marker_is_sent_early() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.add("<th") == ("", "")  # could open a think block
    assert stream.add("ink>plan</th") == ("plan", "")  # could close it
    assert stream.add("ink>\n") == ("", "")  # blank lines after </think> are not content
    assert stream.add("\nAnswer") == ("", "Answer")
    assert stream.finish() == ("", "")
