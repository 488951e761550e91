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
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from offloadopt.harness.data import TokenData, get_batch, load_text, mock_data
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.optim import HybridAdamW

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Per-preset (batch_size, peak lr) used when --batch-size / --lr are not given. The GPT-2
# learning rates are GPT-3's for those sizes (Brown et al. 2020, table 2.1); the GPT-2 batch
# sizes fit one 141 GB H200 in bf16 at 1024 tokens (DESIGN.md section 2 uses 4 x 1024 for xl).
RUN_DEFAULTS: dict[str, tuple[int, float]] = {
    "tiny": (16, 3e-3),
    "small": (32, 1e-3),
    "gpt2": (8, 6e-4),
    "gpt2-medium": (8, 3e-4),
    "gpt2-large": (4, 2.5e-4),
    "gpt2-xl": (4, 2e-4),
}


@dataclass
class TrainConfig:
    device: str = "cpu"  # "cpu" or "cuda" (or "cuda:N")
    preset: str = "tiny"  # a key of gpt.PRESETS
    optimizer: str = "hybrid"  # "hybrid" (HybridAdamW) or "adamw" (torch.optim.AdamW(fused=True))
    offload_fraction: float = 1.0  # HybridAdamW: share of optimizer-state bytes kept on the host
    min_offload_numel: int = 4096  # HybridAdamW: params with fewer elements stay on the device
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

    def resolved(self) -> TrainConfig:
        """A copy with every None default filled in; raises ValueError on a bad setting."""
        if self.preset not in PRESETS:
            raise ValueError(f"Invalid preset: {self.preset!r} (one of {', '.join(PRESETS)})")
        if self.optimizer not in ("hybrid", "adamw"):
            raise ValueError(f"Invalid optimizer: {self.optimizer!r} (hybrid or adamw)")
        dev = torch.device(self.device)
        dtype = self.dtype or ("bf16" if dev.type == "cuda" else "fp32")
        if dtype not in DTYPES:
            raise ValueError(f"Invalid dtype: {dtype!r} (one of {', '.join(DTYPES)})")
        batch, lr = RUN_DEFAULTS[self.preset]
        cfg = replace(
            self,
            dtype=dtype,
            batch_size=batch if self.batch_size is None else self.batch_size,
            seq_len=PRESETS[self.preset].block_size if self.seq_len is None else self.seq_len,
            lr=self.lr if self.lr is not None else lr,
            warmup_steps=self.warmup_steps if self.warmup_steps is not None else self.steps // 20,
        )
        if cfg.warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: {cfg.warmup_steps} (must be >= 0)")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"Invalid {name}: {getattr(cfg, name)} (must be >= 1)")
        if cfg.seq_len > PRESETS[self.preset].block_size:
            raise ValueError(
                f"seq_len {cfg.seq_len} > block_size {PRESETS[self.preset].block_size}"
            )
        return cfg


