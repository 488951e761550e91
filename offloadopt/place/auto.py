"""``offload_fraction="auto"``: measure the first steps, predict every fraction with the cost
model (offloadopt/place/costmodel.py), move to the one it picks, then measure that.

Timeline (each phase is :data:`MEASURED_STEPS` steps; the optimizer calls :meth:`begin`,
:meth:`mark` and :meth:`end` from ``step()``, and :meth:`moved` after a move ``end`` asked
for; auto reads the Placer it is handed and records its choice there, and never moves state
itself):

1. *Probe*: the optimizer is placed at :data:`PROBE_FRACTION` (or, with ``max_gpu_memory``, at
   the budget's choice, made at the first ``step()``); ``overlap="backward"``'s updates wait
   for ``step()`` (:attr:`AutoFraction.holds`). The first step pays for lazy state and
   warm-up and is not measured. Each later step gives, on the compute stream (CUDA events; the
   host clock without CUDA): the window from the end of the previous ``step()`` to the start of
   this one (forward + backward), the device-resident update, and the period from end to end
   (the whole training step). ``opt.stats`` gives the worker's kernel time and the link's bytes
   and times. With gradient accumulation every window spans the whole optimizer step, all its
   micro-steps (``step()`` marks it); the micro-steps a step has (the optimizer counts
   ``opt.accumulating()`` blocks) go to the cost model, whose backward mode hides the CPU work
   behind one micro-step's backward and forward, not the whole step's.
2. *Choose*: medians become :class:`costmodel.Measurements` (:func:`measurements`; the
   probe's own period, measured and predicted, is kept beside them). Without a budget the choice
   is :func:`costmodel.largest_hidden` (the largest fraction whose predicted step stays within
   ``1 + tolerance * CHOICE_MARGIN`` of fraction 0's: half the tolerance); with a budget it stays the budget's (the smallest
   fraction that fits, which is also the fastest that fits: the predicted step grows with the
   fraction). :meth:`AutoFraction.end` returns the fraction; the step moves the state there,
   losslessly (offloadopt/relocate.py), and tells it (:meth:`AutoFraction.moved`).
3. *Baseline* (without a budget): the state moves to fraction 0 and fraction 0's period is
   measured (the model's prediction of it was 3-6% high on the H200, which let a choice end at
   1.08-1.12x the real fraction 0's step). If fraction 0 does not fit (out of memory) or cannot
   be placed, the prediction stands in, and ``choice["measured_step_ms_at_0"]`` stays None.
4. *Verify*: the state moves to the chosen fraction, whose period is measured and logged beside
   the prediction. Without a budget, a period above ``1 + tolerance`` times fraction 0's
   (measured in the baseline; else predicted) moves the state down to the fraction the model, corrected by that error, keeps within it, and that
   one is verified in turn (:data:`CORRECTIONS` times at most; ``choice["corrections"]``).
   After each move (the baseline's and the choice's alike) the step whose window spans it and
   :data:`SETTLE_STEPS` more are no sample: both are timed in their steady state.
5. *Steady*: :data:`STEADY_AFTER` steps after a choice within the limit, its period is measured
   once more (``choice["steady_step_ms"]``). Above the limit it is corrected as in 4 while
   corrections are left; otherwise a warning says that the host moved, and
   ``choice["host_moved"]`` is True (False when the steady state held).

``opt.placement_choice`` holds the choice, its inputs and the predicted and measured step
times (milliseconds); logger ``offloadopt`` says the same in two lines. When no choice can be
made (nothing offloaded at the probe, or too few elements left on the device to time its
update) the placement stays and ``placement_choice["kept"]`` says why; an optimizer closed
before the choice (a run too short) also says so in a warning (:meth:`AutoFraction.closed`). A
step that updates nothing is no sample.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from offloadopt.place import costmodel, report
from offloadopt.place.costmodel import cost_mode, measurements  # auto's inputs, re-exported
from offloadopt.warn import warn

__all__ = [
    "AutoFraction",
    "PROBE_FRACTION",
    "MEASURED_STEPS",
    "CORRECTIONS",
    "SETTLE_STEPS",
    "STEADY_AFTER",
    "cost_mode",
    "measurements",
]

PROBE_FRACTION = 0.5  # both sides hold state, so both kernels' speeds are measured
MEASURED_STEPS = 3  # steps per phase (medians)
CORRECTIONS = 2  # verified periods above the limit that move the fraction down
# Steps after a move that are no sample (besides the first, whose window spans the move): the
# allocator's new blocks, the old placement's pinned frees and the worker's pages settle there,
# for fraction 0's baseline and the chosen fraction alike, so both are timed in the steady
# state a user then gets. On the H200 (issue 46) a choice verified right after its move
# measured 123.2 ms against fraction 0's 120.5, and stepped 135.6 ms from then on.
SETTLE_STEPS = 2
# Steps after a verified choice before it is measured once more (the steady state): a period
# there above the limit moves the fraction down while corrections are left, or says that the
# host moved (a warning, ``placement_choice["host_moved"]``).
STEADY_AFTER = 6
# The choice aims at this share of the tolerance; the rest is room for what the probe cannot
# see: the steps' spread on a shared host (+-10% step to step on the GPU host) and, in backward
# mode, the grad hooks' hand-off inside backward (the probe holds the updates for step()). On
# the H200 (GPT-2 1.5B, batch 4 x 1024) a choice at the full 5% ended at 1.115x fraction 0's
# step (benchmarks/RESULTS.md, auto).
CHOICE_MARGIN = 0.5
SMALLEST_SIDE = 0.05  # the probe's device share below which its update is not timed
_log = logging.getLogger("offloadopt")


class _Clock:
    """Marks on the compute stream of ``device`` (CUDA events), or host time without CUDA."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))  # after the work queued so far
            return event
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()  # long done by the time this is read: one step later
            return a.elapsed_time(b)
        return (b - a) * 1e3


