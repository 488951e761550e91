"""``offloadopt train --grad-accum N`` (issue 47): bitwise torch.optim.AdamW(fused=True) trained
on the same micro-batches with the same accumulation in every mode that is bitwise today, a
resumed run bitwise the uninterrupted one, the throughput figures and ``--measure-fwd-bwd``
(CPU, tiny preset, a few seconds)."""

import json
import re
from dataclasses import replace

import pytest
import torch
from oracle import DelayedReference

from offloadopt.cli import main
from offloadopt.harness import throughput, train
from offloadopt.harness.data import get_batch, load_text
from offloadopt.harness.options import TrainConfig
from offloadopt.state.integrity import fsync_save

N = 3  # micro-batches a step
KW = dict(steps=4, batch_size=2, seq_len=32, grad_accum=N, eval_every=4, eval_batches=1,
          progress=False)  # fmt: skip

# The modes whose runs are bitwise torch's today: step mode at any fraction
# (tests/test_parity.py), backward mode with grads declared final, clipped through the
# optimizer or with grads released (tests/test_overlap.py), speculation (tests/test_speculate.py),
# and the delayed update against its torch reference (tests/test_delayed.py, oracle.py). The
# compressed states (int8, bf16-sr) are not torch's math: their resume is checked below.
MODES = {
    "adamw": dict(optimizer="adamw"),
    "step": dict(),
    "step-fraction-0.5": dict(offload_fraction=0.5, min_offload_numel=1),
    "backward-grads-final": dict(overlap="backward", grad_clip=0.0),
    "backward-clip": dict(overlap="backward"),
    "backward-release": dict(overlap="backward", grad_clip=0.0, release_grads=True),
    "backward-release-clip": dict(overlap="backward", release_grads=True),
    "backward-speculate": dict(overlap="backward", speculate=True),
    "delayed": dict(overlap="delayed"),
}


def run_harness(monkeypatch, cfg: TrainConfig):
    """``train(cfg)``: every step's loss (the full float), the model and optimizer it built, and
    the summary."""
    made, losses = [], []
    build, step = train.make_model_and_optimizer, train.train_step

    def built(c):
        made.append(build(c))
        return made[-1]

    def stepped(*args, **kwargs):
        loss = step(*args, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(train, "make_model_and_optimizer", built)
    monkeypatch.setattr(train, "train_step", stepped)
    summary = train.train(cfg)
    monkeypatch.undo()
    return losses, *made[0], summary


def reference(cfg: TrainConfig, delayed: list[int] | None = None):
    """The same run written out: the same model (seed, dtype) under torch.optim.AdamW(fused=True)
    (with ``delayed``, param indices: the delayed update's reference over torch's), the same
    schedule, the same micro-batches drawn from the same generator in order, each loss / N,
    torch's clip, step. Returns every step's loss and the final weights."""
    cfg = replace(cfg, optimizer="adamw", overlap="step", offload_fraction=1.0,
                  min_offload_numel=4096, release_grads=False, speculate=False).resolved()  # fmt: skip
    model, opt = train.make_model_and_optimizer(cfg)
    if delayed is not None:
        params = list(model.parameters())
        group = dict(params=params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        opt = DelayedReference(params, [group], delayed)
    groups = opt.opt.param_groups if delayed is not None else opt.param_groups
    data, gen, losses = load_text(), torch.Generator().manual_seed(cfg.seed), []
    for step in range(1, cfg.steps + 1):
        for g in groups:
            g["lr"] = train.lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        micro = [get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen) for _ in range(N)]
        total = None  # the step's loss: the sum of the divided losses, in order
        for x, y in micro:
            loss = model(x, y)[1] / N
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(total.item())
    if delayed is not None:
        opt.synchronize()
    return losses, [p.detach().clone() for p in model.parameters()]


SLOW_MODES = {"step-fraction-0.5", "backward-clip", "backward-release-clip", "backward-speculate"}


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODES else m for m in MODES]
)
def test_grad_accum_is_bitwise_torchs_adamw_on_the_same_micro_batches(monkeypatch, mode):
    cfg = TrainConfig(**KW, **MODES[mode])
    losses, model, opt, summary = run_harness(monkeypatch, cfg)
    delayed = None
    if mode == "delayed":  # the offloaded params train on weights one step old
        delayed = [i for i, p in enumerate(model.parameters()) if opt.is_offloaded(p)]
        assert delayed
    want_losses, want = reference(cfg, delayed)
    assert losses == want_losses and len(losses) == KW["steps"]
    for i, (got, ref) in enumerate(zip(model.parameters(), want, strict=True)):
        torch.testing.assert_close(got.detach(), ref, rtol=0, atol=0, msg=f"param {i}")
    assert summary["grad_accum"] == N and summary["final_train_loss"] == want_losses[-1]


