"""The hybrid optimizers' machinery: torch's fused update rules with a chosen fraction of their
state on the host. :class:`HybridOptimizer` is written once; :class:`offloadopt.adamw.HybridAdamW`
is AdamW's signature on it (offloadopt/rules.py holds the rule), adam.py and sgd.py the others."""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from dataclasses import replace
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.link.layout import Arena, Bucket
from offloadopt.link.pipeline import Pipeline
from offloadopt.link.transfer import Transfer
from offloadopt.link.worker import Worker, default_cpu_threads, local_ranks, usable_cores
from offloadopt.options import Options
from offloadopt.place import budget
from offloadopt.place.auto import PROBE_FRACTION, AutoFraction
from offloadopt.place.placement import ParamInfo, Placement, format_placement, place
from offloadopt.place.records import ParamRecord
from offloadopt.placing import Placing
from offloadopt.rules import ADAMW, Rule
from offloadopt.shards import is_dtensor, local, local_state, world_size, wrap_like
from offloadopt.state import checkpoint
from offloadopt.state.store import OptimizerState
from offloadopt.step.guards import Guards
from offloadopt.step.hooks import GradHooks
from offloadopt.step.scaling import Scaling
from offloadopt.step.step import Timeline
from offloadopt.step.steps import Stepping
from offloadopt.validation import (
    check_ddp,
    check_zero,
    validate_group,
    validate_options,
    validate_params_arg,
)
from offloadopt.warn import warn

__all__ = ["HybridOptimizer"]

log = logging.getLogger("offloadopt")


OVERLAPS = ("step", "backward", "delayed")
WAITS = ("step", "module")
# bucket_nbytes=None: 64 MiB; 128 MiB with overlap="backward" and 256 MiB with overlap="delayed",
# where the worker's copy launches between buckets (about 0.3-0.5 ms a bucket inside a step, the
# GIL shared with the training thread's forward and backward) add to the CPU pass: GPT-2 1.5B at
# fraction 1, backward mode, 128 MiB against 64 MiB: 553-585 against 633-765 ms in two runs;
# delayed, 256 MiB: 1.13x -> 1.05x of the step's bound (benchmarks/RESULTS.md).
BUCKET_NBYTES = {"step": 64 * 2**20, "backward": 128 * 2**20, "delayed": 256 * 2**20}


