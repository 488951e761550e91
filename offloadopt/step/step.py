"""One step as an object with an explicit phase (:class:`Step`), and the :class:`Timeline` the
step's owners share: the step being fed, the step being published, and whether the optimizer
refuses to step. In a module of its own so that every piece of the step imports it from below.

A step's phases, in order (a step made inside ``step()`` starts at ``STEPPING``)::

    ANNOUNCING      a backward's grad hooks (or DDP's reductions) announce grads; updates may
                    start (start.py's note says when)
    BACKWARD_DONE   autograd's final callback ran: every grad of this backward is final
    STEPPING        inside ``step()``: guards, scaling, feeding, the device update
    STEPPED         ``step()`` returned with copies back (or a delayed update) in flight
    PUBLISHED       every copy back is waited for: the new weights are visible
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadopt.link.layout import Bucket
from offloadopt.link.pipeline import BucketWork, StepRun
from offloadopt.place.placer import Placer
from offloadopt.rules import Hyper, Rule
from offloadopt.step.amp import AmpInputs

__all__ = ["Phase", "Step", "Timeline"]


class Phase(enum.Enum):
    """Where a :class:`Step` is (the module docstring has the order)."""

    ANNOUNCING = "announcing"
    BACKWARD_DONE = "backward done"
    STEPPING = "stepping"
    STEPPED = "stepped"
    PUBLISHED = "published"


@dataclass(eq=False)
class Step:
    """One step from its first bucket to the end of ``step()`` (or, with ``wait="module"``,
    until its copies back are all waited for)."""

    hypers: dict[int, Hyper]  # id(group) -> its values, frozen at the step's start
    group_of: dict[torch.Tensor, dict]  # param -> the group that holds it this step
    stats: dict[str, float]
    run: StepRun | None = None
    prepared: set[torch.Tensor] = field(default_factory=set)  # state ready, step advanced
    announced: set[torch.Tensor] = field(default_factory=set)  # grad hooks that fired
    fed: dict[Bucket, BucketWork] = field(default_factory=dict)
    versions: dict[torch.Tensor, tuple] = field(default_factory=dict)  # (grad, _version) fed
    released: set[torch.Tensor] = field(default_factory=set)  # grads release_grads dropped
    # The fp32 L2 norm of each grad fed before step(), on its device: a grad whose version moved
    # with an unchanged norm (torch's clip_grad_norm_ at an infinite max_norm, which
    # transformers' Trainer calls to log the norm, multiplies by 1.0) is not an edit; any
    # scaling, clipping or zeroing changes the norm.
    fingerprints: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    landing: dict[torch.Tensor, int] = field(default_factory=dict)  # buckets left to feed
    phase: Phase = Phase.ANNOUNCING
    task_id: int = -1  # autograd graph task that announced grads
    norm: torch.Tensor | None = None
    scale: torch.Tensor | tuple[torch.Tensor, ...] | None = None  # clip factors (BucketWork)
    amp: AmpInputs | None = None  # a GradScaler's scale and found_inf (offloadopt/step/amp.py)
    # speculate=True: (clip factors, GradScaler inputs) of this step's speculative feeds
    speculative: tuple | None = None
    speculates: bool | None = None  # speculate=True: whether this step does (Speculation.wants)
    created: set[torch.Tensor] = field(default_factory=set)  # state made by this step
    backed_up: set = field(default_factory=set)  # speculate: buckets whose update began
    waited: set[Bucket] = field(default_factory=set)  # wait="module": buckets waited for
    first: set[torch.Tensor] = field(default_factory=set)  # lazy-state params' first update
    thread: int = 0  # the thread that called step() (overlap="delayed" publishes there only)
    delayed: bool = False  # overlap="delayed", past delay_after: the update lands one step late
    # wait="module": (weakref to the grad, its version, param) of each grad the copies still
    # read when step() returned; checked when the step ends (publish.Publisher.synchronize)
    lent: list[tuple[Any, int, torch.Tensor]] = field(default_factory=list)

    @property
    def backward_done(self) -> bool:
        """The backward that announced this step's grads has ended (or none did)."""
        return self.phase is not Phase.ANNOUNCING