# --- resume --------------------------------------------------------------------------------

STEPS = 3  # steps before the interrupt; the run has 2 * STEPS
ARGS = ["train", "--steps", str(2 * STEPS), "--batch-size", "2", "--seq-len", "32",
        "--grad-accum", str(N), "--eval-every", str(STEPS), "--eval-batches", "1",
        "--log-every", "1", "--no-progress"]  # fmt: skip


def _recorded(monkeypatch) -> list[float]:
    """Every step's loss (the full float) from here on."""
    real, losses = train.train_step, []

    def recorded(*args, **kwargs):
        loss = real(*args, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(train, "train_step", recorded)
    return losses


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "flags",
    [["--overlap", "step"], ["--overlap", "delayed"],
     pytest.param(["--overlap", "backward", "--release-grads", "--grad-clip", "0"],
                  marks=pytest.mark.slow),
     pytest.param(["--dtype", "bf16", "--state-dtype", "int8", "--master-weights", "bf16-sr",
                   "--offload-fraction", "0.5"], marks=pytest.mark.slow)],
    ids=str,
)  # fmt: skip
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, capsys, monkeypatch, flags):
    """Interrupted while step STEPS + 1 fetches its second micro-batch: the checkpoint holds
    STEPS optimizer steps (not micro-batches), and the resumed run draws that step's micro-batches
    again, in order, from the saved generator; every loss is the uninterrupted run's."""
    argv = [*ARGS, *flags]
    losses = _recorded(monkeypatch)
    assert main(argv) == 0
    whole, summary, losses[:] = list(losses), _last_json(capsys.readouterr().out), []
    assert len(whole) == 2 * STEPS

    real_get_batch, fetched = train.get_batch, []

    def interrupted(data, split, *args, **kwargs):
        if split == "train":
            fetched.append(1)
            if len(fetched) == N * STEPS + 2:
                raise KeyboardInterrupt
        return real_get_batch(data, split, *args, **kwargs)

    monkeypatch.setattr(train, "get_batch", interrupted)
    ck = str(tmp_path / "run.pt")
    assert main([*argv, "--save", ck, "--save-every", "1"]) == 130
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert losses == whole[:STEPS] and torch.load(ck, weights_only=True)["step"] == STEPS
    capsys.readouterr()
    # --measure-fwd-bwd may change on resume: it draws its own batches and takes no step
    assert main([*argv, "--resume", ck, "--measure-fwd-bwd", "1"]) == 0
    resumed = _last_json(capsys.readouterr().out)
    assert losses == whole and resumed["fwd_bwd_ms"] > 0
    for key in ("final_train_loss", "final_heldout_loss"):
        assert resumed[key] == summary[key], key


def test_grad_accum_is_the_saved_runs_and_old_checkpoints_had_1(tmp_path, capsys, monkeypatch):
    ck = str(tmp_path / "run.pt")
    argv = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches",
            "1", "--no-progress", "--save", ck, "--save-every", "1"]  # fmt: skip
    real_get_batch = train.get_batch

    def saved_at_step_1(accum: int) -> None:  # Ctrl-C as step 2 fetches its first batch
        fetched = []

        def interrupted(data, split, *args, **kwargs):
            fetched.append(split)
            if fetched.count("train") == accum + 1:
                raise KeyboardInterrupt
            return real_get_batch(data, split, *args, **kwargs)

        monkeypatch.setattr(train, "get_batch", interrupted)
        assert main([*argv, "--grad-accum", str(accum)]) == 130
        monkeypatch.setattr(train, "get_batch", real_get_batch)
        capsys.readouterr()

    saved_at_step_1(2)
    assert main([*argv, "--resume", ck]) == 2
    err = capsys.readouterr().err
    assert "--grad-accum 2 there, 1 here" in err and err.count("\n") == 1, err
    # a checkpoint saved before --grad-accum existed: its run had 1 micro-batch a step
    saved_at_step_1(1)
    saved = torch.load(ck, weights_only=True)
    for key in ("grad_accum", "measure_fwd_bwd"):
        del saved["config"][key]
    fsync_save(saved, ck)
    assert main([*argv, "--resume", ck]) == 0


