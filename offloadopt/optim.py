"""The hybrid optimizers' machinery: torch's fused update rules with a chosen fraction of their
state on the host. :class:`HybridOptimizer` is written once; :class:`offloadopt.adamw.HybridAdamW`
is AdamW's signature on it (offloadopt/rules.py holds the rule), adam.py and sgd.py the others."""

from __future__ import annotations

import numbers
import warnings
import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.link.layout import Arena, Bucket
from offloadopt.link.pipeline import Pipeline
from offloadopt.link.transfer import Transfer
from offloadopt.options import Options
from offloadopt.place import budget
from offloadopt.place.auto import AutoFraction
from offloadopt.place.placement import Placement
from offloadopt.place.placer import Placer
from offloadopt.place.records import ParamRecord
from offloadopt.rules import ADAMW, Rule
from offloadopt.shards import local, local_state, world_size
from offloadopt.state import checkpoint
from offloadopt.state.store import OptimizerState
from offloadopt.step.guards import Guards
from offloadopt.step.hooks import GradHooks
from offloadopt.step.publish import publisher_for
from offloadopt.step.scaling import Scaling
from offloadopt.step.step import Timeline
from offloadopt.step.steps import Stepping
from offloadopt.step.update import Updater
from offloadopt.validation import (
    check_combinations,
    check_ddp,
    check_zero,
    validate_group,
    validate_options,
    validate_params_arg,
)
from offloadopt.warn import WarnOnce, weak_method

__all__ = ["HybridOptimizer"]