class HybridOptimizer(Placing, Stepping, Optimizer):
    """The machinery shared by the hybrid optimizers (see :class:`HybridAdamW` for the
    timeline, memory and caveats). A subclass sets :attr:`rule` and maps its torch signature
    onto ``hyper`` (the rule's hyperparameters)."""

    rule: Rule = ADAMW
    # state_dict()'s copies of device-resident state: on the host (False), or on their device
    # (True: Megatron's HybridDeviceOptimizer layout, which its tests check).
    _snapshot_on_device = False
    # torch.amp.GradScaler.step() sets opt.grad_scale and opt.found_inf and calls step(), which
    # hands them to the kernels (offloadopt/step/amp.py), instead of unscaling grads on the device
    # and reading found_inf with .item().
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        hyper: dict[str, Any],
        *,
        amsgrad: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        **options: Any,
    ):
        # One Options from the keywords (offloadopt/options.py); an unknown one is named for
        # the class the caller built, not this base (a fresh user's nit).
        o = Options.parse(type(self).__name__, options)
        if o.placement_policy not in ("state-bytes", "megatron"):
            raise ValueError(
                f"Invalid placement_policy: {o.placement_policy!r} (expected 'state-bytes' or 'megatron')"
            )
        validate_options(self.rule, hyper, o, amsgrad=amsgrad, capturable=capturable,
                         differentiable=differentiable)  # fmt: skip
        params = validate_params_arg(params)
        sizes = budget.sizes(max_gpu_memory=o.max_gpu_memory, max_host_memory=o.max_host_memory,
                             activation_bytes=o.activation_bytes)  # fmt: skip
        auto = o.offload_fraction == "auto"
        if sizes["max_gpu_memory"] is not None and not auto and o.offload_fraction != 1.0:
            raise ValueError(
                f"offload_fraction={o.offload_fraction!r} with max_gpu_memory={o.max_gpu_memory!r}: "
                "give one (the budget chooses the fraction), or offload_fraction='auto'"
            )
        if auto and o.overlap == "delayed" and sizes["max_gpu_memory"] is None:
            raise ValueError(
                "offload_fraction='auto' with overlap='delayed': the fraction decides which "
                "params train on weights one step old, so a fraction chosen from timings would "
                "make the results depend on them; give a number (1.0 is the delayed update's "
                "usual one), or max_gpu_memory="
            )
        for name, value in (
            ("max_host_memory", o.max_host_memory),
            ("activation_bytes", o.activation_bytes),
        ):
            if value is not None and sizes["max_gpu_memory"] is None:
                raise ValueError(f"{name}={value!r} without max_gpu_memory does nothing")
        if o.grad_scaler is not None and world_size() > 1 and o.ddp is None:
            raise ValueError(
                f"grad_scaler= with {world_size()} ranks and no ddp=: the check for infs would "
                "see this rank's shard alone; leave it out (step() takes the scaler's values, as "
                "torch's fused AdamW does)"
            )
        if auto and world_size() > 1:
            raise ValueError(
                f"offload_fraction='auto' with {world_size()} ranks: it measures one process, and "
                "ranks choosing apart would train unevenly; give each rank the same number"
            )
        self.options = o  # as given; offload_fraction and the like change below and later
        self.placement_policy = o.placement_policy
        self._budget = sizes  # max_gpu_memory: the fraction is chosen at the first step()
        self.placement_choice: dict[str, Any] | None = None  # what chose the fraction, and why
        # offload_fraction="auto" (offloadopt/place/auto.py): probe, choose, verify in the first steps
        self._auto = (AutoFraction(o.auto_tolerance, sizes["max_gpu_memory"] is not None, o.release_grads)
                      if auto else None)  # fmt: skip
        self.offload_fraction = PROBE_FRACTION if auto else float(o.offload_fraction)
        self.min_offload_numel = o.min_offload_numel
        self.master_weights = o.master_weights
        self.pin_memory = o.pin_memory
        self.bucket_nbytes = (
            o.bucket_nbytes if o.bucket_nbytes is not None else BUCKET_NBYTES[o.overlap]
        )
        self.flush_denormal = o.flush_denormal
        self.overlap, self.wait = o.overlap, o.wait
        self.grads_final, self.release_grads = o.grads_final, o.release_grads
        self.delay_after = int(o.delay_after)  # overlap="delayed": synchronous steps first
        # Step mode: the training thread waits in step() while the worker runs; when updates
        # overlap backward or the next forward, it needs a core of its own.
        busy = o.overlap != "step" or o.wait != "step"
        self.cpu_threads = o.cpu_threads or default_cpu_threads(training_thread_busy=busy)
        self.timeout_s = float(o.timeout_s)
        self._ready = False
        # The step being fed, the step in flight after step() returned, and why the optimizer
        # refuses to step, under one lock (offloadopt/step/step.py)
        self._timeline = Timeline(type(self).__name__)
        # max_grad_norm, the attached GradScaler (backward mode checks found_inf, amp.py),
        # clip_grad_norm_'s request and the last step's norm (offloadopt/step/scaling.py)
        max_grad_norm = None if o.max_grad_norm is None else float(o.max_grad_norm)
        self._scaling = Scaling(max_grad_norm, o.grad_scaler, self._timeline, id(self))
        self._accumulating = 0  # depth of opt.accumulating()
        self._grad_hooks: list[GradHooks] = []
        self._closed = False
        self._module_waits: list = []
        self._unwaited = False  # a forward ran past its waits (steps._begin): wait in step()
        self._watched: list = []  # weak references to the models given to watch()
        self._watch_later: list = []  # watch() before a budget's choice: registered after it
        self._ddp = o.ddp  # the DDP model whose all-reduced buckets announce grads (hooks.DDPGrads)
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
        # What a step refuses before any state changes (offloadopt/step/guards.py). Its
        # callables reach the optimizer through a weak reference: a dropped optimizer must die
        # at once, or its grad hooks fire on the next one's backward until a gc.collect()
        # (benchmarks/faults.py's lifetimes; tests/test_faults.py).
        me, scaling = weakref.ref(self), self._scaling
        self._guards = Guards(self._records, self._timeline, lambda: scaling.grad_scaler,
                              lambda key, message: me()._warn_once(key, message),
                              lambda: me()._closed, lambda: me()._pipeline)  # fmt: skip
        self._stats: dict[str, float] = {}
        self._warned: set[str] = set()
        self._unplaced: list[int] = []  # groups waiting for their meta params (ensure_placed)
        super().__init__(params, defaults)
        self.state = OptimizerState(self)  # assignments copy into the buffers (state.py)
        for g in self.param_groups:
            self._check_auto_group(g)
        if o.ddp is not None:
            check_ddp(o.ddp, self.param_groups, self._name)
        check_zero(o.overlap, self.param_groups, world_size())
        self._place_or_defer(list(range(len(self.param_groups))))
        if o.ddp is not None:
            from offloadopt.step.hooks import DDPGrads

            try:
                self._ddp_hook = DDPGrads(self, o.ddp)
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

    def _check_group(self, group: dict[str, Any]) -> None:
        """A subclass's own refusals for a group about to be placed (its params are tensors);
        raising here adds nothing, at construction and in ``add_param_group`` alike."""

    def _start_worker(self) -> Worker:
        """The CPU worker, with the thread count decided once and said where it surprises."""
        cores, ranks = usable_cores(), local_ranks()
        if os.environ.get("OMP_NUM_THREADS") == "1" and self.cpu_threads > 1:
            log.warning(
                "offloadopt: OMP_NUM_THREADS=1 (torchrun sets it when it starts several "
                "processes); the CPU update runs on its own %d threads (cores %d // local ranks "
                "%d, less one when updates overlap the training thread); pass cpu_threads= to "
                "choose", self.cpu_threads, cores, ranks,
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

    # ------------------------------------------------------------------ the timeline
    # The step's pieces read the Timeline through these names (step/step.py owns the values).
    @property
    def _lock(self):
        return self._timeline.lock

    @property
    def _step(self):
        return self._timeline.current

    @_step.setter
    def _step(self, st) -> None:
        self._timeline.current = st

    @property
    def _inflight(self):
        return self._timeline.inflight

    @_inflight.setter
    def _inflight(self, st) -> None:
        self._timeline.inflight = st

    @property
    def _inflight_streams(self):
        return self._timeline.inflight_streams

    @_inflight_streams.setter
    def _inflight_streams(self, streams) -> None:
        self._timeline.inflight_streams = streams

    @property
    def _broken(self):
        return self._timeline.broken

    @_broken.setter
    def _broken(self, why) -> None:
        self._timeline.broken = why

    # ------------------------------------------------------------------ clipping and scaling
    # offloadopt/step/scaling.py owns them; these are the optimizer's public names.
    @property
    def max_grad_norm(self) -> float | None:
        """``max_grad_norm=``: every step's grads are clipped to this global L2 norm inside
        the update (a float), or None."""
        return self._scaling.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._scaling.max_grad_norm = value

    @property
    def grad_scaler(self):
        """``grad_scaler=``: the attached ``torch.amp.GradScaler``, or None."""
        return self._scaling.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler) -> None:
        self._scaling.grad_scaler = scaler

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """With ``max_grad_norm``: the last step's global grad norm (unscaled with an attached
        GradScaler), a 0-dim fp32 tensor on the params' device; None before the first."""
        return self._scaling.last_grad_norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's grads by their global L2 norm, inside the update: the next
        ``step()`` multiplies every fp32 grad by ``min(1, max_norm / (norm + 1e-6))`` (torch's
        ``clip_grad_norm_`` coefficient) on the device, before the update; ``p.grad`` is left
        as it is. Returns the norm, a 0-dim fp32 tensor on the params' device.

        The norm is the L2 norm of the per-param norms in group order (each computed in fp32),
        the same at every fraction and in every mode.

        Raises:
            ValueError: ``max_norm`` is not a finite number > 0.
            RuntimeError: the optimizer was built with ``max_grad_norm`` (it clips every step),
                or a GradScaler is attached (``grad_scaler=``: the grads are still scaled here;
                ``max_grad_norm=`` clips them unscaled).
        """
        with self._lock:  # the params with a grad, read under the step's lock
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            return self._scaling.clip_grad_norm_(max_norm, params)

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
        """The placement as a fixed-width table (see :func:`offloadopt.place.placement.format_placement`);
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
        """Figures of the last completed step (with ``wait="module"`` or ``overlap="delayed"`` a
        step completes at the next ``synchronize()`` or ``step()``: until then these are the
        step's before, and ``{}`` before the first): ``d2h_wait_ms`` (worker time blocked on D2H
        events), ``cpu_update_ms`` (worker time in the fused kernel), ``launch_ms`` (worker
        time queuing the D2H and H2D copies and casts, staging-slot waits included),
        ``feed_wait_ms`` (worker time waiting for the next bucket to be fed after the first
        one arrived: backward had not announced it yet), ``device_update_ms``
        (host time launching the device-resident update), ``collect_ms`` (host time checking
        grads and state before the update), ``h2d_ms`` and ``d2h_ms`` (GPU time of the copies
        and casts on the side streams, summed over every step since ``stats`` was last read),
        ``d2h_nbytes`` / ``h2d_nbytes`` (bytes over the
        link), ``step_ms`` (host wall time of ``step()``), ``worker_ms`` (the worker's wall time from
        the first bucket's arrival to the last H2D queued, its D2H waits included),
        ``buckets`` (offloaded buckets updated; 0, and ``worker_ms`` 0, when none was),
        ``cpu_threads`` (the worker's),
        ``local_ranks`` (processes of the job on this host, sharing its cores).

        Reading it waits for the CUDA events of that step's copies (long done by the time the
        next forward has run)."""
        if self._pipeline is not None:
            for key, ms in self._pipeline.collect_timing().items():
                self._stats[key] = self._stats.get(key, 0.0) + ms
        return dict(self._stats)

    # ------------------------------------------------------------------ opt.state
    @property
    def state(self) -> OptimizerState:
        """``opt.state``: param -> its state dict (offloadopt/state/store.py)."""
        return self.__dict__["state"]

    @state.setter
    def state(self, mapping: Any) -> None:
        """``opt.state = mapping`` as torch allows it: the state starts afresh from ``mapping``
        (usually an empty ``defaultdict(dict)``), made again at each param's next grad where
        it is placed (host state stays on the host, in its pinned arena); a param's entry in
        ``mapping`` is copied into its buffers, as an assignment to ``opt.state[p]`` is.

        Raises:
            TypeError: ``mapping`` is not a mapping, or an entry of a param is not a dict.
            ValueError: an entry's tensor does not fit the param's buffer.
        """
        if isinstance(mapping, OptimizerState) or "state" not in self.__dict__:
            self.__dict__["state"] = mapping  # ours, or torch's __init__ before our own
            return
        if not hasattr(mapping, "items"):
            raise TypeError(f"opt.state = {type(mapping).__name__}: expected a mapping")
        entries = list(mapping.items())
        for p, entry in entries:
            rec = self._records.get(p)
            if rec is None:
                continue
            if not isinstance(entry, dict):
                raise TypeError(
                    f"opt.state = ...: the entry of {rec.name} is a {type(entry).__name__}, "
                    "expected a dict of its state"
                )
            for key, v in entry.items():
                if key != "step" and isinstance(v, torch.Tensor) and v.numel() != p.numel():
                    raise ValueError(
                        f"opt.state = ...: {rec.name}'s {key!r} has {v.numel()} elements, "
                        f"the param {p.numel()}"
                    )
        with signals_deferred(), self._lock:
            self.synchronize()  # no update in flight reads or writes the old state
            fresh = self.state
            dict.clear(fresh)  # the same object: the owners that read it keep it
            for p, entry in entries:
                fresh[p] = entry  # copied into p's buffers where p has a record

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
        The groups leave out the ``"offload"`` key: placement is the loading optimizer's own.
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
        if self._updates_started():
            # Some offloaded params hold this step's update, the others not yet: no
            # checkpoint of that resumes as any run would.
            if not self._step.backward_done:  # interrupted: step() will refuse it too
                raise RuntimeError(
                    f"{type(self).__name__}.state_dict(): this step's updates started during a "
                    "backward that has not finished (interrupted, or still running in another "
                    "thread), so some params were updated and others not; after an interrupt "
                    "call opt.load_state_dict(...) to restore a checkpoint, or "
                    "opt.discard_failed_step() to go on from here"
                )
            raise RuntimeError(
                f"{type(self).__name__}.state_dict() between backward and step(): this step's "
                "updates started during backward (grads_final, max_grad_norm or grad_scaler "
                "with overlap='backward') and end in step(); call state_dict() after step()"
            )
        sd = checkpoint.pack(super().state_dict(), on_device=self._snapshot_on_device)
        for g in sd["param_groups"]:
            # Placement is the loading optimizer's own (load_state_dict keeps its groups'
            # "offload"), so a checkpoint carries none: torch.distributed.checkpoint loads
            # only keys the checkpoint has, and one of torch's AdamW, or one taken at another
            # placement, must load here (found by benchmarks/faults.py: "Missing key in
            # checkpoint state_dict: optim.param_groups.0.offload").
            g.pop("offload", None)
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

    @no_grad_whole  # no grad (copies record nothing); signals deferred around it
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
        self._refuse_other_thread()  # not swallowed below: it is no failed step
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
        # Copied in place entry by entry: a Ctrl-C (or SIGTERM) waits until every entry is in
        # (torch swaps its state in at once); any other failure part-way leaves the optimizer
        # refusing step() and state_dict() until a load succeeds (tests/test_state_contract.py).
        with signals_deferred():
            try:
                ignored_masters = self._load_validated(groups, saved_groups, saved_state)
            except BaseException:
                self._broken = "load_state_dict() failed part-way"
                raise
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

    def _load_validated(self, groups, saved_groups, saved_state) -> bool:
        """Copy a validated state dict in; returns whether it carried masters that were ignored."""
        if self._step is not None and self._step.run is not None:
            self._stop_run(self._step.run)  # the worker's bucket in hand lands before the load
        self._step, self._broken, self._scaling.pending_clip = None, None, None
        for g, s in zip(groups, saved_groups, strict=True):
            g.update(checkpoint.merge_group(g, s, self.rule))
        if self._keys_changed():  # a checkpoint of SGD with momentum into one built without
            self._replace_for_keys()  # (a fresh user's finding: its buffers were dropped)
        ignored_masters = False
        params = [p for g in groups for p in g["params"]]
        for index, p in enumerate(params):
            entry = saved_state.get(index)
            if entry is None:
                self.state.pop(p, None)
                continue
            self._load_entry(p, self._records[p], entry)
            ignored_masters |= entry.get("master") is not None and "master" not in self.state[p]
        return ignored_masters

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
                self._stop_run(self._step.run)
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
