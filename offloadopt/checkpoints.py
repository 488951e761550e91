"""The optimizer's checkpoints: ``state_dict()`` and the load path (``load_state_dict``, and
what ``load_streamed`` shares with it), as functions of the optimizer, and :class:`Checkpoints`,
the base class of :class:`offloadopt.optim.HybridOptimizer` whose methods call them (their
docstrings are the contract).
The pure formats are offloadopt/state/checkpoint.py; streamed checkpoints
offloadopt/state/streamed.py and streamed_load.py."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.options import OPTION_NAMES
from offloadopt.shards import local, local_state
from offloadopt.state import checkpoint

__all__ = ["Checkpoints", "load_state_dict", "load_validated", "prepare_load", "snapshot_source"]
__all__ += ["opened_by_torch_save", "state_dict"]


def state_dict(opt: Any) -> dict[str, Any]:
    """``opt.state_dict()``: a snapshot in the rule's torch layout (the method's docstring)."""
    if not opt._placer.budget_pending():  # a budget waits for the first step(): no state yet
        opt.ensure_placed()
    if opt.overlap == "delayed" and not opt._publish.module_waits and opt._timeline.inflight is not None:  # fmt: skip
        opt._warn_once(
            "delayed-unwatched",
            "overlap='delayed' without opt.watch(model): a model.state_dict() taken before "
            "this call holds weights one step older than these masters, and a resume from "
            "the pair loses that step's update (fp32 params cannot even tell)",
        )
    sd = checkpoint.pack(snapshot_source(opt), on_device=opt._snapshot_on_device)
    sd = checkpoint.export_moments(sd, opt.rule)  # fp32 under torch's keys
    # a param with no state has no entry, as in torch's (SGD without momentum: "state": {};
    # a new user's find: one empty dict per param)
    sd["state"] = {k: v for k, v in sd["state"].items() if v}
    params = [p for g in opt.param_groups for p in g["params"]]
    return checkpoint.wrap_shards(checkpoint.drop_placement(sd), params)


def snapshot_source(opt: Any) -> dict[str, Any]:
    """torch's ``state_dict()`` layout over the live state tensors, once every update has
    landed (``state_dict()`` copies it; ``save_streamed`` writes it as it is)."""
    opt.synchronize()
    opt._guards.check_snapshot()
    return Optimizer.state_dict(opt)


def refuse_dict_hooks(verb: str, what: str, instead: str, *registries) -> None:
    """ValueError when any of ``registries`` (torch's hook dicts) holds a hook: a streamed
    checkpoint never holds the whole dict such a hook edits, and skipping it silently
    would save or load something else than the hook's owner expects."""
    n = sum(len(r) for r in registries)
    if n:
        raise ValueError(
            f"{verb}: {n} {what} registered on this optimizer; a streamed "
            f"checkpoint never holds the whole dict they edit, so they cannot run: use "
            f"{instead} with torch.save/torch.load, or remove the hooks"
        )


def load_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict(state_dict)`` (the method's docstring): its pre-hooks, then
    :func:`load_validated`."""
    prepare_load(opt)
    sd = dict(state_dict) if isinstance(state_dict, dict) else state_dict
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    load_validated(opt, sd)


def prepare_load(opt: Any) -> None:
    """What every load does before its checks (``load_state_dict``, ``load_streamed``):
    place the groups (meta-device params materialized since), refuse a load mid-step, let
    the updates in flight land (a failed one is what a load repairs)."""
    opt.ensure_placed()
    opt._publish.refuse_other_thread()  # not swallowed below: it is no failed step
    opt._guards.check_load()  # a step in progress since backward: refused, unchanged
    try:
        opt.synchronize()
    except Exception:  # noqa: BLE001 - a failed step is what a load repairs
        pass


def load_validated(opt: Any, sd: Any, before: Callable[[], None] | None = None,
                   real_entry: Callable[[int, dict], dict] | None = None,
                   check: Callable[[], None] | None = None) -> None:  # fmt: skip
    """Validate ``sd`` whole, then copy it in (``load_state_dict``'s work after its
    pre-hooks). ``check``: run after the validation, before anything changes (a streamed
    load verifies its files there; its ValueError changes nothing); ``before``: run once
    everything is validated, before the first copy (a streamed load reads the model's
    weights there); ``real_entry(index, entry)``: the entry with its tensors' values,
    where ``sd`` holds only their shapes (a streamed load,
    offloadopt/state/streamed_load.py). A ValueError after the first copy is raised as a
    RuntimeError: a ValueError means nothing was changed."""
    groups, placer, timeline = opt.param_groups, opt._placer, opt._timeline
    specs = [[(placer.record(p, g, gi, i).name, tuple(local(p).shape))
              for i, p in enumerate(g["params"])] for gi, g in enumerate(groups)]  # fmt: skip
    sd = local_state(sd, groups, lambda p: placer.records[p].name)
    saved_groups, saved_state = checkpoint.validate(sd, opt.rule, specs)
    if check is not None:
        check()
    opt._relocate.refuse_unsupported_casts()  # a cast to a dtype the representation does not update
    opt._relocate.budget_for_new_dtypes()  # a cast no budget's fraction meets: nothing changed
    # Copied in place entry by entry: a Ctrl-C (or SIGTERM) waits until every entry is in
    # (torch swaps its state in at once); any other failure part-way leaves the optimizer
    # refusing step() and state_dict() until a load succeeds (tests/test_state_contract.py).
    with signals_deferred():
        try:
            timeline.discard(opt.timeout_s)  # the bucket in hand lands first
            opt._scaling.pending_clip = None
            if before is not None:
                before()
            for g, s in zip(groups, saved_groups, strict=True):
                g.update(checkpoint.merge_group(g, s, opt.rule, OPTION_NAMES))
            # the model cast after the optimizer was built: the state is loaded in the
            # params' dtypes, as torch's (a no-op unless a param's dtype changed)
            opt._relocate.for_new_dtypes()
            if placer.keys_changed():  # a checkpoint of SGD with momentum into one built without
                opt._relocate.for_new_keys()  # (a fresh user's finding: its buffers were dropped)
            ignored_masters = opt._updater.load_state(groups, saved_state, real_entry)
        except BaseException as e:
            timeline.refuse("load_state_dict() failed part-way")
            if isinstance(e, ValueError):  # found after copies began: not "nothing changed"
                raise RuntimeError(f"the load failed part-way, after its checks: {e}; some "
                                   "state was copied in, and the optimizer refuses step() "
                                   "until a load succeeds") from e  # fmt: skip
            raise
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
    if ignored_masters:
        warnings.warn(
            "the state dict carries fp32 masters for params that keep none here (fp32 "
            "params, master_weights=False, or master_weights='bf16-sr', whose bf16 weight "
            "is the master): they were ignored, and the state takes the params' dtype",
            stacklevel=3,
        )
    placer.check_pinned()


class Checkpoints:
    """The checkpoint methods of :class:`offloadopt.optim.HybridOptimizer` (a base class of it,
    before ``torch.optim.Optimizer``, whose ``state_dict`` and ``load_state_dict`` these
    replace), each calling this module's function of the same name."""

    def state_dict(self) -> dict[str, Any]:
        """The rule's torch layout (``torch.optim.AdamW(fused=True)``'s) plus ``"master"``
        (fp32) where one exists. Loadable with ``torch.load(weights_only=True)``.

        A snapshot: every state tensor is a standalone copy in host memory (CPU), taken now,
        so a kept dict never changes with later steps (torch's holds live references; ours
        cannot for offloaded entries, which are views of host arenas, and one rule for every
        entry beats two). Device-resident state is copied to the host with a blocking D2H,
        never duplicated on the GPU. ``load_state_dict`` copies values into the optimizer's
        buffers wherever they come from; ``torch.optim`` optimizers move them to their params.
        The groups leave out the ``"offload"`` key: placement is the loading optimizer's own.
        """
        return state_dict(self)

    def _snapshot_source(self) -> dict[str, Any]:
        """For offloadopt/state/streamed.py: checkpoints.snapshot_source."""
        return snapshot_source(self)

    def save_streamed(self, path: str, model: torch.nn.Module | None = None,
                      extra: Any = None) -> int:  # fmt: skip
        """Write the state to the folder ``path`` in ``torch.save`` parts of at most 256 MiB,
        with ``model.state_dict()`` and ``extra`` (any object ``torch.load(weights_only=True)``
        reads; another is a ValueError) when given; returns the bytes written.

        For models whose state does not fit twice in host memory: ``state_dict()`` copies
        every state tensor to the host (and decodes int8 moments to fp32 beside their codes);
        this writes the live tensors in the stored representation, with one part in flight
        (offloadopt/state/streamed.py, docs/checkpoints.md). A temporary folder beside
        ``path`` is renamed into place: an interrupt leaves the previous checkpoint or the new
        one. Read it back with :meth:`load_streamed` (not with ``torch.optim.AdamW``).

        ``state_dict`` hooks (``register_state_dict_pre_hook`` / ``_post_hook``) edit a whole
        dict, which a streamed save never builds: with one registered it is refused.

        Raises:
            NotImplementedError: FSDP2 (DTensor) params. OSError: the folder could not be
                written (a previous checkpoint at ``path`` is kept). ValueError: a
                ``state_dict`` hook is registered (nothing was written).
        """
        from offloadopt.state import streamed

        refuse_dict_hooks("save_streamed", "state_dict hook(s)", "state_dict()",
                          self._optimizer_state_dict_pre_hooks,
                          self._optimizer_state_dict_post_hooks)  # fmt: skip
        return streamed.save(self, path, model, extra)

    def load_streamed(self, path: str, model: torch.nn.Module | None = None) -> Any:
        """Read a :meth:`save_streamed` folder into this optimizer (and ``model``'s tensors, in
        place); returns the ``extra`` object saved with it, or None. The whole checkpoint is
        checked against the optimizer and the model first, as ``load_state_dict`` checks a
        dict; then it is read in chunks of at most 256 MiB of host memory.

        ``load_state_dict`` post-hooks run after it, as after ``load_state_dict``; a pre-hook
        (which edits the whole dict, never held here) makes it refuse.

        Raises:
            ValueError: not a streamed checkpoint, or one that does not fit (names what), or
                a ``load_state_dict`` pre-hook is registered; nothing was changed.
            RuntimeError: as ``load_state_dict``.
        """
        from offloadopt.state import streamed_load

        refuse_dict_hooks("load_streamed", "load_state_dict pre-hook(s)", "load_state_dict()",
                          self._optimizer_load_state_dict_pre_hooks)  # fmt: skip
        return streamed_load.load(self, path, model)

    @no_grad_whole  # no grad (copies record nothing); signals deferred around it
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate the whole dict, then copy it into the existing buffers.

        Group hyperparameters (and extra keys such as a scheduler's ``initial_lr``) come from
        the dict; ``params``, ``param_names`` and ``offload`` stay the optimizer's own, and the
        rule's torch flags are restored. State is copied, never aliased: masters keep fp32,
        offloaded state stays in its arena on the host. A low-precision param with no master
        in the dict (a checkpoint of ``torch.optim.AdamW`` on a bf16 model) gets its master
        from its current weights, with a warning: such a resume cannot be exact. An fp32
        offloaded param's host copy is refreshed from the param. Params with no saved state
        lose theirs (it is made again at their next grad), as in torch.

        Raises:
            ValueError: the dict does not fit this optimizer; nothing was changed.
            RuntimeError: between backward and ``step()`` once this step's updates began
                (declared backward mode); nothing was changed.
        """
        load_state_dict(self, state_dict)

    def _prepare_load(self) -> None:
        """For offloadopt/state/streamed_load.py: checkpoints.prepare_load."""
        prepare_load(self)

    def _load_validated(self, sd: Any, **kw: Any) -> None:
        """For offloadopt/state/streamed_load.py: checkpoints.load_validated."""
        load_validated(self, sd, **kw)


def opened_by_torch_save() -> str:
    """Where a pickling of the optimizer runs inside ``torch.save(obj, path)``: a sentence
    naming ``path``, which torch.save opened (emptied) before it pickled (a user's find: a
    checkpoint there was lost without a word); "" otherwise."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "save" and code.co_filename.endswith(
            os.path.join("torch", "serialization.py")
        ):
            path = frame.f_locals.get("f")
            if isinstance(path, (str, os.PathLike)):
                opened = os.fspath(path)
                return f" (torch.save had opened {opened!r} before this: a file that was there is now empty)"
            return ""
        frame = frame.f_back
    return ""
