"""state_dict post-processing and load_state_dict for HybridAdamW.

A checkpoint has ``torch.optim.AdamW(fused=True)``'s layout (group flags included) plus an fp32
``"master"`` per low-precision param: plain tensors and builtins, so
``torch.load(weights_only=True)`` reads it. Loading is our own, not the base class's: the base
would cast fp32 masters to the param's dtype, move offloaded moments to the GPU, replace groups
wholesale and alias the caller's tensors. Here the whole dict is validated first (a bad one
raises ``ValueError`` and changes nothing), then copied into the optimizer's existing buffers.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from offloadopt.validation import validate_hparams

if TYPE_CHECKING:
    from offloadopt.optim import HybridAdamW

__all__ = ["detach_host_views", "load"]

_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq", "master"}
# Flags that describe how HybridAdamW runs, not what the user chose: always restored to these.
_OWN_FLAGS = dict(
    amsgrad=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=True,
    decoupled_weight_decay=True,
)


def _params(opt: HybridAdamW) -> list[tuple[torch.Tensor, str]]:
    out = []
    for gi, g in enumerate(opt.param_groups):
        out += [(p, opt._param_name(g, gi, i)) for i, p in enumerate(g["params"])]
    return out


def detach_host_views(opt: HybridAdamW, sd: dict[str, Any]) -> dict[str, Any]:
    """Replace views of host buckets in a packed state dict by standalone copies."""
    state = {}
    for index, (p, _) in enumerate(_params(opt)):
        entry = sd["state"].get(index)
        if entry is None:
            continue
        if p in opt._home:
            state[index] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()
            }
        else:
            state[index] = dict(entry)
    return {"state": state, "param_groups": sd["param_groups"]}


def _validate(opt: HybridAdamW, sd: Any) -> tuple[list[dict], dict[int, dict]]:
    """Check everything; return the saved groups and the state by param position."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' keys")
    groups, saved_groups = opt.param_groups, sd["param_groups"]
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        n = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else saved_groups
        raise ValueError(f"loaded state dict has {n} parameter groups, the optimizer {len(groups)}")
    ids: dict[Any, int] = {}
    for gi, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
        if not isinstance(s, dict) or not isinstance(s.get("params"), (list, tuple)):
            raise ValueError(f"saved param group {gi} is not a dict with a 'params' list")
        if len(s["params"]) != len(g["params"]):
            raise ValueError(
                f"saved param group {gi} has {len(s['params'])} params, the optimizer's has {len(g['params'])}"
            )
        for k in s["params"]:
            if k in ids:
                raise ValueError(f"param id {k!r} appears twice in the saved param groups")
            ids[k] = len(ids)
        merged = {**g, **s}
        validate_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        if merged.get("amsgrad"):
            raise ValueError(
                f"saved param group {gi} has amsgrad=True, which HybridAdamW does not support"
            )
        if not isinstance(merged.get("maximize", False), bool):
            raise ValueError(f"saved param group {gi} has maximize={merged['maximize']!r}")
    params = _params(opt)
    state: dict[int, dict] = {}
    if not isinstance(sd["state"], dict):
        raise ValueError("state_dict['state'] must be a dict")
    for key, entry in sd["state"].items():
        if key not in ids:
            raise ValueError(f"state for param id {key!r}, which is in no saved param group")
        p, name = params[ids[key]]
        if not isinstance(entry, dict):
            raise ValueError(f"state of {name} is a {type(entry).__name__}, not a dict")
        if not entry:
            continue  # an empty entry (a defaultdict lookup) means no state, as in torch
        unknown = set(entry) - _STATE_KEYS
        if unknown:
            raise ValueError(
                f"state of {name} has keys {sorted(unknown)} that HybridAdamW does not use"
            )
        for k in ("step", "exp_avg", "exp_avg_sq"):
            if k not in entry:
                raise ValueError(f"state of {name} lacks {k!r}")
        step = entry["step"]
        if isinstance(step, torch.Tensor):
            if step.numel() != 1:
                raise ValueError(
                    f"state of {name}: 'step' has shape {tuple(step.shape)}, expected a scalar"
                )
            if step.is_meta:
                raise ValueError(f"state of {name}: 'step' is on the meta device (no value)")
            step = float(step.detach().cpu())
        if (
            isinstance(step, bool)
            or not isinstance(step, (int, float))
            or not math.isfinite(step)
            or step < 0
        ):
            raise ValueError(f"state of {name}: invalid 'step' {entry['step']!r}")
        for k in ("exp_avg", "exp_avg_sq", "master"):
            t = entry.get(k)
            if t is None and k == "master":
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_complex():
                what = f"a {t.dtype} Tensor" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"state of {name}: {k!r} must be a floating-point Tensor, got {what}"
                )
            if t.is_meta or t.layout != torch.strided:
                raise ValueError(
                    f"state of {name}: {k!r} has no values here ({t.device}, {t.layout})"
                )
            if t.shape != p.shape:
                raise ValueError(
                    f"state of {name}: {k!r} has shape {tuple(t.shape)}, the param {tuple(p.shape)}"
                )
        state[ids[key]] = {**entry, "step": step}  # step as a float: any 1-element shape loads
    return list(saved_groups), state


