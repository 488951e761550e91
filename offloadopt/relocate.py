"""Moving every param to another offload fraction: ``set_offload_fraction``, the moves
``offload_fraction="auto"`` asks for, and a placement made again for new state keys or a
cast's new dtypes (where a ``max_gpu_memory`` budget chooses again), in one owner, the
:class:`Relocator`. A move copies the state out (as ``state_dict()`` would), places
the params again (the Placer), copies the state in and rebuilds what depends on the placement
(:meth:`Relocator.rebuild_dependents`); nothing is lost and no result changes.

It sits beside the optimizer, above step/: it takes the step's owners (the start policy's grad
hooks, the publish policy's module waits, the Updater's load) as they are handed to it, and
none of them calls it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from offloadopt.interrupts import signals_deferred
from offloadopt.place import budget
from offloadopt.place.auto import AutoFraction
from offloadopt.place.costmodel import format_bytes
from offloadopt.place.placer import Placer
from offloadopt.state import checkpoint
from offloadopt.state.store import OptimizerState
from offloadopt.step.guards import Guards
from offloadopt.step.start import AtStep
from offloadopt.step.step import Timeline, recast_error
from offloadopt.step.update import Updater

__all__ = ["FractionChoice", "Relocator"]


@dataclass(frozen=True)
class FractionChoice:
    """A caller's fraction and what it replaces (``opt.placement_choice`` says it after the
    move, and a warning once): a ``max_gpu_memory`` budget, chosen or not yet, or
    ``offload_fraction="auto"`` still measuring; ``replaced`` is None when neither, or when a
    caller's fraction replaced it already."""

    fraction: float
    replaced: str | None

    @classmethod
    def of(cls, placer: Placer, fraction: float) -> FractionChoice:
        """The caller's ``fraction`` against what chose the placement so far."""
        chooser = (placer.choice or {}).get("set_by", "")
        nbytes = placer.sizes["max_gpu_memory"]
        replaced = None
        if chooser.startswith("set_offload_fraction"):
            pass
        elif nbytes is not None:
            when = "its choice" if placer.choice is not None else "before its choice"
            replaced = f"max_gpu_memory={format_bytes(nbytes)} ({when})"
        elif placer.auto is not None and placer.auto.active:
            replaced = "offload_fraction='auto' before its choice"
        return cls(fraction, replaced)

    def instead_of_budget(self, placer: Placer) -> None:
        """The budget's choice is still pending: the placement waits for this fraction
        instead, and the budget is dropped."""
        if placer.auto is not None:
            placer.auto.cancel(f"set_offload_fraction({self.fraction!r}) by the caller")
        placer.sizes["max_gpu_memory"] = None
        placer.fraction = self.fraction
        placer.choice = {"fraction": self.fraction, "set_by": "set_offload_fraction",
                         "replaced": self.replaced}  # fmt: skip

    def commit(self, placer: Placer) -> None:
        """Placed: from here the fraction is the caller's, and ``placer.choice`` says what it
        replaced."""
        if placer.auto is not None:
            placer.auto.cancel(f"set_offload_fraction({self.fraction!r}) by the caller")
        if placer.choice is not None:
            by = "set_offload_fraction"
            if "max_gpu_memory" in placer.choice:
                by += " (the budget is not checked)"
            placer.choice = {"fraction": self.fraction, "replaced": placer.choice, "set_by": by}
        elif self.replaced is not None:  # auto still measuring: no choice to keep
            placer.choice = {"fraction": self.fraction, "replaced": self.replaced,
                             "set_by": "set_offload_fraction"}  # fmt: skip

    def say(self, warn_once) -> None:
        """A warning (once) of what the caller's fraction replaced: a budget or auto dropped
        without a word was a fresh user's finding."""
        if self.replaced is not None:
            warn_once(
                "fraction-replaces-choice",
                f"set_offload_fraction({self.fraction:g}) replaces {self.replaced}: the "
                "fraction is now yours and no budget is checked again (placement_choice says so)",
            )


