"""Checkpoints of the main job (``offloadopt train --save / --resume``): the run's whole state
written atomically (:func:`save_checkpoint`), and read back checked against the resumed run's
configuration (:func:`load_checkpoint`, one-line ``UsageError`` on a bad file). The CPU tests
in ``tests/test_train_checkpoint.py`` hold it to bit-for-bit resumption.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from typing import Any

import torch

from offloadopt.harness.checks import CHECKPOINT_FORMAT, UsageError, begins_as_train_checkpoint
from offloadopt.harness.data import text_digest
from offloadopt.harness.options import DERIVED, TrainConfig
from offloadopt.interrupts import signals_deferred
from offloadopt.state import integrity
from offloadopt.state.integrity import fsync_save
from offloadopt.state.leftovers import recover_leftovers, temp_file
from offloadopt.warn import warn

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "RESUME_MAY_CHANGE", "save_checkpoint"]
__all__ += ["load_checkpoint"]

CHECKPOINT_VERSION = 2  # 2: the file ends with its checksum (state/integrity.py); 1 still loads
# The TrainConfig fields a resumed run may change: where and how often it logs and saves,
# whether it stops at a NaN loss, --speculate (its runs are bitwise the runs without it:
# docs/modes.md) and --measure-fwd-bwd (its batches are drawn apart; no step is taken). Every
# other field must be the saved run's (they decide the losses).
RESUME_MAY_CHANGE = ("progress", "eval_every", "eval_batches", "log_every", "save",
                     "save_every", "resume", "tensorboard", "checkpoint_format", "speculate",
                     "stop_on_nonfinite", "measure_fwd_bwd")  # fmt: skip


def save_checkpoint(path: str, cfg: TrainConfig, step: int, model, opt, gen: torch.Generator,
                    first_loss: float, delayed_weights: dict | None = None) -> int:  # fmt: skip
    """Write the run's state after ``step`` to ``path`` whole: ``torch.save`` into a temporary
    file in the same folder, flushed to disk, then ``os.replace``, so an interrupt (Ctrl-C,
    SIGTERM, a full disk) leaves either the previous checkpoint or the new one, never half a file.
    The file ends with the checksum of its bytes, which :func:`load_checkpoint` verifies; a full
    disk is an OSError naming ``path`` and the space needed.
    With ``cfg.checkpoint_format == "streamed"`` a folder instead, written by
    ``opt.save_streamed`` (the same guarantee; everything but the model and the optimizer goes
    in its ``extra``). Returns the bytes written.

    Holds the model's ``state_dict``, the optimizer's (after ``synchronize()`` in delayed mode),
    ``step``, the batch sampler's generator state, torch's global RNG state, the resolved config
    (a dict) and the first step's loss (for the summary); ``delayed_weights`` ({param name:
    CPU tensor}, ``--overlap delayed``): the weights the run's next forward reads where they are
    not the newest (:class:`offloadopt.harness.delayed.DelayedSchedule`), saved as given.
    """
    if hasattr(opt, "synchronize"):
        opt.synchronize()  # delayed: the masters and moments of every step taken
    payload = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "step": step,
        "config": asdict(cfg),
        "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "first_train_loss": first_loss,
        "delayed_weights": dict(delayed_weights or {}),
        "torch": str(torch.__version__),
        "data_sha256": text_digest(cfg.data),  # the data by its bytes (_checked)
    }
    if cfg.checkpoint_format == "streamed":
        return opt.save_streamed(path, model=model, extra=payload)
    payload.update(model=model.state_dict(), optimizer=opt.state_dict())
    # a symlink stays and its target is replaced, as save_streamed does (a new user's find:
    # the link became a regular file and its target went stale)
    target = os.path.realpath(path)
    # the temporary file of a save killed outright (SIGKILL, a lost node) goes now (a new
    # user's find: each one stayed beside the checkpoint for good, checkpoint-sized)
    recover_leftovers(target)
    tmp = temp_file(target)
    try:
        fsync_save(payload, tmp)  # Ctrl-C while torch writes: a KeyboardInterrupt, exit 130
        os.replace(tmp, target)
        integrity.fsync_dir(os.path.dirname(target))
    except BaseException as e:
        with signals_deferred():  # a second Ctrl-C left the temporary file behind
            written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if integrity.disk_full(e):
            kept = (f"the previous checkpoint at {path!r} is kept" if os.path.exists(path)
                    else "nothing was at that path before")  # fmt: skip
            needed = _tensor_nbytes(payload)
            raise integrity.full_disk_error("--save", path, written, needed, kept) from e
        raise
    return os.path.getsize(target)


def identity(path: str) -> tuple[int, int, int] | None:
    """What is at ``path`` now (device, inode, mtime), or None: a save's ``os.replace`` puts a
    new inode there, so a change says that a save was committed, whatever stopped it after."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _tensor_nbytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (nested dicts, lists, tuples): about what a
    ``torch.save`` of it writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_nbytes(v) for v in obj)
    return 0


