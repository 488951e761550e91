"""The main job: train a GPT-2 preset on real text and show what the optimizer costs.

``python -m offloadopt train`` (no options) trains the tiny preset on CPython's pydoc text
on the CPU for 200 steps (under a minute on 2 quiet cores) and ends with a held-out loss well
below the text's byte unigram entropy (about 2.3 nats against 3.26), the sign that the
optimizer really trains. It logs through ``logging`` (logger ``offloadopt.train``, to stdout
by default): per logged step one fixed-width line (loss, held-out loss, step time, tokens/s,
model TFLOPS, MFU, GPU peak memory, host RSS, optimizer pinned memory); it shows a progress bar
on stderr and ends with one JSON line on stdout. ``--grad-accum N`` accumulates N micro-batches
a step, ``--measure-fwd-bwd K`` times forward+backward alone first; ``--save`` / ``--resume``
checkpoint and continue a run, ``--tensorboard DIR`` also writes TensorBoard events.

``make_model_and_optimizer`` and ``train_step`` are the pieces a benchmark reuses.
One step over its micro-batches (``train_step``, ``fwd_bwd``) lives in ``train_step.py``, the
throughput figures (tokens/s, TFLOPS, MFU, the peaks) in ``throughput.py``, the checkpoints
(``save_checkpoint``, ``load_checkpoint``) in ``train_checkpoint.py``, the logger and the
figures it reports (``host_rss_nbytes``, ``describe_choice``, ``per_rank``) in
``train_log.py``; they are imported here too, where some were defined before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from offloadopt.harness import checks
from offloadopt.harness.build import (  # noqa: F401 - also here
    DTYPES,
    check_fits_device,
    make_model_and_optimizer,
)
from offloadopt.harness.data import TokenData, get_batch, mock_data
from offloadopt.harness.delayed import DelayedSchedule
from offloadopt.harness.distributed import Dist, init_from_env, teardown
from offloadopt.harness.gpt import GPT, PRESETS

# the configuration and its options live in options.py (no torch: --help starts at once)
from offloadopt.harness.options import (  # noqa: E402, F401 - their old home is here
    FIELD_CHECKS,
    HELP,
    OPTIMIZERS,
    OVERLAPS,
    PARALLELS,
    RUN_DEFAULTS,
    TrainConfig,
    add_train_args,
    config_from_args,
)
from offloadopt.harness.throughput import Throughput, matmul_peak, peak_of, time_steps
from offloadopt.harness.train_checkpoint import (  # noqa: F401 - imported from here too
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    RESUME_MAY_CHANGE,
    identity,
    load_checkpoint,
    resume_error,
    save_checkpoint,
)
from offloadopt.harness.train_log import (  # noqa: F401 - imported from here too
    StdoutHandler,
    _logging_to_stdout,
    describe_choice,
    host_rss_nbytes,
    log,
    per_rank,
)
from offloadopt.harness.train_step import fwd_bwd, train_step
from offloadopt.shards import local


def lr_at(step: int, lr: float, warmup_steps: int, steps: int) -> float:
    """Learning rate of 1-based ``step``: linear warm-up to ``lr``, then cosine decay to lr / 10."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: GPT, data: TokenData, cfg: TrainConfig) -> torch.Tensor:
    """Mean held-out loss over ``cfg.eval_batches`` fixed batches: 0-dim fp32 on the device."""
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # the same held-out batches every time
    losses = [
        model(*get_batch(data, "heldout", cfg.batch_size, cfg.seq_len, gen, cfg.device))[1]
        for _ in range(cfg.eval_batches)
    ]
    model.train()
    return torch.stack(losses).mean()


