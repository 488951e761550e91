"""``opt.state``: torch's ``defaultdict(dict)``, whose assignments copy into the buffers.

Frameworks assign whole state entries: PyTorch Lightning moves optimizer state to the device
after a resume with ``state[p][key] = value.to(device)``, ``ZeroRedundancyOptimizer`` and users
assign new tensors. A plain dict would then hold the assigned copy while the update keeps
writing the optimizer's own buffer (an offloaded moment lives in a host arena the kernel reads
through views), so ``state_dict()`` would report stale values and the copy would take GPU
memory. Here an assignment of a tensor to a key that holds one waits for work in flight and
copies the value into the existing buffer, which stays where it lives (host state on the host,
pinned where it was); a whole-entry assignment does that key by key; deleting an entry resets
that param's state (made again at its next grad, as torch does); under ``state_dtype="int8"``
an assignment to torch's ``exp_avg`` / ``exp_avg_sq`` encodes the value into the entry's codes
and block scales (it would otherwise sit beside them, unread); ``opt.state = mapping`` empties
the same object and refills it (:meth:`OptimizerState.reset`). Reads through ``opt.state``
(``opt.state[p]``, ``get``, ``values``, ``items``) first wait for an update in flight
(``wait="module"`` and ``overlap="delayed"`` return from ``step()`` before it is done), so a
read never sees host state the worker is writing; delayed, a read does not copy the new weights
in (that would end the staleness and change the run), writes and deletions do.
Copies of an entry (``copy.deepcopy``, ``dict(...)``) are plain dicts.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from offloadopt.interrupts import signals_deferred
from offloadopt.rules import BLOCK, MOMENT_KEYS
from offloadopt.shards import is_dtensor, local

__all__ = ["OptimizerState", "StateEntry"]


class StateEntry(dict):
    """One param's state (``opt.state[p]``); see the module docstring."""

    def __init__(self, owner: Any, *args: Any):
        super().__init__(*args)
        self._owner = weakref.ref(owner)

    def __setitem__(self, key: str, value: Any) -> None:
        if key in MOMENT_KEYS and key not in self and f"{key}_q" in self:
            self._encode_into(key, value)  # int8 state: torch's key goes into the codes
            return
        old = self.get(key)
        if isinstance(old, torch.Tensor) and is_dtensor(value):
            value = local(value)  # an FSDP2 param's state: this rank's shard is copied in
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(old, torch.Tensor) and (number or isinstance(value, torch.Tensor)):
            _refuse_wrapping(key, old, value)
        if isinstance(old, torch.Tensor) and old.numel() == 1 and number:
            old.fill_(value)  # e.g. "step" assigned a number: the counter tensor keeps it
            return
        if isinstance(old, torch.Tensor) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"opt.state[...][{key!r}] = {value!r}: the optimizer's buffer is a tensor of "
                f"shape {tuple(old.shape)} that the update keeps using; assign a tensor (or a "
                "number to a one-element entry such as 'step')"
            )
        if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and value is not old:
            owner = self._owner()
            if owner is not None:
                owner.synchronize()  # no update in flight reads or writes this buffer
            if value.numel() != old.numel() or (old.dim() and value.shape != old.shape):
                raise ValueError(
                    f"opt.state[...][{key!r}] = a tensor of shape {tuple(value.shape)}: the "
                    f"optimizer's buffer has shape {tuple(old.shape)}"
                )
            with torch.no_grad():
                old.copy_(value.reshape(old.shape))  # the buffer keeps its device, dtype, pinning
            return
        super().__setitem__(key, value)

    def __missing__(self, key: Any) -> Any:
        """A read of torch's ``exp_avg`` / ``exp_avg_sq`` under ``state_dtype="int8"`` (a
        user's find: a bare KeyError): the KeyError says where the moment is and how to read
        it. No decoded copy is returned: an in-place edit of one would be lost silently."""
        if key in MOMENT_KEYS and f"{key}_q" in self:
            decode = "decode_m" if key == "exp_avg" else "decode_v"
            raise KeyError(
                f"{key!r}: under state_dtype='int8' this optimizer keeps {key} as int8 codes and "
                f"block scales ({key + '_q'!r}, {key + '_scale'!r}); read it with "
                f"offloadopt.kernels.formats.{decode}(state[{key + '_q'!r}].flatten(), state[{key + '_scale'!r}]) "
                f"or from opt.state_dict(), which holds it in fp32; assigning "
                f"opt.state[p][{key!r}] = t encodes t"
            )
        raise KeyError(key)

    def _encode_into(self, key: str, value: Any) -> None:
        """``opt.state[p]["exp_avg"] = tensor`` under ``state_dtype="int8"``: the entry holds
        codes and block scales, not torch's key; the value is encoded into them (as a
        checkpoint's fp32 moments are on load), so the next step and ``state_dict()`` use it.
        Raises TypeError (not a tensor) or ValueError (another numel) before writing."""
        from offloadopt.state.checkpoint import encoded

        codes_key, scale_key = f"{key}_q", f"{key}_scale"
        codes, scales = self[codes_key], self[scale_key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"opt.state[...][{key!r}] = {value!r}: this optimizer keeps {key} as int8 codes "
                f"({codes_key!r}, {scale_key!r}); assign a tensor of {codes.numel()} elements"
            )
        if value.numel() != codes.numel():
            raise ValueError(
                f"opt.state[...][{key!r}] = a tensor of shape {tuple(value.shape)}: the "
                f"optimizer's {codes_key!r} has shape {tuple(codes.shape)}"
            )
        owner = self._owner()
        if owner is not None:
            owner.synchronize()  # no update in flight reads or writes these buffers
        with torch.no_grad():
            c, sc = encoded(key, local(value).reshape(codes.shape), codes.device)
            codes.copy_(c)
            scales.copy_(sc)

    def __delitem__(self, key: str) -> None:
        owner = self._owner()
        if owner is not None:
            owner.synchronize()
        super().__delitem__(key)

    def __reduce__(self):
        return dict, (dict(self),)  # copies are plain dicts


