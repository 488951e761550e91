"""Print the rows of overlap_bench.py's JSON files: step medians (min-max), the time to the
end of backward, and the worker's figures from ``opt.stats`` (its kernel, copy launches, waits
for the next bucket, busy span, threads), with the kernel probe when there is one.

Usage: python benchmarks/summarize_rows.py OUT/overlap.json [more.json ...]
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        probe = d.get("kernel_probe", {})
        if probe:
            ns = probe["worker_link_ns_per_param"]
            print(f"{path}: probe {ns:.4f} ns/param under link traffic = {ns * d['params'] / 1e6:.1f} ms "
                  f"over {d['params']} params")  # fmt: skip
        print(f"{'row':28} {'step':>7} {'min':>6} {'max':>6} {'to bwd':>6} {'kernel':>6} "
              f"{'launch':>6} {'feed':>6} {'d2hw':>5} {'busy':>6} thr")  # fmt: skip
        for r in d["configs"]:
            if "error" in r:
                print(f"{r['name']:28} {r['error']}")
                continue
            s = r.get("stats", {})
            print(f"{r['name']:28} {r['step_ms']:7.1f} {r['step_ms_min']:6.1f} {r['step_ms_max']:6.1f} "
                  f"{r['to_backward_end_ms']:6.1f} {s.get('cpu_update_ms', 0):6.1f} "
                  f"{s.get('launch_ms', 0):6.1f} {s.get('feed_wait_ms', 0):6.1f} "
                  f"{s.get('d2h_wait_ms', 0):5.1f} {s.get('worker_ms', 0):6.1f} {s.get('cpu_threads')}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
