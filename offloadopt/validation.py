"""Argument checks for the hybrid optimizers: each raises before anything is built and names
the value. The rule's own hyperparameters are checked by the rule (offloadopt/rules.py), with
``torch/optim/adamw.py``'s messages (``ValueError(f"Invalid learning rate: {lr}")``).
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import torch

from offloadopt.kernels.adam import device_step_env
from offloadopt.options import OPTION_NAMES, Options
from offloadopt.rules import MOMENTS, Rule, tensor_betas, tensor_hyper_flags
from offloadopt.warn import warn

# cpu_threads' upper bound is 4 a CPU, and at least this: tens of thousands of threads made
# libgomp fail to create them or crash (SIGSEGV) inside torch.set_num_threads on the worker
MAX_THREADS = 64

__all__ = ["validate_options", "check_combinations", "validate_group", "validate_params_arg"]


def _check(ok: bool, message: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(message)


def validate_params_arg(params: Any) -> list:
    """The ``params`` argument as a list (tensors, ``(name, tensor)`` pairs or group dicts).

    Raises:
        TypeError: a single Tensor, or a set (its order changes between runs, as torch says).
        ValueError: an empty list.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}"
        )
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the ordering "
            "of tensors in sets will change between runs: got a set; use a list instead"
        )
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    return params


def _check_worker_cpus(value: Any) -> None:
    """``worker_cpus``: None, ``"any"``, or a non-empty collection of CPU ids this process may
    run on (``os.sched_getaffinity``). Raises ValueError naming the value."""
    if value is None or (isinstance(value, str) and value == "any"):
        return
    ok = (isinstance(value, (list, tuple, set, frozenset, range)) and len(value) > 0
          and all(isinstance(c, numbers.Integral) and not isinstance(c, bool) and c >= 0
                  for c in value))  # fmt: skip
    if not ok:
        raise ValueError(f"Invalid worker_cpus: {value!r} (expected None, 'any', or a non-empty "
                         "list of CPU ids, ints >= 0)")  # fmt: skip
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return
    outside = sorted(set(value) - allowed)
    if outside:
        raise ValueError(f"Invalid worker_cpus: {value!r}: CPU {outside[0]} is not one this "
                         f"process may run on ({sorted(allowed)})")  # fmt: skip


# When the CPU worker gets an update thread (offloadopt/link/worker.py, docs/how-it-works.md):
# "link" (where its copies cross to a GPU), "always" (host copies too) or "never".
UPDATE_THREADS = ("link", "always", "never")


def update_thread_env() -> str:
    """``OFFLOADOPT_UPDATE_THREAD``, one of :data:`UPDATE_THREADS`; "never" where unset or
    empty (the update thread is not yet measured on a GPU host). Raises ValueError for
    another value (the constructor asks, so a bad one fails there, not at the first step)."""
    mode = os.environ.get("OFFLOADOPT_UPDATE_THREAD") or "never"
    if mode not in UPDATE_THREADS:
        raise ValueError(f"OFFLOADOPT_UPDATE_THREAD={mode!r}; expected 'link', 'always' or 'never'")
    return mode


def check_environment() -> None:
    """The environment's settings that the optimizer reads (``OFFLOADOPT_DEVICE_STEP``,
    ``OFFLOADOPT_UPDATE_THREAD``): raises ValueError naming a bad one. The constructor and the
    CLI (before it reads any data) ask."""
    device_step_env()
    update_thread_env()


