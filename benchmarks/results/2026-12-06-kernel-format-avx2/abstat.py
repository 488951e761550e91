"""Medians of the interleaved A/B runs in a folder (cpu_kernel.py outputs named
avx2_t<threads>_<A|B>_r<round>.txt): python abstat.py ab-1thread"""

import glob
import re
import statistics as st
import sys

MODES = ["fp32m bf16 state", "fp32m int8 state", "bf16m bf16 state", "bf16m int8 state"]
ROW = re.compile(r"(torch fused fp32|\w+ \w+ state)\s+[\d.]+\s+\d+\s+[\d.]+\s+([\d.]+)")


def main(folder: str) -> None:
    d: dict[tuple[str, str], list[float]] = {}
    for f in sorted(glob.glob(folder + "/avx2_t*_*_r*.txt")):
        side = f.split("_")[-2]
        for line in open(f):
            m = ROW.match(line)
            if m:
                d.setdefault((side, m.group(1)), []).append(float(m.group(2)))
            m = re.search(r"triad ([\d.]+) GB/s", line)
            if m:
                d.setdefault((side, "triad"), []).append(float(m.group(1)))
    for mode in ["triad", "torch fused fp32", *MODES]:
        b, a = d[("B", mode)], d[("A", mode)]
        print(
            f"{mode:20s} B {st.median(b):.3f} ({min(b):.3f}) {b}  A {st.median(a):.3f} ({min(a):.3f}) {a}"
        )
    tb, ta = st.median(d[("B", "torch fused fp32")]), st.median(d[("A", "torch fused fp32")])
    for mode in MODES:
        before, after = st.median(d[("B", mode)]) / tb, st.median(d[("A", mode)]) / ta
        print(f"{mode} B/torch {before:.3f}  A/torch {after:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
