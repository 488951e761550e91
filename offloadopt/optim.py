"""The hybrid optimizers' machinery: torch's fused update rules with a chosen fraction of their
state on the host. :class:`HybridOptimizer` is written once; :class:`offloadopt.adamw.HybridAdamW`
is AdamW's signature on it (offloadopt/rules.py holds the rule), adam.py and sgd.py the others."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import replace as dc_replace
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt import kernels
from offloadopt.debug import Debug
from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.options import Options
from offloadopt.place import budget, report
from offloadopt.place.placer import Placer
from offloadopt.place.records import ParamRecord
from offloadopt.rules import ADAMW, AdamWRule, Rule
from offloadopt.shards import check_ddp, check_zero, local, local_state, world_size
from offloadopt.state import checkpoint
from offloadopt.state.store import OptimizerState
from offloadopt.step.amp import scaler_inputs
from offloadopt.step.feed import Feeder
from offloadopt.step.guards import Guards
from offloadopt.step.publish import publisher_for
from offloadopt.step.scaling import Scaling
from offloadopt.step.speculate import Speculation
from offloadopt.step.start import start_policy
from offloadopt.step.step import Phase, Step, Timeline, begin_step, steps_taken, stop_run
from offloadopt.step.update import Updater
from offloadopt.validation import (
    check_combinations,
    check_fraction,
    validate_group,
    validate_options,
    validate_params_arg,
)
from offloadopt.warn import WarnOnce

__all__ = ["HybridOptimizer"]


def _owned(owner: str, name: str, doc: str, settable: bool = False) -> property:
    """A property of the optimizer that reads ``self.<owner>.<name>`` (and writes it when
    ``settable``): the value lives in its owner, once."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, owner), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, put if settable else None, doc=doc)


