"""Medians of ab.sh's rounds: python stat.py ROUNDS.txt -> each mode's x torch (paired medians) a
round, before and after, and their medians; torch's ns/param a round."""

import collections
import re
import statistics
import sys

rows = collections.defaultdict(list)
side = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ (old|new)", line)
    if m:
        side = m.group(1)
        continue
    m = re.match(
        r"((?:fp32m|bf16m) (?:bf16|int8)) state .* ([\d.]+)x +[\d.]+x +[\d.]+-[\d.]+$", line
    )
    if m:
        rows[(m.group(1), side)].append(float(m.group(2)))
    m = re.match(r"torch fused fp32 +28.00 +1 +[\d.]+ +([\d.]+)", line)
    if m:
        rows[("torch ns/param", side)].append(float(m.group(1)))
print(f"{'row':<16} {'side':<4} {'median':>7}  rounds")
for (name, s), v in sorted(rows.items()):
    print(f"{name:<16} {s:<4} {statistics.median(v):>7.3f}  {' '.join(f'{x:.2f}' for x in v)}")