def validate_options(
    rule: Rule,
    hyper: dict[str, Any],
    o: Options,
    *,
    amsgrad: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    owner: str | None = None,
) -> None:
    """The constructor's arguments (``owner``: the class the messages name, default
    ``Hybrid<rule>``): the rule's hyperparameters ``hyper``, the offloading
    options ``o`` (offloadopt/options.py) and torch's flags (``foreach`` and ``fused`` are
    accepted and ignored, but checked as torch checks them; the others are refused).

    Raises:
        ValueError: a bad value, named in the message (the environment's
            ``OFFLOADOPT_DEVICE_STEP`` and ``OFFLOADOPT_UPDATE_THREAD`` too).
        TypeError: an object of the wrong kind (``grad_scaler``, ``ddp``, ``lr``).
        NotImplementedError: ``amsgrad``, ``capturable`` or ``differentiable`` set.
        RuntimeError: ``fused`` and ``foreach`` both True (torch's words).
    """
    if o.placement_policy not in ("state-bytes", "megatron"):
        raise ValueError(
            f"Invalid placement_policy: {o.placement_policy!r} (expected 'state-bytes' or 'megatron')"
        )
    tensor_hyper_flags(hyper, foreach=foreach, capturable=capturable)
    rule.validate(hyper)
    tensor_betas(hyper)
    if fused and foreach:  # torch's Adam, AdamW and SGD, after their values
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    check_environment()  # a bad setting fails here, on any device

    def number(x) -> bool:  # numpy's scalars too (numbers.Real), not a bool or a tensor
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    _check(o.offload_fraction == "auto" or (number(o.offload_fraction) and 0.0 <= o.offload_fraction <= 1.0),
           f"Invalid offload_fraction: {o.offload_fraction!r} (expected a number in [0, 1], or 'auto')")  # fmt: skip
    _check(number(o.auto_tolerance) and 0.0 <= o.auto_tolerance < float("inf"),
           f"Invalid auto_tolerance: {o.auto_tolerance!r} (expected a finite number >= 0, like 0.05)")  # fmt: skip
    _check(o.auto_tolerance == 0.05 or o.offload_fraction == "auto",
           f"auto_tolerance={o.auto_tolerance!r} without offload_fraction='auto' does nothing")  # fmt: skip
    _check(count(o.min_offload_numel) and o.min_offload_numel >= 0,
           f"Invalid min_offload_numel: {o.min_offload_numel!r} (expected an int >= 0)")  # fmt: skip
    _check(o.bucket_nbytes is None or (count(o.bucket_nbytes) and o.bucket_nbytes > 0),
           f"Invalid bucket_nbytes: {o.bucket_nbytes!r} (expected None or an int > 0)")  # fmt: skip
    most = max(MAX_THREADS, 4 * (os.cpu_count() or 1))  # more only contend (and crash libgomp)
    integral = isinstance(o.cpu_threads, numbers.Integral) and not isinstance(o.cpu_threads, bool)
    _check(o.cpu_threads is None or (integral and 0 < o.cpu_threads <= most),
           f"Invalid cpu_threads: {o.cpu_threads!r} (expected None or an int in 1..{most}: "
           f"4 a CPU of this machine's {os.cpu_count()}, {MAX_THREADS} at least)")  # fmt: skip
    _check_worker_cpus(o.worker_cpus)
    _check(number(o.timeout_s) and 0 < o.timeout_s < 1e7,
           f"Invalid timeout_s: {o.timeout_s!r} (expected seconds, finite and > 0)")  # fmt: skip
    _check(o.overlap in ("step", "backward", "delayed"),
           f"Invalid overlap: {o.overlap!r} (expected 'step', 'backward' or 'delayed')")  # fmt: skip
    _check(o.wait in ("step", "module"), f"Invalid wait: {o.wait!r} (expected 'step' or 'module')")
    _check(o.max_grad_norm is None or (number(o.max_grad_norm) and 0 < o.max_grad_norm < float("inf")),
           f"Invalid max_grad_norm: {o.max_grad_norm!r} (expected None or a finite number > 0)")  # fmt: skip
    _check(isinstance(o.master_weights, bool) or o.master_weights == "bf16-sr",
           f"Invalid master_weights: {o.master_weights!r} (expected True, False or 'bf16-sr')")  # fmt: skip
    _check(isinstance(o.state_dtype, str) and o.state_dtype in MOMENTS,
           f"Invalid state_dtype: {o.state_dtype!r} (expected 'fp32', 'bf16' or 'int8')")  # fmt: skip
    compressed = o.state_dtype != "fp32" or o.master_weights == "bf16-sr"
    if compressed:
        what = (f"state_dtype={o.state_dtype!r}" if o.state_dtype != "fp32"
                else "master_weights='bf16-sr'")  # fmt: skip
        _check(rule.name in ("AdamW", "Adam"),
               f"{what} is for HybridAdamW and HybridAdam; Hybrid{rule.name} keeps torch's "
               "fp32 state (state_dtype='fp32', master_weights=True or False)")  # fmt: skip
        _check(o.master_weights is not False,
               f"{what} with master_weights=False: a compressed representation keeps fp32 "
               "masters (True) or bf16 masters rounded stochastically ('bf16-sr')")  # fmt: skip
    for flag, value in [
        ("pin_memory", o.pin_memory),
        ("flush_denormal", o.flush_denormal),
        ("grads_final", o.grads_final),
        ("release_grads", o.release_grads),
        ("speculate", o.speculate),
    ]:
        _check(isinstance(value, bool), f"Invalid {flag}: {value!r} (expected a bool)")
    if o.grad_scaler is not None:
        _check(
            isinstance(o.grad_scaler, torch.amp.GradScaler),
            f"Invalid grad_scaler: {type(o.grad_scaler).__name__} (expected a torch.amp.GradScaler)",
            TypeError,
        )
    through = o.grads_final or o.max_grad_norm is not None or o.grad_scaler is not None
    if o.speculate is True:
        final = ""
        if o.grads_final and o.max_grad_norm is None and o.grad_scaler is None:
            final = "; grads_final=True starts updates with nothing to check: none to speculate on"
        _check(
            o.overlap == "backward" and (o.max_grad_norm is not None or o.grad_scaler is not None),
            "speculate=True starts backward mode's clipped or scaled updates during backward: "
            "it needs overlap='backward' and max_grad_norm= or grad_scaler= (got "
            f"overlap={o.overlap!r}, max_grad_norm={o.max_grad_norm!r}, grad_scaler="
            f"{'attached' if o.grad_scaler is not None else None}{final})",
        )
        _check(
            not o.release_grads,
            "speculate=True with release_grads=True: a speculative update that the clip or "
            "the GradScaler's check undoes is made again from the device grads, so they must "
            "stay until step(); leave release_grads out",
        )
    _check(
        not o.release_grads or (o.overlap == "backward" and through),
        "release_grads=True frees grads once their copy lands during backward: it needs "
        "overlap='backward' and grads_final=True, max_grad_norm= (clipping through the "
        "optimizer) or grad_scaler= (a GradScaler attached)",
    )
    if o.ddp is not None:
        from torch.nn.parallel import DistributedDataParallel

        _check(
            isinstance(o.ddp, DistributedDataParallel),
            f"Invalid ddp: {type(o.ddp).__name__} (expected the DistributedDataParallel model whose "
            "all-reduced grads this optimizer reads)",
            TypeError,
        )
        _check(
            o.overlap == "backward" and through,
            "ddp= is the grad source of overlap='backward' with grads_final=True, "
            f"max_grad_norm= or grad_scaler= (got overlap={o.overlap!r}); without them step() "
            "reads DDP's reduced "
            "grads, and needs no ddp=",
        )
        _check(
            o.ddp.gradient_as_bucket_view,
            "ddp=: build DistributedDataParallel(..., gradient_as_bucket_view=True), so that a "
            "bucket's grads are reduced in place once its all-reduce is done (otherwise DDP "
            "copies them into p.grad only at the end of backward)",
        )
        _check(
            not o.release_grads,
            "release_grads=True with ddp=: DDP owns its grad buckets (their memory stays)",
        )
    _check(
        isinstance(o.delay_after, numbers.Integral) and not isinstance(o.delay_after, bool) and o.delay_after >= 0,
        f"Invalid delay_after: {o.delay_after!r} (expected an int >= 0: synchronous steps before the delay)",
    )  # fmt: skip
    _check(
        o.delay_after == 0 or o.overlap == "delayed",
        f"delay_after={o.delay_after} applies to overlap='delayed' (got overlap={o.overlap!r})",
    )
    _check(
        o.delay_after == 0 or rule.has_step,
        f"delay_after={o.delay_after}: {rule.name} keeps no step count to tell the synchronous "
        "steps by (it resumes from a checkpoint by the params' step); use delay_after=0",
    )
    _check(
        not o.grads_final or o.overlap == "backward",
        f"grads_final=True applies to overlap='backward' (got overlap={o.overlap!r}, which reads "
        "the grads in step())",
    )
    if o.overlap == "delayed":
        _check(
            o.wait == "step",
            f"overlap='delayed' publishes the new weights at the next step() (or "
            f"opt.synchronize()): wait={o.wait!r} does not apply; leave wait='step'",
        )
    name = owner or f"Hybrid{rule.name}"
    given = "" if amsgrad is True else f" (got amsgrad={amsgrad!r}, which torch reads as True)"
    _check(not amsgrad, f"{name} does not support amsgrad=True yet{given}", NotImplementedError)
    _check(
        not capturable,
        f"{name} does not support capturable=True (CUDA graphs)",
        NotImplementedError,
    )
    _check(not differentiable, f"{name} does not support differentiable=True", NotImplementedError)


