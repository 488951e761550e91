"""Host memory: pinned allocation, and pinning whose lifetime is bound to the buffers' owner.

Every host tensor that crosses the link (the master that goes H2D, the grad staging that D2H
writes) is pinned, allocated once and never rebound, so its ``data_ptr`` is stable and every
copy can be truly asynchronous. State that never crosses (the moments) stays pageable.

Pinned memory is taken with ``cudaHostRegister`` on an ordinary host allocation rather than
``torch.empty(pin_memory=True)``: PyTorch's caching host allocator rounds every block up to a
power of two (a 322 MB embedding master would take 512 MB), and pinned memory is scarce.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["PinnedAllocationError", "alloc_host", "HostBuffers"]


class PinnedAllocationError(RuntimeError):
    """Raised when pinned host memory cannot be had; the message gives the bytes asked for."""


def _unregister(tensors: list[torch.Tensor]) -> None:
    # Runs when the owner closes or dies; the tensors are alive until here (this call holds
    # them), so the memory is unpinned before it can be freed. Errors at interpreter exit (CUDA
    # already torn down) are harmless: the process is going away.
    for tensor in tensors:
        try:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
    tensors.clear()


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


def alloc_host(numel: int, dtype: torch.dtype, pin: bool, what: str) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements of ``dtype``, page-locked when ``pin``. The
    caller unpins it (:class:`HostBuffers` does, when its owner closes or dies).

    Args:
        numel: elements; the buffer is ``(numel,)``, contiguous, on the CPU.
        dtype: element dtype.
        pin: page-lock it (only valid with a CUDA build and device).
        what: label used in errors.

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
    return t


class HostBuffers:
    """The host buffers of one owner (an arena, a staging ring): their pinning lasts as long
    as the owner, or until :meth:`close`, whichever comes first (not as long as the optimizer:
    staging replaced by ``add_param_group`` is unpinned at once)."""

    def __init__(self, owner: object):
        self._pinned: list[torch.Tensor] = []
        self._finalizer = weakref.finalize(owner, _unregister, self._pinned)
        self.nbytes = 0  # bytes allocated through this object
        self.pinned_nbytes = 0  # of which pinned

    def alloc(self, numel: int, dtype: torch.dtype, pin: bool, what: str) -> torch.Tensor:
        """:func:`alloc_host`, with the pinning bound to the owner.

        Raises:
            PinnedAllocationError: the allocation or the pinning failed.
        """
        t = alloc_host(numel, dtype, pin, what)
        nbytes = numel * dtype.itemsize
        self.nbytes += nbytes
        if pin and numel > 0:
            self._pinned.append(t)
            self.pinned_nbytes += nbytes
        return t

    def close(self) -> None:
        """Unpin everything now. The caller guarantees no copy still reads or writes them."""
        self._finalizer()
        self.pinned_nbytes = 0