def _refuse_wrapping(key: str, old: torch.Tensor, value: Any) -> None:
    """Raises TypeError when copying ``value`` into the integer buffer ``old`` (int8 moments'
    uint8 codes) would not keep its values: a float, or an integer of another dtype, which
    ``copy_`` wraps (300.0 -> 44, -1 -> 255, NaN -> 0: a fresh user's finding, issue 44)."""
    if old.is_floating_point() or old.is_complex() or old.dtype == torch.bool:
        return
    dtype = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
    if isinstance(value, torch.Tensor) and value.dtype == old.dtype:
        return
    if isinstance(value, int) and torch.iinfo(old.dtype).min <= value <= torch.iinfo(old.dtype).max:
        return
    moment = key[: -len("_q")] if key.endswith("_q") else None
    hint = (f"; to set {moment}, assign torch's key: opt.state[p][{moment!r}] = a float tensor "
            "is encoded into the codes and scales" if moment in MOMENT_KEYS else "")  # fmt: skip
    raise TypeError(
        f"opt.state[...][{key!r}] = a value of {dtype}: the optimizer's buffer holds "
        f"{old.dtype} codes, and the copy would wrap the values (300.0 becomes 44, -1 becomes "
        f"255); assign a {old.dtype} tensor{hint}"
    )


