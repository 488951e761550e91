"""Streamed checkpoints: the optimizer's state (and optionally the model's) written and read in
parts of at most :data:`PART_NBYTES`, so that host memory never holds a second copy of the state.

``opt.state_dict()`` is a snapshot: every state tensor copied to the host, and under a
compressed representation the moments decoded to fp32 beside their codes, so that
``torch.optim.AdamW`` loads it (offloadopt/state/checkpoint.py). For a model near the machine's
limits that snapshot does not fit: at 25e9 params with int8 moments and fp32 masters the state
is 6 bytes per param on the host, the snapshot 14. A streamed checkpoint is a folder of
``torch.save`` files written from the live tensors themselves, in the stored representation
(int8 codes and scales, bf16-sr weights: no fp32 moments): a host tensor is written from its own
memory (a tensor aliasing exactly its bytes, so a view of an arena saves only its range), a
device tensor copied to the host with the rest of its part. The transient host memory is one
part on save and one part on load.

``torch.distributed.checkpoint`` was the first choice and is not used: its file writer keeps
every tensor it copied or cloned (a view of a larger buffer is cloned) until the file is done,
so a save held a second copy of the host arenas (tests/test_streamed.py measures the peak).

The folder: ``index.pt`` (format, version, representation, the groups as in ``state_dict()``,
every param's ``step``, each item's part, shape and dtype, each part's bytes and checksum, and
the caller's ``extra``) and ``part-00000.pt``, ...; items ``model/<name>``
(``model.state_dict()``, when a model is given) then ``optimizer/state/<param index>/<key>``
(the param index counts over the groups, as torch's). Every file is read with
``torch.load(weights_only=True)`` and ends with the xxh3-64 checksum of its bytes
(offloadopt/state/integrity.py); the index records each part's.

A save writes a temporary folder beside ``path`` and renames it into place: an interrupt
leaves the previous checkpoint or the new one; a save killed between its two renames leaves
the previous one under a hidden name, which the next load or save moves back (:func:`locate`;
what killed saves leave, and its recovery, is offloadopt/state/leftovers.py).
The load is offloadopt/state/streamed_load.py: it verifies everything, then applies.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from typing import Any

import torch

from offloadopt.interrupts import signals_deferred
from offloadopt.state import checkpoint, integrity
from offloadopt.state.integrity import fsync_save
from offloadopt.state.leftovers import INDEX as _INDEX
from offloadopt.state.leftovers import keep_foreign, locate, recover_leftovers, temp_file
from offloadopt.warn import warn

# ``opt`` below is a HybridOptimizer (offloadopt/optim.py, which calls this module: not
# imported here, the layers import downwards only)
HybridOptimizer = Any

__all__ = ["FORMAT", "VERSION", "PART_NBYTES", "save", "read_extra", "locate", "read_index"]
__all__ += ["recover_leftovers", "temp_file"]

FORMAT = "offloadopt-streamed-checkpoint"
VERSION = 2  # 2: checksums (every file's at its end, each part's in the index); 1 still loads
PART_NBYTES = 256 * 2**20  # bytes of tensors per part file (host memory in flight)
# the advice of every message on a damaged checkpoint folder (streamed_load.py's too)
_FIX = "; nothing was changed: restore the folder from a copy, or load an earlier checkpoint"
_STATE, _MODEL = "optimizer/state/", "model/"
_NUMPY_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
_said_unchecked: set[str] = set()  # checkpoints without checksums already named in a warning


def _own_bytes(t: torch.Tensor) -> torch.Tensor:
    """A host tensor whose storage is exactly ``t``'s bytes (same memory, no copy): torch.save
    of a view writes its whole storage (an arena's view would save the arena); a device tensor,
    or one numpy cannot alias, is copied to the host."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        return t.to("cpu", memory_format=torch.contiguous_format, copy=True)
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    try:
        alias = _NUMPY_VIEW.get(t.dtype)
        base = t.view(alias) if alias is not None else t
        out = torch.from_numpy(base.numpy())
        return out.view(t.dtype) if alias is not None else out
    except (TypeError, RuntimeError):
        return t.clone()


def save(
    opt: HybridOptimizer, path: str, model: torch.nn.Module | None = None, extra: Any = None
) -> int:
    """Write ``opt``'s state (and ``model``'s, and ``extra``) to the folder ``path``; returns
    the bytes written. See the module docstring.

    Raises:
        NotImplementedError: FSDP2 (DTensor) params (their state is sharded across ranks).
        ValueError: ``extra`` cannot be saved, or read back with
            ``torch.load(weights_only=True)`` (nothing was written).
        FileExistsError: ``path`` exists and is not a streamed checkpoint (left as it is).
        FileNotFoundError: the folder that would hold ``path`` does not exist (names both).
        RuntimeError: a step is in progress (as ``state_dict()``; a closed optimizer's state
            saves as it stands).
        OSError: the folder could not be written; a full disk names the space the checkpoint
            needs. An existing checkpoint at ``path`` is kept whole in every case.
    """
    from offloadopt.shards import is_dtensor

    if any(is_dtensor(p) for g in opt.param_groups for p in g["params"]):
        raise NotImplementedError(
            "save_streamed: FSDP2 (DTensor) params are sharded across ranks; use "
            "torch.distributed.checkpoint with opt.state_dict() there"
        )
    if extra is not None:  # a checkpoint whose extra cannot be read back must not replace one
        _check_extra(extra)
    target = os.path.realpath(path)  # a symlink's checkpoint goes where it points
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        link = f" (a link to {target!r})" if os.path.islink(path) else ""
        raise FileNotFoundError(
            f"save_streamed: the folder {parent!r} that would hold {path!r}{link} does not "
            "exist; create it first"
        )
    with integrity.folder_lock(parent):  # not amid another process's renames (its save)
        recover_leftovers(target)
        empty = os.path.isdir(target) and not os.listdir(target)  # an empty folder: taken
        if os.path.exists(target) and not (os.path.isfile(os.path.join(target, _INDEX)) or empty):
            raise FileExistsError(
                f"save_streamed: {path!r} exists and is not a streamed checkpoint; not replaced"
            )
    base = opt._snapshot_source()  # synchronized, checked: live tensors, torch's layout
    named: list[tuple[str, torch.Tensor]] = []
    if model is not None:
        named += [(f"{_MODEL}{n}", t) for n, t in model.state_dict().items()]
    steps: dict[int, float] = {}
    for index, entry in base["state"].items():
        for key, value in entry.items():
            if key == "step":
                steps[index] = float(value)
            elif isinstance(value, torch.Tensor):
                named.append((f"{_STATE}{index}/{key}", value))
    groups = checkpoint.drop_placement({"state": {}, "param_groups": base["param_groups"]})
    needed = sum(t.numel() * t.element_size() for _, t in named) + 512 * len(named) + 2**16
    # unique per save (the process id first: recover_leftovers tells a killed save's
    # leftovers by it)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}.{os.getpid()}.",
                           suffix=".tmp")  # fmt: skip
    # mkdtemp's folder is 0700: the checkpoint takes the mode of the folder it replaces, else
    # the umask's (a new user's find: every streamed checkpoint, and a folder the user made for
    # one, ended up readable by its owner only)
    os.chmod(tmp, _folder_mode(target))
    old = tmp[: -len(".tmp")] + ".old"
    sizes: list[int] = []  # each part file's bytes and checksum: a load checks them first
    sums: list[str] = []
    try:
        items: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        part: dict[str, torch.Tensor] = {}
        nbytes, parts = 0, 0

        def flush() -> None:
            nonlocal part, nbytes, parts
            if part:
                written = fsync_save(part, os.path.join(tmp, f"part-{parts:05d}.pt"))
                sizes.append(written.nbytes)
                sums.append(written.checksum)
                parts += 1
            part, nbytes = {}, 0

        for name, t in named:
            size = t.numel() * t.element_size()
            if part and nbytes + size > PART_NBYTES:
                flush()
            part[name] = _own_bytes(t)
            nbytes += size
            items[name] = (parts, tuple(t.shape), t.dtype)
        flush()
        index = {"format": FORMAT, "version": VERSION, "rule": opt.rule.name,
                 "moments": opt.rule.moments, "master_sr": opt.rule.master_sr,
                 "torch": str(torch.__version__), "param_groups": groups["param_groups"],
                 "steps": steps, "items": items, "part_nbytes": sizes,
                 "checksum": integrity.ALGORITHM, "part_checksums": sums, "extra": extra}  # fmt: skip
        fsync_save(index, os.path.join(tmp, _INDEX))
        integrity.fsync_dir(tmp)
        written = sum(e.stat().st_size for e in os.scandir(tmp))
        # the renames, their flush and the previous checkpoint's removal whole: a Ctrl-C
        # after the new one was in place left the previous one beside it for good, under its
        # hidden .old name (a new user's find); an interrupt is delivered after them
        with signals_deferred(), integrity.folder_lock(parent):  # another process's save too
            if os.path.exists(target):
                os.replace(target, old)
            os.replace(tmp, target)
            integrity.fsync_dir(parent)  # both renames on the disk before the old one goes
            if os.path.isdir(old) and not keep_foreign(old, target):
                shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        # a second Ctrl-C left the new one's parts behind (.tmp)
        with signals_deferred(), integrity.folder_lock(parent):
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.exists(old) and not os.path.exists(target):
                os.replace(old, target)  # put the previous checkpoint back
        if integrity.disk_full(e):
            kept = (f"the previous checkpoint at {path!r} is kept" if os.path.exists(target)
                    else "nothing was at that path before")  # fmt: skip
            raise integrity.full_disk_error("save_streamed", path, sum(sizes), needed, kept) from e
        raise
    return written


