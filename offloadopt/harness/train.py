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
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from offloadopt.adamw import HybridAdamW
from offloadopt.harness import checks
from offloadopt.harness.checks import UsageError
from offloadopt.harness.data import TokenData, get_batch, mock_data
from offloadopt.harness.distributed import Dist, init_from_env, shard_fsdp, teardown, wrap_ddp
from offloadopt.harness.gpt import GPT, PRESETS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZERS = ("hybrid", "adamw")
# The modes the main job offers: step and delayed clip with torch's clip_grad_norm_; backward
# clips through the optimizer (max_grad_norm), or declares grads final with --grad-clip 0.
OVERLAPS = ("step", "backward", "delayed")
PARALLELS = ("none", "fsdp", "ddp")  # under torchrun: FSDP2 (fully_shard per block) or DDP

# Per-preset (batch_size, peak lr) used when --batch-size / --lr are not given. The GPT-2
# learning rates are GPT-3's for those sizes (Brown et al. 2020, table 2.1); the GPT-2 batch
# sizes fit one 141 GB H200 in bf16 at 1024 tokens (benchmarks/RESULTS.md uses 4 x 1024 for xl).
RUN_DEFAULTS: dict[str, tuple[int, float]] = {
    "tiny": (16, 3e-3),
    "small": (32, 1e-3),
    "gpt2": (8, 6e-4),
    "gpt2-medium": (8, 3e-4),
    "gpt2-large": (4, 2.5e-4),
    "gpt2-xl": (4, 2e-4),
    # width 4096, one sequence a step (activation checkpointing): Adam's first steps move every
    # weight by about lr at once, and on the GPU host (2026-12-01, 10 warm-up steps) 1e-4 and
    # 2e-5 spiked gpt-17.5b's loss from 6.2 to 31 and 21 at step 2, 6e-6 gpt-9b's to 9.2 at
    # step 6; at 2e-6 gpt-9b's fell from 5.2 to 3.9 in 20 steps
    "gpt-9b": (1, 2e-6),
    "gpt-13b": (1, 2e-6),
    "gpt-17.5b": (1, 2e-6),
    "gpt-18b": (1, 2e-6),
}


