"""The fault suites' model, reference and tools (tests/long/faults.py loops the cases over
seeds; tests/test_faults.py and tests/test_resume_matrix.py run a fast slice).

The model (:class:`Probe`) is a list of params whose loss is ``sum(p * G)`` with ``G`` seeded
per step: backward gives every param the grad ``G`` exactly (grad hooks fire as in any
backward), and the grads do not depend on the weights, so every mode (step, backward, delayed)
trains to the same weights, bitwise ``torch.optim.AdamW(fused=True)`` for fp32 params on the
CPU (:class:`Reference`, the reference of every case). ``WAIT_MODULE`` adds ``wait="module"``
(step and declared backward mode), where ``step()`` returns before the copies back land.

Tools: :func:`check` (weights and state bitwise against the reference), :func:`train`,
:func:`alarm_handler` and :func:`interrupted` (a SIGALRM timer whose handler raises),
:func:`timed`, and :func:`recover` (the way out of a backward that failed part-way).
"""

from __future__ import annotations

import contextlib
import copy
import signal
import statistics
import time

import torch

from offloadopt import HybridAdamW

SHAPES = [(64, 32), (64,), (48, 64), (48,), (32, 48), (32,), (7, 5, 3)]
MODES = {
    "step": {},
    "backward": dict(overlap="backward", grads_final=True),
    "delayed": dict(overlap="delayed"),
}
# wait="module": step() returns before the copies back land; the long run draws these too
WAIT_MODULE = {
    "module": dict(overlap="backward", grads_final=True, wait="module"),
    "step-module": dict(wait="module"),
}
ALL_MODES = {**MODES, **WAIT_MODULE}
FRACTIONS = (0.0, 0.5, 1.0)
TIMEOUT_S = 30.0  # the optimizer's timeout_s in every case: nothing may hang past it


class Alarm(Exception):
    """Raised by the SIGALRM handler of the signal cases."""


class Probe(torch.nn.Module):
    """Params of ``SHAPES`` (seeded); ``forward(step)`` is ``sum(p * G)`` with ``G`` seeded by
    the step, so each param's grad is ``G`` (fp32, shaped like it), whatever the weights."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, shapes=SHAPES):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
        )

    def forward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        loss = torch.zeros((), dtype=torch.float32)
        for p in self.ps:
            loss = loss + (p * torch.randn(p.shape, generator=g).to(p.dtype)).sum().float()
        return loss


def groups(params: list) -> list[dict]:
    """Two groups with different hyperparameters."""
    return [
        {"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]


def hybrid(model: Probe, fraction: float, mode: str, **kw) -> HybridAdamW:
    """HybridAdamW over ``groups(model)``; a bucket of about 1,000 elements, so each case
    runs several buckets."""
    kw = {"min_offload_numel": 1, "bucket_nbytes": 4 * 1024, "timeout_s": TIMEOUT_S,
          **ALL_MODES[mode], **kw}  # fmt: skip
    return HybridAdamW(groups(list(model.parameters())), offload_fraction=fraction, **kw)


class Reference:
    """``torch.optim.AdamW(fused=True)`` on a copy of the model, fed the hybrid's grads; can
    take a snapshot and go back to it."""

    def __init__(self, model: Probe):
        self.params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        self.opt = torch.optim.AdamW(groups(self.params), fused=True)

    def step(self, grads: list) -> None:
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        self.opt.step()
        self.opt.zero_grad()

    def snapshot(self):
        return [p.detach().clone() for p in self.params], copy.deepcopy(self.opt.state_dict())

    @torch.no_grad()
    def restore(self, snap) -> None:
        weights, sd = snap
        for p, w in zip(self.params, weights, strict=True):
            p.copy_(w)
        self.opt.load_state_dict(copy.deepcopy(sd))

    @torch.no_grad()
    def take(self, model: Probe, opt) -> None:
        """Become the hybrid: its weights and state (after a step accepted as it is)."""
        for p, q in zip(self.params, model.parameters(), strict=True):
            p.copy_(q)
        self.opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def grads_of(model: Probe, step: int) -> list[torch.Tensor]:
    """The grads step ``step`` gives (what backward writes)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def same(model: Probe, ref: Reference) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.params, strict=True))


def same_state(opt, ref: Reference) -> bool:
    """The hybrid's state dict equals the reference's, bitwise (keys it has in common)."""
    mine, theirs = opt.state_dict()["state"], ref.opt.state_dict()["state"]
    if set(mine) != set(theirs):
        return False
    for k, entry in theirs.items():
        for key, t in entry.items():
            if not torch.equal(mine[k][key].reshape(t.shape), t):
                return False
    return True


def check(model: Probe, opt, ref: Reference, what: str) -> None:
    opt.synchronize()
    if not same(model, ref):
        diffs = [i for i, (p, q) in enumerate(zip(model.parameters(), ref.params, strict=True))
                 if not torch.equal(p, q)]  # fmt: skip
        raise AssertionError(f"{what}: weights of params {diffs} differ from the reference")
    if not same_state(opt, ref):
        raise AssertionError(f"{what}: optimizer state differs from the reference")


def train(model: Probe, opt, ref: Reference, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        model(s).backward()
        ref.step(grads_of(model, s))
        opt.step()
    check(model, opt, ref, f"after steps {steps.start}..{steps.stop - 1}")


@contextlib.contextmanager
def alarm_handler(handler=None):
    """SIGALRM's handler for the block (default: raise :class:`Alarm`); the timer and the
    previous handler are restored after it."""

    def raising(signum, frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, handler or raising)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def interrupted(call, delay_s: float) -> bool:
    """Run ``call()`` with SIGALRM due in ``delay_s``; whether :class:`Alarm` was raised (the
    timer is disarmed before this returns; an alarm in the disarming itself counts)."""
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(delay_s, 1e-6))
            call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Alarm:
        return True
    return False


def timed(call, n: int = 3) -> float:
    """Median seconds of ``call()`` over ``n`` runs."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def recover(model: Probe, opt, ref: Reference, before, how: str) -> str:
    """After a backward that failed part-way: ``step()`` either takes the grads backward left
    (equal to the reference fed the same), or refuses, naming the way out; then recover by
    ``how`` ("load": the checkpoint ``before``; "discard": accept the step as it is)."""
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as e:
        msg = str(e)
        # some params updated ("inconsistent"), or none yet ("nothing was changed": the
        # signal came before the first bucket was fed); either names the way out
        said = "inconsistent" in msg or "nothing was changed" in msg
        if not said or "discard_failed_step" not in msg:
            raise AssertionError(f"step() after a failed backward: unclear refusal: {msg}") from e
        try:  # refuses too, until recovered
            opt.state_dict()
        except RuntimeError:
            pass
        else:
            raise AssertionError("state_dict() after a refused step did not refuse")
        if how == "load":
            weights, sd = before
            with torch.no_grad():  # the model's checkpoint first, as a resume loads it
                for p, w in zip(model.parameters(), weights, strict=True):
                    p.copy_(w)
            opt.load_state_dict(copy.deepcopy(sd))
        else:
            opt.discard_failed_step()
            ref.take(model, opt)
        opt.zero_grad()
        return f"refused-{how}"
    opt.synchronize()
    ref.step(grads)
    return "stepped"