def _folder_mode(target: str) -> int:
    """The permission bits of the folder at ``target``, or the umask's for a new folder."""
    try:
        return os.stat(target).st_mode & 0o7777
    except OSError:
        return 0o777 & ~_umask()


def _umask() -> int:
    """The process's umask: from /proc where it says (no other thread sees a change), else
    set and set back (Python has no getter)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _check_extra(extra: Any) -> None:
    """Raises ValueError (naming the type and torch's reason) when ``extra`` cannot be saved
    by ``torch.save`` or read back by ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle's or torch's unpickler's reason, named
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"save_streamed: extra (a {type(extra).__name__}) cannot be saved and read back with "
            f"torch.load(weights_only=True) ({type(e).__name__}: {reason}); give numbers, "
            "strings, tensors, lists and dicts of them"
        ) from None


def read_index(path: str, who: str = "load_streamed") -> dict[str, Any]:
    """The index of the checkpoint folder ``path``, its checksum verified and its structure
    checked (``who`` names the caller in the messages). A checkpoint of an offloadopt before
    checksums (version 1) loads unverified, with one warning per folder.

    Raises:
        ValueError: ``path`` is no streamed checkpoint of offloadopt, or its index is damaged
            (names the file and what is wrong, and what to do).
    """
    file = os.path.join(path, _INDEX)
    what = f"{who}: {file!r}"
    if os.path.lexists(file) and not os.path.isfile(file):  # it read "has no index.pt"
        raise ValueError(f"{what} is no regular file (a folder, a link to a device or a missing "
                         f"file): the checkpoint is damaged{_FIX}")  # fmt: skip
    if not os.path.isfile(file):
        raise ValueError(f"{who}: {path!r} has no {_INDEX}: not a streamed checkpoint")
    try:
        verified = integrity.verify(file, what, required=False)
    except integrity.Damaged as e:
        raise ValueError(f"{e}{_FIX}") from None
    except OSError as e:
        raise ValueError(f"{what} could not be read ({e.strerror or e})") from None
    try:
        index = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of a damaged file
        # its kind only: torch's text is a paragraph on miniz (quoted, it was cut mid-word)
        kind = f"{type(e).__name__}: {e.strerror}" if isinstance(e, OSError) and e.strerror else (
            type(e).__name__)  # fmt: skip
        if verified:  # its bytes are those saved: no damage, another torch's file?
            raise ValueError(f"{what}: torch.load cannot read it ({kind}), though its bytes "
                             "match its checksum (saved by a newer torch?); nothing was changed"
                             ) from None  # fmt: skip
        raise ValueError(f"{what} is damaged (cut short or overwritten): torch.load cannot read "
                         f"it ({kind}){_FIX}") from None  # fmt: skip
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{who}: {path!r} is not a streamed checkpoint of offloadopt")
    version = index.get("version")
    if version not in (1, VERSION):
        raise ValueError(f"{who}: {path!r} has version {version!r}; this offloadopt reads 1 "
                         f"and {VERSION}")  # fmt: skip
    if version >= 2 and not verified:
        raise ValueError(f"{what} is damaged: a version {version} index carries a checksum at "
                         f"its end, and this one has none (cut short or overwritten there){_FIX}")  # fmt: skip
    problem = _index_problem(index)
    if problem:
        raise ValueError(f"{what} is damaged: {problem}{_FIX}")
    if version < 2 and os.path.realpath(path) not in _said_unchecked:
        _said_unchecked.add(os.path.realpath(path))
        warn(f"{who}: {path!r} was saved by an offloadopt before checksums (version 1): its "
             "bytes cannot be verified; it loads as before. Save it again to add them")  # fmt: skip
    return index