class Timeline:
    """The optimizer's steps in time, shared by the owners of a step's pieces under one lock
    (the training thread and autograd's take it): the step being fed (from its first grad
    hook, or made in ``step()``), the step whose copies back are in flight after ``step()``
    returned, and why the optimizer refuses to step (a failed step), if it does."""

    def __init__(self, name: str):
        self.name = name  # the optimizer's class name, for messages
        self.lock = threading.RLock()
        self.current: Step | None = None  # the step being fed
        self.inflight: Step | None = None  # step() returned, copies back not all waited for
        self.inflight_streams: dict = {}  # the streams that read the in-flight step's weights
        self.broken: str | None = None  # why the optimizer refuses to step
        self.partial = True  # with broken: some params may hold the failed step's update
        self.closed = False  # opt.close() was called: nothing steps again

    def refuse(self, why: str, partial: bool = True) -> None:
        """From now on ``step()`` and ``state_dict()`` are refused, naming ``why``;
        ``partial``: some params may hold the step's update (False: none was started)."""
        self.broken = why
        self.partial = partial

    def raise_if_broken(self) -> None:
        """Raises:
        RuntimeError: the optimizer refuses to step (a failed step), naming why."""
        if self.broken is not None:
            if not self.partial:
                raise RuntimeError(
                    f"{self.name}: {self.broken}, before any update of its step had started "
                    "(nothing was changed); call opt.discard_failed_step() to go on from here"
                )
            undo = ""
            if self.current is not None and self.current.speculative is not None:
                undo = (
                    " (speculate=True: it rolls this step's updates back, nothing is left changed)"
                )
            raise RuntimeError(
                f"{self.name} is inconsistent: {self.broken}, so some params were "
                "updated and others not; call opt.load_state_dict(...) to restore a checkpoint, "
                f"or opt.discard_failed_step() to go on from here{undo}"
            )

    def abandon(self, st: Step, why: str) -> None:
        """A step whose updates started cannot complete: its run is aborted and the optimizer
        refuses to step until a load or ``discard_failed_step()``.

        Raises:
            RuntimeError: always, naming ``why``.
        """
        if st.run is not None:
            st.run.abort()
        self.refuse(why, partial=bool(st.fed))
        self.raise_if_broken()

    def discard(self, timeout_s: float) -> None:
        """Forget the step being fed and any refusal (``discard_failed_step()``, a load): its
        run is stopped first, so the worker's bucket in hand lands before anything follows."""
        if self.current is not None and self.current.run is not None:
            stop_run(self.current.run, timeout_s)
        self.current, self.broken = None, None

    def updates_started(self) -> bool:
        """Updates began before ``step()`` (backward mode, declared): from then until
        ``step()`` returns the worker writes the params of the buckets fed so far."""
        st = self.current
        return st is not None and st.run is not None and bool(st.fed) and not st.delayed


def stop_run(run: StepRun, timeout_s: float) -> None:
    """Drop the buckets ``run`` has not started and wait until the worker is done with the one
    in hand (an abort alone lets it write that bucket's state and weights after a
    load_state_dict that follows; bounded by ``timeout_s`` seconds)."""
    run.abort()
    run.job.done.wait(timeout_s)


_STATS = (
    "d2h_wait_ms",
    "cpu_update_ms",
    "cpu_kernel_ms",
    "launch_ms",
    "feed_wait_ms",
    "h2d_ms",
    "d2h_ms",
)


