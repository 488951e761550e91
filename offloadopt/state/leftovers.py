"""What a save killed part-way leaves beside its target, and the recovery from it.

A streamed save (streamed.py) writes a temporary folder ``.NAME.PID.XXXX.tmp`` beside its
target, moves the previous checkpoint aside as ``.NAME.PID.XXXX.old``, renames the new one into
place and removes the old one; the main job's file format writes ``.NAME.PID.tmp``
(:func:`temp_file`, harness/train_checkpoint.py) and renames it. The process id in each name
tells a killed save's leftovers from those of a save still running. Before writing, a save
removes a killed one's leftovers, or moves the previous checkpoint it left aside back
(:func:`recover_leftovers`); a load of a missing streamed checkpoint finds that previous one
(:func:`locate`). What the user put in a replaced checkpoint folder moves into the new one
(:func:`keep_foreign`).
"""

from __future__ import annotations

import contextlib
import os
import shutil

from offloadopt.state import integrity
from offloadopt.warn import warn

__all__ = ["INDEX", "keep_foreign", "temp_file", "recover_leftovers", "locate"]

INDEX = "index.pt"  # a streamed checkpoint's index (streamed.py): a folder holding it is one


def _ours(entry: str) -> bool:
    """Whether ``entry`` (a name in a checkpoint folder) is a file a save writes."""
    return entry == INDEX or (entry.startswith("part-") and entry.endswith(".pt"))


def keep_foreign(old: str, target: str) -> bool:
    """Moves what the user put in the replaced checkpoint folder ``old`` (anything a save
    does not write: notes, a config) into the new one at ``target`` (a new user's find: the
    next save deleted them). True where something could not be moved: ``old`` is then left
    beside ``target`` (under its hidden name), with a warning, and nothing is lost."""
    left = []
    for entry in os.listdir(old):
        if _ours(entry):
            continue
        dest = os.path.join(target, entry)
        try:
            if os.path.lexists(dest):
                raise FileExistsError(dest)
            os.replace(os.path.join(old, entry), dest)
        except OSError:
            left.append(entry)
    if left:
        warn(f"save_streamed: {left} in the replaced checkpoint could not be moved into the new "
             f"one; the replaced checkpoint is kept at {old!r}")  # fmt: skip
    return bool(left)


def temp_file(target: str) -> str:
    """The temporary file a file-format save to ``target`` writes before its rename
    (``.NAME.PID.tmp`` beside it): named so that :func:`recover_leftovers` finds it if the
    save is killed (harness/train_checkpoint.py)."""
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.{os.getpid()}.tmp")


def _leftovers(target: str) -> list[tuple[str, int, str]]:
    """``(path, pid, kind)`` of the temporary folders and files of earlier saves to
    ``target`` (``.NAME.PID.XXXX.tmp`` / ``.old`` beside it, :func:`temp_file`'s
    ``.NAME.PID.tmp``)."""
    parent, name = os.path.split(target)
    out = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return out
    for entry in entries:
        prefix = f".{name}."
        if not entry.startswith(prefix) or not entry.endswith((".tmp", ".old")):
            continue
        pid = entry[len(prefix) :].split(".", 1)[0]
        if pid.isdigit():
            out.append((os.path.join(parent, entry), int(pid), entry[-3:]))
    return out


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def recover_leftovers(target: str) -> None:
    """Leftovers of saves to ``target`` killed part-way (their process is gone): a ``.tmp``
    folder or file (the file format's) is removed; an ``.old`` one (killed between moving the
    previous checkpoint aside and moving the new one in) is moved back to ``target`` if
    ``target`` is missing, else removed, what the user put in it moved into ``target``."""
    for path, pid, kind in _leftovers(target):
        if _alive(pid):
            continue
        if kind == "old" and not os.path.exists(target):
            os.replace(path, target)
        elif not os.path.isdir(path):  # the file format's temporary file (train_checkpoint.py)
            with contextlib.suppress(OSError):
                os.unlink(path)
        elif kind == "tmp" or not keep_foreign(path, target):
            shutil.rmtree(path, ignore_errors=True)


def locate(path: str, who: str = "load_streamed") -> str:
    """The folder to read the checkpoint at ``path`` from: ``path`` itself, or, where it is
    missing because a save to it was killed between moving the previous checkpoint aside and
    moving the new one in, that previous checkpoint: moved back to ``path`` (as the next save
    would), or read where it lies when it cannot be moved (a read-only folder). Says so in a
    warning. Other leftovers are left to the next save.

    Raises:
        ValueError: ``path`` is not a folder, and no killed save left a checkpoint for it.
    """
    if os.path.isdir(path):
        return path
    target = os.path.realpath(path)
    kept = [(p, pid) for p, pid, kind in _leftovers(target) if kind == "old"]
    dead = [p for p, pid in kept if not _alive(pid) and os.path.isfile(os.path.join(p, INDEX))]
    if dead:
        try:
            os.replace(dead[0], target)
            integrity.fsync_dir(os.path.dirname(target))
            found, where = target, f"moved back to {path!r}"
        except OSError as e:
            found, where = dead[0], f"read where it lies: it could not be moved back ({e})"
        warn(f"{who}: {path!r} is missing: a save to it was killed after moving the previous "
             f"checkpoint aside, to {dead[0]!r}; that previous checkpoint is used ({where})")  # fmt: skip
        return found
    if kept:
        raise ValueError(
            f"{who}: {path!r} is missing: a save to it (process {kept[0][1]}, still running) "
            f"is between its renames; the checkpoint before it is {kept[0][0]!r}"
        )
    raise ValueError(f"{who}: {path!r} is not a folder (save_streamed writes one)")
