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

import sys
from typing import Any

import torch

__all__ = ["is_dtensor", "local", "wrap_like", "unwrap_like", "check_setup", "local_state",
           "check_ddp", "check_zero"]  # fmt: skip

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
        advice = (  # ZeRO refuses ddp= and the delayed update (check_zero): step mode there
            "under ZeroRedundancyOptimizer use overlap='step'" if built_by_zero() else
            "pass ddp=<the DDP model> (its all-reduced buckets announce the grads), or use "
            "overlap='step' or 'delayed'"
        )  # fmt: skip
        raise NotImplementedError(
            f"overlap='backward' in a job of {world} ranks with params that are not FSDP2's: "
            f"a grad hook sees the un-reduced grad under DDP: {advice}"
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


# ------------------------------------------------- DDP and ZeRO: the setups refused


def check_ddp(ddp: Any, param_groups: list[dict], name_of: Any) -> None:
    """``ddp=``'s model must hold the optimizer's trainable params (a subset is fine), and the
    groups must not carry the constructor's options. ``name_of(group, gi, i)`` names a param.

    Raises:
        ValueError: a param the DDP model does not hold (named); a group holding a ``ddp``
            key (``ZeroRedundancyOptimizer`` copies the constructor's keywords into every
            group, so each checkpoint would try to pickle the DDP model).
    """
    for gi, group in enumerate(param_groups):
        if "ddp" in group:
            raise ValueError(
                f"param group {gi} carries the ddp= option as a key: torch's "
                "ZeroRedundancyOptimizer copies the constructor's keywords into every group, "
                "and its checkpoints would pickle the DDP model; under ZeRO use "
                "overlap='step' or 'delayed' (ZeRO reads grads in step())"
            )
    held = {id(p) for p in ddp.parameters()}
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.requires_grad and id(p) not in held:
                raise ValueError(
                    f"ddp=: {name_of(group, gi, i)} is not a param of that DDP model, so "
                    "its all-reduce would never announce the grad; pass the DDP model that "
                    "holds these params (a subset of its params is fine)"
                )


def built_by_zero() -> bool:
    """Whether torch's ``ZeroRedundancyOptimizer`` is building this optimizer: one of its
    methods is on the calling thread's stack (its ``__init__``, or the DDP comm hook that
    builds the local optimizer with ``overlap_with_ddp=True``). False when torch's module was
    never imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    if zero is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), zero):
            return True
        frame = frame.f_back
    return False


def check_zero(overlap: str, param_groups: list[dict], world: int, *,
               max_grad_norm: float | None = None, grad_scaler: Any = None) -> None:  # fmt: skip
    """Refuse the delayed update under torch's ``ZeroRedundancyOptimizer`` in a job of
    ``world`` ranks: ZeRO building it (:func:`built_by_zero`, looked at only then), or groups
    that carry ``overlap="delayed"`` as a key (ZeRO copies the constructor's keywords into them).

    ZeRO broadcasts each rank's updated shard inside its ``step()``, right after this
    optimizer's ``step()`` returns; in delayed mode that is before the update has landed, so
    the other ranks get each shard a step later than its owner, and a checkpoint (after
    ``opt.synchronize()``) holds weights that differ between ranks (a fresh user's finding;
    a second one passed the option through ``functools.partial`` and a subclass, past the
    group key alone).

    ``max_grad_norm`` and an attached ``grad_scaler`` are refused there too: each rank's
    optimizer sees its shard alone, so the norm (and the inf check) were its shard's, and each
    shard was clipped by a factor of its own, silently unlike ``clip_grad_norm_`` on the model
    (a fresh user's finding).

    Raises:
        ValueError: ``overlap="delayed"``, ``max_grad_norm`` or ``grad_scaler`` under ZeRO
            with more than one rank.
    """
    if world <= 1:
        return
    if max_grad_norm is not None or grad_scaler is not None:
        keyed = [gi for gi, g in enumerate(param_groups)
                 if g.get("max_grad_norm") is not None or g.get("grad_scaler") is not None]  # fmt: skip
        if keyed or built_by_zero():
            what = "max_grad_norm" if max_grad_norm is not None else "grad_scaler"
            raise ValueError(
                f"{what} under ZeRO (ZeroRedundancyOptimizer, {world} ranks): each rank's "
                "optimizer holds its shard of the params alone, so the grad norm and the inf "
                "check would be its shard's, not the model's; call "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (or the "
                "scaler's unscale_ and step) before opt.step() instead"
            )
    if overlap != "delayed":
        return
    keyed = [gi for gi, group in enumerate(param_groups) if group.get("overlap") == "delayed"]
    by_zero = built_by_zero()
    if by_zero or keyed:
        how = "ZeroRedundancyOptimizer is building it" if by_zero else (
            f"param group {keyed[0]} carries overlap='delayed' as a key (built by torch's "
            "ZeroRedundancyOptimizer?)"
        )  # fmt: skip
        raise ValueError(
            f"overlap='delayed' under ZeRO ({how}): each rank updates its shard and ZeRO "
            "broadcasts the weights inside step(), before a delayed update has landed, so "
            f"the {world} ranks would train on different weights and checkpoint them; "
            "use overlap='step' under ZeRO"
        )


def refuse_sharded(sharded: list[torch.Tensor], moments: str, master_sr: bool) -> None:
    """Compressed optimizer state (``state_dtype``, ``master_weights='bf16-sr'``) is refused
    with FSDP2 (DTensor) params (``sharded``): its per-block scales are not laid out like the
    params' shards.

    Raises:
        NotImplementedError: ``sharded`` is not empty (counted).
    """
    if sharded:
        draws = (
            "stochastic rounding draws by the element's index in the whole tensor, "
            "which a shard does not know"
        )  # bf16 moments and bf16-sr masters
        given, why = [], []
        if moments != "fp32":
            given.append(f"state_dtype={moments!r}")
            why.append("int8's per-block scales are not laid out like the params' shards"
                       if moments == "int8" else draws)  # fmt: skip
        if master_sr:
            given.append("master_weights='bf16-sr'")
            why.append(draws)
        reasons = "; ".join(dict.fromkeys(why))  # each reason once
        raise NotImplementedError(
            f"compressed optimizer state ({', '.join(given)}) with FSDP2 is not supported yet "
            f"({len(sharded)} of the params are DTensor shards): {reasons}; use "
            "state_dtype='fp32' and master_weights=True with FSDP2"
        )
