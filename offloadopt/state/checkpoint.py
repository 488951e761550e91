"""Checkpoint code, pure: pack, validate and parse a state dict (the optimizer applies it).

A checkpoint has the layout of the rule's torch optimizer (``torch.optim.AdamW(fused=True)``'s,
group flags included) plus an fp32 ``"master"`` per low-precision param: plain tensors and
builtins, so ``torch.load(weights_only=True)`` reads it. Loading is the optimizer's own, not the
base class's: the base would cast fp32 masters to the param's dtype, move offloaded moments to
the GPU, replace groups wholesale and alias the caller's tensors. Here the whole dict is
validated first (a bad one raises ``ValueError`` and changes nothing), then the optimizer copies
it into its existing buffers. Nothing in this module touches an optimizer.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from offloadopt.rules import BLOCK, INT8_KEYS, MOMENT_KEYS, Rule
from offloadopt.shards import is_dtensor, wrap_like

__all__ = [
    "ParamSpec",
    "pack",
    "drop_placement",
    "wrap_shards",
    "validate",
    "merge_group",
    "export_moments",
    "stored_entry",
    "encoded",
]


# Group keys that belong to the optimizer that loads, never to the checkpoint.
_OWN_KEYS = ("params", "param_names", "offload")

ParamSpec = tuple[str, tuple[int, ...]]  # (name, shape) of one param of the loading optimizer


def pack(sd: dict[str, Any], on_device: bool = False) -> dict[str, Any]:
    """A snapshot of ``sd``: every state tensor replaced by a standalone copy taken now, in
    host memory (CPU, pageable), or with ``on_device`` where it lives. Offloaded entries are
    views of a host arena (saving one would save the whole arena), device entries the live GPU
    tensors; a kept dict of live tensors would change at the next step for some entries and
    not for others. Host memory by default: a snapshot must not take GPU memory from a model
    that barely fits. Tensor values of ``param_groups`` (a tensor lr) are copied where they
    live; other top-level keys, and non-tensor values, are kept.
    """
    device = None if on_device else "cpu"
    state = {}
    for index, entry in sd["state"].items():
        if isinstance(entry, dict):
            state[index] = {k: _copy(v, device) for k, v in entry.items()}
        else:
            state[index] = _copy(entry, device)
    # A tensor lr in a group would change with the scheduler: copied too, where it lives.
    groups = [{k: _copy(v, None) for k, v in g.items()} for g in sd["param_groups"]]
    return {**sd, "state": state, "param_groups": groups}


def _copy(v: Any, device: str | None) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    return v.detach().to(device or v.device, copy=True)


def drop_placement(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (a packed snapshot, changed in place and returned) with no group's ``"offload"``
    key."""
    for g in sd["param_groups"]:
        # Placement is the loading optimizer's own (load_state_dict keeps its groups'
        # "offload"), so a checkpoint carries none: torch.distributed.checkpoint loads
        # only keys the checkpoint has, and one of torch's AdamW, or one taken at another
        # placement, must load here (found by the fault suite's resumes: "Missing key in
        # checkpoint state_dict: optim.param_groups.0.offload").
        g.pop("offload", None)
    return sd


def export_moments(sd: dict[str, Any], rule: Rule) -> dict[str, Any]:
    """``sd`` (a packed snapshot, changed in place and returned) with the moments of a
    compressed representation under torch's keys in fp32, so that ``torch.optim.AdamW``
    loads it: bf16 moments upcast (exact); int8 codes decoded, the codes and scales kept
    beside them for an exact resume (:func:`stored_entry` prefers them)."""
    if rule.moments == "fp32":
        return sd
    for entry in sd["state"].values():
        if not isinstance(entry, dict):
            continue
        if rule.moments == "bf16":
            for k in MOMENT_KEYS:
                if isinstance(entry.get(k), torch.Tensor):
                    entry[k] = entry[k].float()
        elif all(isinstance(entry.get(k), torch.Tensor) for k in INT8_KEYS):
            entry.update(_decoded(entry))
    return sd


