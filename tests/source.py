"""Parsing the project's own source in tests, safe beside other threads.

CPython 3.11 keeps the AST converter's recursion depth in the `ast` module's state, not the
thread's, so `ast.parse` can fail with `SystemError: AST constructor recursion depth mismatch`
when another conversion runs in the middle of it: a garbage collection during the conversion
runs finalizers, which may format a traceback (3.11 parses each source line for the carets) or
let another thread parse. Seen once in the full suite. A parse is pure: it is tried again.
"""

from __future__ import annotations

import ast

__all__ = ["parse"]

_TRIES = 5


def parse(source: str) -> ast.Module:
    """`ast.parse(source)`, tried again if a concurrent conversion in another thread upsets it."""
    for _ in range(_TRIES - 1):
        try:
            return ast.parse(source)
        except SystemError:
            continue
    return ast.parse(source)