def _index_problem(index: dict) -> str | None:
    """What is wrong with the structure of a loaded index, or None."""
    items, sizes = index.get("items"), index.get("part_nbytes")
    if not isinstance(items, dict):
        return f"its 'items' is a {type(items).__name__}, not a dict"
    parts = set()
    for name, item in items.items():
        ok = (isinstance(name, str) and isinstance(item, (tuple, list)) and len(item) == 3
              and isinstance(item[0], int) and item[0] >= 0 and isinstance(item[2], torch.dtype)
              and isinstance(item[1], (tuple, list))
              and all(isinstance(d, int) and d >= 0 for d in item[1]))  # fmt: skip
        if not ok:
            return f"item {name!r} is {item!r}, not (part, shape, dtype)"
        if name.startswith(_STATE) and not name[len(_STATE) :].split("/", 1)[0].isdigit():
            return f"item {name!r} names no param index"
        parts.add(item[0])
    if sizes is not None:  # absent in checkpoints saved before it was recorded
        if not isinstance(sizes, list) or not all(isinstance(s, int) for s in sizes):
            return f"its 'part_nbytes' is {sizes!r}, not a list of byte counts"
        if parts and max(parts) >= len(sizes):
            return f"its items name part {max(parts)}, and it records {len(sizes)} parts"
    if index["version"] >= 2:
        sums = index.get("part_checksums")
        if not isinstance(sums, list) or sizes is None or len(sums) != len(sizes):
            return "its part checksums do not match its parts"
    steps = index.get("steps")
    if not isinstance(steps, dict) or not all(
        isinstance(k, int) and isinstance(v, (int, float)) for k, v in steps.items()
    ):
        return "its 'steps' is not a dict of param index -> step"
    if not isinstance(index.get("param_groups"), list):
        return "its 'param_groups' is not a list"
    return None


def read_extra(path: str) -> Any:
    """The ``extra`` object saved with the checkpoint at ``path`` (None if none); the index's
    checksum is verified, and a checkpoint a killed save left aside is found (:func:`locate`).

    Raises:
        ValueError: ``path`` is no streamed checkpoint of offloadopt, or its index is damaged."""
    return read_index(locate(path, "read_extra"), "read_extra")["extra"]
