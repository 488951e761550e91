"""``--overlap delayed`` in the main job: evaluations and checkpoints that do not change the
losses (:class:`DelayedSchedule`, used by offloadopt/harness/train.py)."""

from __future__ import annotations

import torch

from offloadopt.harness import checks
from offloadopt.shards import local

__all__ = ["DelayedSchedule"]


class DelayedSchedule:
    """``--overlap delayed``: an evaluation or a checkpoint does not change the losses.

    Both need the newest weights in the params (``opt.synchronize()`` copies the update in
    flight in), which ends the delayed parameter update's staleness once: the next forward would
    read weights one step newer than in a run that neither evaluates nor saves there. So after
    them the params that changed get back the weights the delayed schedule reads
    (:meth:`keep_delay`), and the newest go in again just before the next ``opt.step()``
    (:meth:`publish`), where the optimizer would have copied them in. The copies go through
    ``param.data``: the optimizer sees no outside write (no master refresh). A checkpoint keeps
    those weights (``"delayed_weights"``) and a resumed run puts them back (:meth:`resume`), so
    it continues an uninterrupted run bit for bit, whatever ``--save-every`` and ``--eval-every``.

    Holds, between :meth:`newest` and :meth:`publish`, two host copies of the params whose
    update was in flight (on the CPU device: copies beside them).
    """

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.model, self.opt = model, opt
        self.delayed = getattr(opt, "overlap", None) == "delayed"
        # name -> (this rank's shard of the param, the weights the schedule reads, the newest)
        self.held: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def newest(self) -> dict[str, torch.Tensor]:
        """Put the newest weights in the params (every mode: ``opt.synchronize()`` where the
        optimizer has it). Returns {param name: the weights the delayed schedule's next forward
        reads} for the params where they differ (CPU tensors; empty unless delayed)."""
        if not self.delayed:
            if hasattr(self.opt, "synchronize"):
                self.opt.synchronize()
            return {}
        if self.held:  # already held at this step (an evaluation, then a checkpoint)
            self._copy(newest=True)
        else:
            shards = {name: local(p) for name, p in self.model.named_parameters()}
            before = {name: t.detach().to("cpu", copy=True) for name, t in shards.items()}
            self.opt.synchronize()  # the update in flight copied in
            for name, t in shards.items():
                now = t.detach().to("cpu", copy=True)
                if not torch.equal(now, before[name]):
                    self.held[name] = (t, before[name], now)
        return {name: stale for name, (_, stale, _) in self.held.items()}

    def keep_delay(self) -> None:
        """After an evaluation or a checkpoint: the params read the delayed schedule's weights
        until :meth:`publish`."""
        self._copy(newest=False)

    def publish(self) -> None:
        """Just before ``opt.step()``: the newest weights go in, as the optimizer's own copy-in
        of the update in flight would have put them (a no-op when nothing is held)."""
        if self.held:
            self._copy(newest=True)
            self.held = {}

    def resume(self, delayed_weights: dict[str, torch.Tensor], path: str) -> None:
        """A resumed run (model and optimizer loaded: the newest weights in the params): its
        next forward reads the checkpoint's ``delayed_weights``, as the saved run's did.

        Raises:
            UsageError: a name that is not a param of the model, or a shape that is not its
                (naming ``--resume``, the file and the param).
        """
        shards = {name: local(p) for name, p in self.model.named_parameters()}
        for name, stale in delayed_weights.items():
            t = shards.get(name)
            if t is None or not self.delayed or tuple(stale.shape) != tuple(t.shape):
                raise checks.UsageError(
                    f"--resume: {path!r}: its delayed weights of {name!r} "
                    f"({tuple(stale.shape)}) match no param of this model"
                )
            self.held[name] = (t, stale, t.detach().to("cpu", copy=True))
        self.keep_delay()

    @torch.no_grad()
    def _copy(self, newest: bool) -> None:
        for t, stale, now in self.held.values():
            t.data.copy_(now if newest else stale)  # .data: the param's version does not move