@dataclass
class TrainConfig:
    device: str = "cpu"  # "cpu" or "cuda" (or "cuda:N")
    preset: str = "tiny"  # a key of gpt.PRESETS
    optimizer: str = "hybrid"  # "hybrid" (HybridAdamW) or "adamw" (torch.optim.AdamW(fused=True))
    offload_fraction: float | str = (
        1.0  # HybridAdamW: host share of optimizer-state bytes, or "auto"
    )
    min_offload_numel: int = 4096  # HybridAdamW: params with fewer elements stay on the device
    overlap: str = (
        "step"  # HybridAdamW: "step", "backward" (updates start in backward) or "delayed"
    )
    release_grads: bool = (
        False  # HybridAdamW, overlap "backward": free offloaded grads as they land
    )
    delay_after: int = 0  # HybridAdamW, overlap "delayed": synchronous steps before the delay
    checkpointing: bool = False  # activation checkpointing per block (recomputed in backward)
    steps: int = 300  # optimizer steps
    batch_size: int | None = None  # sequences per step; None: RUN_DEFAULTS[preset]
    seq_len: int | None = None  # tokens per sequence; None: the preset's block_size
    lr: float | None = None  # peak learning rate; None: RUN_DEFAULTS[preset]
    warmup_steps: int | None = None  # linear warm-up steps, then cosine to lr/10; None: steps/20
    weight_decay: float = 0.1  # AdamW decoupled weight decay, applied to every param
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    seed: int = 0  # seeds the model init and the batch sampler
    dtype: str | None = None  # "fp32" or "bf16" model params; None: fp32 on CPU, bf16 on CUDA
    data: str | None = None  # text file read as bytes; None: CPython's pydoc_data.topics
    mock_data: bool = False  # uniform random tokens instead of text (the loss stays at ln(vocab))
    eval_every: int = 100  # held-out evaluation every this many steps (and at the last step)
    eval_batches: int = 8  # batches per held-out evaluation (the same batches every time)
    log_every: int = 25  # one log line every this many steps (and at the first and last step)
    progress: bool = True  # tqdm progress bar on stderr
    parallel: str = "none"  # "fsdp" (FSDP2) or "ddp" under torchrun; "none": one process
    max_gpu_memory: int | None = None  # HybridAdamW: a GPU budget (bytes); it picks the fraction

    def resolved(self) -> TrainConfig:
        """A checked copy with every None default filled in.

        Raises:
            UsageError (a ValueError): a bad setting, named by its ``--flag``; see
                ``FIELD_CHECKS`` and, across fields, ``seq_len`` <= the preset's block_size.
        """
        for name, choices in (("preset", PRESETS), ("optimizer", OPTIMIZERS), ("dtype", DTYPES),
                              ("overlap", OVERLAPS), ("parallel", PARALLELS)):  # fmt: skip
            value = getattr(self, name)
            known = isinstance(value, str) and value in choices
            if not known and not (name == "dtype" and value is None):
                raise UsageError(f"--{name}: {value!r} is not one of {', '.join(choices)}")
        checked = {
            name: checks.check(f"--{name.replace('_', '-')}", getattr(self, name), check)
            for name, check in FIELD_CHECKS.items()
            if getattr(self, name) is not None
        }
        cfg = replace(self, **checked)
        batch, lr = RUN_DEFAULTS[cfg.preset]
        block_size = PRESETS[cfg.preset].block_size
        cfg = replace(
            cfg,
            dtype=cfg.dtype or ("bf16" if torch.device(cfg.device).type == "cuda" else "fp32"),
            batch_size=batch if cfg.batch_size is None else cfg.batch_size,
            seq_len=block_size if cfg.seq_len is None else cfg.seq_len,
            lr=lr if cfg.lr is None else cfg.lr,
            warmup_steps=cfg.steps // 20 if cfg.warmup_steps is None else cfg.warmup_steps,
        )
        if cfg.max_gpu_memory is not None and cfg.offload_fraction not in ("auto", 1.0):
            raise UsageError(
                f"--offload-fraction {cfg.offload_fraction:g} with --max-gpu-memory: the budget "
                "chooses the fraction; give one, or --offload-fraction auto"
            )
        if cfg.max_gpu_memory is not None and cfg.optimizer != "hybrid":
            raise UsageError(
                f"--max-gpu-memory: HybridAdamW's option; --optimizer {cfg.optimizer} keeps "
                "everything on the device"
            )
        if cfg.delay_after and cfg.overlap != "delayed":
            raise UsageError(
                f"--delay-after: the synchronous steps before the delayed update, so it needs "
                f"--overlap delayed (not {cfg.overlap!r})"
            )
        if cfg.release_grads and cfg.overlap != "backward":
            raise UsageError(
                f"--release-grads: frees grads during backward, so it needs --overlap backward "
                f"(not {cfg.overlap!r})"
            )
        if cfg.offload_fraction == "auto" and cfg.optimizer != "hybrid":
            raise UsageError(
                f"--offload-fraction auto: HybridAdamW's option; --optimizer {cfg.optimizer} "
                "keeps everything on the device"
            )
        if cfg.offload_fraction == "auto" and cfg.overlap == "delayed" and not cfg.max_gpu_memory:
            raise UsageError(  # HybridAdamW refuses it too, but only once the data is loaded
                "--offload-fraction auto with --overlap delayed: the fraction decides which "
                "params train on weights one step old, so one chosen from timings would make "
                "the results depend on them; give a number (1.0 is the delayed update's usual "
                "one), or a --max-gpu-memory budget"
            )
        d = TrainConfig()
        for flag, value, default in (
            ("--offload-fraction", cfg.offload_fraction, d.offload_fraction),
            ("--min-offload-numel", cfg.min_offload_numel, d.min_offload_numel),
        ):
            if cfg.optimizer != "hybrid" and value != default:
                raise UsageError(
                    f"{flag} {value}: HybridAdamW's option; --optimizer {cfg.optimizer} keeps "
                    "everything on the device (it would be ignored)"
                )
        if cfg.overlap != "step" and cfg.optimizer != "hybrid":
            raise UsageError(
                f"--overlap: {cfg.overlap!r} is HybridAdamW's mode; --optimizer {cfg.optimizer} "
                "has only 'step'"
            )
        if cfg.parallel != "none" and "WORLD_SIZE" not in os.environ:
            raise UsageError(
                f"--{cfg.parallel}: run under torchrun (torchrun --nproc-per-node N -m offloadopt "
                f"train --{cfg.parallel}); WORLD_SIZE is not set"
            )
        if cfg.seq_len > block_size:
            raise UsageError(
                f"--seq-len: {cfg.seq_len} is more than the {cfg.preset} preset's block_size "
                f"{block_size}"
            )
        if cfg.mock_data and cfg.data is not None:
            raise UsageError(
                f"--mock-data with --data {cfg.data}: random tokens replace the text (the file "
                "would be ignored); give one"
            )
        if cfg.delay_after >= cfg.steps and cfg.overlap == "delayed":
            raise UsageError(
                f"--delay-after: {cfg.delay_after} synchronous steps of --steps {cfg.steps} "
                "leave none delayed (--overlap delayed would never start)"
            )
        if cfg.warmup_steps > cfg.steps:
            raise UsageError(
                f"--warmup-steps: {cfg.warmup_steps} is more than --steps {cfg.steps} (the "
                "warm-up would never reach the peak --lr)"
            )
        return cfg