def encoded(key: str, value: torch.Tensor, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Moment ``key`` (``"exp_avg"`` or ``"exp_avg_sq"``) as int8 codes shaped like ``value``
    and fp32 block scales, on ``device`` (:mod:`offloadopt.kernels.formats`)."""
    from offloadopt.kernels import formats

    x = value.detach().to(device, torch.float32).reshape(-1)
    codes, scales = (formats.encode_m if key == "exp_avg" else formats.encode_v)(x)
    return codes.view(value.shape), scales


def _decoded(entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An entry's int8 codes and scales decoded: torch's keys -> fp32 moments shaped like the
    codes, where the codes live."""
    from offloadopt.kernels import formats

    out = {}
    for key, decode in zip(MOMENT_KEYS, (formats.decode_m, formats.decode_v), strict=True):
        q, s = entry[f"{key}_q"], entry[f"{key}_scale"]
        out[key] = decode(q.reshape(-1), s).view(q.shape)
    return out


def stored_entry(entry: dict[str, Any], rule: Rule, keys: tuple[str, ...]) -> dict[str, Any]:
    """A validated saved entry's moments in the representation ``keys`` (the loading
    param's state keys) stores: int8 codes and scales copied when the entry has them (an exact
    resume), else encoded from the fp32 moments (a checkpoint of torch's AdamW, or of another
    representation); fp32 or bf16 moments from torch's keys (copied, or cast by the caller),
    else decoded from codes. Other keys (``step``, ``master``) as they are."""
    out = {k: v for k, v in entry.items() if k not in MOMENT_KEYS and k not in INT8_KEYS}
    want_codes = "exp_avg_q" in keys
    has_codes = all(isinstance(entry.get(k), torch.Tensor) for k in INT8_KEYS)
    has_moments = all(isinstance(entry.get(k), torch.Tensor) for k in MOMENT_KEYS)
    if want_codes and has_codes:
        out.update({k: entry[k] for k in INT8_KEYS})
    elif want_codes and has_moments:
        for key in MOMENT_KEYS:
            out[f"{key}_q"], out[f"{key}_scale"] = encoded(key, entry[key], "cpu")
    elif has_moments or not has_codes:
        out.update({k: entry[k] for k in MOMENT_KEYS if k in entry})
    else:  # codes only, into fp32 or bf16 moments
        out.update(_decoded(entry))
    return out


def wrap_shards(sd: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """``sd`` (a packed snapshot, changed in place and returned) with the state tensors of
    FSDP2 params (DTensors; ``params`` in group order, as ``sd["state"]``'s indices count
    them) wrapped as DTensors laid out like their param; ``step`` and other entries as they
    are."""
    for index, entry in sd["state"].items():
        p = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if is_dtensor(p) and isinstance(
            entry, dict
        ):  # FSDP2: each shard goes out as a DTensor laid out like its param
            for key, v in entry.items():
                if key != "step" and isinstance(v, torch.Tensor):
                    entry[key] = wrap_like(p, v)
    return sd


def validate(
    sd: Any, rule: Rule, groups: list[list[ParamSpec]]
) -> tuple[list[dict], dict[int, dict]]:
    """Check a whole state dict against the loading optimizer's groups (``(name, shape)`` of
    each param, in order) and the rule; nothing is changed.

    Returns:
        The saved groups, and the saved state by param position (over all groups), each entry
        with ``step`` as a float (any 1-element shape loads). Empty entries are dropped.

    Raises:
        ValueError: the first thing that does not fit, named.
    """
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' keys")
    saved_groups = sd["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        raise ValueError(
            f"state_dict['param_groups'] is a {type(saved_groups).__name__}, not a list of groups"
        )
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(groups)}"
        )
    ids: dict[Any, int] = {}
    for gi, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
        if not isinstance(s, dict) or not isinstance(s.get("params"), (list, tuple)):
            raise ValueError(f"saved param group {gi} is not a dict with a 'params' list")
        if len(s["params"]) != len(g):
            raise ValueError(
                f"saved param group {gi} has {len(s['params'])} params, the optimizer's has {len(g)}"
            )
        for k in s["params"]:
            if k in ids:
                raise ValueError(f"param id {k!r} appears twice in the saved param groups")
            ids[k] = len(ids)
        for flag in rule.refused_flags:
            if s.get(flag):
                raise ValueError(
                    f"saved param group {gi} has {flag}={s[flag]!r}, which Hybrid{rule.name} "
                    "does not support"
                )
        # every hyperparameter but maximize (newer than some torch versions' state dicts):
        # a missing one means another optimizer's state dict (SGD's has no betas)
        missing = [k for k in rule.hyper_defaults if k != "maximize" and k not in s]
        if missing:
            raise ValueError(
                f"saved param group {gi} has no {', '.join(map(repr, missing))}: not a state "
                f"dict of Hybrid{rule.name} or torch.optim.{rule.name} (its keys: "
                f"{sorted(k for k in s if k != 'params')})"
            )
        values = {k: s.get(k, v) for k, v in rule.hyper_defaults.items()}
        try:
            rule.validate(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"saved param group {gi}: {e}") from e
    params = [spec for g in groups for spec in g]
    state: dict[int, dict] = {}
    state_keys = {"step", "master", *rule.state_keys}
    adam = tuple(rule.state_keys) == MOMENT_KEYS  # any representation's checkpoint loads
    if adam:
        state_keys |= set(INT8_KEYS)
    if not isinstance(sd["state"], dict):
        raise ValueError("state_dict['state'] must be a dict")
    for key, entry in sd["state"].items():
        if key not in ids:
            raise ValueError(f"state for param id {key!r}, which is in no saved param group")
        name, shape = params[ids[key]]
        if not isinstance(entry, dict):
            raise ValueError(f"state of {name} is a {type(entry).__name__}, not a dict")
        if not entry:
            continue  # an empty entry (a defaultdict lookup) means no state, as in torch
        unknown = set(entry) - state_keys
        if unknown:
            raise ValueError(
                f"state of {name} has keys {sorted(unknown)} that Hybrid{rule.name} does not use"
            )
        required = ("step",) if rule.has_step else ()
        coded = adam and any(k in entry for k in INT8_KEYS)
        if coded:  # int8 codes: all four, and torch's keys (decoded) need not be there
            required += INT8_KEYS
        elif not rule.lazy_state:
            required += rule.state_keys
        for k in required:
            if k not in entry:
                raise ValueError(f"state of {name} lacks {k!r}")
        if not rule.has_step:
            state[ids[key]] = _checked_tensors(entry, name, shape, rule)
            continue
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
        state[ids[key]] = {**_checked_tensors(entry, name, shape, rule), "step": step}
    return list(saved_groups), state


