"""How :class:`offloadopt.optim.HybridOptimizer` is built: its rule from the options, its
owners wired (each handed the owners it uses, docs/how-it-works.md has the table), then its
groups checked and placed. Called from ``HybridOptimizer.__init__`` around torch's
``Optimizer.__init__``."""

from __future__ import annotations

from dataclasses import replace as dc_replace
from typing import Any

import torch

from offloadopt import kernels
from offloadopt.options import Options
from offloadopt.place.placer import Placer
from offloadopt.place.records import ParamRecord
from offloadopt.relocate import Relocator
from offloadopt.rules import AdamWRule, Rule
from offloadopt.shards import check_ddp, check_zero, world_size
from offloadopt.step.delayed import NextStep
from offloadopt.step.feed import Feeder
from offloadopt.step.guards import Guards
from offloadopt.step.publish import AtReturn, PerModule, Publisher
from offloadopt.step.scaling import Scaling
from offloadopt.step.speculate import Speculation
from offloadopt.step.start import start_policy
from offloadopt.step.step import Timeline
from offloadopt.step.update import Updater
from offloadopt.warn import warn

__all__ = ["check_and_place", "load_kernel", "publisher_for", "rule_for", "wire"]


def rule_for(rule: Rule, o: Options) -> Rule:
    """The class's ``rule`` under the options: a compressed representation (``state_dtype``,
    ``master_weights="bf16-sr"``) runs offloadopt's kernel (:func:`load_kernel`)."""
    compressed = dc_replace(rule, moments=o.state_dtype, master_sr=o.master_weights == "bf16-sr",
                            flush_denormal=o.flush_denormal)  # fmt: skip
    return compressed if compressed.compressed else rule


def load_kernel(rule: Rule, o: Options) -> None:
    """Build offloadopt's kernel where ``rule`` (from :func:`rule_for`) needs it, after the
    params and the setup were checked (a refusal is named before a 40 s build, and not hidden
    by a missing compiler) and before anything is placed: a compressed representation fails here
    without a compiler; ``speculate=True`` with Adam/AdamW builds it too (it writes the
    speculative backups, offloadopt/step/speculate.py: built now, not on the worker in the
    middle of a step, about 40 s once), and says so where it cannot."""
    if rule.compressed:
        kernels.load()
    elif o.speculate and isinstance(rule, AdamWRule):
        try:
            kernels.load()
        except kernels.KernelBuildError as e:
            warn(f"offloadopt: speculate=True: {e}; the speculative backups are copies "
                 "made before each update instead (slower: docs/modes.md)")  # fmt: skip


def wire(opt: Any, o: Options, sizes: dict[str, int | None]) -> None:
    """Build ``opt``'s owners, right after torch's ``Optimizer.__init__`` (the Placer reads
    the groups). None holds the optimizer, so a dropped optimizer dies at once and its grad
    hooks with it, not at the next gc.collect() after firing on the next optimizer's backward
    (tests/test_faults.py drops 200 optimizers of one model). Nor do two owners hold each
    other (a cycle would keep a dropped optimizer's state until Python's gc): the two calls
    against the build order, the placer's to the start policy's grad hooks and the
    publisher's to the feeder's step end, are ``weakref.WeakMethod``s."""
    name, timeout_s, warn_once = type(opt).__name__, opt.timeout_s, opt._warn_once
    opt._records = records = {}  # param -> ParamRecord; the Placer fills it
    records: dict[torch.Tensor, ParamRecord]
    opt._timeline = timeline = Timeline(name)  # the lock, the steps in time, a refusal
    max_grad_norm = None if o.max_grad_norm is None else float(o.max_grad_norm)
    opt._scaling = scaling = Scaling(max_grad_norm, o.grad_scaler, timeline, id(opt))
    opt._placer = placer = Placer(  # where each param's state lives, the memory it holds
        opt.param_groups, opt.rule, o, sizes, name=name, records=records,
        ddp=o.ddp is not None, warn_once=warn_once,
    )  # fmt: skip
    opt._guards = guards = Guards(records, timeline, scaling, warn_once, placer)
    opt._publish = publisher = publisher_for(  # WHEN new weights are visible
        o, timeline, records, placer, timeout_s=timeout_s, warn_once=warn_once
    )
    opt._updater = updater = Updater(  # the rule's application; making and loading state
        opt.rule, records, opt.state, master_weights=o.master_weights is True,
        bucket_nbytes=placer.bucket_nbytes, timeout_s=timeout_s, warn_once=warn_once,
    )  # fmt: skip
    opt._feeder = feeder = Feeder(  # buckets to the pipeline, the device update, the step's end
        timeline, placer, updater, guards, publisher, opt.state, opt.rule,
        release_grads=o.release_grads, module_order=o.wait == "module",
        delay_after=opt.delay_after if o.overlap == "delayed" else None, timeout_s=timeout_s,
    )  # fmt: skip
    opt._speculation = Speculation(  # speculate=True: backups, validation, rollback
        scaling, placer, timeout_s, in_kernel=updater.backs_up_in_kernel,
    ) if o.speculate else None  # fmt: skip
    opt._start = start = start_policy(  # WHEN an update may start
        o, timeline=timeline, placer=placer, feeder=feeder, scaling=scaling,
        grads_final=o.grads_final, release_grads=o.release_grads, ddp=o.ddp is not None,
        timeout_s=timeout_s, speculation=opt._speculation,
    )  # fmt: skip
    placer.hooks_to(start.hook)  # each placed arena's grad hooks
    opt._relocate = Relocator(  # every move to another fraction, or to new state keys
        placer, opt.state, updater, start, publisher, guards, timeline
    )