def check_combinations(o: Options, sizes: dict[str, int | None], world: int) -> None:
    """The options that are valid one by one (:func:`validate_options`) but not together:
    ``o`` as parsed, ``sizes`` its byte sizes (:func:`offloadopt.place.budget.sizes`: bytes or
    None), ``world`` the job's ranks.

    Raises:
        ValueError: ``offload_fraction`` with ``max_gpu_memory``; ``"auto"`` with
            ``overlap="delayed"`` and no budget; ``max_host_memory`` or ``activation_bytes``
            without ``max_gpu_memory``; ``grad_scaler=`` with several ranks and no ``ddp=``;
            ``"auto"`` with several ranks.
    """
    auto = o.offload_fraction == "auto"
    if sizes["max_gpu_memory"] is not None and not auto and o.offload_fraction != 1.0:
        raise ValueError(
            f"offload_fraction={o.offload_fraction!r} with max_gpu_memory={o.max_gpu_memory!r}: "
            "give one (the budget chooses the fraction), or offload_fraction='auto'"
        )
    if auto and o.overlap == "delayed" and sizes["max_gpu_memory"] is None:
        raise ValueError(
            "offload_fraction='auto' with overlap='delayed': the fraction decides which "
            "params train on weights one step old, so a fraction chosen from timings would "
            "make the results depend on them; give a number (1.0 is the delayed update's "
            "usual one), or max_gpu_memory="
        )
    for name, value in (
        ("max_host_memory", o.max_host_memory),
        ("activation_bytes", o.activation_bytes),
    ):
        if value is not None and sizes["max_gpu_memory"] is None:
            raise ValueError(f"{name}={value!r} without max_gpu_memory does nothing")
    if o.grad_scaler is not None and world > 1 and o.ddp is None:
        raise ValueError(
            f"grad_scaler= with {world} ranks and no ddp=: the check for infs would "
            "see this rank's shard alone; leave it out (step() takes the scaler's values, as "
            "torch's fused AdamW does)"
        )
    if auto and world > 1:
        raise ValueError(
            f"offload_fraction='auto' with {world} ranks: it measures one process, and "
            "ranks choosing apart would train unevenly; give each rank the same number"
        )


