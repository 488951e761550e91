"""The endurance run's two trainings (tests/long/endurance.py): HybridAdamW checked by the
oracle at every step (:func:`run_endurance`) and ``torch.optim.AdamW(fused=True)`` with
nothing offloaded (:func:`run_reference`), on the same small GPT, text, init, batches,
clipping and lr schedule for a seed; each returns its timings, losses (nats) and, for the
endurance run, the checks' counts and memory samples.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
from endurance_checks import Oracle, flatness, sample
from tqdm import tqdm

from offloadopt import HybridAdamW
from offloadopt.harness.data import TokenData, get_batch
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.harness.train import DTYPES, TrainConfig, lr_at

BETAS = (0.9, 0.95)  # as offloadopt.harness.train.make_model_and_optimizer
SMOOTH_FRACTION = 0.1  # smoothed loss: mean over the last 10% of the steps
EVAL_SEED = 1  # held-out batches: one generator seed for every run, so the losses compare


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(cfg: TrainConfig) -> GPT:
    """The preset's model on ``cfg.device`` in ``cfg.dtype``, seeded by ``cfg.seed``, exactly
    as ``offloadopt.harness.train.make_model_and_optimizer`` builds it."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    with device:
        model = GPT(PRESETS[cfg.preset])
    return model.to(dtype=DTYPES[cfg.dtype])


@torch.no_grad()
def heldout_loss(model: GPT, data: TokenData, cfg: TrainConfig) -> float:
    """Mean loss (nats) over ``cfg.eval_batches`` held-out batches, the same batches for every
    run and seed (generator seed ``EVAL_SEED``)."""
    model.eval()
    gen = torch.Generator().manual_seed(EVAL_SEED)
    losses = [
        model(*get_batch(data, "heldout", cfg.batch_size, cfg.seq_len, gen, cfg.device))[1]
        for _ in range(cfg.eval_batches)
    ]
    model.train()
    return float(torch.stack(losses).mean())


def loss_summary(losses: list[float]) -> dict:
    """Final and smoothed (mean of the last ``SMOOTH_FRACTION`` of the steps, at least one)
    train loss, in nats."""
    tail = losses[-max(1, math.ceil(len(losses) * SMOOTH_FRACTION)) :]
    return {
        "final_train_loss_nats": losses[-1],
        "smoothed_train_loss_nats": statistics.fmean(tail),
        "smoothed_over_steps": len(tail),
    }


def set_lr(opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> None:
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)


