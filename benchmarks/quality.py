"""Held-out loss of HybridAdamW's compressed optimizer state against torch's AdamW: the table
to read before switching ``state_dtype`` or ``master_weights``.

What it measures: a GPT (``--preset``, default gpt2, 124M params) trained for ``--steps`` steps
on real text available offline, once per setting and seed, each run one subprocess
``python3 -m offloadopt train ... --no-progress``; the held-out loss (nats per byte, the last
10% of the corpus) at the end. Every setting sees the same corpus, the same data order and the
same initial weights for a given seed (``--seed`` seeds both). Settings:

    torch-adamw    --optimizer adamw (torch.optim.AdamW(fused=True)): the reference
    fp32           HybridAdamW, fp32 exp_avg/exp_avg_sq and fp32 masters (its defaults)
    bf16-moments   --state-dtype bf16
    int8-moments   --state-dtype int8
    bf16-sr        --master-weights bf16-sr (the bf16 weights are the masters, rounded
                   stochastically)
    bf16-sr+int8   --master-weights bf16-sr --state-dtype int8

With ``--dtype bf16`` (the default), torch-adamw is torch's AdamW on the bf16 params themselves:
its exp_avg/exp_avg_sq are bf16 too (``zeros_like(param)``) and there is no fp32 master (each
update is rounded to nearest into the bf16 weight). It is the plain-torch run a user has without
offloadopt, not an fp32-master reference; fp32 (HybridAdamW's fp32 masters and moments) is that.
A setting better than torch's spread is "outside" too: read the sign of "mean - torch".

The settings in ``--seeds-for`` (default torch-adamw, fp32, int8-moments, bf16-sr+int8) run seeds
0 .. K-1 (``--seeds K``, default 3); the others seed 0 only.

The corpus: every ``*.py`` file of the Python standard library's own sources
(``sysconfig.get_paths()["stdlib"]``; no ``site-packages``, no ``test``/``tests``/``idlelib``
folders), sorted by relative path, each preceded by a header line ``# ==> <relative path>``;
written once to ``<out>/corpus.txt`` (git-ignored there by ``<out>/.gitignore``: a results
folder is committed without it), its size and sha256 kept in quality.json. Another Python
version gives another corpus: compare tables only when their sha256 agree.

The GPU host runs (repo root)::

    python3 benchmarks/quality.py --out benchmarks/results/<date>-quality-h200 --parallel 4

Each run's output goes to ``<out>/runs/<setting>-seed<k>.log`` and its JSON summary (the train
command's last stdout line) to ``<out>/runs/<setting>-seed<k>.json``; a run whose .json exists
is not run again (``--force`` reruns it), so a cut-short session continues where it stopped.
``<out>/quality.json`` holds every summary, the corpus, the command line, torch, the GPU and the
git commit; the markdown table is printed last, and ``--table-only`` prints it again from
``<out>`` without running anything. With ``--parallel P > 1`` the runs share the GPU and the
host's cores (each run pinned to its own slice of the cores, with ``taskset``): the losses are
unchanged, the step times are those of a shared machine.

How to read the verdict: a setting is "within torch's seed spread" when

    |mean - torch_mean| <= max(2 * torch_std, torch_max - torch_min)

over torch-adamw's seeds (std: the sample standard deviation, n - 1), else "outside". It needs
torch-adamw with at least two seeds ("n/a" otherwise). A setting with one seed is judged by that
seed alone: a coarse check; give it seeds (``--seeds-for``) to judge its mean. The last two
columns judge the same way against fp32 (HybridAdamW's default, fp32 masters and moments): on
bf16 params torch-adamw keeps no fp32 master, so "within fp32's seed spread" is the claim that a
compressed setting loses nothing against the run it replaces.

Exit status: 0 every run done, 1 a run failed (its row shows the exit code and the last line of
its log), 2 bad input (an unknown setting, --seeds/--parallel/--steps < 1 ...).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import queue
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repo whose offloadopt the runs import
sys.path.insert(0, str(ROOT))

from offloadopt.harness import checks, models  # noqa: E402

SETTINGS = {
    "torch-adamw": ["--optimizer", "adamw"],
    "fp32": ["--optimizer", "hybrid", "--state-dtype", "fp32", "--master-weights", "fp32"],
    "bf16-moments": ["--optimizer", "hybrid", "--state-dtype", "bf16"],
    "int8-moments": ["--optimizer", "hybrid", "--state-dtype", "int8"],
    "bf16-sr": ["--optimizer", "hybrid", "--master-weights", "bf16-sr"],
    "bf16-sr+int8": ["--optimizer", "hybrid", "--master-weights", "bf16-sr", "--state-dtype", "int8"],
}  # fmt: skip
REFERENCE = "torch-adamw"
# The second reference: HybridAdamW's default (fp32 masters and moments), the run a compressed
# setting replaces; on bf16 params torch-adamw has no fp32 master, so the two differ.
MASTER_REFERENCE = "fp32"
SEEDS_FOR = "torch-adamw,fp32,int8-moments,bf16-sr+int8"
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib"}
RULE = "|mean - torch_mean| <= max(2 * torch_std, torch_max - torch_min)"


def settings_list(value: str) -> list[str]:
    """A comma list of setting names, in the order given, each once; a ``UsageError`` names an
    unknown one."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise checks.UsageError(f"{value!r} names no setting (one of {', '.join(SETTINGS)})")
    for name in names:
        if name not in SETTINGS:
            raise checks.UsageError(f"{name!r} is not a setting (one of {', '.join(SETTINGS)})")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before a corpus is built or a run started: a bad value is argparse's
    usage error (status 2) naming the flag and the value."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=checks.out_dir, default="quality-out", help="results folder")
    ap.add_argument("--settings", type=settings_list, default=list(SETTINGS),
                    help=f"comma list of settings (default all: {','.join(SETTINGS)})")  # fmt: skip
    ap.add_argument("--seeds", type=checks.positive_int, default=3,
                    help="seeds 0 .. K-1 for the --seeds-for settings, >= 1 (default 3)")  # fmt: skip
    ap.add_argument("--seeds-for", type=settings_list, default=settings_list(SEEDS_FOR),
                    help=f"settings that get --seeds seeds; the rest seed 0 (default {SEEDS_FOR})")  # fmt: skip
    ap.add_argument("--preset", type=checks.preset, default="gpt2", help="model preset")
    ap.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (default cuda)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="param dtype")
    ap.add_argument("--steps", type=checks.positive_int, default=2000, help="steps, >= 1")
    ap.add_argument("--batch-size", type=checks.positive_int, default=8, help="sequences, >= 1")
    ap.add_argument("--seq-len", type=checks.positive_int, default=512, help="tokens, >= 1")
    ap.add_argument("--eval-every", type=checks.positive_int, default=None,
                    help="held-out evaluation every N steps (default --steps: at the end only)")  # fmt: skip
    ap.add_argument("--eval-batches", type=checks.positive_int, default=32,
                    help="batches per held-out evaluation (default 32)")  # fmt: skip
    ap.add_argument("--grad-clip", type=checks.nonneg_float, default=1.0, help="0: off")
    ap.add_argument("--offload-fraction", type=checks.fraction_or_auto, default=1.0,
                    help="HybridAdamW settings: share of state on the host, 0..1 or auto")  # fmt: skip
    ap.add_argument("--lr", type=checks.nonneg_float, default=None,
                    help="peak learning rate (default the preset's)")  # fmt: skip
    ap.add_argument("--parallel", type=checks.positive_int, default=1,
                    help="runs at once, >= 1 (default 1)")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="rerun runs whose .json exists")
    ap.add_argument("--table-only", action="store_true",
                    help="print the table of <out>/quality.json; run nothing")  # fmt: skip
    args = ap.parse_args(argv)
    if args.table_only:
        if not (Path(args.out) / "quality.json").is_file():
            ap.error(f"--table-only: {str(Path(args.out) / 'quality.json')!r}: no such file")
        return args
    try:
        checks.check("--device", args.device, checks.device)
    except checks.UsageError as e:
        ap.error(str(e))
    if args.seq_len > (longest := models.max_seq_len(args.preset)):
        ap.error(f"--seq-len: {args.seq_len} is more than the {args.preset} preset's {longest}")
    if args.eval_every is None:
        args.eval_every = args.steps
    return args


