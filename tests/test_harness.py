"""The harness: GPT-2 model, byte data, the training loop and the ``train`` command (CPU, fast)."""

import dataclasses
import json
import math

import pytest
import torch

from offloadopt.cli import main
from offloadopt.harness.data import byte_entropy_nats, get_batch, load_text, mock_data
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.harness.train import TrainConfig, lr_at, make_model_and_optimizer, train

# a short run: a few seconds on 2 cores
SHORT = dict(steps=12, batch_size=8, seq_len=64, eval_every=6, eval_batches=2, progress=False)


# --- model ---------------------------------------------------------------------------------


def test_first_loss_is_ln_vocab():
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 8, cfg.block_size), generator=gen)
    _, loss = model(idx, targets)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_head_is_tied_to_token_embedding():
    model = GPT(PRESETS["tiny"])
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    # still one Parameter after the bf16 cast of the harness
    cfg = TrainConfig(optimizer="adamw", dtype="bf16").resolved()
    model, _ = make_model_and_optimizer(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_gpt2_init():
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    params = dict(model.named_parameters())
    # 16384 draws: the sample std is within 3% of the target with overwhelming probability
    proj = params["transformer.h.0.mlp.c_proj.weight"]
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.03)
    assert params["transformer.h.0.mlp.c_fc.weight"].std().item() == pytest.approx(0.02, rel=0.03)
    assert all(p.count_nonzero() == 0 for n, p in params.items() if n.endswith(".bias"))