class OptimizerState(defaultdict):
    """``opt.state``: param -> :class:`StateEntry`, created on first lookup as torch's is."""

    def __init__(self, owner: Any):
        super().__init__()
        # The one reach up that remains: opt.state is torch's surface, and an assignment into
        # it waits for the optimizer's update in flight and makes buffers with its Updater;
        # held weakly, as the optimizer holds this dict.
        self._owner = weakref.ref(owner)

    def _settle(self) -> None:
        """Wait for the owner's update in flight, if any (a no-op check otherwise)."""
        owner = self._owner()
        if owner is not None and owner._timeline.inflight is not None:
            owner._publish.wait_update()

    def __getitem__(self, key: Any) -> Any:
        self._settle()
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._settle()
        return super().get(key, default)

    def values(self):
        self._settle()
        return super().values()

    def items(self):
        self._settle()
        return super().items()

    def __missing__(self, key: Any) -> StateEntry:
        entry = StateEntry(self._owner())
        dict.__setitem__(self, key, entry)
        return entry

    def install(self, p: torch.Tensor, state: dict) -> StateEntry:
        """Set ``p``'s state as the optimizer made it (no copying)."""
        entry = StateEntry(self._owner(), state)
        dict.__setitem__(self, p, entry)
        return entry

    def __setitem__(self, p: Any, value: Any) -> None:
        owner = self._owner()
        if owner is None or not isinstance(value, dict) or p not in owner._records:
            dict.__setitem__(self, p, value)
            return
        owner.synchronize()
        entry = self.get(p)
        if not entry:
            entry = owner._updater.make_state(p)  # the buffers the assigned values are copied into
        for key, v in value.items():
            if key not in entry and isinstance(v, torch.Tensor):
                rec = owner._records[p]
                if key in rec.state_keys:  # a lazy key (SGD's buffer): its home first
                    dict.__setitem__(entry, key, owner._updater.new_state_tensor(p, rec, key))
            entry[key] = v
        for key in [k for k in entry if k not in value and k != "master"]:
            dict.__delitem__(entry, key)

    def __delitem__(self, p: Any) -> None:
        owner = self._owner()
        if owner is not None:
            owner.synchronize()
        dict.__delitem__(self, p)

    def reset(
        self,
        mapping: Any,
        records: dict[torch.Tensor, Any],
        rule: Any,
        lock: Any,
        synchronize: Callable[[], None],
    ) -> None:
        """``opt.state = mapping``: this object is emptied in place and refilled from
        ``mapping``, each entry of a param in ``records`` (param -> its
        :class:`offloadopt.place.records.ParamRecord`) copied into its buffers as an
        assignment to ``opt.state[p]`` is; ``rule``: the optimizer's
        :class:`offloadopt.rules.Rule` (which keys hold one value per block). Every entry is checked before anything changes;
        then, under ``lock`` (the step's) with signals deferred, ``synchronize()`` waits for
        the update in flight.

        Raises:
            TypeError: ``mapping`` is not a mapping, an entry of a param is not a dict, or a
                value would wrap in an integer buffer (int8 codes).
            ValueError: an entry's tensor does not fit the param's buffer.
        """
        if not hasattr(mapping, "items"):
            raise TypeError(f"opt.state = {type(mapping).__name__}: expected a mapping")
        entries = list(mapping.items())
        for p, entry in entries:
            rec = records.get(p)
            if rec is None:
                continue
            if not isinstance(entry, dict):
                raise TypeError(
                    f"opt.state = ...: the entry of {rec.name} is a {type(entry).__name__}, "
                    "expected a dict of its state"
                )
            current = dict.get(self, p)  # its buffers' dtypes (the new ones have the same)
            for key, v in entry.items():
                held = current.get(key) if isinstance(current, dict) else None
                if isinstance(held, torch.Tensor) and isinstance(v, (torch.Tensor, int, float)):
                    _refuse_wrapping(key, held, v)  # before anything is cleared
                # a blockwise key (int8 scales): one value per block of BLOCK elements
                want = -(-p.numel() // BLOCK) if rule.blockwise(key) else p.numel()
                if key != "step" and isinstance(v, torch.Tensor) and v.numel() != want:
                    raise ValueError(
                        f"opt.state = ...: {rec.name}'s {key!r} has {v.numel()} elements, "
                        f"expected {want}"
                    )
        with signals_deferred(), lock:
            synchronize()  # no update in flight reads or writes the old state
            dict.clear(self)  # the same object: the owners that read it keep it
            for p, entry in entries:
                self[p] = entry  # copied into p's buffers where p has a record

    def __reduce__(self):
        return dict, (dict(self),)
