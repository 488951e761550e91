"""WHEN an update may start: the start policy, chosen once from the options (the note below
has the rules). :class:`AtStep`: every update starts inside ``step()`` (step mode, the delayed
update, backward mode without a declaration). :class:`FromBackward`: backward announces grads
(post-accumulate-grad hooks, DDP's reduced buckets, autograd's end-of-backward callback) and
complete buckets start during backward (``grads_final``) or all at its end (``max_grad_norm``,
an attached GradScaler); each backward asks :class:`~offloadopt.step.scaling.Scaling` which,
since an attached GradScaler may be disabled. Both mark gradient accumulation's non-final
micro-steps (``opt.accumulating()``).

[Note: when an update may start]
- ``overlap="step"`` (default): everything happens inside ``step()``.
- ``overlap="backward"``: post-accumulate-grad hooks announce each offloaded grad. A bucket is
  *complete* when every param in it has been announced, or when backward ends (autograd's final
  callback: a param that gets no grad cannot hang a bucket). Its update may start early only
  when nothing can change the grads after backward:
  - ``grads_final=True`` (the caller declares it) and no clipping: at completion, during
    backward;
  - ``max_grad_norm=`` (clipping through the optimizer): at the end of backward, once the
    global norm is known (the coefficient multiplies the fp32 grads on the device before D2H);
  - ``grad_scaler=`` (a GradScaler attached): at the end of backward, once every grad has
    been checked for infs (offloadopt/step/amp.py's note);
  - otherwise (torch's ``clip_grad_norm_``, an unattached GradScaler, a hand edit may
    follow): inside ``step()``, as in step mode.
  Non-final micro-steps of gradient accumulation run under ``with opt.accumulating():`` and
  announce nothing; the last micro-step is never inferred from counts. An update that started
  from a grad changed afterwards (``grad._version`` moved) is an error naming the param.
- ``wait="step"`` (default): ``step()`` returns once every copy back is queued and the compute
  stream waits for them. ``wait="module"``: ``step()`` returns at once; each module watched with
  ``opt.watch(model)`` waits, before its forward, for its own params' copies only;
  ``opt.synchronize()`` waits for everything (``state_dict()``, ``load_state_dict()``,
  ``add_param_group()``, ``zero_grad(set_to_none=False)`` and ``close()`` call it).
- ``overlap="delayed"`` (the delayed parameter update): ``step()`` reads the grads (after any
  clipping or scaling), queues every offloaded bucket, takes the grads from their params and
  returns. The worker's H2D writes each param's landing buffer (``ParamRecord.landing``), not
  the param, so the next forward and backward read the weights of the step before; the next
  ``step()``, or anything that calls ``synchronize()``, waits for the update and copies the
  landed weights in on the stream that reads them (delayed.py's ``NextStep``), and only then are
  the params marked written (the stale-master check must not see our own copy as an edit).
- A step is consistent or refused: if a backward that started updates fails part-way, or a
  second backward comes before ``step()``, the optimizer refuses ``step()`` and
  ``state_dict()`` until ``load_state_dict()`` or ``opt.discard_failed_step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from offloadopt.link.layout import Bucket
from offloadopt.link.transfer import SLOTS
from offloadopt.options import Options
from offloadopt.place.placer import Placer
from offloadopt.shards import is_dtensor, local
from offloadopt.step.amp import found_inf
from offloadopt.step.feed import Feeder
from offloadopt.step.hooks import BackwardEnd, DDPGrads, GradHooks
from offloadopt.step.scaling import Scaling
from offloadopt.step.speculate import Speculation
from offloadopt.step.step import Phase, Step, Timeline

_PENDING = -2  # Step.task_id of a step begun by DDP's comm hook, before any grad hook

__all__ = ["AtStep", "FromBackward", "start_policy"]


class AtStep:
    """Every update starts inside ``step()``: nothing listens to backward.

    Attributes:
        depth: how many ``opt.accumulating()`` contexts are open.
        marked: the ``opt.accumulating()`` blocks entered since the last ``step()`` began
            (:meth:`take_micro_steps`).
    """

    hooks = False  # no grad hooks, no DDP comm hook

    def __init__(self) -> None:
        self.depth = 0
        self.marked = 0
        self.grad_hooks: list[GradHooks] = []  # the offloaded params' (FromBackward)
        self.ddp_hook: DDPGrads | None = None  # ddp=: DDP's comm hook (FromBackward)

    def hook(self, params: list[torch.Tensor]) -> None:
        """The Placer placed ``params`` on the host: nothing listens here."""

    def remove_hooks(self) -> None:
        """Take every hook off (``close()``; idempotent). DDP keeps its comm hook: a plain
        all-reduce from then on."""
        for hooks in self.grad_hooks:
            hooks.remove()
        self.grad_hooks = []
        if self.ddp_hook is not None:
            self.ddp_hook.remove()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Mark the backward passes inside as non-final micro-steps of gradient accumulation:
        their grads stay on the device and nothing starts before the final backward (outside
        this context) or ``step()``. Without the marker, ``overlap="backward"`` treats every
        backward as final (a second backward before ``step()`` is an error). Each block counts
        as one non-final micro-step (:meth:`take_micro_steps`)."""
        self.depth += 1
        self.marked += 1
        try:
            yield
        finally:
            self.depth -= 1

    def take_micro_steps(self) -> int:
        """At ``step()``: the micro-steps of the step, 1 + the ``accumulating()`` blocks
        entered since the last (one per non-final micro-step, as the docs write them; one
        block around several backward passes counts once); the count starts again.
        ``offload_fraction="auto"`` reads it (place/auto.py: backward mode's window)."""
        n, self.marked = 1 + self.marked, 0
        return n


