"""Which parameters keep their optimizer state on the host: pure policy, no CUDA calls.

The offload fraction is a share of optimizer-state bytes, not of parameters: an fp32 param
costs 8 bytes of state per element (``exp_avg``, ``exp_avg_sq``), a bf16 param with an fp32
master 12. Only *eligible* params count (``requires_grad``, ``numel >= min_offload_numel``, in a
group whose ``"offload"`` key is ``None``); a group with ``"offload": True`` goes to the host
whole and one with ``"offload": False`` stays on the device, and neither counts toward the
fraction. Eligible params are taken last-registered first: their grads appear first in
backward and the next forward needs them last (README, "How it works").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ParamInfo", "Placement", "update_dtype", "state_nbytes", "place", "format_placement"]


@dataclass(frozen=True)
class ParamInfo:
    """What the policy needs to know of one param (no tensor: the policy is pure)."""

    index: int  # position over all groups, in registration order
    name: str  # from named_parameters(), else "group{g}.param{i}"
    group: int  # index of its param group
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    group_offload: bool | None  # the group's "offload" key
    contiguous: bool = True  # offloaded params are copied as flat ranges, so must be contiguous
    n_states: int = 2  # state tensors the rule keeps for its group (AdamW 2; SGD 1, or 0)
    shard_of: tuple[int, ...] | None = None  # an FSDP2 param: ``shape`` is this rank's shard
    elem_bytes: float | None = None  # a compressed representation's state bytes per element

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Placement:
    """Where one param's optimizer state lives and what it costs."""

    index: int
    name: str
    group: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str  # "host" or "device"
    state_nbytes: int  # bytes of exp_avg + exp_avg_sq (+ fp32 master), wherever they live
    reason: str  # why it is there: "fraction", "forced", "frozen", "small", ...
    shard_of: tuple[int, ...] | None = None  # an FSDP2 param: the global shape of its shard
    # Offloaded, the host also keeps a copy of the weights in the update dtype (the arena's
    # master: the CPU update's input and the H2D's source). With an fp32 master of a bf16 param
    # that copy is the master, already in state_nbytes; without one (fp32 params,
    # master_weights=False, "bf16-sr") it is these bytes more on the host, none on the device.
    weight_copy_nbytes: int = 0

    @property
    def host_nbytes(self) -> int:
        """Host bytes this param's state takes once offloaded (its state and the copy)."""
        return self.state_nbytes + self.weight_copy_nbytes

    @property
    def offloaded(self) -> bool:
        return self.where == "host"


def update_dtype(dtype: torch.dtype, master_weights: bool) -> torch.dtype:
    """The dtype the AdamW update runs in for a param of ``dtype``: fp32 with masters on
    for any floating dtype narrower than fp32, else the param's own dtype."""
    if master_weights and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def state_nbytes(
    numel: int,
    dtype: torch.dtype,
    master_weights: bool,
    n_states: int = 2,
    elem_bytes: float | None = None,
) -> int:
    """Bytes of optimizer state for one param: ``n_states`` tensors of the update dtype (the
    rule's state keys: AdamW's two moments), or ``elem_bytes`` per element (a compressed
    representation: bf16 moments 4, int8 moments 2 plus the blocks' scales), plus an fp32
    master when the update dtype differs from the param's dtype."""
    udt = update_dtype(dtype, master_weights)
    master = udt.itemsize if udt != dtype else 0
    if elem_bytes is not None:
        return int(numel * (elem_bytes + master) + 0.5)
    return numel * (udt.itemsize * n_states + master)


