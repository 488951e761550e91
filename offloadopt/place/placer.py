"""The :class:`Placer`: where each param's optimizer state lives, and the memory that placement
holds. It owns the placement (one :class:`~offloadopt.place.records.ParamRecord` per param), the
host arenas and their buckets, the pipeline (staging and the CPU worker), the offload fraction
and what chose it (a number, a ``max_gpu_memory`` budget, ``offload_fraction="auto"``), and the
groups still waiting for their meta-device params. The pure policy it applies is
offloadopt/place/placement.py; moving state between placements losslessly is
offloadopt/relocate.py's (it is handed ``opt.state``), which calls :meth:`Placer.replace`."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import replace as dc_replace
from typing import Any

import torch

from offloadopt.link.layout import CUT_ALIGN, Arena, Bucket, build_arenas
from offloadopt.link.pipeline import Pipeline
from offloadopt.link.transfer import Transfer
from offloadopt.link.worker import plan_cpus, start_worker
from offloadopt.options import Options
from offloadopt.place import budget
from offloadopt.place.auto import PROBE_FRACTION, AutoFraction
from offloadopt.place.placement import (
    ParamInfo,
    Placement,
    format_placement,
    place,
    update_dtype,
)
from offloadopt.place.records import ParamRecord, add_records, landing_buffers
from offloadopt.place.report import check_pinned
from offloadopt.rules import BLOCK, Rule
from offloadopt.shards import check_setup, is_dtensor, local, refuse_sharded

__all__ = ["BUCKET_NBYTES", "Placer"]

log = logging.getLogger("offloadopt")

# bucket_nbytes=None: 64 MiB; 128 MiB with overlap="backward" and 256 MiB with overlap="delayed",
# where the worker's copy launches between buckets (about 0.3-0.5 ms a bucket inside a step, the
# GIL shared with the training thread's forward and backward) add to the CPU pass: GPT-2 1.5B at
# fraction 1, backward mode, 128 MiB against 64 MiB: 553-585 against 633-765 ms in two runs;
# delayed, 256 MiB: 1.13x -> 1.05x of the step's bound (benchmarks/RESULTS.md).
# bf16 grads and weights over the link where the update allows it (Placer.link_dtype); the
# tests turn it off to compare the two paths
BF16_LINK = True
BUCKET_NBYTES = {"step": 64 * 2**20, "backward": 128 * 2**20, "delayed": 256 * 2**20}


class Placer:
    """Placement and the memory it holds, for one optimizer.

    Args:
        param_groups: the optimizer's ``param_groups`` list (torch's; read, never replaced).
        rule: the update rule (its state keys per group).
        options: the validated offloading options (offloadopt/options.py).
        sizes: :func:`offloadopt.place.budget.sizes` of the options (bytes or None).
        name: the optimizer's class name, for messages.
        records: the param -> record dict this placer fills (the optimizer's, kept for life).
        ddp: whether a DDP model announces grads (``ddp=``), for the setup checks.
        warn_once: ``warn_once(key, message)``, the optimizer's one warning per key.

    Attributes:
        fraction: the offload fraction in force (``opt.offload_fraction``).
        choice: what chose the fraction, and why (``opt.placement_choice``), or None.
        auto: offload_fraction="auto"'s controller (offloadopt/place/auto.py), or None.
        placement, arenas, buckets: every param's placement, the host arenas, their buckets.
        pipeline: the staging and the CPU worker, made with the first offloaded bucket.
        unplaced: indices of the groups waiting for their meta params (:meth:`ensure_placed`).
        group_offload: each placed group's ``"offload"`` key as placed (begin_step refuses changes).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        rule: Rule,
        options: Options,
        sizes: dict[str, int | None],
        *,
        name: str,
        records: dict[torch.Tensor, ParamRecord],
        ddp: bool,
        warn_once: Callable[[str, str], None],
    ):
        o = options
        self.param_groups = param_groups
        self.rule = rule
        self.sizes = sizes  # max_gpu_memory: the fraction is chosen at the first step()
        self.name = name
        self.records = records
        self.ddp = ddp
        self.warn_once = warn_once
        self.on_offloaded: Callable[[], Callable | None] = lambda: _no_hooks
        self.policy = o.placement_policy
        self.min_offload_numel = o.min_offload_numel
        self.master_weights = o.master_weights is True  # fp32 masters ("bf16-sr": none)
        self.pin_memory = o.pin_memory
        self.bucket_nbytes = (
            o.bucket_nbytes if o.bucket_nbytes is not None else BUCKET_NBYTES[o.overlap]
        )
        self.overlap, self.wait = o.overlap, o.wait
        self.speculate = o.speculate  # the budget counts the pre-step backups on the host
        self.flush_denormal = o.flush_denormal
        self.timeout_s = float(o.timeout_s)
        # Step mode: the training thread waits in step() while the worker runs; when updates
        # overlap backward or the next forward, it needs a core of its own.
        busy = o.overlap != "step" or o.wait != "step"
        self.cpu_plan = plan_cpus(o.worker_cpus, o.cpu_threads, training_thread_busy=busy)
        self.cpu_threads = self.cpu_plan.threads
        # max_gpu_memory's choice: grads go during backward only when no clip waits for them
        # all (backward mode's grad hook), and with wait="module" they are in flight meanwhile
        self.releases_early = o.release_grads and o.max_grad_norm is None and o.grad_scaler is None
        auto = o.offload_fraction == "auto"
        # offload_fraction="auto" (offloadopt/place/auto.py): probe, choose, verify in the first steps
        self.auto = (AutoFraction(o.auto_tolerance, sizes["max_gpu_memory"] is not None, o.release_grads)
                     if auto else None)  # fmt: skip
        self.fraction = PROBE_FRACTION if auto else float(o.offload_fraction)
        self.choice: dict[str, Any] | None = None
        self.placement: list[Placement] = []
        self.arenas: list[Arena] = []
        self.buckets: list[Bucket] = []
        self.pipeline: Pipeline | None = None
        self.unplaced: list[int] = []
        self.group_offload: dict[int, bool | None] = {}

    def hooks_to(self, hook: Callable[[list[torch.Tensor]], None]) -> None:
        """``hook(params)`` is called with the params of each new arena once it is placed (the
        start policy's ``hook``: their grad hooks). The start policy holds this placer, so its
        bound method is held weakly: no cycle between owners, whose memory (the state, the
        arenas) would then wait for Python's gc once the optimizer is dropped."""
        self.on_offloaded = weakref.WeakMethod(hook)

    # ------------------------------------------------------------------ when to place
    def check_auto_group(self, group: dict[str, Any]) -> None:
        """offload_fraction="auto" refuses a group that forces its placement (AutoFraction)."""
        if self.auto is not None:
            self.auto.check_group(group)

    def budget_pending(self) -> bool:
        """Whether max_gpu_memory's choice is still to be made (at the first step())."""
        return self.sizes["max_gpu_memory"] is not None and self.choice is None

    def place_or_defer(self, group_indices: list[int]) -> None:
        """Place these groups now, or when :meth:`ensure_placed` finds them materialized (while
        a param of them, or of a group still waiting, is on the meta device)."""
        params = (p for gi in group_indices for p in self.param_groups[gi]["params"])
        if self.unplaced or self.budget_pending() or any(p.is_meta for p in params):
            self.unplaced.extend(group_indices)
        else:
            self.place(group_indices)

    def ensure_placed(self, micro_steps: int = 1) -> bool:
        """Place the groups waiting for their meta params (``opt.ensure_placed``'s work);
        returns whether any was placed. ``micro_steps``: the forward and backward passes of
        the step that places them (gradient accumulation), for max_gpu_memory's choice.

        Raises:
            RuntimeError: a param is still on the meta device (named); nothing is placed.
            ValueError: max_gpu_memory's choice finds no fraction that fits (with figures).
        """
        if not self.unplaced:
            return False
        for gi in self.unplaced:
            group = self.param_groups[gi]
            for i, p in enumerate(group["params"]):
                if p.is_meta:
                    raise RuntimeError(
                        f"{self.param_name(group, gi, i)} is still on the meta device: "
                        "materialize the model in place first (torch.__future__."
                        "set_swap_module_params_on_conversion(True) before model.to_empty(); "
                        "without it to_empty() makes new params this optimizer does not hold)"
                    )
        if self.budget_pending():  # raises with the figures; nothing is built
            self.choice = budget.choose_for(self, self.unplaced, micro_steps)
            self.fraction = self.choice["fraction"]
        pending, self.unplaced = self.unplaced, []
        try:
            self.place(pending)
        except BaseException:
            self.unplaced = pending
            raise
        return True

    def sampling(self) -> AutoFraction | None:
        """offload_fraction="auto" while it measures (its step's sample begun now), else None."""
        auto = self.auto if self.auto is not None and self.auto.active else None
        if auto is not None:
            auto.begin(self.device())
        return auto

    # ------------------------------------------------------------------ the budget
    def check_budget_for(self, group_indices: list[int]) -> None:
        """max_gpu_memory after its choice: a later group must fit (:func:`budget.check_added`).

        Raises:
            ValueError: the budget would be exceeded (with figures); the group is not added.
        """
        self.choice["predicted_gpu_bytes"] = budget.check_added(self, group_indices)

    def keys_changed(self) -> bool:
        """Whether a group's values now need other state keys than its params were placed with."""
        for g in self.param_groups:
            keys = self.rule.state_keys_for(g)  # once per group, not per param
            if any((r := self.records.get(p)) is not None and r.state_keys != keys
                   for p in g["params"]):  # fmt: skip
                return True
        return False

    def check_new_keys(self) -> None:
        """New state keys (momentum turned on or off) need the params placed again.

        Raises:
            ValueError: a ``max_gpu_memory`` budget was met with the old keys (more state
                now: the fraction it chose may not fit).
        """
        if self.sizes["max_gpu_memory"] is not None:
            raise ValueError(
                "the param groups' values need other state than when max_gpu_memory chose the "
                f"fraction {self.fraction:g} (momentum turned on or off after the "
                "first step()); build the optimizer with the values it trains with (OneCycleLR "
                "sets momentum at construction, before max_gpu_memory chooses)"
            )

    # ------------------------------------------------------------------ placing
    def replace(self, fraction: float) -> None:
        """Place every param again at ``fraction`` (the records emptied in place and made
        again); on success the old arenas are released once the staging's last H2D from them
        is done. The caller has emptied ``opt.state`` and moves the state over.

        Raises:
            PinnedAllocationError: the new buffers could not be had (the old placement stays).
        """
        old = (self.placement, self.arenas, self.buckets, dict(self.records), self.fraction)
        self.placement, self.arenas, self.buckets = [], [], []
        self.records.clear()
        self.fraction = fraction
        try:
            self.place(list(range(len(self.param_groups))))
        except BaseException:
            self.placement, self.arenas, self.buckets, records, self.fraction = old
            self.records.clear()
            self.records.update(records)
            raise
        for tr in self.transfers().values():
            tr.forget(old[2], self.timeout_s)  # waits for their last H2D, before release
        for arena in old[1]:
            arena.release()  # unpinned now

    def place(self, group_indices: list[int]) -> None:
        """Place the params of these groups and allocate their host buffers (all or nothing)."""
        start = sum(len(g["params"]) for g in self.param_groups[: group_indices[0]])
        tensors = [p for gi in group_indices for p in self.param_groups[gi]["params"]]
        check_setup([(self.param_name(self.param_groups[gi], gi, i), p) for gi in group_indices
                     for i, p in enumerate(self.param_groups[gi]["params"])],
                    self.overlap, ddp=self.ddp)  # fmt: skip
        if self.rule.compressed:  # per-block scales are not laid out like FSDP2's shards
            refuse_sharded([p for p in tensors if is_dtensor(p)], self.rule.moments,
                           self.rule.master_sr)  # fmt: skip
        keys = {gi: self.rule.state_keys_for(self.param_groups[gi]) for gi in group_indices}
        infos = self.infos(group_indices)
        placements = place(infos, self.fraction, self.min_offload_numel,
                           self.master_weights, self.policy)  # fmt: skip
        order = [(tensors[k], pl.name, pl.group, update_dtype(pl.dtype, self.master_weights),
                  self.link_dtype(pl.dtype))
                 for k, pl in reversed(list(enumerate(placements))) if pl.offloaded]  # fmt: skip
        align = BLOCK if self.rule.moments == "int8" else CUT_ALIGN  # whole blocks per segment
        arenas, buckets = build_arenas(order, self.bucket_nbytes, align)
        devices = {a.device for a in arenas}
        pin = {d: self.pin_memory and d.type == "cuda" for d in devices}
        if not self.pin_memory and any(d.type == "cuda" for d in devices):
            self.warn_once(
                "pageable",
                f"{self.name}(pin_memory=False): host buffers are pageable, so every "
                "copy over the link takes the slow pageable path; this setting exists to "
                "reproduce and measure it",
            )
        new_transfers: dict[torch.device, Transfer] = {}
        try:
            for arena in arenas:
                ks = keys[arena.group_label]
                specs = {k: (self.rule.key_dtype(k, arena.dtype), self.rule.blockwise(k))
                         for k in ks}  # fmt: skip
                arena.allocate(ks, pin[arena.device], specs)
            # overlap="delayed": the next weights, published at the next step()
            landing = landing_buffers(arenas) if self.overlap == "delayed" else {}
            # Staging as large as the largest bucket (at most bucket_nbytes); a later
            # add_param_group that needs more replaces it, between steps.
            for d in devices:
                need = max(b.nbytes for b in buckets if b.arena.device == d)
                old = self.pipeline.transfers.get(d) if self.pipeline else None
                if old is None or old.nbytes < need:
                    new_transfers[d] = Transfer(d, need, pin[d])
            if buckets and self.pipeline is None:
                cross = any(d.type == "cuda" for d in devices)  # the worker's update thread
                worker = start_worker(self.cpu_plan, self.flush_denormal, self.warn_once, cross)
                self.pipeline = Pipeline(worker, self.timeout_s)
        except BaseException:
            for arena in arenas:
                arena.release()
            for tr in new_transfers.values():
                tr.close()
            raise
        # Everything allocated: commit.
        for d, tr in new_transfers.items():
            old = self.pipeline.transfers.get(d)
            if old is not None:
                old.close()  # no copy of the last step still uses it; unpinned now
                tr.adopt(old)
            self.pipeline.transfers[d] = tr
            for b in self.buckets:
                b.forget_slot_views()
        placed = {tensors[pl.index - start]: pl for pl in placements}
        add_records(self.records, placed, keys, arenas, buckets, landing, len(self.buckets))
        self.on_offloaded()([p for a in arenas for p in a.params])
        odd = [pl.name for pl in placements if pl.reason == "non-contiguous"]
        if odd and self.fraction > 0:
            self.warn_once(
                "non-contiguous",
                f"{len(odd)} params are not contiguous (e.g. channels_last conv weights: "
                f"{', '.join(odd[:3])}) and keep their state on the device",
            )
        self.arenas.extend(arenas)
        self.buckets.extend(buckets)
        self.placement.extend(placements)
        for gi in group_indices:
            self.group_offload.setdefault(gi, self.param_groups[gi].get("offload"))
        self.check_pinned()

    def record(self, p: torch.Tensor, group: dict[str, Any], gi: int, i: int) -> ParamRecord:
        """``p``'s record; a param put into a group's list by hand gets one now (on the device)."""
        rec = self.records.get(p)
        if rec is None:
            keys = self.rule.state_keys_for(group)
            info = ParamInfo(-1, self.param_name(group, gi, i), gi, tuple(p.shape), p.dtype,
                             p.requires_grad, group.get("offload"), n_states=len(keys),
                             elem_bytes=self.elem_bytes(group, p.dtype))  # fmt: skip
            pl = place([info], 0.0, 0, self.master_weights)[0]
            rec = ParamRecord(pl.name, dc_replace(pl, reason="added by hand"), state_keys=keys)
            self.records[p] = rec
            self.placement.append(rec.placement)
        return rec

    # ------------------------------------------------------------------ views
    def transfers(self) -> dict[torch.device, Transfer]:
        """The staging per device (none before the first offloaded bucket)."""
        return self.pipeline.transfers if self.pipeline is not None else {}

    def forward_order(self) -> list[Bucket]:
        """Buckets in the order the next forward reads them (first-registered params first)."""
        return self.buckets[::-1]

    def device(self) -> torch.device:
        """The device of the params (one per rank: shards.check_setup)."""
        return local(self.param_groups[0]["params"][0]).device

    def link_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype an offloaded param's grads and new weights cross the link in: bf16 for a
        bf16 param whose update is offloadopt's kernel with an fp32 master (a compressed
        representation: it reads bf16 grads and writes the bf16 weights itself, 2 bytes per
        element each way instead of 4; bitwise the same, tests/test_link_dtype.py), else the
        update dtype. torch's fused kernel (the fp32 default) takes grads in the master's dtype
        only, so there they cross in fp32 and stay bitwise torch's."""
        udt = update_dtype(param_dtype, self.master_weights)
        if BF16_LINK and self.rule.compressed and param_dtype == torch.bfloat16 != udt:
            return param_dtype
        return udt

    def infos(self, group_indices: list[int]) -> list[ParamInfo]:
        """The placement policy's view of these groups' params."""
        start = sum(len(g["params"]) for g in self.param_groups[: group_indices[0]])
        infos = []
        for gi in group_indices:
            g = self.param_groups[gi]
            keys = self.rule.state_keys_for(g)
            offload = self.group_offload.get(gi, g["offload"])  # as first placed, once placed
            for i, p in enumerate(g["params"]):
                mine = local(p)  # an FSDP2 param: this rank's shard is what it places
                infos.append(
                    ParamInfo(start + len(infos), self.param_name(g, gi, i), gi, tuple(mine.shape),
                              p.dtype, p.requires_grad, offload, mine.is_contiguous(), len(keys),
                              tuple(p.shape) if mine is not p else None, self.elem_bytes(g, p.dtype))
                )  # fmt: skip
        return infos

    def elem_bytes(self, group: dict[str, Any], dtype: torch.dtype) -> float | None:
        """Bytes of state per element of a param of ``dtype`` in ``group`` (the master aside)
        under a compressed representation; None under torch's (the update dtype's size per
        state key)."""
        if not self.rule.compressed:
            return None
        return self.rule.elem_bytes(group, update_dtype(dtype, self.master_weights))

    def param_name(self, group: dict[str, Any], gi: int, i: int) -> str:
        """The name of param ``i`` of group ``gi``: its record's, else from ``param_names``."""
        rec = self.records.get(group["params"][i])
        if rec is not None:
            return rec.name
        names = group.get("param_names")
        return names[i] if names and i < len(names) else f"group{gi}.param{i}"

    # ------------------------------------------------------------------ reporting
    def table(self) -> str:
        """The placement as a fixed-width table; while params wait, a line saying so."""
        if self.unplaced:
            n = sum(len(self.param_groups[gi]["params"]) for gi in self.unplaced)
            why = (
                "max_gpu_memory chooses the fraction at the first step()"
                if self.budget_pending()
                else "built on the meta device"
            )
            pending = (f"placement pending: {n} params of {len(self.unplaced)} groups ({why}; "
                       "placed at the first step(), or ensure_placed())")  # fmt: skip
            return (
                pending if not self.placement else f"{format_placement(self.placement)}\n{pending}"
            )
        return format_placement(self.placement)

    def check_pinned(self) -> None:
        """The pinned invariant (offloadopt/place/report.py's :func:`check_pinned`)."""
        check_pinned(self.arenas, self.transfers(), self.pin_memory)

    def close(self) -> None:
        """Stop the worker and unpin the staging (idempotent); auto says what it leaves."""
        if self.auto is not None:
            self.auto.closed(self)
        if self.pipeline is not None:
            self.pipeline.close()


def _no_hooks(params: list[torch.Tensor]) -> None:
    """Before the start policy is wired: nothing listens to the placed params."""
