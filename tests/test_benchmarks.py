"""The benchmark scripts still run, at toy sizes: the docs (docs/benchmarks.md) quote their output,
so a change that breaks one must fail here rather than in the next person's measurement. Nothing here looks at a
time; the comparisons themselves belong to the scripts."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import spark_dl.compression as C
from spark_dl.compression import native
from spark_dl.compression.stats import label

ROOT = Path(__file__).resolve().parent.parent
KERNEL_ROWS = ["1-bit+EF encode", "EF-sign encode", "fp16 encode /W", "bf16 encode /W", "QSGD-4bit encode",
               "top-k 1% encode", "1-bit decode+acc", "EF-sign dec+acc", "fp16 decode+acc", "bf16 decode+acc",
               "QSGD decode+acc", "1-bit decode (new)", "fp16 decode (new)", "QSGD decode (new)"]


def _run(*args: str) -> subprocess.CompletedProcess:
    # a stall is told after 30 s, so a script that hangs shows where each rank was
    env = dict(os.environ, PYTHONWARNINGS="ignore", HOROVOD_STALL_CHECK_TIME_SECONDS="30")
    try:
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240,
                              env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{args[0]} did not finish within 240 s; its stderr ends:\n{err[-6000:]}") from None


def test_kernels_benchmark_prints_a_verdict_per_row():
    done = _run("benchmarks/kernels.py", "--numel", "100003", "--repeats", "1")
    if not native.available():
        assert done.returncode != 0 and "spark_dl._native is not built" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("memory passes (GB/s read + written): copy_") for line in lines)
    for row in KERNEL_ROWS:
        line = next(line for line in lines if line.startswith(row))
        assert line.rstrip().endswith("met") or "out of reach" in line, line


def test_allocator_benchmark_compares_both_settings_for_training_steps_and_the_sign_encoders():
    done = _run("benchmarks/allocator.py", "--configs", "fp32,encode-efsign", "--rounds", "1", "--steps", "2",
                "--warmup", "1", "--hidden", "256")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for config in ("fp32", "encode-efsign"):
        rows = [line.split() for line in lines if line.startswith(config + " ")]
        assert [r[1] for r in rows] == ["reuse", "glibc", "ratio"], rows
        assert rows[0][-1] == "reuse" and rows[1][-1] == "off"  # what the ranks' allocator setting did


def test_compression_benchmark_runs_both_parts_or_says_why_not():
    done = _run("benchmarks/compression.py", "--layout", "square", "--numel", "40000", "--steps", "1",
                "--compressors", "fp32,qsgd-4bit,powersgd-r4")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for name in ("fp32", "fp16", "onebit", "qsgd-4bit", "topk-1%+ef", "powersgd-r4"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    if "Skipping the shaped-link all-reduce" in out:  # not root, no iproute2, or no namespaces here
        return
    table = out[out.index("2-rank all-reduce"):]
    for name in ("fp32", "qsgd-4bit", "powersgd-r4", "raw PowerSGD compute only", "raw PowerSGD's memory passes"):
        assert any(line.startswith(name + " ") for line in table.splitlines()), name
    # 200 x 200 at rank 4: P and Q are 200 x 4 floats each, PowerSGD's ideal bytes
    powersgd = next(line for line in table.splitlines() if line.startswith("powersgd-r4 "))
    assert powersgd.split()[1] == "6,400"
    assert "PowerSGD's memory floor on cpu: M = e + G" in table


def test_launch_benchmark_compares_waiting_for_the_zygote_with_fresh_ranks():
    done = _run("benchmarks/launch.py", "--back-to-back", "2", "--runs", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for name in ("wait for the zygote", "fresh beside it"):
        row = next(line for line in lines if line.startswith(name + " "))
        assert len(row.split("median")[1].split("total")[0].split()) == 2, row  # a time per run
    assert any(line.startswith("ratio of the totals, waiting / fresh: ") for line in lines), done.stdout


def test_error_feedback_benchmark_prints_every_comparison():
    done = _run("benchmarks/error_feedback.py", "--numel", "100003", "--repeats", "1", "--port", "29671")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for row in ("OneBit(None)", "OneBit(1024)", "EFSign()", "EFSign(None)", "ErrorFeedback(TopK)",
                "ErrorFeedback(RandomK)", "fp16", "bf16", "randomk"):
        assert any(line.startswith(row + " ") for line in lines), row
    assert any(line.startswith("2 local Gloo ranks") and "median" in line for line in lines)


def test_compression_benchmark_without_a_gpu_says_so_for_device_cuda():
    import torch

    if torch.cuda.is_available():
        return  # a GPU host runs the real thing (benchmarks/gpu_checks.sh)
    done = _run("benchmarks/compression.py", "--device", "cuda", "--skip-network")
    assert done.returncode == 2
    assert "--device cuda: torch" in done.stderr and "sees no CUDA device here" in done.stderr
    assert "Traceback" not in done.stderr


def test_compression_benchmark_on_resnet50_layers_counts_powersgd_per_weight():
    import importlib.util
    import math

    spec = importlib.util.spec_from_file_location("compression_bench", ROOT / "benchmarks" / "compression.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = bench.resnet50_shapes(8)
    assert len(shapes) == 161 and sum(math.prod(s) for s in bench.resnet50_shapes()) == 25_557_032
    # rank 4 per weight (shape[0] x the rest) where it saves 2x or more, the rest sent as is
    expected = 0
    for s in shapes:
        n, m = s[0], math.prod(s) // s[0]
        r = min(4, n, m)
        expected += 4 * (r * (n + m) if len(s) > 1 and n * m >= 2 * r * (n + m) else n * m)
    done = _run("benchmarks/compression.py", "--layout", "resnet50:8", "--steps", "1",
                "--compressors", "fp32,powersgd-r4")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any("resnet50:8's 161 gradients in one float32 bucket" in line for line in lines)
    rows = [line for line in lines if line.startswith("powersgd-r4 ")]
    assert rows and all(line.split()[2 if i == 0 else 1] == f"{expected:,}" for i, line in enumerate(rows)), rows


def test_checkpoint_benchmark_prints_both_comparisons():
    done = _run("benchmarks/checkpoint.py", "--mb", "1", "--reps", "1", "--runs", "1", "--steps", "20")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.split()[:1] == ["1"] and line.rstrip().endswith("x") for line in lines)  # the 1 MB row
    assert any(line.startswith("no failure ") for line in lines)
    assert any(line.startswith("rank 1 lost, restarted ") for line in lines)
    assert any(line.startswith("a lost rank cost ") and "steps redone" in line for line in lines)


def test_join_control_benchmark_prints_both_variants():
    done = _run("benchmarks/join_control.py", "--steps", "20", "--rounds", "1", "--widths", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("MLP 8-8-1"))
    assert row.split()[2] == "81" and row.count("ms") == 2  # 8*8+8 + 8+1 parameters
    assert "the agreement's all-reduce alone" in done.stdout


def test_hvd_checks_benchmark_prints_a_ratio_per_size():
    done = _run("benchmarks/hvd_checks.py", "--calls", "10", "--rounds", "1", "--sizes", "1,1000")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["1,000"])]
    assert len(rows) == 2 and all(len(row) == 6 and row[2] == row[4] == "ms" for row in rows)
    assert "the check alone" in done.stdout


def test_powersgd_round_benchmark_profiles_and_compares_the_orthonormalizations():
    done = _run("benchmarks/powersgd_round.py", "--device", "cpu", "--layout", "resnet50:4", "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "(resnet50:4, 161 tensors)" in out and out.count("ms wall (synchronized)") == 1
    assert re.search(r"orthonormal P for \d+ matrices in \d+ shape groups", out)
    for way in ("batched QR on the device", "batched Gram-Schmidt", "batched Cholesky-QR"):
        assert any(line.strip().startswith(way) and float(line.split()[-1]) > 0 for line in out.splitlines()), way
    err = float(out.rsplit("|P^T P - I| on the first group: ", 1)[1].split(")")[0])
    assert err < 1e-5  # the Gram-Schmidt variant is a real orthonormalization


def test_ddp_hooks_benchmark_compares_with_torchs_hooks():
    done = _run("benchmarks/ddp_hooks.py", "--loopback", "--width", "64", "--depth", "2", "--steps", "1",
                "--warmup", "3", "--bucket-mb", "0.01")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "Gloo over loopback" in out and "(--loopback)" in out
    rows = {line[:34].strip(): line[34:].split() for line in out.splitlines() if line[:34].strip()
            and len(line[34:].split()) == 2 and line.rstrip().endswith("x")}
    assert set(rows) == {"ddp fp32", "torch fp16_compress_hook", "spark-dl FP16", "spark-dl FP16 overlap=True",
                         "torch powerSGD_hook r4", "spark-dl PowerSGD r4", "spark-dl PowerSGD r4 overlap=True",
                         "spark-dl QSGD 4-bit", "spark-dl top-k 1% + EF", "compute only (no communication)"}, rows
    assert "spark-dl PowerSGD r4 against torch powerSGD_hook r4: " in out


def _first_step_below(fraction: float, opt: str, steps: int) -> int | None:
    """The first step whose lr is below ``fraction`` of the peak so far under the benchmark's ``opt``
    (2 ranks, its lr and batch defaults), from the recipe's own scheduler; None at a constant lr."""
    from spark_dl.train import LargeBatchRecipe

    if opt == "sgd":
        return None
    recipe = LargeBatchRecipe(0.1, 32, per_rank_batch=32, world_size=2, steps_per_epoch=10, warmup_epochs=steps / 50,
                              epochs=steps / 10, decay="step" if opt == "recipe-step" else "cosine")
    opt_ = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=recipe.peak_lr)
    sched, peak = recipe.scheduler(opt_), 0.0
    for step in range(steps):
        lr = opt_.param_groups[0]["lr"]
        peak = max(peak, lr)
        if lr < fraction * peak:
            return step
        opt_.step()
        sched.step()
    return None


