"""A GradScaler's scale and found_inf in the update, on the device and on the worker.

[Note: how a GradScaler reaches the update]
- ``torch.amp.GradScaler.step(opt)`` on an optimizer with ``_step_supports_amp_scaling = True``
  (torch's fused AdamW, and ours) sets ``opt.grad_scale`` (the scale; None after
  ``scaler.unscale_(opt)``) and ``opt.found_inf`` (1.0 when its check of the grads found an inf
  or a NaN) and calls ``opt.step()``. torch's fused kernel divides each grad by the scale and
  leaves everything unchanged when found_inf is 1.0; ``torch.optim.AdamW(fused=True)`` takes
  back the ``step`` increment then. No ``.item()``: nothing waits for the check on the host.
- Ours, in every mode: the device-resident params get the scaler's device tensors, as torch's
  kernel does. The worker gets pinned host copies (:class:`AmpInputs`), made non-blocking on
  the compute stream once the values exist, behind an event it waits for before each bucket's
  kernel; the offloaded params' ``step`` increment is taken back from the host copy when the
  step ends. The scaler may change its scale in place right after ``step()`` returns
  (``update()``): the copies were queued before that on the same stream.
- ``overlap="backward"`` with ``grad_scaler=`` (attached): nothing calls ``step()`` before the
  end of backward, so the optimizer checks every grad itself there (:func:`found_inf`, the
  same test as GradScaler's, without writing the grads), takes the scale from the scaler and
  starts every update. The grads stay on the device until ``step()`` (``release_grads`` drops
  them there), so ``scaler.step``'s own check sees every one of them and its ``update()``
  backs off as with torch's optimizer; ``step()`` keeps its own found_inf for the
  device-resident params, the same value the worker read.
- Clipping with a scaler (``max_grad_norm=``): torch's order is ``scaler.unscale_(opt)``, then
  ``clip_grad_norm_``, then ``scaler.step`` (no scale left for the kernel). Ours multiplies the
  fp32 grads on the device by the inverse scale (torch's ``1 / scale`` in float64, rounded to
  fp32), then by the clip coefficient, and gives the kernel no scale: the same arithmetic for
  fp32 grads. The norm is the scaled grads' norm times the inverse scale, which equals the
  unscaled grads' norm bitwise when the scale is a power of two (GradScaler's default growth
  and backoff keep it one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offloadopt.link.transfer import wait_event

__all__ = ["AmpInputs", "found_inf", "inverse", "scaler_inputs"]


@dataclass(eq=False)
class AmpInputs:
    """One step's GradScaler inputs to the update.

    ``grad_scale``: what the kernel divides each grad by (a 0-dim fp32 tensor on the params'
    device), or None; ``found_inf``: 0-dim fp32, 1.0 to skip the update, or None. ``host_*``
    are their copies for the worker (pinned with CUDA), made by :meth:`to_host`; ``ready`` the
    event after which those copies hold the values (None without CUDA).
    """

    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None
    host_scale: torch.Tensor | None = None
    host_inf: torch.Tensor | None = None
    ready: Any = None

    def to_host(self, pin: bool) -> None:
        """Queue the host copies on the current stream of the tensors' device (idempotent)."""
        if self.host_scale is not None or self.host_inf is not None:
            return  # copied for an earlier bucket of this step
        like = self.grad_scale if self.grad_scale is not None else self.found_inf
        cuda = like is not None and like.device.type == "cuda"
        for name in ("grad_scale", "found_inf"):
            value = getattr(self, name)
            if value is None:
                continue
            if cuda:
                host = torch.empty((), dtype=torch.float32, pin_memory=pin)
                host.copy_(value, non_blocking=pin)
            else:
                host = value.detach().to(torch.float32, copy=True)  # update() changes it later
            setattr(self, "host_scale" if name == "grad_scale" else "host_inf", host)
        if cuda:
            self.ready = torch.cuda.current_stream(like.device).record_event()

    def wait(self, timeout_s: float) -> None:
        """Block until the host copies hold their values (any thread).

        Raises:
            TimeoutError: not in ``timeout_s`` seconds.
        """
        wait_event(self.ready, "the GradScaler's scale and found_inf", timeout_s)

    def kernel_args(self, host: bool) -> dict[str, torch.Tensor | None]:
        """The fused kernel's ``grad_scale`` and ``found_inf`` arguments."""
        if host:
            return dict(grad_scale=self.host_scale, found_inf=self.host_inf)
        return dict(grad_scale=self.grad_scale, found_inf=self.found_inf)


def scaler_inputs(opt: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_scale, found_inf)`` as ``GradScaler.step`` set them on ``opt`` for this
    ``step()`` call; None for each one it did not set (a plain ``opt.step()``), or set to a
    non-tensor (its ``found_inf`` is the int 0 when no grad was checked)."""
    values = []
    for name in ("grad_scale", "found_inf"):
        value = opt.__dict__.get(name)
        values.append(value if isinstance(value, torch.Tensor) else None)
    return values[0], values[1]


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as GradScaler's ``unscale_`` computes it (float64, then fp32)."""
    return scale.double().reciprocal().float()


def found_inf(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 when any element of ``grads`` is an inf or a NaN, else 0.0 (a 0-dim fp32 tensor on
    ``device``): GradScaler's test, through each grad's largest magnitude (a NaN makes it NaN),
    so the grads are only read. An empty list, or one of 0-element grads only, gives 0.0.

    0-element grads are left out: the inf-norm of an empty tensor has no identity, and torch's
    ``_foreach_norm`` raises on one (tests/test_amp.py, the empty-param case in every mode)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    peaks = [n.to(device) for n in torch._foreach_norm(grads, float("inf"))]
    return (~torch.stack(peaks).isfinite()).any().to(torch.float32)
