"""The hybrid optimizers' machinery: torch's fused update rules with a chosen fraction of their
state on the host. :class:`HybridOptimizer` is written once; :class:`offloadopt.adamw.HybridAdamW`
is AdamW's signature on it (offloadopt/rules.py holds the rule), adam.py and sgd.py the others."""

from __future__ import annotations

import logging
import numbers
import os
import threading
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt import budget, checkpoint
from offloadopt.auto import PROBE_FRACTION, AutoFraction
from offloadopt.costmodel import format_bytes
from offloadopt.hooks import GradHooks
from offloadopt.layout import Arena, Bucket, build_arenas
from offloadopt.pipeline import Pipeline
from offloadopt.placement import ParamInfo, Placement, format_placement, place, update_dtype
from offloadopt.records import ParamRecord
from offloadopt.rules import ADAMW, Rule
from offloadopt.shards import check_setup, is_dtensor, local, local_state, world_size, wrap_like
from offloadopt.state import OptimizerState
from offloadopt.steps import Stepping, signals_deferred
from offloadopt.transfer import Transfer
from offloadopt.validation import check_ddp, validate_group, validate_options, validate_params_arg
from offloadopt.warn import warn
from offloadopt.worker import Worker, default_cpu_threads, local_ranks, usable_cores

__all__ = ["HybridOptimizer"]

log = logging.getLogger("offloadopt")


OVERLAPS = ("step", "backward", "delayed")
WAITS = ("step", "module")
# bucket_nbytes=None: 64 MiB, or 256 MiB with overlap="delayed", where the worker's Python between
# buckets waits for the GIL while the training thread launches the next forward and backward
# (GPT-2 1.5B: 1.13x -> 1.05x of the step's bound, benchmarks/RESULTS.md).
BUCKET_NBYTES = {"step": 64 * 2**20, "backward": 64 * 2**20, "delayed": 256 * 2**20}