def test_convergence_benchmark_prints_a_row_per_compressor_optimizer_and_path():
    done = _run("benchmarks/convergence.py", "--seeds", "2", "--steps", "6", "--eval-every", "3",
                "--compressors", "onebit,powersgd,powersgd-r2-w3,efsign-b16,efsign-whole,onebit-own,randomk-r0.5,"
                "topk-norescale,onebit-w3,efsign-d95-c3",
                "--optimizers", "sgd,recipe,recipe-step", "--paths", "hvd,ddp-overlap", "--curves")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("convergence: model=digits ranks=2 seeds=2 steps=6")
    assert lines[1].startswith("machine: ") and " UTC; commit " in lines[1]
    for comp in ("none", "onebit", "powersgd", "powersgd-r2-w3", "efsign-b16", "efsign-whole",  # none: always run
                 "randomk-r0.5", "topk-norescale", "onebit-w3", "efsign-d95-c3"):
        for opt in ("sgd", "recipe", "recipe-step"):
            for path in ("hvd", "ddp-overlap"):
                row = next(line for line in lines if line.split()[:3] == [comp, opt, path])
                assert "±" in row, row
    # the settings reach PowerSGD: rank 2 after 3 uncompressed steps of 6 sends other bytes than rank 8 from the first
    bytes_of = {line.split()[0]: int(line.split()[6].replace(",", "")) for line in lines
                if line.split()[1:3] == ["sgd", "hvd"] and "±" in line}  # the table's rows, not the curves
    assert bytes_of["powersgd-r2-w3"] != bytes_of["powersgd"], bytes_of
    assert bytes_of["efsign-b16"] > bytes_of["efsign-whole"], bytes_of  # a scale per 16 elements, not per tensor
    assert bytes_of["onebit-own"] == bytes_of["onebit"], bytes_of  # the same payloads, of another vector
    assert bytes_of["onebit-w3"] > 2 * bytes_of["onebit"], bytes_of  # 3 of its 6 steps uncompressed
    assert abs(2 * bytes_of["randomk-r0.5"] - bytes_of["none"]) < 0.05 * bytes_of["none"], bytes_of  # half the entries
    assert bytes_of["efsign-d95-c3"] > 2 * bytes_of["efsign-b16"], bytes_of  # its last 3 of 6 steps uncompressed
    curves = lines.index("mean test accuracy every 3 steps:")
    assert lines[curves + 1].split()[:3] == ["none", "sgd", "hvd"] and len(lines[curves + 1].split()) == 5, lines
    assert lines[-1] == "132 runs in " + lines[-1].split(" runs in ")[1]
    # OneBit's switch to each rank's own gradient (and -dP's): at the step the lr first falls below 95% of
    # its peak (each decay's), never at a constant lr; none for -own, which has no shared velocity to leave
    at = lines.index("each rank's own gradient through the decay, per seed:")
    got = set(lines[at + 1:])
    for opt in ("sgd", "recipe", "recipe-step"):
        first = _first_step_below(0.95, opt, steps=6)
        assert (first is None) == (opt == "sgd") and first != 0, (opt, first)
        note = "never" if first is None else f"from step {first}"
        for comp in ("onebit", "onebit-w3", "efsign-d95-c3"):
            for path in ("hvd", "ddp-overlap"):
                assert f"  {comp} {opt} {path}: {note}; {note}" in got, (comp, opt, path, lines[at:])
    assert not any(line.split()[:1] in (["onebit-own"], ["efsign-b16"]) for line in lines[at + 1:]), lines[at:]
    # -own, -norescale, -wN, -cN and -dP need error feedback; P is a percent
    names = ["powersgd-r0-w1", "efsign-b0", "none-own", "qsgd-own", "topk-r0", "topk-r1.5", "randomk-rx",
             "fp16-norescale", "qsgd-w5", "qsgd-c3", "onebit-d101", "onebit"]
    bad = _run("benchmarks/convergence.py", "--compressors", ",".join(names))  # each is judged on its own
    assert bad.returncode == 2 and f"--compressors: unknown {names[:-1]}; choose from " in bad.stderr, bad.stderr
    assert "powersgd-r<rank >= 1>[-w<start_iter>], efsign-b<bucket_size >= 1>, topk-r<ratio in (0, 1]>, " \
        "randomk-r<ratio in (0, 1]>, or any of those with error feedback and -own, -norescale, -w<steps>, " \
        "-c<last steps> or -d<percent of the peak lr>" \
        in bad.stderr


