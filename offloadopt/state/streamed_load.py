"""Loading a streamed checkpoint (offloadopt/state/streamed.py): verify everything, then apply.

A load reads the data twice, one part at a time, because nothing may change before all of it
is known to be good and the data may not fit in memory:

1. Check: the index (its checksum and structure), the optimizer's groups and the shapes and
   dtypes of every entry against the optimizer (``load_state_dict``'s checks), the model's
   tensors against the model; then every part file: present, of the recorded size, its bytes
   matching the checksum the index recorded, and holding each item the index names with its
   shape and dtype (read through a memory map: no copy). A failure here is a ``ValueError``
   and nothing was changed.
2. Apply: each part is memory-mapped, its checksum computed again (the bytes applied are the
   bytes verified), and its tensors copied into the model and the optimizer's buffers. A
   failure here (a file changed or removed since step 1, a read error) is a ``RuntimeError``
   that says what was loaded; the optimizer then refuses ``step()`` and ``state_dict()`` until
   a load succeeds.

Step 2 reads from the page cache when the checkpoint fits in it, else from the disk again.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from offloadopt.state import integrity
from offloadopt.state.leftovers import locate
from offloadopt.state.streamed import _FIX, _MODEL, _STATE, read_index

HybridOptimizer = Any  # offloadopt/optim.py's (not imported: the layers import downwards)

__all__ = ["load", "verify"]

_PARTLY = (
    "the load stopped part-way after the whole checkpoint was verified: the model's tensors "
    "and the optimizer's state may hold some of its values and the rest of the old ones, and "
    "the optimizer refuses step() and state_dict() until a load succeeds; load this "
    "checkpoint (once the file is back) or another one"
)


def _part_file(path: str, number: int) -> str:
    return os.path.join(path, f"part-{number:05d}.pt")


def _read_part(file: str) -> Any:
    """The part's tensors, memory-mapped (``torch.load(mmap=True)``: nothing read yet)."""
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)