def _checked_tensors(entry: dict, name: str, shape: tuple, rule: Rule) -> dict:
    """``entry`` after checking its state tensors (and optional master) against the shape.
    With torch's keys beside them, int8 codes are a cache of those moments: kept only when
    they are exactly their encoding (our own checkpoint, an exact resume), else dropped, so
    that the moments win (``torch.optim.AdamW`` loads our checkpoint, casts the codes to the
    param's dtype, steps on and saves codes that no longer match)."""
    entry = dict(entry)
    if all(k in entry for k in INT8_KEYS) and not _codes_match(entry, name, shape):
        for k in INT8_KEYS:
            del entry[k]
    coded = any(k in entry for k in INT8_KEYS)
    if coded:
        _checked_codes(entry, name, shape)
    for k in (*rule.state_keys, "master"):
        t = entry.get(k)
        if t is None and (k == "master" or rule.lazy_state or coded):
            continue  # no master; a lazy key not made yet (SGD's buffer); codes instead
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_complex():
            what = f"a {t.dtype} Tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"state of {name}: {k!r} must be a floating-point Tensor, got {what}")
        if t.is_meta or t.layout != torch.strided:
            raise ValueError(f"state of {name}: {k!r} has no values here ({t.device}, {t.layout})")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"state of {name}: {k!r} has shape {tuple(t.shape)}, the param {tuple(shape)}"
            )
    return dict(entry)


def _codes_match(entry: dict, name: str, shape: tuple) -> bool:
    """Whether ``entry`` has no fp32 moments under torch's keys, or has well-formed codes that
    decode bitwise to them (what :func:`export_moments` writes)."""
    moments = [entry.get(k) for k in MOMENT_KEYS]
    if not all(isinstance(t, torch.Tensor) for t in moments):
        return True  # codes only: they are the state (checked as such)
    if any(
        t.dtype != torch.float32 or tuple(t.shape) != tuple(shape) or t.is_meta for t in moments
    ):
        return False  # not our export's moments (cast, or another shape: checked after)
    try:
        _checked_codes(entry, name, shape)
    except ValueError:
        return False  # torch's AdamW cast the codes to the param's dtype
    decoded = _decoded({k: entry[k].detach().cpu() for k in INT8_KEYS})
    return all(
        torch.equal(decoded[k], t.detach().cpu()) for k, t in zip(MOMENT_KEYS, moments, strict=True)
    )


def _checked_codes(entry: dict, name: str, shape: tuple) -> None:
    """Check int8 moments: uint8 codes shaped like the param, fp32 scales, one per block."""
    numel = math.prod(shape)
    for k in INT8_KEYS:
        t = entry[k]
        scale = k.endswith("_scale")
        want = (torch.float32, (-(-numel // BLOCK),)) if scale else (torch.uint8, tuple(shape))
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state of {name}: {k!r} must be a Tensor, got {type(t).__name__}")
        if t.is_meta or t.layout != torch.strided:
            raise ValueError(f"state of {name}: {k!r} has no values here ({t.device}, {t.layout})")
        if (t.dtype, tuple(t.shape)) != want:
            raise ValueError(
                f"state of {name}: {k!r} is {t.dtype} of shape {tuple(t.shape)}, expected "
                f"{want[0]} of shape {want[1]}"
            )


def merge_group(mine: dict[str, Any], saved: dict[str, Any], rule: Rule,
                options: frozenset[str] = frozenset()) -> dict[str, Any]:  # fmt: skip
    """The values a loading group takes: every saved key (hyperparameters and extras such as a
    scheduler's ``initial_lr``, deep-copied) except the loading optimizer's own keys
    (``params``, ``param_names`` when it has them, ``offload``, and its ``options``' names: a
    group that carries one, as ZeroRedundancyOptimizer's do, keeps the loading optimizer's
    value or none, never the saved one, which it would not run with), then the rule's torch
    flags."""
    out = {k: v for k, v in mine.items()}
    for k, v in saved.items():
        if k not in _OWN_KEYS and k not in options:
            out[k] = copy.deepcopy(v)
    if "param_names" in saved and "param_names" not in mine:
        out["param_names"] = list(saved["param_names"])  # as torch keeps a named checkpoint's
    if "betas" in out:
        out["betas"] = tuple(out["betas"])
    out.update(rule.torch_flags)
    return out