class FromBackward(AtStep):
    """Updates start from backward's announcements (the hooks in hooks.py call
    :meth:`on_grad`, :meth:`on_reduced`, :meth:`reduction_started` and
    :meth:`on_backward_end`, holding this object weakly).

    Args:
        timeline: the optimizer's Timeline (its lock and the step being fed).
        placer: the Placer (records, buckets in forward order, auto's probe).
        feeder: the Feeder that begins the step at its first announcement, queues complete
            buckets and releases landed grads.
        scaling: the Scaling that decides a clip or a GradScaler's inputs at backward's end.
        grads_final, release_grads: the options of those names.
        ddp: whether DDP's comm hook announces grads (``ddp=``).
        timeout_s: the longest wait for the worker, in seconds.
        speculation: ``speculate=True``'s :class:`~offloadopt.step.speculate.Speculation`
            (updates start during backward under a clip or a GradScaler, validated at its
            end), or None.
    """

    hooks = True

    def __init__(
        self,
        timeline: Timeline,
        placer: Placer,
        feeder: Feeder,
        scaling: Scaling,
        *,
        grads_final: bool,
        release_grads: bool,
        ddp: bool,
        timeout_s: float,
        speculation: Speculation | None = None,
    ):
        super().__init__()
        self.speculation = speculation
        self.timeline, self.placer, self.feeder, self.scaling = timeline, placer, feeder, scaling
        self.grads_final, self.release_grads = grads_final, release_grads
        self.ddp, self.timeout_s = ddp, timeout_s
        self.reductions: list = []  # ddp=: this backward's all-reduce futures
        # on_backward_end once per backward, whichever hook fires first (GradHooks, DDPGrads)
        self.backward_end = BackwardEnd(self)

    def hook(self, params: list[torch.Tensor]) -> None:
        """The Placer placed ``params`` on the host: their post-accumulate-grad hooks (and
        the end-of-backward callback) announce each grad to this policy."""
        self.grad_hooks.append(GradHooks(self, params, self.backward_end))

    def hook_ddp(self, ddp: torch.nn.Module) -> None:
        """``ddp=``: DDP's comm hook announces each reduced bucket (hooks.DDPGrads).

        Raises:
            RuntimeError: the DDP model has a comm hook already (DDP takes one).
        """
        self.ddp_hook = DDPGrads(self, ddp, self.backward_end)

    def on_grad(self, p: torch.Tensor) -> None:
        """A grad hook (autograd's thread): ``p``'s grad is final for this backward (with
        ``ddp=``: accumulated locally; it is announced once reduced, by :meth:`on_reduced`)."""
        if self.depth or self.holding():
            return  # auto's probe: step() feeds everything, as in step mode
        task = torch._C._current_graph_task_id()
        with self.timeline.lock:
            st = self.timeline.current
            if st is not None and st.task_id == _PENDING:
                st.task_id = task  # begun by a bucket reduced before this backward's first hook
            if st is not None and st.task_id != task:
                if st.fed and not st.backward_done:  # it raised or was interrupted
                    self.timeline.abandon(
                        st,
                        "a backward did not finish (it raised, or was interrupted) after its "
                        "updates started, and another one started; after a failed backward "
                        "call opt.discard_failed_step() and opt.zero_grad() before the next",
                    )
                elif st.fed:  # its updates used grads that this backward now adds to
                    self.timeline.abandon(
                        st,
                        "a backward came before step(), and another one started (for gradient "
                        "accumulation, run the non-final micro-steps' backward inside "
                        "opt.accumulating(); a framework that accumulates on its own, such as "
                        "transformers' Trainer or Lightning, needs overlap='step', or "
                        "overlap='backward' without grads_final, max_grad_norm and grad_scaler)",
                    )
                if st.run is not None:  # begun, nothing queued: the worker must not wait on it
                    st.run.abort()
                self.timeline.current = st = None
            if st is None:
                self.check_single_process()
                st = self.timeline.current = self.feeder.begin()
                st.task_id = task
            if self.ddp:
                return  # DDP's all-reduce of its bucket announces it (hooks.DDPGrads)
            if p not in st.group_of:
                return  # no longer in any group
            st.announced.add(p)
            self.start_complete(st, self.placer.records[p].buckets)
        if self.release_grads and st.run is not None:
            st.run.wait_launched(SLOTS, self.timeout_s)  # backpressure: grads do not pile up
            self.feeder.release(st)

    def reduction_started(self, fut) -> None:
        """DDP's comm hook launched a bucket's all-reduce (autograd's thread)."""
        with self.timeline.lock:
            self.reductions.append(fut)

    def on_reduced(self, params: list[torch.Tensor]) -> None:
        """``ddp=``: DDP's all-reduce of a bucket holding ``params`` is done (a future's
        callback, see hooks.DDPGrads): their grads are final; complete buckets start
        (``grads_final``), or wait for the end of backward (``max_grad_norm``)."""
        if self.depth:
            return
        with self.timeline.lock:
            st = self.timeline.current
            if st is None:  # before this backward's first grad hook (a small first bucket)
                st = self.timeline.current = self.feeder.begin()
                st.task_id = _PENDING
            # A param DDP reduced without a grad of its own (unused this step, with
            # find_unused_parameters=True) keeps grad None: it is not announced, as in torch.
            params = [p for p in params if p in st.group_of and p.grad is not None]
            st.announced.update(params)
            mine = {b for p in params for b in self.placer.records[p].buckets}
            self.start_complete(st, [b for b in self.placer.buckets if b in mine])

    def start_complete(self, st: Step, buckets: list[Bucket]) -> None:
        """Feed those of ``buckets`` whose every param is announced and that are not fed yet,
        when an update may start before the end of backward (under the timeline's lock): with
        ``grads_final`` and nothing that waits for the end (a clip, an attached GradScaler),
        or speculatively (``speculate=True``, the factors of a check that passes; every rank
        decides alike at the end: speculate.py)."""
        at_end = self.scaling.starts_at_end()
        if self.speculation is None and (at_end or not self.grads_final):
            return
        if at_end and not self.speculation.wants(st):
            return  # held back: every bucket is fed at the end of backward
        items = [(b, _announced_idx(st, b)) for b in buckets
                 if b not in st.fed and all(q in st.announced for q in b.params)]  # fmt: skip
        if at_end:
            self.feeder.feed(st, items, self.speculation.factors(st), early=True,
                             before=self.speculation.saver(st))  # fmt: skip
        else:
            self.feeder.feed(st, items, None, early=True)

    def on_backward_end(self) -> None:
        """Autograd's final callback (the thread that called backward): complete the buckets
        whose params got no grad, and start the clipped updates. With ``ddp=``: first wait
        for this backward's all-reduces (outside the lock: their callbacks take it); none
        means a ``no_sync()`` micro-step, which starts nothing."""
        if self.ddp:
            with self.timeline.lock:
                futures, self.reductions = self.reductions, []
            for fut in futures:
                fut.wait()  # gloo: done; NCCL: the current stream waits for it
            if not futures:
                with self.timeline.lock:
                    if self.timeline.current is not None:
                        self.timeline.current.phase = Phase.BACKWARD_DONE
                return
        if self.depth:
            return  # a marked micro-step: its grads are not final
        with self.timeline.lock:
            st = self.timeline.current
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
            scale = self.scaling.attached_scale()
            if self.scaling.max_grad_norm is not None or scale is not None:
                inf = None
                if scale is not None:  # the scaler's check, made here (offloadopt/step/amp.py)
                    inf = found_inf([local(p.grad) for p in params], scale.device)
                self.scaling.decide(st, params, scale, inf)
                if self.speculation is not None and st.run is not None:
                    # the speculative updates stand, or are undone to be fed again below
                    self.speculation.validate(st)
                elif self.speculation is not None:
                    self.speculation.observe(st)  # whether it clipped, for the next step
            elif not self.grads_final and self.speculation is None:
                return
            items = [(b, _announced_idx(st, b)) for b in self.placer.forward_order()
                     if b not in st.fed]  # fmt: skip
            self.feeder.feed(st, [(b, idx) for b, idx in items if idx], st.scale, early=True)

    def holding(self) -> bool:
        """offload_fraction="auto"'s probe: updates wait for ``step()``, so that its window
        measures forward and backward alone (auto.AutoFraction.holds)."""
        return self.placer.auto is not None and self.placer.auto.holds

    def check_single_process(self) -> None:
        """A hook's grad is reduced: one process, FSDP2's (sharded, hooks after reduce), or
        announced by DDP's comm hook (``ddp=``)."""
        dist = torch.distributed
        if (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
            and not self.ddp
            and not all(is_dtensor(p) for p in self.placer.records)
        ):
            raise RuntimeError(
                f"overlap='backward' with a world size of {dist.get_world_size()} and params "
                "that are not FSDP2's: a grad hook sees DDP's un-reduced grad (no DDP grad "
                "source is attached yet); use FSDP2, overlap='step' or overlap='delayed'"
            )


def start_policy(o: Options, **owners) -> AtStep:
    """The start policy of options ``o``: :class:`FromBackward` with ``overlap="backward"``
    when grads are declared final, clipped in the optimizer or scaled by an attached
    GradScaler (``ddp=`` needs one of them); :class:`AtStep` otherwise.
    ``owners``: :class:`FromBackward`'s arguments."""
    declared = (o.grads_final or o.speculate or o.max_grad_norm is not None
                or o.grad_scaler is not None)  # fmt: skip
    if o.overlap == "backward" and declared:  # ddp= requires both (validation.py)
        return FromBackward(**owners)
    return AtStep()


def _announced_idx(st: Step, b: Bucket) -> list[int]:
    """The segments of ``b`` whose params were announced in ``st``."""
    return [n for n, s in enumerate(b.segments) if b.arena.params[s.k] in st.announced]
