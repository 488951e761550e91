"""What the optimizer reports, under the names torch users know: its placement and host
memory, the last step's figures (``stats``), speculation's counts, and the options and values
its owners hold (read, and a few written, through the owner: each value lives once). A base
class of :class:`offloadopt.optim.HybridOptimizer`, which sets the owners it reads."""

from __future__ import annotations

from typing import Any

import torch

from offloadopt.place import report

__all__ = ["Reports"]


def _owned(owner: str, name: str, doc: str, settable: bool = False) -> property:
    """A property of the optimizer that reads ``self.<owner>.<name>`` (and writes it when
    ``settable``): the value lives in its owner, once."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, owner), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, put if settable else None, doc=doc)


class Reports:
    """The read side of :class:`~offloadopt.optim.HybridOptimizer` (its owners: ``_placer``,
    ``_scaling``, ``_feeder``, ``_speculation``, ``_records``)."""

    def crossing_host_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every host buffer that crosses the link: ``(label, tensor)`` pairs."""
        return report.crossing_host_tensors(self.arenas, self._placer.transfers())

    def placement_table(self) -> str:
        """The placement as a fixed-width table (see :func:`offloadopt.place.placement.format_placement`);
        while params are still on the meta device, a line saying so."""
        return self._placer.table()

    def is_offloaded(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s optimizer state (and fp32 master) lives on the host."""
        rec = self._records.get(p)
        return rec is not None and rec.offloaded

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory held for optimizer state and staging."""
        return report.host_nbytes(self.arenas, self._placer.transfers())

    @property
    def pinned_nbytes(self) -> int:
        """Of :attr:`host_nbytes`, the bytes that are pinned now."""
        return report.pinned_nbytes(self.arenas, self._placer.transfers())

    # What the owners hold, read (and a few written) under the names torch users know.
    offload_fraction = _owned(
        "_placer",
        "fraction",
        "The offload fraction in force (``'auto'`` and ``max_gpu_memory`` set it).",
    )
    placement_choice = _owned(
        "_placer",
        "choice",
        "What chose the fraction, and why (a budget, ``'auto'``, the caller), or None.",
        settable=True,
    )
    placement = _owned(
        "_placer",
        "placement",
        "Every param's :class:`~offloadopt.place.placement.Placement`, in group order.",
    )
    arenas = _owned(
        "_placer", "arenas", "The host arenas (offloadopt/link/layout.py), one per group and dtype."
    )
    buckets = _owned("_placer", "buckets", "The arenas' buckets, in the order they are placed.")
    cpu_threads = _owned("_placer", "cpu_threads", "The CPU worker's threads.")
    bucket_nbytes = _owned("_placer", "bucket_nbytes", "The bucket size in bytes.")
    min_offload_numel = _owned("_placer", "min_offload_numel", "``min_offload_numel=``.")
    placement_policy = _owned("_placer", "policy", "``placement_policy=``.")
    master_weights = _owned("_placer", "master_weights", "``master_weights=``.")
    pin_memory = _owned("_placer", "pin_memory", "``pin_memory=``.")
    max_grad_norm = _owned(
        "_scaling",
        "max_grad_norm",
        "``max_grad_norm=``: every step's grads are clipped to this global L2 norm inside the update, or None.",
        settable=True,
    )
    grad_scaler = _owned(
        "_scaling",
        "grad_scaler",
        "``grad_scaler=``: the attached ``torch.amp.GradScaler``, or None.",
        settable=True,
    )
    last_grad_norm = _owned(
        "_scaling",
        "last_grad_norm",
        "With clipping: the last step's global grad norm (unscaled with an attached GradScaler), a 0-dim fp32 tensor on the params' device; None before the first.",
    )

    @property
    def stats(self) -> dict[str, float]:
        """Figures of the last completed step (with ``wait="module"`` or ``overlap="delayed"`` a
        step completes at the next ``synchronize()`` or ``step()``: until then these are the
        step's before, and ``{}`` before the first): ``d2h_wait_ms`` (worker time blocked on D2H
        events), ``cpu_update_ms`` (worker time in the fused kernel), ``cpu_kernel_ms`` (of it, the
        time inside offloadopt's compiled kernel's parallel regions: compressed state; 0 when
        torch's kernel runs), ``launch_ms`` (worker
        time queuing the D2H and H2D copies and casts, staging-slot waits included),
        ``feed_wait_ms`` (worker time waiting for the next bucket to be fed after the first
        one arrived: backward had not announced it yet), ``device_update_ms``
        (host time launching the device-resident update), ``collect_ms`` (host time checking
        grads and state before the update), ``h2d_ms`` and ``d2h_ms`` (GPU time of the copies
        and casts on the side streams, summed over every step since ``stats`` was last read),
        ``d2h_nbytes`` / ``h2d_nbytes`` (bytes over the
        link; 0 without CUDA, where the copies are host to host, as the times are 0), ``step_ms`` (host wall time of ``step()``), ``worker_ms`` (the worker's wall time from
        the first bucket's arrival to the last H2D queued, its D2H waits included),
        ``buckets`` (offloaded buckets updated; 0, and ``worker_ms`` 0, when none was),
        ``redone_buckets`` (``speculate=True``, a step whose speculative updates were undone
        and made again: how many buckets; the link bytes and worker times include both),
        ``cpu_threads`` (the worker's),
        ``local_ranks`` (processes of the job on this host, sharing its cores).

        Reading it waits for the CUDA events of that step's copies (long done by the time the
        next forward has run)."""
        if self._placer.pipeline is not None:
            for key, ms in self._placer.pipeline.collect_timing().items():
                self._feeder.stats[key] = self._feeder.stats.get(key, 0.0) + ms
        return dict(self._feeder.stats)

    @property
    def speculation(self) -> dict[str, int] | None:
        """``speculate=True``'s counts since construction (offloadopt/step/speculate.py's
        note): ``steps`` (steps that speculated), ``buckets`` (bucket updates made
        speculatively), ``redone_clip`` / ``redone_inf`` (steps undone and made again because
        the clip coefficient was below 1.0 / found_inf was set), ``redone_buckets``,
        ``discarded`` (steps rolled back by :meth:`discard_failed_step`), ``held_back``
        (steps that did not speculate: after redos, or after a step that clipped), and
        ``backup_nbytes`` (pageable host bytes of the pre-step copies, kept between steps),
        ``device_extra_peak_nbytes`` (the most device bytes speculation held beyond the run
        without it, measured at each speculative step's start and end; documented bound:
        ``offloadopt.step.speculate.DEVICE_BOUND_NBYTES``, 8 bytes, the factors of one step).
        None without ``speculate``."""
        spec = self._speculation
        if spec is None:
            return None
        return {**spec.counts, "backup_nbytes": spec.backup_nbytes,
                "device_extra_peak_nbytes": spec.device_extra_peak_nbytes}  # fmt: skip