class HybridOptimizer(Stepping, Optimizer):
    """The machinery shared by the hybrid optimizers (see :class:`HybridAdamW` for the
    timeline, memory and caveats). A subclass sets :attr:`rule` and maps its torch signature
    onto ``hyper`` (the rule's hyperparameters)."""

    rule: Rule = ADAMW
    # state_dict()'s copies of device-resident state: on the host (False), or on their device
    # (True: Megatron's HybridDeviceOptimizer layout, which its tests check).
    _snapshot_on_device = False

    def __init__(
        self,
        params,
        hyper: dict[str, Any],
        *,
        amsgrad: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        offload_fraction: float = 1.0,
        min_offload_numel: int = 4096,
        master_weights: bool = True,
        pin_memory: bool = True,
        bucket_nbytes: int | None = None,
        flush_denormal: bool = True,
        cpu_threads: int | None = None,
        timeout_s: float = 600.0,
        overlap: str = "step",
        wait: str = "step",
        max_grad_norm: float | None = None,
        grads_final: bool = False,
        release_grads: bool = False,
        ddp: Any = None,
        max_gpu_memory: int | str | None = None,
        max_host_memory: int | str | None = None,
        activation_bytes: int | str | None = None,
        auto_tolerance: float = 0.05,
        placement_policy: str = "state-bytes",
    ):
        if placement_policy not in ("state-bytes", "megatron"):
            raise ValueError(
                f"Invalid placement_policy: {placement_policy!r} (expected 'state-bytes' or 'megatron')"
            )
        self.placement_policy = placement_policy
        validate_options(
            self.rule, hyper, amsgrad=amsgrad, capturable=capturable,
            differentiable=differentiable, offload_fraction=offload_fraction,
            min_offload_numel=min_offload_numel, master_weights=master_weights,
            pin_memory=pin_memory, bucket_nbytes=bucket_nbytes, flush_denormal=flush_denormal,
            cpu_threads=cpu_threads, timeout_s=timeout_s, overlap=overlap, wait=wait,
            max_grad_norm=max_grad_norm, grads_final=grads_final, release_grads=release_grads,
            ddp=ddp, auto_tolerance=auto_tolerance,
        )  # fmt: skip
        params = validate_params_arg(params)
        sizes = budget.sizes(max_gpu_memory=max_gpu_memory, max_host_memory=max_host_memory,
                             activation_bytes=activation_bytes)  # fmt: skip
        auto = offload_fraction == "auto"
        if sizes["max_gpu_memory"] is not None and not auto and offload_fraction != 1.0:
            raise ValueError(
                f"offload_fraction={offload_fraction!r} with max_gpu_memory={max_gpu_memory!r}: "
                "give one (the budget chooses the fraction), or offload_fraction='auto'"
            )
        if auto and overlap == "delayed" and sizes["max_gpu_memory"] is None:
            raise ValueError(
                "offload_fraction='auto' with overlap='delayed': the fraction decides which "
                "params train on weights one step old, so a fraction chosen from timings would "
                "make the results depend on them; give a number (1.0 is the delayed update's "
                "usual one), or max_gpu_memory="
            )
        for name, value in (
            ("max_host_memory", max_host_memory),
            ("activation_bytes", activation_bytes),
        ):
            if value is not None and sizes["max_gpu_memory"] is None:
                raise ValueError(f"{name}={value!r} without max_gpu_memory does nothing")
        if auto and world_size() > 1:
            raise ValueError(
                f"offload_fraction='auto' with {world_size()} ranks: it measures one process, and "
                "ranks choosing apart would train unevenly; give each rank the same number"
            )
        self._budget = sizes  # max_gpu_memory: the fraction is chosen at the first step()
        self.placement_choice: dict[str, Any] | None = None  # what chose the fraction, and why
        # offload_fraction="auto" (offloadopt/auto.py): probe, choose, verify in the first steps
        self._auto = (AutoFraction(auto_tolerance, sizes["max_gpu_memory"] is not None, release_grads)
                      if auto else None)  # fmt: skip
        self.offload_fraction = PROBE_FRACTION if auto else float(offload_fraction)
        self.min_offload_numel = min_offload_numel
        self.master_weights = master_weights
        self.pin_memory = pin_memory
        self.bucket_nbytes = bucket_nbytes if bucket_nbytes is not None else BUCKET_NBYTES[overlap]
        self.flush_denormal = flush_denormal
        self.overlap, self.wait = overlap, wait
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grads_final, self.release_grads = grads_final, release_grads
        # Step mode: the training thread waits in step() while the worker runs; when updates
        # overlap backward or the next forward, it needs a core of its own.
        busy = overlap != "step" or wait != "step"
        self.cpu_threads = cpu_threads or default_cpu_threads(training_thread_busy=busy)
        self.timeout_s = float(timeout_s)
        self._ready = False
        self._lock = threading.RLock()  # the step state, from the training and autograd threads
        self._step = None  # the step in flight (steps.StepState), from its first bucket
        self._inflight = None  # a step whose copies back are not all waited for (wait="module")
        self._inflight_streams: dict = {}
        self._broken: str | None = None  # why the optimizer refuses to step (a failed step)
        self._pending_clip = None  # (norm, coefficient) from clip_grad_norm_, for the next step
        self._accumulating = 0  # depth of opt.accumulating()
        self.last_grad_norm: torch.Tensor | None = None  # max_grad_norm: the last step's norm
        self._grad_hooks: list[GradHooks] = []
        self._closed = False
        self._module_waits: list = []
        self._watched: list = []  # weak references to the models given to watch()
        self._watch_later: list = []  # watch() before a budget's choice: registered after it
        self._ddp = ddp  # the DDP model whose all-reduced buckets announce grads (hooks.DDPGrads)
        self._ddp_hook = None
        self._reductions: list = []  # ddp=: this backward's all-reduce futures
        # torch's group flags, so a cross-load into torch's optimizer keeps its fused kernel.
        defaults = {**hyper, **self.rule.torch_flags, "offload": None}
        if "betas" in defaults:
            defaults["betas"] = tuple(defaults["betas"])
        self.placement: list[Placement] = []
        self.arenas: list[Arena] = []
        self.buckets: list[Bucket] = []
        self._records: dict[torch.Tensor, ParamRecord] = {}
        self._pipeline: Pipeline | None = None  # made with the first offloaded param
        self._stats: dict[str, float] = {}
        self._warned: set[str] = set()
        self._unplaced: list[int] = []  # groups waiting for their meta params (ensure_placed)
        super().__init__(params, defaults)
        self.state = OptimizerState(self)  # assignments copy into the buffers (state.py)
        for g in self.param_groups:
            self._check_auto_group(g)
        if ddp is not None:
            check_ddp(ddp, self.param_groups, self._name)
        self._place_or_defer(list(range(len(self.param_groups))))
        if ddp is not None:
            from offloadopt.hooks import DDPGrads

            try:
                self._ddp_hook = DDPGrads(self, ddp)
            except RuntimeError as e:  # DDP takes one comm hook per model
                self.close()
                raise RuntimeError(
                    f"ddp=: this DDP model has a comm hook already ({e}); ddp= installs its "
                    "own (torch's all-reduce, then an announcement), and DDP takes one: drop the "
                    "other hook (fp16 compression, PowerSGD, another optimizer's ddp=), or leave "
                    "out ddp= and use overlap='step' or 'delayed'"
                ) from e
        self._ready = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``torch.optim`` contract); its params are placed by the same rule,
        with the fraction applied to the new group's eligible state bytes.

        Raises:
            TypeError, ValueError, NotImplementedError: a bad group (named); nothing is added.
        """
        param_group = validate_group(param_group, self.defaults, self.rule)
        if self._ready:
            self.synchronize()  # staging may be replaced: no copy of the last step still runs
        super().add_param_group(param_group)
        try:
            if self._ready:
                self._check_auto_group(self.param_groups[-1])
            self._check_group(self.param_groups[-1])
            if (
                self._ready
                and self._budget["max_gpu_memory"] is not None
                and not self._budget_pending()
            ):
                self._check_budget_for([len(self.param_groups) - 1])
            if self._ready:
                self._place_or_defer([len(self.param_groups) - 1])
        except BaseException:
            self.param_groups.pop()  # nothing half built: the group goes with its failure
            raise

    def _check_auto_group(self, group: dict[str, Any]) -> None:
        """offload_fraction="auto" chooses a share of every param: a group that forces its
        placement (``"offload": True`` or ``False``) would not move with it."""
        if self._auto is not None and not self._auto.budgeted and group.get("offload") is not None:
            raise ValueError(
                f"a param group with 'offload': {group['offload']!r} and "
                "offload_fraction='auto': the cost model predicts a share of every param, and "
                "this group's stays where it is forced; give a number, or drop the key"
            )

    def _check_group(self, group: dict[str, Any]) -> None:
        """A subclass's own refusals for a group about to be placed (its params are tensors);
        raising here adds nothing, at construction and in ``add_param_group`` alike."""

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
            # grads go during backward only when no clip waits for them all (steps._on_grad)
            release_grads=self.release_grads and self.max_grad_norm is None,
            grads_in_flight=self.wait == "module" and self.overlap != "delayed",
        )  # fmt: skip
        self.offload_fraction = self.placement_choice["fraction"]

    @torch.no_grad()
    def set_offload_fraction(self, fraction: float) -> None:
        """Place every param again at ``fraction``, between steps, moving state between the
        device and the host; nothing is lost and no result changes (the state is copied out
        as ``state_dict()`` would, the new buffers are allocated, and it is copied in;
        tests/test_budget.py checks a run that switches against one that does not, bitwise).
        Models given to :meth:`watch` are watched again. The old host buffers are freed after
        the new ones exist, so for a moment both are held.

        With ``max_gpu_memory`` whose choice is still pending (or could not be met), this
        places at ``fraction`` instead and drops the budget; after the choice it replaces it
        (``placement_choice`` says so) and the budget is not checked again.

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
        if self._budget_pending():  # the caller's fraction instead of the budget's choice
            if self._auto is not None:
                self._auto.cancel(f"set_offload_fraction({fraction!r}) by the caller")
            self._budget["max_gpu_memory"] = None
            self.offload_fraction = fraction
            self.ensure_placed()
            return
        self.ensure_placed()
        self.synchronize()
        self._raise_if_broken()
        self._check_worker([])
        # Ctrl-C or SIGTERM in the middle would leave state half copied in: they reach their
        # handler once the move is done (steps.signals_deferred).
        with signals_deferred(), self._lock:
            if self._step is not None:
                raise RuntimeError(
                    "set_offload_fraction() between steps only: a backward already announced "
                    "grads (call it after step())"
                )
            saved = checkpoint.pack(Optimizer.state_dict(self), on_device=False)["state"]
            old = (self.placement, self.arenas, self.buckets, self._records, self.state,
                   self._grad_hooks, self._module_waits, self.offload_fraction)  # fmt: skip
            self.placement, self.arenas, self.buckets, self._records = [], [], [], {}
            self._grad_hooks, self._module_waits = [], []
            self.state = OptimizerState(self)
            self.offload_fraction = float(fraction)
            try:
                self._place(list(range(len(self.param_groups))))
            except BaseException:
                (self.placement, self.arenas, self.buckets, self._records, self.state,
                 self._grad_hooks, self._module_waits, self.offload_fraction) = old  # fmt: skip
                raise
            if not ours:  # placed: from here the caller's fraction holds, not a choice
                if self._auto is not None:
                    self._auto.cancel(f"set_offload_fraction({fraction!r}) by the caller")
                if self.placement_choice is not None:
                    budget = "max_gpu_memory" in self.placement_choice
                    self.placement_choice = {
                        "fraction": fraction, "replaced": self.placement_choice,
                        "set_by": "set_offload_fraction" + (" (the budget is not checked)" if budget else ""),
                    }  # fmt: skip
            for hooks in (*old[5], *old[6]):
                hooks.remove()  # the old placement's grad hooks and module waits
            for arena in old[1]:
                arena.release()  # unpinned now
            params = [p for g in self.param_groups for p in g["params"]]
            for index, entry in saved.items():
                if isinstance(index, int) and 0 <= index < len(params) and isinstance(entry, dict):
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
        if self.overlap == "backward" and (self.grads_final or self.max_grad_norm is not None):
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

    def _start_worker(self) -> Worker:
        """The CPU worker, with the thread count decided once and said where it surprises."""
        cores, ranks = usable_cores(), local_ranks()
        if os.environ.get("OMP_NUM_THREADS") == "1" and self.cpu_threads > 1:
            log.warning(
                "offloadopt: OMP_NUM_THREADS=1 (torchrun sets it when it starts several "
                "processes); the CPU update runs on its own %d threads (cores %d // local ranks "
                "%d - 1); pass cpu_threads= to choose", self.cpu_threads, cores, ranks,
            )  # fmt: skip
        if self.cpu_threads > cores:
            self._warn_once(
                "threads-over",
                f"cpu_threads={self.cpu_threads} is more than the {cores} cores this process "
                "may use: the worker's threads will contend for them",
            )
        if self.cpu_threads * ranks < cores // 2:
            self._warn_once(
                "threads",
                f"the CPU update will run on {self.cpu_threads} threads x {ranks} local ranks, "
                f"far below the {cores} cores this process may use (cpu_threads=)",
            )
        return Worker(self.cpu_threads, self.flush_denormal)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    # ------------------------------------------------------------------ reporting
    def crossing_host_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every host buffer that crosses the link: ``(label, tensor)`` pairs."""
        out = [(f"the master of arena {k}, {a.label}", a.master)
               for k, a in enumerate(self.arenas) if a.device.type == "cuda"]  # fmt: skip
        for d, tr in self._transfers().items():
            if d.type == "cuda":
                out += [(f"{d} grad staging slot {i}", t) for i, t in enumerate(tr.host_slots())]
        return out

    def _transfers(self) -> dict[torch.device, Transfer]:
        return self._pipeline.transfers if self._pipeline is not None else {}

    def _check_pinned(self) -> None:
        """The pinned invariant: every crossing host buffer is pinned (unless pin_memory=False)."""
        if not self.pin_memory:
            return
        bad = [f"{label}: {t.numel() * t.element_size()} bytes" for label, t in self.crossing_host_tensors()
               if t.numel() and not t.is_pinned()]  # fmt: skip
        if bad:
            raise RuntimeError(
                "host buffers that cross the link must be pinned; not pinned: " + "; ".join(bad)
            )

    def placement_table(self) -> str:
        """The placement as a fixed-width table (see :func:`offloadopt.placement.format_placement`);
        while params are still on the meta device, a line saying so."""
        if self._unplaced:
            n = sum(len(self.param_groups[gi]["params"]) for gi in self._unplaced)
            why = (
                "max_gpu_memory chooses the fraction at the first step()"
                if self._budget_pending()
                else "built on the meta device"
            )
            pending = (f"placement pending: {n} params of {len(self._unplaced)} groups ({why}; "
                       "placed at the first step(), or ensure_placed())")  # fmt: skip
            return (
                pending if not self.placement else f"{format_placement(self.placement)}\n{pending}"
            )
        return format_placement(self.placement)

    def is_offloaded(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s optimizer state (and fp32 master) lives on the host."""
        rec = self._records.get(p)
        return rec is not None and rec.offloaded

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory held for optimizer state and staging."""
        n = sum(a.buffers.nbytes for a in self.arenas if a.buffers is not None)
        return n + sum(tr.ring.buffers.nbytes for tr in self._transfers().values())

    @property
    def pinned_nbytes(self) -> int:
        """Of :attr:`host_nbytes`, the bytes that are pinned now."""
        n = sum(a.buffers.pinned_nbytes for a in self.arenas if a.buffers is not None)
        return n + sum(tr.ring.buffers.pinned_nbytes for tr in self._transfers().values())

    @property
    def stats(self) -> dict[str, float]:
        """Figures of the last ``step()``: ``d2h_wait_ms`` (worker time blocked on D2H
        events), ``cpu_update_ms`` (worker time in the fused kernel), ``device_update_ms``
        (host time launching the device-resident update), ``collect_ms`` (host time checking
        grads and state before the update), ``h2d_ms`` and ``d2h_ms`` (GPU time of the copies
        and casts on the side streams), ``d2h_nbytes`` / ``h2d_nbytes`` (bytes over the
        link), ``step_ms`` (host wall time of ``step()``), ``worker_ms`` (the worker's wall time from
        the first bucket's arrival to the last H2D queued, its D2H waits included),
        ``buckets`` (offloaded buckets updated), ``cpu_threads`` (the worker's),
        ``local_ranks`` (processes of the job on this host, sharing its cores).

        Reading it waits for the CUDA events of that step's copies (long done by the time the
        next forward has run)."""
        if self._pipeline is not None:
            for key, ms in self._pipeline.collect_timing().items():
                self._stats[key] = self._stats.get(key, 0.0) + ms
        return dict(self._stats)

    # ------------------------------------------------------------------ records
    def _record(self, p: torch.Tensor, group: dict[str, Any], gi: int, i: int) -> ParamRecord:
        """``p``'s record; a param put into a group's list by hand gets one now (on the device)."""
        rec = self._records.get(p)
        if rec is None:
            keys = self.rule.state_keys_for(group)
            info = ParamInfo(-1, self._name(group, gi, i), gi, tuple(p.shape), p.dtype,
                             p.requires_grad, group.get("offload"), n_states=len(keys))  # fmt: skip
            pl = place([info], 0.0, 0, self.master_weights)[0]
            rec = ParamRecord(pl.name, replace(pl, reason="added by hand"), state_keys=keys)
            self._records[p] = rec
            self.placement.append(rec.placement)
        return rec

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rule's torch layout (``torch.optim.AdamW(fused=True)``'s) plus ``"master"``
        (fp32) where one exists. Loadable with ``torch.load(weights_only=True)``.

        A snapshot: every state tensor is a standalone copy in host memory (CPU), taken now,
        so a kept dict never changes with later steps (torch's holds live references; ours
        cannot for offloaded entries, which are views of host arenas, and one rule for every
        entry beats two). Device-resident state is copied to the host with a blocking D2H,
        never duplicated on the GPU. ``load_state_dict`` copies values into the optimizer's
        buffers wherever they come from; ``torch.optim`` optimizers move them to their params.
        """
        if not self._budget_pending():  # a budget waits for the first step(): no state yet
            self.ensure_placed()
        if self.overlap == "delayed" and not self._module_waits and self._inflight is not None:
            self._warn_once(
                "delayed-unwatched",
                "overlap='delayed' without opt.watch(model): a model.state_dict() taken before "
                "this call holds weights one step older than these masters, and a resume from "
                "the pair loses that step's update (fp32 params cannot even tell)",
            )
        self.synchronize()
        self._raise_if_broken()
        sd = checkpoint.pack(super().state_dict(), on_device=self._snapshot_on_device)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in sd["state"].items():
            p = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
            if is_dtensor(p) and isinstance(
                entry, dict
            ):  # FSDP2: each shard goes out as a DTensor laid out like its param
                for key, v in entry.items():
                    if key != "step" and isinstance(v, torch.Tensor):
                        entry[key] = wrap_like(p, v)
        return sd

    @torch.no_grad()  # copies from tensors that require grad record nothing
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate the whole dict, then copy it into the existing buffers.

        Group hyperparameters (and extra keys such as a scheduler's ``initial_lr``) come from
        the dict; ``params``, ``param_names`` and ``offload`` stay the optimizer's own, and the
        rule's torch flags are restored. State is copied, never aliased: masters keep fp32,
        offloaded state stays in its arena on the host. A low-precision param with no master
        in the dict (a checkpoint of ``torch.optim.AdamW`` on a bf16 model) gets its master
        from its current weights, with a warning: such a resume cannot be exact. An fp32
        offloaded param's host copy is refreshed from the param. Params with no saved state
        lose theirs (it is made again at their next grad), as in torch.

        Raises:
            ValueError: the dict does not fit this optimizer; nothing was changed.
        """
        self.ensure_placed()
        try:
            self.synchronize()
        except Exception:  # noqa: BLE001 - a failed step is what a load repairs
            pass
        sd = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        groups = self.param_groups
        specs = [[(self._record(p, g, gi, i).name, tuple(local(p).shape))
                  for i, p in enumerate(g["params"])] for gi, g in enumerate(groups)]  # fmt: skip
        sd = local_state(sd, self.param_groups, lambda p: self._records[p].name)
        saved_groups, saved_state = checkpoint.validate(sd, self.rule, specs)
        if self._step is not None and self._step.run is not None:
            self._step.run.abort()
        self._step, self._broken, self._pending_clip = None, None, None
        for g, s in zip(groups, saved_groups, strict=True):
            g.update(checkpoint.merge_group(g, s, self.rule))
        ignored_masters = False
        params = [p for g in groups for p in g["params"]]
        for index, p in enumerate(params):
            entry = saved_state.get(index)
            if entry is None:
                self.state.pop(p, None)
                continue
            self._load_entry(p, self._records[p], entry)
            ignored_masters |= entry.get("master") is not None and "master" not in self.state[p]
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
        if ignored_masters:
            warnings.warn(
                "the state dict carries fp32 masters for params that keep none here (fp32 "
                "params, or master_weights=False): they were ignored, and the state takes the "
                "params' dtype",
                stacklevel=2,
            )
        self._check_pinned()

    def _load_entry(self, p: torch.Tensor, rec: ParamRecord, entry: dict[str, Any]) -> None:
        """Copy one validated saved entry into ``p``'s existing state."""
        if not self.state.get(p):
            self._init_state(p, rec)
        mine = self.state[p]
        if self.rule.has_step:
            mine["step"].fill_(entry["step"])
        for k in rec.state_keys:
            if entry.get(k) is None:  # a lazy key not made yet (SGD before its first step)
                mine.pop(k, None)
                continue
            if k not in mine:
                mine[k] = self._new_state_tensor(p, rec, k)
            mine[k].copy_(entry[k])
        if "master" in mine:
            if entry.get("master") is not None:
                mine["master"].copy_(entry["master"])
                rec.forget_written()  # compare with the weights at the next step
            else:
                mine["master"].copy_(local(p).detach())
                rec.mark_written(p)
                self._warn_once(
                    "no-master",
                    f"the state dict has no fp32 master for {rec.name} ({p.dtype}): masters were "
                    "made from the current weights, so this resume is not bitwise exact",
                )
        elif rec.offloaded:
            rec.home("master").copy_(local(p).detach())  # fp32 offloaded: the param is the truth
            rec.mark_written(p)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the CPU worker and unpin the staging (idempotent). The optimizer cannot step
        afterwards; its state and ``state_dict()`` stay readable. Also runs when it is
        garbage-collected and at interpreter exit."""
        self._closed = True
        try:
            self.synchronize()
        finally:
            for hooks in (*self._grad_hooks, *self._module_waits):
                hooks.remove()
            if self._ddp_hook is not None:
                self._ddp_hook.remove()  # DDP keeps the hook: a plain all-reduce from now on
            self._grad_hooks, self._module_waits = [], []
            if self._step is not None and self._step.run is not None:
                self._step.run.abort()
            if self._pipeline is not None:
                self._pipeline.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        head = super().__repr__()
        n = sum(1 for p in self.placement if p.offloaded)
        return (
            f"{head[:-2]}\n    offload_fraction: {self.offload_fraction}\n"
            f"    offloaded params: {n} of {len(self.placement)}\n)"
        )

    def __getstate__(self):
        # torch's Optimizer pickles only defaults, state and groups; ours would come back
        # without its pinned arenas, staging, worker and streams, broken. Refuse clearly.
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or deep-copied: its state lives in pinned "
            "host buffers, a worker thread and CUDA streams of this process; save and load "
            "opt.state_dict() instead"
        )


def _weights_and_grads_nbytes(tensors: list[torch.Tensor]) -> int:
    """Device bytes of these params (this rank's shards) and of the grads of trainable ones."""
    return sum(local(p).nbytes * (2 if p.requires_grad else 1) for p in tensors)