class Relocator:
    """Places every param again, at a fraction, with new state keys or in new dtypes, moving
    the state over.

    Args:
        placer: the Placer (the placement, the fraction and what chose it).
        state: ``opt.state`` (emptied and refilled in place, never replaced).
        updater: the Updater (copies each saved entry into the new buffers).
        start: the start policy (its ``grad_hooks``, made again by the new placement).
        publisher: the publish policy (its waits, ``module_waits`` and the watched models).
        guards: the Guards (a closed optimizer or a stopped worker is refused).
        timeline: the Timeline (the lock; no step between backward and ``step()``).
    """

    def __init__(self, placer: Placer, state: OptimizerState, updater: Updater, start: AtStep,
                 publisher: Any, guards: Guards, timeline: Timeline):  # fmt: skip
        self.placer, self.state, self.updater = placer, state, updater
        self.start, self.publisher, self.guards, self.timeline = start, publisher, guards, timeline

    # ------------------------------------------------------------------ placed, watched
    def ensure_placed(self, micro_steps: int = 1) -> None:
        """``opt.ensure_placed``: the groups waiting for their meta params placed, and the
        models given to ``watch()`` meanwhile watched; from ``step()`` with its
        ``micro_steps`` (gradient accumulation), which a budget's choice there counts."""
        if not self.placer.ensure_placed(micro_steps):
            return
        later, self.publisher.watch_later = self.publisher.watch_later, []
        for ref in later:
            model = ref()
            if model is not None:
                self.watch(model)

    def watch(self, model: torch.nn.Module) -> None:
        """``opt.watch``: the module waits of ``model`` (after a budget's choice: once placed)."""
        if self.placer.budget_pending():  # placed at the first step(): registered then
            self.publisher.watch_later.append(weakref.ref(model))
            return
        self.ensure_placed()
        offloaded = {p for p, rec in self.placer.records.items() if rec.offloaded}
        self.publisher.watch(model, offloaded)

    # ------------------------------------------------------------------ moves
    def set_fraction(self, fraction: float, by_auto: bool = False) -> None:
        """``opt.set_offload_fraction(fraction)`` (its docstring says what it does), or, with
        ``by_auto``, the move ``offload_fraction="auto"`` asked for (it records its own choice).

        Raises:
            RuntimeError: a step in flight from backward, a failed step, or a closed optimizer.
            PinnedAllocationError: the new buffers could not be had (the old placement stays).
        """
        choice = None if by_auto else FractionChoice.of(self.placer, fraction)
        if self.placer.budget_pending() and choice is not None:
            choice.instead_of_budget(self.placer)  # placed below, at the caller's fraction
            self.ensure_placed()
            choice.say(self.placer.warn_once)
            return
        self.ensure_placed()
        self.publisher.synchronize()
        self.timeline.raise_if_broken()
        self.guards.check_worker()
        # Ctrl-C or SIGTERM in the middle would leave state half copied in: they reach their
        # handler once the move is done (interrupts.signals_deferred).
        with signals_deferred(), self.timeline.lock:
            if self.timeline.current is not None:
                raise RuntimeError(
                    "set_offload_fraction() between steps only: a backward already announced "
                    "grads (call it after step())"
                )
            # A step() that ran since the wait above (on another thread: a fresh user's
            # finding) has an update in flight that writes the buffers about to be replaced.
            self.publisher.synchronize()
            self.relocate(fraction)
            if choice is not None:  # placed: from here the caller's fraction holds
                choice.commit(self.placer)
                choice.say(self.placer.warn_once)

    def for_auto(self, auto: AutoFraction, want: float | None) -> None:
        """Move the state where offload_fraction="auto" asks (``want``, from its ``end``;
        None: stay), and tell it (a failed move keeps the old placement: auto may then ask
        for another fraction)."""
        while want is not None:
            error = None
            try:
                if want != self.placer.fraction:
                    self.set_fraction(want, by_auto=True)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # the old placement stays
                error = e
            except BaseException:  # Ctrl-C at the end of the move: the state moved
                auto.moved(self.placer, None)
                raise
            want = auto.moved(self.placer, error)

    def for_new_keys(self) -> None:
        """Place every param again with the state keys its group's values need now.

        Raises:
            ValueError: as :meth:`Placer.check_new_keys`; before a step nothing changed,
                inside ``load_state_dict()`` the load fails (refused until one succeeds).
        """
        self.placer.check_new_keys()
        self.relocate(self.placer.fraction)

    def for_new_dtypes(self) -> None:
        """Place every param again in the dtype it has now (a model cast after the optimizer
        was built, before ``load_state_dict()``: the load makes the state in that dtype, as
        torch's does). The state of a cast param was made for its old dtype and is dropped
        first: the load replaces it, or drops it as it drops any param's without a saved entry
        (moved over, it would be cast silently, and a bf16 param would get a master from its
        weights with a warning the load may not deserve). A budget chooses again
        (:meth:`in_new_dtypes`)."""
        recast = [p for p, rec in self.placer.records.items() if rec.placement.dtype != p.dtype]
        if not recast:
            return
        if self.placer.keys_changed():
            self.placer.check_new_keys()  # placed with the new keys too: a budget refuses them
        self.in_new_dtypes(drop=recast)

    def in_new_dtypes(self, drop: list[torch.Tensor] | None = None) -> None:
        """Place every param again in its dtype now, at the fraction in force or, under a
        ``max_gpu_memory`` budget, at the one it chooses for these dtypes
        (:meth:`budget_for_new_dtypes`), checked before anything changes; the state of the
        params in ``drop`` is dropped first (a load replaces it)."""
        choice = self.budget_for_new_dtypes()
        for p in drop or ():
            self.state.pop(p, None)
        self.relocate(self.placer.fraction if choice is None else choice["fraction"])
        if choice is not None:  # placed: the budget's new choice holds
            self.placer.choice = choice

    def budget_for_new_dtypes(self) -> dict[str, Any] | None:
        """A ``max_gpu_memory`` budget's choice made again for the params' dtypes now (a cast
        changes the bytes of their weights, grads and state), as at the first ``step()``: the
        smallest fraction that fits, over every group, with the first choice's
        ``micro_steps`` (on a GPU the measured peak then holds what the optimizer keeps there
        already: the choice errs toward more offload). None where no budget chose the
        fraction (none given, or a caller's fraction replaced it). Changes nothing.

        Raises:
            ValueError: no fraction fits, or the host lacks the memory (``budget.choose``'s
                figures), with the cast named.
        """
        placer = self.placer
        chosen = placer.choice or {}
        if placer.sizes["max_gpu_memory"] is None or "max_gpu_memory" not in chosen:
            return None
        cast = [f"{rec.name}: {rec.placement.dtype} -> {p.dtype}"
                for p, rec in placer.records.items() if rec.placement.dtype != p.dtype]  # fmt: skip
        if not cast:
            return None
        groups = list(range(len(placer.param_groups)))
        try:
            choice = budget.choose_for(placer, groups, chosen.get("micro_steps", 1))
        except ValueError as e:
            raise ValueError(
                f"{e}; the params were cast since the budget chose offload fraction "
                f"{placer.fraction:g} ({len(cast)} params, e.g. {cast[0]}): cast the model "
                "back, or build the optimizer after casting the model"
            ) from None
        return {**chosen, **choice, "chosen_again": f"{len(cast)} params cast, e.g. {cast[0]}"}

    def refuse_recast_state(self) -> None:
        """Refuse to move the state of a param cast since its placement (it would be copied into
        the new dtype silently, and a bf16 param's master made from its weights), as step()
        refuses it, and a cast to a dtype the representation does not update
        (:meth:`refuse_unsupported_casts`), before anything changes: :meth:`relocate`'s first
        check, whoever moves.

        Raises:
            ValueError: such a param, named (``step.recast_error``).
        """
        for gi, group in enumerate(self.placer.param_groups):
            for i, p in enumerate(group["params"]):
                rec = self.placer.records.get(p)
                if rec is not None and rec.placement.dtype != p.dtype and self.state.get(p):
                    raise ValueError(recast_error(gi, i, rec.name, rec.placement.dtype, p.dtype))
        self.refuse_unsupported_casts()

    def refuse_unsupported_casts(self) -> None:
        """Refuse a param cast since its placement to a dtype the representation does not update
        (fp64 under compressed state, fp16 under bf16-sr masters), as the constructor refuses
        it, before anything changes: placed, it failed in the kernel without a name and left
        state in the new dtype behind (a user's finding).

        Raises:
            ValueError: the first such param, named (``Rule.dtype_refusal``).
        """
        for gi, group in enumerate(self.placer.param_groups):
            for i, p in enumerate(group["params"]):
                rec = self.placer.records.get(p)
                if rec is None or rec.placement.dtype == p.dtype:
                    continue
                label = (f"param group {gi}, param {i} ({rec.name}, cast from "
                         f"{rec.placement.dtype} after the optimizer was built)")  # fmt: skip
                refusal = self.placer.rule.dtype_refusal(p.dtype, label)
                if refusal is not None:
                    raise ValueError(f"{refusal}; or cast the model back to {rec.placement.dtype}")

    def for_new_placement(self) -> bool:
        """New state keys or a param's new dtype at ``step()`` (the step before was waited
        for: nothing is in flight): placed again, as torch's optimizers make a param's state
        at its first step, in its dtype; returns whether it was (False: new keys while a param
        has state, which ``begin_step`` then names). New keys need every param stateless; a
        new dtype only the cast params (a param whose grad was None so far has none): the
        others' state moves over losslessly, and a budget chooses again (:meth:`in_new_dtypes`).

        Raises:
            ValueError: before anything changes: a cast param with state, named
                (:meth:`refuse_recast_state`); new keys under a budget (:meth:`for_new_keys`);
                a budget no fraction meets in the new dtypes (:meth:`budget_for_new_dtypes`).
        """
        if self.placer.keys_changed():
            if any(self.state.get(q) for q in self.placer.records):
                return False
            self.for_new_keys()
            return True
        self.refuse_recast_state()  # checked whole before the move begins
        self.in_new_dtypes()  # a budget chooses again
        return True

    def relocate(self, fraction: float) -> None:
        """Place every param again at ``fraction`` with the groups' current values (their
        state keys included), moving the state over losslessly; the caller holds the lock,
        with signals deferred, and nothing is in flight.

        Raises:
            ValueError: a param with state cast since it was placed (:meth:`refuse_recast_state`).
            PinnedAllocationError: the new buffers could not be had (the old placement stays).
        """
        self.refuse_recast_state()
        params = [p for g in self.placer.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        # torch's state_dict() layout (param index -> entry), copied to the host
        saved = checkpoint.pack({"state": {index[p]: entry for p, entry in self.state.items()
                                           if p in index}, "param_groups": []})["state"]  # fmt: skip
        # opt.state is emptied in place, never replaced: the owners that read it (and a
        # user's reference to opt.state) keep the same object.
        old_state = dict.copy(self.state)
        old_hooks = (self.start.grad_hooks, self.publisher.module_waits)
        dict.clear(self.state)
        self.updater.flat.drop()  # the device's flat buffers: laid out again from the state
        self.start.grad_hooks, self.publisher.module_waits = [], []
        try:
            self.placer.replace(fraction)
        except BaseException:
            for hooks in (*self.start.grad_hooks, *self.publisher.module_waits):
                hooks.remove()  # a placement that failed after its hooks were registered
            dict.update(self.state, old_state)
            self.start.grad_hooks, self.publisher.module_waits = old_hooks
            raise
        for hooks in (*old_hooks[0], *old_hooks[1]):
            hooks.remove()  # the old placement's grad hooks and module waits
        self.rebuild_dependents(params, saved)

    def rebuild_dependents(self, params: list[torch.Tensor], saved: dict[int, Any]) -> None:
        """After params move between host and device, rebuild what depends on the placement:
        the state copied into the new buffers (``saved``: param index -> its entry, torch's
        layout, on the host), and the watched models' module waits registered again. The
        grad hooks were made by the placement itself (the Placer's ``on_offloaded``); the
        device's flat buffers (step/device_flat.py), dropped with the old placement, are laid
        out again from this state at the next step. An owner of anything else laid out by
        placement rebuilds it here."""
        for index, entry in saved.items():
            # An empty entry is a read of opt.state[p] for a param without state (torch's
            # defaultdict makes it): no state to move, as load_state_dict() drops it too.
            if isinstance(index, int) and 0 <= index < len(params) and isinstance(entry, dict) and entry:  # fmt: skip
                self.updater.load_entry(params[index], self.placer.records[params[index]], entry)
        watched, self.publisher.watched = self.publisher.watched, []
        for ref in watched:
            model = ref()
            if model is not None:
                self.watch(model)
