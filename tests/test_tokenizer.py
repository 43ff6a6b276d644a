"""IncrementalDetokenizer: streamed deltas add up to the full decode, with bounded decode windows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, render_chat
from tests.checkpoints import write_tokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "naïve café — 東京タワー 🗼 and ünïcödé mixed with ascii",
    "emoji runs 😀😀👍🏽 then text",
]


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)  # type: ignore[attr-defined]


def hf_tokenizer(tmp_path: Path) -> HFTokenizer:
    write_tokenizer(tmp_path)
    return HFTokenizer(tmp_path, [], vocab_size=512)


def stream(tok: object, ids: list[int], step_sizes: list[int], skip_special: bool) -> tuple[str, str]:
    detok = IncrementalDetokenizer(tok, skip_special)  # type: ignore[arg-type]
    out, i = [], 0
    for n in step_sizes:
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.add(ids[i:]))
    tail = detok.flush()
    return "".join(out), tail


@pytest.mark.parametrize("kind", ["byte-level tokenizer.json", "byte tokenizer"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_deltas_add_up_to_the_full_decode(tmp_path: Path, kind: str, skip_special: bool) -> None:
    base = hf_tokenizer(tmp_path) if kind.startswith("byte-level") else ByteTokenizer()
    rng = random.Random(0)
    for text in TEXTS:
        ids = base.encode(text, add_special_tokens=False)
        if isinstance(base, HFTokenizer):  # specials in the middle: skipped or kept
            eos = base.eos_token_ids[0]
            for _ in range(3):
                ids.insert(rng.randrange(len(ids)), eos)
        full = base.decode(ids, skip_special_tokens=skip_special)
        for steps in ([1] * len(ids), [rng.randint(1, 4) for _ in range(len(ids) // 2)]):
            tok = CountingTokenizer(base)
            streamed, tail = stream(tok, ids, steps, skip_special)
            assert streamed == full and tail == "", (kind, text)
            assert "\ufffd" not in streamed
            # One token at a time, every decode but flush's sees a short window, not the whole output.
            if steps[0] == 1 and len(steps) == len(ids):
                assert max(tok.lengths[:-1]) <= 12, max(tok.lengths[:-1])


def test_incomplete_character_is_held_back() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é🗼", add_special_tokens=False)  # 2 + 4 bytes
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:2]) == "é"
    assert [detok.add([i]) for i in ids[2:5]] == ["", "", ""]
    assert detok.add(ids[5:]) == "🗼"
    assert detok.text == "é🗼" and detok.flush() == ""


def test_find_stop_searches_only_what_could_be_new() -> None:
    from engine.tokenizer import find_stop

    # A long delta holding the stop twice: the first occurrence wins, not the one near the end.
    text = "held" + "xx END yy" * 3
    assert find_stop(text, ["END"], checked=4) == (7, "END")
    # A match across the boundary of what was checked counts; one wholly inside it cannot be new.
    assert find_stop("abcSTOP", ["cST"], checked=3) == (2, "cST")
    assert find_stop("STOP then more", ["STOP"], checked=9) is None
    # Stop strings are tried in request order.
    assert find_stop("one two", ["two", "one"], checked=0) == (4, "two")


def test_chat_template_is_compiled_once_and_renders_the_same() -> None:
    from engine.tokenizer import ByteTokenizer, _compiled_chat_template, render_chat

    tok = ByteTokenizer(300)
    messages = [{"role": "user", "content": "hi"}]
    first = render_chat(tok, messages)
    before = _compiled_chat_template.cache_info()
    for _ in range(3):
        assert render_chat(tok, messages) == first
    after = _compiled_chat_template.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 3
    assert "hi" in first


def test_render_chat_passes_tools_and_template_kwargs_to_the_template() -> None:
    """What chat requests' ``tools`` and ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) reach."""
    tok = ByteTokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    assert render_chat(tok, messages) == "user:hi|"
    assert (
        render_chat(tok, messages, tools=tools, enable_thinking=False) == "TOOLS:f;g;user:hi|<think></think>"
    )


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMMING = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n\n{% endfor %}"


@pytest.mark.parametrize("template", [None, CHATML, TRIMMING], ids=["checkpoint", "chatml", "trimming"])
def test_continue_final_message_renders_as_transformers_does(tmp_path: Path, template: str | None) -> None:
    """vLLM's continue_final_message: the text ends with the last message's, open for the model to go on;
    transformers' apply_chat_template is the reference (templates that keep or trim the message's spacing,
    the same text earlier in the chat)."""
    from transformers import AutoTokenizer

    ours = hf_tokenizer(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    if template is not None:
        ours.chat_template = reference.chat_template = template
    for last in ("The answer is", "  spaced out  ", "Same"):
        messages = [
            {"role": "user", "content": "Same"},
            {"role": "assistant", "content": last},
        ]
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert render_chat(ours, messages, False, continue_final_message=True) == expected
        assert expected.rstrip().endswith(last.strip()) and "CONTINUE" not in expected
    with pytest.raises(ValueError, match="cannot both"):
        render_chat(ours, messages, True, continue_final_message=True)
    with pytest.raises(ValueError, match="text to continue"):
        render_chat(ours, [{"role": "assistant", "content": None}], False, continue_final_message=True)
    ours.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # writes no message's text
    with pytest.raises(ValueError, match="does not write"):
        render_chat(ours, messages, False, continue_final_message=True)