def place(
    infos: list[ParamInfo],
    offload_fraction: float,
    min_offload_numel: int,
    master_weights: bool,
    policy: str = "state-bytes",
) -> list[Placement]:
    """Decide, deterministically, which params keep their state on the host.

    Args:
        infos: the params, in registration order.
        offload_fraction: share in [0, 1] of the eligible params' state bytes to offload.
        min_offload_numel: eligible params need at least this many elements.
        master_weights: whether low-precision params carry an fp32 master (affects bytes).
        policy: ``"state-bytes"`` (below), or ``"megatron"``: Megatron-Core's
            ``HybridDeviceOptimizer`` rule, params in registration order offloaded while the
            offloaded numel is below ``offload_fraction`` x the numel of all params (it may
            overshoot by one param), every size eligible.
        n_states: state tensors the update rule keeps per param (AdamW: 2).

    Returns:
        One :class:`Placement` per info, in the same order.

    Walks eligible params from the last registered to the first and offloads each as long as
    that brings the bytes offloaded nearer to ``offload_fraction`` x the eligible total (a param
    is taken while ``taken + nbytes / 2 <= target``), so fraction 0 offloads nothing, fraction 1
    everything eligible, and a fraction in between misses its target by at most half a param.
    """
    nbytes = [state_nbytes(i.numel, i.dtype, master_weights, i.n_states, i.elem_bytes)
              for i in infos]  # fmt: skip
    where = ["device"] * len(infos)
    reason = [""] * len(infos)
    eligible = []
    for k, info in enumerate(infos):
        if not info.requires_grad:
            reason[k] = "frozen"
        elif info.numel == 0:
            reason[k] = "empty"
        elif not info.contiguous:
            reason[k] = "non-contiguous"
        elif nbytes[k] == 0:
            reason[k] = "no state"  # e.g. an fp32 param under SGD without momentum
        elif info.group_offload is True:
            where[k], reason[k] = "host", "forced"
        elif info.group_offload is False:
            reason[k] = "forbidden"
        elif info.numel < min_offload_numel:
            reason[k] = "small"
        else:
            eligible.append(k)
            reason[k] = "fraction"
    if policy == "megatron":
        threshold = offload_fraction * sum(i.numel for i in infos)
        taken = 0
        for k in eligible:
            if taken >= threshold:
                break
            where[k] = "host"
            taken += infos[k].numel
    else:
        target = offload_fraction * sum(nbytes[k] for k in eligible)
        taken = 0
        for k in reversed(eligible):
            if taken + nbytes[k] / 2 > target:
                break
            where[k] = "host"
            taken += nbytes[k]
    copies = [i.numel * i.dtype.itemsize if update_dtype(i.dtype, master_weights) == i.dtype
              else 0 for i in infos]  # fmt: skip
    return [
        Placement(
            i.index,
            i.name,
            i.group,
            i.shape,
            i.dtype,
            where[k],
            nbytes[k],
            reason[k],
            i.shard_of,
            copies[k],
        )
        for k, i in enumerate(infos)
    ]


def format_placement(placements: list[Placement]) -> str:
    """A fixed-width table of a placement, one line per param, and a total line."""
    lines = [
        f"{'param':<40} {'group':>5} {'shape':<18} {'dtype':<9} {'where':<6} {'state MB':>9}  why"
    ]
    for p in placements:
        shape = "x".join(map(str, p.shape)) or "()"
        if p.shard_of is not None:  # this rank's shard: its shape, then the whole param's
            shape += "/" + ("x".join(map(str, p.shard_of)) or "()")
        dtype = str(p.dtype).replace("torch.", "")
        lines.append(
            f"{p.name[:40]:<40} {p.group:>5} {shape[:18]:<18} {dtype:<9} {p.where:<6} "
            f"{p.state_nbytes / 1e6:>9.3f}  {p.reason}"
        )
    host = sum(p.state_nbytes for p in placements if p.offloaded)
    total = sum(p.state_nbytes for p in placements)
    share = host / total if total else 0.0
    lines.append(f"state on host: {host / 1e6:.3f} MB of {total / 1e6:.3f} MB ({share:.1%})")
    if any(p.shard_of is not None for p in placements):
        lines.append(
            "FSDP2 shards: shape is this rank's shard/the whole param; bytes are this rank's"
        )
    return "\n".join(lines)
