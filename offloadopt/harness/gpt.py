"""GPT-2, small and plain: the model the harness trains and benchmarks.

Learned positions, pre-LayerNorm blocks with biases, GELU (tanh approximation, as GPT-2),
causal ``scaled_dot_product_attention``, no dropout, the LM head tied to the token embedding,
fp32 cross-entropy and GPT-2 initialisation (std 0.02, residual projections scaled by
1/sqrt(2 * n_layer)), so the first loss is about ln(vocab_size).

Follows karpathy/nanoGPT ``model.py`` and OpenAI's GPT-2 ``model.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from offloadopt.harness.presets import PRESETS, GPTConfig  # noqa: F401 - their old home


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model.

    ``forward(idx, targets=None) -> (logits, loss)``:

    - ``idx``: (batch, seq) int64 token ids in [0, vocab_size), seq <= block_size, on the
      model's device.
    - ``targets``: optional, same shape and dtype as ``idx``.
    - ``logits``: (batch, seq, vocab_size) in the model's dtype.
    - ``loss``: 0-dim fp32 mean cross-entropy in nats (computed on ``logits.float()``), or
      None without targets.

    The head is tied: ``lm_head.weight is transformer.wte.weight``, one Parameter that
    ``named_parameters()`` yields once, as ``transformer.wte.weight``.

    Raises ``ValueError`` when seq > block_size.

    Example::

        model = GPT(PRESETS["tiny"])
        logits, loss = model(idx, targets)  # loss ~ ln(256) = 5.55 at init
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),  # token embedding, also the head
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),  # learned positions
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one Parameter
        # Activation checkpointing per block: its activations are recomputed in backward.
        self.checkpointing = False
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), two residual adds per block
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # nn.LayerNorm already starts at weight 1, bias 0

    def num_params(self) -> int:
        """Number of parameter elements, the tied head counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(
                f"sequence of {t} tokens is longer than block_size {self.cfg.block_size}"
            )
        pos = torch.arange(t, device=idx.device)  # (t,) int64
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (b, t, d)
        for block in self.transformer.h:
            if self.checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (b, t, vocab)
        loss = None
        if targets is not None:
            # fp32 cross-entropy: a bf16 log-softmax over 50k classes loses the loss's precision
            loss = F.cross_entropy(logits.float().view(b * t, -1), targets.reshape(b * t))
        return logits, loss
