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
every param's ``step``, each item's part, shape and dtype, and the caller's ``extra``) and
``part-00000.pt``, ...; items ``model/<name>`` (``model.state_dict()``, when a model is given)
then ``optimizer/state/<param index>/<key>`` (the param index counts over the groups, as
torch's). Every file is read with ``torch.load(weights_only=True)``.

A load validates the whole checkpoint against the optimizer first (the same checks as
``load_state_dict``, on the shapes and dtypes of the index): a checkpoint that does not fit
raises ``ValueError`` and changes nothing. A save writes a temporary folder beside ``path`` and
renames it into place: an interrupt leaves the previous checkpoint or the new one.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from typing import Any

import torch

from offloadopt.state import checkpoint

# ``opt`` below is a HybridOptimizer (offloadopt/optim.py, which calls this module: not
# imported here, the layers import downwards only)
HybridOptimizer = Any

__all__ = ["FORMAT", "VERSION", "PART_NBYTES", "save", "load", "read_extra"]

FORMAT = "offloadopt-streamed-checkpoint"
VERSION = 1
PART_NBYTES = 256 * 2**20  # bytes of tensors per part file (host memory in flight)
_INDEX = "index.pt"
_STATE, _MODEL = "optimizer/state/", "model/"
_NUMPY_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


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


def fsync_save(obj: Any, path: str) -> int:
    """``torch.save(obj)`` to ``path``, flushed to the disk; returns the file's bytes.

    Raises:
        KeyboardInterrupt: Ctrl-C during the write (torch's zip writer reports one that
            lands while it writes as a RuntimeError; the interrupt is what the caller sees)."""
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            if isinstance(e.__context__, KeyboardInterrupt):
                raise e.__context__ from None
            raise
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def save(
    opt: HybridOptimizer, path: str, model: torch.nn.Module | None = None, extra: Any = None
) -> int:
    """Write ``opt``'s state (and ``model``'s, and ``extra``) to the folder ``path``; returns
    the bytes written. See the module docstring.

    Raises:
        NotImplementedError: FSDP2 (DTensor) params (their state is sharded across ranks).
        FileExistsError: ``path`` exists and is not a streamed checkpoint (left as it is).
        RuntimeError: a step is in progress (as ``state_dict()``; a closed optimizer's state
            saves as it stands).
        OSError: the folder could not be written; an existing checkpoint at ``path`` is kept.
    """
    from offloadopt.shards import is_dtensor

    if any(is_dtensor(p) for g in opt.param_groups for p in g["params"]):
        raise NotImplementedError(
            "save_streamed: FSDP2 (DTensor) params are sharded across ranks; use "
            "torch.distributed.checkpoint with opt.state_dict() there"
        )
    if extra is not None:  # a checkpoint whose extra cannot be read back must not replace one
        buf = io.BytesIO()
        torch.save(extra, buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's unpickler names what it refused
            raise ValueError(
                f"save_streamed: extra cannot be read back with torch.load(weights_only=True) "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give "
                "numbers, strings, tensors, lists and dicts of them"
            ) from None
    target = os.path.realpath(path)  # a symlink's checkpoint goes where it points
    _recover(target)
    if (
        os.path.exists(target)
        and not os.path.isfile(os.path.join(target, _INDEX))
        and not (os.path.isdir(target) and not os.listdir(target))  # an empty folder: taken
    ):
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
    parent = os.path.dirname(target)
    # unique per save (the process id first: _recover tells a killed save's leftovers by it)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}.{os.getpid()}.",
                           suffix=".tmp")  # fmt: skip
    old = tmp[: -len(".tmp")] + ".old"
    try:
        items: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        part: dict[str, torch.Tensor] = {}
        nbytes, parts = 0, 0
        sizes: list[int] = []  # each part file's bytes: a load checks them first

        def flush() -> None:
            nonlocal part, nbytes, parts
            if part:
                sizes.append(fsync_save(part, os.path.join(tmp, f"part-{parts:05d}.pt")))
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
                 "steps": steps, "items": items, "part_nbytes": sizes, "extra": extra}  # fmt: skip
        fsync_save(index, os.path.join(tmp, _INDEX))
        written = sum(e.stat().st_size for e in os.scandir(tmp))
        if os.path.exists(target):
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(target):
            os.replace(old, target)  # put the previous checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return written


