"""Checks of the commands' input, all run before a model is built or a file written.

Each value check (``positive_int``, ``fraction``, ``device``, ``out_dir``...) takes the text of
a command-line value or a config's value, returns it converted, and raises :class:`UsageError`
with a message that shows the value and what is allowed. They serve as argparse ``type=``
functions (argparse then prints ``offloadopt: error: --steps: 0 is not an integer >= 1``) and,
through :func:`check`, as the checks of the configs Python callers build. Checks that need
several values or the file system (the data file against ``--seq-len``) raise it too; the CLI
prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from offloadopt.harness.data import TokenData

# Nothing here imports torch at import time: the commands' parsers use these checks, and
# ``offloadopt --help`` must not wait for torch.

__all__ = ["UsageError", "check", "positive_int", "nonneg_int", "seed", "fraction"]
__all__ += ["nonneg_float", "device", "input_file", "out_dir", "output_file", "text_data"]
__all__ += ["preset", "chrome_trace_file", "json_output_file", "write_atomic"]
__all__ += ["CHECKPOINT_FORMAT", "begins_as_train_checkpoint"]

INT_MAX = 2**63 - 1  # torch's int64: a larger count or seed fits neither tensors nor generators
# the "format" of a --save file (train_checkpoint.py)
CHECKPOINT_FORMAT = "offloadopt-train-checkpoint"


def begins_as_train_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` begins as a ``--save`` file does, readable or not: a zip of
    ``torch.save`` whose first record (``data.pkl``, stored uncompressed) names
    :data:`CHECKPOINT_FORMAT` in its first bytes. True of one cut short or partly overwritten
    too, which torch.load cannot read (a user's find: that was called "not a checkpoint")."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") and CHECKPOINT_FORMAT.encode() in head


T = TypeVar("T")


class UsageError(argparse.ArgumentTypeError, ValueError):
    """Bad input: a value out of range, a data file too short, a path that cannot be written.

    An ``ArgumentTypeError`` so that argparse prints its message as it is (it prints a generic
    one for a plain ``ValueError``), and a ``ValueError`` for Python callers.
    """


class RunStopped(RuntimeError):
    """The main job stopped itself: a NaN or infinite loss, or weights that are no longer
    finite before a checkpoint (``offloadopt train`` without ``--no-stop-on-nonfinite``). The
    message is one line: the step, what was found, and where the run can go on from."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "..."


def check(flag: str, value: Any, validate: Callable[[Any], T]) -> T:
    """``validate(value)``, its ``UsageError`` prefixed by ``flag`` (``"--steps: ..."``)."""
    try:
        return validate(value)
    except UsageError as e:
        raise UsageError(f"{flag}: {e}") from None


def _int(value: Any, lo: int) -> int:
    allowed = f"an integer >= {lo}"
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:  # "1.5", "nan", "" and also more than 4300 digits
            raise UsageError(f"{_shown(value)} is not {allowed}") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{_shown(value)} is not {allowed}")
    if value < lo:
        raise UsageError(f"{_shown(value)} is not {allowed}")
    if value > INT_MAX:
        raise UsageError(f"{_shown(value)} is too large (at most 2**63 - 1)")
    return value


def _float(value: Any, allowed: str, ok: Callable[[float], bool]) -> float:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"{_shown(value)} is not a number") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond a float's range
            number = math.copysign(math.inf, value)
    else:
        raise UsageError(f"{_shown(value)} is not a number")
    if not ok(number):
        raise UsageError(f"{number!r} is not {allowed}")
    return number


def positive_int(value: Any) -> int:
    """An integer in [1, 2**63 - 1]: steps, batch size, sequence length."""
    return _int(value, 1)


# micro-batches a step: 65,536 x one sequence of 1,024 tokens is 67M tokens a step, beyond any
# batch in use; a larger count is a typo that would build the model and run without end
MAX_EVAL_BATCHES = 2**16  # --eval-batches: the same bound as --grad-accum
MAX_GRAD_ACCUM = 2**16


def grad_accum(value: Any) -> int:
    """Micro-batches per optimizer step: an integer in [1, 65,536]."""
    n = _int(value, 1)
    if n > MAX_GRAD_ACCUM:
        raise UsageError(
            f"{_shown(value)} is too large (at most {MAX_GRAD_ACCUM:,} micro-batches a step)"
        )
    return n