def begin_step(
    param_groups: list[dict[str, Any]], rule: Rule, placer: Placer, may_place_again: bool = False
) -> Step | None:
    """A new :class:`Step`: every group's hyperparameters frozen and validated, each param's
    group found by identity (a param put into a group by hand gets its record here).

    ``may_place_again`` (from ``step()``, never from a backward's hooks): when a group's values
    now need other state keys than its params were placed with (SGD's ``momentum_buffer``:
    ``OneCycleLR(cycle_momentum=True)`` on a group built with ``momentum=0``), or a param has
    another dtype than it was placed with (``model.double()`` after the optimizer was built),
    return None: "place again" (the caller does it, for new keys while no param has state,
    for a new dtype while no cast param has state of its own, as torch's optimizers then
    make a param's state at its first step, in its dtype, and begins again). Otherwise the
    change is an error naming the param. One dtype compared per param and step.

    Raises:
        TypeError, ValueError: a group's value is invalid (named with the group's index), its
            state keys or a param's dtype changed (above), or its ``"offload"`` key changed
            since it was placed.
        NotImplementedError: a flag the rule refuses (``amsgrad``) set on a group since.
        RuntimeError: a param in two groups (named).
    """
    check_offload_keys(param_groups, placer.group_offload)
    hypers: dict[int, Hyper] = {}
    group_of: dict[torch.Tensor, dict] = {}
    index_of: dict[torch.Tensor, int] = {}
    for gi, group in enumerate(param_groups):
        try:
            hypers[id(group)] = rule.freeze(group)
        except (TypeError, ValueError, NotImplementedError) as e:
            raise type(e)(f"param group {gi}: {e}") from e
        keys = rule.state_keys_for(group)
        for i, p in enumerate(group["params"]):
            rec = placer.records.get(p)
            if rec is not None and rec.placement.dtype != p.dtype:
                if may_place_again:
                    return None  # place again
                raise ValueError(recast_error(gi, i, rec.name, rec.placement.dtype, p.dtype))
            if rec is not None and rec.state_keys != keys:
                if may_place_again:
                    return None  # place again
                raise ValueError(
                    f"param group {gi}: {rec.name} keeps state {list(rec.state_keys)} since "
                    f"it was placed, the group's values now need {list(keys)} (momentum "
                    "turned on or off after the first step with state; while no param "
                    "has state, step() places the params again, but not a backward that "
                    "starts updates)"
                )
            if p in group_of:
                raise RuntimeError(
                    f"{placer.param_name(group, gi, i)} is in param groups {index_of[p]} and "
                    f"{gi}: a param may be in one group only"
                )
            group_of[p], index_of[p] = group, gi
            placer.record(p, group, gi, i)
    stats = dict.fromkeys(_STATS, 0.0)
    stats.update(d2h_nbytes=0, h2d_nbytes=0, buckets=0, worker_ms=0.0)
    return Step(hypers, group_of, stats)


def recast_error(gi: int, i: int, name: str, placed: torch.dtype, now: torch.dtype) -> str:
    """The refusal of a param cast since its placement: its state is (or would be, in a
    backward's hooks) made for ``placed``, silently in that precision when offloaded, or
    failing in torch's kernel without a name on the device."""
    return (
        f"param group {gi}, param {i} ({name}): placed as {placed} and now {now} (the model "
        "was cast after the optimizer was built); step() and load_state_dict() place a cast "
        "param again in its new dtype while it has no state of its own yet, but not once a "
        "step() or load_state_dict() has made its state (it is in the old dtype), nor in a "
        f"backward that starts updates. Cast the model back to {placed}, or build the "
        "optimizer after casting the model"
    )


def check_offload_keys(param_groups: list[dict[str, Any]], placed: dict[int, Any]) -> None:
    """Refuse a group whose ``"offload"`` key differs from the one its params were placed with
    (``placed``: :attr:`Placer.group_offload`), before anything changes: placement is fixed
    when a group is placed, and the new value would be silently ignored (a user's finding).

    Raises:
        ValueError: names the group, the value it was placed with and the new one.
    """
    for gi, group in enumerate(param_groups):
        if gi in placed and group.get("offload") is not placed[gi]:
            raise ValueError(
                f"param group {gi}: 'offload' changed from {placed[gi]!r} to "
                f"{group.get('offload')!r} after the group was placed; placement is fixed at "
                "construction (or add_param_group), so the new value would be ignored. Set it "
                f"back to {placed[gi]!r}, or build a new optimizer with the groups' 'offload' "
                "keys (opt.set_offload_fraction() moves the state of the groups without one)"
            )


def steps_taken(state: Any, records: dict, delay_after: int) -> int:
    """The updates the offloaded params have had: the largest ``step`` among them (host
    tensors: no device sync), so a resume from a checkpoint counts on where it left off.
    Read at each step's start when ``delay_after`` > 0 (0 otherwise: nothing to compare)."""
    if delay_after == 0:
        return 0
    steps = (state.get(p, {}).get("step") for p, rec in records.items() if rec.offloaded)
    return max((int(s) for s in steps if s is not None), default=0)
