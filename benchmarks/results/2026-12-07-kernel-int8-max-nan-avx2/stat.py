"""Medians of the rounds in rounds/ (cpu_kernel.py outputs <tree>_t<threads>_r<round>.txt):
ns/param, the ratio to torch's fused fp32 kernel and to bytes / triad, per tree and thread count."""

import collections
import glob
import re
import statistics as st
from pathlib import Path

ROW = re.compile(r"(torch fused fp32|ours fp32|\w+ \w+ state)\s+([\d.]+)\s+\d+\s+[\d.]+\s+([\d.]+)")
TRIAD = re.compile(r"triad ([\d.]+) GB/s")
HERE = Path(__file__).resolve().parent


def main() -> None:
    for th in (1, 2):
        for tree in ("before", "after"):
            rows: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
            triads = []
            for f in glob.glob(str(HERE / "rounds" / f"{tree}_t{th}_r*.txt")):
                text = Path(f).read_text()
                triads.append(float(TRIAD.search(text).group(1)))
                for line in text.splitlines():
                    if m := ROW.match(line):
                        rows[m.group(1)].append((float(m.group(2)), float(m.group(3))))
            torch_ns, triad = st.median(x[1] for x in rows["torch fused fp32"]), st.median(triads)
            print(f"threads {th}, {tree}, triad {triad:.1f} GB/s")
            for mode, v in rows.items():
                ns = st.median(x[1] for x in v)
                print(f"  {mode:18s} {ns:.3f} ns  {ns / torch_ns:.2f}x torch  {v[0][0] / ns:5.1f} GB/s  "
                      f"{ns / (v[0][0] / triad):.2f}x bus")  # fmt: skip


if __name__ == "__main__":
    main()