def eval_batches(value: Any) -> int:
    """Batches per held-out evaluation: an integer in [1, 65,536] (10**11 was taken, and the
    first evaluation never ended)."""
    n = _int(value, 1)
    if n > MAX_EVAL_BATCHES:
        raise UsageError(
            f"{_shown(value)} is too large (at most {MAX_EVAL_BATCHES:,} batches an evaluation)"
        )
    return n


MAX_MEASURED_STEPS = 2**16  # --measure-fwd-bwd: steps timed before training


def measured_steps(value: Any) -> int:
    """Steps of forward+backward timed before training: an integer in [0, 65,536] (a new
    user's find: 2**63 - 1 was taken, and the run never reached its first step)."""
    n = _int(value, 0)
    if n > MAX_MEASURED_STEPS:
        raise UsageError(f"{_shown(value)} is too large (at most {MAX_MEASURED_STEPS:,} steps)")
    return n


def nonneg_int(value: Any) -> int:
    """An integer in [0, 2**63 - 1]: warm-up steps, ``min_offload_numel``."""
    return _int(value, 0)


def seed(value: Any) -> int:
    """A seed in [0, 2**63 - 1]; the harness adds small offsets and torch takes < 2**64."""
    return _int(value, 0)


def fraction(value: Any) -> float:
    """A number in [0, 1]: an offload fraction."""
    return _float(value, "in [0, 1]", lambda x: 0.0 <= x <= 1.0)


def fraction_or_auto(value: Any) -> float | str:
    """An offload fraction, or ``auto`` (HybridAdamW measures the first steps and chooses)."""
    if value == "auto":
        return "auto"
    try:
        return fraction(value)
    except UsageError as e:
        raise UsageError(f"{e} (a number in [0, 1], or auto)") from None


def size(value: Any) -> int:
    """A byte size: a number of bytes, or a string like ``120GB`` or ``112GiB``."""
    from offloadopt.place.costmodel import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as e:
        raise UsageError(str(e)) from None


def nonneg_float(value: Any) -> float:
    """A finite number >= 0: learning rate, weight decay, grad-clip norm (0 turns it off)."""
    return _float(value, "a finite number >= 0", lambda x: 0.0 <= x < math.inf)


def preset(value: Any) -> str:
    """A model preset (``models.MODEL_PRESETS``) whose package is importable here."""
    from offloadopt.harness import models

    if value not in models.MODEL_PRESETS:
        raise UsageError(f"{_shown(value)} is not one of {', '.join(models.MODEL_PRESETS)}")
    if missing := models.missing_package(value):
        raise UsageError(f"{value!r} needs {missing} (pip install {missing})")
    return value