def _without_repeats(items: list) -> list:
    """A group's params (tensors or ``(name, tensor)`` pairs) with each tensor listed once.
    A repeat is torch's ``UserWarning`` (torch/optim/optimizer.py, ``add_param_group``: "in
    future, this will cause an error"); torch then updates the param once per listing, this
    optimizer once."""
    first: dict[int, str] = {}  # id of a tensor -> how its first listing is named
    kept = []
    for i, item in enumerate(items):
        p = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        name = repr(item[0]) if isinstance(item, tuple) else f"param {i} of the group"
        if isinstance(p, torch.Tensor) and id(p) in first:
            warn("optimizer contains a parameter group with duplicate parameters; in future, "
                 "this will cause an error; see github.com/pytorch/pytorch/issues/40967 for "
                 f"more information (offloadopt: {name} is {first[id(p)]} listed again, shape "
                 f"{tuple(p.shape)}; it is kept once and updated once a step)")  # fmt: skip
            continue
        first[id(p)] = name
        kept.append(item)
    return kept


def _same(value: Any, mine: Any) -> bool:
    try:  # a group's value that cannot compare (a tensor) is not the optimizer's
        return value is mine or bool(value == mine)
    except (TypeError, ValueError, RuntimeError):
        return False


def validate_group(
    param_group: Any, defaults: dict[str, Any], rule: Rule, options: Options, index: int, owner: str
) -> dict[str, Any]:
    """Group ``index`` of an ``owner`` built with ``options``, about to be added: its params
    (tensors or ``(name, tensor)`` pairs; one listed again is dropped, with torch's warning) and
    its values (other keys are kept, as torch's). Returns a shallow copy, ``params`` a list.

    Raises:
        TypeError: not a dict, or a param that is not a Tensor.
        ValueError: a complex, non-float, sparse or non-cpu/cuda param (named), a
            param the compressed representation cannot update (fp64; fp16 with ``"bf16-sr"``),
            a bad hyperparameter or ``"offload"`` key, or an offloading option as a key with
            another value than the optimizer's (one per optimizer: it would be ignored), or
            ``decoupled_weight_decay`` other than the rule's (:meth:`Rule.check_flags`).
        NotImplementedError: ``amsgrad`` set in the group.
    """
    _check(
        isinstance(param_group, dict),
        f"param_group must be a dict, but got {torch.typename(param_group)}",
        TypeError,
    )
    _check(
        "params" in param_group,
        f"a param group must have a 'params' key (a list of tensors); got keys {sorted(map(str, param_group))}",
    )
    group = dict(param_group)
    raw = group["params"]
    _check(
        not isinstance(raw, (set, frozenset)),
        "optimizer parameters need to be organized in ordered collections, but the ordering of "
        "tensors in sets will change between runs: a group's 'params' is a set; use a list",
        TypeError,
    )
    raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
    group["params"] = raw = _without_repeats(raw)
    for i, item in enumerate(raw):
        name, p = item if isinstance(item, tuple) else (None, item)
        label = name or f"param {i} of the new group"
        _check(
            isinstance(p, torch.Tensor),
            f"optimizer can only optimize Tensors, but {label} is {torch.typename(p)}",
            TypeError,
        )
        _check(not p.is_complex(), f"complex parameters are not supported: {label} is {p.dtype}")
        _check(
            p.is_floating_point(),
            f"{label} has dtype {p.dtype}: only floating-point params can be optimized (torch's "
            "optimizers keep a non-float param that never gets a grad; leave it out: "
            "[p for p in model.parameters() if p.is_floating_point()])",
        )
        _check(
            p.layout == torch.strided,
            f"sparse parameters are not supported: {label} has layout {p.layout}",
        )
        refusal = rule.dtype_refusal(p.dtype, label)
        _check(refusal is None, refusal or "")
        _check(
            p.device.type in ("cpu", "cuda", "meta"),
            f"{label} is on {p.device}: HybridAdamW supports cpu and cuda params (and meta "
            "params materialized in place before the first step)",
        )
    rule.validate({k: group.get(k, defaults[k]) for k in rule.hyper_defaults})
    # An option as a group key would be ignored: refused, unless it is the optimizer's own
    # value (torch's ZeroRedundancyOptimizer copies the constructor's keywords into each group).
    for key in sorted(OPTION_NAMES.intersection(group)):
        mine = getattr(options, key)
        _check(
            _same(group[key], mine),
            f"param group {index} has {key}={group[key]!r} (the constructor's: {mine!r}): {key} "
            f"is one per optimizer ({owner}(..., {key}=...)), not per group, where it would be "
            "ignored" + ("; a group's own placement is its 'offload' key (True or False)"
               if key in ("offload_fraction", "min_offload_numel") else ""),
        )  # fmt: skip
    offload = group.get("offload")
    _check(
        offload is None or isinstance(offload, bool),
        f"Invalid 'offload' group key: {offload!r} (expected True, False or None)",
    )
    rule.check_flags(group)
    return group


# ------------------------------------------------------------------ construction


def check_fraction(fraction: Any) -> float:
    """``set_offload_fraction``'s argument as a float.

    Raises:
        ValueError: ``fraction`` is not a number in [0, 1] (``"auto"`` included: it is a
            constructor option).
    """
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction <= 1:  # fmt: skip
        raise ValueError(
            f"Invalid offload_fraction: {fraction!r} (expected a number in [0, 1]; "
            "offload_fraction='auto' is a constructor option)"
        )
    return float(fraction)
