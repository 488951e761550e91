"""The main job's model and optimizer, built from its resolved config
(:func:`make_model_and_optimizer`); ``offloadopt/harness/train.py`` imports it back."""

from __future__ import annotations

import torch

from offloadopt.adamw import HybridAdamW
from offloadopt.harness.checks import UsageError
from offloadopt.harness.distributed import shard_fsdp, wrap_ddp
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.harness.options import TrainConfig
from offloadopt.place.budget import mem_available
from offloadopt.place.costmodel import format_bytes, parse_bytes

__all__ = ["DTYPES", "check_fits_device", "make_model_and_optimizer"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # options.DTYPE_NAMES' dtypes


def make_model_and_optimizer(cfg: TrainConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """The preset's model on ``cfg.device`` in ``cfg.dtype`` (seeded init) and its optimizer;
    with ``cfg.parallel`` the model is sharded by FSDP2 or wrapped in DDP (the process group
    must exist: :func:`offloadopt.harness.distributed.init_from_env`).

    The model is built directly on the device in its dtype (no fp32 copy, on the host or the
    device: a 17.5e9-param model in bf16 is 35 GB, in fp32 70). ``cfg`` must be resolved
    (``TrainConfig.resolved()``); that the model fits is :func:`check_fits_device`'s, which
    ``train`` runs before it loads the data.
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
        # backward mode starts each bucket from DDP's all-reduce (HybridAdamW's ddp=)
        model = wrap_ddp(model, bucket_view=cfg.optimizer == "hybrid" and cfg.overlap == "backward")
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
            if cfg.parallel == "ddp":  # a fresh user's finding: --ddp --overlap backward failed
                clip["ddp"] = model
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


def host_bytes_per_param(cfg: TrainConfig) -> int:
    """A run's bytes per param in one memory: its weights and grads in ``cfg.dtype``, and the
    optimizer's state (torch's AdamW: two moments in that dtype; HybridAdamW: fp32 masters of
    non-fp32 params unless bf16-sr, and two moments in ``--state-dtype``). Activations and
    staging are not counted: a lower bound."""
    size = DTYPES[cfg.dtype].itemsize
    if cfg.optimizer == "adamw":
        return 4 * size
    master = 4 if cfg.dtype != "fp32" and cfg.master_weights == "fp32" else 0
    return 2 * size + master + {"fp32": 8, "bf16": 4, "int8": 2}[cfg.state_dtype]


def check_fits_device(cfg: TrainConfig, device: torch.device, total: int | None = None) -> None:
    """Before the model is built: its weights alone (on the CPU, with its grads and optimizer
    state: :func:`host_bytes_per_param`), and the logits of one micro-batch (fp32,
    batch x sequence x vocabulary: a lower bound of the activations), must fit the device
    (``total``: its bytes; default: a GPU's memory, or on the CPU the host's MemAvailable),
    and ``--max-gpu-memory`` must not exceed a GPU's memory; otherwise the build or the first
    step runs out of memory after minutes (on the CPU the kernel's OOM killer ends it), or
    the budget cannot be kept. A ``--max-gpu-memory`` on a run without a GPU is refused: no
    GPU memory to budget (the CPU would stand in for the device, as in the tests, and the
    budget would choose a fraction that moves state from host memory to host memory). Raises
    UsageError with the figures."""
    if cfg.max_gpu_memory is not None and device.type != "cuda":
        why = "--device cpu" if torch.cuda.is_available() else "torch sees no CUDA device here"
        raise UsageError(
            f"--max-gpu-memory {format_bytes(parse_bytes(cfg.max_gpu_memory))}: a budget of GPU "
            f"memory, and this run has no GPU ({why}); leave it out, or run on a GPU with "
            "--device cuda"
        )
    if total is not None:
        name = str(device)
    elif device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        total, name = props.total_memory, f"{device} ({props.name})"
    elif device.type == "cpu" and (total := mem_available()) is not None:
        name = "the host (its MemAvailable)"
    else:
        return
    pc = PRESETS[cfg.preset]
    weights = pc.num_params() * DTYPES[cfg.dtype].itemsize
    if weights > total:
        raise UsageError(
            f"--preset {cfg.preset}: its weights alone are {format_bytes(weights)} in "
            f"{cfg.dtype}, more than {name} holds ({format_bytes(total)}); a smaller preset, "
            f"or {'a GPU' if device.type == 'cuda' else 'a machine'} with more memory"
        )
    if device.type == "cpu":  # the host holds everything: weights, grads and the state too
        per = host_bytes_per_param(cfg)
        if pc.num_params() * per > total:
            raise UsageError(
                f"--preset {cfg.preset}: its weights, grads and optimizer state are about "
                f"{format_bytes(pc.num_params() * per)}, {per} bytes a param in {cfg.dtype} "
                f"with --optimizer {cfg.optimizer}: more than {name} holds "
                f"({format_bytes(total)}); a smaller preset, compressed state "
                "(--state-dtype int8), or a machine with more memory"
            )
    seq, batch = cfg.seq_len or pc.block_size, cfg.batch_size or 1  # (resolved: both set)
    logits = batch * seq * pc.vocab_size * 4
    if logits > total:
        raise UsageError(
            f"--batch-size {batch}: one micro-batch's logits alone are "
            f"{format_bytes(logits)} ({batch} x {seq} tokens x {pc.vocab_size} "
            f"in fp32), more than {name} holds ({format_bytes(total)}); a smaller batch "
            "(--grad-accum keeps the tokens per step)"
        )
    if device.type == "cuda" and cfg.max_gpu_memory and parse_bytes(cfg.max_gpu_memory) > total:
        raise UsageError(
            f"--max-gpu-memory {cfg.max_gpu_memory}: more than {name} holds ({format_bytes(total)})"
        )