# The check of each TrainConfig field that has one: the --flag's argparse type, and
# TrainConfig.resolved()'s check of the values a Python caller gives.
FIELD_CHECKS = {
    "device": checks.device,
    "offload_fraction": checks.fraction_or_auto,
    "max_gpu_memory": checks.size,
    "min_offload_numel": checks.nonneg_int,
    "delay_after": checks.nonneg_int,
    "steps": checks.positive_int,
    "batch_size": checks.positive_int,
    "seq_len": checks.positive_int,
    "lr": checks.nonneg_float,
    "warmup_steps": checks.nonneg_int,
    "weight_decay": checks.nonneg_float,
    "grad_clip": checks.nonneg_float,
    "seed": checks.seed,
    "data": checks.input_file,
    "eval_every": checks.positive_int,
    "eval_batches": checks.positive_int,
    "log_every": checks.positive_int,
}


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


# --flag help, one per TrainConfig field; a field's type check is FIELD_CHECKS'
HELP = {
    "device": "cpu, cuda or cuda:N (default: %(default)s)",
    "preset": "model size (default: %(default)s)",
    "optimizer": "hybrid: HybridAdamW; adamw: torch.optim.AdamW(fused=True) (default: %(default)s)",
    "offload_fraction": "HybridAdamW: share of optimizer-state bytes on the host, 0..1, or auto: measured in the first steps and chosen (default: %(default)s)",
    "min_offload_numel": "HybridAdamW: params with fewer elements stay on the device (default: %(default)s)",
    "max_gpu_memory": "HybridAdamW: a GPU budget, bytes or 120GB / 112GiB; it picks the smallest fraction that fits, at the first step (with --offload-fraction auto: measured too)",
    "overlap": "HybridAdamW: step; backward: updates start during backward (clipping through the optimizer; --grad-clip 0: none, grads final); or delayed: the update runs during the next forward and backward, which read weights one step old (default: %(default)s)",
    "delay_after": "HybridAdamW, --overlap delayed: synchronous steps before the delay begins, as ZeRO-Offload does (default: %(default)s)",
    "steps": "optimizer steps (default: %(default)s)",
    "batch_size": "sequences per step (default: per preset, 16 for tiny)",
    "seq_len": "tokens per sequence (default: the preset's block_size)",
    "lr": "peak learning rate (default: per preset, 3e-3 for tiny)",
    "warmup_steps": "linear warm-up steps before cosine decay to lr/10 (default: steps/20)",
    "weight_decay": "AdamW weight decay (default: %(default)s)",
    "grad_clip": "max global grad norm, 0 = off (default: %(default)s)",
    "seed": "seed of model init and batches, 0 .. 2**63 - 1 (default: %(default)s)",
    "dtype": "model param dtype (default: fp32 on cpu, bf16 on cuda)",
    "data": "text file, read as bytes (default: CPython's pydoc_data.topics)",
    "eval_every": "held-out evaluation every N steps, and at the last (default: %(default)s)",
    "eval_batches": "batches per held-out evaluation (default: %(default)s)",
    "log_every": "one log line every N steps (default: %(default)s)",
}  # fmt: skip


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` options (``--kebab-case``, one per TrainConfig field) to ``parser``;
    each value is checked as it is parsed (``FIELD_CHECKS``), so a bad one is argparse's
    one-line error."""
    d = TrainConfig()
    choices = {"preset": list(PRESETS), "optimizer": list(OPTIMIZERS), "dtype": list(DTYPES),
               "overlap": list(OVERLAPS)}  # fmt: skip
    for name, help_text in HELP.items():
        kwargs = {"choices": choices[name]} if name in choices else {"type": FIELD_CHECKS[name]}
        metavar = {"metavar": "FILE"} if name == "data" else {}
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, default=getattr(d, name), help=help_text, **kwargs, **metavar)
    a = parser.add_argument
    a("--mock-data", action="store_true", help="uniform random tokens: loss stays at ln(vocab)")
    a(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing per block: activations are recomputed in backward",
    )
    a(
        "--release-grads",
        action="store_true",
        help="HybridAdamW, --overlap backward: free each offloaded grad once its copy lands on the host",
    )
    a("--no-progress", action="store_true", help="no tqdm progress bar on stderr")
    par = parser.add_mutually_exclusive_group()
    par.add_argument(
        "--fsdp",
        dest="parallel",
        action="store_const",
        const="fsdp",
        help="under torchrun: FSDP2 (fully_shard per block); the optimizer updates each rank's shard",
    )
    par.add_argument(
        "--ddp",
        dest="parallel",
        action="store_const",
        const="ddp",
        help="under torchrun: DDP; each rank keeps the whole optimizer state",
    )
    parser.set_defaults(parallel="none")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed ``add_train_args`` options."""
    fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig(**fields, progress=not args.no_progress)


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