def test_feedback_overhead_benchmark_times_each_mode_against_plain():
    done = _run("benchmarks/feedback_overhead.py", "--elements", "5000", "--rounds", "2", "--calls", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "feedback overhead: 2 ranks, loopback, rounds=2 calls=3" and lines[1].startswith("machine: ")
    rows = [line.split() for line in lines if re.match(r" *5,000  ", line)]
    assert [r[1] for r in rows] == ["onebit", "efsign"] * 2, done.stdout  # wall-clock, then CPU
    for r in rows:
        assert r[3] == "(1.000)" and all(float(v) > 0 for v in r[2::2]), r  # ms for plain, momentum, adam-own, adam
    bad = _run("benchmarks/feedback_overhead.py", "--compressors", "topk")
    assert bad.returncode == 2 and "--compressors: unknown ['topk']; choose from onebit, efsign" in bad.stderr
    bad = _run("benchmarks/feedback_overhead.py", "--elements", "1M")
    assert bad.returncode == 2 and "--elements: comma-separated integers" in bad.stderr, bad.stderr[-2000:]


def test_auto_overhead_benchmark_times_auto_against_its_own_pick():
    done = _run("benchmarks/auto_overhead.py", "--elements", "5000,8192", "--rounds", "2", "--calls", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r" *[\d,]+  [A-Za-z]", line)]
    assert [r[0] for r in rows] == ["5,000", "8,192"], done.stdout
    # the exact candidates; 12 calls after the pick are too few for a check, so no switch in the row
    picks = {"NoneCompressor", "FP16"}
    for r in rows:
        assert r[1] in picks and r[3] == "us" and r[5] == "us" and float(r[6]) > 0 and float(r[11]) > 0, r
    bad = _run("benchmarks/auto_overhead.py", "--elements", "1k")
    assert bad.returncode == 2 and "--elements: comma-separated integers" in bad.stderr, bad.stderr[-2000:]
    small = _run("benchmarks/auto_overhead.py", "--elements", "100")
    assert small.returncode == 2 and "each at least 4,096 (Auto's min_elements" in small.stderr, small.stderr[-2000:]