def device(value: Any) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` with a device N that torch sees here, as a string.

    ``torch.device`` parses the text; any other type (``meta``, ``mps``...), a text it does
    not parse (``CUDA``) or a CUDA device this machine lacks is a ``UsageError``.
    """
    import torch

    allowed = "cpu, cuda or cuda:N"
    text = str(value) if isinstance(value, torch.device) else value
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        hint = ""
        if isinstance(text, str) and text.strip().lower() != text:
            with contextlib.suppress(RuntimeError, TypeError, ValueError):
                hint = f"; did you mean {str(torch.device(text.strip().lower()))!r}?"
        raise UsageError(f"{_shown(value)} is not a device ({allowed}){hint}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise UsageError(f"{_shown(value)} is not a device ({allowed})")
    if dev.type == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise UsageError(f"{str(dev)!r}: torch sees no CUDA device here (try --device cpu)")
        if dev.index is not None and dev.index >= n:
            raise UsageError(f"{str(dev)!r}: torch sees {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return str(dev)


def _path(value: Any) -> Path:
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text or "\x00" in text:  # the OS takes no NUL byte
        raise UsageError(f"{_shown(value)} is not a path")
    return Path(value)


def _writable_folder(folder: Path, what: str) -> None:
    """``folder`` must be an existing folder this process may create files in."""
    if not folder.is_dir():
        raise UsageError(f"{what}: {str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: cannot write in {str(folder)!r} ({_why_not_writable(folder)})")
    try:  # what access() cannot tell: /proc, a read-only mount, root's permission bypass
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        why = _why_not_writable(folder, e.strerror or str(e))
        raise UsageError(f"{what}: cannot write in {str(folder)!r} ({why})") from None


def _why_not_writable(folder: Path, error: str = "permission denied") -> str:
    """Why no file can be made in ``folder`` (``error``: what the OS said): a read-only mount
    (a new user's find: it read "permission denied"), a pseudo file system with no storage (a
    user's find: ``--save /proc/version`` as root read "No such file or directory"), or
    ``error``."""
    with contextlib.suppress(OSError, AttributeError):
        fs = os.statvfs(folder)
        if fs.f_flag & os.ST_RDONLY:
            return "read-only file system"
        if fs.f_blocks == 0:  # proc, sysfs: the kernel's files, shown and never stored
            return ("a pseudo file system, as /proc and /sys: it shows the kernel's files and "
                    "stores none")  # fmt: skip
    return error


def out_dir(value: Any) -> str:
    """A folder to write results in: an existing writable folder, or a path that can be made
    one (its nearest existing ancestor is a writable folder). Nothing is created here."""
    path = _path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{str(path)!r} exists and is not a folder")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    _writable_folder(ancestor, repr(str(path)))
    return str(path)


def input_file(value: Any) -> str:
    """A file to read: it exists and is a regular file, not a folder, a device or a pipe (its
    content is checked by its reader)."""
    path = _path(value)
    if not path.exists():
        raise UsageError(f"{str(path)!r}: no such file")
    if path.is_dir():
        raise UsageError(f"{str(path)!r} is a folder, not a file")
    if not path.is_file():  # /dev/zero was read until the OOM killer came; a pipe would hang
        raise UsageError(f"{str(path)!r} is no regular file (a device, a pipe or a socket): "
                         "give a file")  # fmt: skip
    if not os.access(path, os.R_OK):
        raise UsageError(f"{str(path)!r}: cannot read it (permission denied)")
    return str(path)


def output_file(value: Any) -> str:
    """A file to write at the end: not a folder, in an existing folder that is writable; where
    something is there already (a symlink's target counts), a regular file. A new user's find:
    ``train --save`` and ``audit --json`` onto ``/dev/null``, a pipe or a link to one replaced
    the node with a regular file (``/dev/null`` itself, as root) and exited 0."""
    path = _path(value)
    if path.is_dir():
        raise UsageError(f"{str(path)!r} is a folder, not a file name")
    if not path.parent.exists():
        raise UsageError(f"{str(path)!r}: no folder {str(path.parent)!r}")
    if path.exists() and not path.is_file():
        raise UsageError(f"{str(path)!r} is no regular file (a device, a pipe or a socket), and "
                         "a write would replace it: give a file name")  # fmt: skip
    _writable_folder(_written_folder(path), repr(str(path)))
    return str(path)


def _written_folder(path: Path) -> Path:
    """The folder a write to ``path`` creates its file in: a symlink's target's (the writes
    replace the target and keep the link). A link whose target's folder is missing is refused
    here, before anything is built (a new user's find: ``--save`` through a dangling link
    trained the whole run, then failed to save it)."""
    if not path.is_symlink():
        return path.parent
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise UsageError(f"{str(path)!r} is a link to {str(target)!r}, whose folder "
                         f"{str(target.parent)!r} does not exist")  # fmt: skip
    return target.parent


def _replaces_only(path: str, looks_like: Callable[[bytes], bool], what: str) -> str:
    """``path`` (an :func:`output_file`) if nothing is there or what is there ``looks_like``
    (its first bytes) a file of this kind, which the write then replaces; else UsageError (a
    new user's find: ``audit --json ck.pt`` replaced a checkpoint with JSON, status 0)."""
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError as e:
            raise UsageError(f"{path!r}: cannot read what is there ({e.strerror})") from None
        if head and not looks_like(head):
            raise UsageError(f"{path!r}: a file that is not {what} is there, and the write "
                             "would replace it; give another name, or move it away")  # fmt: skip
    return path


def json_output_file(value: Any) -> str:
    """An :func:`output_file` for a JSON report: an existing file there must be JSON too."""
    return _replaces_only(output_file(value), lambda b: b.lstrip()[:1] in (b"{", b"["),
                          "a JSON report")  # fmt: skip


def checkpoint_path(value: Any) -> str:
    """Where ``--save`` writes: a file name (:func:`output_file`), an existing streamed
    checkpoint folder (one with an ``index.pt``, which the next save replaces whole), or an
    empty folder (a streamed checkpoint goes there: ``save_streamed`` takes one; the file
    format refuses it in ``TrainConfig``'s checks, which know the format)."""
    path = _path(value)
    if path.is_dir() and ((path / "index.pt").is_file() or not any(path.iterdir())):
        _writable_folder(path.parent, repr(str(path)))
        return str(path)
    if path.is_dir():  # "is a folder, not a file name" misled where a folder was meant
        raise UsageError(f"{str(path)!r} is a folder that holds files but no streamed checkpoint "
                         "(no index.pt): give a file name, or a new or empty folder for "
                         "--checkpoint-format streamed")  # fmt: skip
    return output_file(value)


def checkpoint_input(value: Any) -> str:
    """A checkpoint to read: a file (:func:`input_file`), or a streamed checkpoint folder; or
    a missing folder that a save killed between its renames left aside (``.NAME.PID.*.old``
    with an ``index.pt`` beside it: the load moves it back, offloadopt/state/streamed.py)."""
    path = _path(value)
    if not path.exists() and path.parent.is_dir():
        real = Path(os.path.realpath(path))
        with contextlib.suppress(OSError):
            for entry in os.listdir(real.parent):
                if (entry.startswith(f".{real.name}.") and entry.endswith(".old")
                        and (real.parent / entry / "index.pt").is_file()):  # fmt: skip
                    return str(path)
    if path.is_dir():
        index = path / "index.pt"
        if os.path.lexists(index) and not index.is_file():  # a user's find: it read "no index.pt"
            raise UsageError(f"{str(path)!r}: its index.pt is no regular file (a link to a "
                             "device, a folder or a missing file): the checkpoint is damaged; "
                             "nothing was changed: restore the folder from a copy, or load an "
                             "earlier checkpoint")  # fmt: skip
        if not index.is_file():
            raise UsageError(f"{str(path)!r} is a folder but no streamed checkpoint (no index.pt)")
        return str(path)
    return input_file(value)


def chrome_trace_file(value: Any) -> str:
    """An :func:`output_file` for a Chrome trace (JSON, ``export_chrome_trace``): its name ends
    in ``.json``, or ``.json.gz`` (torch compresses by the name)."""
    path = output_file(value)
    if not path.endswith((".json", ".json.gz")):
        raise UsageError(f"{path!r} is not a .json or .json.gz file name (a Chrome trace is JSON)")
    gz = path.endswith(".gz")
    return _replaces_only(path, lambda b: b[:2] == b"\x1f\x8b" if gz else b.lstrip()[:1] == b"{",
                          "a Chrome trace")  # fmt: skip


def text_data(path: str | None, seq_len: int) -> TokenData:
    """``load_text(path)``, checked to hold a training and a held-out window of ``seq_len + 1``
    tokens, so that a short file fails here and not at the first evaluation.

    Raises ``UsageError`` naming ``--data``: a missing, unreadable or empty file, or one too
    short for ``seq_len`` (the message gives the size needed).
    """
    from offloadopt.harness.data import load_text, min_text_bytes

    name = "--data: " + ("pydoc_data.topics" if path is None else repr(str(path)))
    try:
        data = load_text(path)
    except OSError as e:
        raise UsageError(f"{name}: {e.strerror or e}") from None
    except ValueError as e:  # empty, or too short to split; the message names the file
        raise UsageError(f"--data: {e}") from None
    need = seq_len + 1
    for split, part in (("train", "training"), ("heldout", "held-out")):
        have = len(getattr(data, split))
        if have < need:
            raise UsageError(
                f"{name}: {len(data.train) + len(data.heldout):,} bytes give a {part} split of "
                f"{have} tokens, fewer than --seq-len + 1 = {need} (use at least "
                f"{min_text_bytes(need):,} bytes of text, or a smaller --seq-len)"
            )
    return data


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and one rename, so that
    no reader (nor a run cut short) ever finds half a file there. A symlink stays: the file
    it points to is the one replaced."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
