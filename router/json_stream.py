"""One JSON value read as it streams in and written out in one form: ``json.dumps(json.loads(text),
ensure_ascii=False)``'s (``", "`` and ``": "`` between items, no other whitespace, strings with JSON's
shortest escapes, numbers and literals as Python writes them back).

A tool call's arguments are streamed to the client as the model writes them; a whole reply gives the same
text, because both are this machine's output for the same characters, in whatever pieces they came.
What ``json.loads`` would refuse is still read where the form is plain: control characters in a string
are escaped, and a key given twice is kept twice (``json.loads`` keeps the last). Anything else that is not
JSON stops the output where it is (``error``); nothing here does I/O.
"""

from __future__ import annotations

import json
import re

_SCALAR = re.compile(r"[A-Za-z0-9.+\-]")  # the characters of a number, true, false, null, NaN, Infinity
_HEX = re.compile(r"[0-9a-fA-F]{1,4}")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _encoded(text: str) -> str:
    """``text`` as json.dumps writes it inside a string's quotes (ensure_ascii=False)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class CanonicalJson:
    """``feed(text)`` returns the part of the canonical form that ``text`` settles; ``finish()`` the rest
    (a number at the very end); ``done`` once the value is whole, ``error`` once the text is not JSON."""

    def __init__(self) -> None:
        self.done = False
        self.error = False
        self.rest = ""  # what came after the value
        self._stack: list[str] = []  # the open containers: "{" or "["
        # What comes next: "value", "value_or_end" (after "["), "key", "key_or_end" (after "{"), "colon",
        # "comma_or_end"; "string" inside a string, "scalar" inside a number or literal.
        self._state = "value"
        self._after_string = ""  # "colon" after a key, "" after a value
        self._pending = ""  # an escape or a scalar not yet whole

    def feed(self, text: str) -> str:
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.done or self.error:
                if self.done:
                    self.rest += text[i:]
                break
            self._step(ch, out)
        return "".join(out)

    def finish(self) -> str:
        """A scalar that ends the text (a top-level number) is whole at the end; an unfinished escape or
        container is not (the output stops where it is)."""
        if self._state == "scalar" and not self.done and not self.error:
            out: list[str] = []
            self._end_scalar(out)
            return "".join(out)
        return ""

    # ---- the machine ----------------------------------------------------------------------------------
    def _step(self, ch: str, out: list[str]) -> None:
        state = self._state
        if state == "string":
            self._string_char(ch, out)
            return
        if state == "scalar":
            if _SCALAR.match(ch):
                self._pending += ch
                return
            self._end_scalar(out)
            if self.done or self.error:
                if self.done:
                    self.rest += ch
                return
            state = self._state
        if ch in " \t\r\n":
            return
        if state in ("value", "value_or_end"):
            if ch == "]" and state == "value_or_end":
                self._close("[", out)
            elif ch in "{[":
                out.append(ch)
                self._stack.append(ch)
                self._state = "key_or_end" if ch == "{" else "value_or_end"
            elif ch == '"':
                out.append(ch)
                self._state, self._after_string = "string", ""
            elif _SCALAR.match(ch):
                self._state, self._pending = "scalar", ch
            else:
                self.error = True
        elif state in ("key", "key_or_end"):
            if ch == "}" and state == "key_or_end":
                self._close("{", out)
            elif ch == '"':
                out.append(ch)
                self._state, self._after_string = "string", "colon"
            else:
                self.error = True
        elif state == "colon":
            if ch == ":":
                out.append(": ")
                self._state = "value"
            else:
                self.error = True
        elif state == "comma_or_end":
            top = self._stack[-1]
            if ch == ",":
                out.append(", ")
                self._state = "key" if top == "{" else "value"
            elif ch == ("}" if top == "{" else "]"):
                self._close(top, out)
            else:
                self.error = True

    def _close(self, opener: str, out: list[str]) -> None:
        self._stack.pop()
        out.append("}" if opener == "{" else "]")
        self._value_ended()

    def _value_ended(self) -> None:
        if self._stack:
            self._state = "comma_or_end"
        else:
            self._state, self.done = "done", True

    def _end_scalar(self, out: list[str]) -> None:
        text, self._pending = self._pending, ""
        try:
            value = json.loads(text)
        except ValueError:
            self.error = True
            return
        out.append(json.dumps(value))
        self._value_ended()

    def _string_char(self, ch: str, out: list[str]) -> None:
        pending = self._pending
        if not pending:
            if ch == '"':
                out.append(ch)
                if self._after_string == "colon":
                    self._state = "colon"
                else:
                    self._value_ended()
            elif ch == "\\":
                self._pending = ch
            else:
                out.append(_encoded(ch))  # a raw control character too (json.loads would refuse it)
            return
        pending += ch
        if len(pending) == 2:  # the escape's letter
            if ch in _ESCAPES:
                self._pending = ""
                out.append(_encoded(_ESCAPES[ch]))
            elif ch == "u":
                self._pending = pending
            else:
                self.error = True
            return
        self._pending = pending
        if len(pending) <= 6 and ch not in "0123456789abcdefABCDEF":
            self.error = True
            return
        if len(pending) < 6:
            return
        if len(pending) == 6:
            if not 0xD800 <= int(pending[2:6], 16) <= 0xDBFF:
                self._pending = ""
                out.append(_encoded(chr(int(pending[2:6], 16))))
            return  # a high surrogate waits for a low one to pair with
        # A second escape must follow, character by character: "\\", "u", four hex digits of a low surrogate.
        tail = pending[6:]
        if tail == "\\u"[: len(tail)] or (
            len(tail) > 2
            and _HEX.fullmatch(tail[2:])
            and (len(tail) < 6 or 0xDC00 <= int(tail[2:], 16) <= 0xDFFF)
        ):
            if len(tail) < 6:
                return
            self._pending = ""
            high, low = int(pending[2:6], 16), int(tail[2:], 16)
            out.append(_encoded(chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))))
            return
        # Not a pair: the high surrogate stands alone (as json.loads keeps it), the rest is read again.
        self._pending = ""
        out.append(_encoded(chr(int(pending[2:6], 16))))
        for again in tail:
            self._string_char(again, out)
