"""The hybrid optimizers' machinery: torch's fused update rules with a chosen fraction of their
state on the host. :class:`HybridOptimizer` is written once; :class:`offloadopt.adamw.HybridAdamW`
is AdamW's signature on it (offloadopt/rules.py holds the rule), adam.py and sgd.py the others."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt import wiring
from offloadopt.checkpoints import Checkpoints, opened_by_torch_save
from offloadopt.debug import Debug
from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.options import Options
from offloadopt.place import budget
from offloadopt.place.auto import cost_mode
from offloadopt.reports import Reports
from offloadopt.rules import ADAMW, Rule
from offloadopt.shards import world_size
from offloadopt.state.store import OptimizerState
from offloadopt.step.amp import scaler_inputs
from offloadopt.step.step import Phase, Step, stop_run
from offloadopt.validation import (
    check_combinations,
    check_fraction,
    validate_group,
    validate_options,
    validate_params_arg,
)
from offloadopt.warn import WarnOnce

__all__ = ["HybridOptimizer"]


class HybridOptimizer(Reports, Checkpoints, Optimizer):
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
        fused: bool | None = None,
        **options: Any,
    ):
        o = Options.parse(type(self).__name__, options)  # unknown keywords named for the class
        validate_options(self.rule, hyper, o, amsgrad=amsgrad, capturable=capturable, differentiable=differentiable,
                         foreach=foreach, fused=fused, owner=type(self).__name__)  # fmt: skip
        self.rule = wiring.rule_for(self.rule, o)
        params = validate_params_arg(params)
        sizes = budget.sizes(max_gpu_memory=o.max_gpu_memory, max_host_memory=o.max_host_memory,
                             activation_bytes=o.activation_bytes)  # fmt: skip
        check_combinations(o, sizes, world_size())
        self.options = o  # as given; what changes later (the fraction, ...) is its owner's
        self.overlap, self.wait = o.overlap, o.wait
        self.grads_final, self.release_grads = o.grads_final, o.release_grads
        self.delay_after = int(o.delay_after)  # overlap="delayed": synchronous steps first
        self.timeout_s = float(o.timeout_s)
        self._ready = False
        self._warn_once = WarnOnce()  # one warning per key, shared with the owners
        # torch's group flags, so a cross-load into torch's optimizer keeps its fused kernel.
        defaults = {**hyper, **self.rule.torch_flags, "offload": None}
        if "betas" in defaults:
            defaults["betas"] = tuple(defaults["betas"])
        super().__init__(params, defaults)  # each group checked (validate_group)
        self.state = OptimizerState(self)  # assignments copy into the buffers (state.py)
        wiring.wire(self, o, sizes)  # the owners, each handed the ones it uses
        wiring.check_and_place(self, o)  # the groups checked and placed; ddp='s comm hook
        self._ready = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``torch.optim`` contract); its params are placed by the same rule,
        with the fraction applied to the new group's eligible state bytes.

        Raises:
            TypeError, ValueError, NotImplementedError: a bad group (named); nothing is added.
        """
        param_group = validate_group(param_group, self.defaults, self.rule, self.options,
                                     len(self.param_groups), type(self).__name__)  # fmt: skip
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
        self._relocate.ensure_placed(micro_steps)  # meta-device params materialized since
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
        if auto is not None:  # a sample (a step that updated nothing is none)
            mode = cost_mode(self.overlap, self.grads_final or self.grad_scaler is not None,
                             self.max_grad_norm)  # fmt: skip
            self._relocate.for_auto(auto, auto.end(
                self._placer, worked=bool(st.prepared), stats=self._feeder.stats, mode=mode,
                synchronize=self._publish.synchronize, wait_module=self.wait == "module",
                micro_steps=micro_steps))  # fmt: skip

    def _take_step(self) -> Step:
        """Phase 0: the step that backward's announcements began (its values frozen at the
        first), or a new one; a step whose backward never finished is refused."""
        self._raise_if_broken()
        st = self._timeline.current
        if st is not None and not st.backward_done:
            self._timeline.abandon(st, "a backward that announced grads never finished")
        self._timeline.current = None
        if st is None:
            st = self._feeder.begin(may_place_again=True)
            if st is None and self._relocate.for_new_placement():
                st = self._feeder.begin()  # new keys or dtypes: placed again, state moved over
            elif st is None:
                st = self._feeder.begin()  # raises: new keys while a param has state
        elif st.fed:
            self._guards.warn_if_hypers_moved(st, self.param_groups)
        st.phase = Phase.STEPPING
        st.thread = threading.get_ident()
        return st

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
        self._relocate.watch(model)

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
        self._relocate.ensure_placed()

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
        self._relocate.set_fraction(check_fraction(fraction))

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the CPU worker and unpin the staging (idempotent). The optimizer cannot step
        afterwards; its state and ``state_dict()`` stay readable. Also runs when it is
        garbage-collected and at interpreter exit."""
        self._timeline.closed = True
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
            f"opt.state_dict() instead{opened_by_torch_save()}"
        )
