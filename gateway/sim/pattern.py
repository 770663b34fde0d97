"""Strings that match a regular expression: the `pattern` keyword of a JSON schema.

A small subset of the ECMA-262 syntax JSON Schema uses, enough for the patterns tool schemas
carry (codes, identifiers, dates): literals and escapes, `.`, character classes with ranges and
negation, `\\d \\w \\s` and their negations, groups (capturing, `(?:...)`, named), alternation,
the quantifiers `? * + {n} {n,} {n,m}` (lazy or not) and the anchors `^ $`. Lookarounds,
backreferences and word boundaries raise `PatternError`: a string cannot be built for them
without a regex engine, and the simulator never emits a value its schema would reject.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Final

__all__ = ["PatternError", "compile_pattern", "generate_match"]

_ALPHABET: Final = string.ascii_letters + string.digits + "_-"  # what `.` and negations draw from
_PRINTABLE: Final = "".join(chr(c) for c in range(0x20, 0x7F))
_CLASSES: Final = {
    "d": string.digits,
    "w": string.ascii_letters + string.digits + "_",
    "s": " ",
}
_ESCAPED: Final = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_OPEN_REPEAT: Final = 3  # `*`, `+` and `{n,}` repeat up to this many times more than the least
_MAX_RANGE: Final = 4096  # characters a class may expand to
_MAX_REPEAT: Final = 1000


class PatternError(ValueError):
    """A pattern outside the subset that strings can be generated for."""


@dataclass(slots=True, frozen=True)
class _Chars:
    """One character drawn from `chars`."""

    chars: str


@dataclass(slots=True, frozen=True)
class _Seq:
    items: tuple[_Node, ...]


@dataclass(slots=True, frozen=True)
class _Alt:
    options: tuple[_Seq, ...]


@dataclass(slots=True, frozen=True)
class _Repeat:
    node: _Node
    least: int
    most: int | None  # None: open (`*`, `+`, `{n,}`)


_Node = _Chars | _Seq | _Alt | _Repeat


@dataclass(slots=True)
class Compiled:
    """A parsed pattern, and the compiled regex its strings are checked with."""

    tree: _Alt
    regex: re.Pattern[str]


def compile_pattern(pattern: str) -> Compiled:
    """Parse `pattern`. Raises PatternError for an invalid pattern or one outside the subset."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise PatternError(f"invalid pattern {pattern!r}: {exc}") from None
    parser = _Parser(pattern)
    tree = parser.alternation()
    if parser.pos != len(pattern):
        raise PatternError(f"unbalanced ')' in pattern {pattern!r}")
    return Compiled(tree, regex)


def generate_match(
    compiled: Compiled, rng: random.Random, least: int = 0, most: int | None = None
) -> str | None:
    """A string matching the pattern, `least` to `most` characters long; None if no attempt
    found one (a length the pattern cannot meet)."""
    for attempt in range(32):
        # Open repeats stay short, unless a minimum length needs them longer.
        extra = _OPEN_REPEAT if attempt < 8 else max(_OPEN_REPEAT, least)
        text = _emit(compiled.tree, rng, extra)
        fits = least <= len(text) and (most is None or len(text) <= most)
        if fits and compiled.regex.search(text) is not None:
            return text
    return None


def _emit(node: _Node, rng: random.Random, extra: int) -> str:
    if isinstance(node, _Chars):
        return rng.choice(node.chars) if node.chars else ""
    if isinstance(node, _Seq):
        return "".join(_emit(item, rng, extra) for item in node.items)
    if isinstance(node, _Alt):
        return _emit(rng.choice(node.options), rng, extra) if node.options else ""
    most = node.least + extra if node.most is None else node.most
    return "".join(_emit(node.node, rng, extra) for _ in range(rng.randint(node.least, most)))


