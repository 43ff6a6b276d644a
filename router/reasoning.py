"""Reasoning in chat replies: the text a thinking model writes between ``<think>`` and ``</think>`` goes to
``reasoning_content``, the rest to ``content`` (vLLM's ``--reasoning-parser``, the DeepSeek API's field).

- ``deepseek_r1``: the reply is reasoning from its start until ``</think>`` (a leading ``<think>`` is
  dropped: the model's template may have put it in the prompt); without ``</think>`` all of it is
  reasoning.
- ``qwen3``: the reply is reasoning only when it opens with ``<think>`` (Qwen3 thinks unless the request
  turns it off with ``chat_template_kwargs: {"enable_thinking": false}``, whose template then writes an
  empty think block into the prompt); it ends at ``</think>`` or with the reply. A reply that does not
  open so is all content.

Whitespace right after ``</think>`` is dropped from the content (the templates put a blank line there).
``ReasoningStream`` reads deltas, holding back only what could still be a marker, so that streamed and
whole replies (the same machine fed the whole text) agree. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.text_stream import marker_prefix_length

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningStream:
    parser: str  # "qwen3" | "deepseek_r1"
    reasoning: str = ""  # every reasoning delta so far
    _buffer: str = ""
    _state: str = "opening"  # "opening": the reply's start is undecided; then "reasoning", "after", "content"

    def add(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) that ``delta`` settles."""
        self._buffer += delta
        reasoning, content = "", ""
        if self._state == "opening":
            head = self._buffer.lstrip()
            if head.startswith(THINK_START):
                self._buffer, self._state = head[len(THINK_START) :], "reasoning"
            elif THINK_START.startswith(head):
                return "", ""  # empty, or a beginning of <think>: not decided yet
            else:
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_END)
            if end < 0:
                keep = marker_prefix_length(self._buffer, THINK_END)
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
            else:
                reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(THINK_END) :]
                self._state = "after"
        if self._state == "after":
            self._buffer = self._buffer.lstrip()
            if self._buffer:
                self._state = "content"
        if self._state == "content":
            content, self._buffer = self._buffer, ""
        self.reasoning += reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "opening":  # the reply ended undecided: text that only began like <think>
            return ("", rest) if self.parser == "qwen3" else self._add_reasoning(rest)
        if self._state == "reasoning":  # no </think>: what was held back is reasoning too
            return self._add_reasoning(rest)
        return "", rest.lstrip() if self._state == "after" else rest

    def _add_reasoning(self, text: str) -> tuple[str, str]:
        self.reasoning += text
        return text, ""
