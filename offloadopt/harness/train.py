"""The main job: train a GPT-2 preset on real text and show what the optimizer costs.

``python -m offloadopt train`` (no options) trains the tiny preset on CPython's pydoc text
on the CPU in about a minute and ends with a held-out loss well below the text's byte unigram
entropy, the sign that the optimizer really trains. Per logged step it prints one fixed-width
line (loss, held-out loss, step time, tokens/s, GPU peak memory, host RSS, optimizer pinned
memory), shows a progress bar on stderr, and ends with one JSON line.

``make_model_and_optimizer`` and ``train_step`` are the pieces a benchmark reuses.
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
) -> torch.Tensor:
    """One forward, backward, optional grad clipping (torch's, unless the optimizer clips:
    ``max_grad_norm``), ``opt.step()`` and ``zero_grad``.

    ``x``, ``y``: (batch, seq) int64 on the model's device. Returns the detached 0-dim fp32
    loss on the device: this function adds no host sync and no device-to-host copy of its own
    (``.item()`` would show as a pageable D2H copy in a profile); the optimizer may sync.
    """
    _, loss = model(x, y)
    loss.backward()
    if grad_clip > 0 and getattr(opt, "max_grad_norm", None) is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # stays on the device
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


def host_rss_nbytes() -> int:
    """Resident set size of this process in bytes (psutil, else /proc/self/status; 0 if neither)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB, meaning KiB
    except OSError:
        pass
    return 0


def train(cfg: TrainConfig) -> dict:
    """Train, log, and return the summary that is printed as the last (JSON) line.

    Step times bracket the batch fetch and ``train_step`` with ``torch.cuda.synchronize()`` on
    CUDA. Memory figures are in GB = 1e9 bytes.
    """
    cfg = cfg.resolved()
    ranks = init_from_env(cfg.device) if cfg.parallel != "none" else Dist()
    if ranks.initialized and torch.device(cfg.device).type == "cuda":
        cfg = replace(cfg, device=f"cuda:{ranks.local_rank}")  # this rank's GPU
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    say = print if ranks.main else (lambda *a, **k: None)  # rank 0 speaks for the job
    # the data before the model: a missing or short file fails in a second, not after a build
    if cfg.mock_data:
        data = mock_data(PRESETS[cfg.preset].vocab_size)
    else:
        data = checks.text_data(cfg.data, cfg.seq_len)
    say(f"data: {data.description}")
    say(f"data: byte unigram entropy {data.entropy_nats:.4f} nats (held-out loss should end below)")

    model, opt = make_model_and_optimizer(cfg)
    n_params = getattr(model, "module", model).num_params()  # DDP wraps; FSDP2 does not
    tokens_per_step = cfg.batch_size * cfg.seq_len  # per rank
    on = (
        f"{device}"
        if not ranks.initialized
        else f"{device.type} x {ranks.world} ranks ({cfg.parallel})"
    )
    say(
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
        + f" | batch {cfg.batch_size} x {cfg.seq_len} = {tokens_per_step:,} tokens/step"
        + (" per rank" if ranks.initialized else "")
        + f" | {cfg.steps} steps, lr {cfg.lr:g}"
        + (" | activation checkpointing" if cfg.checkpointing else "")
    )
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

    gen = torch.Generator().manual_seed((cfg.seed + 7919 * ranks.rank) % 2**63)  # own batches
    step_ms: list[float] = []
    first_loss = train_loss = val_loss = float("nan")
    gb = 1e9
    t_start = time.perf_counter()
    said_choice = None  # the optimizer's placement choice last printed
    bar = tqdm(range(1, cfg.steps + 1), desc="train", file=sys.stderr,
               disable=not (cfg.progress and ranks.main))  # fmt: skip
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        if cuda:
            torch.cuda.synchronize(device)  # the timed window starts with an idle GPU
        t0 = time.perf_counter()
        x, y = get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, device)
        loss = train_step(model, opt, x, y, cfg.grad_clip)
        if cuda:
            torch.cuda.synchronize(device)  # the window ends when the step's GPU work is done
        step_ms.append((time.perf_counter() - t0) * 1e3)
        train_loss = to_host(loss)
        if step == 1:
            first_loss = train_loss
        evaluated = step % cfg.eval_every == 0 or step == cfg.steps
        if evaluated:
            if hasattr(opt, "synchronize"):
                opt.synchronize()  # delayed: evaluate the newest weights (copied in now)
            val_loss = to_host(evaluate(model, data, cfg))
        if ranks.main and (step % cfg.log_every == 0 or step in (1, cfg.steps) or evaluated):
            peak_gpu = torch.cuda.max_memory_allocated(device) / gb if cuda else 0.0
            pinned = getattr(opt, "pinned_nbytes", 0) / gb
            val = f"{val_loss:6.4f}" if evaluated else f"{'-':>6}"
            tqdm.write(
                f"step {step:6d}/{cfg.steps} | loss {train_loss:6.4f} | held-out {val} | "
                f"{step_ms[-1]:8.1f} ms | {tokens_per_step / step_ms[-1] * 1e3:10,.0f} tok/s | "
                f"gpu {peak_gpu:6.2f} GB | rss {host_rss_nbytes() / gb:6.2f} GB | "
                f"pinned {pinned:6.2f} GB",
                file=sys.stdout,
            )
            sys.stdout.flush()  # a log redirected to a file keeps every line if the job is killed
        choice = getattr(opt, "placement_choice", None)
        if ranks.main and choice is not None and choice != said_choice:
            said_choice = dict(choice)
            tqdm.write(describe_choice(choice), file=sys.stdout)
        bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)
    bar.close()

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
        "delay_after": cfg.delay_after,
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


