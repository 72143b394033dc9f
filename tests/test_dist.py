"""More than one process on CPU (gloo, 2 torchrun ranks): the data-parallel update equals the single-process one
(also with micro-batches of unequal count, an out-of-memory retry on one rank, the batch-level baseline), a gradient
spike on one rank makes every rank skip the step, metrics reduce by name, and a stuck group ends its attempt."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import wait_until
from dist_support import config, step
from test_daemon_supervisor import START, Studio, assert_each_step_once
from test_daemon_supervisor import config as daemon_config

ROOT = Path(__file__).resolve().parent.parent


def two_ranks(tmp_path, strategy: str, *extra) -> list[dict]:
    """Run tests/dist_support.py on 2 ranks; what each rank got."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "dist_support.py"), str(tmp_path), strategy, *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in (0, 1)]


def assert_same_update(got: dict, one: dict):
    """A rank published the weights of one process within 1e-5 (and they moved), with its gradient norm."""
    single, start = one["weights"], one["start"]
    diff = max(float((got["weights"][k] - single[k]).abs().max()) for k in single)
    moved = max(float((got["weights"][k] - start[k]).abs().max()) for k in single)
    assert diff < 1e-5 and moved > 100 * diff, (diff, moved)
    assert got["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    assert all(torch.equal(got["model"][k], got["weights"][k]) for k in single)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_update_on_two_ranks_gives_the_weights_of_one_process(tmp_path, strategy):
    """Each rank trains 2 of the 4 groups (with different token counts: the token mean must be the global one);
    the published weights equal one process training all 4 within 1e-5. Metrics reduce by name, also those only
    one rank reported: counts summed, the rest averaged over the ranks that have them."""
    one = step(config(strategy))
    for got in two_ranks(tmp_path, strategy):
        assert_same_update(got, one)
        assert got["reduced"] == {"reward_mean": 0.5, "tool_errors": 4.0, "accuracy_strict": 0.25,
                                  "agent_errors": 3.0, "a_first": 7.0}
        assert got["stalled"] == [False, True, False]  # the heartbeat's watch on a step (dist.stalled)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_micro_batches_of_unequal_count_over_the_ranks_give_the_weights_of_one_process(tmp_path, strategy):
    """Micro-batches of 2 in 2 minibatches; rank 1 leaves two episodes of advantage 0 out of its first minibatch,
    so it has one micro-batch there where rank 0 has two: it pads, both complete, and equal one process."""
    one = step(config(strategy, "micro"))
    for got in two_ranks(tmp_path, strategy, "micro"):
        assert_same_update(got, one)


@pytest.mark.parametrize("where", ["oom", "forward-oom", "step-oom"])
def test_an_out_of_memory_on_one_rank_is_retried_by_both(tmp_path, where):
    """Only rank 1 runs out (drills.oom_rank 1 before the update, a real OutOfMemoryError in its first training
    forward, while rank 0 goes on to the backward's all-reduce, or in its first optimizer step, while rank 0 goes on
    to the next step): both ranks retry with micro-batches half their 8 episodes and publish what one process does
    without running out."""
    one = step(config("ddp"))
    ranks = two_ranks(tmp_path, "ddp", where)
    assert [got["micro_batch_size"] for got in ranks] == [4, 4]
    for got in ranks:
        assert_same_update(got, one)


def test_the_batch_baseline_is_over_every_ranks_episodes(tmp_path):
    """reinforce_baseline normalises over the whole batch: the groups of the two ranks differ in reward scale, so
    per-rank normalisation would train differently from one process."""
    one = step(config("ddp", "reinforce"))
    for got in two_ranks(tmp_path, "ddp", "reinforce"):
        assert_same_update(got, one)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_gradient_spike_on_one_rank_makes_every_rank_skip_the_step(tmp_path, strategy):
    """The drill spikes rank 0's gradient only; the breaker judges the norm gathered over the ranks, so both skip:
    nothing is published and both models are back at the weights the step started from."""
    for got in two_ranks(tmp_path, strategy, "spike"):
        start = got["start"]
        assert got["weights"] is None and got["metrics"]["breaker_tripped"] == 1.0
        assert got["metrics"]["grad_norm"] > 100
        assert all(torch.equal(got["model"][k], start[k]) for k in start)


def rank_pid(home: Path, rank: int) -> int | None:
    """The pid of a live rank process of a daemon run in `home` (torchrun sets RANK in its environment)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"daemon.worker" in cmdline and str(home).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.slow
def test_sigkill_of_one_rank_restarts_the_attempt_from_the_checkpoint_and_loses_nothing(tmp_path):
    """A 2-rank daemon run; rank 1 is SIGKILLed mid-run. The attempt ends naming rank 1 and its signal, the daemon
    restarts it from the checkpoint, every step is recorded once, and the final weights equal those of the same
    run uninterrupted (`molt train --nproc 2`): no prompt was skipped or repeated on any rank."""
    cfg = daemon_config(16, dist={"nproc": 2})
    studio = Studio(tmp_path / "home")
    try:
        run = studio.api.create_run(cfg)["id"]
        studio.start_daemon()
        studio.wait_step(run, 7, timeout=START + 120)
        pid = wait_until(lambda: rank_pid(studio.home, 1), 30, message="rank 1")
        os.kill(pid, signal.SIGKILL)
        final = studio.api.wait_run(run, timeout=300)
        attempts = studio.api.attempts(run)
        print("attempts:", [(a["number"], a["cause"], a["start_step"], a["end_step"]) for a in attempts])
        assert final["status"] == "completed", final["last_error"]
        assert len(attempts) == 2 and attempts[0]["cause"].startswith(f"rank 1 (pid {pid}) killed by SIGKILL")
        assert "{" not in attempts[0]["cause"], "the other rank's error is named by its message, not a raw record"
        assert attempts[1]["start_step"] % 5 == 0 and 5 <= attempts[1]["start_step"] <= attempts[0]["end_step"]
        assert_each_step_once(studio.api, run, 16)
        assert [v["version"] for v in studio.api.policy_versions(run)] == list(range(1, 17))
    finally:
        studio.close()
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "app.cli", "train", "--config", str(tmp_path / "run.json"),
                           "--out", str(tmp_path / "straight")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(studio.home / "runs" / str(run) / "final").state_dict()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"final weights, killed and resumed vs uninterrupted: max difference {diff:.3g}")
    assert diff <= 1e-6


@pytest.mark.slow
def test_an_out_of_memory_in_one_ranks_backward_ends_the_attempt_and_the_next_trains_at_half_the_micro_batch(
        tmp_path):
    """Rank 1 runs out in its first backward of step 3 (a real torch.OutOfMemoryError, while rank 0 waits in the
    backward's all-reduce): the attempt ends naming it, and the next attempt starts from half the micro-batch (the
    drill fires again at the config's size: without the note it would, until the restarts run out)."""
    cfg = daemon_config(6, dist={"nproc": 2}, algo={"micro_batch_size": 4},
                        drills={"oom_at": [3], "oom_rank": 1, "oom_in": "backward"})
    studio = Studio(tmp_path / "home")
    try:
        run = studio.api.create_run(cfg)["id"]
        studio.start_daemon()
        final = studio.api.wait_run(run, timeout=START + 300)
        attempts = studio.api.attempts(run)
        assert final["status"] == "completed", final["last_error"]
        assert len(attempts) == 2 and "out of memory in a backward on rank 1" in attempts[0]["cause"], attempts
        [oom] = studio.api.events(run, kind="oom")
        assert oom["data"]["micro_batch_size"] == 2 and oom["data"]["step"] == attempts[1]["start_step"] <= 3
        assert_each_step_once(studio.api, run, 6)
    finally:
        studio.close()


@pytest.mark.slow
def test_two_ranks_learn_max_digit(tmp_path):
    """`molt train --nproc 2` on max_digit (each rank 8 of the 16 groups a step): the greedy eval on 64 held-out
    prompts reaches 0.9."""
    (tmp_path / "run.json").write_text(json.dumps({"env": "max_digit", "seed": 0, "checkpoint": {"every": 0},
                                                   "loop": {"steps": 100, "eval_every": 25, "eval_episodes": 64}}))
    proc = subprocess.run([sys.executable, "-m", "app.cli", "train", "--nproc", "2", "--config",
                           str(tmp_path / "run.json"), "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    print("2 ranks, max_digit:", {k: summary[k] for k in ("step", "eval_reward", "best_step", "reward_mean")})
    assert summary["status"] == "completed" and summary["eval_reward"] >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("asked", ["every rank", "rank 1 alone"])
def test_stop_of_a_two_rank_run_checkpoints_both_ranks_at_one_step_then_resumes(tmp_path, asked):
    """The daemon's stop (SIGTERM to the launching worker; torchrun passes it to every rank), or a SIGTERM that
    reaches one rank alone, at any moment of its step (as a stop reaches the nodes of a Ray run one by one): the
    ranks agree on one step, checkpoint together and the run is `stopped`; resumed, it completes with every step
    recorded once."""
    studio = Studio(tmp_path / "home")
    try:
        api = studio.api
        run = api.create_run(daemon_config(40, dist={"nproc": 2}))["id"]
        studio.start_daemon()
        studio.wait_step(run, 8, timeout=START + 120)
        if asked == "every rank":
            assert api.stop_run(run)["status"] == "stopping"
        else:
            os.kill(wait_until(lambda: rank_pid(studio.home, 1), 30, message="rank 1"), signal.SIGTERM)
        stopped = api.wait_run(run, timeout=90)
        assert stopped["status"] == "stopped" and 8 <= stopped["step"] < 40, stopped["last_error"]
        assert api.checkpoints(run)[-1]["step"] == stopped["step"]
        assert api.resume_run(run)["status"] == "queued"
        final = api.wait_run(run, timeout=START + 120)
        assert final["status"] == "completed", final["last_error"]
        assert api.attempts(run)[1]["start_step"] == stopped["step"]
        assert_each_step_once(api, run, 40)
    finally:
        studio.close()


@pytest.mark.slow
def test_a_stopped_rank_ends_the_attempt_within_the_collective_timeout_and_the_run_resumes(tmp_path):
    """A 2-rank daemon run with dist.timeout_s 10; rank 1 is frozen (SIGSTOP) mid-run. Rank 0's heartbeat goes on,
    but its next collective gives up after 10 s: the attempt ends with rank 0's timeout, and the daemon restarts
    the run from its checkpoint; it completes with every step recorded once. By default the run got one GPU per
    rank (only ids here: the ranks see no CUDA and train on the CPU)."""
    studio = Studio(tmp_path / "home")
    try:
        run = studio.api.create_run(daemon_config(16, dist={"nproc": 2, "timeout_s": 10}))["id"]
        studio.start_daemon("--gpus", "0,1,2")
        studio.wait_step(run, 7, timeout=START + 120)
        pid = wait_until(lambda: rank_pid(studio.home, 1), 30, message="rank 1")
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        final = studio.api.wait_run(run, timeout=300)
        attempts = studio.api.attempts(run)
        print("attempts:", [(a["number"], a["cause"][:300], a["end_step"], a["ended_at"] - frozen_at)
                            for a in attempts])
        assert final["status"] == "completed", final["last_error"]
        # torchrun ends the frozen rank (SIGTERM waits while it is stopped, then SIGKILL): both are named
        assert len(attempts) == 2 and "rank 0 " in attempts[0]["cause"]
        # rank 0's own end is gloo's timeout, in whichever words the collective it waited in uses
        rank0 = attempts[0]["cause"].split("rank 0 ", 1)[1]
        assert "Timed out waiting 10000ms" in rank0 or "Application timeout caused pair closure" in rank0, rank0
        assert attempts[0]["ended_at"] - frozen_at < 10 + 45  # the timeout, then torchrun ends the frozen rank
        assert final["gpus"] == "0,1"
        assert_each_step_once(studio.api, run, 16)
    finally:
        studio.close()
