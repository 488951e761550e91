"""Warnings that point at the user's line: the first frame outside offloadopt and torch.

A fixed ``stacklevel`` breaks as soon as the path to the warning changes (``step()`` under
torch's ``no_grad`` wrapper and its profiling hook, a grad hook, a bucket fed from backward):
the warning then names a line inside torch. :func:`warn` walks the stack instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["WarnOnce", "warn"]

_INSIDE = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], torch)
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost caller outside
    offloadopt and torch (the script's ``opt.step()`` line, say)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class WarnOnce:
    """One :func:`warn` per key for one optimizer; its owners share it (it holds no reference
    to the optimizer, so handing it to them makes no reference cycle)."""

    def __init__(self):
        self.warned: set[str] = set()

    def __call__(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warn(message)
