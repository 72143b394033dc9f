"""bench/gpu_proof.py at toy scale on the CPU, so the GPU proof never rots before a GPU runs it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["setup", "learn", "sampler", "trainer", "two_jobs", "oom", "multiturn", "trl", "ladder", "machine_panel"]


@pytest.mark.slow
def test_the_gpu_proof_runs_every_check_at_toy_scale_on_the_cpu(tmp_path):
    out = tmp_path / "proof.jsonl"
    run = subprocess.run([sys.executable, "bench/gpu_proof.py", "--device", "cpu", "--tiny", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["check"] for line in lines] == CHECKS
    assert run.stdout.splitlines() == out.read_text().splitlines()  # printed as written
    c = {line["check"]: line for line in lines}
    assert all(line["seconds"] >= 0 for line in lines)
    assert c["setup"]["ok"] and c["setup"]["device"] == "cpu" and c["setup"]["peak_tflops"] is None

    learn = c["learn"]  # a few steps: greedy eval improves on the warm start's, the samples carry bf16's gap
    assert learn["ok"] and 0 < learn["steps"] <= 20 and learn["samples_per_s_median"] > 0
    assert learn["eval_best"] > learn["eval_reward"]["0"]
    assert 0 < learn["mismatch_kl_median"] < 1e-3

    multi = c["multiturn"]  # both placements of the sampler train the multi-turn env within the staleness bound
    assert multi["ok"] and multi["process_vs_in_process"] > 0
    for run in (multi["in_process"], multi["sampler_process"]):
        assert run["status"] == "completed" and run["steps"] == 3 and 0 <= run["staleness_max"] <= 2
        assert run["completions_per_s_median"] > 0 and run["mismatch_kl_median"] >= 0

    sampler = c["sampler"]
    assert sampler["ok"] and sampler["params"] > 0 and [b["requests"] for b in sampler["batches"]] == [8, 16]
    assert sampler["decoding"] == "static shapes"  # the CUDA graphs' step, uncaptured on the CPU
    for b in sampler["batches"]:
        assert b["new_tokens"] == sampler["max_new_tokens"]
        assert 0 <= b["same_tokens_as_eager"] <= 1
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "eager_decode_tokens_per_s", "sampler_tokens_per_s",
                    "generate_tokens_per_s", "sampler_vs_generate", "sampler_peak_gb", "generate_peak_gb"):
            assert b[key] > 0, key
    assert 0 < sampler["mismatch_kl"] < 1e-3 and sampler["mismatch_abs"] > 0  # bf16 sampler vs fp32 trainer

    trainer = c["trainer"]
    assert trainer["ok"] and trainer["episodes"] == 8 and trainer["flops_per_step"] > 0
    assert [r["micro_batch_size"] for r in trainer["runs"]] == [None, 4]
    for r in trainer["runs"]:
        assert r["tokens_per_s"] > 0 and r["peak_gb"] > 0 and r["grad_norm"] > 0 and r["mfu"] is None

    two = c["two_jobs"]
    assert two["ok"] and two["trainer_steps_meanwhile"] >= 1
    assert two["sampler_tokens_per_s_alone"] > 0 and two["sampler_tokens_per_s_with_trainer"] > 0

    ladder = c["ladder"]  # the toy shape: every mode, checkpointing off and on, fits the CPU
    assert ladder["ok"] and [(r["mode"], r["checkpointing"]) for r in ladder["runs"]] == [
        (m, gc) for m in ("full", "full_bf16", "lora16") for gc in ("off", "on")]
    assert ladder["runs"][0]["decode_tokens_per_s_128"] > 0 and "decode_tokens_per_s_128" not in ladder["runs"][1]
    for r in ladder["runs"]:
        assert r["fits"] and r["micro_batch_size"] is None and r["tokens_per_s"] > 0 and r["peak_gb"] > 0

    # The CUDA-only checks say why they did not run, and count as neither passed nor failed.
    assert c["oom"]["ok"] is None and c["oom"]["skipped"].startswith("needs CUDA")
    assert c["trl"]["ok"] is None and c["trl"]["skipped"].startswith("needs CUDA")
    assert c["machine_panel"]["ok"] is None and c["machine_panel"]["skipped"].startswith("unavailable")


def test_a_check_that_raises_is_a_failed_line_and_the_next_check_still_runs(tmp_path):
    # trainer without sampler has no samples to update on: its line carries the error, machine_panel still runs.
    out = tmp_path / "proof.jsonl"
    run = subprocess.run([sys.executable, "bench/gpu_proof.py", "--device", "cpu", "--tiny", "--out", str(out),
                          "--checks", "trainer", "machine_panel"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    trainer, panel = [json.loads(line) for line in out.read_text().splitlines()]
    assert trainer["check"] == "trainer" and trainer["ok"] is False and trainer["error"].startswith("KeyError")
    assert panel["check"] == "machine_panel" and panel["ok"] is None