def runs_of(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(setting, seed) pairs in table order."""
    seeds_for = set(args.seeds_for)
    return [(s, k) for s in args.settings for k in range(args.seeds if s in seeds_for else 1)]


def build_corpus() -> bytes:
    """The standard library's ``*.py`` sources (see the module docstring), as one byte string."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):  # symlinked folders are not followed
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    parts = []
    for rel, path in sorted((p.relative_to(root).as_posix(), p) for p in files):
        if not path.is_file():
            continue
        text = path.read_bytes()
        parts += [f"# ==> {rel}\n".encode(), text, b"" if text.endswith(b"\n") else b"\n"]
    return b"".join(parts)


def write_corpus(out: Path, force: bool) -> dict:
    """``<out>/corpus.txt``: written once; an existing one must be the corpus built here (the
    runs already done used it), unless ``force``. Returns its path, size and sha256."""
    data = build_corpus()
    path = out / "corpus.txt"
    if path.exists() and path.read_bytes() != data:
        if not force:
            raise checks.UsageError(
                f"{str(path)!r} differs from the corpus this Python builds (another Python wrote "
                "it?): use another --out, or --force to rebuild it and rerun every run"
            )
        for old in (out / "runs").glob("*.json"):
            old.unlink()
    if not path.exists() or path.read_bytes() != data:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # whole or absent: a cut-short write leaves no half corpus
    ignore = out / ".gitignore"  # 11 MB rebuilt from any Python of this version: its sha256 is kept
    if not ignore.exists():
        ignore.write_text(
            "# rebuilt by benchmarks/quality.py; quality.json keeps its sha256\ncorpus.txt\n"
        )
    root = sysconfig.get_paths()["stdlib"]
    # absolute: the runs work in the repo's root, not in this process's working folder
    return {"path": str(path.resolve()), "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "source": f"*.py under {root}, no {', '.join(sorted(EXCLUDED_DIRS))} folders",
            "python": sys.version.split()[0]}  # fmt: skip


def command(args: argparse.Namespace, setting: str, seed: int, corpus: str) -> list[str]:
    """The train command of one run."""
    cmd = [sys.executable, "-m", "offloadopt", "train", "--preset", args.preset,
           "--device", args.device, "--dtype", args.dtype, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
           "--grad-clip", str(args.grad_clip), "--data", corpus, "--seed", str(seed),
           "--no-progress", *SETTINGS[setting]]  # fmt: skip
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if setting != REFERENCE:
        cmd += ["--offload-fraction", str(args.offload_fraction)]
    return cmd


def summary_of(log: str) -> dict | None:
    """The train command's JSON summary: the last log line that is a JSON object with a
    ``final_heldout_loss``; None if there is none."""
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "final_heldout_loss" in row:
                return row
    return None


def last_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[-1] if lines else "(empty log)"


def core_slices(parallel: int) -> list[list[int]] | None:
    """This process's cores split into ``parallel`` disjoint slices, one per run slot, or None
    (one slot, fewer cores than slots, or no ``taskset``): runs then share every core.

    P runs that each start as many OpenMP threads as there are cores oversubscribe the host
    (on 2 cores, two CPU runs went from 0.5 s to 3 s per step); a run pinned to its slice sees
    only those cores (HybridAdamW's CPU worker and torch size their thread pools by the
    affinity mask)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if parallel == 1 or len(cores) < parallel or shutil.which("taskset") is None:
        return None
    n = len(cores) // parallel
    return [cores[i * n : (i + 1) * n] for i in range(parallel)]


def run_one(
    args, setting: str, seed: int, corpus: str, runs: Path, cores: list[int] | None
) -> dict:
    """One run as a subprocess (pinned to ``cores`` if given); its log and summary written
    beside the others. Returns the result row: the summary, or the exit code and the log's
    last line."""
    name = f"{setting}-seed{seed}"
    cmd = command(args, setting, seed, corpus)
    if cores is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"  # the log in the order written: a failure's message last
    t0 = time.perf_counter()
    with open(runs / f"{name}.log", "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall_s = time.perf_counter() - t0
    text = (runs / f"{name}.log").read_text(errors="replace")
    row = {"setting": setting, "seed": seed, "command": shlex.join(cmd), "wall_s": wall_s,
           "cores": cores}  # fmt: skip
    summary = summary_of(text) if rc == 0 else None
    if summary is None:
        why = last_line(text) if rc != 0 else "no JSON summary in the log"
        return {**row, "exit_code": rc, "error": why}
    (runs / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return {**row, "exit_code": 0, "summary": summary}


def _train_options(cmd: list[str]) -> list[str]:
    """A run command's options after ``train``, without ``--data``'s path (the same corpus in a
    moved folder is the same run)."""
    rest = cmd[cmd.index("train") + 1 :]
    i = rest.index("--data")
    return rest[:i] + rest[i + 2 :]


def _by_flag(options: list[str]) -> dict[str, str]:
    """``["--steps", "3", "--no-progress"]`` -> ``{"--steps": "3", "--no-progress": ""}``."""
    out: dict[str, str] = {}
    for i, word in enumerate(options):
        if word.startswith("--"):
            nxt = options[i + 1] if i + 1 < len(options) else "--"
            out[word] = "" if nxt.startswith("--") else nxt
    return out


def check_done(args, setting: str, seed: int, path: Path) -> None:
    """A kept run must have been run with this command's options (not other --steps...): the
    first line of its log holds its command. Raises ``UsageError`` naming the difference."""
    log = path.with_suffix(".log")
    first = log.read_text(errors="replace").split("\n", 1)[0] if log.exists() else ""
    if not first.startswith("$ "):
        raise checks.UsageError(f"{str(log)!r} holds no command line: cannot tell how "
                                f"{path.name} was run (--force reruns it)")  # fmt: skip
    was = _train_options(shlex.split(first[2:]))
    now = _train_options(command(args, setting, seed, "-"))
    if was != now:
        a, b = _by_flag(was), _by_flag(now)
        diff = [f"{k} {a.get(k, '(none)')} -> {b.get(k, '(none)')}" for k in {**a, **b}
                if a.get(k) != b.get(k)]  # fmt: skip
        raise checks.UsageError(
            f"{str(path)!r} was run with other options ({'; '.join(diff) or 'in another order'}): "
            "use another --out, or --force to rerun it")  # fmt: skip


def environment(args) -> dict:
    import torch

    info = {"torch": torch.__version__, "gpu": None, "git_commit": None}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True).stdout.strip()  # fmt: skip
            info["git_commit"] = head.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:  # no git here
        pass
    return info


def _f(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def table(results: dict) -> str:
    """The markdown table of a quality.json's content, with its footer."""
    by: dict[str, list[dict]] = {}
    for row in results["runs"]:
        by.setdefault(row["setting"], []).append(row)

    def losses(setting):
        return [r["summary"]["final_heldout_loss"] for r in by.get(setting, ()) if "summary" in r]

    def judge(ref_name: str, mean: float | None, setting: str) -> tuple[float | None, str]:
        """(mean - the reference's mean, the verdict) against ``ref_name``'s seeds."""
        ref = losses(ref_name)
        diff = mean - statistics.mean(ref) if mean is not None and ref else None
        if setting == ref_name:
            return diff, "reference"
        if mean is None:
            return diff, "n/a (no run done)"
        if not ref:
            return diff, f"n/a (no {ref_name} run)"
        if len(ref) < 2:
            return diff, f"n/a ({ref_name} needs >= 2 seeds)"
        bound = max(2 * statistics.stdev(ref), max(ref) - min(ref))
        short = "torch" if ref_name == REFERENCE else ref_name
        return diff, f"within {short}'s seed spread" if abs(diff) <= bound else "outside"

    lines = ["| setting | seeds | held-out loss per seed | mean | std | mean - torch | verdict "
             "| median step ms | peak GPU GB | mean - fp32 | vs fp32 |", "|" + "---|" * 11]  # fmt: skip
    for setting, rows in by.items():
        cells = []
        for r in sorted(rows, key=lambda r: r["seed"]):
            if "summary" in r:
                cells.append(f"{r['summary']['final_heldout_loss']:.4f}")
            else:
                why = r["error"].replace("|", "/")
                why = why if len(why) <= 100 else why[:97] + "..."
                cells.append(f"seed {r['seed']} failed (exit {r['exit_code']}: {why})")
        got = losses(setting)
        mean = statistics.mean(got) if got else None
        std = statistics.stdev(got) if len(got) >= 2 else None
        diff, verdict = judge(REFERENCE, mean, setting)
        diff32, verdict32 = judge(MASTER_REFERENCE, mean, setting)
        done = [r["summary"] for r in rows if "summary" in r]
        ms = statistics.median(s["median_step_ms"] for s in done) if done else None
        gb = max(s["peak_gpu_gb"] for s in done) if done else None
        lines.append(f"| {setting} | {len(rows)} | {', '.join(cells)} | {_f(mean)} | {_f(std)} | "
                     f"{_f(diff, '+.4f')} | {verdict} | {_f(ms, '.1f')} | {_f(gb, '.2f')} | "
                     f"{_f(diff32, '+.4f')} | {verdict32} |")  # fmt: skip
    a = results["args"]
    c = results["corpus"]
    lines += [
        "",
        f"{a['preset']}, {a['dtype']} on {results.get('gpu') or a['device']}, {a['steps']} steps "
        f"of {a['batch_size']} x {a['seq_len']} tokens, lr {a['lr'] or 'the preset default'}, "
        f"grad clip {a['grad_clip']}, offload fraction {a['offload_fraction']}; held-out loss in "
        f"nats/byte over {a['eval_batches']} batches of the corpus's last 10% "
        f"({c['nbytes']:,} bytes, sha256 {c['sha256'][:12]}); torch {results['torch']}, "
        f"commit {results.get('git_commit') or 'unknown'}.",
        f"Verdict: within torch's seed spread when {RULE} over {REFERENCE}'s seeds "
        f"(std: sample, n - 1), else outside; vs fp32: the same rule over {MASTER_REFERENCE}'s "
        "seeds (HybridAdamW's default, fp32 masters and moments).",
    ]
    if a["dtype"] == "bf16" and REFERENCE in by:
        lines.append(f"{REFERENCE} on bf16 params: bf16 weights and moments, no fp32 master "
                     "(torch's AdamW as it is); fp32 is HybridAdamW with fp32 masters and moments.")  # fmt: skip
    if a.get("parallel", 1) > 1:
        lines.append(f"{a['parallel']} runs at once: step times are those of a shared machine.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        print(table(json.loads((out / "quality.json").read_text())))
        return 0
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    try:
        corpus = write_corpus(out, args.force)
    except checks.UsageError as e:
        print(f"quality.py: error: {e}", file=sys.stderr)
        return 2
    todo, rows = [], {}
    for setting, seed in runs_of(args):
        path = runs_dir / f"{setting}-seed{seed}.json"
        if path.exists() and not args.force:
            summary = json.loads(path.read_text())
            try:
                check_done(args, setting, seed, path)
            except checks.UsageError as e:
                print(f"quality.py: error: {e}", file=sys.stderr)
                return 2
            rows[setting, seed] = {"setting": setting, "seed": seed, "exit_code": 0,
                                   "summary": summary, "kept": True}  # fmt: skip
        else:
            todo.append((setting, seed))
    if rows:
        print(f"{len(rows)} run(s) kept from {runs_dir}; {len(todo)} to run", file=sys.stderr)
    left = len(todo)
    slots: queue.Queue[list[int] | None] = queue.Queue()
    for cores in core_slices(args.parallel) or [None] * args.parallel:
        slots.put(cores)

    def slotted(setting: str, seed: int) -> dict:
        cores = slots.get()  # a free slot always waits: the pool runs at most P at once
        try:
            return run_one(args, setting, seed, corpus["path"], runs_dir, cores)
        finally:
            slots.put(cores)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel)
    try:
        futures = [pool.submit(slotted, s, k) for s, k in todo]
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            left -= 1
            rows[row["setting"], row["seed"]] = row
            loss = row["summary"]["final_heldout_loss"] if "summary" in row else None
            what = f"loss {loss:.4f}" if loss is not None else \
                f"FAILED exit {row['exit_code']}: {row['error'][:150]}"  # fmt: skip
            print(f"{row['setting']} seed {row['seed']}: {what}, {row['wall_s']:.1f} s, "
                  f"{left} run(s) left", file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        # the runs started got Ctrl-C too (one process group); the queued ones must not start
        pool.shutdown(wait=True, cancel_futures=True)
        print(f"interrupted: the same command continues from the {len(rows)} run(s) done",
              file=sys.stderr)  # fmt: skip
        return 130
    finally:
        pool.shutdown(wait=True)
    ordered = [rows[key] for key in runs_of(args)]
    results = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None
               else shlex.join(["benchmarks/quality.py", *argv]),
               "args": {k: v for k, v in vars(args).items()},
               "corpus": corpus, **environment(args), "runs": ordered}  # fmt: skip
    (out / "quality.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    failed = [f"{r['setting']} seed {r['seed']}" for r in ordered if "summary" not in r]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)} (logs in {runs_dir})",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
