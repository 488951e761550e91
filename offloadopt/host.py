"""Host buffers: pinned allocation, buckets of offloaded state, the pinned invariant.

Every host tensor that crosses the link (the fp32 master / host weight copy that goes H2D, the
grad staging that D2H writes) is pinned, allocated once and never rebound, so its ``data_ptr``
is stable and every copy can be truly asynchronous. Moments never cross and stay pageable.

Pinned memory is taken with ``cudaHostRegister`` on an ordinary host allocation rather than
``torch.empty(pin_memory=True)``: PyTorch's caching host allocator rounds every block up to a
power of two (a 322 MB embedding master would take 512 MB), and pinned memory is scarce.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["PinnedAllocationError", "alloc_host", "Arena", "Segment", "Bucket", "build_arenas"]


class PinnedAllocationError(RuntimeError):
    """Raised when pinned host memory cannot be had; the message gives the bytes asked for."""


def _unregister(tensor: torch.Tensor) -> None:
    # Runs when the owning optimizer dies; the tensor is alive until here, so the memory is
    # unpinned before it can be freed. Errors at interpreter exit (CUDA already torn down)
    # are harmless: the process is going away.
    try:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


def _pin(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Page-lock ``tensor``'s memory in place; raise :class:`PinnedAllocationError` on failure."""
    nbytes = tensor.numel() * tensor.element_size()
    try:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)  # 0: cudaHostRegisterDefault
    except Exception as e:  # noqa: BLE001 - rewrapped with the byte count
        raise PinnedAllocationError(
            f"could not pin {nbytes} bytes ({nbytes / 2**30:.3f} GiB) of host memory for {what}: {e}"
        ) from e
    if int(err) != 0:
        raise PinnedAllocationError(
            f"could not pin {nbytes} bytes ({nbytes / 2**30:.3f} GiB) of host memory for {what}: "
            f"cudaHostRegister returned {err}"
        )
    return tensor


def alloc_host(numel: int, dtype: torch.dtype, pin: bool, what: str, owner: object) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements of ``dtype``, pinned when ``pin``.

    Args:
        numel: elements; the buffer is ``(numel,)``, contiguous, on the CPU.
        dtype: element dtype.
        pin: page-lock it (only valid with a CUDA build and device).
        what: label used in errors.
        owner: the object whose lifetime bounds the pinning (unpinned when it dies).

    Raises:
        PinnedAllocationError: the allocation or the pinning failed; says how many bytes.
    """
    nbytes = numel * dtype.itemsize
    try:
        t = torch.empty(numel, dtype=dtype)
    except RuntimeError as e:
        kind = "pinned " if pin else ""
        raise PinnedAllocationError(
            f"could not allocate {nbytes} bytes ({nbytes / 2**30:.3f} GiB) of {kind}host memory "
            f"for {what}: {e}"
        ) from e
    if pin and numel > 0:
        _pin(t, what)
        weakref.finalize(owner, _unregister, t)
    return t


@dataclass
class Arena:
    """Flat host state of the offloaded params of one (group, device, update dtype).

    The params lie back to back in backward order (last-registered first); every buffer is
    ``(numel,)`` on the host: ``weight`` the fp32 master (or, for a param already in the update
    dtype, its host copy), pinned because it crosses H2D; ``exp_avg`` and ``exp_avg_sq``
    pageable (they never cross). Each param's state is a view of its own contiguous range,
    shaped like the param, so one allocation per buffer serves any number of params.
    """

    group: int
    device: torch.device
    dtype: torch.dtype  # update dtype: fp32, or the param dtype without masters
    params: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # position in backward order
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    weight: torch.Tensor | None = None  # (numel,) update dtype, pinned host: crosses H2D
    exp_avg: torch.Tensor | None = None  # (numel,) update dtype, pageable host
    exp_avg_sq: torch.Tensor | None = None  # (numel,) update dtype, pageable host

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def add(self, param: torch.Tensor, name: str, rank: int) -> None:
        self.params.append(param)
        self.names.append(name)
        self.ranks.append(rank)
        self.offsets.append(self.numel)
        self.numel += param.numel()

    def view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Param ``k``'s range of ``flat``, shaped like the param."""
        p = self.params[k]
        return flat[self.offsets[k] : self.offsets[k] + p.numel()].view(p.shape)

    def allocate(self, pin: bool, owner: object) -> None:
        label = f"group {self.group} ({len(self.params)} params, first {self.names[0]})"
        self.weight = alloc_host(self.numel, self.dtype, pin, f"the weights of {label}", owner)
        self.exp_avg = alloc_host(self.numel, self.dtype, False, f"exp_avg of {label}", owner)
        self.exp_avg_sq = alloc_host(self.numel, self.dtype, False, f"exp_avg_sq of {label}", owner)


