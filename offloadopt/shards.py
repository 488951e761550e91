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

__all__ = ["is_dtensor", "local", "wrap_like", "unwrap_like", "check_setup", "local_state"]

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


def world_size() -> int:
    """Ranks of the default process group (1 when there is none)."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def check_setup(named: list[tuple[str, torch.Tensor]], overlap: str, ddp: bool = False) -> None:
    """Refuse the distributed setups this optimizer cannot run correctly, before anything is
    allocated.

    Raises:
        ValueError: an FSDP2 param whose shard lives on another device type than its mesh
            (FSDP2's own ``CPUOffloadPolicy``), or, in a job of several ranks, params of one
            rank on more than one device (each rank owns one device).
        NotImplementedError: ``overlap="backward"`` in a job of several ranks with params
            that are not FSDP2's (a grad hook sees DDP's un-reduced grad), unless ``ddp=``.
    """
    for name, p in named:
        if is_dtensor(p):
            mesh_type = p.device_mesh.device_type
            if local(p).device.type != mesh_type:
                raise ValueError(
                    f"{name} is an FSDP2 param on a {mesh_type} mesh whose shard lives on "
                    f"{local(p).device} (FSDP2's CPUOffloadPolicy?): the two offloads do not "
                    "stack; drop offload_policy= and let this optimizer offload the state"
                )
    world = world_size()
    if world == 1:
        return
    # FSDP2 calls a sharded param's post-accumulate-grad hooks after its reduce-scatter, on
    # its post-reduce stream: the grads a hook announces are reduced. DDP's hooks are not.
    if (
        overlap == "backward"
        and not ddp
        and not all(is_dtensor(p) for _, p in named if p.requires_grad)
    ):
        raise NotImplementedError(
            f"overlap='backward' in a job of {world} ranks with params that are not FSDP2's: "
            "a grad hook sees the un-reduced grad under DDP: pass ddp=<the DDP model> (its "
            "all-reduced buckets announce the grads), or use overlap='step' or 'delayed'"
        )
    devices: dict[torch.device, str] = {}
    for name, p in named:
        if not p.is_meta:
            devices.setdefault(local(p).device, name)
    if len(devices) > 1:
        (d1, n1), (d2, n2) = list(devices.items())[:2]
        raise ValueError(
            f"params of this rank are on {len(devices)} devices ({n1} on {d1}, {n2} on {d2}): "
            f"in a job of {world} ranks each rank's params live on its own one device"
        )


def local_state(sd: Any, param_groups: list[dict], name_of: Any) -> Any:
    """``sd`` (a state dict being loaded) with the DTensor state of FSDP2 params replaced by
    this rank's shards: a new dict, the caller's is left as it was. ``name_of(p)`` names a
    param in messages.

    Raises:
        ValueError: a DTensor value sharded otherwise than its param (named).
    """
    state = sd.get("state") if isinstance(sd, dict) else None
    saved = sd.get("param_groups") if isinstance(sd, dict) else None
    if not isinstance(state, dict) or not isinstance(saved, list):
        return sd  # checkpoint.validate says what is wrong
    # The saved ids (ints, or FQNs from torch.distributed.checkpoint) name params by their
    # position in the groups, as in torch's load_state_dict.
    param_of = {}
    for g, s in zip(param_groups, saved, strict=False):
        ids = s.get("params") if isinstance(s, dict) else None
        if isinstance(ids, list) and len(ids) == len(g["params"]):
            param_of.update((i, p) for i, p in zip(ids, g["params"], strict=True)
                            if isinstance(i, (int, str)))  # fmt: skip
    if not any(is_dtensor(p) for p in param_of.values()):
        return sd
    out = {}
    for index, entry in state.items():
        p = param_of.get(index) if isinstance(index, (int, str)) else None
        if p is None or not is_dtensor(p) or not isinstance(entry, dict):
            out[index] = entry
            continue
        name = name_of(p)
        out[index] = {k: unwrap_like(p, v, f"state {k!r} of {name}") for k, v in entry.items()}
    return {**sd, "state": out}
