"""The names the commands' options choose from, without importing torch (``offloadopt
--help`` reads them): the GPT presets' shapes and ``train``'s defaults for each, the
transformers presets' configs, the bench's overlap modes and anchors. The modules that build
them (``gpt``, ``models``, ``anchors``) import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 128  # model width d (residual stream size)
    vocab_size: int = 256  # token ids are in [0, vocab_size); 256 = raw bytes
    block_size: int = 128  # longest sequence, in tokens (rows of the position table)

    def num_params(self) -> int:
        """Parameter count from the config alone (tied head counted once, positions included).

        Per block: 12 d^2 (attention 4 d^2, MLP 8 d^2) + 13 d (biases and two LayerNorms).
        """
        d = self.n_embd
        per_block = 12 * d * d + 13 * d
        return self.vocab_size * d + self.block_size * d + self.n_layer * per_block + 2 * d


PRESETS: dict[str, GPTConfig] = {
    # byte vocabulary, sized so `python -m offloadopt train` finishes in ~1 min on 2 CPU cores
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128),
    # byte vocabulary, a few times bigger: a quick GPU run, or a patient CPU run
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=256, block_size=256),
    # GPT-2 sizes keep the 50304 vocabulary (50257 padded to a multiple of 64) so figures compare
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50304, block_size=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, vocab_size=50304, block_size=1024),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=50304, block_size=1024),
    # Width 4096 (32 heads of 128), byte vocabulary: the largest models one GPU trains with the
    # host's memory (README, "The largest model"); 201.4e6 params per block.
    "gpt-9b": GPTConfig(n_layer=45, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    "gpt-13b": GPTConfig(n_layer=64, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    "gpt-17.5b": GPTConfig(n_layer=87, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    "gpt-18b": GPTConfig(n_layer=89, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    # Past the fp32-state wall (about 17.8e9 on one H200 + 128 GiB): compressed host state
    # (docs/compressed-state.md), int8 moments with fp32 masters, then bf16-sr masters.
    "gpt-25b": GPTConfig(n_layer=125, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    "gpt-30b": GPTConfig(n_layer=150, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    "gpt-32b": GPTConfig(n_layer=160, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
    # Past 40e9: bf16-sr masters and int8 moments with both memories nearly full on one H200
    # + 128 GiB (docs/modes.md's table: about 42e9 at fraction 0.70 at most)
    "gpt-40b": GPTConfig(n_layer=199, n_head=32, n_embd=4096, vocab_size=256, block_size=1024),
}

# Per-preset (batch_size, peak lr) used when train's --batch-size / --lr are not given. The GPT-2
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
    **dict.fromkeys(
        ("gpt-9b", "gpt-13b", "gpt-17.5b", "gpt-18b", "gpt-25b", "gpt-30b", "gpt-32b", "gpt-40b"),
        (1, 2e-6),
    ),
}


_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # GPT2Config's default is 0.1
# name -> (transformers config class, its arguments)
# fmt: off
HF_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # the "gpt2-xl" preset's shape as transformers writes GPT-2: 1.56e9 params, tied head
    "hf-gpt2-xl": ("GPT2Config", dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50304,
                                      n_positions=1024, **_GPT2)),
    # TinyLlama-1.1B's shape: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head
    "hf-llama-1b": ("LlamaConfig", dict(hidden_size=2048, num_hidden_layers=22,
                                        num_attention_heads=32, num_key_value_heads=4,
                                        intermediate_size=5632, vocab_size=32000,
                                        max_position_embeddings=2048)),
    # byte vocabularies, for the CPU tests
    "hf-gpt2-tiny": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                        n_positions=128, bos_token_id=None, eos_token_id=None,
                                        **_GPT2)),
    "hf-llama-tiny": ("LlamaConfig", dict(hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=176, vocab_size=256,
                                          max_position_embeddings=128)),
}
# fmt: on
MODEL_PRESETS: list[str] = [*PRESETS, *HF_PRESETS]


# The overlap modes the bench runs beside step mode (``offloadopt bench --overlap``): the
# HybridAdamW options of each, and what its weights are compared as (README, "Overlap modes").
MODES: dict[str, tuple[dict[str, Any], str]] = {
    "step": ({}, "same"),
    "backward": (dict(overlap="backward", grads_final=True, wait="module"), "same"),
    "backward-clip": (dict(overlap="backward", max_grad_norm=1.0, wait="module"),
                      "clipped in the optimizer (max_grad_norm=1.0)"),
    # the same, its updates started during backward and validated at its end (speculate.py)
    "backward-speculate": (dict(overlap="backward", max_grad_norm=1.0, wait="module",
                                speculate=True), "clipped in the optimizer (max_grad_norm=1.0)"),
    # torch's clip_grad_norm_(params, 1.0) after backward: nothing declared, so the updates
    # wait for step() (README, "Overlap modes")
    "backward-torch-clip": (dict(overlap="backward", wait="module"),
                            "clipped by torch (clip_grad_norm_ 1.0)"),
    "delayed": (dict(overlap="delayed"), "delayed (the weights one step stale)"),
}  # fmt: skip


# The keys of ``anchors.ANCHORS`` (builders that import torch), in its order.
ANCHOR_NAMES: tuple[str, ...] = (
    "megatron:0",
    "megatron:1",
    "megatron-pinfix-fused:1",
    "torchao",
    "fsdp2-cpuoffload",
    "hybrid-fsdp2:0.5",
    "hybrid-fsdp2:1",
    "hybrid-fsdp2-delayed:1",
    "hybrid-fsdp2-backward:1",
    "deepspeed-zero2",
    "deepspeed-zenflow",
)
