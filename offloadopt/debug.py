"""``opt.debug``: the one door to an optimizer's insides, for tests, benchmarks and debugging.

Everything else a test needs is public (``opt.placement``, ``opt.stats``, ``opt.state``, ...).
What is here is not a stable API: each attribute is an owner (docs/how-it-works.md lists them)
or a piece of its state, named for what it is, so a test that patches or reads one says which
owner it reaches into. The commonest uses:

- ``opt.debug.pipeline.worker_hook = fn``: ``fn(bucket)`` runs on the CPU worker (on its update
  thread where it has one) before each bucket's update (a sleep makes the worker slow; a raise
  makes it fail).
- ``opt.debug.pipeline.transfers[device]``: that device's staging slots, side streams and
  per-bucket events (offloadopt/link/transfer.py).
- ``opt.debug.step`` / ``opt.debug.inflight``: the :class:`~offloadopt.step.step.Step` being
  fed (from backward) and the one whose copies back are still in flight after ``step()``.
- ``opt.debug.updater.update_bucket``: the worker's callable (wrap it to count or skip buckets).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Debug"]


class Debug:
    """A view of one optimizer's owners; made by ``opt.debug`` (no copies, no waits).

    Attributes:
        placer: the Placer (offloadopt/place/placer.py): placement, arenas, buckets.
        updater: the Updater (offloadopt/step/update.py): the rule on the worker and device.
        feeder: the Feeder (offloadopt/step/feed.py): buckets queued on the pipeline.
        publisher: the publish policy (offloadopt/step/publish.py): waits, module waits.
        start: the start policy (offloadopt/step/start.py): backward's announcements.
        guards: the Guards (offloadopt/step/guards.py): what a step refuses.
        scaling: the Scaling (offloadopt/step/scaling.py): clipping, a GradScaler's inputs.
        timeline: the Timeline (offloadopt/step/step.py): the lock, the steps in time.
        relocate: the Relocator (offloadopt/relocate.py): every move to another fraction.
        speculation: the Speculation (offloadopt/step/speculate.py), or None without
            ``speculate=True``: backups, validation, rollback (``kernel_backup = False``:
            the copy before the update, not the kernel's).
    """

    def __init__(self, opt: Any):
        self.placer = opt._placer
        self.updater = opt._updater
        self.feeder = opt._feeder
        self.publisher = opt._publish
        self.start = opt._start
        self.guards = opt._guards
        self.scaling = opt._scaling
        self.timeline = opt._timeline
        self.relocate = opt._relocate
        self.speculation = opt._speculation

    @property
    def pipeline(self) -> Any:
        """The pipeline (staging per device, the CPU worker), or None before the first
        offloaded bucket is placed."""
        return self.placer.pipeline

    @property
    def records(self) -> dict:
        """param -> its :class:`~offloadopt.place.records.ParamRecord` (name, placement,
        buckets, home in the host arena)."""
        return self.placer.records

    @property
    def auto(self) -> Any:
        """offload_fraction="auto"'s controller (offloadopt/place/auto.py), or None."""
        return self.placer.auto

    @property
    def step(self) -> Any:
        """The step being fed (begun by backward's announcements, or inside ``step()``)."""
        return self.timeline.current

    @property
    def inflight(self) -> Any:
        """The step ``step()`` returned from with copies back (or a delayed update) in flight."""
        return self.timeline.inflight

    @property
    def grad_hooks(self) -> list:
        """The post-accumulate-grad hooks of the offloaded params (the start policy's)."""
        return self.start.grad_hooks
