"""Python call sites of profiled copies (``CallSite``): frame stacks from ``python_function``
trace events, and the exact source lines recovered from the files; ``num`` and ``key`` read
the untrusted fields of any trace event.

torch records a frame when it is entered, so a ``python_function`` event's line is the ``def``
line (or the current line of a frame already running when recording began); the line that
called, say, ``.item()`` is found by reading that block's source for the callee's name.
"""

from __future__ import annotations

import bisect
import linecache
import math
import os
import re
import sys
import tokenize
from dataclasses import dataclass

__all__ = ["FRAME", "BUILTIN", "CallSite", "Stacks", "callee_name", "num", "key", "resolve_lines"]

# "file(line): function"
FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")
BUILTIN = re.compile(r"^<built-in (?:method|function) ([\w.]+)(?: of (\w+) object)?")


@dataclass
class CallSite:
    """Where pageable (or any) copies came from: the innermost user frames above the copy.

    Attributes:
        frames: user frames, innermost first, as the trace names them ``"file(line): func"``.
        callee: what the innermost user frame called (``"Tensor.item"``, ``"Tensor.to"``);
            when that went through torch's Python first, the first and the last frame below the
            user's (``"torch/optim/optimizer.py(480): wrapper > Tensor.copy_"``); the CPU op
            (``"aten::copy_"``) when the trace has no Python stack.
        lines: source lines in the innermost frame's block that call the callee (may be empty).
        count: copies issued from here. nbytes: their bytes.
    """

    frames: tuple[str, ...]
    callee: str
    lines: tuple[int, ...] = ()
    count: int = 0
    nbytes: int = 0

    @property
    def file(self) -> str:
        """File of the innermost user frame, as the trace names it (relative to sys.path)."""
        m = FRAME.match(self.frames[0] if self.frames else "")
        return m["file"] if m else ""

    @property
    def function(self) -> str:
        m = FRAME.match(self.frames[0] if self.frames else "")
        return m["func"] if m else ""

    def __str__(self) -> str:
        if not self.frames:
            where = "<no Python stack>"
        elif self.lines:
            where = f"{self.file}:{','.join(map(str, self.lines))} in {self.function}"
        else:
            where = self.frames[0]
        return f"{where} via {self.callee}" if self.callee else where


def num(x) -> float:
    """A trace field as a finite float (0.0 when missing or malformed, NaN and infinities
    included: traces are not trusted)."""
    try:
        x = float(x)
    except (TypeError, ValueError, OverflowError):  # None, "soon", [], 10**400
        return 0.0
    return x if math.isfinite(x) else 0.0


def key(x):
    """A trace field as a dict key: itself when hashable, else its repr (a list-valued pid)."""
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


class Stacks:
    """Python frames of one thread, nested by time; ``at(t)`` gives the stack, innermost first."""

    def __init__(self, events: list[dict]) -> None:
        evs = sorted(events, key=lambda e: (num(e.get("ts")), -num(e.get("dur"))))
        self.starts = [num(e.get("ts")) for e in evs]
        self.ends = [s + num(e.get("dur")) for s, e in zip(self.starts, evs, strict=True)]
        self.names = [str(e.get("name", "")) for e in evs]
        self.parent: list[int] = []
        open_: list[int] = []
        for i, s in enumerate(self.starts):
            while open_ and self.ends[open_[-1]] <= s:
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(i)

    def at(self, t: float) -> list[str]:
        # With proper nesting, the innermost frame holding t is an ancestor of the last one
        # that started before t.
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.ends[i] < t:
            i = self.parent[i]
        chain = []
        while i >= 0:
            chain.append(self.names[i])
            i = self.parent[i]
        return chain


def callee_name(frame: str) -> tuple[str, str]:
    """(display name, identifier searched in the source) of a non-user frame."""
    m = BUILTIN.match(frame)
    if m:
        name = m[1].rsplit(".", 1)[-1]
        return (f"Tensor.{name}" if m[2] in ("Tensor", "TensorBase") else m[1]), name
    m = FRAME.match(frame)
    return (frame, m["func"]) if m else (frame, "")


def _find_source(file: str, cache: dict[str, str | None]) -> str | None:
    if file not in cache:
        roots = ["", os.getcwd(), *sys.path] if not os.path.isabs(file) else [""]
        cache[file] = next((p for r in roots if os.path.isfile(p := os.path.join(r, file))), None)
    return cache[file]


def _block(lines: list[str], start: int) -> list[str]:
    """The statement at ``lines[start]`` with its indented body (a def, a with block...)."""
    rows, base, body = 0, None, False
    try:
        for tok in tokenize.generate_tokens(iter(lines[start:]).__next__):
            if tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
                continue
            col = len(tok.line) - len(tok.line.lstrip())
            if base is None:
                base = col
            elif tok.start[0] > rows and col <= base and body and tok.type != tokenize.ENDMARKER:
                break  # a sibling or outer statement begins
            if tok.type == tokenize.NEWLINE:
                rows, body = tok.end[0], not tok.line.lstrip().startswith("@") or body
            elif tok.type == tokenize.ENDMARKER:
                break
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return lines[start : start + max(rows, 1)]


def resolve_lines(frame: str, tokens: list[str], cache: dict) -> tuple[int, ...]:
    m = FRAME.match(frame)
    path = _find_source(m["file"], cache) if m else None
    if path is None:
        return ()
    if len(m["line"]) > 9:  # no file is that long (and int() refuses 4300 digits)
        return ()
    lines, first = linecache.getlines(path), int(m["line"])
    if not 0 < first <= len(lines):
        return ()
    block = _block(lines, first - 1)
    for tok in tokens:
        if not tok.isidentifier() or tok.startswith("__"):
            continue
        pat = re.compile(rf"\b{re.escape(tok)}\s*\(")
        hits = tuple(first + k for k, text in enumerate(block) if pat.search(text))
        if hits:
            return hits
    return ()
