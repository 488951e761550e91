"""The delayed parameter update (``overlap="delayed"``) through transformers' Trainer and
PyTorch Lightning: a run checkpoints halfway through its framework and goes on to the end;
a fresh process resumes from that checkpoint to the same end. The two must be bitwise equal.

    python examples/delayed_resume.py [--framework trainer|lightning|both] [--device cpu|cuda]

Each run calls ``opt.watch(model)``: the framework's ``model.state_dict()`` then copies the
update in flight into the weights first, so the checkpoint's weights match its masters. Prints
the largest weight difference per framework; exits 1 unless every one is 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from offloadopt import HybridAdamW


def delayed(params, model, device):
    opt = HybridAdamW(params, lr=1e-2, offload_fraction=1.0, min_offload_numel=1, overlap="delayed")
    opt.watch(model)
    return opt


# ---------------------------------------------------------------------- transformers' Trainer
def trainer_run(out: Path, resume: bool, device: str) -> list[torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from offloadopt.harness.data import load_text

    class Bytes(torch.utils.data.Dataset):
        rows = load_text(None).train[: 64 * 32].long().view(64, 32)

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    torch.manual_seed(1 if resume else 0)  # resumed: the checkpoint brings the weights
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(cfg).to(device)
    opt = delayed(model.parameters(), model, device)
    args = TrainingArguments(
        output_dir=str(out / ("resumed" if resume else "full")), max_steps=6, save_steps=3,
        per_device_train_batch_size=8, save_strategy="steps", report_to=[], seed=0,
        data_seed=0, use_cpu=device == "cpu", dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    t = Trainer(model=model, args=args, train_dataset=Bytes(), optimizers=(opt, None))
    t.train(resume_from_checkpoint=str(out / "full" / "checkpoint-3") if resume else None)
    opt.synchronize()  # the last step's update, copied in
    opt.close()
    return [p.detach().cpu() for p in model.parameters()]


# ---------------------------------------------------------------------- PyTorch Lightning
def lightning_run(out: Path, resume: bool, device: str) -> list[torch.Tensor]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(L.LightningModule):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)
            )

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return delayed(self.parameters(), self, device)

        def on_train_end(self):
            # Before Lightning's teardown moves the module to the CPU: the last update in
            # flight is copied in while the params are where the optimizer put them.
            self.trainer.optimizers[0].synchronize()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.roll(1, 1)), batch_size=8
    )
    # Epochs, not max_steps: with max_steps Lightning's own resume replays a batch (torch's
    # AdamW shows it too), so a resume would not equal the uninterrupted run for any optimizer.
    ckpts = out / "lightning-ckpts"
    callbacks = [] if resume else [ModelCheckpoint(dirpath=ckpts, every_n_epochs=1, save_top_k=-1,
                                                   save_on_train_epoch_end=True)]  # fmt: skip
    t = L.Trainer(max_epochs=2, accelerator=device, devices=1, default_root_dir=str(out),
                  logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=not resume, callbacks=callbacks, deterministic=True)  # fmt: skip
    module = Module(seed=1 if resume else 0)
    t.fit(module, data, ckpt_path=str(ckpts / "epoch=0-step=8.ckpt") if resume else None)
    opt = t.optimizers[0]
    opt.synchronize()
    opt.close()
    return [p.detach().cpu() for p in module.parameters()]


RUNS = {"trainer": trainer_run, "lightning": lightning_run}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=[*RUNS, "both"], default="both")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--phase", choices=["full", "resume"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:  # one run, in this process; its weights to --out
        out = Path(args.out)
        weights = RUNS[args.framework](out, args.phase == "resume", args.device)
        torch.save(weights, out / f"{args.framework}-{args.phase}.pt")
        return 0
    diffs = {}
    for name in RUNS if args.framework == "both" else [args.framework]:
        with tempfile.TemporaryDirectory() as tmp:
            for phase in ("full", "resume"):  # each in a fresh process
                cmd = [sys.executable, __file__, "--framework", name, "--device", args.device,
                       "--phase", phase, "--out", tmp]  # fmt: skip
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    print(r.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{name} {phase}: exit {r.returncode}")
            a, b = (torch.load(Path(tmp) / f"{name}-{p}.pt") for p in ("full", "resume"))
            diffs[name] = max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))
    exact = all(d == 0.0 for d in diffs.values())
    print(json.dumps({"max_abs_weight_diff": diffs, "exact": exact}))
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