def load_checkpoint(path: str, cfg: TrainConfig) -> dict:
    """The checkpoint at ``path`` (tensors on the CPU), checked against the resolved ``cfg``.

    Raises ``UsageError`` naming ``--resume`` and the file: not a checkpoint of this command
    (unreadable, another kind of file), one of another preset or with other settings (each
    differing ``--flag`` with both values), or one already at ``cfg.steps``. A damaged
    checkpoint is refused as damaged (the file and what failed) before any of those.
    """
    name = f"--resume: {path!r}"
    from offloadopt.state.streamed import read_extra

    if os.path.isdir(path) or not os.path.exists(path):  # a streamed checkpoint: extra is all
        # (a missing path may be one a killed save left aside: read_extra finds it)
        try:
            ck = read_extra(path)
        except ValueError as e:
            raise UsageError(resume_error(path, e)) from None
        if isinstance(ck, dict):
            ck = {**ck, "streamed": True}
        try:
            if cfg.optimizer != "hybrid":
                raise UsageError(f"{name} is a streamed checkpoint, which only --optimizer "
                                 "hybrid reads")  # fmt: skip
            return _checked(ck, cfg, name)
        except UsageError:
            # read_extra verified the index alone (the parts are verified as the run loads
            # them): a damaged part says so before any other refusal, as a damaged file does
            _verify_streamed(path)
            raise
    return _checked(_load_file(path, name), cfg, name)


def _verify_streamed(path: str) -> None:
    """Raises UsageError where a part of the streamed checkpoint at ``path`` is missing or
    damaged (the message the run's load gives for it: names the file and what failed)."""
    from offloadopt.state import streamed_load

    try:
        streamed_load.verify(path)
    except ValueError as e:
        raise UsageError(resume_error(path, e)) from None


def resume_error(path: str, e: BaseException) -> str:
    """``e``, an error from loading the checkpoint at ``path``, as ``--resume``'s message: the
    flag in place of the library's function that the message begins with (``load_streamed:``,
    ``read_extra:``: a new user's find, the function named where the flag they passed was
    not), then the path where the message names neither it nor a file in it (it read
    ``--resume: 't': 't/index.pt' is damaged``)."""
    text = str(e)
    for who in ("load_streamed: ", "read_extra: "):
        text = text.removeprefix(who)
    named = repr(path) in text or repr(os.path.join(path, ""))[:-1] in text
    return f"--resume: {text}" if named else f"--resume: {path!r}: {text}"