def _check_items(tensors: Any, names: list[str], items: dict, file: str) -> str | None:
    """What of ``names`` the loaded part ``tensors`` lacks or holds with another shape or
    dtype than the index says, or None."""
    for name in names:
        t = tensors.get(name) if isinstance(tensors, dict) else None
        _, shape, dtype = items[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            return (f"{file!r} holds no {dtype} {tuple(shape)} tensor {name!r}, which the index "
                    "names (a damaged or mixed-up file)")  # fmt: skip
    return None


def _verify_parts(path: str, index: dict, by_part: dict[int, list[str]],
                  who: str = "load_streamed") -> None:  # fmt: skip
    """Step 1 for the part files (see the module docstring); ``who`` names the caller.

    Raises:
        ValueError: the first part that is missing, of another size, damaged or mixed up,
            named (with how many more are); nothing was changed.
    """
    items, sizes = index["items"], index.get("part_nbytes")
    sums = index.get("part_checksums") if index["version"] >= 2 else None
    # a part there but no regular file (a folder, a link to a device): named, as damaged (a
    # user's find: it read "lacks part files")
    odd = [n for n in by_part if os.path.lexists(_part_file(path, n))
           and not os.path.isfile(_part_file(path, n))]  # fmt: skip
    if odd:
        more = f" (and {len(odd) - 1} more parts)" if len(odd) > 1 else ""
        name = os.path.basename(_part_file(path, odd[0]))
        raise ValueError(f"{who}: {name} of {path!r} is no regular file (a folder, a link to "
                         f"a device or a missing file){more}: the checkpoint is damaged{_FIX}")  # fmt: skip
    missing = [n for n in by_part if not os.path.isfile(_part_file(path, n))]
    if missing:
        raise ValueError(f"{who}: {path!r} lacks part files {missing[:5]} that its index "
                         f"names: an incomplete copy{_FIX}")  # fmt: skip
    if sizes is not None:
        wrong = [(n, os.path.getsize(_part_file(path, n)), sizes[n]) for n in by_part]
        wrong = [w for w in wrong if w[1] != w[2]]
        if wrong:
            n, have, want = wrong[0]
            more = f" ({len(wrong)} parts differ)" if len(wrong) > 1 else ""
            raise ValueError(f"{who}: part-{n:05d}.pt of {path!r} has {have} bytes, "
                             f"{want} when saved: a truncated or damaged copy{more}{_FIX}")  # fmt: skip
    for n, names in sorted(by_part.items()):
        file = _part_file(path, n)
        what = f"{who}: part-{n:05d}.pt of {path!r}"
        try:
            if sums is not None:
                integrity.verify(file, what, expect=sums[n])
            tensors = _read_part(file)
        except integrity.Damaged as e:
            raise ValueError(f"{e}{_FIX}") from None
        except Exception as e:  # noqa: BLE001 - a truncated zip, an unreadable file
            raise ValueError(f"{what} could not be read ({type(e).__name__}): a damaged "
                             f"file{_FIX}") from None  # fmt: skip
        problem = _check_items(tensors, names, items, file)
        del tensors  # unmapped before the next part
        if problem:
            raise ValueError(f"{who}: {problem}{_FIX}")


def verify(path: str, who: str = "load_streamed") -> None:
    """Step 1 for the files alone, without an optimizer: the index of the checkpoint at
    ``path`` and every part file it names (present, of the recorded size, matching its
    checksum, holding its items). For a caller that refuses the checkpoint for another reason
    (``offloadopt train --resume`` of one at the last step): a damaged checkpoint must say so
    first. Reads every part once; ``who`` names the caller in the messages.

    Raises:
        ValueError: ``path`` is no streamed checkpoint, or a file of it is missing or damaged
            (names the file and what failed).
    """
    path = locate(path, who)
    index = read_index(path, who)
    by_part: dict[int, list[str]] = {}
    for name, (number, _, _) in index["items"].items():
        by_part.setdefault(number, []).append(name)
    _verify_parts(path, index, by_part, who)


class _Parts:
    """Step 2: the part files, mapped one at a time (the last one kept), each checksum
    computed again before its tensors are used."""

    def __init__(self, path: str, index: dict):
        self.path, self.items, self.number, self.tensors = path, index["items"], -1, {}
        self.sums = index.get("part_checksums") if index["version"] >= 2 else None

    def get(self, number: int, name: str) -> torch.Tensor:
        """Item ``name`` of part ``number``.

        Raises:
            RuntimeError: the part no longer reads as verified (see ``_PARTLY``)."""
        file = _part_file(self.path, number)
        if number != self.number:
            self.tensors = {}  # unmap the last part before mapping the next
            try:
                if self.sums is not None:
                    integrity.verify(file, f"part-{number:05d}.pt", expect=self.sums[number])
                self.tensors = _read_part(file)
            except Exception as e:  # noqa: BLE001 - changed, removed or unreadable since step 1
                raise RuntimeError(f"load_streamed: {file!r} no longer reads as it did when it "
                                   f"was verified ({type(e).__name__}: {e}); {_PARTLY}") from e  # fmt: skip
            self.number = number
        problem = _check_items(self.tensors, [name], self.items, file)
        if problem:
            raise RuntimeError(f"load_streamed: {problem}, since it was verified; {_PARTLY}")
        return self.tensors[name]


def load(opt: HybridOptimizer, path: str, model: torch.nn.Module | None = None) -> Any:
    """Read the checkpoint folder ``path`` into ``opt`` (and ``model``'s tensors, in place);
    returns the ``extra`` object saved with it (None if none). Everything is verified first
    (the module docstring's step 1), then the model's tensors are copied in, then the
    optimizer's entries, each as ``load_state_dict`` copies an entry (so a checkpoint of
    another representation loads as one of ``state_dict()`` would), one part file mapped at a
    time. A ``path`` missing because a save to it was killed between its renames is found
    where that save left the previous checkpoint (``streamed.locate``, with a warning).

    Raises:
        ValueError: ``path`` is no streamed checkpoint, is damaged (a part or the index fails
            its checksum, size or structure: names the file and what to do), or does not fit
            ``opt`` or ``model`` (names what); nothing was changed.
        RuntimeError: as ``load_state_dict`` (nothing was changed); or the load failed after
            everything was verified (a file changed or removed meanwhile, a read error): the
            message says so, and the optimizer refuses ``step()`` until a load succeeds.
    """
    opt._prepare_load()  # as load_state_dict: placed, not mid-step, nothing in flight
    path = locate(path)
    index = read_index(path)
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
    by_part: dict[int, list[str]] = {}
    for name, (number, _, _) in items.items():
        if name.startswith(_STATE) or name in targets:
            by_part.setdefault(number, []).append(name)
    parts = _Parts(path, index)

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

    opt._load_validated(sd, check=lambda: _verify_parts(path, index, by_part),
                        before=read_model, real_entry=real_entry)  # fmt: skip
    return index["extra"]
