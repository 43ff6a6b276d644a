"""One value read as it streams in and written out in one form: ``json.dumps(value, ensure_ascii=False)``'s
(``", "`` and ``": "`` between items, no other whitespace, strings with JSON's shortest escapes, numbers and
literals as Python writes them back). ``CanonicalJson`` reads JSON; ``CanonicalPython`` reads a Python literal
(the values of pythonic tool calls).

A tool call's arguments are streamed to the client as the model writes them; a whole reply gives the same
text, because both are this machine's output for the same characters, in whatever pieces they came.
What ``json.loads`` would refuse is still read where the form is plain: control characters in a string
are escaped, and a key given twice is kept twice (``json.loads`` keeps the last, as a Python dict does).
Anything else that is not JSON (or a literal) stops the output where it is (``error``); nothing here does I/O.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
from typing import Any

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


# ---- Python literals ------------------------------------------------------------------------------------
# JSON's names, read in Python literals too (models write both)
JSON_NAMES = {"true": True, "false": False, "null": None}
_PY_SPACE = " \t\r\n\f"
_PY_SCALAR = re.compile(r"[A-Za-z0-9_.+\-]")  # a number's characters, True, False, None, a string's prefix
_PY_RUN = {q: re.compile(rf"[^{q}\\]+") for q in "'\""}  # a string's characters up to a quote or backslash
_PY_ESCAPES = {"\n": "", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
               "t": "\t", "v": "\v"}  # fmt: skip
_PY_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_OCTAL = "01234567"
_CLOSERS = {"[": "]", "{": "}", "(": ")", "t": ")"}


class CanonicalPython:
    """A Python literal, as ``ast.literal_eval`` reads it (and JSON's true, false and null), written as
    ``json.dumps`` writes its value: a tuple is an array, a dict key that is a number, a boolean or None is
    the string json.dumps makes of it. Strings stream as they are written (single, double or triple quotes,
    ``r`` and ``u`` prefixes, every escape, adjacent strings joined), held back only by a quote that may
    end them; a number or name is written once it ends, and a parenthesis's first item once a comma (a
    tuple) or the closing parenthesis (a grouping) says which it is. Same interface as ``CanonicalJson``.
    What a Python dict would merge is kept as written: a key given twice twice, ``1`` and ``True`` as two."""

    def __init__(self) -> None:
        self.done = False
        self.error = False
        self.rest = ""  # what came after the value
        # The open containers: "[", "{", "t" (a tuple), "(" (a parenthesis not yet known to be a tuple, whose
        # output is held in ``_held`` until it is).
        self._stack: list[str] = []
        self._held: list[list[str]] = []
        self._out: list[str] = []
        # What comes next: "value", "value_or_end", "key_or_end", "colon", "comma_or_end"; "scalar" inside a
        # number or name; "string", "after_string" (its closing quote held: another string may join it) and
        # "prefix" (a string prefix after a string).
        self._state = "value"
        self._key = False  # the string or scalar being read is a dict key
        self._comma = False  # a comma read: ", " is written once an item follows it
        self._pending = ""  # a scalar, or an escape, not yet whole
        self._quote = ""  # the string's quote character
        self._triple = False
        self._raw = False
        self._quotes = 0  # in a triple-quoted string: its quote characters read in a row
        self._empty = False  # the string just closed had nothing between its quotes (a third one opens """)
        self._adjacent = False  # nothing came between the string's closing quote and this character

    def feed(self, text: str) -> str:
        i = 0
        while i < len(text) and not (self.done or self.error):
            i = self._step(text, i)
        if self.done:
            self.rest += text[i:]
        out, self._out = "".join(self._out), []
        return out

    def finish(self) -> str:
        """A scalar or string that ends the text is whole at the end; an unfinished escape, container or
        parenthesis is not (the output stops where it is)."""
        if not (self.done or self.error):
            if self._state == "scalar":
                self._end_scalar()
            elif self._state == "after_string":
                self._emit('"')
                self._string_ended()
        out, self._out = "".join(self._out), []
        return out

    # ---- the machine ----------------------------------------------------------------------------------
    def _emit(self, text: str) -> None:
        (self._held[-1] if self._held else self._out).append(text)

    def _step(self, text: str, i: int) -> int:
        """Read the character at ``i``; return where reading goes on (``i`` again when it ended a scalar or a
        string and is read anew)."""
        state, ch = self._state, text[i]
        if state == "string":
            return self._string(text, i)
        if state == "scalar":
            if _PY_SCALAR.match(ch):
                self._pending += ch
            elif ch in "'\"" and self._pending in ("r", "R", "u", "U"):
                self._open_string(ch, raw=self._pending in "rR", join=False)
            elif ch in _PY_SPACE and not self._pending.strip("+-"):
                pass  # "- 1" is -1
            else:
                self._end_scalar()
                return i
            return i + 1
        if state == "after_string":
            return self._after_string(text, i)
        if state == "prefix":
            if ch not in "'\"":
                self.error = True
                return i
            self._open_string(ch, raw=self._raw, join=True)
            return i + 1
        if ch in _PY_SPACE:
            return i + 1
        top = self._stack[-1] if self._stack else ""
        if state in ("value", "value_or_end", "key_or_end"):
            key = state == "key_or_end"
            if state != "value" and ch == _CLOSERS[top]:
                self._close(top)
            elif ch in "'\"":
                self._item(key)
                self._open_string(ch, raw=False, join=False)
            elif _PY_SCALAR.match(ch):
                self._item(key)
                self._state, self._pending = "scalar", ch
            elif ch in "[{(" and not key:
                self._item(key)
                self._stack.append(ch)
                if ch == "(":
                    self._held.append([])
                else:
                    self._emit(ch)
                self._state = "key_or_end" if ch == "{" else "value_or_end"
            else:
                self.error = True
        elif state == "colon":
            if ch == ":":
                self._emit(": ")
                self._state = "value"
            else:
                self.error = True
        elif state == "comma_or_end":
            if ch == ",":
                if top == "(":  # a comma makes the parenthesis a tuple
                    self._stack[-1] = "t"
                    self._emit("[" + "".join(self._held.pop()))
                self._comma, self._state = True, "key_or_end" if top == "{" else "value_or_end"
            elif ch == _CLOSERS[top]:
                self._close(top)
            else:
                self.error = True
        return i + 1

    def _item(self, key: bool) -> None:
        """An item starts: the comma before it is written."""
        self._key = key
        if self._comma:
            self._comma = False
            self._emit(", ")

    def _close(self, opener: str) -> None:
        self._stack.pop()
        self._comma = False  # a trailing comma
        if opener == "(":  # () is an empty tuple; (x) is x
            held = "".join(self._held.pop())
            self._emit(held or "[]")
        else:
            self._emit("]" if opener in "[t" else "}")
        self._value_ended()

    def _value_ended(self) -> None:
        if self._stack:
            self._state = "comma_or_end"
        else:
            self._state, self.done = "done", True

    def _end_scalar(self) -> None:
        text, self._pending = self._pending, ""
        try:
            value: Any = JSON_NAMES[text] if text in JSON_NAMES else ast.literal_eval(text)
            written = json.dumps({value: None} if self._key else value, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.error = True
            return
        if self._key:  # the key as json.dumps writes it: {"1": null}
            self._emit(written[1 : -len(": null}")])
            self._state = "colon"
        else:
            self._emit(written)
            self._value_ended()

    # ---- strings --------------------------------------------------------------------------------------
    def _open_string(self, quote: str, raw: bool, join: bool) -> None:
        """A string's opening quote; ``join``: it follows a string, and goes on with its text."""
        if not join:
            self._emit('"')
        self._state, self._quote, self._raw, self._triple, self._quotes = "string", quote, raw, False, 0
        self._pending, self._empty = "", True

    def _string(self, text: str, i: int) -> int:
        ch = text[i]
        if self._pending:
            return self._escape(ch, i)
        if self._quotes:  # a triple-quoted string's quotes: its end, or its text
            if ch == self._quote:
                self._quotes += 1
                if self._quotes == 3:
                    self._state, self._adjacent, self._empty = "after_string", True, False
                return i + 1
            self._emit(_encoded(self._quote * self._quotes))
            self._quotes = 0
        if ch == self._quote:
            if self._triple:
                self._quotes = 1
            else:
                self._state, self._adjacent = "after_string", True
            return i + 1
        self._empty = False
        if ch == "\\":
            self._pending = ch
            return i + 1
        run = _PY_RUN[self._quote].match(text, i)
        assert run is not None
        self._emit(_encoded(run.group()))  # a raw newline too (Python would refuse it outside triple quotes)
        return run.end()

    def _escape(self, ch: str, i: int) -> int:
        """The escape after a backslash, Python's: ``\\n``, octal, ``\\x``, ``\\u``, ``\\U``, ``\\N{name}``; one it
        does not know keeps its backslash; a raw string keeps both characters."""
        pending = self._pending + ch
        kind = pending[1]
        if len(pending) == 2:
            if self._raw or not (kind in _PY_ESCAPES or kind in _OCTAL or kind in "xuUN"):
                self._pending = ""
                self._emit(_encoded(pending))
            elif kind in _PY_ESCAPES:
                self._pending = ""
                self._emit(_encoded(_PY_ESCAPES[kind]))
            else:
                self._pending = pending
            return i + 1
        if kind in _OCTAL:  # up to three digits
            if ch in _OCTAL:
                self._pending = pending
                if len(pending) < 4:
                    return i + 1
                i += 1
            self._emit(_encoded(chr(int(self._pending[1:], 8))))
            self._pending = ""
            return i  # a character after the digits is read again
        self._pending = pending
        if kind == "N":  # \N{name}
            if len(pending) == 3 and ch != "{" or len(pending) > 100:
                self.error = True
            elif ch == "}":
                try:
                    self._emit(_encoded(unicodedata.lookup(pending[3:-1])))
                except KeyError:
                    self.error = True
                self._pending = ""
            return i + 1
        if ch not in "0123456789abcdefABCDEF":
            self.error = True
        elif len(pending) == 2 + _PY_HEX_ESCAPES[kind]:
            self._pending = ""
            code = int(pending[2:], 16)
            if code > 0x10FFFF:
                self.error = True
            else:
                self._emit(_encoded(chr(code)))
        return i + 1

    def _after_string(self, text: str, i: int) -> int:
        """After a string's closing quote: another string joins it (``"a" "b"``; ``""`` then a quote opens a
        triple-quoted one); anything else ends it."""
        ch = text[i]
        if ch in _PY_SPACE:
            self._adjacent = False
            return i + 1
        if ch in "'\"":
            if self._adjacent and self._empty and ch == self._quote:
                self._state, self._triple, self._empty = "string", True, True
            else:
                self._open_string(ch, raw=False, join=True)
            return i + 1
        if ch in "rRuU":
            self._state, self._raw = "prefix", ch in "rR"
            return i + 1
        self._emit('"')
        self._string_ended()
        return i

    def _string_ended(self) -> None:
        if self._key:
            self._state = "colon"
        else:
            self._value_ended()
