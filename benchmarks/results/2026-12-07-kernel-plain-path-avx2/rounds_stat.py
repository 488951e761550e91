"""Medians of interleaved rounds in a folder (cpu_kernel.py outputs named <tree>_r<round>.txt,
written by run_rounds.sh): python rounds_stat.py probe-no-divider"""

import collections
import glob
import re
import statistics as st
import sys

ROW = re.compile(r"(torch fused fp32|ours fp32|\w+ \w+ state)\s+[\d.]+\s+\d+\s+[\d.]+\s+([\d.]+)")


def main(folder: str) -> None:
    d: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for f in glob.glob(folder + "/*_r*.txt"):
        tree = f.split("/")[-1].rsplit("_r", 1)[0]
        for line in open(f):
            m = ROW.match(line)
            if m:
                d[(tree, m.group(1))].append(float(m.group(2)))
    trees = sorted({k[0] for k in d})
    modes = sorted({k[1] for k in d})
    for tree in trees:
        torch_ns = st.median(d[(tree, "torch fused fp32")])
        cells = [
            f"{m}: {st.median(d[(tree, m)]):.3f} ns ({st.median(d[(tree, m)]) / torch_ns:.2f}x)"
            for m in modes
        ]
        print(tree, "  ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
