"""Argument checks for HybridAdamW: each raises before anything is built and names the value.

They follow ``torch/optim/adamw.py``'s messages (``ValueError(f"Invalid learning rate: {lr}")``)
so that errors read the same as torch's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["validate_hparams", "validate_options", "validate_group"]


def validate_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad value, as ``torch.optim.AdamW`` does."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        lr_value = float(lr.detach().cpu())
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        lr_value = float(lr)
    else:
        raise TypeError(f"Invalid learning rate: {lr!r} (expected a float or a 1-element Tensor)")
    if not lr_value >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise TypeError(f"Invalid weight_decay value: {weight_decay!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair)")
    for i, b in enumerate(betas):
        b = float(b) if isinstance(b, torch.Tensor) and b.numel() == 1 else b
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]!r}")


def _check(ok: bool, message: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(message)


def validate_options(
    *,
    lr,
    betas,
    eps,
    weight_decay,
    amsgrad,
    maximize,
    capturable,
    differentiable,
    offload_fraction,
    min_offload_numel,
    master_weights,
    pin_memory,
    bucket_nbytes,
) -> None:
    """The constructor's arguments, AdamW's and ours.

    Raises:
        ValueError, TypeError: a bad value, named in the message.
        NotImplementedError: ``amsgrad``, ``capturable`` or ``differentiable`` set.
    """  # fmt: skip
    validate_hparams(lr, betas, eps, weight_decay)

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    _check(number(offload_fraction) and 0.0 <= offload_fraction <= 1.0,
           f"Invalid offload_fraction: {offload_fraction!r} (expected a number in [0, 1])")  # fmt: skip
    _check(count(min_offload_numel) and min_offload_numel >= 0,
           f"Invalid min_offload_numel: {min_offload_numel!r} (expected an int >= 0)")  # fmt: skip
    _check(count(bucket_nbytes) and bucket_nbytes > 0,
           f"Invalid bucket_nbytes: {bucket_nbytes!r} (expected an int > 0)")  # fmt: skip
    for flag, value in [
        ("master_weights", master_weights),
        ("pin_memory", pin_memory),
        ("maximize", maximize),
    ]:
        _check(isinstance(value, bool), f"Invalid {flag}: {value!r} (expected a bool)", TypeError)
    _check(not amsgrad, "HybridAdamW does not support amsgrad=True yet", NotImplementedError)
    _check(
        not capturable,
        "HybridAdamW does not support capturable=True (CUDA graphs)",
        NotImplementedError,
    )
    _check(
        not differentiable, "HybridAdamW does not support differentiable=True", NotImplementedError
    )


def validate_group(param_group: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """A param group about to be added: its params (tensors or ``(name, tensor)`` pairs, listed
    once) and its hyperparameters. Returns a shallow copy with ``params`` as a list.

    Raises:
        TypeError: not a dict, or a param that is not a Tensor.
        ValueError: a duplicate, complex, non-float, sparse or non-cpu/cuda param (named), or a
            bad hyperparameter or ``"offload"`` key.
        NotImplementedError: ``amsgrad`` set in the group.
    """
    _check(
        isinstance(param_group, dict),
        f"param_group must be a dict, but got {torch.typename(param_group)}",
        TypeError,
    )
    group = dict(param_group)
    raw = group["params"]
    raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
    group["params"] = raw
    seen: set[int] = set()
    for i, item in enumerate(raw):
        name, p = item if isinstance(item, tuple) else (None, item)
        label = name or f"param {i} of the new group"
        _check(
            isinstance(p, torch.Tensor),
            f"optimizer can only optimize Tensors, but {label} is {torch.typename(p)}",
            TypeError,
        )
        _check(
            id(p) not in seen,
            f"duplicate parameter in one group: {label} (shape {tuple(p.shape)}) appears twice",
        )
        seen.add(id(p))
        _check(not p.is_complex(), f"complex parameters are not supported: {label} is {p.dtype}")
        _check(
            p.is_floating_point(),
            f"{label} has dtype {p.dtype}: only floating-point params can be optimized",
        )
        _check(
            p.layout == torch.strided,
            f"sparse parameters are not supported: {label} has layout {p.layout}",
        )
        _check(
            p.device.type in ("cpu", "cuda"),
            f"{label} is on {p.device}: HybridAdamW supports cpu and cuda params",
        )
    if any(k in group for k in ("lr", "betas", "eps", "weight_decay")):
        validate_hparams(
            *(group.get(k, defaults[k]) for k in ("lr", "betas", "eps", "weight_decay"))
        )
    offload = group.get("offload")
    _check(
        offload is None or isinstance(offload, bool),
        f"Invalid 'offload' group key: {offload!r} (expected True, False or None)",
    )
    _check(
        not group.get("amsgrad"),
        "HybridAdamW does not support amsgrad=True yet",
        NotImplementedError,
    )
    return group