class AutoFraction:
    """The state of ``offload_fraction="auto"`` (see the module docstring).

    Args:
        tolerance: the step may grow by this share over fraction 0's prediction (0.05 = 5%).
        budgeted: a ``max_gpu_memory`` budget chose the fraction: keep it, measure it.
        release_grads: the optimizer frees grads during backward (the probe must not hold
            them: its memory was counted without them).
    """

    def __init__(self, tolerance: float, budgeted: bool, release_grads: bool = False):
        self.tolerance, self.budgeted = tolerance, budgeted
        self._may_hold = not budgeted and not release_grads
        self.phase = "probe"  # "probe" -> "baseline" -> "verify" -> "steady" -> "done"
        self.choice: dict[str, Any] = {}
        self._clock: _Clock | None = None
        self._cur: dict[str, Any] = {}
        self._prev_end: Any = None
        self._samples: list[dict[str, float]] = []
        self.moving = False  # a move asked for by end(), not yet moved() (a caller's cancels us)
        self._then = "verify"  # the phase after that move
        self._skip = 0  # steps still to pass before the next sample (SETTLE_STEPS, STEADY_AFTER)
        self._model: costmodel.Measurements | None = None  # the probe's, once chosen
        self._stats: dict[str, float] = {}  # the figures of the last step that updated buckets
        self._target = 0.0  # the chosen fraction, while fraction 0 is measured
        self._mode = "step"

    @property
    def active(self) -> bool:
        return self.phase != "done"

    @property
    def holds(self) -> bool:
        """During the probe the updates of ``overlap="backward"`` wait for ``step()`` (as in
        step mode): the window between steps is then forward and backward alone, with no
        hook's hand-off or worker in it, which the cost model's ``fwd_bwd_ms`` means. Not with
        a budget (its choice needs no times) or ``release_grads`` (held grads would exceed
        the memory it counted)."""
        return self.phase == "probe" and self._may_hold

    def check_group(self, group: dict[str, Any]) -> None:
        """offload_fraction="auto" chooses a share of every param: a group that forces its
        placement (``"offload": True`` or ``False``) would not move with it.

        Raises:
            ValueError: such a group, without a budget (whose choice it keeps).
        """
        if not self.budgeted and group.get("offload") is not None:
            raise ValueError(
                f"a param group with 'offload': {group['offload']!r} and "
                "offload_fraction='auto': the cost model predicts a share of every param, and "
                "this group's stays where it is forced; give a number, or drop the key"
            )

    def cancel(self, why: str) -> None:
        """Stop (the caller placed the params itself); ``placement_choice`` says why."""
        if self.active and not self.moving:
            self.phase = "done"
            self.choice["cancelled"] = why
            self._prev_end = self._cur = None

    def begin(self, device: torch.device) -> None:
        """At the start of ``step()``."""
        if self._clock is None:
            self._clock = _Clock(device)
        self._cur = {"start": self._clock.mark()}

    def mark(self, key: str) -> None:
        """Around the device-resident update (``"dev0"``, ``"dev1"``)."""
        if self._cur:
            self._cur[key] = self._clock.mark()

    def end(self, placer: Any, *, worked: bool, stats: dict[str, float],
            synchronize: Callable[[], None], wait_module: bool, mode: str,
            micro_steps: int = 1) -> float | None:  # fmt: skip
        """At the end of a successful ``step()``: a sample, and the phase's action once it has
        :data:`MEASURED_STEPS`. Returns the fraction to move to (the step moves the state,
        then calls :meth:`moved`), or None. A step that updated nothing (no grads) is no
        sample, and the window of the next one runs from the last step that did.

        ``placer``: the Placer (the fraction, records, pipeline; the choice is recorded in
        it); ``stats``: the Feeder's figures of this step; ``synchronize``: the publish
        policy's (every copy of the step waited for); ``wait_module``: ``wait="module"``;
        ``mode``: :func:`cost_mode` of the options now; ``micro_steps``: the step's forward
        and backward passes (gradient accumulation; the optimizer counts them)."""
        if not self._cur:
            return None
        cur, self._cur = self._cur, {}
        if not worked:
            return None
        if self.phase == "probe" and wait_module:
            # The next forward must not wait for this step's copies inside the window that
            # measures forward+backward: the probe waits for them here, as wait="step" would.
            synchronize()
        if stats.get("buckets"):
            self._stats = dict(stats)  # this step's figures (complete: it was waited for)
        cur["end"], cur["micro_steps"] = self._clock.mark(), micro_steps
        prev, self._prev_end = self._prev_end, cur["end"]
        if prev is not None and self._skip > 0:  # settling after a move: no sample
            self._skip -= 1
        elif prev is not None:
            if not self._samples and placer.pipeline is not None:
                placer.pipeline.collect_link()  # the link's copies from here on are ours
            self._samples.append(cur | {"prev": prev})
        if len(self._samples) < MEASURED_STEPS:
            return None
        samples, self._samples = self._timed(self._samples), []
        if self.phase == "probe":
            return self._choose(placer, samples, synchronize, mode)
        if self.phase == "baseline":
            self.choice["measured_step_ms_at_0"] = samples["period_ms"]
            _log.info("offloadopt: offload_fraction auto: fraction 0 measured %.1f ms/step "
                      "(predicted %.1f)", samples["period_ms"],
                      self.choice["predicted_step_ms_at_0"])  # fmt: skip
            return self._want(self._target, "verify")
        return self._verified(placer, samples)

    def _want(self, fraction: float, then: str) -> float:
        """Ask the step to move the state to ``fraction``; :meth:`moved` follows, and then
        phase ``then`` (``"baseline"``: fraction 0 measured, ``"verify"``)."""
        self.moving, self._then = True, then
        return fraction

    def moved(self, placer: Any, error: BaseException | None) -> float | None:
        """The step moved the state as :meth:`end` asked (``error``: the move failed, and the
        old placement stays: out of memory, or a RuntimeError). Also called when Ctrl-C
        reaches its handler at the end of the move (interrupts.signals_deferred): the choice
        records where the state is, and the next steps measure it. Returns a further
        fraction to move to (fraction 0 could not be placed: straight to the target), or
        None."""
        self.moving = False
        if self._then == "baseline":
            if error is not None:
                self.choice["baseline_skipped"] = f"{type(error).__name__}: {error}"[:300]
                _log.warning("offloadopt: offload_fraction auto: fraction 0 not measured: %s",
                             error)  # fmt: skip
                return self._want(self._target, "verify")
            if placer.fraction == 0.0:
                placer.choice = {**(placer.choice or {}), **self.choice, "fraction": 0.0}
                self.phase, self._samples = "baseline", []
                self._prev_end, self._skip = None, SETTLE_STEPS  # the next window spans the move
            return None
        if error is not None:
            self.choice["kept"] = f"{type(error).__name__}: {error}"[:300]
            _log.warning("offloadopt: offload_fraction auto: kept %g: %s", placer.fraction,
                         error)  # fmt: skip
        self.choice["fraction"] = placer.fraction
        self.choice["predicted_step_ms"] = costmodel.predict(
            self._model, placer.fraction, self._mode
        ).step_ms
        placer.choice = {**(placer.choice or {}), **self.choice}
        self.phase, self._samples = "verify", []
        self._prev_end, self._skip = None, SETTLE_STEPS  # the next window spans the move
        return None

    def closed(self, placer: Any) -> None:
        """The optimizer is closed (its run ended) after a step, before a choice (the probe,
        :data:`MEASURED_STEPS` + 1 steps) or while fraction 0 is timed (the baseline): the
        fraction in force is none auto chose. A warning and ``placement_choice`` say so
        (``"kept"``, ``"unmeasured": True``). A budget's probe keeps the budget's choice."""
        if self._clock is None or self.phase not in ("probe", "baseline") or self.budgeted:
            return
        what = (f"the probe's starting {placer.fraction:g}, unmeasured (a choice takes "
                f"{MEASURED_STEPS + 1} steps; the first is not timed)" if self.phase == "probe"
                else f"0, timed as the baseline, not the choice {self._target:g}")  # fmt: skip
        self._keep(placer, f"closed before its choice: the fraction in force is {what}")
        placer.choice["unmeasured"] = True
        warn(f"offload_fraction='auto' chose no fraction: the optimizer was closed and the "
             f"fraction in force is {what}; give offload_fraction a number for a run this "
             "short (opt.placement_choice says so too)")  # fmt: skip

    def _keep(self, placer: Any, why: str) -> None:
        """No choice can be made: the placement stays, and ``placement_choice`` says why."""
        self.phase = "done"
        self.choice = {"fraction": placer.fraction, "set_by": "auto", "kept": why}
        placer.choice = {**(placer.choice or {}), **self.choice}
        _log.info("offloadopt: offload_fraction auto: kept %g (%s)", placer.fraction, why)
        self._clock = self._prev_end = None

    def _timed(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Medians of the windows, in ms, and of the samples' micro-steps."""
        ms = self._clock.ms

        def median(a: str, b: str) -> float:
            values = [ms(s[a], s[b]) for s in samples if a in s and b in s]
            return statistics.median(values) if values else 0.0

        return {"fwd_bwd_ms": median("prev", "start"), "period_ms": median("prev", "end"),
                "device_update_ms": median("dev0", "dev1"),
                "micro_steps": round(statistics.median(s["micro_steps"] for s in samples))}  # fmt: skip

    def _link(self, placer: Any, synchronize: Callable[[], None]) -> dict[str, float]:
        """The last step's figures, with the link's GPU times and bytes of the copies since
        the first sample (``opt.stats`` sums times over every step not yet read)."""
        stats = dict(self._stats)
        if placer.pipeline is not None:
            synchronize()  # every copy of the measured steps has run
            for key, (ms, nbytes) in placer.pipeline.collect_link().items():
                stats[key], stats[key.replace("_ms", "_nbytes")] = ms, nbytes
        return stats

    def _choose(self, placer: Any, timed: dict[str, float], synchronize: Callable[[], None],
                mode: str) -> float | None:  # fmt: skip
        probe = placer.fraction
        numel = report.numel_by_side(placer.records)
        sizes = report.bytes_per_param(placer.param_groups, placer.rule, placer.master_weights)
        try:
            m = measurements(fwd_bwd_ms=timed["fwd_bwd_ms"], stats=self._link(placer, synchronize),
                             device_update_ms=timed["device_update_ms"],
                             device_numel=numel[False], offloaded_numel=numel[True],
                             bucket_nbytes=placer.bucket_nbytes, micro_steps=timed["micro_steps"],
                             **sizes)  # fmt: skip
        except ValueError as e:
            self._keep(placer, str(e))
            return None
        if numel[False] < SMALLEST_SIDE * (numel[False] + numel[True]) and not self.budgeted:
            self._keep(placer, f"offload_fraction='auto': {numel[False]:,} of "
                       f"{numel[False] + numel[True]:,} trainable elements are on the device "
                       "at the probe, too few to time its update")  # fmt: skip
            return None
        zero = costmodel.predict(m, 0.0, mode)
        if self.budgeted:
            chosen = costmodel.predict(m, probe, mode)
        else:
            chosen = costmodel.largest_hidden(m, self.tolerance * CHOICE_MARGIN, mode)
        sweep = {round(k / 20, 2): costmodel.predict(m, k / 20, mode).step_ms for k in range(21)}
        self.choice = {
            "fraction": chosen.fraction, "set_by": "auto", "mode": mode,
            "tolerance": self.tolerance, "probe_fraction": probe,
            "probe_measured_step_ms": timed["period_ms"],
            "probe_predicted_step_ms": costmodel.predict(m, probe, mode).step_ms,
            "measurements": dataclasses.asdict(m), "predicted_step_ms": chosen.step_ms,
            "predicted_step_ms_at_0": zero.step_ms, "predicted_sweep_ms": sweep,
            "measured_step_ms": None,
        }  # fmt: skip
        if self.budgeted:
            self.choice["why"] = "max_gpu_memory: the smallest fraction that fits is the fastest"
        else:
            aim = self.tolerance * CHOICE_MARGIN
            self.choice["why"] = (f"the largest fraction predicted within {aim:.1%} of "
                                  f"fraction 0's {zero.step_ms:.1f} ms (half the tolerance: "
                                  "the rest is room for the host's noise)")  # fmt: skip
        _log.info(
            "offloadopt: offload_fraction auto: probe %g measured %.1f ms/step (fwd+bwd %.1f ms "
            "over %d micro-steps, worker %.3f ns/param, device %.3f ns/param); chose %g, "
            "predicted %.1f ms/step (fraction 0: %.1f)", probe, timed["period_ms"], m.fwd_bwd_ms,
            m.micro_steps, m.cpu_ns_per_param, m.device_ns_per_param, chosen.fraction,
            chosen.step_ms, zero.step_ms,
        )  # fmt: skip
        self._model, self._mode = m, mode
        self.choice["corrections"] = []
        self.choice["measured_step_ms_at_0"] = None
        if self.budgeted or probe == 0.0 or chosen.fraction == 0.0:
            return self._want(chosen.fraction, "verify")
        return self._baseline(chosen.fraction)

    def _baseline(self, target: float) -> float:
        """Fraction 0 is measured first, then the state moves to ``target`` (where fraction 0
        cannot be placed, straight there, verified against the prediction: :meth:`moved`)."""
        self._target = target
        return self._want(0.0, "baseline")

    def _verified(self, placer: Any, timed: dict[str, float]) -> float | None:
        """The period at the placed fraction, measured. Without a budget, a period above the
        limit (``1 + tolerance`` times fraction 0's prediction) moves down: to the largest
        fraction whose prediction, raised by the error just measured, stays within it, but at
        least 0.05 down and no lower than the fractions the model predicts fully hidden
        (unless 0.05 down is lower); at most :data:`CORRECTIONS` times (the CPU's speed varies
        from run to run, and the model leaves out the contention between the worker and the
        training thread)."""
        fraction, measured = placer.fraction, timed["period_ms"]
        steady = self.phase == "steady"
        self.choice["steady_step_ms" if steady else "measured_step_ms"] = measured
        _log.info("offloadopt: offload_fraction auto: fraction %g measured %.1f ms/step%s "
                  "(predicted %.1f)", fraction, measured, " (steady)" if steady else "",
                  self.choice["predicted_step_ms"])  # fmt: skip
        zero = self.choice["measured_step_ms_at_0"] or self.choice["predicted_step_ms_at_0"]
        limit = (1 + self.tolerance) * zero
        corrections = self.choice["corrections"]
        if (not self.budgeted and measured > limit and fraction > 0
                and len(corrections) < CORRECTIONS and "kept" not in self.choice):  # fmt: skip
            error = measured - self.choice["predicted_step_ms"]
            step = {f: costmodel.predict(self._model, f, self._mode).step_ms
                    for f in costmodel._grid(0.01)}  # fmt: skip
            fits = max(f for f in step if f < fraction and step[f] + error <= limit or f == 0)
            # no lower than the model's fully hidden fractions (the error of a fraction whose
            # CPU work shows says nothing of those that hide), and at least 0.05 down
            hidden = max(f for f in step if step[f] <= self.choice["predicted_step_ms_at_0"])
            corrections.append({"fraction": fraction, "measured_step_ms": measured,
                                "predicted_step_ms": self.choice["predicted_step_ms"]})  # fmt: skip
            return self._want(max(0.0, min(max(fits, hidden), round(fraction - 0.05, 2))), "verify")
        within = self.budgeted or measured <= limit or fraction == 0  # the limit's own base
        if not steady and within:  # measured once more, STEADY_AFTER steps on
            self.phase, self._samples, self._skip = "steady", [], STEADY_AFTER
            self.choice["within_tolerance"] = True
            placer.choice = {**(placer.choice or {}), **self.choice}
            return None
        self.phase = "done"
        self.choice["within_tolerance"] = within
        if steady:
            self.choice["host_moved"] = not within
        if not within and steady:
            self.choice["why"] += (f"; the steady step measured {measured:.1f} ms after the "
                                   f"choice, above the limit {limit:.1f}")  # fmt: skip
            warn(
                f"offload_fraction='auto' kept fraction {fraction:g}, but the host moved: its "
                f"step measured {self.choice['measured_step_ms']:.1f} ms when chosen and "
                f"{measured:.1f} ms {STEADY_AFTER + MEASURED_STEPS} steps later, above the "
                f"limit {limit:.1f} ms ({1 + self.tolerance:g} x fraction 0's {zero:.1f} ms), "
                f"after {len(corrections)} corrections; give offload_fraction a number, or "
                "call opt.set_offload_fraction(), to choose yourself (opt.placement_choice "
                "has the figures)"
            )
        elif not within:
            self.choice["why"] += (f"; measured {measured:.1f} ms, above the limit {limit:.1f} "
                                   f"after {len(corrections)} corrections")  # fmt: skip
            # A fresh user's finding: auto ended above its own limit and said nothing.
            probe = self.choice["probe_measured_step_ms"], self.choice["probe_predicted_step_ms"]
            warn(
                f"offload_fraction='auto' kept fraction {fraction:g}: its step measured "
                f"{measured:.1f} ms, above the limit {limit:.1f} ms ({1 + self.tolerance:g} x "
                f"fraction 0's {zero:.1f} ms) after "
                f"{len(corrections)} corrections. The host's speed moved between the probe "
                f"(measured {probe[0]:.1f} ms, predicted {probe[1]:.1f}) and these steps; give "
                "offload_fraction a number, or call opt.set_offload_fraction(), to choose "
                "yourself (opt.placement_choice has the figures)"
            )
        placer.choice = {**(placer.choice or {}), **self.choice}
        self._clock = self._prev_end = None
        return None