class HybridOptimizer(Stepping, Optimizer):
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
        validate_options(self.rule, hyper, o, amsgrad=amsgrad, capturable=capturable,
                         differentiable=differentiable)  # fmt: skip
        params = validate_params_arg(params)
        sizes = budget.sizes(max_gpu_memory=o.max_gpu_memory, max_host_memory=o.max_host_memory,
                             activation_bytes=o.activation_bytes)  # fmt: skip
        check_combinations(o, sizes, world_size())
        self.options = o  # as given; offload_fraction and the like change below and later
        self.overlap, self.wait = o.overlap, o.wait
        self.grads_final, self.release_grads = o.grads_final, o.release_grads
        self.delay_after = int(o.delay_after)  # overlap="delayed": synchronous steps first
        self.timeout_s = float(o.timeout_s)
        self._ready = False
        # The step being fed, the step in flight after step() returned, and why the optimizer
        # refuses to step, under one lock (offloadopt/step/step.py)
        self._timeline = Timeline(type(self).__name__)
        self._warn_once = WarnOnce()  # one warning per key, shared with the owners
        self._stats: dict[str, float] = {}
        # max_grad_norm, the attached GradScaler (backward mode checks found_inf, amp.py),
        # clip_grad_norm_'s request and the last step's norm (offloadopt/step/scaling.py)
        max_grad_norm = None if o.max_grad_norm is None else float(o.max_grad_norm)
        self._scaling = Scaling(max_grad_norm, o.grad_scaler, self._timeline, id(self))
        self._accumulating = 0  # depth of opt.accumulating()
        self._grad_hooks: list[GradHooks] = []
        self._closed = False
        self._ddp = o.ddp  # the DDP model whose all-reduced buckets announce grads (hooks.DDPGrads)
        self._ddp_hook = None
        self._reductions: list = []  # ddp=: this backward's all-reduce futures
        # torch's group flags, so a cross-load into torch's optimizer keeps its fused kernel.
        defaults = {**hyper, **self.rule.torch_flags, "offload": None}
        if "betas" in defaults:
            defaults["betas"] = tuple(defaults["betas"])
        self._records: dict[torch.Tensor, ParamRecord] = {}  # the Placer fills it
        # What a step refuses before any state changes (offloadopt/step/guards.py). Its
        # callables reach the optimizer through a weak reference: a dropped optimizer must die
        # at once, or its grad hooks fire on the next one's backward until a gc.collect()
        # (benchmarks/faults.py's lifetimes; tests/test_faults.py).
        me, scaling = weakref.ref(self), self._scaling
        self._guards = Guards(self._records, self._timeline, lambda: scaling.grad_scaler,
                              self._warn_once, lambda: me()._closed,
                              lambda: me()._pipeline)  # fmt: skip
        # WHEN the new weights are visible (offloadopt/step/publish.py): at step()'s return,
        # per watched module, or at the next step (the delayed update), chosen once here. Its
        # callables reach the optimizer through a weak reference: a bound method would make a
        # cycle, and a dropped optimizer would live on until the garbage collector ran, its
        # grad hooks answering a model another optimizer now trains (tests/test_faults.py,
        # test_200_optimizers_dropped_are_collected_and_leave_nothing_behind).
        me = weakref.ref(self)
        self._publish = publisher_for(
            o, self._timeline, self._records, lambda: me()._pipeline, timeout_s=self.timeout_s,
            finish=lambda st, streams: me()._finish(st, streams),
            warn_once=self._warn_once,
            closed=lambda: me()._closed,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.state = OptimizerState(self)  # assignments copy into the buffers (state.py)
        # Where each param's state lives, the host arenas, staging and worker, the fraction
        # and what chose it (offloadopt/place/placer.py)
        self._placer = Placer(
            self.param_groups, self.rule, o, sizes, name=type(self).__name__,
            records=self._records, ddp=o.ddp is not None, warn_once=self._warn_once,
            on_offloaded=weak_method(self._hook_offloaded),
        )  # fmt: skip
        # The rule's application and the making of state (offloadopt/step/update.py)
        self._updater = Updater(
            self.rule, self._records, self.state, master_weights=self._placer.master_weights,
            bucket_nbytes=self._placer.bucket_nbytes, timeout_s=self._placer.timeout_s,
            warn_once=self._warn_once,
        )  # fmt: skip
        for g in self.param_groups:
            self._placer.check_auto_group(g)
        if o.ddp is not None:
            check_ddp(o.ddp, self.param_groups, self._name)
        check_zero(o.overlap, self.param_groups, world_size())
        self._placer.place_or_defer(list(range(len(self.param_groups))))
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
                self._placer.check_auto_group(self.param_groups[-1])
            self._check_group(self.param_groups[-1])
            placer = self._placer if self._ready else None
            if (
                placer
                and placer.sizes["max_gpu_memory"] is not None
                and not placer.budget_pending()
            ):
                placer.check_budget_for([len(self.param_groups) - 1])
            if placer:
                placer.place_or_defer([len(self.param_groups) - 1])
        except BaseException:
            self.param_groups.pop()  # nothing half built: the group goes with its failure
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        """A subclass's own refusals for a group about to be placed (its params are tensors);
        raising here adds nothing, at construction and in ``add_param_group`` alike."""

    def _hook_offloaded(self, params: list[torch.Tensor]) -> None:
        """The Placer placed ``params`` on the host: in backward mode with updates that may
        start before step() (steps.py's note), their grad hooks announce each grad."""
        if self.overlap == "backward" and (
            self.grads_final or self.max_grad_norm is not None or self.grad_scaler is not None
        ):
            self._grad_hooks.append(GradHooks(self, params))

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

    def _updates_started(self) -> bool:
        """Updates began before ``step()`` (backward mode, declared): from then until
        ``step()`` returns the worker writes the params of the buckets fed so far."""
        return self._timeline.updates_started()

    # ------------------------------------------------------------------ publishing
    # WHEN the new weights are visible is the publish policy's (offloadopt/step/publish.py).
    def synchronize(self) -> None:
        """Wait for this optimizer's work in flight (host side), and make the current stream
        wait for every copy back (GPU side). A no-op when nothing is in flight.

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        self._publish.synchronize()

    def watch(self, model: torch.nn.Module) -> None:
        """Register forward pre-hooks on the modules of ``model`` that own offloaded params;
        with ``wait="module"`` each waits only for its own params' copies back. Modules inside
        a ``torch.compile``d region are not waited for one by one (their pre-hooks trace as
        nothing, ``fullgraph=True`` included): once one has run compiled, or the model was
        compiled before this call, ``step()`` waits for every copy back before it returns (one
        full wait, as ``wait="step"``). Call it before the model's first compiled forward:
        torch.compile ignores hooks added after a region first ran (then the step after the
        first forward that waited for nothing warns, and ``step()`` waits for everything from
        there on). A region first compiled while a step's copies are in flight (after
        ``step()``, before the next forward): call ``opt.synchronize()`` before its first
        forward. Removed by ``close()``.

        Under FSDP2 call it after ``fully_shard``: the waits go on the FSDP2 modules, before
        FSDP2's own pre-forward (which all-gathers the module's shards on FSDP2's streams, and
        those of the modules it prefetches), and those streams wait too.

        Raises:
            ValueError: FSDP2 params (DTensors) in a model with no FSDP2 module (``watch()``
                before ``fully_shard``).
        """
        if self._budget_pending():  # placed at the first step(): the waits are registered then
            self._publish.watch_later.append(weakref.ref(model))
            return
        self.ensure_placed()
        offloaded = {p for p, rec in self._records.items() if rec.offloaded}
        self._publish.watch(model, offloaded)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; with ``set_to_none=False`` the grads are zeroed in place, so this first
        waits for copies that may still read them (``set_to_none=True`` does not wait: the
        copies hold their grads and ``record_stream`` protects the memory; with
        ``overlap="delayed"`` the update already took the offloaded params' grads).

        Raises:
            RuntimeError: between backward and ``step()`` once this step's updates began
                (declared backward mode: ``grads_final=True``, ``max_grad_norm=`` or
                ``grad_scaler=``); zeroing the grads would not skip the step (they ran with
                backward's grads), and nothing is changed. A fresh user's finding: the usual skip of a step with a
                non-finite loss was silently an update.
        """
        if self._updates_started():
            started = len(self._step.fed)
            raise RuntimeError(
                f"zero_grad() between backward and step(): this step's updates already began "
                f"({started} buckets, at the end of backward or during it with "
                "grads_final=True), so zeroing the grads cannot skip the step; nothing was "
                "changed. Call step() to finish it, or, to be able to skip steps (a "
                "non-finite loss), leave grads_final and max_grad_norm unset so that updates "
                "wait for step() (an attached GradScaler, grad_scaler=, skips a step whose "
                "grads hold an inf or NaN by itself)"
            )
        self._publish.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none=set_to_none)

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
        return self._placer.crossing_host_tensors()

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
        return self._placer.host_nbytes()

    @property
    def pinned_nbytes(self) -> int:
        """Of :attr:`host_nbytes`, the bytes that are pinned now."""
        return self._placer.pinned_nbytes()

    # The Placer's figures, read where torch users and the step's pieces look for them.
    @property
    def offload_fraction(self) -> float:
        """The offload fraction in force (``"auto"`` and ``max_gpu_memory`` set it)."""
        return self._placer.fraction

    @property
    def placement_choice(self) -> dict[str, Any] | None:
        """What chose the fraction, and why (a budget, ``"auto"``, the caller), or None."""
        return self._placer.choice

    @placement_choice.setter
    def placement_choice(self, choice: dict[str, Any] | None) -> None:
        self._placer.choice = choice

    @property
    def placement(self) -> list[Placement]:
        """Every param's :class:`~offloadopt.place.placement.Placement`, in group order."""
        return self._placer.placement

    @property
    def arenas(self) -> list[Arena]:
        return self._placer.arenas

    @property
    def buckets(self) -> list[Bucket]:
        return self._placer.buckets

    @property
    def _pipeline(self) -> Pipeline | None:
        return self._placer.pipeline

    @property
    def _auto(self) -> AutoFraction | None:
        return self._placer.auto

    @property
    def cpu_threads(self) -> int:
        return self._placer.cpu_threads

    @property
    def bucket_nbytes(self) -> int:
        return self._placer.bucket_nbytes

    @property
    def min_offload_numel(self) -> int:
        return self._placer.min_offload_numel

    @property
    def placement_policy(self) -> str:
        return self._placer.policy

    @property
    def master_weights(self) -> bool:
        return self._placer.master_weights

    @property
    def pin_memory(self) -> bool:
        return self._placer.pin_memory

    def _transfers(self) -> dict[torch.device, Transfer]:
        return self._placer.transfers()

    def _forward_order(self) -> list[Bucket]:
        return self._placer.forward_order()

    def _device(self) -> torch.device:
        return self._placer.device()

    def _budget_pending(self) -> bool:
        return self._placer.budget_pending()

    def _name(self, group: dict[str, Any], gi: int, i: int) -> str:
        return self._placer.param_name(group, gi, i)

    def _record(self, p: torch.Tensor, group: dict[str, Any], gi: int, i: int) -> ParamRecord:
        return self._placer.record(p, group, gi, i)

    def _check_pinned(self) -> None:
        self._placer.check_pinned()

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
        self.state.reset(mapping, self._records, self._timeline.lock, self.synchronize)

    # ------------------------------------------------------------------ placement
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
        if not self._placer.ensure_placed():
            return
        later, self._publish.watch_later = self._publish.watch_later, []
        for ref in later:
            model = ref()
            if model is not None:
                self.watch(model)

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
        placer = self._placer
        ours = placer.auto is not None and placer.auto.moving  # auto's own move
        replaced = None if ours else placer.choice_replaced()

        def say_replaced() -> None:  # once placed: a refused call replaces nothing
            if replaced is not None:
                # A fresh user's finding: the budget (or auto) was dropped without a word.
                self._warn_once(
                    "fraction-replaces-choice",
                    f"set_offload_fraction({fraction:g}) replaces {replaced}: the fraction is "
                    "now yours and no budget is checked again (placement_choice says so)",
                )

        if placer.budget_pending():  # the caller's fraction instead of the budget's choice
            placer.drop_budget(fraction, replaced)
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
            self._replace(fraction)
            if not ours:  # placed: from here the caller's fraction holds, not a choice
                placer.caller_chose(fraction, replaced)
                say_replaced()

    def _replace(self, fraction: float) -> None:
        """Place every param again at ``fraction`` with the groups' current values (their
        state keys included), moving the state over losslessly; the caller holds the lock,
        with signals deferred, and nothing is in flight.

        Raises:
            PinnedAllocationError: the new buffers could not be had (the old placement stays).
        """
        saved = checkpoint.pack(Optimizer.state_dict(self), on_device=False)["state"]
        # opt.state is emptied in place, never replaced: the owners that read it (and a
        # user's reference to opt.state) keep the same object.
        old_state = dict.copy(self.state)
        old_hooks = (self._grad_hooks, self._publish.module_waits)
        dict.clear(self.state)
        self._grad_hooks, self._publish.module_waits = [], []
        try:
            self._placer.replace(fraction)
        except BaseException:
            dict.update(self.state, old_state)
            self._grad_hooks, self._publish.module_waits = old_hooks
            raise
        for hooks in (*old_hooks[0], *old_hooks[1]):
            hooks.remove()  # the old placement's grad hooks and module waits
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in saved.items():
            # An empty entry is a read of opt.state[p] for a param without state (torch's
            # defaultdict makes it): no state to move, as load_state_dict() drops it too.
            if isinstance(index, int) and 0 <= index < len(params) and isinstance(entry, dict) and entry:  # fmt: skip
                self._updater.load_entry(params[index], self._records[params[index]], entry)
        watched, self._publish.watched = self._publish.watched, []
        for ref in watched:
            model = ref()
            if model is not None:
                self.watch(model)

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
        if (
            self.overlap == "delayed"
            and not self._publish.module_waits
            and self._inflight is not None
        ):
            self._warn_once(
                "delayed-unwatched",
                "overlap='delayed' without opt.watch(model): a model.state_dict() taken before "
                "this call holds weights one step older than these masters, and a resume from "
                "the pair loses that step's update (fp32 params cannot even tell)",
            )
        self.synchronize()
        self._guards.check_snapshot()
        sd = checkpoint.pack(super().state_dict(), on_device=self._snapshot_on_device)
        params = [p for g in self.param_groups for p in g["params"]]
        return checkpoint.wrap_shards(checkpoint.drop_placement(sd), params)

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
        self._publish.refuse_other_thread()  # not swallowed below: it is no failed step
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
                if self._step is not None and self._step.run is not None:
                    # the worker's bucket in hand lands before the load
                    self._stop_run(self._step.run)
                self._step, self._broken, self._scaling.pending_clip = None, None, None
                for g, s in zip(groups, saved_groups, strict=True):
                    g.update(checkpoint.merge_group(g, s, self.rule))
                if self._keys_changed():  # a checkpoint of SGD with momentum into one built without
                    self._replace_for_keys()  # (a fresh user's finding: its buffers were dropped)
                ignored_masters = self._updater.load_state(groups, saved_state)
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

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the CPU worker and unpin the staging (idempotent). The optimizer cannot step
        afterwards; its state and ``state_dict()`` stay readable. Also runs when it is
        garbage-collected and at interpreter exit."""
        self._closed = True
        try:
            self.synchronize()
        finally:
            for hooks in (*self._grad_hooks, *self._publish.module_waits):
                hooks.remove()
            if self._ddp_hook is not None:
                self._ddp_hook.remove()  # DDP keeps the hook: a plain all-reduce from now on
            self._grad_hooks, self._publish.module_waits = [], []
            if self._step is not None and self._step.run is not None:
                self._stop_run(self._step.run)
            self._placer.close()

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
