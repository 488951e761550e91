"""Where each param's optimizer state lives, and moving it: placement when a group is added,
or at the first ``step()`` (params on the meta device, a ``max_gpu_memory`` budget to choose
from measurements), the budget's choice, ``set_offload_fraction()``, and the host buffers and
staging each placement allocates. A mixin of :class:`offloadopt.optim.HybridOptimizer`, which
holds the state it reads (the pure policy is offloadopt/place/placement.py)."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.link.layout import build_arenas
from offloadopt.link.pipeline import Pipeline
from offloadopt.link.transfer import Transfer
from offloadopt.place import budget
from offloadopt.place.costmodel import format_bytes
from offloadopt.place.placement import ParamInfo, place, update_dtype
from offloadopt.place.records import ParamRecord
from offloadopt.shards import check_setup, local
from offloadopt.state import checkpoint
from offloadopt.step.hooks import GradHooks

__all__ = ["Placing"]


class Placing:
    """The placement machinery of :class:`offloadopt.optim.HybridOptimizer` (a mixin)."""

    def _check_auto_group(self, group: dict[str, Any]) -> None:
        """offload_fraction="auto" chooses a share of every param: a group that forces its
        placement (``"offload": True`` or ``False``) would not move with it."""
        if self._auto is not None and not self._auto.budgeted and group.get("offload") is not None:
            raise ValueError(
                f"a param group with 'offload': {group['offload']!r} and "
                "offload_fraction='auto': the cost model predicts a share of every param, and "
                "this group's stays where it is forced; give a number, or drop the key"
            )

    def _place_or_defer(self, group_indices: list[int]) -> None:
        """Place these groups now, or, while any param of them (or of a group still waiting) is
        on the meta device, when :meth:`ensure_placed` finds them materialized."""
        params = (p for gi in group_indices for p in self.param_groups[gi]["params"])
        choosing = self._budget["max_gpu_memory"] is not None and self.placement_choice is None
        if self._unplaced or choosing or any(p.is_meta for p in params):
            self._unplaced.extend(group_indices)
        else:
            self._place(group_indices)

    def ensure_placed(self) -> None:
        """Place the groups built from meta-device params, now that they are materialized, and
        allocate their host buffers. Runs by itself at the first ``step()``, ``state_dict()``,
        ``load_state_dict()`` and ``watch()``; call it to see the placement
        (:meth:`placement_table`, :meth:`is_offloaded`) before that.

        Materialize in place, so that the optimizer's params are the model's: build the model
        under ``torch.device("meta")``, call ``torch.__future__.set_swap_module_params_on_conversion(True)``
        before ``model.to_empty(device=...)`` (without it ``to_empty`` makes new params and this
        optimizer's stay on meta), or build the optimizer after ``to_empty``.

        Raises:
            RuntimeError: a param is still on the meta device (named); nothing is placed.
        """
        if not self._unplaced:
            return
        for gi in self._unplaced:
            group = self.param_groups[gi]
            for i, p in enumerate(group["params"]):
                if p.is_meta:
                    raise RuntimeError(
                        f"{self._name(group, gi, i)} is still on the meta device: materialize "
                        "the model in place first (torch.__future__."
                        "set_swap_module_params_on_conversion(True) before model.to_empty(); "
                        "without it to_empty() makes new params this optimizer does not hold)"
                    )
        if self._budget["max_gpu_memory"] is not None and self.placement_choice is None:
            self._choose_fraction(self._unplaced)  # raises with the figures; nothing is built
        pending, self._unplaced = self._unplaced, []
        try:
            self._place(pending)
        except BaseException:
            self._unplaced = pending
            raise
        later, self._watch_later = self._watch_later, []
        for ref in later:
            model = ref()
            if model is not None:
                self.watch(model)

    def _check_budget_for(self, group_indices: list[int]) -> None:
        """max_gpu_memory after its choice: a group added later is placed at the chosen
        fraction, and the device bytes it adds (weights, grads, the state left on the device)
        must still fit the budget.

        Raises:
            ValueError: the budget would be exceeded (with figures); the group is not added.
        """
        infos = self._infos(group_indices)
        tensors = [p for gi in group_indices for p in self.param_groups[gi]["params"]]
        pls = place(infos, self.offload_fraction, self.min_offload_numel, self.master_weights,
                    self.placement_policy)  # fmt: skip
        added = _weights_and_grads_nbytes(tensors)
        added += sum(pl.state_nbytes for pl in pls if not pl.offloaded and pl.reason != "frozen")
        choice = self.placement_choice
        need = choice["predicted_gpu_bytes"] + added
        if need > choice["max_gpu_memory"]:
            raise ValueError(
                f"add_param_group: at the chosen offload fraction {self.offload_fraction:g} the "
                f"new group adds {format_bytes(added)} on the device, {format_bytes(need)} in "
                f"all, over max_gpu_memory={format_bytes(choice['max_gpu_memory'])}; call "
                "opt.set_offload_fraction(...) for more offload first"
            )
        choice["predicted_gpu_bytes"] = need

    def _budget_pending(self) -> bool:
        """Whether max_gpu_memory's choice is still to be made (at the first step())."""
        return self._budget["max_gpu_memory"] is not None and self.placement_choice is None

    def _choose_fraction(self, group_indices: list[int]) -> None:
        """max_gpu_memory: measure what the device holds, then let :func:`budget.choose`
        take the smallest fraction that fits (see there).

        Raises:
            ValueError: no fraction fits, or the host lacks the memory (both with figures).
        """
        tensors = [p for gi in group_indices for p in self.param_groups[gi]["params"]]
        cuda = {local(p).device for p in tensors if local(p).device.type == "cuda"}
        given = self._budget["activation_bytes"]
        if given is None and cuda:
            measured = sum(torch.cuda.max_memory_allocated(d) for d in cuda)
            how = "the device's peak so far (weights, grads, forward and backward)"
            if not any(p.grad is not None for p in tensors):
                self._warn_once("budget-before-backward",
                                "max_gpu_memory: placing before any backward ran, so the "
                                "activations are not in the measured peak; pass "
                                "activation_bytes= or call step() first")  # fmt: skip
        else:
            if given is None and not any(p.grad is not None for p in tensors):
                self._warn_once("budget-before-backward",
                                "max_gpu_memory: placing before any backward ran and without "
                                "activation_bytes=, so activations count as 0")  # fmt: skip
            counted = _weights_and_grads_nbytes(tensors)
            measured = counted + (given or 0)
            how = (f"weights and grads {format_bytes(counted)} + activations "
                   f"{format_bytes(given or 0)}")  # fmt: skip
        self.placement_choice = budget.choose(
            self._infos(group_indices), measured, how, self._budget["max_gpu_memory"],
            self._budget["max_host_memory"], self.bucket_nbytes, self.overlap == "delayed",
            lambda f, infos: place(infos, f, self.min_offload_numel, self.master_weights,
                                   self.placement_policy),
            # grads go during backward only when no clip waits for them all (backward._on_grad)
            release_grads=self.release_grads and self.max_grad_norm is None
            and self.grad_scaler is None,
            grads_in_flight=self.wait == "module" and self.overlap != "delayed",
        )  # fmt: skip
        self.offload_fraction = self.placement_choice["fraction"]

    @no_grad_whole
    def set_offload_fraction(self, fraction: float) -> None:
        """Place every param again at ``fraction``, between steps, moving state between the
        device and the host; nothing is lost and no result changes (the state is copied out
        as ``state_dict()`` would, the new buffers are allocated, and it is copied in;
        tests/test_budget.py checks a run that switches against one that does not, bitwise).
        Models given to :meth:`watch` are watched again. The old host buffers are freed after
        the new ones exist, so for a moment both are held.

        With ``max_gpu_memory`` whose choice is still pending (or could not be met), this
        places at ``fraction`` instead and drops the budget; after the choice it replaces it
        and the budget is not checked again; with ``offload_fraction="auto"`` still measuring,
        it ends the measuring. Each time ``placement_choice`` says so, and a ``UserWarning``
        says what was replaced (once).

        Raises:
            ValueError: ``fraction`` outside [0, 1].
            RuntimeError: a step in flight from backward, a failed step, or a closed optimizer.
            PinnedAllocationError: the new buffers could not be had (the old placement stays).
        """
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not 0 <= fraction <= 1
        ):
            raise ValueError(
                f"Invalid offload_fraction: {fraction!r} (expected a number in [0, 1]; "
                "offload_fraction='auto' is a constructor option)"
            )
        fraction = float(fraction)
        ours = self._auto is not None and self._auto.moving  # auto's own move
        replaced = None if ours else self._choice_replaced()

        def say_replaced() -> None:  # once placed: a refused call replaces nothing
            if replaced is not None:
                # A fresh user's finding: the budget (or auto) was dropped without a word.
                self._warn_once(
                    "fraction-replaces-choice",
                    f"set_offload_fraction({fraction:g}) replaces {replaced}: the fraction is "
                    "now yours and no budget is checked again (placement_choice says so)",
                )

        if self._budget_pending():  # the caller's fraction instead of the budget's choice
            if self._auto is not None:
                self._auto.cancel(f"set_offload_fraction({fraction!r}) by the caller")
            self._budget["max_gpu_memory"] = None
            self.offload_fraction = fraction
            self.placement_choice = {"fraction": fraction, "set_by": "set_offload_fraction",
                                     "replaced": replaced}  # fmt: skip
            self.ensure_placed()
            say_replaced()
            return
        self.ensure_placed()
        self.synchronize()
        self._raise_if_broken()
        self._guards.check_worker()
        # Ctrl-C or SIGTERM in the middle would leave state half copied in: they reach their
        # handler once the move is done (steps.signals_deferred).
        with signals_deferred(), self._lock:
            if self._step is not None:
                raise RuntimeError(
                    "set_offload_fraction() between steps only: a backward already announced "
                    "grads (call it after step())"
                )
            # A step() that ran since the wait above (on another thread: a fresh user's
            # finding) has an update in flight that writes the buffers about to be replaced.
            self.synchronize()
            self._replace(float(fraction))
            if not ours:  # placed: from here the caller's fraction holds, not a choice
                if self._auto is not None:
                    self._auto.cancel(f"set_offload_fraction({fraction!r}) by the caller")
                if self.placement_choice is not None:
                    budget = "max_gpu_memory" in self.placement_choice
                    self.placement_choice = {
                        "fraction": fraction, "replaced": self.placement_choice,
                        "set_by": "set_offload_fraction" + (" (the budget is not checked)" if budget else ""),
                    }  # fmt: skip
                elif replaced is not None:  # auto still measuring: no choice to keep
                    self.placement_choice = {"fraction": fraction, "replaced": replaced,
                                             "set_by": "set_offload_fraction"}  # fmt: skip
                say_replaced()

    def _choice_replaced(self) -> str | None:
        """What a caller's fraction replaces, in words: a ``max_gpu_memory`` budget (chosen
        or not yet), or ``offload_fraction="auto"`` still measuring; None when neither (or
        when a caller's fraction replaced it already)."""
        chooser = (self.placement_choice or {}).get("set_by", "")
        if chooser.startswith("set_offload_fraction"):
            return None
        nbytes = self._budget["max_gpu_memory"]
        if nbytes is not None:
            when = "its choice" if self.placement_choice is not None else "before its choice"
            return f"max_gpu_memory={format_bytes(nbytes)} ({when})"
        if self._auto is not None and self._auto.active:
            return "offload_fraction='auto' before its choice"
        return None

    def _replace(self, fraction: float) -> None:
        """Place every param again at ``fraction`` with the groups' current values (their
        state keys included), moving the state over losslessly; the caller holds the lock,
        with signals deferred, and nothing is in flight.

        Raises:
            PinnedAllocationError: the new buffers could not be had (the old placement stays).
        """
        saved = checkpoint.pack(Optimizer.state_dict(self), on_device=False)["state"]
        # The records and opt.state are emptied in place, never replaced: the owners that
        # read them (and a user's reference to opt.state) keep the same objects.
        old = (self.placement, self.arenas, self.buckets, dict(self._records),
               dict.copy(self.state), self._grad_hooks, self._module_waits,
               self.offload_fraction)  # fmt: skip
        self.placement, self.arenas, self.buckets = [], [], []
        self._records.clear()
        dict.clear(self.state)
        self._grad_hooks, self._module_waits = [], []
        self.offload_fraction = fraction
        try:
            self._place(list(range(len(self.param_groups))))
        except BaseException:
            (self.placement, self.arenas, self.buckets, records, state, self._grad_hooks,
             self._module_waits, self.offload_fraction) = old  # fmt: skip
            self._records.clear()
            self._records.update(records)
            dict.clear(self.state)
            dict.update(self.state, state)
            raise
        for hooks in (*old[5], *old[6]):
            hooks.remove()  # the old placement's grad hooks and module waits
        if self._pipeline is not None:
            for tr in self._pipeline.transfers.values():
                tr.forget(old[2], self.timeout_s)  # waits for their last H2D, before release
        for arena in old[1]:
            arena.release()  # unpinned now
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in saved.items():
            # An empty entry is a read of opt.state[p] for a param without state (torch's
            # defaultdict makes it): no state to move, as load_state_dict() drops it too.
            if isinstance(index, int) and 0 <= index < len(params) and isinstance(entry, dict) and entry:  # fmt: skip
                self._load_entry(params[index], self._records[params[index]], entry)
        watched, self._watched = self._watched, []
        for ref in watched:
            model = ref()
            if model is not None:
                self.watch(model)

    def _device(self) -> torch.device:
        """The device of the params (one per rank: shards.check_setup)."""
        return local(self.param_groups[0]["params"][0]).device

    def _bytes_per_param(self) -> dict[str, int]:
        """The cost model's bytes per trainable param: its weight (and grad) in the dtype of
        most of the elements, and the state (the rule's, and an fp32 master when kept)."""
        by_dtype: dict[torch.dtype, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + local(p).numel()
        dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
        master = update_dtype(dtype, self.master_weights) != dtype
        n_states = len(self.rule.state_keys_for(self.param_groups[0]))
        return {"weight_bytes": dtype.itemsize, "state_bytes": 4 * n_states + 4 * master}

    def _numel_by_side(self) -> dict[bool, int]:
        """Trainable elements (this rank's shards) whose state is offloaded (True) or on the
        device (False)."""
        out = {True: 0, False: 0}
        for p, rec in self._records.items():
            if rec.placement.reason != "frozen":
                out[rec.offloaded] += local(p).numel()
        return out

    def _infos(self, group_indices: list[int]) -> list[ParamInfo]:
        """The placement policy's view of these groups' params."""
        start = sum(len(g["params"]) for g in self.param_groups[: group_indices[0]])
        infos = []
        for gi in group_indices:
            g = self.param_groups[gi]
            keys = self.rule.state_keys_for(g)
            for i, p in enumerate(g["params"]):
                mine = local(p)  # an FSDP2 param: this rank's shard is what it places
                infos.append(
                    ParamInfo(start + len(infos), self._name(g, gi, i), gi, tuple(mine.shape),
                              p.dtype, p.requires_grad, g["offload"], mine.is_contiguous(),
                              len(keys), tuple(p.shape) if mine is not p else None)
                )  # fmt: skip
        return infos

    def _name(self, group: dict[str, Any], gi: int, i: int) -> str:
        """The name of param ``i`` of group ``gi``: its record's, else from ``param_names``."""
        rec = self._records.get(group["params"][i])
        if rec is not None:
            return rec.name
        names = group.get("param_names")
        return names[i] if names and i < len(names) else f"group{gi}.param{i}"

    def _place(self, group_indices: list[int]) -> None:
        """Place the params of these groups and allocate their host buffers (all or nothing)."""
        start = sum(len(g["params"]) for g in self.param_groups[: group_indices[0]])
        check_setup([(self._name(self.param_groups[gi], gi, i), p) for gi in group_indices
                     for i, p in enumerate(self.param_groups[gi]["params"])],
                    self.overlap, ddp=self._ddp is not None)  # fmt: skip
        keys = {gi: self.rule.state_keys_for(self.param_groups[gi]) for gi in group_indices}
        infos = self._infos(group_indices)
        tensors = [p for gi in group_indices for p in self.param_groups[gi]["params"]]
        placements = place(infos, self.offload_fraction, self.min_offload_numel,
                           self.master_weights, self.placement_policy)  # fmt: skip
        order = [(tensors[k], pl.name, pl.group, update_dtype(pl.dtype, self.master_weights))
                 for k, pl in reversed(list(enumerate(placements))) if pl.offloaded]  # fmt: skip
        arenas, buckets = build_arenas(order, self.bucket_nbytes)
        devices = {a.device for a in arenas}
        pin = {d: self.pin_memory and d.type == "cuda" for d in devices}
        if not self.pin_memory and any(d.type == "cuda" for d in devices):
            self._warn_once(
                "pageable",
                f"{type(self).__name__}(pin_memory=False): host buffers are pageable, so every "
                "copy over the link takes the slow pageable path; this setting exists to "
                "reproduce and measure it",
            )
        new_transfers: dict[torch.device, Transfer] = {}
        try:
            for arena in arenas:
                arena.allocate(keys[arena.group_label], pin[arena.device])
            landing = {}
            if self.overlap == "delayed":  # the next weights, published at the next step()
                for arena in arenas:
                    for p in arena.params:
                        landing[p] = torch.empty_like(
                            local(p), memory_format=torch.contiguous_format
                        )
            # Staging as large as the largest bucket (at most bucket_nbytes); a later
            # add_param_group that needs more replaces it, between steps.
            for d in devices:
                need = max(b.nbytes for b in buckets if b.arena.device == d)
                old = self._pipeline.transfers.get(d) if self._pipeline else None
                if old is None or old.nbytes < need:
                    new_transfers[d] = Transfer(d, need, pin[d])
            if buckets and self._pipeline is None:
                self._pipeline = Pipeline(self._start_worker(), self.timeout_s)
        except BaseException:
            for arena in arenas:
                arena.release()
            for tr in new_transfers.values():
                tr.close()
            raise
        # Everything allocated: commit.
        for d, tr in new_transfers.items():
            old = self._pipeline.transfers.get(d)
            if old is not None:
                old.close()  # no copy of the last step still uses it; unpinned now
                tr.adopt(old)
            self._pipeline.transfers[d] = tr
            for b in self.buckets:
                b.forget_slot_views()
        for pl in placements:
            rec = ParamRecord(pl.name, pl, state_keys=keys[pl.group])
            self._records[tensors[pl.index - start]] = rec
        for arena in arenas:
            for k, p in enumerate(arena.params):
                rec = self._records[p]
                rec.arena, rec.k = arena, k
                rec.landing = landing.get(p)
        for n, b in enumerate(buckets, start=len(self.buckets)):
            b.index = n
            for seg in b.segments:
                rec = self._records[b.arena.params[seg.k]]
                if not rec.buckets or rec.buckets[-1] is not b:
                    rec.buckets.append(b)
        if self.overlap == "backward" and (
            self.grads_final or self.max_grad_norm is not None or self.grad_scaler is not None
        ):
            offloaded = [p for a in arenas for p in a.params]
            self._grad_hooks.append(GradHooks(self, offloaded))
        odd = [pl.name for pl in placements if pl.reason == "non-contiguous"]
        if odd and self.offload_fraction > 0:
            self._warn_once(
                "non-contiguous",
                f"{len(odd)} params are not contiguous (e.g. channels_last conv weights: "
                f"{', '.join(odd[:3])}) and keep their state on the device",
            )
        self.arenas.extend(arenas)
        self.buckets.extend(buckets)
        self.placement.extend(placements)
        self._check_pinned()


def _weights_and_grads_nbytes(tensors: list[torch.Tensor]) -> int:
    """Device bytes of these params (this rank's shards) and of the grads of trainable ones."""
    return sum(local(p).nbytes * (2 if p.requires_grad else 1) for p in tensors)
