"""Run the CPU kernel on fixed inputs with NaN and inf in grads and masters, every mode, ISA and
option set; save the outputs, or compare two saved runs bit for bit.

PYTHONPATH=<tree> OFFLOADOPT_KERNEL_DIR=<dir> python same_bits_nonfinite.py OUT.pt   (per kernel)
python same_bits_nonfinite.py --compare BEFORE.pt AFTER.pt
"""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

SIZES = [4099, 256, 70_001, 3, 1000]
OPTS = [
    {},
    {"grad_scale": 3.0, "maximize": True, "decoupled": False},
    {"weight_decay": 0.0, "beta1": 0.3},
]


def run(out: str) -> None:
    from test_kernels import MODES, kcall, make_mode

    from offloadopt import kernels

    mod = kernels.load()
    res = []
    for isa in mod.isas():
        mod.set_isa(isa)
        for (mb, mo), opts, poison in itertools.product([(False, 0)] + MODES, OPTS, (False, True)):
            x = make_mode(SIZES, 3, mb, mo, gdtype=torch.bfloat16 if mb or mo else torch.float32)
            if poison:  # block starts, middles and ends; a master NaN and -inf; a short end
                for j in (0, 17, 255, 256, 600, 999):
                    x[1][4][j] = float("nan") if j % 2 else float("inf")
                x[0][2][70_000], x[0][2][5] = float("nan"), float("-inf")
                x[1][0][4098] = float("nan")
            wout = [] if mb else [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
            n = len(SIZES)
            for step in (1.0, 2.0):
                kcall(mod.adam_step, *x[:4], sms=x[4], svs=x[5], wout=wout, steps=[step] * n,
                      offsets=[2**32 - 40] * n, moments=mo, master_sr=mb, **opts)  # fmt: skip
            res.append([t.clone() for lst in list(x) + [wout] for t in lst])
    torch.save(res, out)
    print(f"{len(res)} cases, {sum(len(r) for r in res)} tensors -> {out}")


def compare(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    bad = [(i, j) for i, (x, y) in enumerate(zip(a, b, strict=True))
           for j, (s, t) in enumerate(zip(x, y, strict=True))
           if s.dtype != t.dtype or not torch.equal(s.view(torch.uint8), t.view(torch.uint8))]  # fmt: skip
    print(f"{sum(len(x) for x in a)} tensors, {len(bad)} differ: {bad[:10]}")


if __name__ == "__main__":
    compare(*sys.argv[2:4]) if sys.argv[1] == "--compare" else run(sys.argv[1])
