"""Text of a streamed completion: incremental detokenization with stop strings cut off.

Workers stream token ids only; the router turns them into text. A worker stops at the token that
completes a stop string (its tokens are returned), so the text must end before the stop string, exactly
as the offline engine's text does. While streaming, the last ``len(longest stop string) - 1`` characters
are held back, since they may be the start of a stop string that the next tokens complete.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


class TextStream:
    """Feed token ids with ``add``; take the text that is safe to send; ``finish`` flushes the rest."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        stop_token_ids: Collection[int] = (),
    ) -> None:
        """``include_stop``: the text ends after the stop string or stop token that ended it, not before
        it. ``stop_token_ids``: the tokens that end the request by themselves (EOS unless ignored, and the
        request's stop_token_ids); one that ended it is not in the text (vLLM's rule, as the engine's)."""
        self._stop_token_ids = frozenset(stop_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._text = ""  # all text decoded so far (before any stop cut)
        self._sent = 0  # characters of _text already returned
        self.stopped_on: str | None = None  # the stop string that ended the text
        self._include_stop = include_stop

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._sent]

    def add(self, token_ids: Sequence[int], stopped: bool = False) -> str:
        """New text safe to send; after a stop string matched, always ''. ``stopped``: these are the
        request's last tokens and it finished on "stop"."""
        if self.stopped_on is not None:
            return ""
        if stopped and token_ids and token_ids[-1] in self._stop_token_ids and not self._include_stop:
            token_ids = token_ids[:-1]
        checked = len(self._text)
        self._text += self._detok.add(list(token_ids))
        if self._cut_at_stop(checked):
            return self._take(len(self._text))
        return self._take(max(self._sent, len(self._text) - self._holdback))

    def finish(self) -> str:
        """The held-back rest, once the request is over."""
        if self.stopped_on is None:
            checked = len(self._text)
            self._text += self._detok.flush()
            self._cut_at_stop(checked)
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        delta = self._text[self._sent : upto]
        self._sent = max(self._sent, upto)
        return delta

    def _cut_at_stop(self, checked: int) -> bool:
        found = find_stop(self._text, self.stop, checked)  # the engine's rule
        if found is None:
            return False
        idx, self.stopped_on = found
        if self._include_stop:
            idx += len(self.stopped_on)
        self._text = self._text[:idx]
        self._sent = min(self._sent, idx)
        return True


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, for logprobs; ``token_id:<id>`` when it decodes to nothing (special tokens)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text if text else f"token_id:{token_id}"


def marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``: what a stream holds back until the
    next text shows whether the marker follows (``<tool_call>``, ``</think>``)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