# --- throughput ----------------------------------------------------------------------------

STEP_LINE = re.compile(r"^step +\d+/\d+ \| .* ms \| +[\d,]+ tok/s \| +[\d.]+ TFLOPS \| MFU +- \|")


def test_the_throughput_figures_are_consistent(capsys):
    out = train.train(TrainConfig(**KW))
    tokens = KW["batch_size"] * KW["seq_len"] * N
    assert out["tokens_per_step"] == tokens
    assert out["tokens_per_s"] * out["median_step_ms"] / 1e3 == pytest.approx(tokens, rel=1e-12)
    assert out["model_flops_per_step"] == 6 * out["params"] * tokens
    tflops = 6 * out["params"] * tokens / (out["median_step_ms"] * 1e-3) / 1e12
    assert out["achieved_tflops"] == pytest.approx(tflops, rel=1e-12)
    assert "not counted" in out["flops_note"]
    # no dense bf16 peak for a CPU: MFU is null and says why; the matmul is fp32, labelled
    assert out["mfu"] is None and out["peak_tflops"] is None and "CPU" in out["peak_source"]
    assert out["matmul_dtype"] == "fp32" and out["matmul_tflops"] > 0
    assert out["achieved_over_matmul"] == pytest.approx(
        out["achieved_tflops"] / out["matmul_tflops"]
    )
    assert out["fwd_bwd_ms"] is None and out["step_over_fwd_bwd"] is None
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and all(STEP_LINE.match(line) for line in steps), steps
    assert f"x {N} micro-batches = {tokens:,} tokens/step" in "\n".join(lines)
    assert any(line.startswith("throughput: 6 x ") and "fp32" in line for line in lines)


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
     ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce GTX 1080", None)],
)  # fmt: skip
def test_the_peak_is_looked_up_by_the_gpus_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = throughput.peak_of(torch.device("cuda"))
    assert peak.tflops == tflops and peak.device_name == name
    assert ("dense bf16" in peak.source) if tflops else ("MFU is null" in peak.source)
    rate = throughput.Throughput(10**9, 16384, peak, throughput.MatmulPeak(700.0, "bf16", 8192, 10))
    # 6 x 1e9 params x 16,384 tokens in 1 s: 98.3 TFLOPS
    assert rate.tflops(1000.0) == pytest.approx(98.304)
    assert rate.mfu(1000.0) == (None if tflops is None else pytest.approx(98.304 / tflops))
    assert rate.summary(1000.0, 800.0)["step_over_fwd_bwd"] == pytest.approx(1.25)


@pytest.mark.parametrize("overlap", ["step", pytest.param("backward", marks=pytest.mark.slow)])
def test_measuring_forward_and_backward_changes_no_loss(overlap):
    """--measure-fwd-bwd runs the step's micro-batches forward and backward before training,
    all inside opt.accumulating(): in backward mode with grads declared final no update starts,
    and no weight, state or batch of the run changes."""
    kw = dict(KW, overlap=overlap, grad_clip=0.0 if overlap == "backward" else 1.0)
    ref = train.train(TrainConfig(**kw))
    got = train.train(TrainConfig(measure_fwd_bwd=2, **kw))
    for key in ("first_train_loss", "final_train_loss", "final_heldout_loss"):
        assert got[key] == ref[key], key
    assert got["fwd_bwd_ms"] > 0
    assert got["step_over_fwd_bwd"] == got["median_step_ms"] / got["fwd_bwd_ms"]


@pytest.mark.slow
def test_auto_measures_whole_steps_with_accumulation_and_released_grads():
    """--offload-fraction auto with --grad-accum and --release-grads: the choice's windows span
    the whole optimizer step (both micro-batches), and the cost model knows there are 2."""
    # auto measures its choice at the 16th step (probe, baseline, verify)
    out = train.train(TrainConfig(**dict(KW, steps=18, grad_accum=2), offload_fraction="auto",
                                  overlap="backward", release_grads=True, grad_clip=0.0))  # fmt: skip
    choice = out["placement_choice"]
    assert choice["set_by"] == "auto" and choice["measurements"]["micro_steps"] == 2, choice
    assert choice["measured_step_ms"] > 0 and out["final_train_loss"] < out["first_train_loss"]