def _load_file(path: str, name: str) -> Any:
    """The ``--save`` file at ``path``, its checksum verified (a version 1 file has none: it
    loads with a warning; a version 2 file without one is damaged)."""
    fix = "; restore it from a copy, or resume from an earlier checkpoint"
    try:
        verified = integrity.verify(path, name, required=False)
    except integrity.Damaged as e:
        raise UsageError(f"{e}{fix}") from None
    except OSError as e:
        raise UsageError(f"{name}: {e.strerror or e}") from None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UsageError(f"{name}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of a file that is not one
        if begins_as_train_checkpoint(path):  # one of ours, cut short or overwritten
            raise UsageError(f"{name} is damaged: it begins as a checkpoint of offloadopt train, and "
                             f"torch.load cannot read it (cut short or overwritten; "
                             f"{type(e).__name__}){fix}") from None  # fmt: skip
        raise UsageError(
            f"{name} is not a checkpoint of offloadopt train (--save writes one; "
            f"torch.load: {type(e).__name__}{'' if verified else '; damaged?'})"
        ) from None
    if isinstance(ck, dict) and ck.get("format") == CHECKPOINT_FORMAT:
        version = ck.get("version")
        if not verified and isinstance(version, int) and version >= 2:
            raise UsageError(f"{name} is damaged: a version {version} checkpoint ends with its "
                             f"checksum, and this one has none (cut short or overwritten){fix}")  # fmt: skip
        if not verified and version == 1:
            warn(f"{name} was saved by an offloadopt before checksums: its bytes cannot be "
                 "verified; it loads as before")  # fmt: skip
    return ck


def _checked(ck: Any, cfg: TrainConfig, name: str) -> dict:
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{name} is not a checkpoint of offloadopt train (--save writes one)")
    if ck.get("version") not in (1, CHECKPOINT_VERSION):
        raise UsageError(f"{name}: checkpoint version {ck.get('version')!r}, this offloadopt "
                         f"reads 1 and {CHECKPOINT_VERSION}")  # fmt: skip
    saved = ck["config"]
    if saved.get("preset") != cfg.preset:
        raise UsageError(f"{name} is a checkpoint of preset {saved.get('preset')!r}, not "
                         f"{cfg.preset!r} (--preset)")  # fmt: skip
    ours = asdict(cfg)
    # a field the saved config lacks came after the checkpoint: its run had the default
    # (--grad-accum 1 before gradient accumulation existed)
    saved = {**asdict(TrainConfig()), **saved}
    may_change = RESUME_MAY_CHANGE
    digest = ck.get("data_sha256")
    if digest is not None:  # the data by its bytes: the same file by another path resumes,
        may_change += ("data",)  # a file changed under the same path does not
        here = text_digest(cfg.data)
        if here != digest:

            def data(path: str | None) -> str:  # None: the default text (a new user read
                return "(none: pydoc_data.topics)" if path is None else repr(path)  # "None")

            raise UsageError(
                f"{name} was saved training on other data: --data {data(saved.get('data'))} "
                f"there (sha256 {digest[:16]}...), {data(cfg.data)} here (sha256 {here[:16]}...); "
                "a resumed run must read the same bytes to continue its losses exactly"
            )
    # a default that follows a field the user changed (--warmup-steps, steps/20, after --steps)
    # is not named beside it (a user's find: "--warmup-steps 0 there, 1 here", never passed)
    followed = {k for k, (src, default) in DERIVED.items() if saved.get(src) != ours[src]
                and saved.get(k) == default(saved.get(src)) and ours[k] == default(ours[src])}  # fmt: skip
    differ = [f"--{k.replace('_', '-')} {saved.get(k)!r} there, {v!r} here" for k, v in ours.items()
              if k not in may_change and k not in followed and saved.get(k) != v]  # fmt: skip
    if differ:
        why = ("; --steps sets the learning-rate schedule (warm-up, steps/20 by default, then "
               "cosine decay to lr/10 at the last step), so it cannot change on resume"
               if saved.get("steps") != cfg.steps else "")  # fmt: skip
        raise UsageError(f"{name} was saved with other settings: {'; '.join(differ)} (a resumed "
                         f"run takes the saved run's, to continue its losses exactly{why})")  # fmt: skip
    if ck["step"] >= cfg.steps:
        raise UsageError(f"{name} is at step {ck['step']} of --steps {cfg.steps}: nothing left")
    return ck