def test_convergence_benchmarks_oracle_adam_trains_as_torchs_adam_where_nothing_is_compressed():
    def accuracies(*extra: str) -> dict[tuple[str, str], float]:
        done = _run("benchmarks/convergence.py", "--seeds", "1", "--steps", "30", "--compressors", "none,efsign",
                    "--optimizers", "adam,adamw", "--paths", "hvd,ddp", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["none"], ["efsign"])]
        assert len(rows) == 8, done.stdout
        return {(r[0], r[1] + " " + r[2]): float(r[3]) for r in rows}

    own, oracle = accuracies(), accuracies("--oracle-second-moment")
    for key, acc in own.items():
        if key[0] == "none":  # the same gradients in both moments: torch's Adam and AdamW, to rounding
            assert abs(oracle[key] - acc) <= 0.01, (key, own, oracle)
    bad = _run("benchmarks/convergence.py", "--optimizers", "adam,sgd", "--oracle-second-moment")
    assert bad.returncode == 2 and "use it with --optimizers adam,adamw" in bad.stderr, bad.stderr[-2000:]


def test_convergence_benchmark_says_what_auto_picked_in_each_run():
    done = _run("benchmarks/convergence.py", "--seeds", "1", "--steps", "40", "--compressors", "auto",
                "--optimizers", "sgd", "--paths", "ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.split()[:3] == ["auto", "sgd", "ddp"] for line in lines), done.stdout
    at = lines.index("auto's picks at the end (over the tensors it decides):")
    # 40 steps: past the warm-up and the probe, so a pick among the candidates eligible under
    # momentum SGD (OneBit is one: it compresses the shared velocity). Which one wins is timing.
    auto = C.Auto()
    auto.observe_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9))
    eligible = {label(c) for i, c in enumerate(auto.candidates) if i not in auto.unsafe}
    assert eligible == {"NoneCompressor", "FP16", "PowerSGD", "OneBit"}
    assert lines[at + 1].startswith("  sgd ddp seed 0: "), done.stdout
    assert lines[at + 1].split(": ")[1] in eligible, done.stdout