def load(opt: HybridAdamW, state_dict: dict[str, Any]) -> None:
    """Validate ``state_dict`` whole, then copy it into ``opt``'s existing buffers.

    Group hyperparameters (and any extra keys such as a scheduler's ``initial_lr``) come from
    the dict; ``params``, ``param_names`` and ``offload`` stay the optimizer's own, and the
    flags of :data:`_OWN_FLAGS` are restored. State is copied, never aliased: masters keep
    fp32, offloaded moments stay on the host in their buckets. A low-precision param with no
    master in the dict (a checkpoint of ``torch.optim.AdamW`` on a bf16 model) gets its
    master from its current weights, with a warning: such a resume cannot be exact. An fp32
    offloaded param's host copy is refreshed from the param. Params with no saved state lose
    theirs (it is made again at their next grad), as in torch.

    Raises:
        ValueError: the dict does not fit; the optimizer is unchanged.
    """
    sd = dict(state_dict) if isinstance(state_dict, dict) else state_dict
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    saved_groups, saved_state = _validate(opt, sd)
    for g, s in zip(opt.param_groups, saved_groups, strict=True):
        for k, v in s.items():
            if k not in ("params", "param_names", "offload"):
                g[k] = copy.deepcopy(v)
        g["betas"] = tuple(g["betas"])
        g.update(_OWN_FLAGS)
    for index, (p, name) in enumerate(_params(opt)):
        entry = saved_state.get(index)
        if entry is None:
            opt.state.pop(p, None)
            continue
        if p not in opt.state or not opt.state[p]:
            opt._init_state(p)
        mine = opt.state[p]
        step = entry["step"]
        mine["step"].fill_(step)
        mine["exp_avg"].copy_(entry["exp_avg"])
        mine["exp_avg_sq"].copy_(entry["exp_avg_sq"])
        mirror = opt._mirror(p)
        if "master" in mine:
            if entry.get("master") is not None:
                mine["master"].copy_(entry["master"])
                opt._written[p] = (-1, -1)  # compare with the weights at the next step
            else:
                mine["master"].copy_(p.detach())
                opt._mark_written(p)
                opt._warn_once(
                    "no-master",
                    f"the state dict has no fp32 master for {name} ({p.dtype}): masters were made "
                    "from the current weights, so this resume is not bitwise exact",
                )
        elif mirror is not None:
            mirror.copy_(p.detach())  # fp32 offloaded: the param is the truth
            opt._mark_written(p)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
    params = _params(opt)
    if any(e.get("master") is not None and "master" not in opt.state.get(params[i][0], {})
           for i, e in saved_state.items()):  # fmt: skip
        warnings.warn(
            "the state dict carries fp32 masters for params that keep none here (fp32 params, or "
            "master_weights=False): they were ignored, and the moments take the params' dtype",
            stacklevel=3,
        )
