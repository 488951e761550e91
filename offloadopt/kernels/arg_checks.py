"""The argument checks of :mod:`offloadopt.kernels.reference`'s two entry points: list lengths,
dtypes, devices and shapes, each failure a ValueError naming the entry point and the list."""

from __future__ import annotations

import torch

from offloadopt.kernels.formats import nblocks

__all__ = ["check_flat_args", "check_lists"]


def check_lists(fn: str, masters: list, *, moments: int, **lists: list) -> int:
    """Every list as long as ``masters`` and ``moments`` one of 0, 1, 2; returns the length.
    Raises ValueError naming ``fn`` and the list."""
    n_t = len(masters)
    for name, lst in lists.items():
        if len(lst) != n_t:
            raise ValueError(f"{fn}: {name} has {len(lst)} entries; masters has {n_t}")
    if moments not in (0, 1, 2):
        raise ValueError(f"{fn}: moments={moments}; expected 0, 1 or 2")
    return n_t


def check_flat_args(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
                     weights_out, steps, salts, offsets, moments, master_sr) -> None:  # fmt: skip
    n_t = check_lists("adam_step_flat", masters, grads=grads, exp_avgs=exp_avgs,
                       exp_avg_sqs=exp_avg_sqs, steps=steps, salts=salts, offsets=offsets,
                       moments=moments)  # fmt: skip
    if moments == 2 and (len(exp_avg_scales) != n_t or len(exp_avg_sq_scales) != n_t):
        raise ValueError(
            f"adam_step_flat: exp_avg_scales / exp_avg_sq_scales have {len(exp_avg_scales)} / "
            f"{len(exp_avg_sq_scales)} entries; masters has {n_t}"
        )
    if weights_out and len(weights_out) != n_t:
        raise ValueError(
            f"adam_step_flat: weights_out has {len(weights_out)} entries; masters has {n_t}"
        )
    if not n_t:
        return
    dtype, device = masters[0].dtype, masters[0].device
    for i, p in enumerate(masters):
        if p.dtype != dtype or p.device != device:
            raise ValueError(
                f"adam_step_flat: masters[{i}] is {p.dtype} on {p.device}; masters[0] is "
                f"{dtype} on {device} (one call, one master dtype and device)"
            )
        if (p.dtype == torch.bfloat16) != bool(master_sr):
            raise ValueError(
                "adam_step_flat: master_sr=True goes with bf16 masters and only with them"
            )
        lists = [("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)]
        if weights_out:
            lists.append(("weights_out", weights_out))
        for name, lst in [("masters", masters), *lists]:
            t = lst[i]
            if t.dim() != 1 or t.numel() != p.numel() or t.device != device:
                raise ValueError(
                    f"adam_step_flat: {name}[{i}] is {tuple(t.shape)} on {t.device}; expected "
                    f"({p.numel()},) on {device}"
                )
        if moments == 2:
            for name, lst in (("exp_avg_scales", exp_avg_scales),
                              ("exp_avg_sq_scales", exp_avg_sq_scales)):  # fmt: skip
                if lst[i].dim() != 1 or lst[i].numel() != nblocks(p.numel()):
                    raise ValueError(
                        f"adam_step_flat: {name}[{i}] is {tuple(lst[i].shape)}; expected "
                        f"({nblocks(p.numel())},)"
                    )
