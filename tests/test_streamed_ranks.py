"""Streamed checkpoints saved by several processes to one path (every DDP rank calling
``opt.save_streamed(path)``, a fresh user's finding): the saves take their renames in turn, so
none raises and the folder is a whole checkpoint afterwards."""

from __future__ import annotations

import subprocess
import sys

import torch

from offloadopt import HybridAdamW

SAVER = """
import os, sys, time, torch
from offloadopt import HybridAdamW
torch.manual_seed(0)
m = torch.nn.Linear(64, 64)
opt = HybridAdamW(m.parameters(), min_offload_numel=1)
m(torch.ones(2, 64)).sum().backward()
opt.step()
failed = 0
open(sys.argv[1] + f".ready{os.getpid()}", "w").close()
while len([e for e in os.listdir(os.path.dirname(sys.argv[1])) if ".ready" in e]) < 2:
    time.sleep(0.01)  # both processes built: their saves overlap
for i in range(int(sys.argv[2])):
    try:
        opt.save_streamed(sys.argv[1], model=m, extra={"i": i})
    except OSError as e:
        failed += 1
        print(type(e).__name__, e, flush=True)
sys.exit(1 if failed else 0)
"""


def test_every_rank_saving_to_one_path_takes_turns(tmp_path):
    path = tmp_path / "ckpt"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), "100"],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs  # without the lock: 10% raised
    for ready in tmp_path.glob("ckpt.ready*"):
        ready.unlink()
    assert [e.name for e in tmp_path.iterdir()] == ["ckpt"]  # no leftovers beside it
    m = torch.nn.Linear(64, 64)
    opt = HybridAdamW(m.parameters(), min_offload_numel=1)
    assert opt.load_streamed(str(path), model=m) == {"i": 99}
    opt.close()