def run_endurance(cfg: TrainConfig, data: TokenData, sample_every: int, progress: bool) -> dict:
    """The endurance run (see the module docstring): per-step timings, the lockstep check,
    memory samples, losses."""
    device = torch.device(cfg.device)
    model = build_model(cfg)
    named = list(model.named_parameters())
    opt = HybridAdamW(
        named,
        lr=cfg.lr,
        betas=BETAS,
        weight_decay=cfg.weight_decay,
        offload_fraction=cfg.offload_fraction,
        min_offload_numel=cfg.min_offload_numel,
        flush_denormal=False,  # the oracle runs on the training thread, without flush-to-zero
    )
    oracle = Oracle(opt, named)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    params = [p for _, p in named]
    step_ms: list[float] = []
    oracle_ms: list[float] = []
    compare_ms: list[float] = []
    # Losses land in one preallocated buffer on the device: no sync, and no small tensor kept
    # per step (on the CPU such survivors among the freed activations grew the RSS ~1 MB/step).
    losses = torch.zeros(cfg.steps, dtype=torch.float32, device=device)
    samples: list[dict] = []
    mismatch_steps, first_mismatch = 0, None
    weight_checks, weight_mismatch_samples, first_weight_mismatch = 0, 0, None
    t_start = time.perf_counter()
    bar = tqdm(
        range(1, cfg.steps + 1),
        desc="endurance",
        file=sys.stderr,
        disable=None if progress else True,
    )
    for step in bar:
        set_lr(opt, cfg, step)
        _sync(device)
        t0 = time.perf_counter()
        x, y = get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, device)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        _sync(device)
        t1 = time.perf_counter()
        grads = oracle.capture()  # blocking: not part of the step's time
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        oracle.step(grads)
        del grads
        t4 = time.perf_counter()
        bad = oracle.compare()
        t5 = time.perf_counter()
        step_ms.append((t1 - t0 + t3 - t2) * 1e3)
        oracle_ms.append((t2 - t1 + t4 - t3) * 1e3)
        compare_ms.append((t5 - t4) * 1e3)
        losses[step - 1] = loss.detach()
        if bad:
            mismatch_steps += 1
            if first_mismatch is None:
                first_mismatch = {"step": step, "mismatches": bad[:20], "count": len(bad)}
            oracle.resync()
        if step % sample_every == 0 or step == cfg.steps:
            s = sample(step, opt, device, float(losses[step - 1]))
            samples.append(s)
            weight_checks += 1
            wrong = oracle.weights_mismatching()  # after the sample: its temporaries come later
            if wrong:
                weight_mismatch_samples += 1
                if first_weight_mismatch is None:
                    first_weight_mismatch = {"step": step, "params": wrong[:20]}
            bar.set_postfix(loss=f"{s['train_loss_nats']:.3f}", mismatches=mismatch_steps)
    bar.close()
    train_s = time.perf_counter() - t_start
    heldout = heldout_loss(model, data, cfg)
    timed = step_ms[1:] or step_ms  # the first step pays for lazy state and warm-up
    out = {
        "optimizer": "HybridAdamW",
        "seed": cfg.seed,
        "offload_fraction": cfg.offload_fraction,
        "params": model.num_params(),
        "param_tensors": len(params),
        "offloaded_param_tensors": len(oracle.params),
        "offloaded_numel": oracle.numel,
        "offloaded_params": oracle.names,
        "steps": cfg.steps,
        "step_ms_median": statistics.median(timed),
        "step_ms_p90": _quantile(timed, 0.9),
        "step_ms_max": max(timed),
        "first_step_ms": step_ms[0],
        "oracle_ms_median": statistics.median(oracle_ms),
        "compare_ms_median": statistics.median(compare_ms),
        "train_s": train_s,
        "mismatch_steps": mismatch_steps,
        "first_mismatch": first_mismatch,
        "weight_checks": weight_checks,
        "weight_mismatch_samples": weight_mismatch_samples,
        "first_weight_mismatch": first_weight_mismatch,
        "samples": samples,
        "flatness": flatness(samples, cfg.steps),
        "heldout_loss_nats": heldout,
        "train_losses_nats": losses.cpu().tolist(),
    }
    out.update(loss_summary(out["train_losses_nats"]))
    opt.close()
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_reference(cfg: TrainConfig, data: TokenData, masters: bool, progress: bool) -> dict:
    """The same training with ``torch.optim.AdamW(fused=True)``, nothing offloaded: same init,
    batches, clipping and schedule for ``cfg.seed``. With ``masters`` and a low-precision
    model, torch's AdamW steps fp32 copies of the params on the device (grads upcast) and the
    weights are their rounding, as HybridAdamW does at fraction 0."""
    device = torch.device(cfg.device)
    model = build_model(cfg)
    params = list(model.parameters())
    masters = masters and any(p.dtype != torch.float32 for p in params)
    stepped = [p.detach().float().clone() for p in params] if masters else params
    opt = torch.optim.AdamW(
        stepped, lr=cfg.lr, betas=BETAS, weight_decay=cfg.weight_decay, fused=True
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = torch.zeros(cfg.steps, dtype=torch.float32, device=device)
    step_ms: list[float] = []
    t_start = time.perf_counter()
    bar = tqdm(
        range(1, cfg.steps + 1),
        desc=f"ref seed {cfg.seed}",
        file=sys.stderr,
        disable=None if progress else True,
    )
    for step in bar:
        set_lr(opt, cfg, step)
        _sync(device)
        t0 = time.perf_counter()
        x, y = get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, device)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if masters:
            for m, p in zip(stepped, params, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
        opt.step()
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(params, stepped)  # weights = round(master)
            opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        _sync(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses[step - 1] = loss.detach()
    bar.close()
    out = {
        "optimizer": "torch.optim.AdamW(fused=True)",
        "seed": cfg.seed,
        "offload_fraction": 0.0,
        "fp32_masters": masters,
        "step_ms_median": statistics.median(step_ms[1:] or step_ms),
        "train_s": time.perf_counter() - t_start,
        "heldout_loss_nats": heldout_loss(model, data, cfg),
        "train_losses_nats": losses.cpu().tolist(),
    }
    out.update(loss_summary(out["train_losses_nats"]))
    return out