def test_stall_inspector_benchmark_prints_both_variants_and_a_reports_cost():
    done = _run("benchmarks/stall_inspector.py", "--seconds", "0.5", "--rounds", "1", "--width", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"inspector off [\d.]+ ms, on [\d.]+ ms: ratio on/off [\d.]+", done.stdout), done.stdout
    assert re.search(r"one progress report, timed alone in a rank: \d+ us", done.stdout), done.stdout


def test_time_to_accuracy_benchmark_prints_a_row_per_configuration():
    configs = ["fp32", "powersgd-r2", "powersgd-r2-w3", "bf16", "efsign", "topk"]
    done = _run("benchmarks/time_to_accuracy.py", "--links", "loopback", "--configs", ",".join(configs),
                "--hidden", "16", "--d-in", "8", "--target", "0.3", "--eval-every", "2", "--max-seconds", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("spark-dl DDP ")]
    assert [r.split()[2] for r in rows] == configs, done.stdout
    assert all(" s " in r for r in rows)


def test_time_to_accuracy_benchmark_summarizes_its_seeds():
    done = _run("benchmarks/time_to_accuracy.py", "--links", "loopback", "--configs", "fp32,qsgd", "--seeds", "0,1",
                "--hidden", "16", "--d-in", "8", "--target", "0.3", "--eval-every", "2", "--max-seconds", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "loopback, seed 0:" in out and "loopback, seed 1:" in out, out
    summary = out[out.index("loopback, 2 seeds"):].splitlines()
    fp32 = next(line for line in summary if line.startswith("spark-dl DDP fp32"))
    qsgd = next(line for line in summary if line.startswith("spark-dl DDP qsgd"))
    assert re.search(r" ± +[\d.]+ s +\d+ +- +1\.00 +1\.00-1\.00$", fp32), out
    assert re.search(r" ± +[\d.]+ s +\d+ +- +[\d.]+ +[\d.]+-[\d.]+$", qsgd), out
    bad = _run("benchmarks/time_to_accuracy.py", "--links", "loopback", "--configs", "fp32", "--seeds", "0,x")
    assert bad.returncode == 2 and "--seeds takes integers separated by commas, got '0,x'" in bad.stderr, bad.stderr
    bad = _run("benchmarks/time_to_accuracy.py", "--links", "loopback", "--max-steps", "-1")
    assert bad.returncode == 2 and "a whole number of steps >= 0 (0: no limit), got '-1'" in bad.stderr, bad.stderr


def test_every_benchmark_names_powersgds_settings_one_way():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from powersgd_names import settings
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert settings("powersgd") == {}
    assert settings("powersgd-r8") == {"rank": 8}
    assert settings("powersgd-r4-w10") == {"rank": 4, "start_iter": 10}
    for other in ("powersgd-r0", "powersgd-r4-w", "powersgd:4", "powersgd-w3", "qsgd"):
        assert settings(other) is None, other
    bad = _run("benchmarks/time_to_accuracy.py", "--links", "loopback", "--configs", "fp32,powersgd:4")
    assert bad.returncode == 2 and "powersgd-r<rank >= 1>[-w<start_iter>]" in bad.stderr, bad.stderr[-2000:]


def test_auto_compression_benchmark_compares_auto_with_fp32_and_the_hand_picked_ones():
    # a target out of reach: every configuration trains its 100 steps, enough for auto to probe its four
    # candidates (OneBit too, under heavy-ball momentum) and decide: counted in steps, so on a loaded machine too
    done = _run("benchmarks/auto_compression.py", "--links", "loopback", "--hand-picked", "fp16", "--hidden", "80",
                "--d-in", "8", "--target", "0.99", "--eval-every", "2", "--max-steps", "101", "--seeds", "0,1")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "at most 101 steps a run" in lines[0], lines[0]
    assert [line.split()[4] for line in lines if line.startswith("DDP ")] == ["101"] * 6, done.stdout
    assert [line.split()[1] for line in lines if line.startswith("DDP ")] == ["fp32", "fp16", "auto"] * 2, done.stdout
    # 8k gradients: one bucket, picked once per seed
    assert sum(line.startswith("auto picked: ddp.bucket") for line in lines) == 2, done.stdout
    assert [line for line in lines if line.startswith("loopback, seed ")] == ["loopback, seed 0:", "loopback, seed 1:"]
    summary = next(line for line in lines if line.startswith("loopback "))
    # auto's ratios to fp32 and to the best hand-picked, per seed; then to the best by median (the target
    # out of reach: no ratio)
    assert summary.endswith("(fp16, fp16)       n/a (fp16)"), summary
    assert "seeds 0,1: median [lowest, highest]" in done.stdout
    assert any(line.startswith("median seconds a step") and "auto " in line for line in lines), done.stdout