class HybridOptimizer(Optimizer):
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
        foreach: bool | None = None,
        **options: Any,
    ):
        # One Options from the keywords (offloadopt/options.py); an unknown one is named for
        # the class the caller built, not this base (a fresh user's nit).
        o = Options.parse(type(self).__name__, options)
        validate_options(self.rule, hyper, o, amsgrad=amsgrad, capturable=capturable,
                         differentiable=differentiable, foreach=foreach)  # fmt: skip
        rule = dc_replace(self.rule, moments=o.state_dtype, master_sr=o.master_weights == "bf16-sr",
                          flush_denormal=o.flush_denormal)  # fmt: skip
        if rule.compressed:  # offloadopt's own kernel (offloadopt/kernels/), built now so that
            self.rule = rule  # a missing compiler fails here; else the class's rule, as before
            kernels.load()
        elif o.speculate and isinstance(self.rule, AdamWRule):  # Adam/AdamW: the kernel writes
            try:  # the speculative backups (offloadopt/step/speculate.py); built now, not on
                kernels.load()  # the worker in the middle of a step (about 40 s, once)
            except kernels.KernelBuildError as e:
                from offloadopt.warn import warn

                warn(f"offloadopt: speculate=True: {e}; the speculative backups are copies "
                     "made before each update instead (slower: docs/modes.md)")  # fmt: skip
        params = validate_params_arg(params)
        sizes = budget.sizes(max_gpu_memory=o.max_gpu_memory, max_host_memory=o.max_host_memory,
                             activation_bytes=o.activation_bytes)  # fmt: skip
        check_combinations(o, sizes, world_size())
        self.options = o  # as given; what changes later (the fraction, ...) is its owner's
        self.overlap, self.wait = o.overlap, o.wait
        self.grads_final, self.release_grads = o.grads_final, o.release_grads
        self.delay_after = int(o.delay_after)  # overlap="delayed": synchronous steps first
        self.timeout_s = float(o.timeout_s)
        self._ready, self._closed = False, False
        self._records: dict[torch.Tensor, ParamRecord] = {}  # the Placer fills it
        self._warn_once = WarnOnce()  # one warning per key, shared with the owners
        # torch's group flags, so a cross-load into torch's optimizer keeps its fused kernel.
        defaults = {**hyper, **self.rule.torch_flags, "offload": None}
        if "betas" in defaults:
            defaults["betas"] = tuple(defaults["betas"])
        # The owners (docs/how-it-works.md has the table). None holds the optimizer: the few
        # callables that must reach it hold it weakly, so a dropped optimizer dies at once and
        # its grad hooks with it, not at the next gc.collect() after firing on the next
        # optimizer's backward (tests/test_faults.py drops 200 optimizers of one model).
        me, name = weakref.ref(self), type(self).__name__
        self._timeline = Timeline(name)  # the lock, the steps in time, a refusal
        max_grad_norm = None if o.max_grad_norm is None else float(o.max_grad_norm)
        self._scaling = scaling = Scaling(max_grad_norm, o.grad_scaler, self._timeline, id(self))
        self._guards = Guards(self._records, self._timeline, lambda: scaling.grad_scaler,
                              self._warn_once, lambda: me()._closed,
                              lambda: me()._placer.pipeline)  # fmt: skip
        self._publish = publisher_for(  # WHEN new weights are visible
            o, self._timeline, self._records, lambda: me()._placer.pipeline,
            timeout_s=self.timeout_s, finish=lambda st, streams: me()._feeder.finish(st, streams),
            warn_once=self._warn_once, closed=lambda: me()._closed,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.state = OptimizerState(self)  # assignments copy into the buffers (state.py)
        self._placer = Placer(  # where each param's state lives, and the memory it holds
            self.param_groups, self.rule, o, sizes, name=name, records=self._records,
            ddp=o.ddp is not None, warn_once=self._warn_once,
            on_offloaded=lambda params: me()._start.hook(params),
        )  # fmt: skip
        self._updater = Updater(  # the rule's application; making and loading state
            self.rule, self._records, self.state, master_weights=o.master_weights is True,
            bucket_nbytes=self._placer.bucket_nbytes, timeout_s=self.timeout_s,
            warn_once=self._warn_once,
        )  # fmt: skip
        self._feeder = Feeder(  # buckets to the pipeline, the device update, the step's end
            self._timeline, self._placer, self._updater, self._guards, self._publish,
            self.state, self.rule, release_grads=o.release_grads,
            module_order=o.wait == "module", timeout_s=self.timeout_s,
        )  # fmt: skip
        self._speculation = Speculation(  # speculate=True: backups, validation, rollback
            scaling, lambda: me()._placer.transfers(), lambda: me()._placer.buckets,
            self.timeout_s, in_kernel=self._updater.backs_up_in_kernel,
        ) if o.speculate else None  # fmt: skip
        self._start = start_policy(  # WHEN an update may start
            o, timeline=self._timeline, placer=self._placer, feeder=self._feeder,
            scaling=scaling, begin=lambda: me()._begin(), grads_final=o.grads_final,
            release_grads=o.release_grads, ddp=o.ddp is not None, timeout_s=self.timeout_s,
            speculation=self._speculation,
        )  # fmt: skip
        for g in self.param_groups:
            self._placer.check_auto_group(g)
        if rule.master_sr and not any(p.dtype == torch.bfloat16 for g in self.param_groups
                                      for p in g["params"]):  # fmt: skip
            self._warn_once("bf16-sr-no-bf16", (
                "master_weights='bf16-sr' has no bf16 param to act on: fp32 params keep "
                "updating in fp32 (the fp32 weight is its own master) and fp16 params are "
                "refused; cast the model to bf16 (model.to(torch.bfloat16)) for bf16 masters, "
                "or leave master_weights out"))  # fmt: skip
        if o.ddp is not None:
            check_ddp(o.ddp, self.param_groups, self._placer.param_name)
        check_zero(o.overlap, self.param_groups, world_size())
        self._placer.place_or_defer(list(range(len(self.param_groups))))
        if o.ddp is not None:
            try:
                self._start.hook_ddp(o.ddp)
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

    # ------------------------------------------------------------------ the step
    @torch.compiler.disable  # under torch.compile the step runs eagerly (a graph break)
    def step(self, closure: Callable[[], float] | None = None):
        """One update of every param with a grad; params whose grad is None are skipped.

        Raises:
            RuntimeError: a sparse grad, a grad whose shape differs from its param, a param
                listed in two groups, a grad changed after its update started (named), or an
                optimizer left inconsistent by a failed step (see ``discard_failed_step``).
            ValueError, TypeError: a group's hyperparameter is invalid (named); nothing changed.
            WorkerError: an offloaded update failed on the worker (names the bucket).
            TimeoutError: a wait outlasted ``timeout_s`` (names what it waited for).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_whole()
        return loss

    @no_grad_whole  # the closure above runs with signals delivered as they come
    def _step_whole(self) -> None:
        """The step after the closure, as its timeline (without grad; a signal waits for its
        handler until the step is whole). Phase 0 freezes the values and checks every grad
        before any state changes; phase 2 (the offloaded buckets, on the worker) starts before
        phase 1 (the device-resident params) is launched; phase 3 publishes."""
        t0 = time.perf_counter()
        micro_steps = self._start.take_micro_steps()  # gradient accumulation's: budget, auto
        self._ensure_placed(micro_steps)  # params built on the meta device, materialized since
        auto = self._placer.sampling()  # offload_fraction="auto" while it measures, else None
        with signals_deferred(), self._timeline.lock:
            st = self._take_step()  # phase 0: the step begun in backward, or a new one
            with_grad = self._guards.grads_to_update(st, self.timeout_s)
            self._scaling.at_step(st, with_grad, *scaler_inputs(self))  # clip and scale, once
            streams = self._feeder.update(st, with_grad, auto, t0)  # phases 2 and 1
            self._publish.end_step(st, streams)  # phase 3: as the publish policy says
        # The host wall time of step() itself: with wait="module" or overlap="delayed" the step
        # ends later (the next synchronize() or step()), and the time in between is the
        # caller's (tests/test_overlap.py).
        st.stats["step_ms"] = (time.perf_counter() - t0) * 1e3
        if auto is not None:  # a sample (a step that updated nothing is none); may move state
            auto.end(self, worked=bool(st.prepared), micro_steps=micro_steps)

    def _take_step(self) -> Step:
        """Phase 0: the step that backward's announcements began (its values frozen at the
        first), or a new one; a step whose backward never finished is refused."""
        self._raise_if_broken()
        st = self._timeline.current
        if st is not None and not st.backward_done:
            self._timeline.abandon(st, "a backward that announced grads never finished")
        self._timeline.current = None
        if st is None:
            st = self._begin(may_replace=True)
        elif st.fed:
            self._guards.warn_if_hypers_moved(st, self.param_groups)
        st.phase = Phase.STEPPING
        st.thread = threading.get_ident()
        return st

    def _begin(self, may_replace: bool = False) -> Step:
        """A new step once the step before is over (publish.py): step/step.py's
        ``begin_step``; ``may_replace`` (from ``step()`` only) lets it place the params again
        for new state keys while none has state."""
        self._publish.before_step()
        st = begin_step(self.param_groups, self.rule, self._placer,
                        self._replace_if_stateless if may_replace else None)  # fmt: skip
        delayed = self.overlap == "delayed"
        st.delayed = (
            delayed and steps_taken(self.state, self._records, self.delay_after) >= self.delay_after
        )
        return st

    def _replace_if_stateless(self) -> bool:
        """New state keys at step(): place again while no param has state (begin_step)."""
        if any(self.state.get(q) for q in self._records):
            return False
        self._replace_for_keys()  # the step before was waited for: nothing is in flight
        return True

    def _replace_for_keys(self) -> None:
        """Place every param again with the state keys its group's values need now.

        Raises:
            ValueError: as :meth:`Placer.check_new_keys`; before a step nothing changed,
                inside ``load_state_dict()`` the load fails (refused until one succeeds).
        """
        self._placer.check_new_keys()
        self._replace(self.offload_fraction)

    def discard_failed_step(self) -> None:
        """Accept the state a failed step left (some params updated, others not) and go on.

        Nothing is rolled back and the grads stay as they are: call ``zero_grad()`` before the
        next ``step()``, or the params already updated get the same grads applied again (a
        fresh user's finding; the README says so). With ``speculate=True``, the speculative
        updates of the failed step, not yet validated, are rolled back (their pre-step state
        and weights restored, offloadopt/step/speculate.py), as the run without it would
        have started none."""
        with self._timeline.lock:
            st = self._timeline.current
            self._timeline.discard(self.timeout_s)
            if self._speculation is not None and st is not None:
                self._speculation.roll_back(st, self.state, self._records)

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Mark the backward passes inside as non-final micro-steps of gradient accumulation:
        their grads stay on the device and nothing starts before the final backward (outside
        this context) or ``step()``. Without the marker, ``overlap="backward"`` treats every
        backward as final (a second backward before ``step()`` is an error)."""
        return self._start.accumulating()

    def _raise_if_broken(self) -> None:
        self._timeline.raise_if_broken()

    @property
    def debug(self) -> Debug:
        """The optimizer's owners, for tests, benchmarks and debugging: not a stable API
        (offloadopt/debug.py lists what it holds)."""
        return Debug(self)

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
        if (
            self._placer.budget_pending()
        ):  # placed at the first step(): the waits are registered then
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
        self._guards.check_zero_grad()  # updates began in backward: nothing changed
        self._publish.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ clipping and scaling
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
        with self._timeline.lock:  # the params with a grad, read under the step's lock
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            return self._scaling.clip_grad_norm_(max_norm, params)

    # ------------------------------------------------------------------ reporting
    def crossing_host_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every host buffer that crosses the link: ``(label, tensor)`` pairs."""
        return report.crossing_host_tensors(self.arenas, self._placer.transfers())

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
        return report.host_nbytes(self.arenas, self._placer.transfers())

    @property
    def pinned_nbytes(self) -> int:
        """Of :attr:`host_nbytes`, the bytes that are pinned now."""
        return report.pinned_nbytes(self.arenas, self._placer.transfers())

    # What the owners hold, read (and a few written) under the names torch users know.
    offload_fraction = _owned(
        "_placer",
        "fraction",
        "The offload fraction in force (``'auto'`` and ``max_gpu_memory`` set it).",
    )
    placement_choice = _owned(
        "_placer",
        "choice",
        "What chose the fraction, and why (a budget, ``'auto'``, the caller), or None.",
        settable=True,
    )
    placement = _owned(
        "_placer",
        "placement",
        "Every param's :class:`~offloadopt.place.placement.Placement`, in group order.",
    )
    arenas = _owned(
        "_placer", "arenas", "The host arenas (offloadopt/link/layout.py), one per group and dtype."
    )
    buckets = _owned("_placer", "buckets", "The arenas' buckets, in the order they are placed.")
    cpu_threads = _owned("_placer", "cpu_threads", "The CPU worker's threads.")
    bucket_nbytes = _owned("_placer", "bucket_nbytes", "The bucket size in bytes.")
    min_offload_numel = _owned("_placer", "min_offload_numel", "``min_offload_numel=``.")
    placement_policy = _owned("_placer", "policy", "``placement_policy=``.")
    master_weights = _owned("_placer", "master_weights", "``master_weights=``.")
    pin_memory = _owned("_placer", "pin_memory", "``pin_memory=``.")
    max_grad_norm = _owned(
        "_scaling",
        "max_grad_norm",
        "``max_grad_norm=``: every step's grads are clipped to this global L2 norm inside the update, or None.",
        settable=True,
    )
    grad_scaler = _owned(
        "_scaling",
        "grad_scaler",
        "``grad_scaler=``: the attached ``torch.amp.GradScaler``, or None.",
        settable=True,
    )
    last_grad_norm = _owned(
        "_scaling",
        "last_grad_norm",
        "With clipping: the last step's global grad norm (unscaled with an attached GradScaler), a 0-dim fp32 tensor on the params' device; None before the first.",
    )

    @property
    def stats(self) -> dict[str, float]:
        """Figures of the last completed step (with ``wait="module"`` or ``overlap="delayed"`` a
        step completes at the next ``synchronize()`` or ``step()``: until then these are the
        step's before, and ``{}`` before the first): ``d2h_wait_ms`` (worker time blocked on D2H
        events), ``cpu_update_ms`` (worker time in the fused kernel), ``cpu_kernel_ms`` (of it, the
        time inside offloadopt's compiled kernel's parallel regions: compressed state; 0 when
        torch's kernel runs), ``launch_ms`` (worker
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
        ``redone_buckets`` (``speculate=True``, a step whose speculative updates were undone
        and made again: how many buckets; the link bytes and worker times include both),
        ``cpu_threads`` (the worker's),
        ``local_ranks`` (processes of the job on this host, sharing its cores).

        Reading it waits for the CUDA events of that step's copies (long done by the time the
        next forward has run)."""
        if self._placer.pipeline is not None:
            for key, ms in self._placer.pipeline.collect_timing().items():
                self._feeder.stats[key] = self._feeder.stats.get(key, 0.0) + ms
        return dict(self._feeder.stats)

    @property
    def speculation(self) -> dict[str, int] | None:
        """``speculate=True``'s counts since construction (offloadopt/step/speculate.py's
        note): ``steps`` (steps that speculated), ``buckets`` (bucket updates made
        speculatively), ``redone_clip`` / ``redone_inf`` (steps undone and made again because
        the clip coefficient was below 1.0 / found_inf was set), ``redone_buckets``,
        ``discarded`` (steps rolled back by :meth:`discard_failed_step`), and
        ``backup_nbytes`` (pageable host bytes of the pre-step copies, kept between steps).
        None without ``speculate``."""
        spec = self._speculation
        if spec is None:
            return None
        return {**spec.counts, "backup_nbytes": spec.backup_nbytes}

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
        self.state.reset(mapping, self._records, self.rule, self._timeline.lock, self.synchronize)

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
        self._ensure_placed()

    def _ensure_placed(self, micro_steps: int = 1) -> None:
        """:meth:`ensure_placed`; from ``step()`` with its ``micro_steps`` (gradient
        accumulation), which a ``max_gpu_memory`` budget's choice at the first step counts."""
        if not self._placer.ensure_placed(micro_steps):
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
        fraction = check_fraction(fraction)
        placer = self._placer
        ours = placer.auto is not None and placer.auto.moving  # auto's own move
        replaced = None if ours else placer.choice_replaced()

        if placer.budget_pending():  # the caller's fraction instead of the budget's choice
            placer.drop_budget(fraction, replaced)
            self.ensure_placed()
            placer.say_replaced(fraction, replaced)
            return
        self.ensure_placed()
        self.synchronize()
        self._raise_if_broken()
        self._guards.check_worker()
        # Ctrl-C or SIGTERM in the middle would leave state half copied in: they reach their
        # handler once the move is done (steps.signals_deferred).
        with signals_deferred(), self._timeline.lock:
            if self._timeline.current is not None:
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
                placer.say_replaced(fraction, replaced)

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
        old_hooks = (self._start.grad_hooks, self._publish.module_waits)
        dict.clear(self.state)
        self._updater.flat.drop()  # the device's flat buffers: laid out again from the state
        self._start.grad_hooks, self._publish.module_waits = [], []
        try:
            self._placer.replace(fraction)
        except BaseException:
            for hooks in (*self._start.grad_hooks, *self._publish.module_waits):
                hooks.remove()  # a placement that failed after its hooks were registered
            dict.update(self.state, old_state)
            self._start.grad_hooks, self._publish.module_waits = old_hooks
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
        if not self._placer.budget_pending():  # a budget waits for the first step(): no state yet
            self.ensure_placed()
        if (
            self.overlap == "delayed"
            and not self._publish.module_waits
            and self._timeline.inflight is not None
        ):
            self._warn_once(
                "delayed-unwatched",
                "overlap='delayed' without opt.watch(model): a model.state_dict() taken before "
                "this call holds weights one step older than these masters, and a resume from "
                "the pair loses that step's update (fp32 params cannot even tell)",
            )
        sd = checkpoint.pack(self._snapshot_source(), on_device=self._snapshot_on_device)
        sd = checkpoint.export_moments(sd, self.rule)  # fp32 under torch's keys
        params = [p for g in self.param_groups for p in g["params"]]
        return checkpoint.wrap_shards(checkpoint.drop_placement(sd), params)

    def _snapshot_source(self) -> dict[str, Any]:
        """torch's ``state_dict()`` layout over the live state tensors, once every update has
        landed (``state_dict()`` copies it; ``save_streamed`` writes it as it is)."""
        self.synchronize()
        self._guards.check_snapshot()
        return super().state_dict()

    def save_streamed(self, path: str, model: torch.nn.Module | None = None,
                      extra: Any = None) -> int:  # fmt: skip
        """Write the state to the folder ``path`` in ``torch.save`` parts of at most 256 MiB,
        with ``model.state_dict()`` and ``extra`` (any object ``torch.load(weights_only=True)``
        reads; another is a ValueError) when given; returns the bytes written.

        For models whose state does not fit twice in host memory: ``state_dict()`` copies
        every state tensor to the host (and decodes int8 moments to fp32 beside their codes);
        this writes the live tensors in the stored representation, with one part in flight
        (offloadopt/state/streamed.py, docs/checkpoints.md). A temporary folder beside
        ``path`` is renamed into place: an interrupt leaves the previous checkpoint or the new
        one. Read it back with :meth:`load_streamed` (not with ``torch.optim.AdamW``).

        ``state_dict`` hooks (``register_state_dict_pre_hook`` / ``_post_hook``) edit a whole
        dict, which a streamed save never builds: with one registered it is refused.

        Raises:
            NotImplementedError: FSDP2 (DTensor) params. OSError: the folder could not be
                written (a previous checkpoint at ``path`` is kept). ValueError: a
                ``state_dict`` hook is registered (nothing was written).
        """
        from offloadopt.state import streamed

        self._refuse_dict_hooks("save_streamed", "state_dict hook(s)", "state_dict()",
                                self._optimizer_state_dict_pre_hooks,
                                self._optimizer_state_dict_post_hooks)  # fmt: skip
        return streamed.save(self, path, model, extra)

    def _refuse_dict_hooks(self, verb: str, what: str, instead: str, *registries) -> None:
        """ValueError when any of ``registries`` (torch's hook dicts) holds a hook: a streamed
        checkpoint never holds the whole dict such a hook edits, and skipping it silently
        would save or load something else than the hook's owner expects."""
        n = sum(len(r) for r in registries)
        if n:
            raise ValueError(
                f"{verb}: {n} {what} registered on this optimizer; a streamed "
                f"checkpoint never holds the whole dict they edit, so they cannot run: use "
                f"{instead} with torch.save/torch.load, or remove the hooks"
            )

    def load_streamed(self, path: str, model: torch.nn.Module | None = None) -> Any:
        """Read a :meth:`save_streamed` folder into this optimizer (and ``model``'s tensors, in
        place); returns the ``extra`` object saved with it, or None. The whole checkpoint is
        checked against the optimizer and the model first, as ``load_state_dict`` checks a
        dict; then it is read in chunks of at most 256 MiB of host memory.

        ``load_state_dict`` post-hooks run after it, as after ``load_state_dict``; a pre-hook
        (which edits the whole dict, never held here) makes it refuse.

        Raises:
            ValueError: not a streamed checkpoint, or one that does not fit (names what), or
                a ``load_state_dict`` pre-hook is registered; nothing was changed.
            RuntimeError: as ``load_state_dict``.
        """
        from offloadopt.state import streamed_load

        self._refuse_dict_hooks("load_streamed", "load_state_dict pre-hook(s)", "load_state_dict()",
                                self._optimizer_load_state_dict_pre_hooks)  # fmt: skip
        return streamed_load.load(self, path, model)

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
            RuntimeError: between backward and ``step()`` once this step's updates began
                (declared backward mode); nothing was changed.
        """
        self._prepare_load()
        sd = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        self._load_validated(sd)

    def _prepare_load(self) -> None:
        """What every load does before its checks (``load_state_dict``, ``load_streamed``):
        place the groups (meta-device params materialized since), refuse a load mid-step, let
        the updates in flight land (a failed one is what a load repairs)."""
        self.ensure_placed()
        self._publish.refuse_other_thread()  # not swallowed below: it is no failed step
        self._guards.check_load()  # a step in progress since backward: refused, unchanged
        try:
            self.synchronize()
        except Exception:  # noqa: BLE001 - a failed step is what a load repairs
            pass

    def _load_validated(self, sd: Any, before: Callable[[], None] | None = None,
                        real_entry: Callable[[int, dict], dict] | None = None,
                        check: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Validate ``sd`` whole, then copy it in (``load_state_dict``'s work after its
        pre-hooks). ``check``: run after the validation, before anything changes (a streamed
        load verifies its files there; its ValueError changes nothing); ``before``: run once
        everything is validated, before the first copy (a streamed load reads the model's
        weights there); ``real_entry(index, entry)``: the entry with its tensors' values,
        where ``sd`` holds only their shapes (a streamed load,
        offloadopt/state/streamed_load.py). A ValueError after the first copy is raised as a
        RuntimeError: a ValueError means nothing was changed."""
        groups = self.param_groups
        specs = [[(self._placer.record(p, g, gi, i).name, tuple(local(p).shape))
                  for i, p in enumerate(g["params"])] for gi, g in enumerate(groups)]  # fmt: skip
        sd = local_state(sd, self.param_groups, lambda p: self._records[p].name)
        saved_groups, saved_state = checkpoint.validate(sd, self.rule, specs)
        if check is not None:
            check()
        # Copied in place entry by entry: a Ctrl-C (or SIGTERM) waits until every entry is in
        # (torch swaps its state in at once); any other failure part-way leaves the optimizer
        # refusing step() and state_dict() until a load succeeds (tests/test_state_contract.py).
        with signals_deferred():
            try:
                self._timeline.discard(self.timeout_s)  # the bucket in hand lands first
                self._scaling.pending_clip = None
                if before is not None:
                    before()
                for g, s in zip(groups, saved_groups, strict=True):
                    g.update(checkpoint.merge_group(g, s, self.rule))
                if (
                    self._placer.keys_changed()
                ):  # a checkpoint of SGD with momentum into one built without
                    self._replace_for_keys()  # (a fresh user's finding: its buffers were dropped)
                ignored_masters = self._updater.load_state(groups, saved_state, real_entry)
            except BaseException as e:
                self._timeline.refuse("load_state_dict() failed part-way")
                if isinstance(e, ValueError):  # found after copies began: not "nothing changed"
                    raise RuntimeError(f"the load failed part-way, after its checks: {e}; some "
                                       "state was copied in, and the optimizer refuses step() "
                                       "until a load succeeds") from e  # fmt: skip
                raise
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
        if ignored_masters:
            warnings.warn(
                "the state dict carries fp32 masters for params that keep none here (fp32 "
                "params, master_weights=False, or master_weights='bf16-sr', whose bf16 weight "
                "is the master): they were ignored, and the state takes the params' dtype",
                stacklevel=2,
            )
        self._placer.check_pinned()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the CPU worker and unpin the staging (idempotent). The optimizer cannot step
        afterwards; its state and ``state_dict()`` stay readable. Also runs when it is
        garbage-collected and at interpreter exit."""
        self._closed = True
        try:
            self.synchronize()
        finally:
            self._start.remove_hooks()  # grad hooks; DDP keeps its comm hook, as a plain one
            for hooks in self._publish.module_waits:
                hooks.remove()
            self._publish.module_waits = []
            if self._timeline.current is not None and self._timeline.current.run is not None:
                stop_run(self._timeline.current.run, self.timeout_s)
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