def _leftovers(target: str) -> list[tuple[str, int, str]]:
    """``(path, pid, kind)`` of the temporary folders of earlier saves to ``target``
    (``.NAME.PID.XXXX.tmp`` / ``.old`` beside it)."""
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


def _recover(target: str) -> None:
    """Leftovers of saves to ``target`` killed part-way (their process is gone): a ``.tmp``
    folder is removed; an ``.old`` one (killed between moving the previous checkpoint aside
    and moving the new one in) is moved back to ``target`` if ``target`` is missing, else
    removed."""
    for path, pid, kind in _leftovers(target):
        if _alive(pid):
            continue
        if kind == "old" and not os.path.exists(target):
            os.replace(path, target)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _index(path: str, who: str = "load_streamed") -> dict[str, Any]:
    """The checkpoint's index; ``who`` names the caller in the messages.

    Raises:
        ValueError: ``path`` is no streamed checkpoint of offloadopt (names it).
    """
    if not os.path.isdir(path):
        kept = [p for p, _, kind in _leftovers(os.path.realpath(path)) if kind == "old"]
        if kept:
            raise ValueError(
                f"{who}: {path!r} is missing, and a save to it was interrupted: the "
                f"checkpoint before it is {kept[0]!r} (the next save_streamed to {path!r} "
                "moves it back, or rename it yourself)"
            )
        raise ValueError(f"{who}: {path!r} is not a folder (save_streamed writes one)")
    file = os.path.join(path, _INDEX)
    if not os.path.isfile(file):
        raise ValueError(f"{who}: {path!r} has no {_INDEX}: not a streamed checkpoint")
    try:
        index = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of a damaged file
        raise ValueError(f"{who}: {file!r} could not be read ({type(e).__name__}: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{who}: {path!r} is not a streamed checkpoint of offloadopt")
    if index.get("version") != VERSION:
        raise ValueError(f"{who}: {path!r} has version {index.get('version')!r}; this "
                         f"offloadopt reads {VERSION}")  # fmt: skip
    return index


def read_extra(path: str) -> Any:
    """The ``extra`` object saved with the checkpoint at ``path`` (None if none).

    Raises:
        ValueError: ``path`` is no streamed checkpoint of offloadopt."""
    return _index(path, "read_extra")["extra"]


class _Parts:
    """The part files of one checkpoint, read one at a time (the last one kept)."""

    def __init__(self, path: str, items: dict):
        self.path, self.items, self.number, self.tensors = path, items, -1, {}

    def get(self, number: int, name: str) -> torch.Tensor:
        """Item ``name`` of part ``number``, checked against the index.

        Raises:
            ValueError: the part is unreadable, or holds another shape or dtype than the index
                says (a damaged or mixed-up file)."""
        file = os.path.join(self.path, f"part-{number:05d}.pt")
        if number != self.number:
            self.tensors = {}  # drop the last part before reading the next
            try:
                self.tensors = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - a truncated zip, a missing file
                raise ValueError(f"load_streamed: {file!r} could not be read "
                                 f"({type(e).__name__})") from None  # fmt: skip
            self.number = number
        t = self.tensors.get(name) if isinstance(self.tensors, dict) else None
        _, shape, dtype = self.items[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"load_streamed: {file!r} holds no {dtype} {tuple(shape)} tensor "
                             f"{name!r}, which the index names (a damaged or mixed-up file)")  # fmt: skip
        return t