def check_and_place(opt: Any, o: Options) -> None:
    """The groups checked against the options (auto, bf16-sr, ddp=, ZeRO), the kernel built
    where the rule needs it (:func:`load_kernel`), the groups placed now or at the first step
    (meta params, a budget), and ``ddp=``'s comm hook installed.

    Raises:
        ValueError, RuntimeError: a group or setup the options refuse (named); ``ddp=`` on a
            DDP model with a comm hook already (the optimizer is closed first).
    """
    groups = opt.param_groups
    for g in groups:
        opt._placer.check_auto_group(g)
    if opt.rule.master_sr and not any(p.dtype == torch.bfloat16 for g in groups
                                      for p in g["params"]):  # fmt: skip
        opt._warn_once("bf16-sr-no-bf16", (
            "master_weights='bf16-sr' has no bf16 param to act on: fp32 params keep "
            "updating in fp32 (the fp32 weight is its own master) and fp16 params are "
            "refused; cast the model to bf16 (model.to(torch.bfloat16)) for bf16 masters, "
            "or leave master_weights out"))  # fmt: skip
    if o.ddp is not None:
        check_ddp(o.ddp, groups, opt._placer.param_name)
    check_zero(o.overlap, groups, world_size(), max_grad_norm=o.max_grad_norm,
               grad_scaler=o.grad_scaler)  # fmt: skip
    load_kernel(opt.rule, o)  # every check above first: none waits for a 40 s build
    opt._placer.place_or_defer(list(range(len(groups))))
    if o.ddp is not None:
        try:
            opt._start.hook_ddp(o.ddp)
        except RuntimeError as e:  # DDP takes one comm hook per model
            opt.close()
            raise RuntimeError(
                f"ddp=: this DDP model has a comm hook already ({e}); ddp= installs its "
                "own (torch's all-reduce, then an announcement), and DDP takes one: drop the "
                "other hook (fp16 compression, PowerSGD, another optimizer's ddp=), or leave "
                "out ddp= and use overlap='step' or 'delayed'"
            ) from e


def publisher_for(
    options: Options, timeline: Timeline, records: dict, placer: Placer, **kw: Any
) -> Publisher:
    """The publish policy of ``options.overlap`` and ``options.wait`` (validated:
    ``overlap="delayed"`` takes ``wait="step"``), built with :class:`Publisher`'s arguments
    (``kw``: ``timeout_s``, ``warn_once``)."""
    if options.overlap == "delayed":
        return NextStep(timeline, records, placer, **kw)
    if options.wait == "module":
        return PerModule(timeline, records, placer, **kw)
    return AtReturn(timeline, records, placer, **kw)