def lr_at(step: int, lr: float, warmup_steps: int, steps: int) -> float:
    """Learning rate of 1-based ``step``: linear warm-up to ``lr``, then cosine decay to lr / 10."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def make_model_and_optimizer(cfg: TrainConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """The preset's model on ``cfg.device`` in ``cfg.dtype`` (seeded init) and its optimizer.

    The model is built directly on the device (no fp32 CPU copy of a 1.5B model). ``cfg`` must
    be resolved (``TrainConfig.resolved()``).
    """
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    with device:
        model = GPT(PRESETS[cfg.preset])
    model.to(dtype=DTYPES[cfg.dtype])
    kwargs = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
    else:
        opt = HybridAdamW(
            model.named_parameters(),
            offload_fraction=cfg.offload_fraction,
            min_offload_numel=cfg.min_offload_numel,
            **kwargs,
        )
    return model, opt


def train_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_clip: float = 1.0,
) -> torch.Tensor:
    """One forward, backward, optional grad clipping, ``opt.step()`` and ``zero_grad``.

    ``x``, ``y``: (batch, seq) int64 on the model's device. Returns the detached 0-dim fp32
    loss on the device: this function adds no host sync and no device-to-host copy of its own
    (``.item()`` would show as a pageable D2H copy in a profile); the optimizer may sync.
    """
    _, loss = model(x, y)
    loss.backward()
    if grad_clip > 0:
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
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    data = mock_data(PRESETS[cfg.preset].vocab_size) if cfg.mock_data else load_text(cfg.data)
    print(f"data: {data.description}")
    print(
        f"data: byte unigram entropy {data.entropy_nats:.4f} nats (held-out loss should end below)"
    )

    model, opt = make_model_and_optimizer(cfg)
    n_params = model.num_params()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    print(
        f"model: {cfg.preset}, {n_params / 1e6:.2f}M params, {cfg.dtype} on {device} | "
        f"optimizer: {cfg.optimizer}"
        + (f" (offload_fraction {cfg.offload_fraction})" if cfg.optimizer == "hybrid" else "")
        + f" | batch {cfg.batch_size} x {cfg.seq_len} = {tokens_per_step:,} tokens/step"
        + f" | {cfg.steps} steps, lr {cfg.lr:g}"
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

    gen = torch.Generator().manual_seed(cfg.seed)
    step_ms: list[float] = []
    first_loss = train_loss = val_loss = float("nan")
    gb = 1e9
    t_start = time.perf_counter()
    bar = tqdm(range(1, cfg.steps + 1), desc="train", file=sys.stderr, disable=not cfg.progress)
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
            val_loss = to_host(evaluate(model, data, cfg))
        if step % cfg.log_every == 0 or step in (1, cfg.steps) or evaluated:
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
        "offload_fraction": cfg.offload_fraction if cfg.optimizer == "hybrid" else 0.0,
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
    }
    return summary


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` options (``--kebab-case``, one per TrainConfig field) to ``parser``."""
    d = TrainConfig()
    a = parser.add_argument
    a("--device", default=d.device, help="cpu or cuda[:N] (default: %(default)s)")
    a("--preset", default=d.preset, choices=list(PRESETS), help="model size (default: %(default)s)")
    a(
        "--optimizer",
        default=d.optimizer,
        choices=["hybrid", "adamw"],
        help="hybrid: HybridAdamW; adamw: torch.optim.AdamW(fused=True) (default: %(default)s)",
    )
    a(
        "--offload-fraction",
        type=float,
        default=d.offload_fraction,
        help="HybridAdamW: share of optimizer-state bytes on the host, 0..1 (default: %(default)s)",
    )
    a(
        "--min-offload-numel",
        type=int,
        default=d.min_offload_numel,
        help="HybridAdamW: params with fewer elements stay on the device (default: %(default)s)",
    )
    a("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    a(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per step (default: per preset, 16 for tiny)",
    )
    a(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the preset's block_size)",
    )
    a(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: per preset, 3e-3 for tiny)",
    )
    a(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warm-up steps before cosine decay to lr/10 (default: steps/20)",
    )
    a(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="AdamW weight decay (default: %(default)s)",
    )
    a(
        "--grad-clip",
        type=float,
        default=d.grad_clip,
        help="max global grad norm, 0 = off (default: %(default)s)",
    )
    a(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of model init and batches (default: %(default)s)",
    )
    a(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="model param dtype (default: fp32 on cpu, bf16 on cuda)",
    )
    a(
        "--data",
        default=None,
        metavar="FILE",
        help="text file, read as bytes (default: CPython's pydoc_data.topics)",
    )
    a("--mock-data", action="store_true", help="uniform random tokens: loss stays at ln(vocab)")
    a(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="held-out evaluation every N steps, and at the last (default: %(default)s)",
    )
    a(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help="batches per held-out evaluation (default: %(default)s)",
    )
    a(
        "--log-every",
        type=int,
        default=d.log_every,
        help="one log line every N steps (default: %(default)s)",
    )
    a("--no-progress", action="store_true", help="no tqdm progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed ``add_train_args`` options."""
    fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig(**fields, progress=not args.no_progress)


def run(args: argparse.Namespace) -> int:
    """``offloadopt train``: train, then print the summary as the last line (JSON)."""
    summary = train(config_from_args(args))
    print(json.dumps(summary), flush=True)
    return 0