class _Parser:
    """Recursive descent over the pattern; `pos` is the next character to read."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0

    def _peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def _fail(self, what: str) -> PatternError:
        return PatternError(f"{what} is not supported in pattern {self.pattern!r}")

    def alternation(self) -> _Alt:
        options = [self._sequence()]
        while self._peek() == "|":
            self.pos += 1
            options.append(self._sequence())
        return _Alt(tuple(options))

    def _sequence(self) -> _Seq:
        items: list[_Node] = []
        while (char := self._peek()) is not None and char not in "|)":
            if char in "^$":  # anchors: zero-width, checked by the final search
                self.pos += 1
                continue
            atom = self._atom()
            items.append(self._quantified(atom))
        return _Seq(tuple(items))

    def _atom(self) -> _Node:
        char = self.pattern[self.pos]
        self.pos += 1
        if char == "(":
            if self.pattern.startswith("?", self.pos):
                self._group_prefix()
            inner = self.alternation()
            if self._peek() != ")":
                raise PatternError(f"unbalanced '(' in pattern {self.pattern!r}")
            self.pos += 1
            return inner
        if char == "[":
            return self._class()
        if char == ".":
            return _Chars(_ALPHABET)
        if char == "\\":
            return _Chars(self._escape(in_class=False))
        if char in "*+?{":
            raise PatternError(f"nothing to repeat in pattern {self.pattern!r}")
        return _Chars(char)

    def _group_prefix(self) -> None:
        rest = self.pattern[self.pos :]
        if rest.startswith("?:"):
            self.pos += 2
        elif rest.startswith(("?<=", "?<!", "?=", "?!")):
            raise self._fail("a lookaround")
        elif rest.startswith(("?<", "?P<")):
            end = self.pattern.find(">", self.pos)
            if end < 0:
                raise PatternError(f"unterminated group name in pattern {self.pattern!r}")
            self.pos = end + 1
        else:
            raise self._fail("this group syntax")

    def _escape(self, *, in_class: bool) -> str:
        if self.pos >= len(self.pattern):
            raise PatternError(f"a trailing backslash in pattern {self.pattern!r}")
        char = self.pattern[self.pos]
        self.pos += 1
        if char.lower() in _CLASSES:
            chars = _CLASSES[char.lower()]
            if char.isupper():
                return "".join(c for c in _ALPHABET if c not in chars) or "-"
            return chars
        if char in _ESCAPED:
            return _ESCAPED[char]
        if char in "xu":
            width = 2 if char == "x" else 4
            digits = self.pattern[self.pos : self.pos + width]
            if len(digits) != width or not all(d in string.hexdigits for d in digits):
                raise PatternError(f"a bad \\{char} escape in pattern {self.pattern!r}")
            self.pos += width
            return chr(int(digits, 16))
        if char.isdigit() or (char in "bB" and not in_class) or char.isalpha():
            raise self._fail(f"'\\{char}'")
        return char  # an escaped punctuation character stands for itself

    def _class(self) -> _Chars:
        negated = self._peek() == "^"
        if negated:
            self.pos += 1
        members: set[str] = set()
        first = True
        while True:
            char = self._peek()
            if char is None:
                raise PatternError(f"unterminated '[' in pattern {self.pattern!r}")
            if char == "]" and not first:
                self.pos += 1
                break
            first = False
            self.pos += 1
            if char == "\\":
                chars = self._escape(in_class=True)
                if len(chars) != 1:  # a class escape such as \d: no range from it
                    members.update(chars)
                    continue
                char = chars
            if self._peek() == "-" and self.pattern[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.pos += 1
                end = self.pattern[self.pos]
                self.pos += 1
                if end == "\\":
                    end = self._escape(in_class=True)
                    if len(end) != 1:
                        raise self._fail("a range ending in a class escape")
                if ord(end) < ord(char):
                    raise PatternError(f"a bad range {char}-{end} in pattern {self.pattern!r}")
                if ord(end) - ord(char) > _MAX_RANGE:
                    raise self._fail("a character range this wide")
                members.update(chr(c) for c in range(ord(char), ord(end) + 1))
            else:
                members.add(char)
        if negated:
            return _Chars("".join(c for c in _PRINTABLE if c not in members))
        return _Chars("".join(sorted(members)))

    def _quantified(self, atom: _Node) -> _Node:
        char = self._peek()
        if char is None or char not in "*+?{":
            return atom
        if char == "{":
            close = self.pattern.find("}", self.pos)
            body = self.pattern[self.pos + 1 : close] if close > 0 else ""
            least_text, comma, most_text = body.partition(",")
            if not least_text.isdigit() or (most_text and not most_text.isdigit()):
                return atom  # a literal "{", as ECMA and Python read it
            self.pos = close + 1
            least = int(least_text)
            most: int | None = int(most_text) if most_text else (None if comma else least)
        else:
            self.pos += 1
            least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        if self._peek() in ("?", "+"):  # lazy or possessive: the same strings match
            self.pos += 1
        if least > _MAX_REPEAT or (most is not None and (most < least or most > _MAX_REPEAT)):
            raise PatternError(f"a bad repeat count in pattern {self.pattern!r}")
        return _Repeat(atom, least, most)