class NonFiniteStop:
    """The run stops at a NaN or infinite loss (``cfg.stop_on_nonfinite``), and before saving
    weights that are not finite (an update of the step just taken can make them so while its
    loss was finite): a NaN reaches no checkpoint, and the run does not go on for hundreds of
    steps on NaN and end with status 0 (issue 44)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def check(self, step: int, what: str, value: float, saved_at: int | None) -> None:
        """Raises checks.RunStopped when ``value`` (the ``what`` of ``step``) is not finite."""
        if self.cfg.stop_on_nonfinite and not math.isfinite(value):
            self._stop(step, f"the {what} is {value}", saved_at)

    def check_weights(self, step: int, model: torch.nn.Module, saved_at: int | None) -> None:
        """Raises checks.RunStopped when a weight of ``model`` is not finite."""
        if self.cfg.stop_on_nonfinite:
            bad = [n for n, p in model.named_parameters() if not bool(local(p).isfinite().all())]
            if bad:
                self._stop(step, f"{len(bad)} weights are not finite ({bad[0]}, ...)", saved_at)

    def _stop(self, step: int, found: str, saved_at: int | None) -> None:
        cfg = self.cfg
        # a resumed run keeps the saved run's settings (train_checkpoint.RESUME_MAY_CHANGE): a
        # lower --lr or more --grad-clip is a new run (a fresh user followed the old advice)
        kept = (f"the last checkpoint, {cfg.save}, holds step {saved_at} (--resume {cfg.save} "
                "goes on from there with the same settings; a lower --lr or more --grad-clip "
                "is a new run)" if saved_at is not None
                else "no checkpoint was written" + ("" if cfg.save else " (--save PATH)"))  # fmt: skip
        raise checks.RunStopped(f"step {step}: {found}; the run stops, {kept}; "
                                "--no-stop-on-nonfinite trains on")  # fmt: skip


def train(cfg: TrainConfig) -> dict:
    """Train, log, and return the summary that is printed as the last (JSON) line.

    Logs through ``logging.getLogger("offloadopt.train")`` (to stdout unless a handler of the
    caller's is attached to it): a few lines first, then one fixed-width line per logged step.
    With ``cfg.save`` the run's checkpoint is written at the end and every ``cfg.save_every``
    steps; with ``cfg.resume`` it continues from one (see :func:`load_checkpoint`), its losses
    bit for bit those of an uninterrupted run. With ``cfg.tensorboard`` the losses, learning
    rate and step times also go to TensorBoard event files there.

    Step times bracket the fetch of the step's micro-batches and ``train_step`` with
    ``torch.cuda.synchronize()`` on CUDA; ``--measure-fwd-bwd`` brackets the same fetch and
    forward+backward alone the same way. Memory figures are in GB = 1e9 bytes.
    """
    cfg = cfg.resolved()
    ranks = init_from_env(cfg.device) if cfg.parallel != "none" else Dist()
    if ranks.initialized and torch.device(cfg.device).type == "cuda":
        cfg = replace(cfg, device=f"cuda:{ranks.local_rank}")  # this rank's GPU
    with _logging_to_stdout(ranks.main):
        return _train(cfg, ranks)


def _train(cfg: TrainConfig, ranks: Dist) -> dict:
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    check_fits_device(cfg, device)  # the weights and a micro-batch's logits fit, at all
    # the checkpoint and the data before the model: bad input fails in a second, not after a build
    resume = load_checkpoint(cfg.resume, cfg) if cfg.resume is not None else None
    if cfg.mock_data:
        data = mock_data(PRESETS[cfg.preset].vocab_size)
    else:
        data = checks.text_data(cfg.data, cfg.seq_len)
    log.info(f"data: {data.description}")
    log.info(f"data: byte unigram entropy {data.entropy_nats:.4f} nats (held-out loss should "
             "end below)")  # fmt: skip

    peak, matmul = peak_of(device), matmul_peak(device)  # before the model: all memory free
    model, opt = make_model_and_optimizer(cfg)
    n_params = getattr(model, "module", model).num_params()  # DDP wraps; FSDP2 does not
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum  # per rank
    rate = Throughput(n_params, tokens_per_step, peak, matmul)
    on = (
        f"{device}"
        if not ranks.initialized
        else f"{device.type} x {ranks.world} ranks ({cfg.parallel})"
    )
    log.info(
        f"model: {cfg.preset}, {n_params / 1e6:.2f}M params, {cfg.dtype} on {on} | "
        f"optimizer: {cfg.optimizer}"
        + (
            f" (offload_fraction {cfg.offload_fraction})"
            if cfg.optimizer == "hybrid" and not cfg.max_gpu_memory
            else ""
        )
        + (
            f" (max_gpu_memory {cfg.max_gpu_memory:,} bytes: the fraction is chosen at the first "
            "step)"
            if cfg.optimizer == "hybrid" and cfg.max_gpu_memory
            else ""
        )
        + (
            f", state_dtype {cfg.state_dtype}, master_weights {cfg.master_weights}"
            if cfg.optimizer == "hybrid"
            and (cfg.state_dtype, cfg.master_weights) != ("fp32", "fp32")
            else ""
        )
        + f" | batch {cfg.batch_size} x {cfg.seq_len}"
        + (f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
        + f" = {tokens_per_step:,} tokens/step"
        + (" per rank" if ranks.initialized else "")
        + f" | {cfg.steps} steps, lr {cfg.lr:g}"
        + (" | activation checkpointing" if cfg.checkpointing else "")
    )
    gen = torch.Generator().manual_seed((cfg.seed + 7919 * ranks.rank) % 2**63)  # own batches
    first_loss = train_loss = val_loss = float("nan")
    start = 1
    schedule = DelayedSchedule(model, opt)  # evaluations and checkpoints keep the delayed update's
    if resume is not None:
        t = time.perf_counter()
        try:  # a checkpoint that does not fit is refused before anything is changed
            if resume.get("streamed"):
                opt.load_streamed(cfg.resume, model=model)
            else:
                model.load_state_dict(resume["model"])
                opt.load_state_dict(resume["optimizer"])
        except ValueError as e:  # a bad --resume: a usage error (status 2), as the others
            raise checks.UsageError(resume_error(cfg.resume, e)) from None
        except RuntimeError as e:  # failed after its checks (status 1): named as the others
            if type(e) is not RuntimeError:  # torch's OutOfMemoryError and the like: as they are
                raise
            raise RuntimeError(resume_error(cfg.resume, e)) from e
        log.info(f"loaded: {cfg.resume} in {time.perf_counter() - t:.2f} s")
        schedule.resume(resume.get("delayed_weights", {}), cfg.resume)
        gen.set_state(resume["generator"])
        torch.set_rng_state(resume["torch_rng"])
        start, first_loss = resume["step"] + 1, resume["first_train_loss"]
        log.info(f"resumed: {cfg.resume} at step {resume['step']}, continuing at step {start}")
        del resume
    log.info(rate.describe())
    fwd_bwd_ms = _measure_fwd_bwd(model, opt, data, cfg, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # peak of training, not of building

    # Losses come to the host through one small buffer, pinned on CUDA, so that reading them is
    # never a pageable copy in a profile of the loop.
    loss_host = torch.zeros((), dtype=torch.float32, pin_memory=cuda)  # () fp32, host

    def to_host(t: torch.Tensor) -> float:
        # non_blocking from a pinned destination is a true async D2H; the synchronize below
        # guarantees it has landed before the host reads the value.
        loss_host.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        return loss_host.item()

    board = None
    if cfg.tensorboard is not None and ranks.main:
        from torch.utils.tensorboard import SummaryWriter  # resolved() checked it is installed

        board = SummaryWriter(cfg.tensorboard)
    step_ms: list[float] = []
    gb = 1e9
    t_start = time.perf_counter()
    said_choice = None  # the optimizer's placement choice last printed
    # the step of the last checkpoint at --save: this run's, or the one it resumed from there
    saved_at = start - 1 if cfg.resume is not None and cfg.save == cfg.resume else None
    stop = NonFiniteStop(cfg)
    bar = tqdm(range(start, cfg.steps + 1), desc="train", file=sys.stderr, initial=start - 1,
               total=cfg.steps, disable=None if cfg.progress and ranks.main else True)  # fmt: skip
    try:
        for step in bar:
            lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            if cuda:
                torch.cuda.synchronize(device)  # the timed window starts with an idle GPU
            t0 = time.perf_counter()
            batches = [get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, device)
                       for _ in range(cfg.grad_accum)]  # fmt: skip
            loss = train_step(model, opt, batches, cfg.grad_clip, before_step=schedule)
            if cuda:
                torch.cuda.synchronize(device)  # the window ends when the step's GPU work is done
            step_ms.append((time.perf_counter() - t0) * 1e3)
            train_loss = to_host(loss)
            if step == 1:
                first_loss = train_loss
            stop.check(step, "training loss", train_loss, saved_at)
            evaluated = step % cfg.eval_every == 0 or step == cfg.steps
            if evaluated:
                schedule.newest()  # delayed: evaluate the newest weights (copied in now)
                val_loss = to_host(evaluate(model, data, cfg))
                stop.check(step, "held-out loss", val_loss, saved_at)
            if step % cfg.log_every == 0 or step in (start, cfg.steps) or evaluated:
                peak_gpu = torch.cuda.max_memory_allocated(device) / gb if cuda else 0.0
                pinned = getattr(opt, "pinned_nbytes", 0) / gb
                val = f"{val_loss:6.4f}" if evaluated else f"{'-':>6}"
                log.info(
                    f"step {step:6d}/{cfg.steps} | loss {train_loss:6.4f} | held-out {val} | "
                    f"{step_ms[-1]:8.1f} ms | {rate.columns(step_ms[-1])}"
                    f" | gpu {peak_gpu:6.2f} GB | rss {host_rss_nbytes() / gb:6.2f} GB | "
                    f"pinned {pinned:6.2f} GB"
                )
            if board is not None:
                board.add_scalar("loss/train", train_loss, step)
                board.add_scalar("lr", lr, step)
                board.add_scalar("step_ms", step_ms[-1], step)
                if evaluated:
                    board.add_scalar("loss/heldout", val_loss, step)
            choice = getattr(opt, "placement_choice", None)
            if choice is not None and choice != said_choice:
                said_choice = dict(choice)
                log.info(describe_choice(choice))
            if cfg.save is not None and (
                step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)
            ):
                stale = schedule.newest()
                stop.check_weights(step, model, saved_at)  # a NaN update is never saved
                t, before = time.perf_counter(), identity(cfg.save)
                try:
                    nbytes = save_checkpoint(
                        cfg.save, cfg, step, model, opt, gen, first_loss, stale
                    )
                except BaseException:  # a new user's find: Ctrl-C after the new checkpoint's
                    if identity(cfg.save) != before:  # rename said it held the step before
                        saved_at = step
                        log.info(f"saved: {cfg.save} at step {step} (then interrupted)")
                    raise
                saved_at = step
                log.info(f"saved: {cfg.save} at step {step} ({nbytes / 1e9:.3f} GB in "
                         f"{time.perf_counter() - t:.2f} s)")  # fmt: skip
            if step < cfg.steps:
                schedule.keep_delay()  # after an evaluation or a checkpoint: the delay goes on
            bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)
    except BaseException as e:  # Ctrl-C, SIGTERM, an error: where the run can go on from
        if saved_at is not None and ranks.main and not isinstance(e, checks.RunStopped):
            print(f"offloadopt: the last checkpoint, {cfg.save}, holds step {saved_at} of "
                  f"{cfg.steps}: --resume {cfg.save} goes on from there", file=sys.stderr)  # fmt: skip
        raise
    finally:
        bar.close()
        if board is not None:
            board.close()

    spec = getattr(opt, "speculation", None)  # --speculate: how often the clip undid them
    if spec is not None:
        log.info(f"speculation: {spec['steps']} steps began their updates in backward; "
                 f"{spec['redone_clip']} redone for the clip, {spec['redone_inf']} for an inf "
                 f"or NaN; backup {spec['backup_nbytes'] / 1e9:.3f} GB of host memory")  # fmt: skip
    timed = step_ms[1:] or step_ms  # the first step pays for lazy state and kernel warm-up
    median_ms = statistics.median(timed)
    summary = {
        "preset": cfg.preset,
        "params": n_params,
        "device": str(device),
        "dtype": cfg.dtype,
        "optimizer": cfg.optimizer,
        # the fraction placed (with --max-gpu-memory: the one the budget chose)
        "offload_fraction": opt.offload_fraction if cfg.optimizer == "hybrid" else 0.0,
        "placement_choice": getattr(opt, "placement_choice", None),
        "overlap": cfg.overlap if cfg.optimizer == "hybrid" else "step",
        # HybridAdamW's representation of the state (docs/compressed-state.md)
        "state_dtype": cfg.state_dtype if cfg.optimizer == "hybrid" else None,
        "master_weights": cfg.master_weights if cfg.optimizer == "hybrid" else None,
        "delay_after": cfg.delay_after,
        "speculation": spec,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "grad_accum": cfg.grad_accum,
        "lr": cfg.lr,
        "data": data.description,
        "first_train_loss": first_loss,
        "final_train_loss": train_loss,
        "final_heldout_loss": val_loss,
        "entropy_nats": data.entropy_nats,
        "heldout_below_entropy": bool(val_loss < data.entropy_nats),
        "median_step_ms": median_ms,
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / gb if cuda else 0.0,
        "host_rss_gb": host_rss_nbytes() / gb,
        "optimizer_host_gb": getattr(opt, "host_nbytes", 0) / gb,
        "optimizer_pinned_gb": getattr(opt, "pinned_nbytes", 0) / gb,
        "wall_s": time.perf_counter() - t_start,
        "torch": torch.__version__,
        "parallel": cfg.parallel,
        "world_size": ranks.world,
    }
    if ranks.initialized:  # the job steps at its slowest rank; tokens/s adds up over ranks
        job = per_rank(opt, summary, ranks, tokens_per_step)
        slowest = max(r["median_step_ms"] for r in job["ranks"])
        summary.update(rate.summary(slowest, fwd_bwd_ms), **job)
    else:
        summary.update(rate.summary(median_ms, fwd_bwd_ms))
    if hasattr(opt, "close"):
        opt.close()  # the worker thread ends here, not in the interpreter's shutdown
        # a run too short for --offload-fraction auto's choice: close() says so (a warning and
        # placement_choice["kept"]), and the summary with it
        summary["placement_choice"] = opt.placement_choice
    return summary


def _measure_fwd_bwd(model, opt, data: TokenData, cfg: TrainConfig,
                     device: torch.device) -> float | None:  # fmt: skip
    """``--measure-fwd-bwd K``: the median ms of K steps' forward+backward alone (``fwd_bwd``:
    the step's micro-batches, accumulated as ``train_step`` does, grads kept, no optimizer
    step), after one untimed; None when K is 0. Each window brackets the fetch of the
    micro-batches too, as the training steps' do. The batches come from a generator of their
    own and torch's RNG state is restored: the run's batches and losses are those of a run
    without it."""
    if not cfg.measure_fwd_bwd:
        return None
    gen = torch.Generator().manual_seed((cfg.seed + 3) % 2**63)

    def work() -> None:
        batches = [get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, device)
                   for _ in range(cfg.grad_accum)]  # fmt: skip
        fwd_bwd(model, opt, batches)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        work()  # untimed: lazy initialisation, the allocator's first blocks
        ms = statistics.median(time_steps(cfg.measure_fwd_bwd, work, device))
    log.info(f"forward+backward alone: {ms:.1f} ms a step (median of {cfg.measure_fwd_bwd}; "
             f"{cfg.grad_accum} micro-batches, grads kept, no optimizer step)")  # fmt: skip
    return ms


def run(args: argparse.Namespace) -> int:
    """``offloadopt train``: train, then print the summary as the last line (JSON)."""
    try:
        summary = train(config_from_args(args))
        if rank_of_env() == 0:
            print(json.dumps(summary), flush=True)
    finally:
        teardown()
    return 0


def rank_of_env() -> int:
    """This process's rank under torchrun (0 otherwise)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
