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

__all__ = ["PinnedAllocationError", "alloc_host", "Bucket", "build_buckets"]


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
class Bucket:
    """A few params of one group, one device and one update dtype, with flat host state.

    The unit of the D2H -> CPU update -> H2D pipeline. Buffers, all ``(numel,)`` on the host:
    ``weight`` the fp32 master (or, for a param already in the update dtype, its host copy),
    pinned because it crosses H2D; ``exp_avg`` and ``exp_avg_sq`` pageable (they never cross).
    ``*_views`` are per-param views shaped like each param: the fused kernel takes lists, and
    per-param views of a flat buffer give bitwise the same result as one flat call while each
    param keeps its own ``step``.
    """

    group: int
    device: torch.device
    dtype: torch.dtype  # update dtype: fp32, or the param dtype without masters
    params: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    weight: torch.Tensor | None = None  # (numel,) update dtype, pinned host: crosses H2D
    exp_avg: torch.Tensor | None = None  # (numel,) update dtype, pageable host
    exp_avg_sq: torch.Tensor | None = None  # (numel,) update dtype, pageable host
    weight_views: list[torch.Tensor] = field(default_factory=list)
    exp_avg_views: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq_views: list[torch.Tensor] = field(default_factory=list)
    _slot_views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def add(self, param: torch.Tensor, name: str) -> None:
        self.params.append(param)
        self.names.append(name)
        self.offsets.append(self.numel)
        self.numel += param.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-param views, shaped like the params, of the first ``numel`` of ``flat``."""
        return [
            flat[o : o + p.numel()].view(p.shape)
            for o, p in zip(self.offsets, self.params, strict=True)
        ]

    def slot_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """Per-param views of a staging slot (a flat uint8 buffer, never rebound), cached."""
        key = (slot.data_ptr(), slot.device.index or 0)
        views = self._slot_views.get(key)
        if views is None:
            views = self._slot_views[key] = self.views(slot[: self.nbytes].view(self.dtype))
        return views

    def allocate(self, pin: bool, owner: object) -> None:
        label = f"bucket of group {self.group} ({len(self.params)} params, first {self.names[0]})"
        self.weight = alloc_host(self.numel, self.dtype, pin, f"the weights of the {label}", owner)
        self.exp_avg = alloc_host(self.numel, self.dtype, False, f"exp_avg of the {label}", owner)
        self.exp_avg_sq = alloc_host(
            self.numel, self.dtype, False, f"exp_avg_sq of the {label}", owner
        )
        self.weight_views = self.views(self.weight)
        self.exp_avg_views = self.views(self.exp_avg)
        self.exp_avg_sq_views = self.views(self.exp_avg_sq)


def build_buckets(
    items: list[tuple[torch.Tensor, str, int, torch.dtype]], bucket_nbytes: int
) -> list[Bucket]:
    """Pack params into buckets in the order given (the backward order: last-registered first).

    Args:
        items: ``(param, name, group, update_dtype)`` tuples.
        bucket_nbytes: close a bucket once its update-dtype bytes reach this; a param larger
            than this gets a bucket of its own.

    Each (group, device, dtype) has one open bucket at a time, so interleaved groups (say,
    weights with decay and biases without) still fill large buckets.
    """
    done: list[Bucket] = []
    open_: dict[tuple, Bucket] = {}
    for param, name, group, dtype in items:
        key = (group, param.device, dtype)
        b = open_.get(key)
        if b is None:
            b = open_[key] = Bucket(group=group, device=param.device, dtype=dtype)
        b.add(param, name)
        if b.nbytes >= bucket_nbytes:
            done.append(open_.pop(key))
    done.extend(open_.values())
    return done
