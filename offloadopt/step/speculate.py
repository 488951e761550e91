"""Speculative updates (``speculate=True``): backward mode's offloaded updates start during
backward although a clip (``max_grad_norm=``) or an attached GradScaler would make them wait
for its end, and are validated there.

[Note: speculative updates]
- Without speculation a clip coefficient or a GradScaler's found_inf needs every grad, so
  every offloaded update waits for the end of backward (start.py's note). In stable training
  the coefficient is exactly 1.0 (torch clamps it there) and found_inf is 0, so the update
  made from the grads as they stand is the one the check would have allowed. Pipeline-parallel
  training's "optimizer post validation" (Qi et al., zero-bubble pipeline parallelism, ICLR
  2024) steps eagerly on that assumption and rolls back on a trigger; DeepSpeed's Reflow
  commits the fp32 state only after the checks.
- Here a bucket complete during backward is fed at once with the factors a passing check
  gives: no clip factor; the GradScaler's inverse scale (with ``max_grad_norm``) or its scale
  for the kernel (without), and a found_inf of 0. On the worker, just before its update,
  the bucket's pre-step host state (its range of the master, or of the host copy of the
  weights, and of every state key) is kept in a backup for that bucket
  (:meth:`Speculation.save`; pageable host memory, allocated at the bucket's first
  speculation and reused). Adam/AdamW's update copies it out itself: the CPU kernel
  (offloadopt/kernels/adam_cpu.cpp) copies each cache-sized run of the state to the backup,
  with streaming stores, just before it updates that run, so the backup adds 12 bytes
  written per fp32 param to the update's 28 moved (a copy before the update added 36, and
  made the update 2.5x slower on the GPU host: benchmarks/results/2026-12-03-speculate-h200).
  The kernel's all-fp32 mode is bitwise torch's fused kernel (tests/test_kernels.py), which
  the non-speculative path runs. Other rules (SGD), and hosts where the kernel does not
  build or is not bitwise torch's (no AVX2), copy before the update. ``step`` is advanced
  on the training thread before any update and is the same for the speculative and the
  final update.
- At the end of backward the optimizer decides the clip and found_inf as before, then reads
  both on the host (one device sync). A coefficient of exactly 1.0 and no inf: the
  speculative results stand, bitwise the results of the non-speculative path (the same grads
  reach the same kernel: ``g * 1.0`` is ``g``, a bf16 grad upcasts exactly). Otherwise the
  speculative run stops: the buckets the worker has not started are dropped, each one whose
  update ran waits for its H2D to finish reading the host master (I3) and gets its backup
  copied back, and every bucket is fed again with the true factors: the non-speculative
  path's arithmetic from the same pre-step state (for an inf step the kernel skips and the
  H2D writes the old weights back).
- The next forward reads the params only after ``step()``, which comes after the end of
  backward: the compute stream waits for the redo's H2D, queued on the same side stream after
  the speculative one. A checkpoint cannot hold unvalidated state: ``state_dict()`` refuses a
  step whose updates started and did not end.
- The device grads must outlive validation (a redo copies them again): ``release_grads`` is
  refused with ``speculate``.
- GPU memory: speculation adds none beyond the run without it (the same options), but the
  factors of a check that passes: at most :data:`DEVICE_BOUND_NBYTES` per step (two 0-dim
  fp32 tensors, a GradScaler's inverse scale and found_inf of 0). The backups are pageable
  host memory (``backup_nbytes``); a redo feeds the same grads through the same staging slots;
  a step's grads are freed when it ends, as without speculation. A speculative step once held
  itself in a reference cycle (its buckets' ``before`` closed over the step), so an ended step
  kept its grads, and a dropped optimizer its whole state (the Updater, through the worker's
  run), until Python's gc ran: on the GPU host a run peaked 18.8 GB above the same run without
  speculation (issue 46; the next call, whose gc came earlier, did not). :meth:`Speculation.
  device_extra_nbytes` counts what speculation holds on the device now (the factors, and the
  grads of ended speculative steps still alive); ``opt.speculation["device_extra_peak_nbytes"]``
  its peak, checked at each speculative step's start and end (tests/test_speculate.py). Under DDP (``ddp=``: buckets speculate once their all-reduce is
  done) and FSDP2 (after each reduce-scatter) the norm and found_inf are global, so every rank
  makes the same decision at the end of backward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from offloadopt.link.layout import Bucket
from offloadopt.link.pipeline import BucketWork
from offloadopt.place.placer import Placer
from offloadopt.step.amp import AmpInputs, inverse
from offloadopt.step.scaling import Scaling
from offloadopt.step.step import Phase, Step

__all__ = ["DEVICE_BOUND_NBYTES", "Speculation"]

# The documented bound on speculation's extra device memory: the factors of one step (above)
DEVICE_BOUND_NBYTES = 8


class Speculation:
    """The backups and the validation of speculative updates (the note above).

    Args:
        scaling: the optimizer's :class:`~offloadopt.step.scaling.Scaling` (the clip and the
            attached GradScaler).
        placer: the :class:`~offloadopt.place.placer.Placer`: its ``transfers()`` (I3's
            waits) and its current ``buckets`` (a new placement's drop the old ones' backups).
        timeout_s: the longest wait for the worker, in seconds.
        in_kernel: ``in_kernel(bucket)``: whether the bucket's update copies its pre-step state
            out itself (``Updater.backs_up_in_kernel``); None: never.

    Attributes:
        counts: since construction: ``steps`` (steps with a speculative update),
            ``buckets`` (bucket updates made speculatively), ``redone_clip`` and
            ``redone_inf`` (steps redone because the clip coefficient was below 1.0, or
            found_inf was set), ``redone_buckets`` (bucket updates undone by those steps; a
            bucket fed speculatively that the worker had not started is dropped instead, and
            counts nowhere), ``discarded`` (steps rolled back by ``discard_failed_step()``,
            their bucket updates counted in ``buckets``), ``held_back`` (steps that did not
            speculate: after redos, or after a step that clipped; :meth:`wants`). A step
            whose clip coefficient is not finite or 0 (an inf or NaN grad without a
            GradScaler) counts as a clip.
    """

    def __init__(self, scaling: Scaling, placer: Placer, timeout_s: float, in_kernel=None):
        self.scaling, self.placer, self.timeout_s = scaling, placer, timeout_s
        self.in_kernel = in_kernel or (lambda b: False)
        # False: always the copy before the update (benchmarks/overlap_bench.py's "copybk")
        self.kernel_backup = True
        self.backups: dict[Bucket, list[torch.Tensor]] = {}  # per bucket: its ranges' copies
        self.counts = dict(
            steps=0, buckets=0, redone_clip=0, redone_inf=0, redone_buckets=0, discarded=0,
            held_back=0,
        )  # fmt: skip
        self.hold_len = 0  # the back-off after redos in a row: 1, 2, 4, ... MAX_HOLD steps
        self.hold_left = 0  # steps still held back
        self.clipped = False  # the last step whose coefficient is known clipped (wants)
        self._coef_host: torch.Tensor | None = None  # observe's copy of the coefficient
        self._coef_landed: Any = None  # its copy's CUDA event (None: on the CPU, done)
        self._coef_pending = False  # a copy queued and not read yet
        self.steps: list[weakref.ref] = []  # the speculative steps, weakly: ended ones must die
        self.device_extra_peak_nbytes = 0  # device_extra_nbytes' peak, at each step's ends

    def device_extra_nbytes(self) -> int:
        """Device bytes held because of speculation now: the factors of the steps still alive
        (``st.speculative``) and what ended speculative steps still hold on the device (their
        buckets' grad views not yet dropped, their grads' norms; none should be alive, see
        the note: an ended step alive also holds, through its run, the Updater and its state).
        Host tensors (the backups) are not counted; on the CPU path the params' device is the
        CPU, and the grads count as device bytes there too."""
        seen: set[int] = set()
        total = 0
        alive = [st for st in (ref() for ref in self.steps) if st is not None]
        self.steps = [weakref.ref(st) for st in alive]
        for st in alive:
            scale, amp = st.speculative  # made here: the inverse scale, found_inf's zero
            made = (*(scale if isinstance(scale, tuple) else (scale,)), amp and amp.found_inf)
            tensors = [t for t in made if isinstance(t, torch.Tensor)]
            if st.phase is Phase.PUBLISHED:  # ended: whatever it still holds is extra
                tensors += [g for w in st.fed.values() for g in w.grads]
                tensors += list(st.fingerprints.values())
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    def account(self) -> int:
        """:meth:`device_extra_nbytes` now, its peak kept; returns it."""
        now = self.device_extra_nbytes()
        self.device_extra_peak_nbytes = max(self.device_extra_peak_nbytes, now)
        return now

    @property
    def backup_nbytes(self) -> int:
        """Host bytes held by the backups (pageable)."""
        return sum(t.numel() * t.element_size() for ts in list(self.backups.values()) for t in ts)

    # The most steps held back after redos in a row (0: every step speculates). A redone step
    # costs more than one that never speculated (its updates made twice, its backups written),
    # and while the norm stays over max_grad_norm every speculative step is redone: on the GPU
    # host, GPT-2 1.5B clipped at 1.0 (norm 11.7) stepped 1.48x slower at fraction 0.1 with
    # speculation than without (benchmarks/results/2026-12-06-triton-device-pass-h100).
    MAX_HOLD = 8
    # Whether a step after one that clipped is held back: grad norms change slowly, so while
    # they stay over max_grad_norm the next step would clip too and be redone. Every step's
    # clip coefficient is known at its end of backward (a held-back step's is copied to the
    # host without a sync there, :meth:`observe`), so following it costs no probing step.
    FOLLOW_CLIP = True

    def wants(self, st: Step) -> bool:
        """Whether ``st`` speculates: decided once per step. Not when the last step clipped
        (:attr:`FOLLOW_CLIP`: its coefficient, copied to the host at its end of backward, if
        it has landed; else the one before). After a redo the next step does not either,
        after another redo in a row the next 2, 4, ... up to :attr:`MAX_HOLD` steps; a
        speculative step that stands ends the back-off. Held back, a step runs the
        non-speculative path (the same bits either way)."""
        if st.speculates is None:
            st.speculates = self.hold_left <= 0 and not self._last_clipped()
            if not st.speculates:
                self.hold_left = max(0, self.hold_left - 1)
                self.counts["held_back"] += 1
        return st.speculates

    def observe(self, st: Step) -> None:
        """At the end of backward of a step that made no speculative update, once its clip
        coefficient is decided: queue its copy to the host (no sync), which the next
        :meth:`wants` reads once it has landed."""
        coef = _coefficient(st)
        if not (self.FOLLOW_CLIP and self.MAX_HOLD) or not isinstance(coef, torch.Tensor):
            return
        if self._coef_host is None:
            self._coef_host = torch.empty((), dtype=torch.float32, pin_memory=coef.is_cuda)
        self._coef_host.copy_(coef, non_blocking=True)
        self._coef_landed = None
        if coef.is_cuda:
            self._coef_landed = torch.cuda.Event()
            self._coef_landed.record()
        self._coef_pending = True

    def _last_clipped(self) -> bool:
        """Whether the last step whose coefficient is known clipped (:attr:`FOLLOW_CLIP`)."""
        if not (self.FOLLOW_CLIP and self.MAX_HOLD):
            return False
        # Its copy was queued at the last end of backward, after the norm. Not waited for:
        # the training thread may run ahead of the GPU by more than a step's forward, and a
        # wait here would take that lead away in every backward (on the GPU host, held-back
        # steps at fraction 0.2 took 7-15% longer than the clipped path with such a wait; the
        # query was not measured there yet). Not landed yet: the last coefficient read
        # stands. The decision changes no bits, so ranks that decide differently still agree.
        if self._coef_pending and (self._coef_landed is None or self._coef_landed.query()):
            self._coef_pending = False
            self.clipped = not float(self._coef_host) == 1.0  # NaN too
        return self.clipped

    def _redone(self) -> None:
        self.hold_len = min(max(1, 2 * self.hold_len), self.MAX_HOLD) if self.MAX_HOLD else 0
        self.hold_left = self.hold_len

    def factors(self, st: Step) -> Any:
        """The clip factors of ``st``'s speculative feeds (``BucketWork.scale``), and its
        GradScaler inputs set as ``st.amp`` (replaced by the real ones at the end of
        backward): what a check that passes gives (the note); the same for every speculative
        feed of ``st``."""
        if st.speculative is not None:
            return st.speculative[0]
        # set_offload_fraction made new buckets: drop the old ones' backups. list(): with
        # wait="module" the worker may still be adding the last step's (one atomic copy)
        current = set(self.placer.buckets)
        self.backups = {b: v for b, v in list(self.backups.items()) if b in current}
        grad_scale = self.scaling.attached_scale()
        scale = amp = None
        if grad_scale is not None:
            zero = torch.zeros((), dtype=torch.float32, device=grad_scale.device)
            if self.scaling.max_grad_norm is not None:
                scale = inverse(grad_scale)  # unscaled on the device, as the clip path does
                amp = AmpInputs(None, zero)
            else:
                amp = AmpInputs(grad_scale, zero)  # the kernel unscales
        st.amp = amp
        st.speculative = (scale, amp)
        self.counts["steps"] += 1
        self.steps.append(weakref.ref(st))
        self.account()  # the steps before have ended: none should hold anything
        return scale

    def saver(self, st: Step):
        """The ``BucketWork.before`` of ``st``'s speculative feeds: :meth:`save`, noting the
        bucket in ``st.backed_up`` (per step: a bucket of an earlier step that the worker
        reached after that step's validation must not count for a later one)."""

        backed_up = st.backed_up  # not st: the step's BucketWorks hold this closure

        def before(work: BucketWork) -> None:
            self.save(work)
            backed_up.add(work.bucket)

        return before

    def save(self, work: BucketWork) -> None:
        """On the worker, before ``work``'s update: keep the bucket's pre-step host state in
        its backup. Where the update can do it (``in_kernel``): the backup is handed to the
        update (``work.backup``), whose kernel copies each cache-sized run out just before it
        overwrites it (no second pass over the state). Otherwise: a copy of the bucket's whole
        range of each arena buffer now (one large copy each, spread over the worker's
        threads)."""
        b = work.bucket
        backup = self.backups.get(b)
        if self.kernel_backup and self.in_kernel(b):
            if backup is None:
                backup = self.backups[b] = [torch.empty_like(r) for r in self._ranges(b)]
            work.backup = backup
        elif backup is None:
            self.backups[b] = [r.clone() for r in self._ranges(b)]  # the first: allocated
        else:
            for dst, src in zip(backup, self._ranges(b), strict=True):
                dst.copy_(src)

    def restore(self, b: Bucket) -> None:
        """Copy bucket ``b``'s backup back over its host state."""
        for dst, src in zip(self._ranges(b), self.backups[b], strict=True):
            dst.copy_(src)

    def validate(self, st: Step) -> str | None:
        """At the end of backward, after ``Scaling.decide``: None when the speculative
        updates of ``st`` stand; otherwise they are undone (the run stopped, the buckets not
        started dropped, each updated bucket's host state restored, ``st``'s feed forgotten,
        so that every bucket is fed again) and the reason is returned: ``"inf"`` or
        ``"clip"``. Reads the found_inf and the clip coefficient on the host (a device
        sync).

        Raises:
            TimeoutError, WorkerError: waiting for the speculative updates.
        """
        works = [w for w in st.fed.values() if w.before is not None]
        self.account()  # this step's factors, and any ended step still alive
        if not works:
            return None
        reason = None
        if st.amp is not None and st.amp.found_inf is not None and float(st.amp.found_inf) != 0:
            reason = "inf"
        elif self.scaling.max_grad_norm is not None:
            coef = _coefficient(st)
            if coef is not None and not float(coef) == 1.0:  # NaN too
                reason = "clip"
        self._coef_pending = False  # this step's coefficient is the last one known
        self.clipped = reason == "clip"
        if reason is None:
            self.counts["buckets"] += len(works)  # every one runs (or has run)
            self.hold_len = 0
            return None
        self._redone()
        run = st.run
        # the buckets the worker has not taken yet are dropped: never updated, nothing to undo
        # (at fraction 0.2 on the GPU host the worker trails backward by a third of its work)
        run.abort()
        run.wait(self.timeout_s)  # every speculative update taken is done, its H2D queued
        transfers = self.placer.transfers()
        undone = 0
        for w in works:
            if w.bucket in st.backed_up:  # its update ran (the run is done)
                transfers[w.bucket.arena.device].wait_h2d_done(w.bucket, self.timeout_s)  # (I3)
                self.restore(w.bucket)
                undone += 1
        st.fed.clear()
        st.landing.clear()
        st.run = None
        self.counts[f"redone_{reason}"] += 1
        self.counts["buckets"] += undone  # those dropped were never made
        self.counts["redone_buckets"] += undone
        st.stats["redone_buckets"] = undone
        return reason

    def roll_back(self, st: Step, state, records) -> int:
        """A step abandoned after speculative updates began (a backward that raised, then
        ``discard_failed_step()``): its run has stopped; every bucket whose update began gets
        its pre-step host state back and its params the weights of that state (the master
        cast to the param's dtype: the weights before the step, which ``prepare`` checked
        against it); the offloaded params' ``step`` goes back, and state this step made is
        dropped. What the run without ``speculate`` leaves: nothing changed. Returns the
        buckets restored.

        Raises:
            TimeoutError: an H2D of the step did not finish in ``timeout_s``."""
        from offloadopt.shards import local

        if st.speculative is None:
            return 0
        transfers = self.placer.transfers()
        done = [b for b in st.fed if b in st.backed_up]
        for b in done:
            transfers[b.arena.device].wait_h2d_done(b, self.timeout_s)  # (I3)
            self.restore(b)
            master = b.arena.master[b.lo : b.hi]
            for s in b.segments:
                p = b.arena.params[s.k]
                local(p).detach().view(-1)[s.lo : s.hi].copy_(
                    master[s.offset : s.offset + s.hi - s.lo]
                )
        for p in st.prepared:
            if p in st.created:
                state.pop(p, None)
            elif records[p].offloaded and "step" in state.get(p, {}):
                state[p]["step"] -= 1
            if records[p].offloaded:
                records[p].mark_written(p)
        st.backed_up.clear()
        self.counts["buckets"] += len(done)
        self.counts["discarded"] += 1
        return len(done)

    @staticmethod
    def _ranges(b: Bucket) -> list[torch.Tensor]:
        """``b``'s range of the arena's master, then of each state buffer (arena order)."""
        return [b.range_of(flat) for flat in (b.arena.master, *b.arena.states.values())]


def _coefficient(st: Step) -> Any:
    """``st``'s clip coefficient (the last of its clip factors, after a GradScaler's inverse
    scale), or None without ``max_grad_norm``."""
    return st.scale[-1] if isinstance(st.scale, tuple) else st.scale
