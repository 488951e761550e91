"""Training data: byte-level text with a held-out split, or mock uniform tokens.

The default text is the English documentation that ships with every CPython
(``pydoc_data.topics``), so the harness runs offline anywhere. Tokens are raw bytes (ids in
[0, 256)), which are valid ids for every preset, the 50304-token GPT-2 ones included.

The yardstick is the byte unigram entropy H = -sum_b p(b) ln p(b), in nats like the loss: a
model that only learned byte frequencies reaches H, so a held-out loss below H shows that the
optimizer trained the model's context machinery. Mock data cannot show that: uniform random
tokens keep the loss at ln(vocab_size) whatever the optimizer does.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT_FRACTION = 0.1  # the last 10% of the bytes are held out


def default_text() -> bytes:
    """CPython's pydoc topics (``pydoc_data.topics.topics``), joined in sorted key order.

    About 0.5 MB of English; the exact text depends on the Python version.
    """
    from pydoc_data import topics

    return "".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime) -> text_digest's answer


def text_digest(path: str | None) -> str:
    """The sha256 of the bytes :func:`load_text` trains on (the pydoc topics when ``path`` is
    None): a resumed run's data is the saved run's by its bytes, not by its path. Kept per
    file and modification time, so a run saving often reads its data file once."""
    if path is None:
        return hashlib.sha256(default_text()).hexdigest()
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return _DIGESTS[key]


def byte_entropy_nats(data: bytes | torch.Tensor) -> float:
    """Unigram entropy of a byte sequence, in nats: -sum_b p(b) ln p(b).

    ``data``: ``bytes`` or a 1-D integer tensor of byte values in [0, 256).
    Raises ``ValueError`` on empty data.
    """
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes) else data
    if t.numel() == 0:
        raise ValueError("entropy of empty data is undefined")
    counts = torch.bincount(t.reshape(-1).long(), minlength=256).double()
    p = counts[counts > 0] / t.numel()
    return float(-(p * p.log()).sum())


@dataclass
class TokenData:
    """Tokens to train on, split into train and held-out parts.

    For text, ``train`` and ``heldout`` are 1-D uint8 CPU tensors (byte ids, disjoint: the
    held-out part is the last ``HELDOUT_FRACTION`` of the bytes). For mock data both are None
    and batches are drawn uniformly from [0, vocab_size).
    """

    description: str  # one line for the log: the source and its size
    entropy_nats: float  # byte unigram entropy of the text; ln(vocab_size) for mock data
    vocab_size: int  # ids drawn are < vocab_size
    train: torch.Tensor | None  # (n_train,) uint8 CPU, or None for mock
    heldout: torch.Tensor | None  # (n_heldout,) uint8 CPU, or None for mock


def split_sizes(n: int) -> tuple[int, int]:
    """(training, held-out) tokens of an ``n``-byte text: the held-out part is its last
    ``HELDOUT_FRACTION``, rounded down."""
    n_heldout = int(n * HELDOUT_FRACTION)
    return n - n_heldout, n_heldout


def min_text_bytes(window: int) -> int:
    """The fewest bytes of text whose two splits both hold ``window`` tokens."""
    n = max(int(window / HELDOUT_FRACTION) - 16, window)  # just below: int() rounds down
    while min(split_sizes(n)) < window:
        n += 1
    return n


def load_text(path: str | None = None) -> TokenData:
    """Byte tokens of a text file (read as raw bytes), or of the pydoc topics when ``path`` is None.

    Raises ``OSError`` when the file cannot be read (missing, a folder) and ``ValueError``,
    naming the file, when it is empty or too short to split.
    """
    raw = default_text() if path is None else Path(path).read_bytes()
    name = "pydoc_data.topics" if path is None else path
    if not raw:  # torch.frombuffer would say "buffer length (0) and count (-1) must not be 0"
        raise ValueError(f"{name!r}: empty file (0 bytes)")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (n,) uint8 CPU
    n_train, n_heldout = split_sizes(len(tokens))
    if min(n_train, n_heldout) < 2:
        raise ValueError(
            f"{name!r}: {len(tokens)} bytes is too little text to split "
            f"(at least {min_text_bytes(2)} bytes)"
        )
    return TokenData(
        description=f"{name}: {len(tokens):,} bytes, byte tokens, last {HELDOUT_FRACTION:.0%} held out",
        entropy_nats=byte_entropy_nats(tokens),
        vocab_size=256,
        train=tokens[:n_train],
        heldout=tokens[n_train:],
    )


def mock_data(vocab_size: int) -> TokenData:
    """Uniform random tokens in [0, vocab_size): the loss cannot go below ln(vocab_size)."""
    return TokenData(
        description=f"mock: uniform random tokens in [0, {vocab_size})",
        entropy_nats=math.log(vocab_size),
        vocab_size=vocab_size,
        train=None,
        heldout=None,
    )


def get_batch(
    data: TokenData,
    split: str,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of next-token pairs (x, y), both (batch_size, seq_len) int64 on ``device``.

    ``y[:, i] == x[:, i + 1]`` for text and mock data alike: each row is a window of seq_len + 1
    tokens starting at a random offset. ``split`` is "train" or "heldout"; ``generator`` is a
    seeded CPU ``torch.Generator`` that alone decides the batch.

    On a CUDA device the batch is staged in pinned host memory and copied with
    ``non_blocking=True``, so a profile of a step shows no pageable copy.
    Raises ``ValueError`` for an unknown split or a split shorter than seq_len + 1.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"Invalid split: {split!r} (train or heldout)")
    tokens = data.train if split == "train" else data.heldout
    if tokens is None:
        window = torch.randint(0, data.vocab_size, (batch_size, seq_len + 1), generator=generator)
    else:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{split} split has {len(tokens)} tokens, fewer than seq_len + 1")
        starts = torch.randint(0, len(tokens) - seq_len, (batch_size, 1), generator=generator)
        window = tokens[starts + torch.arange(seq_len + 1)].long()  # (batch, seq + 1) int64
    x = window[:, :-1].contiguous()  # (batch, seq) int64 CPU
    y = window[:, 1:].contiguous()  # (batch, seq) int64 CPU
    device = torch.device(device)
    if device.type == "cuda":
        # pin_memory() stages the batch in page-locked memory, so the copy below is a true async
        # DMA (no pageable bounce buffer) that is ordered on the current stream before the
        # forward reads x and y. The caching host allocator records that use, so the pinned
        # block is not reused before the copy finishes even though x and y are dropped here.
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        x, y = x.to(device), y.to(device)
    return x, y
