"""The models the benchmark trains: the harness's GPT presets, or a transformers model built
from its config class (random initialisation, nothing downloaded) for the ``hf-*`` presets.

Every model takes the same batches: ``x`` and ``y``, (batch, seq) int64 token ids on the
model's device, ``y`` already shifted by one token, and every loss is the fp32 mean
cross-entropy in nats. The transformers models use ``sdpa`` attention and no dropout, as the
GPT does, so a step costs what training would.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from offloadopt.harness.gpt import GPT
from offloadopt.harness.presets import HF_PRESETS, MODEL_PRESETS, PRESETS

# where each model family keeps its list of transformer blocks
_BLOCK_PATHS = ("transformer.h", "model.layers")  # GPT and transformers' GPT-2; Llama


def build_model(preset: str, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """A freshly initialised model of ``preset`` on ``device``, its params in ``dtype``; seed
    torch first for the same weights. Raises ``ValueError`` for an unknown preset and
    ``ImportError`` for an ``hf-*`` preset without transformers."""
    device = torch.device(device)
    if preset in PRESETS:
        with device:
            return GPT(PRESETS[preset]).to(dtype)
    if preset not in HF_PRESETS:
        raise ValueError(f"Invalid preset: {preset!r} (choose from {MODEL_PRESETS})")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"preset {preset!r} needs transformers (pip install transformers)") from e
    config_cls, kwargs = HF_PRESETS[preset]
    config = getattr(transformers, config_cls)(
        **kwargs, use_cache=False, attn_implementation="sdpa"
    )
    # Built in dtype, as from_pretrained(dtype=...) does, rather than cast after: buffers that
    # transformers computes in fp32 on purpose (RoPE's inv_freq) stay fp32.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)


def max_seq_len(preset: str) -> int:
    """Longest sequence, in tokens, that the preset's model takes (its position table)."""
    if preset in PRESETS:
        return PRESETS[preset].block_size
    kwargs = HF_PRESETS[preset][1]
    return kwargs.get("n_positions") or kwargs["max_position_embeddings"]


def missing_package(preset: str) -> str | None:
    """The package an ``hf-*`` preset needs that is not importable here, else None (without
    importing it: transformers takes seconds)."""
    if preset not in HF_PRESETS:
        return None
    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # a broken install, or a module without a spec
        found = False
    return None if found else "transformers"


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)[1]


def hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy of a transformers causal LM's logits against ``y`` (already shifted,
    so no ``labels``: transformers would shift them again)."""
    logits = model(input_ids=x).logits  # (batch, seq, vocab) in the model's dtype
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def loss_fn(preset: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(model, x, y) -> 0-dim fp32 loss`` for the models of ``preset``; ``model`` may be
    a wrapper (an FSDP module, a DeepSpeed engine) that takes the same arguments."""
    return hf_loss if preset in HF_PRESETS else gpt_loss


def vocab_size(model: nn.Module) -> int:
    return model.cfg.vocab_size if isinstance(model, GPT) else model.config.vocab_size


def num_params(model: nn.Module) -> int:
    """Parameter elements, a tied head counted once."""
    return sum(p.numel() for p in model.parameters())


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks (the unit FSDP shards by); ``ValueError`` when
    the model keeps them nowhere known."""
    for path in _BLOCK_PATHS:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList):
            return blocks
    raise ValueError(f"no transformer blocks at {_BLOCK_PATHS} in {type(model).__name__}")
