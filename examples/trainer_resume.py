"""transformers' Trainer with HybridAdamW, a checkpoint halfway, and a resume in a fresh Trainer.

    python examples/trainer_resume.py [--out DIR]

Trains a 2-layer GPT-2 built from its config (no download) on CPython's pydoc text, bytes as
tokens, for 6 steps, uninterrupted; then again, stopping after the checkpoint at step 3, and
resumes from that checkpoint with a new model and a new optimizer. Prints the largest weight
difference between the two runs (0.0: the resume is exact) and exits 1 if it is not 0.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from offloadopt import HybridAdamW
from offloadopt.harness.data import load_text


class Bytes(torch.utils.data.Dataset):
    def __init__(self, seq_len: int = 32, n: int = 64):
        data = load_text(None).train[: n * seq_len].long()
        self.rows = data.view(n, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build(seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    opt = HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=0.5, min_offload_numel=1024)
    return model, opt


class StopAfter(TrainerCallback):
    """Ends training after a step (an interrupted run: its checkpoint is on disk)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def trainer(model, opt, out: str, max_steps: int, stop_after: int | None = None) -> Trainer:
    args = TrainingArguments(
        output_dir=out, max_steps=max_steps, per_device_train_batch_size=8, save_steps=3,
        save_strategy="steps", logging_steps=1, report_to=[], seed=0, data_seed=0,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    callbacks = [StopAfter(stop_after)] if stop_after else []
    return Trainer(model=model, args=args, train_dataset=Bytes(), optimizers=(opt, None),
                   callbacks=callbacks)  # fmt: skip


def main(out: str | None = None) -> float:
    out = out or tempfile.mkdtemp(prefix="offloadopt-trainer-")
    model_a, opt_a = build()
    trainer(model_a, opt_a, f"{out}/a", 6).train()
    model_b, opt_b = build()
    trainer(model_b, opt_b, f"{out}/b", 6, stop_after=3).train()  # checkpoint-3, then stops
    model_c, opt_c = build(seed=1)  # a fresh model: the checkpoint brings the weights
    trainer(model_c, opt_c, f"{out}/b", 6).train(resume_from_checkpoint=f"{out}/b/checkpoint-3")
    diff = max((p - q).abs().max().item() for p, q in zip(model_a.parameters(), model_c.parameters(), strict=True))  # fmt: skip
    for opt in (opt_a, opt_b, opt_c):
        opt.close()
    return diff


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    diff = main(ap.parse_args().out)
    print(json.dumps({"max_abs_weight_diff": diff, "exact": diff == 0.0}))
    raise SystemExit(0 if diff == 0.0 else 1)
