"""The commands' configs and options, without importing torch: ``offloadopt --help`` builds
every parser from here (``train``'s and the names the commands share) and from
``bench_options.py`` (``bench``'s and ``audit``'s), so it starts at once. What runs a command
(``train``, ``bench``, ``audit_job``) imports torch when it runs, and imports these names back.

A default that depends on the machine (``--device``: cuda if torch sees one) is None here and
filled in when the command runs (``resolve_device``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import zipfile
from dataclasses import dataclass, replace

from offloadopt.harness import checks
from offloadopt.harness.checks import UsageError
from offloadopt.harness.presets import PRESETS, RUN_DEFAULTS

DTYPE_NAMES = ("fp32", "bf16")  # the model dtypes the commands take (torch.float32, bfloat16)


def resolve_device(device: str | None) -> str:
    """``device``, or when None: ``"cuda"`` if torch sees a CUDA device here, else ``"cpu"``
    (imports torch)."""
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --- train --------------------------------------------------------------------------------------

OPTIMIZERS = ("hybrid", "adamw")
STATE_DTYPES = ("fp32", "bf16", "int8")  # HybridAdamW(state_dtype=)
MASTERS = ("fp32", "bf16-sr")  # HybridAdamW(master_weights=True or "bf16-sr")
# The modes the main job offers: step and delayed clip with torch's clip_grad_norm_; backward
# clips through the optimizer (max_grad_norm), or declares grads final with --grad-clip 0.
OVERLAPS = ("step", "backward", "delayed")
PARALLELS = ("none", "fsdp", "ddp")  # under torchrun: FSDP2 (fully_shard per block) or DDP
# Steps --offload-fraction auto takes before its choice is in force (offloadopt/place/auto.py,
# without a budget): the probe (one untimed step and MEASURED_STEPS timed), then fraction 0's
# baseline (the step that spans the move, SETTLE_STEPS, MEASURED_STEPS); the state moves to the
# choice after that. A shorter run ends on the probe's 0.5 or on fraction 0, chosen by nobody.
# (Kept here: this module does not import torch; tests/test_bad_input.py checks it.)
AUTO_CHOICE_STEPS = (1 + 3) + (1 + 2 + 3)

# The fields whose default (None) resolved() derives from another field: field -> (that field,
# the default for its value). A resume's refusal names the field changed, not what followed it.
DERIVED = {"warmup_steps": ("steps", lambda steps: steps // 20),
           "dtype": ("device", lambda device: "bf16" if device.startswith("cuda") else "fp32")}  # fmt: skip


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
    # HybridAdamW, overlap "backward" with clipping: clipped updates start during backward,
    # validated at its end (speculate=True, docs/modes.md)
    speculate: bool = False
    delay_after: int = 0  # HybridAdamW, overlap "delayed": synchronous steps before the delay
    state_dtype: str = "fp32"  # HybridAdamW: exp_avg and exp_avg_sq in fp32, bf16 or int8
    master_weights: str = "fp32"  # HybridAdamW: fp32 masters, or "bf16-sr" (none; bf16 params)
    checkpointing: bool = False  # activation checkpointing per block (recomputed in backward)
    # optimizer steps; on the tiny preset (seed 0) the held-out loss after 200 steps of its own
    # schedule is that of 300 (2.316 vs 2.326 nats; 150: 2.390) for two thirds of the time
    steps: int = 200
    batch_size: int | None = None  # sequences per micro-batch; None: RUN_DEFAULTS[preset]
    # micro-batches per optimizer step (gradient accumulation): the first N - 1 backward inside
    # opt.accumulating(), each loss divided by N; tokens per step = batch_size x seq_len x N
    grad_accum: int = 1
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
    save: str | None = None  # checkpoint file, written at the end and every save_every steps
    save_every: int = 0  # with save: also every this many steps (0: only at the end)
    # "file": one torch.save file of state_dict(); "streamed": a folder written by
    # HybridAdamW.save_streamed from the live state (no second copy in host memory)
    checkpoint_format: str = "file"
    resume: str | None = None  # checkpoint file of an earlier run (same settings) to continue
    tensorboard: str | None = None  # folder for TensorBoard event files (needs tensorboard)
    # before training, time this many optimizer steps' forward+backward alone (the same
    # micro-batches and accumulation, grads kept, no optimizer step); 0: none
    measure_fwd_bwd: int = 0
    # stop at a NaN or infinite loss, or at weights that are not finite before a checkpoint
    # (exit status 1, one line; the last checkpoint is kept); False: train on, as torch would
    stop_on_nonfinite: bool = True

    def resolved(self) -> TrainConfig:
        """A checked copy with every None default filled in.

        Raises:
            UsageError (a ValueError): a bad setting, named by its ``--flag``; see
                ``FIELD_CHECKS`` and, across fields, ``seq_len`` <= the preset's block_size.
        """
        for name, choices in (("preset", PRESETS), ("optimizer", OPTIMIZERS), ("dtype", DTYPE_NAMES),
                              ("overlap", OVERLAPS), ("parallel", PARALLELS),
                              ("state_dtype", STATE_DTYPES), ("master_weights", MASTERS)):  # fmt: skip
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
        derived = {
            k: f(getattr(cfg, of)) for k, (of, f) in DERIVED.items() if getattr(cfg, k) is None
        }
        cfg = replace(
            cfg,
            batch_size=batch if cfg.batch_size is None else cfg.batch_size,
            seq_len=block_size if cfg.seq_len is None else cfg.seq_len,
            lr=lr if cfg.lr is None else cfg.lr,
            **derived,
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
        if cfg.speculate and (cfg.optimizer != "hybrid" or cfg.overlap != "backward"
                              or cfg.grad_clip == 0 or cfg.release_grads):  # fmt: skip
            raise UsageError(
                "--speculate: starts clipped updates during backward, so it needs --optimizer "
                "hybrid, --overlap backward and a --grad-clip above 0, without --release-grads "
                f"(got --optimizer {cfg.optimizer}, --overlap {cfg.overlap}, --grad-clip "
                f"{cfg.grad_clip:g}{', --release-grads' if cfg.release_grads else ''})"
            )
        if cfg.release_grads and (cfg.overlap != "backward" or cfg.parallel == "ddp"):
            raise UsageError(
                f"--release-grads: frees grads during backward, so it needs --overlap backward "
                f"and no --ddp (DDP owns its grad buckets; got --overlap {cfg.overlap!r}"
                f"{', --ddp' if cfg.parallel == 'ddp' else ''})"
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
                "one), or, on a GPU, a --max-gpu-memory budget"
            )
        if (
            cfg.offload_fraction == "auto"
            and not cfg.max_gpu_memory
            and cfg.steps < AUTO_CHOICE_STEPS
        ):
            raise UsageError(  # a new user's find: the run said so only at its end
                f"--offload-fraction auto with --steps {cfg.steps}: auto measures its first "
                f"{AUTO_CHOICE_STEPS} steps before its choice is in force, so this run would end on "
                f"a fraction nobody chose; give --steps {AUTO_CHOICE_STEPS} or more, or a number"
            )
        d = TrainConfig()
        for flag, value, default in (
            ("--offload-fraction", cfg.offload_fraction, d.offload_fraction),
            ("--min-offload-numel", cfg.min_offload_numel, d.min_offload_numel),
            ("--state-dtype", cfg.state_dtype, d.state_dtype),
            ("--master-weights", cfg.master_weights, d.master_weights),
        ):
            if cfg.optimizer != "hybrid" and value != default:
                raise UsageError(
                    f"{flag} {value}: HybridAdamW's option; --optimizer {cfg.optimizer} keeps "
                    "everything on the device (it would be ignored)"
                )
        compressed = [f"{flag} {value}" for flag, value, default in (
            ("--state-dtype", cfg.state_dtype, d.state_dtype),
            ("--master-weights", cfg.master_weights, d.master_weights)) if value != default]  # fmt: skip
        if compressed and cfg.parallel == "fsdp":
            raise UsageError(  # HybridAdamW refuses it too, but only once the model is built
                f"{' '.join(compressed)} with --fsdp: compressed optimizer state does not support "
                "FSDP2 params yet (its block scales are not laid out like the shards); use "
                "--ddp, or leave out --state-dtype and --master-weights"
            )
        if cfg.master_weights == "bf16-sr" and cfg.dtype not in (None, "bf16"):
            raise UsageError(
                f"--master-weights bf16-sr with --dtype {cfg.dtype}: bf16-sr makes the bf16 "
                "weights their own masters; give --dtype bf16 (fp32 params would keep fp32 "
                "updates, fp16 params are refused)"
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
        if cfg.save_every and cfg.save is None:
            raise UsageError(
                f"--save-every {cfg.save_every}: how often to write the --save checkpoint, so it "
                "needs --save PATH"
            )
        if cfg.checkpoint_format == "streamed" and cfg.save is None:
            raise UsageError(
                "--checkpoint-format streamed: the format --save writes, so it needs --save "
                "PATH (--resume reads either format)"
            )
        if cfg.checkpoint_format == "streamed" and cfg.optimizer != "hybrid":
            raise UsageError(
                f"--checkpoint-format streamed with --optimizer {cfg.optimizer}: only HybridAdamW "
                "writes streamed checkpoints; use --checkpoint-format file"
            )
        if cfg.save is not None and os.path.isdir(cfg.save) and cfg.checkpoint_format != "streamed":
            what = "a streamed checkpoint folder" if os.listdir(cfg.save) else "an empty folder"
            raise UsageError(
                f"--save {cfg.save} is {what}; --checkpoint-format file writes one file (give a "
                "file name, or --checkpoint-format streamed)"
            )
        if (
            cfg.save is not None
            and os.path.isfile(cfg.save)
            and cfg.checkpoint_format == "streamed"
        ):
            raise UsageError(
                f"--save {cfg.save} is a file; --checkpoint-format streamed writes a folder and "
                "does not replace a file (give another name)"
            )
        if cfg.save is not None and os.path.isfile(cfg.save):
            if (
                cfg.data is not None
                and os.path.exists(cfg.data)
                and os.path.samefile(cfg.save, cfg.data)
            ):
                raise UsageError(f"--save {cfg.save} is the --data file; give another name")
            resumed = (
                cfg.resume is not None
                and os.path.exists(cfg.resume)
                and os.path.samefile(cfg.save, cfg.resume)
            )
            if not zipfile.is_zipfile(cfg.save) and not resumed:  # the resume names its own damage
                if checks.begins_as_train_checkpoint(cfg.save):  # ours, cut short
                    raise UsageError(
                        f"--save {cfg.save}: the checkpoint there is damaged (cut short or "
                        "overwritten), and a save would replace it; restore it from a copy, "
                        "resume from an earlier checkpoint, or give another name"
                    )
                raise UsageError(
                    f"--save {cfg.save}: a file that is not a checkpoint is there, and a save "
                    "would replace it; give another name, or move it away"
                )
        for flag, value in (("--save", cfg.save), ("--resume", cfg.resume)):
            if value is not None and cfg.parallel != "none":
                raise UsageError(
                    f"{flag} {value}: one process only (not with --{cfg.parallel}; a sharded "
                    "run saves with torch.distributed.checkpoint)"
                )
        if cfg.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
            raise UsageError(
                f"--tensorboard {cfg.tensorboard}: needs the tensorboard package, which is not "
                "installed here (pip install tensorboard)"
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
    "grad_accum": checks.grad_accum,
    "seq_len": checks.positive_int,
    "lr": checks.nonneg_float,
    "warmup_steps": checks.nonneg_int,
    "weight_decay": checks.nonneg_float,
    "grad_clip": checks.nonneg_float,
    "seed": checks.seed,
    "data": checks.input_file,
    "eval_every": checks.positive_int,
    "eval_batches": checks.eval_batches,
    "log_every": checks.positive_int,
    "save": checks.checkpoint_path,
    "save_every": checks.nonneg_int,
    "resume": checks.checkpoint_input,
    "tensorboard": checks.out_dir,
    "measure_fwd_bwd": checks.measured_steps,
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
    "state_dtype": "HybridAdamW: exp_avg and exp_avg_sq in fp32 (torch's), bf16 (stochastic rounding) or int8 (block-wise codes): 8, 4 or about 2 bytes per param (default: %(default)s)",
    "master_weights": "HybridAdamW: fp32 masters for bf16 params, or bf16-sr: none, the bf16 weights rounded stochastically (default: %(default)s)",
    "steps": "optimizer steps (default: %(default)s)",
    "batch_size": "sequences per micro-batch (default: per preset, 16 for tiny)",
    "grad_accum": "micro-batches per optimizer step (gradient accumulation): the first N - 1 backward passes run inside opt.accumulating(), each loss is divided by N; tokens per step = batch x seq-len x N (default: %(default)s)",
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
    "save": "write a checkpoint (model, optimizer state, step, batch sampler, settings) to this file at the end, and every --save-every steps; each write is whole (a temporary file beside it, then a rename)",
    "save_every": "with --save: also write it every N steps; 0: only at the end (default: %(default)s)",
    "checkpoint_format": "file: one torch.save file of the optimizer's state_dict(); streamed (HybridAdamW): a folder written in parts from the live state, with no second copy of it in host memory, for models near the machine's limits (default: %(default)s)",
    "resume": "continue from a --save checkpoint; the other settings must be the saved run's (log and save options aside), and the losses are then those of an uninterrupted run",
    "tensorboard": "also write the losses, learning rate and step times as TensorBoard events in this folder (needs tensorboard)",
    "measure_fwd_bwd": "before training, time N steps of forward+backward alone (the same micro-batches and accumulation, grads kept, no optimizer step; one untimed step first, batches drawn apart so the run's losses do not change); the JSON gives fwd_bwd_ms and step_over_fwd_bwd (default: %(default)s, none)",
}  # fmt: skip


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` options (``--kebab-case``, one per TrainConfig field) to ``parser``;
    each value is checked as it is parsed (``FIELD_CHECKS``), so a bad one is argparse's
    one-line error."""
    d = TrainConfig()
    choices = {"preset": list(PRESETS), "optimizer": list(OPTIMIZERS), "dtype": list(DTYPE_NAMES),
               "overlap": list(OVERLAPS), "state_dtype": list(STATE_DTYPES),
               "master_weights": list(MASTERS), "checkpoint_format": ["file", "streamed"]}  # fmt: skip
    for name, help_text in HELP.items():
        kwargs = {"choices": choices[name]} if name in choices else {"type": FIELD_CHECKS[name]}
        metavar = {"data": "FILE", "save": "PATH", "resume": "PATH", "tensorboard": "DIR",
                   "grad_accum": "N", "measure_fwd_bwd": "STEPS"}  # fmt: skip
        metavar = {"metavar": metavar[name]} if name in metavar else {}
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
    a(
        "--speculate",
        action="store_true",
        help="HybridAdamW, --overlap backward with --grad-clip: start the clipped updates during "
        "backward as if nothing clips, redo them at its end if the clip bites (docs/modes.md)",
    )
    a("--no-progress", action="store_true", help="no tqdm progress bar on stderr")
    a(
        "--no-stop-on-nonfinite",
        action="store_true",
        help="train on past a NaN or infinite loss; by default the run stops there (exit "
        "status 1, one line naming the step) and keeps its last checkpoint",
    )
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
    return TrainConfig(**fields, progress=not args.no_progress,
                       stop_on_nonfinite=not args.no_stop_on_nonfinite)  # fmt: skip
