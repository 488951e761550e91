"""What a step refuses before any state changes: a grad the update cannot use, a grad set,
dropped or edited after its bucket's update started during backward (start.py's note), a
closed optimizer; what ``state_dict()`` refuses (a snapshot of a step half applied); and the
warning for a group value set after the step's updates began. :class:`Guards` owns these
checks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from offloadopt.place.placer import Placer
from offloadopt.place.records import ParamRecord
from offloadopt.shards import is_dtensor, local
from offloadopt.step.scaling import Scaling
from offloadopt.step.step import Step, Timeline, stop_run

__all__ = ["Guards"]


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 L2 norms of ``grads`` (one foreach launch per device and dtype, no copies)."""
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32)) if grads else []


class Guards:
    """The refusals of :class:`offloadopt.optim.HybridOptimizer`'s steps.

    Args:
        records: the optimizer's param -> :class:`ParamRecord` map (stable for its lifetime:
            names, ``offloaded``, buckets).
        timeline: the optimizer's :class:`offloadopt.step.step.Timeline`: ``refuse(why)``; its
            ``name`` (the optimizer's class) for messages.
        scaling: the optimizer's :class:`~offloadopt.step.scaling.Scaling` (its attached
            ``grad_scaler``, a hint in one message).
        warn_once: ``warn_once(key, message)``: warns once per ``key`` for the optimizer.
        placer: the :class:`~offloadopt.place.placer.Placer` (its ``pipeline``, None before
            the first offloaded bucket: its worker's liveness).

    Owns nothing but the checks; a refusal that follows updates already started marks the
    timeline refused (``refuse(why)``) before it raises.
    """

    def __init__(self, records: dict[torch.Tensor, ParamRecord], timeline: Timeline,
                 scaling: Scaling, warn_once: Callable[[str, str], None], placer: Placer):  # fmt: skip
        self.records = records
        self.timeline = timeline
        self.scaling = scaling
        self.warn_once = warn_once
        self.placer = placer

    def grads_to_update(self, st: Step, timeout_s: float) -> list[torch.Tensor]:
        """The params whose grad ``step()`` updates now (those with a grad not fed during
        backward: the others were checked then, and their grads may be released now), after
        :meth:`check_step`. A refusal with updates started in backward ends their run first,
        so the next step's run is not queued behind it forever (waiting up to ``timeout_s``
        seconds for the worker's bucket in hand).

        Raises:
            RuntimeError: as :meth:`check_step`.
        """
        try:
            with_grad = [p for p in st.group_of if p not in st.versions and p.grad is not None]
            self.check_step(st, with_grad)
        except BaseException:
            if st.run is not None:
                stop_run(st.run, timeout_s)
            raise
        return with_grad

    def check_step(self, st: Step, with_grad: list[torch.Tensor]) -> None:
        """Inside ``step()``, before any state changes: every grad in ``with_grad`` (the
        params with a grad not fed during backward) can be used, and none of the grads fed
        during backward was set late, dropped or edited since; the optimizer is not closed.

        Raises:
            RuntimeError: the first refusal found, naming the param (``check_grad``'s, a grad
                set, set to None or changed after its bucket's update started, a closed
                optimizer).
        """
        records = self.records
        for p in with_grad:
            self.check_grad(p)
        # A grad that appeared after its bucket's update started (set by hand after
        # backward): that update ran without it, and it cannot be fed again.
        for p in with_grad if st.fed else ():  # step mode: nothing started early
            if any(b in st.fed for b in records[p].buckets):
                self.timeline.refuse(f"the grad of {records[p].name} came after its update")
                raise RuntimeError(
                    f"the grad of {records[p].name} was set after its bucket's update "
                    "started (at the end of backward, or during it with grads_final=True); "
                    "set grads before backward ends, or leave grads_final and "
                    "max_grad_norm unset so that updates wait for step()"
                )
        # Each grad is read once: with release_grads the worker sets p.grad to None at any
        # moment (tests/test_overlap.py ran into a None between two reads).
        moved = {}
        dropped = []
        for p, (grad, version) in st.versions.items():
            now = p.grad
            if now is None:
                if p not in st.released:
                    dropped.append(p)
            elif now is not grad() or local(now)._version != version or now.shape != p.shape:
                moved[p] = now  # (``grad.data = x`` leaves the object and its version)
        if dropped:
            # A fresh user's finding: model.zero_grad() (or p.grad = None) between
            # backward and step() to skip a step, after the step's updates began: they
            # were applied anyway, silently (opt.zero_grad() refuses).
            names = ", ".join(records[p].name for p in dropped[:3])
            self.timeline.refuse(
                f"the grads of {len(dropped)} params were dropped after their update"
            )
            raise RuntimeError(
                f"the grads of {len(dropped)} params ({names}"
                f"{', ...' if len(dropped) > 3 else ''}) were set to None after their "
                "buckets' updates started (at the end of backward, or during it with "
                "grads_final=True): those updates ran with the grads as backward left "
                "them, so dropping the grads did not skip this step. To skip steps (a "
                "non-finite loss), leave grads_final and max_grad_norm unset so that "
                "updates wait for step() (an attached GradScaler, grad_scaler=, skips a step "
                "whose grads hold an inf or NaN by itself)"
            )
        same = self.same_values(st, {p: g for p, g in moved.items() if g.shape == p.shape})
        for p in moved:
            if p not in same:
                self.timeline.refuse(f"the grad of {records[p].name} changed after its update")
                hint = ("with grad_scaler= attached, leave out scaler.unscale_(opt) and "
                        "clip with max_grad_norm=" if self.scaling.grad_scaler is not None else
                        "clip or scale through the optimizer: max_grad_norm=, grad_scaler=, "
                        "or leave grads_final and speculate False; a grad hook that edits the "
                        "grad must be registered before the optimizer is built")  # fmt: skip
                raise RuntimeError(
                    f"the grad of {records[p].name} changed after its bucket's update "
                    f"started during backward ({hint}; mark non-final micro-steps with "
                    "opt.accumulating())"
                )
        self.check_worker()  # a closed optimizer changes nothing

    def same_values(self, st: Step, moved: dict[torch.Tensor, torch.Tensor]) -> set:
        """Of the params in ``moved`` (param -> its grad now, whose version moved after its
        update started), those whose norm is unchanged (one host sync, on this rare path)."""
        have = [p for p in moved if p in st.fingerprints]
        if not have:
            return set()
        now = torch.stack(_norms([local(moved[p]) for p in have])).cpu()
        then = torch.stack([st.fingerprints[p] for p in have]).cpu()
        # NaN == NaN here: GradScaler's own check rewrites a grad holding a NaN unchanged
        same = ((now == then) | (now.isnan() & then.isnan())).tolist()
        return {p for p, ok in zip(have, same, strict=True) if ok}

    def check_grad(self, p: torch.Tensor) -> None:
        """``p``'s grad can be used, and an offloaded ``p`` copied as one flat range (before
        any of this step's buckets is queued); a param on the device may be non-contiguous,
        as with torch's fused AdamW.

        Raises:
            RuntimeError: a non-contiguous offloaded param, a sparse grad, a grad sharded
                unlike its DTensor param, or a grad whose shape differs from the param's.
        """
        rec = self.records[p]
        if rec.offloaded and not local(p).is_contiguous():
            raise RuntimeError(
                f"{rec.name} is not contiguous (its data was replaced by a "
                f"non-contiguous tensor of strides {tuple(local(p).stride())}, e.g. "
                "p.data = w.t()): an offloaded param is copied as one flat range; give it "
                "contiguous data (p.data = p.data.contiguous())"
            )
        if p.grad.layout != torch.strided:
            raise RuntimeError(
                f"{self.timeline.name} does not support sparse gradients: "
                f"{rec.name} has a {p.grad.layout} grad"
            )
        if is_dtensor(p) and (
            not is_dtensor(p.grad) or tuple(p.grad.placements) != tuple(p.placements)
        ):
            got = tuple(p.grad.placements) if is_dtensor(p.grad) else "a plain tensor"
            raise RuntimeError(
                f"the grad of {rec.name} is {got}, the param is sharded "
                f"{tuple(p.placements)}: each rank updates its own shard from a grad sharded "
                "the same way (FSDP2 reduce-scatters it so)"
            )
        if p.grad.shape != p.shape:
            raise RuntimeError(
                f"grad of {rec.name} has shape {tuple(p.grad.shape)}, param {tuple(p.shape)}"
            )
        if self.placer.rule.compressed and p.grad.dtype != p.dtype:
            # offloaded, the grad crosses the link in the param's dtype; on the device it was
            # used whole: the bits depended on the fraction (a user's finding, p.grad_dtype)
            raise RuntimeError(
                f"the grad of {rec.name} is {p.grad.dtype}, the param {p.dtype}: compressed "
                "state (state_dtype='int8'/'bf16', master_weights='bf16-sr') takes grads in "
                "their param's dtype, as torch's fused AdamW does; leave p.grad_dtype unset, "
                "or keep the default state_dtype='fp32' and master_weights=True"
            )

    def check_worker(self) -> None:
        """Raises:
        RuntimeError: the optimizer is closed (or its CPU worker stopped)."""
        pipeline = self.placer.pipeline
        if self.timeline.closed or (pipeline is not None and not pipeline.worker.alive):
            raise RuntimeError(
                f"{self.timeline.name} is closed (opt.close() was called; its CPU worker is "
                "stopped): build a new optimizer and load this one's state_dict() to go on"
            )

    def check_snapshot(self) -> None:
        """Before ``state_dict()`` copies the state (nothing in flight): the optimizer is not
        inconsistent, and no step's updates have started before ``step()``.

        Raises:
            RuntimeError: a failed step or load (the timeline's refusal); this step's updates
                started during backward (an unfinished backward, or one not yet followed by
                ``step()``).
        """
        self.timeline.raise_if_broken()
        if self.timeline.updates_started():
            # Some offloaded params hold this step's update, the others not yet: no
            # checkpoint of that resumes as any run would.
            if not self.timeline.current.backward_done:  # interrupted: step() will refuse it too
                if torch._C._current_graph_task_id() != -1:  # a hook of that backward
                    raise RuntimeError(
                        f"{self.timeline.name}.state_dict() during backward (from one of its "
                        "hooks): this step's updates have started, so some params hold their "
                        "new values and others not; call state_dict() after step()"
                    )
                undo = ""
                if self.timeline.current.speculative is not None:
                    undo = " (speculate=True: it rolls this step's updates back)"
                raise RuntimeError(
                    f"{self.timeline.name}.state_dict(): this step's updates started during a "
                    "backward that has not finished (interrupted, or still running in another "
                    "thread), so some params were updated and others not; after an interrupt "
                    "call opt.load_state_dict(...) to restore a checkpoint, or "
                    f"opt.discard_failed_step() to go on from here{undo}"
                )
            raise RuntimeError(
                f"{self.timeline.name}.state_dict() between backward and step(): this step's "
                "updates started during backward (grads_final, max_grad_norm or grad_scaler "
                "with overlap='backward') and end in step(); call state_dict() after step()"
            )

    def check_load(self) -> None:
        """Before ``load_state_dict()`` changes anything: a step whose updates started during
        a backward that has ended, and that ``step()`` has yet to finish, is refused (a fresh
        user's finding: the load was taken, the updated params' new weights stayed, and the
        next ``step()`` matched neither run). After an interrupted backward or a failed step
        a load is the way back, and goes on.

        Raises:
            RuntimeError: that step in progress; nothing was changed.
        """
        st = self.timeline.current
        if self.timeline.broken is None and self.timeline.updates_started() and st.backward_done:
            raise RuntimeError(
                f"{self.timeline.name}.load_state_dict() between backward and step(): this "
                "step's updates started during backward (grads_final, max_grad_norm or "
                "grad_scaler with overlap='backward') and some params hold their new weights "
                "already, which a load cannot take back; call load_state_dict() after step() "
                "(or before backward); nothing was changed"
            )

    def check_zero_grad(self) -> None:
        """Before ``zero_grad()`` changes anything: once this step's updates began (declared
        backward mode), zeroing the grads cannot skip it (they ran with backward's grads). A
        fresh user's finding: the usual skip of a step with a non-finite loss was silently an
        update.

        Raises:
            RuntimeError: between backward and ``step()`` once the updates began; nothing was
                changed.
        """
        if self.timeline.updates_started():
            started = len(self.timeline.current.fed)
            if not self.timeline.current.backward_done:  # step() refuses it: say what does
                raise RuntimeError(
                    f"zero_grad(): this step's updates began ({started} buckets) during a "
                    "backward that did not finish; nothing was changed. Call "
                    "opt.discard_failed_step() first (with speculate=True it rolls those "
                    "updates back), or opt.load_state_dict(...) to restore a checkpoint"
                )
            raise RuntimeError(
                f"zero_grad() between backward and step(): this step's updates already began "
                f"({started} buckets, at the end of backward or during it with "
                "grads_final=True), so zeroing the grads cannot skip the step; nothing was "
                "changed. Call step() to finish it, or, to be able to skip steps (a "
                "non-finite loss), leave grads_final and max_grad_norm unset so that updates "
                "wait for step() (an attached GradScaler, grad_scaler=, skips a step whose "
                "grads hold an inf or NaN by itself)"
            )

    def warn_if_hypers_moved(self, st: Step, param_groups: list[dict]) -> None:
        """A group value set between backward and ``step()`` after this step's updates began
        (declared backward mode froze the values at its first update: the whole step uses
        those, the new ones apply from the next step). torch reads them in ``step()``; say so,
        once (a fresh user's finding: an lr set after backward was silently a step late)."""
        for gi, group in enumerate(param_groups):
            hyper = st.hypers.get(id(group))
            if hyper is None:
                continue
            for key, frozen in hyper.values.items():
                now = group.get(key)
                if isinstance(now, torch.Tensor) or isinstance(frozen, torch.Tensor):
                    continue  # a tensor lr: comparing it would sync with the device
                if now != frozen:
                    self.warn_once(
                        "hypers-moved",
                        f"param group {gi}'s {key} changed from {frozen!r} to {now!r} after this "
                        "step's updates started during backward (overlap='backward' with "
                        "grads_final, max_grad_norm or grad_scaler freezes a step's values at "
                        "its first update): this step used the old value, and the new one "
                        "applies from the next step. Set hyperparameters before backward (or "
                        "step the scheduler after opt.step())",
                    )
                    return
