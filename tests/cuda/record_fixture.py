"""Record the real-trace fixture of tests/test_audit.py on the GPU host.

    python tests/cuda/record_fixture.py tests/fixtures/audit_trace_h200.json

Runs a pinned H2D, a pageable H2D, a D2H into pinned memory, a ``.item()``, and matmuls on the
compute stream while a side stream copies H2D; keeps only the events the audit reads (copies,
kernels, their runtime calls, CPU ops and flows, the Python frames above each copy), checks
the summary against :func:`expectations` and writes it (< 200 KB). Exits 1 if a check fails.
"""

import json
import sys
from pathlib import Path

import torch

MiB = 2**20


def expectations(report, events) -> list[str]:
    """Problems with a summary of this script's trace (empty: as expected); the test reuses it."""
    rows = {r.label: r for r in report.rows}
    want = {
        "HtoD (Pinned -> Device)": 2,  # staging -> device, and the side-stream copy
        "HtoD (Pageable -> Device)": 1,
        "DtoH (Device -> Pinned)": 1,
        "DtoH (Device -> Pageable)": 1,  # .cpu()
    }
    problems = [f"{k}: {rows[k].count if k in rows else 0} < {n}" for k, n in want.items()
                if k not in rows or rows[k].count < n]  # fmt: skip
    if problems:
        return problems
    memcpys = [e for e in events if e.get("cat") == "gpu_memcpy" and e.get("ph") == "X"]
    if report.copy_count != len(memcpys):
        problems.append(f"{report.copy_count} copies summarised, {len(memcpys)} in the trace")
    for label, callee in [("HtoD (Pageable -> Device)", "Tensor.to"),
                          ("DtoH (Device -> Pageable)", "Tensor.cpu")]:  # fmt: skip
        sites = [s for s in rows[label].call_sites if s.file.endswith("record_fixture.py")]
        if not sites or not sites[0].callee.endswith(callee):
            problems.append(f"{label} not attributed to record_fixture.py via {callee}")
    # .item() is a DtoH of 4 bytes: into a pageable scalar on older torch, through a pinned
    # buffer on torch 2.11 (seen on the H200 host); either way it is attributed.
    items = [s for r in report.rows if r.direction == "DtoH" for s in r.call_sites
             if s.file.endswith("record_fixture.py") and s.callee.endswith("Tensor.item")]  # fmt: skip
    if not items:
        problems.append("no DtoH attributed to record_fixture.py via Tensor.item")
    pinned = rows["HtoD (Pinned -> Device)"]
    if not (pinned.bandwidth_gbps or 0) > 5:
        problems.append(f"pinned H2D at {pinned.bandwidth_gbps} GB/s")
    if not pinned.overlap_us > 0:
        problems.append("the side-stream H2D did not overlap the matmuls")
    if report.kernel_count < 8:
        problems.append(f"{report.kernel_count} kernels < 8 matmuls")
    return problems


def workload(bufs: dict, side: torch.cuda.Stream) -> float:
    bufs["dev"].copy_(bufs["staging"], non_blocking=True)  # pinned H2D
    x = bufs["pageable"].to("cuda", non_blocking=True)  # pageable H2D: staged, synchronous
    bufs["grad_host"].copy_(bufs["dev"], non_blocking=True)  # D2H into pinned memory
    back = bufs["dev"][:1024].cpu()  # D2H into new pageable memory
    value = x.sum().item() + float(back[0])  # a 4-byte D2H that synchronises
    for _ in range(8):  # keeps the compute stream busy for a few ms
        bufs["w"] @ bufs["w"]
    with torch.cuda.stream(side):
        bufs["big_dev"].copy_(bufs["big_host"], non_blocking=True)  # overlaps the matmuls
    return value


def trim(events: list[dict]) -> list[dict]:
    """Only what summarize() reads: copies, kernels, and what links copies to Python frames."""
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    corr = {e["args"].get("correlation") for e in copies} - {None}
    ext = {e["args"].get("External id") for e in copies} - {None}
    keep = [e for e in events if e.get("ph") == "M" or e.get("cat") in ("gpu_memcpy", "kernel")]
    anchors = [e for e in events if e.get("ph") == "X" and (
        (e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") in corr)
        or (e.get("cat") == "cpu_op" and e.get("args", {}).get("External id") in ext))]  # fmt: skip
    keep += anchors
    keep += [e for e in events if e.get("cat") == "ac2g" and e.get("id") in corr]
    for e in events:  # the Python frames holding an anchor, on the anchor's thread
        if e.get("cat") == "python_function" and any(
            (a["pid"], a["tid"]) == (e["pid"], e["tid"])
            and e["ts"] <= a["ts"] + a["dur"] / 2 <= e["ts"] + e["dur"]
            for a in anchors
        ):
            keep.append(e)
    return keep


def main(out: str) -> int:
    from offloadopt.audit import audit, load_trace_events, summarize

    bufs = {
        "staging": torch.randn(16 * MiB // 4).pin_memory(),  # (4 Mi,) fp32, pinned host
        "dev": torch.empty(16 * MiB // 4, device="cuda"),  # (4 Mi,) fp32, device
        "pageable": torch.randn(4 * MiB // 4),  # (1 Mi,) fp32, pageable host
        "grad_host": torch.empty(16 * MiB // 4).pin_memory(),  # (4 Mi,) fp32, pinned host
        "w": torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16),
        "big_host": torch.empty(256 * MiB, dtype=torch.uint8).pin_memory(),
        "big_dev": torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"),
    }
    side = torch.cuda.Stream()
    workload(bufs, side)  # warm-up: CUDA context, cuBLAS handle, allocator
    torch.cuda.synchronize()
    raw = Path(out).with_suffix(".raw.json")
    with audit(trace_path=raw, resolve_lines=False):
        workload(bufs, side)
    events = trim(load_trace_events(raw))
    raw.unlink()
    report = summarize(events, resolve_lines=False)
    print(report.table())
    problems = expectations(report, events)
    if problems:
        print("not written:", *problems, sep="\n  ")
        return 1
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name()}  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"traceEvents": events, "recorded_with": meta}))
    size = Path(out).stat().st_size
    print(f"wrote {out}: {len(events)} events, {size / 1e3:.1f} KB")
    return 0 if size < 200_000 else 1


if __name__ == "__main__":
    sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repo root: offloadopt
    sys.exit(main(sys.argv[1]))
