"""Where offloaded state lies in host memory: arenas, buckets and segments (offsets, no copies).

The offloaded params of one (param group, device, update dtype) lie back to back in one
*arena*, in backward order (last-registered first). An arena owns one flat host buffer per
tensor the rule keeps (the fp32 ``master``, then each state key such as ``exp_avg``); each
param's entry is a view of its own contiguous range, shaped like the param. Arenas are cut
into *buckets*, the unit of the D2H -> CPU update -> H2D pipeline; a bucket may cut through a
param (a 322 MB embedding needs no 322 MB staging slot), at a multiple of :data:`CUT_ALIGN`
elements from the param's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offloadopt.link.host import HostBuffers
from offloadopt.shards import local

__all__ = ["CUT_ALIGN", "Arena", "Segment", "Bucket", "build_arenas"]

# Bucket boundaries inside a param fall on multiples of this many elements from the param's start:
# torch's CPU fused kernels split work in cache-line units (16 fp32, 32 bf16) and handle only a
# tensor's last few elements with scalar code, which rounds differently. Cutting a param at such
# a multiple keeps every element on the same code path as in one whole-tensor call, so the
# result stays bitwise torch's (tests/test_parity.py, test_buckets_cutting_through_params_...).
CUT_ALIGN = 64


@dataclass(eq=False)
class Arena:
    """Flat host state of the offloaded params of one (group, device, update dtype).

    Buffers, each ``(numel,)`` in the update dtype on the host, once :meth:`allocate` ran:
    ``master`` (the optimizer's copy of the weights: the fp32 master of a low-precision param,
    the host copy of an fp32 one), pinned because it crosses H2D; ``states[key]`` for each of
    the rule's state keys, pageable (they never cross the link).
    """

    group_label: int  # the group's position when the arena was built (labels only)
    device: torch.device
    dtype: torch.dtype  # update dtype: fp32, or the param dtype without masters
    # The dtype grads and new weights cross the link in: the update dtype, or the params' own
    # (bf16) where the update reads bf16 grads and writes bf16 weights itself (see placer.py)
    link_dtype: torch.dtype | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # each param's position in backward order
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    master: torch.Tensor | None = None  # (numel,) update dtype, pinned host: crosses H2D
    states: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> (numel,), pageable
    buffers: HostBuffers | None = None
    # Elements each param's start is aligned to: 1 (packed), or a blockwise representation's block
    block: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer (the master, or one state key)."""
        return self.numel * self.dtype.itemsize

    @property
    def label(self) -> str:
        return f"group {self.group_label} ({len(self.params)} params, first {self.names[0]})"

    def add(self, param: torch.Tensor, name: str, order: int) -> None:
        self.params.append(param)
        self.names.append(name)
        self.order.append(order)
        start = -(-self.numel // self.block) * self.block  # params start at a block boundary
        self.offsets.append(start)
        self.numel = start + local(param).numel()  # an FSDP2 param: this rank's shard

    def __post_init__(self) -> None:
        if self.link_dtype is None:
            self.link_dtype = self.dtype

    def view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Param ``k``'s range of ``flat``, shaped like the param (a blockwise buffer's: its
        blocks, 1-D)."""
        p = local(self.params[k])
        if flat.numel() != self.numel:  # a blockwise state key's buffer
            lo = self.offsets[k] // self.block
            return flat[lo : lo - (-p.numel() // self.block)]
        return flat[self.offsets[k] : self.offsets[k] + p.numel()].view(p.shape)

    def allocate(self, state_keys: tuple[str, ...], pin: bool, specs: dict | None = None) -> None:
        """Allocate the master (pinned when ``pin``) and one pageable buffer per state key.

        ``specs``: per state key ``(dtype, blockwise)`` where it is not the update dtype, one
        value per element (a compressed representation: bf16 moments, int8 codes); a
        blockwise key holds one value per :attr:`block` elements (the arena's params then start
        at multiples of ``block``, so each param's blocks are its own).

        Raises:
            PinnedAllocationError: the memory could not be had (the bytes asked for).
        """
        self.buffers = HostBuffers(self)
        self.master = self.buffers.alloc(self.numel, self.dtype, pin, f"the master of {self.label}")
        for key in state_keys:
            dtype, blockwise = (specs or {}).get(key, (self.dtype, False))
            n = -(-self.numel // self.block) if blockwise else self.numel
            self.states[key] = self.buffers.alloc(n, dtype, False, f"{key} of {self.label}")

    def release(self) -> None:
        """Unpin and drop the buffers now (construction failed after they were allocated)."""
        if self.buffers is not None:
            self.buffers.close()
        self.master, self.states = None, {}


@dataclass(frozen=True)
class Segment:
    """The part ``[lo, hi)`` (flat elements) of param ``k`` of an arena that lies in a bucket."""

    k: int  # index of the param in its arena
    lo: int
    hi: int
    offset: int  # where the segment starts in the bucket (elements)


@dataclass(eq=False)
class Bucket:
    """A range ``[lo, hi)`` of an arena: the unit of the D2H -> CPU update -> H2D pipeline.

    AdamW is elementwise and each segment keeps its param's ``step``, so the fused kernel over
    segments is bitwise the same as over whole params (given :data:`CUT_ALIGN`).
    """

    arena: Arena
    lo: int
    hi: int
    segments: list[Segment]
    index: int = -1  # position in the optimizer's bucket list (labels, per-bucket events)
    _views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        return self.numel * self.arena.dtype.itemsize

    @property
    def params(self) -> list[torch.Tensor]:
        """The distinct params with a segment in this bucket."""
        ks = dict.fromkeys(s.k for s in self.segments)
        return [self.arena.params[k] for k in ks]

    @property
    def label(self) -> str:
        names = {self.arena.names[s.k] for s in self.segments}
        first = self.arena.names[self.segments[0].k]
        return f"bucket {self.index} ({len(names)} params from {first}, {self.nbytes} bytes)"

    def range_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket's range ``[lo, hi)`` of an arena buffer (``master``, a state key); of a
        blockwise buffer, the blocks covering it (segments start at block boundaries,
        build_arenas)."""
        if flat.numel() != self.arena.numel:
            k = self.arena.block
            return flat[self.lo // k : -(-self.hi // k)]
        return flat[self.lo : self.hi]

    def state_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each segment's flat range of an arena buffer (``master``, a state key), cached
        (arena buffers are never rebound)."""
        key = (flat.data_ptr(), -1)
        views = self._views.get(key)
        if views is None:
            if flat.numel() != self.arena.numel:  # blockwise: each segment's blocks
                b = self.arena.block  # segments start at block boundaries (build_arenas)
                views = [
                    flat[(self.lo + s.offset) // b : -(-(self.lo + s.offset + s.hi - s.lo) // b)]
                    for s in self.segments
                ]
            else:
                views = [
                    flat[self.lo + s.offset : self.lo + s.offset + s.hi - s.lo]
                    for s in self.segments
                ]
            self._views[key] = views
        return views

    def link_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the bucket's grads (or weights) in ``dtype``: what one copy moves."""
        return self.numel * dtype.itemsize

    def slot_views(
        self, slot: torch.Tensor, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Each segment's flat range of a staging slot (flat uint8, never rebound) read as
        ``dtype`` (default the update dtype; the segments lie back to back from the slot's
        start), cached."""
        dtype = self.arena.dtype if dtype is None else dtype
        key = (slot.data_ptr(), slot.device.index if slot.is_cuda else -2, dtype)
        views = self._views.get(key)
        if views is None:
            flat = slot[: self.numel * dtype.itemsize].view(dtype)
            views = self._views[key] = [
                flat[s.offset : s.offset + s.hi - s.lo] for s in self.segments
            ]
        return views

    def forget_slot_views(self) -> None:
        """Drop cached staging views (the staging they point into was replaced)."""
        self._views = {k: v for k, v in self._views.items() if len(k) == 2}

    def param_views(self) -> list[torch.Tensor]:
        """Each segment's flat range of its (contiguous) param."""
        return [local(self.arena.params[s.k]).view(-1)[s.lo : s.hi] for s in self.segments]

    def grad_views(self, idx: list[int]) -> list[torch.Tensor]:
        """The flat grad ranges of segments ``idx`` (a non-contiguous grad is copied flat)."""
        segs = [self.segments[i] for i in idx]
        return [local(self.arena.params[s.k].grad).reshape(-1)[s.lo : s.hi] for s in segs]


def build_arenas(
    items: list[tuple],
    bucket_nbytes: int,
    align: int = CUT_ALIGN,
) -> tuple[list[Arena], list[Bucket]]:
    """Lay params out in arenas and cut the arenas into buckets of at most ``bucket_nbytes``.

    Args:
        items: ``(param, name, group label, update_dtype)`` or ``(param, name, group label,
            update_dtype, link_dtype)`` in backward order (last-registered first); params of
            one group label share an arena per (device, update dtype, link dtype).
        bucket_nbytes: most bytes (of update dtype) per bucket.
        align: a multiple of :data:`CUT_ALIGN`: params start at, and are cut at, multiples of
            it (a blockwise state representation's block, so a segment holds whole blocks).

    Returns:
        The arenas (one per (group, device, dtype)) and the buckets, ordered by the earliest
        backward-order position they hold, so the grads that appear first move first.
    """
    arenas: dict[tuple, Arena] = {}
    for order, (param, name, group, dtype, *link) in enumerate(items):
        link_dtype = link[0] if link else dtype
        key = (group, param.device, dtype, link_dtype)
        if key not in arenas:
            arenas[key] = Arena(group_label=group, device=param.device, dtype=dtype,
                                 link_dtype=link_dtype,
                                 block=align if align > CUT_ALIGN else 1)  # fmt: skip
        arenas[key].add(param, name, order)
    buckets = []
    for arena in arenas.values():
        size = max(align, bucket_nbytes // arena.dtype.itemsize)
        lo, segments = 0, []
        for k, p in enumerate(arena.params):
            start, n, done = arena.offsets[k], local(p).numel(), 0
            while done < n:
                room = size - (start + done - lo)
                take = n - done
                if take > room:  # cut param k, at a multiple of align from its start
                    take = (done + room) // align * align - done
                if take <= 0:  # no aligned cut fits: close this bucket first (one that
                    # would hold only the padding before param k is no bucket: a user's find,
                    # an IndexError at tiny bucket_nbytes with int8's 256-element alignment)
                    if segments:
                        buckets.append(Bucket(arena, lo, start + done, segments))
                    lo, segments = start + done, []
                    continue
                segments.append(Segment(k, done, done + take, start + done - lo))
                done += take
                if start + done - lo >= size or done < n:
                    buckets.append(Bucket(arena, lo, start + done, segments))
                    lo, segments = start + done, []
        if segments:
            buckets.append(Bucket(arena, lo, arena.numel, segments))
    buckets.sort(key=lambda b: b.arena.order[b.segments[0].k])
    return list(arenas.values()), buckets
