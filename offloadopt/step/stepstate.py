"""``StepState``: one step's bookkeeping, from its first bucket to the end of ``step()``, in a
module of its own so that the step's pieces (steps.py, backward.py, waits.py, scaling.py) all
import it from below and none imports steps.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from offloadopt.link.layout import Bucket
from offloadopt.link.pipeline import BucketWork, StepRun
from offloadopt.rules import Hyper
from offloadopt.step.amp import AmpInputs

__all__ = ["StepState"]


@dataclass(eq=False)
class StepState:
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
    backward_done: bool = False
    task_id: int = -1  # autograd graph task that announced grads
    norm: torch.Tensor | None = None
    scale: torch.Tensor | tuple[torch.Tensor, ...] | None = None  # clip factors (BucketWork)
    amp: AmpInputs | None = None  # a GradScaler's scale and found_inf (offloadopt/step/amp.py)
    waited: set[Bucket] = field(default_factory=set)  # wait="module": buckets waited for
    first: set[torch.Tensor] = field(default_factory=set)  # lazy-state params' first update
    thread: int = 0  # the thread that called step() (overlap="delayed" publishes there only)
    delayed: bool = False  # overlap="delayed", past delay_after: the update lands one step late
    # wait="module": (weakref to the grad, its version, param) of each grad the copies still
    # read when step() returned; checked when the step ends (Waits.synchronize)
    lent: list[tuple[Any, int, torch.Tensor]] = field(default_factory=list)