@dataclass(frozen=True)
class Segment:
    """The part ``[lo, hi)`` (flat elements) of param ``k`` of an arena that lies in a bucket."""

    k: int  # index of the param in its arena
    lo: int
    hi: int
    offset: int  # where the segment starts in the bucket (elements)


@dataclass
class Bucket:
    """A range ``[lo, hi)`` of an arena: the unit of the D2H -> CPU update -> H2D pipeline.

    Bucket boundaries may cut through a param (a 322 MB embedding need not have a 322 MB
    staging slot), at multiples of :data:`CUT_ALIGN` elements from its start; AdamW is
    elementwise and each segment keeps its param's ``step``, so the fused kernel over segments
    is bitwise the same as over whole params.
    """

    arena: Arena
    lo: int
    hi: int
    segments: list[Segment]
    _slot_views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        return self.numel * self.arena.dtype.itemsize

    def state_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each segment's flat range of an arena buffer (``weight``, ``exp_avg``, ...), cached
        (arena buffers are never rebound)."""
        key = (flat.data_ptr(), -1)
        views = self._slot_views.get(key)
        if views is None:
            views = [
                flat[self.lo + s.offset : self.lo + s.offset + s.hi - s.lo] for s in self.segments
            ]
            self._slot_views[key] = views
        return views

    def slot_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """Each segment's flat range of a staging slot (flat uint8, never rebound), cached."""
        key = (slot.data_ptr(), slot.device.index or 0)
        views = self._slot_views.get(key)
        if views is None:
            flat = slot[: self.nbytes].view(self.arena.dtype)
            views = self._slot_views[key] = [
                flat[s.offset : s.offset + s.hi - s.lo] for s in self.segments
            ]
        return views

    def param_views(self) -> list[torch.Tensor]:
        """Each segment's flat range of its (contiguous) param or grad-shaped target."""
        return [self.arena.params[s.k].view(-1)[s.lo : s.hi] for s in self.segments]


# Bucket boundaries inside a param fall on multiples of this many elements from the param's start:
# torch's CPU fused kernel vectorises each tensor from its start in cache-line units (16 fp32,
# 32 bf16) and handles only a tensor's last few elements with scalar code, which rounds
# differently. Cutting a param at such a multiple keeps every element on the same code path as
# in one whole-tensor call, so the result stays bitwise torch's.
CUT_ALIGN = 64


def build_arenas(
    items: list[tuple[torch.Tensor, str, int, torch.dtype]], bucket_nbytes: int
) -> tuple[list[Arena], list[Bucket]]:
    """Lay params out in arenas and cut the arenas into buckets of at most ``bucket_nbytes``.

    Args:
        items: ``(param, name, group, update_dtype)`` in backward order (last-registered first).
        bucket_nbytes: most bytes (of update dtype) per bucket.

    Returns:
        The arenas (one per (group, device, dtype)) and the buckets, ordered by the earliest
        backward-order position they hold, so the grads that appear first move first.
    """
    arenas: dict[tuple, Arena] = {}
    for rank, (param, name, group, dtype) in enumerate(items):
        key = (group, param.device, dtype)
        if key not in arenas:
            arenas[key] = Arena(group=group, device=param.device, dtype=dtype)
        arenas[key].add(param, name, rank)
    buckets = []
    for arena in arenas.values():
        size = max(CUT_ALIGN, bucket_nbytes // arena.dtype.itemsize)
        lo, segments = 0, []
        for k, p in enumerate(arena.params):
            start, n, done = arena.offsets[k], p.numel(), 0
            while done < n:
                room = size - (start + done - lo)
                take = n - done
                if take > room:  # cut param k, at a multiple of CUT_ALIGN from its start
                    take = (done + room) // CUT_ALIGN * CUT_ALIGN - done
                if take <= 0:  # no aligned cut fits: close this bucket first
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
    buckets.sort(key=lambda b: b.arena.ranks[b.segments[0].k])
    return list(arenas.values()), buckets
