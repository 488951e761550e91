"""FSDP2's sharded params (DTensors): the optimizer works on each rank's own shard.

Under ``torch.distributed.fsdp.fully_shard`` every param is an ``nn.Parameter`` wrapping a
``DTensor`` whose ``_local_tensor`` is this rank's shard (dim 0 cut across the ranks, FSDP2's
``Shard(0)``), and its grad, after FSDP2's reduce-scatter, is a DTensor sharded the same way.
The optimizer places, stores and updates local shards only: :func:`local` is the one way to
the memory behind a param or a grad, read afresh each time, since FSDP2 may replace a
param's local tensor object (its lazy init, ``model.load_state_dict``).

What leaves the optimizer as a checkpoint goes back out as DTensors (:func:`wrap_like`), so
that ``torch.distributed.checkpoint`` saves each shard and reshards on load
(tests/test_distributed.py).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_dtensor", "local", "wrap_like", "unwrap_like", "describe"]

try:  # torch.distributed may be built out
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - a torch without distributed
    DTensor = None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor sharing its memory), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def wrap_like(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (shaped like ``local(p)``, any device) as a DTensor laid out like ``p``:
    ``p``'s mesh, placements, global shape and strides. No communication."""
    return DTensor.from_local(
        shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def unwrap_like(p: torch.Tensor, value: Any, what: str) -> Any:
    """A state value loaded for DTensor param ``p``: a DTensor sharded as ``p`` gives its
    local shard; a plain tensor or number passes (its shape is checked later).

    Raises:
        ValueError: a DTensor on another mesh or with other placements (named by ``what``).
    """
    if not is_dtensor(value):
        return value
    if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
        raise ValueError(
            f"{what} is a DTensor with placements {tuple(value.placements)} on {value.device_mesh}, "
            f"the param is sharded {tuple(p.placements)} on {p.device_mesh}: load it through "
            "torch.distributed.checkpoint (which reshards), or redistribute it first"
        )
    return value._local_tensor


def describe(p: torch.Tensor) -> str | None:
    """For a DTensor param, ``"shard of 1600x6400 (Shard(dim=0))"``; else None."""
    if not is_dtensor(p):
        return None
    shape = "x".join(map(str, p.shape)) or "()"
    return f"shard of {shape} {tuple(p.placements)}"