def test_attention_is_causal():
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)  # past: bitwise unchanged
    assert not torch.equal(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-xl"])
def test_param_count_formula_matches_model(name):
    with torch.device("meta"):  # no memory: gpt2-xl would be 6.2 GB in fp32
        model = GPT(PRESETS[name])
    assert model.num_params() == PRESETS[name].num_params()


def test_gpt2_xl_has_1_56e9_params():
    assert PRESETS["gpt2-xl"].num_params() == pytest.approx(1.557e9, rel=1e-3)
    assert PRESETS["gpt2"].num_params() == pytest.approx(124.5e6, rel=1e-3)


# --- data ----------------------------------------------------------------------------------


def test_entropy_of_known_strings():
    assert byte_entropy_nats(b"aaaa") == 0.0
    assert byte_entropy_nats(b"abab") == pytest.approx(math.log(2), abs=1e-12)
    # p = (2/3, 1/3): -(2/3 ln 2/3 + 1/3 ln 1/3) = ln 3 - (2/3) ln 2 = 0.636514168...
    assert byte_entropy_nats(b"aab") == pytest.approx(0.6365141682948128, abs=1e-12)
    assert byte_entropy_nats(torch.tensor([97, 97, 98], dtype=torch.uint8)) == pytest.approx(
        0.6365141682948128, abs=1e-12
    )
    with pytest.raises(ValueError):
        byte_entropy_nats(b"")


def test_default_text_entropy_is_english_like():
    data = load_text()
    assert 2.8 < data.entropy_nats < 3.6
    assert len(data.train) > 9 * len(data.heldout) - 10


def test_split_is_disjoint_and_held_out_is_the_end(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"a" * 900 + b"b" * 100)
    data = load_text(str(path))
    assert data.train.dtype == torch.uint8 and data.heldout.dtype == torch.uint8
    assert len(data.train) == 900 and len(data.heldout) == 100
    assert bool((data.train == ord("a")).all()) and bool((data.heldout == ord("b")).all())
    gen = torch.Generator().manual_seed(0)
    x, _ = get_batch(data, "heldout", 16, 32, gen)
    assert bool((x == ord("b")).all())  # held-out batches never read training bytes


def test_batches_are_shifted_windows_and_seeded():
    data = load_text()
    x, y = get_batch(data, "train", 4, 32, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = bytes(data.train.tolist())
    for row, target in zip(x, y, strict=True):
        assert bytes(row.tolist()) + bytes([int(target[-1])]) in text
    x2, y2 = get_batch(data, "train", 4, 32, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_mock_batches_cover_the_vocab_range():
    data = mock_data(50304)
    assert data.entropy_nats == pytest.approx(math.log(50304))
    x, y = get_batch(data, "train", 8, 64, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and int(x.min()) >= 0 and int(x.max()) < 50304
    assert int(x.max()) > 256  # not bytes
    assert torch.equal(x[:, 1:], y[:, :-1])


# --- training ------------------------------------------------------------------------------


def test_lr_schedule():
    assert lr_at(1, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(1, 1.0, 0, 100) == pytest.approx(1.0, rel=1e-3)


@pytest.mark.slow
def test_train_returns_summary_and_loss_decreases():
    out = train(TrainConfig(optimizer="adamw", **SHORT))
    for key in (
        "final_train_loss",
        "final_heldout_loss",
        "entropy_nats",
        "heldout_below_entropy",
        "median_step_ms",
        "tokens_per_s",
        "peak_gpu_gb",
        "params",
        "host_rss_gb",
    ):
        assert key in out, key
    assert out["params"] == PRESETS["tiny"].num_params()
    assert out["first_train_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert out["final_train_loss"] < out["first_train_loss"] - 1.0
    assert out["final_heldout_loss"] < math.log(256) - 1.0
    assert out["median_step_ms"] > 0 and out["tokens_per_s"] > 0
    json.dumps(out)  # the summary is the last line: it must serialise


@pytest.mark.slow
def test_hybrid_trains_bitwise_like_fused_adamw():
    # fp32 on the CPU: HybridAdamW at fraction 1 runs torch's fused kernel on its own state,
    # so the whole run must match torch.optim.AdamW(fused=True) exactly (README, "How it works")
    ref = train(TrainConfig(optimizer="adamw", **SHORT))
    hyb = train(TrainConfig(optimizer="hybrid", min_offload_numel=1, **SHORT))
    for key in ("first_train_loss", "final_train_loss", "final_heldout_loss"):
        assert hyb[key] == ref[key], key


def test_train_speculate_is_bitwise_the_clipped_backward_run():
    """``offloadopt train --overlap backward --speculate``: the same losses as without it, and
    the summary says how often the clip undid the speculative updates."""
    kw = dict(SHORT, steps=4, eval_every=4, optimizer="hybrid", min_offload_numel=1,
              overlap="backward", grad_clip=1.0)  # fmt: skip
    ref = train(TrainConfig(**kw))
    spec = train(TrainConfig(speculate=True, **kw))
    for key in ("first_train_loss", "final_train_loss", "final_heldout_loss"):
        assert spec[key] == ref[key], key
    assert ref["speculation"] is None
    counts = spec["speculation"]  # after a redo the next step is held back (speculate.py)
    assert counts["steps"] + counts["held_back"] == 4 and counts["redone_clip"] >= 1, counts


def test_invalid_config_raises():
    with pytest.raises(ValueError, match="preset"):
        TrainConfig(preset="gpt5").resolved()
    with pytest.raises(ValueError, match="--seq-len: 4096 is more than the tiny preset's"):
        TrainConfig(seq_len=4096).resolved()


def test_train_combinations_for_python_callers():
    with pytest.raises(ValueError, match=r"^--warmup-steps: 4 is more than --steps 3 "):
        TrainConfig(steps=3, warmup_steps=4).resolved()
    assert TrainConfig(steps=3, warmup_steps=3).resolved().warmup_steps == 3
    with pytest.raises(ValueError, match=r"^--offload-fraction auto with --overlap delayed: "):
        TrainConfig(offload_fraction="auto", overlap="delayed").resolved()
    # with a budget the optimizer takes auto in delayed mode: the budget chooses the fraction
    ok = TrainConfig(offload_fraction="auto", overlap="delayed", max_gpu_memory=10**9).resolved()
    assert ok.offload_fraction == "auto"


def test_cli_train_prints_json_last(capsys):
    argv = [
        "train",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--optimizer",
        "adamw",
        "--no-progress",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("data: ")
    assert any(line.startswith("step ") for line in lines)
    summary = json.loads(lines[-1])
    assert summary["steps"] == 2 and summary["optimizer"] == "adamw"
    assert summary["entropy_nats"] == pytest.approx(load_text().entropy_nats)


def test_cli_errors_are_one_line_not_tracebacks(capsys):
    from offloadopt.cli import main

    assert main(["train", "--steps", "0"]) == 2
    assert capsys.readouterr().err == "offloadopt: error: --steps: 0 is not an integer >= 1\n"
    assert main(["train", "--data", "/nonexistent/file.txt", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "offloadopt: error: --data: '/nonexistent/file.txt': no such file\n"


def cpu_stands_in_for_the_gpu(monkeypatch) -> None:
    """train takes --max-gpu-memory on this CPU-only run, the CPU standing in for the GPU as in
    the library's budget tests (a user's run without a GPU refuses it: check_fits_device)."""
    from offloadopt.harness import build
    from offloadopt.harness import train as train_module

    def fits(cfg, device, total=None):
        build.check_fits_device(dataclasses.replace(cfg, max_gpu_memory=None), device, total)

    monkeypatch.setattr(train_module, "check_fits_device", fits)


def test_main_job_takes_a_gpu_budget_and_reports_the_choice(capsys, monkeypatch):
    from offloadopt.harness.train import TrainConfig, train

    cpu_stands_in_for_the_gpu(monkeypatch)
    summary = train(TrainConfig(steps=2, eval_every=2, eval_batches=1, progress=False,
                                max_gpu_memory=20 * 10**6))  # fmt: skip
    # 20 MB holds the tiny model's weights, grads and state: nothing needs to move
    assert summary["offload_fraction"] == 0.0
    assert summary["placement_choice"]["max_gpu_memory"] == 20 * 10**6
    assert "max_gpu_memory 20,000,000 bytes" in capsys.readouterr().out


@pytest.mark.slow
def test_main_job_says_why_a_gpu_budget_cannot_be_met(capsys, monkeypatch):
    import subprocess
    import sys

    with monkeypatch.context() as patched:
        cpu_stands_in_for_the_gpu(patched)
        assert main(["train", "--max-gpu-memory", "8MB", "--steps", "1", "--no-progress"]) == 1
    assert "cannot be met: the fewest device bytes" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "offloadopt", "train", "--max-gpu-memory", "lots"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--max-gpu-memory: Invalid size: 'lots'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "offloadopt", "train", "--max-gpu-memory", "1GB",
                        "--optimizer", "adamw"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--max-gpu-memory: HybridAdamW's option" in r.stderr


@pytest.mark.parametrize(
    "name",
    ["gpt-9b", "gpt-13b", "gpt-17.5b", "gpt-18b", "gpt-25b", "gpt-30b", "gpt-32b", "gpt-40b"],
)
@pytest.mark.slow
def test_the_width_4096_presets_count_their_params(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert model.num_params() == PRESETS[name].num_params()
    assert PRESETS[name].n_embd == 4096 and PRESETS[name].vocab_size == 256  # byte text


def test_every_preset_has_a_batch_size_and_learning_rate():
    # gpt-25b, gpt-30b and gpt-32b were in PRESETS but not RUN_DEFAULTS: `train --preset gpt-25b`
    # failed with KeyError before building anything
    from offloadopt.harness.options import RUN_DEFAULTS, TrainConfig

    assert set(RUN_DEFAULTS) == set(PRESETS)
    for name in PRESETS:
        cfg = TrainConfig(preset=name).resolved()
        assert cfg.batch_size >= 1 and 0 < cfg.lr <= 3e-3


def test_the_largest_preset_is_over_17_5e9_params():
    assert PRESETS["gpt-17.5b"].num_params() >= 17.5e9
    assert PRESETS["gpt-18b"].num_params() == pytest.approx(17.93e9, rel=1e-3)
    # the compressed-state presets: past 25e9 (int8 moments) and 30e9 (bf16-sr + int8)
    assert 25e9 <= PRESETS["gpt-25b"].num_params() < 25.5e9
    assert 30e9 <= PRESETS["gpt-30b"].num_params() < 30.5e9
    assert PRESETS["gpt-32b"].num_params() == pytest.approx(32.22e9, rel=1e-3)
    assert 40e9 <= PRESETS["gpt-40b"].num_params() < 40.5e9


def test_the_model_is_built_in_its_dtype_never_in_fp32_first(monkeypatch):
    made = []
    original = GPT._init_weights

    def spy(module):
        made.extend(p.dtype for p in module.parameters(recurse=False))
        original(module)

    monkeypatch.setattr(GPT, "_init_weights", staticmethod(spy))
    model, _ = make_model_and_optimizer(
        TrainConfig(dtype="bf16", optimizer="adamw", progress=False).resolved()
    )
    assert made and set(made) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored


@pytest.mark.slow
def test_main_job_backward_mode_with_auto_fraction_release_and_checkpointing(capsys):
    # auto measures its choice at the 16th step (probe, baseline, verify)
    out = train(TrainConfig(overlap="backward", release_grads=True, grad_clip=0.0,
                            checkpointing=True, offload_fraction="auto",
                            **dict(SHORT, steps=18)))  # fmt: skip
    choice = out["placement_choice"]
    assert choice["set_by"] == "auto" and choice["measured_step_ms"] > 0
    assert out["offload_fraction"] == choice["fraction"]
    assert out["final_train_loss"] < out["first_train_loss"] - 1.0
    assert "placement: offload fraction" in capsys.readouterr().out


@pytest.mark.slow
def test_main_job_backward_mode_clips_through_the_optimizer(monkeypatch):
    """--overlap backward with --grad-clip clips inside the update: torch's clip_grad_norm_
    is never called (it would make the updates wait for step())."""
    calls = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(a))
    model, opt = make_model_and_optimizer(
        TrainConfig(overlap="backward", grad_clip=1.0, progress=False).resolved()
    )
    assert opt.max_grad_norm == 1.0 and opt.overlap == "backward"
    out = train(TrainConfig(overlap="backward", grad_clip=1.0, **SHORT))
    assert not calls and out["final_train_loss"] < out["first_train_loss"] - 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--release-grads"],
            "--release-grads: frees grads during backward, so it needs --overlap backward",
        ),
        (
            ["--release-grads", "--overlap", "backward", "--ddp"],
            "and no --ddp (DDP owns its grad buckets; got --overlap 'backward', --ddp)",
        ),
        (
            ["--offload-fraction", "auto", "--optimizer", "adamw"],
            "--offload-fraction auto: HybridAdamW's option",
        ),
        (
            ["--offload-fraction", "automatic"],
            "'automatic' is not a number (a number in [0, 1], or auto)",
        ),
        (
            ["--max-gpu-memory", "10MB", "--offload-fraction", "0.3"],
            "--offload-fraction 0.3 with --max-gpu-memory",
        ),
    ],
)
def test_main_job_refuses_options_that_cannot_combine(capsys, args, message):
    assert main(["train", "--steps", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_model_or_budget_larger_than_the_gpu_is_refused_before_the_build():
    # on an H100 (85.0 GB) `--max-gpu-memory 140GB` was taken without a word, and gpt-40b
    # built for a minute before it ran out of memory
    from offloadopt.harness.build import check_fits_device
    from offloadopt.harness.checks import UsageError
    from offloadopt.harness.options import TrainConfig

    gpu, h100, gib48 = torch.device("cuda"), 85_031_714_816, 48 * 2**30
    big = TrainConfig(preset="gpt-40b", device="cuda", dtype="bf16")
    with pytest.raises(
        UsageError,
        match=r"gpt-40b: its weights alone are 80\.16 GB .* in bf16, "
        r"more than cuda holds \(51\.54 GB",
    ):
        check_fits_device(big, gpu, total=gib48)
    check_fits_device(big, gpu, total=h100)  # the weights fit; the budget decides the rest
    over = TrainConfig(preset="gpt-40b", device="cuda", dtype="bf16", max_gpu_memory="140GB")
    with pytest.raises(
        UsageError,
        match=r"--max-gpu-memory 140GB: more than cuda holds "
        r"\(85\.03 GB",
    ):
        check_fits_device(over, gpu, total=h100)
    check_fits_device(over, gpu, total=150_000_000_000)
    # on the CPU the host's memory: gpt-40b in fp32 built for 78 s until the OOM killer came,
    # and a batch of 1e8 sequences failed in the allocator with status 1 (a new user's finds)
    cpu, host = torch.device("cpu"), 24 * 10**9
    on_cpu = TrainConfig(preset="gpt-40b", dtype="fp32")
    with pytest.raises(UsageError, match=r"weights alone are 160\.32 GB .* more than cpu holds"):
        check_fits_device(on_cpu, cpu, total=host)
    huge = TrainConfig(preset="tiny", dtype="fp32", batch_size=10**8)
    with pytest.raises(
        UsageError,
        match=r"--batch-size 100000000: one micro-batch's logits "
        r"alone are 13\.11 TB",
    ):
        check_fits_device(huge, cpu, total=host)
    check_fits_device(TrainConfig(preset="tiny", dtype="fp32", batch_size=64), cpu, total=host)
    # gpt2-xl's fp32 weights (6.2 GB) fit 22 GB free, its weights, grads and AdamW state (16
    # bytes a param, 24.9 GB) do not: the OOM killer ended the run, with no error (a new
    # user's find); int8 moments (10 bytes a param) fit
    xl, free = TrainConfig(preset="gpt2-xl", dtype="fp32", batch_size=1), 22 * 10**9
    with pytest.raises(
        UsageError,
        match=r"gpt2-xl: its weights, grads and optimizer state are about 24\.92 GB .*, 16 "
        r"bytes a param in fp32 with --optimizer hybrid: more than cpu holds \(22\.00 GB",
    ):
        check_fits_device(xl, cpu, total=free)
    check_fits_device(dataclasses.replace(xl, state_dtype="int8"), cpu, total=free)
    with pytest.raises(UsageError, match=r", 16 bytes a param in fp32 with --optimizer adamw: "):
        check_fits_device(dataclasses.replace(xl, optimizer="adamw"), cpu, total=free)
    budget = TrainConfig(preset="tiny", dtype="fp32", max_gpu_memory="140GB")
    # a budget on the CPU path is no budget of the host's memory: a run without a GPU refuses it
    with pytest.raises(UsageError, match=r"^--max-gpu-memory 140\.00 GB .*: a budget of GPU memory, "
                       r"and this run has no GPU"):  # fmt: skip
        check_fits_device(budget, cpu, total=host)
