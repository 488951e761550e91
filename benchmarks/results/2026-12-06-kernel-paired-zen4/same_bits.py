"""Run the CPU kernel on fixed inputs in every mode, ISA, grad dtype and option; save the outputs.

PYTHONPATH=<tree> OFFLOADOPT_KERNEL_DIR=<dir> python same_bits.py OUT.pt   (once per kernel)
python same_bits.py --compare BEFORE.pt AFTER.pt                           (bitwise, each case)
"""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

SIZES = [1, 7, 15, 16, 17, 31, 33, 63, 64, 65, 255, 256, 257, 1000, 4099, 70001]
OPTS = [{}, {"maximize": True, "grad_scale": 2.0}, {"decoupled": False}]


def run(out: str) -> None:
    from test_kernels import kcall, rand_state

    from offloadopt import kernels

    mod = kernels.load()
    res = {}
    for isa in mod.isas():
        mod.set_isa(isa)
        grid = itertools.product(
            [False, True], [0, 1, 2], [torch.float32, torch.bfloat16], [False, True], OPTS
        )
        for master_bf16, moments, gdtype, wout, opts in grid:
            if wout and master_bf16:
                continue
            state = rand_state(
                SIZES,
                seed=3,
                mdtype=torch.bfloat16 if master_bf16 else torch.float32,
                gdtype=gdtype,
            )
            ps, gs, ms, vs = (list(x) for x in zip(*state, strict=True))
            sms, svs = [], []
            if moments == 1:
                ms, vs = [m.bfloat16() for m in ms], [v.bfloat16() for v in vs]
            if moments == 2:
                ms = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
                vs = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
                sms = [torch.zeros((n + 255) // 256) for n in SIZES]
                svs = [torch.zeros((n + 255) // 256) for n in SIZES]
            wo = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES] if wout else []
            offsets = [0] * (len(SIZES) - 1) + [2**32 - 300]  # the last one's counter wraps
            for step in (1.0, 2.0, 3.0):
                kcall(mod.adam_step, ps, gs, ms, vs, sms=sms, svs=svs, wout=wo, steps=[step] * len(SIZES),
                      salts=list(range(len(SIZES))), offsets=offsets, moments=moments, master_sr=master_bf16,
                      **opts)  # fmt: skip
            key = (isa, master_bf16, moments, str(gdtype), wout, str(opts))
            res[key] = [t.clone() for t in ps + ms + vs + sms + svs + wo]
    torch.save(res, out)
    print(f"{len(res)} cases -> {out}")


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys(), "the two runs hold different cases"
    bad = 0
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                bad += 1
                print("differs:", key, x.dtype, x.numel())
    print(f"{len(a)} cases, {bad} tensors differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(compare(sys.argv[2], sys.argv[3]) if sys.argv[1] == "--compare" else run(sys.argv[1]))
