"""The main job: train a GPT-2 preset on real text and show what the optimizer costs.

``python -m offloadopt train`` (no options) trains the tiny preset on CPython's pydoc text
on the CPU for 200 steps (under a minute on 2 quiet cores) and ends with a held-out loss well
below the text's byte unigram entropy (about 2.3 nats against 3.26), the sign that the
optimizer really trains. It logs through ``logging`` (logger ``offloadopt.train``, to stdout
by default): per logged step one fixed-width line (loss, held-out loss, step time, tokens/s,
GPU peak memory, host RSS, optimizer pinned memory); it shows a progress bar on stderr and
ends with one JSON line on stdout. ``--save`` / ``--resume`` checkpoint and continue a run,
``--tensorboard DIR`` also writes TensorBoard events.

``make_model_and_optimizer`` and ``train_step`` are the pieces a benchmark reuses.
The checkpoints (``save_checkpoint``, ``load_checkpoint``) live in ``train_checkpoint.py``, the
logger and the figures it reports (``host_rss_nbytes``, ``describe_choice``, ``per_rank``) in
``train_log.py``; both are imported here too, where they were defined before.
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

from offloadopt.adamw import HybridAdamW
from offloadopt.harness import checks
from offloadopt.harness.data import TokenData, get_batch, mock_data
from offloadopt.harness.delayed import DelayedSchedule
from offloadopt.harness.distributed import Dist, init_from_env, shard_fsdp, teardown, wrap_ddp
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
from offloadopt.harness.train_checkpoint import (  # noqa: F401 - imported from here too
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    RESUME_MAY_CHANGE,
    load_checkpoint,
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
from offloadopt.shards import local

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # options.DTYPE_NAMES' dtypes


def lr_at(step: int, lr: float, warmup_steps: int, steps: int) -> float:
    """Learning rate of 1-based ``step``: linear warm-up to ``lr``, then cosine decay to lr / 10."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def make_model_and_optimizer(cfg: TrainConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """The preset's model on ``cfg.device`` in ``cfg.dtype`` (seeded init) and its optimizer;
    with ``cfg.parallel`` the model is sharded by FSDP2 or wrapped in DDP (the process group
    must exist: :func:`offloadopt.harness.distributed.init_from_env`).

    The model is built directly on the device in its dtype (no fp32 copy, on the host or the
    device: a 17.5e9-param model in bf16 is 35 GB, in fp32 70). ``cfg`` must be resolved
    (``TrainConfig.resolved()``).
    """
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[cfg.dtype])  # params are created, and initialised, in it
    try:
        with device:
            model = GPT(PRESETS[cfg.preset])
    finally:
        torch.set_default_dtype(default)
    model.checkpointing = cfg.checkpointing
    if cfg.parallel == "fsdp":
        model = shard_fsdp(model)  # every rank built the same weights (the seed); FSDP2 shards them
    elif cfg.parallel == "ddp":
        model = wrap_ddp(model)
    kwargs = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
    else:
        chosen = {"max_gpu_memory": cfg.max_gpu_memory} if cfg.max_gpu_memory else {}
        fraction = cfg.offload_fraction if cfg.offload_fraction == "auto" or not chosen else 1.0
        if cfg.overlap == "backward":  # clipping through the optimizer, or none
            clip = (
                dict(max_grad_norm=cfg.grad_clip) if cfg.grad_clip > 0 else dict(grads_final=True)
            )
            clip["release_grads"] = cfg.release_grads
            if cfg.speculate:
                clip["speculate"] = True
        else:
            clip = {}  # torch's clip_grad_norm_ in train_step
        if cfg.overlap == "delayed":
            clip["delay_after"] = cfg.delay_after
        opt = HybridAdamW(
            model.named_parameters(),
            offload_fraction=fraction,
            **chosen,
            min_offload_numel=cfg.min_offload_numel,
            overlap=cfg.overlap,
            state_dtype=cfg.state_dtype,
            master_weights=True if cfg.master_weights == "fp32" else cfg.master_weights,
            **clip,
            **kwargs,
        )
        if cfg.overlap == "delayed":
            opt.watch(model)  # model.state_dict() sees the weights that match the masters
    return model, opt


def train_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_clip: float = 1.0,
    before_step: DelayedSchedule | None = None,
) -> torch.Tensor:
    """One forward, backward, optional grad clipping (torch's, unless the optimizer clips:
    ``max_grad_norm``), ``opt.step()`` and ``zero_grad``. ``before_step``: its ``publish()``
    runs just before ``opt.step()`` (:class:`DelayedSchedule`).

    ``x``, ``y``: (batch, seq) int64 on the model's device. Returns the detached 0-dim fp32
    loss on the device: this function adds no host sync and no device-to-host copy of its own
    (``.item()`` would show as a pageable D2H copy in a profile); the optimizer may sync.
    """
    _, loss = model(x, y)
    loss.backward()
    if grad_clip > 0 and getattr(opt, "max_grad_norm", None) is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # stays on the device
    if before_step is not None:
        before_step.publish()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


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

    Step times bracket the batch fetch and ``train_step`` with ``torch.cuda.synchronize()`` on
    CUDA. Memory figures are in GB = 1e9 bytes.
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
    # the checkpoint and the data before the model: bad input fails in a second, not after a build
    resume = load_checkpoint(cfg.resume, cfg) if cfg.resume is not None else None
    if cfg.mock_data:
        data = mock_data(PRESETS[cfg.preset].vocab_size)
    else:
        data = checks.text_data(cfg.data, cfg.seq_len)
    log.info(f"data: {data.description}")
    log.info(f"data: byte unigram entropy {data.entropy_nats:.4f} nats (held-out loss should "
             "end below)")  # fmt: skip

    model, opt = make_model_and_optimizer(cfg)
    n_params = getattr(model, "module", model).num_params()  # DDP wraps; FSDP2 does not
    tokens_per_step = cfg.batch_size * cfg.seq_len  # per rank
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
        + f" | batch {cfg.batch_size} x {cfg.seq_len} = {tokens_per_step:,} tokens/step"
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
            raise checks.UsageError(f"--resume: {e}") from None
        log.info(f"loaded: {cfg.resume} in {time.perf_counter() - t:.2f} s")
        schedule.resume(resume.get("delayed_weights", {}), cfg.resume)
        gen.set_state(resume["generator"])
        torch.set_rng_state(resume["torch_rng"])
        start, first_loss = resume["step"] + 1, resume["first_train_loss"]
        log.info(f"resumed: {cfg.resume} at step {resume['step']}, continuing at step {start}")
        del resume
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
            x, y = get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, device)
            loss = train_step(model, opt, x, y, cfg.grad_clip, before_step=schedule)
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
                    f"{step_ms[-1]:8.1f} ms | {tokens_per_step / step_ms[-1] * 1e3:10,.0f} tok/s"
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
                t = time.perf_counter()
                nbytes = save_checkpoint(cfg.save, cfg, step, model, opt, gen, first_loss, stale)
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
        "lr": cfg.lr,
        "data": data.description,
        "first_train_loss": first_loss,
        "final_train_loss": train_loss,
        "final_heldout_loss": val_loss,
        "entropy_nats": data.entropy_nats,
        "heldout_below_entropy": bool(val_loss < data.entropy_nats),
        "median_step_ms": median_ms,
        "tokens_per_s": tokens_per_step / median_ms * 1e3,
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / gb if cuda else 0.0,
        "host_rss_gb": host_rss_nbytes() / gb,
        "optimizer_host_gb": getattr(opt, "host_nbytes", 0) / gb,
        "optimizer_pinned_gb": getattr(opt, "pinned_nbytes", 0) / gb,
        "wall_s": time.perf_counter() - t_start,
        "torch": torch.__version__,
        "parallel": cfg.parallel,
        "world_size": ranks.world,
    }
    if ranks.initialized:
        summary.update(per_rank(opt, summary, ranks, tokens_per_step))
    if hasattr(opt, "close"):
        opt.close()  # the worker thread ends here, not in the interpreter's shutdown
    return summary


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
