"""One step as an object with an explicit phase (:class:`Step`), and the :class:`Timeline` the
step's owners share: the step being fed, the step being published, and whether the optimizer
refuses to step. In a module of its own so that every piece of the step imports it from below.

A step's phases, in order (a step made inside ``step()`` starts at ``STEPPING``)::

    ANNOUNCING      a backward's grad hooks (or DDP's reductions) announce grads; updates may
                    start (steps.py's note says when)
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
from offloadopt.rules import Hyper
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

    def refuse(self, why: str) -> None:
        """From now on ``step()`` and ``state_dict()`` are refused, naming ``why``."""
        self.broken = why

    def raise_if_broken(self) -> None:
        """Raises:
        RuntimeError: the optimizer refuses to step (a failed step), naming why."""
        if self.broken is not None:
            raise RuntimeError(
                f"{self.name} is inconsistent: {self.broken}, so some params were "
                "updated and others not; call opt.load_state_dict(...) to restore a checkpoint, "
                "or opt.discard_failed_step() to go on from here"
            )

    def updates_started(self) -> bool:
        """Updates began before ``step()`` (backward mode, declared): from then until
        ``step()`` returns the worker writes the params of the buckets fed so far."""
        st = self.current
        return st is not None and st.run is not None and bool(st.fed) and not st.delayed
