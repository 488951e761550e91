"""What a placement holds, in bytes and by side: the host buffers that cross the link (and the
pinned invariant over them), host and pinned bytes, and the cost model's bytes and elements per
side. Functions of explicit arguments (the Placer's arenas, staging and records)."""

from __future__ import annotations

from typing import Any

import torch

from offloadopt.link.layout import Arena
from offloadopt.link.transfer import Transfer
from offloadopt.place.placement import update_dtype
from offloadopt.rules import Rule
from offloadopt.shards import local

__all__ = [
    "bytes_per_param",
    "check_pinned",
    "crossing_host_tensors",
    "host_nbytes",
    "numel_by_side",
    "pinned_nbytes",
]


def crossing_host_tensors(
    arenas: list[Arena], transfers: dict[torch.device, Transfer]
) -> list[tuple[str, torch.Tensor]]:
    """Every host buffer that crosses the link: ``(label, tensor)`` pairs (the masters of the
    arenas of CUDA params, and each CUDA device's staging slots)."""
    out = [(f"the master of arena {k}, {a.label}", a.master)
           for k, a in enumerate(arenas) if a.device.type == "cuda"]  # fmt: skip
    for d, tr in transfers.items():
        if d.type == "cuda":
            out += [(f"{d} grad staging slot {i}", t) for i, t in enumerate(tr.host_slots())]
    return out


def check_pinned(
    arenas: list[Arena], transfers: dict[torch.device, Transfer], pin_memory: bool
) -> None:
    """The pinned invariant: every crossing host buffer is pinned (unless ``pin_memory`` is
    False: ``pin_memory=False`` exists to measure the pageable path).

    Raises:
        RuntimeError: a crossing host buffer is not pinned (named, with its bytes).
    """
    if not pin_memory:
        return
    bad = [f"{label}: {t.numel() * t.element_size()} bytes"
           for label, t in crossing_host_tensors(arenas, transfers)
           if t.numel() and not t.is_pinned()]  # fmt: skip
    if bad:
        raise RuntimeError(
            "host buffers that cross the link must be pinned; not pinned: " + "; ".join(bad)
        )


def host_nbytes(arenas: list[Arena], transfers: dict[torch.device, Transfer]) -> int:
    """Bytes of host memory held for optimizer state (the arenas) and staging."""
    n = sum(a.buffers.nbytes for a in arenas if a.buffers is not None)
    return n + sum(tr.ring.buffers.nbytes for tr in transfers.values())


def pinned_nbytes(arenas: list[Arena], transfers: dict[torch.device, Transfer]) -> int:
    """Of :func:`host_nbytes`, the bytes that are pinned now."""
    n = sum(a.buffers.pinned_nbytes for a in arenas if a.buffers is not None)
    return n + sum(tr.ring.buffers.pinned_nbytes for tr in transfers.values())


def bytes_per_param(
    param_groups: list[dict[str, Any]], rule: Rule, master_weights: bool
) -> dict[str, int]:
    """The cost model's bytes per trainable param: its weight (and grad) in the dtype of most
    of the elements, the state (the rule's, and an fp32 master when kept), and the host copy of
    the weights an offloaded param keeps where no fp32 master is counted (its update dtype's
    bytes: fp32 params, master_weights=False, "bf16-sr")."""
    by_dtype: dict[torch.dtype, int] = {}
    for g in param_groups:
        for p in g["params"]:
            if p.requires_grad:
                by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + local(p).numel()
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
    udt = update_dtype(dtype, master_weights)
    master = udt.itemsize if udt != dtype else 0
    copy = 0 if master else udt.itemsize
    if rule.compressed:  # the representation's bytes (bf16 or int8 moments, a bf16 master)
        return {"weight_bytes": dtype.itemsize, "host_copy_bytes": copy,
                "state_bytes": rule.elem_bytes(param_groups[0], udt) + master}  # fmt: skip
    n_states = len(rule.state_keys_for(param_groups[0]))
    return {"weight_bytes": dtype.itemsize, "state_bytes": udt.itemsize * n_states + master,
            "host_copy_bytes": copy}  # fmt: skip


def numel_by_side(records: dict[torch.Tensor, Any]) -> dict[bool, int]:
    """Trainable elements (this rank's shards) whose state is offloaded (True) or on the
    device (False)."""
    out = {True: 0, False: 0}
    for p, rec in records.items():
        if rec.placement.reason != "frozen":
            out[rec.offloaded] += local(p).numel()
    return out