def describe_choice(choice: dict) -> str:
    """One line of what chose the offload fraction (``HybridAdamW.placement_choice``)."""
    gb = 1e9
    line = f"placement: offload fraction {choice['fraction']:g}"
    if "max_gpu_memory" in choice:
        line += (f" | max_gpu_memory {choice['max_gpu_memory'] / gb:.2f} GB: device "
                 f"{choice['predicted_gpu_bytes'] / gb:.2f} GB predicted, host "
                 f"{choice['host_bytes'] / gb:.2f} GB")  # fmt: skip
    if "kept" in choice:
        line += f" | auto kept it: {choice['kept']}"
    elif choice.get("set_by") == "auto":
        measured = choice.get("measured_step_ms")
        line += (f" | auto: probe {choice['probe_fraction']:g} at "
                 f"{choice['probe_measured_step_ms']:.1f} ms/step; predicted "
                 f"{choice['predicted_step_ms']:.1f} ms/step (fraction 0: "
                 f"{choice['predicted_step_ms_at_0']:.1f})")  # fmt: skip
        line += f", measured {measured:.1f}" if measured is not None else ", measuring"
        moves = choice.get("corrections") or []
        if moves:
            line += " | corrected from " + ", ".join(
                f"{c['fraction']:g} ({c['measured_step_ms']:.1f} ms)" for c in moves
            )
    return line


def per_rank(opt, summary: dict, ranks: Dist, tokens_per_step: int) -> dict:
    """Each rank's figures (gathered on every rank) and the job's totals: host bytes add up
    over ranks, tokens/s too (each rank trains on its own batches)."""
    import torch.distributed as dist

    stats = getattr(opt, "stats", {})
    mine = {
        "rank": ranks.rank,
        "median_step_ms": summary["median_step_ms"],
        "peak_gpu_gb": summary["peak_gpu_gb"],
        "host_rss_gb": host_rss_nbytes() / 1e9,
        "host_state_nbytes": getattr(opt, "host_nbytes", 0),
        "pinned_nbytes": getattr(opt, "pinned_nbytes", 0),
        "cpu_threads": int(stats.get("cpu_threads", 0)),
        "local_ranks": int(stats.get("local_ranks", ranks.local_world)),
    }
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, mine)
    slowest = max(r["median_step_ms"] for r in everyone)  # the job steps at its slowest rank
    return {
        "ranks": everyone,
        "tokens_per_s": tokens_per_step * ranks.world / slowest * 1e3,
        "tokens_per_s_per_rank": tokens_per_step / slowest * 1e3,
        "optimizer_host_gb": sum(r["host_state_nbytes"] for r in everyone) / 1e9,
        "optimizer_pinned_gb": sum(r["pinned_nbytes"] for r in everyone) / 1e9,
    }


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
