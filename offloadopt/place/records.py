"""One record per param: its name, placement, home in host memory and the last write.

``opt.state[p]`` stays the sole owner of step, moments and masters; the record holds what the
optimizer needs to know about ``p`` besides that. A param's *group* is never stored: it is the
group whose ``"params"`` list holds it at this step (found by identity, so reordering or popping
``opt.param_groups`` cannot hand a param another group's hyperparameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offloadopt.link.layout import Arena, Bucket
from offloadopt.place.placement import Placement
from offloadopt.shards import local

__all__ = ["ParamRecord", "add_records", "landing_buffers"]


@dataclass(eq=False)
class ParamRecord:
    """What the optimizer knows of one param besides its state.

    ``arena``/``k``: the param's home when offloaded (its master and state are views of the
    arena's buffers at index ``k``); None on the device. ``written``: ``(param._version,
    data_ptr)`` when the optimizer last wrote the weights or read them into its master.
    """

    name: str
    placement: Placement
    arena: Arena | None = None
    k: int = -1
    written: tuple[int, int] | None = None
    buckets: list[Bucket] = field(default_factory=list)  # the buckets that hold its segments
    state_keys: tuple[str, ...] = ()  # the rule's state keys for its group (at placement)
    # overlap="delayed": the next weights (the param's shape, dtype and device), written by the
    # H2D during the next forward and backward, copied into the param at the next step().
    landing: torch.Tensor | None = None

    @property
    def salt(self) -> int:
        """The seed of this param's stochastic rounding (compressed representations): its
        position over all groups at placement, the same in every run of the same model."""
        return self.placement.index

    @property
    def offloaded(self) -> bool:
        return self.arena is not None

    def master(self, state: dict) -> torch.Tensor | None:
        """The optimizer's own copy of the weights, shaped like the param: the arena's master
        view when offloaded, else ``state["master"]`` (a device fp32 master) or None."""
        if self.arena is not None and self.arena.master is not None:
            return self.arena.view(self.arena.master, self.k)
        return state.get("master")

    def home(self, key: str) -> torch.Tensor:
        """The arena view that holds state ``key`` (``"master"`` or a rule's state key)."""
        flat = self.arena.master if key == "master" else self.arena.states[key]
        return self.arena.view(flat, self.k)

    def mark_written(self, p: torch.Tensor) -> None:
        p = local(p)  # an FSDP2 param: the shard's own memory and version counter
        self.written = (p._version, p.data_ptr())

    def forget_written(self) -> None:
        """Compare the master with the weights at the next step (after a load)."""
        self.written = (-1, -1)

    def is_stale(self, p: torch.Tensor) -> bool:
        """Whether ``p`` may have been written outside the optimizer since the last write
        (``param._version`` moved, or the param points at other memory). Edits through
        ``param.data`` do not move the version and are not seen."""
        p = local(p)
        return self.written != (p._version, p.data_ptr())


def landing_buffers(arenas: list[Arena]) -> dict[torch.Tensor, torch.Tensor]:
    """Each offloaded param's :attr:`ParamRecord.landing` buffer (overlap="delayed"): the
    param's shape, dtype and device, contiguous."""
    landing = {}
    for arena in arenas:
        for p in arena.params:
            landing[p] = torch.empty_like(local(p), memory_format=torch.contiguous_format)
    return landing


def add_records(
    records: dict[torch.Tensor, ParamRecord],
    placed: dict[torch.Tensor, Placement],
    keys: dict[int, tuple[str, ...]],
    arenas: list[Arena],
    buckets: list[Bucket],
    landing: dict[torch.Tensor, torch.Tensor],
    first_bucket: int,
) -> None:
    """The records of newly placed params, put into ``records``: one per param of ``placed``
    (param -> its placement), with its group's state ``keys`` (group index -> keys); an
    offloaded param's home in ``arenas``, its ``landing`` buffer (overlap="delayed") and the
    ``buckets`` that hold its segments, which are numbered from ``first_bucket`` on."""
    for p, pl in placed.items():
        records[p] = ParamRecord(pl.name, pl, state_keys=keys[pl.group])
    for arena in arenas:
        for k, p in enumerate(arena.params):
            rec = records[p]
            rec.arena, rec.k = arena, k
            rec.landing = landing.get(p)
    for n, b in enumerate(buckets, start=first_bucket):
        b.index = n
        for seg in b.segments:
            rec = records[b.arena.params[seg.k]]
            if not rec.buckets or rec.buckets[-1] is not b:
                rec.buckets.append(b)