def load(opt: HybridOptimizer, path: str, model: torch.nn.Module | None = None) -> Any:
    """Read the checkpoint folder ``path`` into ``opt`` (and ``model``'s tensors, in place);
    returns the ``extra`` object saved with it (None if none). The whole checkpoint is checked
    first; then the model's tensors are copied in, then the optimizer's entries, each as
    ``load_state_dict`` copies an entry (so a checkpoint of another representation loads as
    one of ``state_dict()`` would), one part file in memory at a time.

    Raises:
        ValueError: ``path`` is no streamed checkpoint, or does not fit ``opt`` or ``model``
            (names what); nothing was changed.
        RuntimeError: as ``load_state_dict``; a read failing part-way leaves the optimizer
            refusing ``step()`` until a load succeeds.
    """
    opt._prepare_load()  # as load_state_dict: placed, not mid-step, nothing in flight
    index = _index(path)
    if index.get("rule") != opt.rule.name:
        raise ValueError(f"load_streamed: {path!r} holds the state of Hybrid{index.get('rule')}, "
                         f"not Hybrid{opt.rule.name}")  # fmt: skip
    items: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = index["items"]
    state: dict[int, dict] = {int(i): {"step": torch.tensor(v)} for i, v in index["steps"].items()}
    for name, (_, shape, dtype) in items.items():
        if name.startswith(_STATE):
            i, key = name[len(_STATE) :].split("/", 1)
            # only the shape and dtype, for the validation: no memory behind it
            state.setdefault(int(i), {})[key] = torch.zeros((), dtype=dtype).expand(shape)
    sd = {"state": state, "param_groups": index["param_groups"]}
    targets: dict[str, torch.Tensor] = {}
    if model is not None:
        mine = model.state_dict()
        saved = {n[len(_MODEL) :] for n in items if n.startswith(_MODEL)}
        if saved != set(mine):
            missing, unexpected = sorted(set(mine) - saved), sorted(saved - set(mine))
            raise ValueError(f"load_streamed: the model's tensors differ from the checkpoint's: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")  # fmt: skip
        for name, t in mine.items():
            _, shape, dtype = items[_MODEL + name]
            if tuple(shape) != tuple(t.shape) or dtype != t.dtype:
                raise ValueError(f"load_streamed: model tensor {name!r} is {t.dtype} "
                                 f"{tuple(t.shape)} here, {dtype} {tuple(shape)} in the "
                                 "checkpoint")  # fmt: skip
            targets[_MODEL + name] = t
    have = {}  # part number -> its file's bytes, None when missing
    for n in sorted({number for number, _, _ in items.values()}):
        file = os.path.join(path, f"part-{n:05d}.pt")
        have[n] = os.path.getsize(file) if os.path.isfile(file) else None
    missing = [n for n, size in have.items() if size is None]
    if missing:
        raise ValueError(f"load_streamed: {path!r} lacks part files {missing[:5]} that its index "
                         "names: an incomplete copy")  # fmt: skip
    sizes = index.get("part_nbytes")  # absent in checkpoints saved before it was recorded
    if sizes is not None:
        wrong = [(n, size, sizes[n]) for n, size in have.items()
                 if n < len(sizes) and size != sizes[n]]  # fmt: skip
        if wrong:
            n, have, want = wrong[0]
            raise ValueError(f"load_streamed: part-{n:05d}.pt of {path!r} has {have} bytes, "
                             f"{want} when saved: a truncated or damaged copy"
                             + (f" ({len(wrong)} parts differ)" if len(wrong) > 1 else ""))  # fmt: skip
    parts = _Parts(path, items)

    def read_model() -> None:
        with torch.no_grad():
            for name in sorted(targets, key=lambda n: items[n][0]):  # part by part
                targets[name].copy_(parts.get(items[name][0], name))

    def real_entry(i: int, validated: dict) -> dict:
        real = dict(validated)
        for key in validated:
            name = f"{_STATE}{i}/{key}"
            if name in items:
                real[key] = parts.get(items[name][0], name)
        return real

    opt._load_validated(sd, before=read_model, real_entry=real_entry)
    return index["extra"]
