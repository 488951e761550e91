"""Grads announced by backward: post-accumulate-grad hooks, DDP's reduced buckets, the end of
backward, gradient accumulation and grad release; a mixin of
:class:`offloadopt.optim.HybridOptimizer` (steps.py's note says when an update may start)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from offloadopt.link.layout import Bucket
from offloadopt.link.transfer import SLOTS
from offloadopt.shards import is_dtensor, local
from offloadopt.step.amp import found_inf
from offloadopt.step.step import Phase, Step

_PENDING = -2  # Step.task_id of a step begun by DDP's comm hook, before any grad hook

__all__ = ["FromBackward"]


class FromBackward:
    """Backward mode's grad sources of :class:`offloadopt.optim.HybridOptimizer` (a mixin)."""

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Mark the backward passes inside as non-final micro-steps of gradient accumulation:
        their grads stay on the device and nothing starts before the final backward (outside
        this context) or ``step()``. Without the marker, ``overlap="backward"`` treats every
        backward as final (a second backward before ``step()`` is an error)."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def _on_grad(self, p: torch.Tensor) -> None:
        """A grad hook (autograd's thread): ``p``'s grad is final for this backward (with
        ``ddp=``: accumulated locally; it is announced once reduced, by :meth:`_on_reduced`)."""
        if self._accumulating or self._holding():
            return  # auto's probe: step() feeds everything, as in step mode
        task = torch._C._current_graph_task_id()
        with self._lock:
            st = self._step
            if st is not None and st.task_id == _PENDING:
                st.task_id = task  # begun by a bucket reduced before this backward's first hook
            if st is not None and st.task_id != task:
                if st.fed:  # its updates used grads that this backward now adds to
                    what = "did not finish" if not st.backward_done else "came before step()"
                    self._abandon(
                        st,
                        f"a backward {what}, and another one started (for gradient "
                        "accumulation, run the non-final micro-steps' backward inside "
                        "opt.accumulating(); a framework that accumulates on its own, such as "
                        "transformers' Trainer or Lightning, needs overlap='step', or "
                        "overlap='backward' without grads_final, max_grad_norm and grad_scaler)",
                    )
                if st.run is not None:  # begun, nothing queued: the worker must not wait on it
                    st.run.abort()
                self._step = st = None
            if st is None:
                self._check_single_process()
                st = self._step = self._begin()
                st.task_id = task
            if self._ddp is not None:
                return  # DDP's all-reduce of its bucket announces it (hooks.DDPGrads)
            if p not in st.group_of:
                return  # no longer in any group
            st.announced.add(p)
            if self.grads_final and not self._scaling.starts_at_end():
                rec = self._records[p]
                done = [b for b in rec.buckets if b not in st.fed
                        and all(q in st.announced for q in b.params)]  # fmt: skip
                self._feed(st, [(b, self._announced_idx(st, b)) for b in done], None, early=True)
        if self.release_grads and st.run is not None:
            st.run.wait_launched(SLOTS, self.timeout_s)  # backpressure: grads do not pile up
            self._release(st)

    def _reduction_started(self, fut) -> None:
        """DDP's comm hook launched a bucket's all-reduce (autograd's thread)."""
        with self._lock:
            self._reductions.append(fut)

    def _on_reduced(self, params: list[torch.Tensor]) -> None:
        """``ddp=``: DDP's all-reduce of a bucket holding ``params`` is done (a future's
        callback, see hooks.DDPGrads): their grads are final; complete buckets start
        (``grads_final``), or wait for the end of backward (``max_grad_norm``)."""
        if self._accumulating:
            return
        with self._lock:
            st = self._step
            if st is None:  # before this backward's first grad hook (a small first bucket)
                st = self._step = self._begin()
                st.task_id = _PENDING
            # A param DDP reduced without a grad of its own (unused this step, with
            # find_unused_parameters=True) keeps grad None: it is not announced, as in torch.
            params = [p for p in params if p in st.group_of and p.grad is not None]
            st.announced.update(params)
            if self.grads_final and not self._scaling.starts_at_end():
                mine = {b for p in params for b in self._records[p].buckets}
                done = [b for b in self.buckets if b in mine and b not in st.fed
                        and all(q in st.announced for q in b.params)]  # fmt: skip
                self._feed(st, [(b, self._announced_idx(st, b)) for b in done], None, early=True)

    def _land_and_release(self, st: Step) -> None:
        """Wait until every bucket fed so far has landed on the host, then drop its grads.

        Raises:
            TimeoutError, WorkerError: as ``step()``.
        """
        if st.run is None:
            return
        for work in list(st.run.fed):
            st.run.wait_h2d_queued(work.bucket, self.timeout_s)  # queued after it landed
        self._release(st)

    def _release(self, st: Step) -> None:
        """Drop the device grads whose every D2H has landed (release_grads), on the thread that
        owns the grads (autograd's during backward, the training thread in step())."""
        for work in st.run.take_landed():
            work.grads = []
            for p, fed in work.release:
                if p.grad is not None and p.grad is fed():  # not a later backward's new grad
                    p.grad = None
                    st.released.add(p)

    def _on_backward_end(self) -> None:
        """Autograd's final callback (the thread that called backward): complete the buckets
        whose params got no grad, and start the clipped updates. With ``ddp=``: first wait
        for this backward's all-reduces (outside the lock: their callbacks take it); none
        means a ``no_sync()`` micro-step, which starts nothing."""
        if self._ddp is not None:
            with self._lock:
                futures, self._reductions = self._reductions, []
            for fut in futures:
                fut.wait()  # gloo: done; NCCL: the current stream waits for it
            if not futures:
                with self._lock:
                    if self._step is not None:
                        self._step.phase = Phase.BACKWARD_DONE
                return
        if self._accumulating:
            return  # a marked micro-step: its grads are not final
        with self._lock:
            st = self._step
            if st is None or st.backward_done:
                return
            st.phase = Phase.BACKWARD_DONE
            # Every grad that exists now is final, hooked in this backward or not: one that
            # only earlier micro-steps accumulated (their hooks returned under
            # accumulating()), or a zero grad that zero_grad(set_to_none=False) left on a
            # param this backward did not reach. torch updates both; so do we
            # (tests/test_overlap.py, test_grads_no_hook_announced_are_updated_at_backward_end).
            params = [p for p in st.group_of if p.grad is not None]
            st.announced.update(params)
            scale = self._scaling.attached_scale()
            if self.max_grad_norm is not None or scale is not None:
                inf = None
                if scale is not None:  # the scaler's check, made here (offloadopt/step/amp.py)
                    inf = found_inf([local(p.grad) for p in params], scale.device)
                self._scaling.decide(st, params, scale, inf)
            elif not self.grads_final:
                return
            items = [(b, self._announced_idx(st, b)) for b in self._forward_order()
                     if b not in st.fed]  # fmt: skip
            self._feed(st, [(b, idx) for b, idx in items if idx], st.scale, early=True)

    def _holding(self) -> bool:
        """offload_fraction="auto"'s probe: updates wait for ``step()``, so that its window
        measures forward and backward alone (auto.AutoFraction.holds)."""
        return self._auto is not None and self._auto.holds

    def _announced_idx(self, st: Step, b: Bucket) -> list[int]:
        return [n for n, s in enumerate(b.segments) if b.arena.params[s.k] in st.announced]

    def _forward_order(self) -> list[Bucket]:
        """Buckets in the order the next forward reads them (first-registered params first)."""
        return self.buckets[::-1]

    def _check_single_process(self) -> None:
        """A hook's grad is reduced: one process, FSDP2's (sharded, hooks after reduce), or
        announced by DDP's comm hook (``ddp=``)."""
        dist = torch.distributed
        if (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
            and self._ddp is None
            and not all(is_dtensor(p) for p in self._records)
        ):
            raise RuntimeError(
                f"overlap='backward' with a world size of {dist.get_world_size()} and params "
                "that are not FSDP2's: a grad hook sees DDP's un-reduced grad (no DDP grad "
                "source is attached yet); use FSDP2, overlap='step' or overlap='delayed'"
            )
