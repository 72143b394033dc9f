"""Multi-node by hand: two `molt train --nnodes 2 --node-rank I --rdzv-endpoint` processes on this machine act as
two nodes of one data-parallel run (gloo, CPU) reporting to a real dashboard; a resume where the nodes see different
checkpoints is refused; bad flags are refused before anything starts."""
import json
import shutil
import subprocess

import httpx
import pytest

from app_support import FAST, ROOT, child_env, free_port, molt, web_thread
from test_daemon_supervisor import assert_each_step_once

from app.cli import main
from daemon.records import Records

TOKEN = "nodes-test-token"
STEPS = 6
CONFIG = {**FAST, "model": {"preset": "tiny-dense"}, "seed": 0, "warm_start": {"steps": 0},
          "loop": {**FAST["loop"], "steps": STEPS}, "checkpoint": {"every": 2}, "dist": {"timeout_s": 60}}


def start_nodes(tmp, outs, *extra) -> list[tuple[subprocess.Popen, object]]:
    """Node 0 and node 1 of a 2-node run (1 rank each), meeting at a free port here; each node's --out from `outs`."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for rank, out in enumerate(outs):
        log = open(tmp / f"node-{rank}.log", "w+")
        nodes.append((subprocess.Popen(molt("train", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
                                            endpoint, "--nproc", "1", "--out", str(out), *extra),
                                       stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(tmp / "unused")),
                      log))
    return nodes


def finish(nodes) -> list[tuple[int, str]]:
    """Each node's exit status and output (a node still running after 5 minutes is killed: its ranks go with it)."""
    try:
        codes = [proc.wait(300) for proc, _ in nodes]
    finally:
        for proc, _ in nodes:
            proc.kill()
    results = []
    for code, (_, log) in zip(codes, nodes):
        log.seek(0)
        results.append((code, log.read()))
        log.close()
    return results


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A 2-node run of STEPS steps reported to a dashboard (the app under uvicorn): the nodes' results, the runs the
    dashboard recorded, its records, the run's output directory."""
    tmp = tmp_path_factory.mktemp("nodes")
    (tmp / "run.json").write_text(json.dumps(CONFIG))
    with web_thread(tmp / "home", TOKEN) as (base, _):
        results = finish(start_nodes(tmp, [tmp / "out"] * 2, "--config", str(tmp / "run.json"),
                                     "--report-to", base, "--token", TOKEN))
        runs = httpx.get(f"{base}/api/v1/runs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    return {"results": results, "runs": runs, "records": Records(tmp / "home"), "out": tmp / "out", "tmp": tmp}


def test_two_nodes_train_one_run_that_rank_0_reports_with_every_step_once(two_nodes):
    (code0, log0), (code1, log1) = two_nodes["results"]
    assert code0 == 0, log0[-3000:]
    assert code1 == 0, log1[-3000:]
    summary = json.loads(log0[log0.index("{\n"):])  # node 0 holds rank 0: it prints the summary
    assert summary["status"] == "completed" and summary["step"] == STEPS, summary
    assert "{\n" not in log1 and "Traceback" not in log1  # node 1 only trains
    # one run on the dashboard (rank 1 reported nothing of its own), with both ranks, every step recorded once
    (run,) = two_nodes["runs"]
    assert run["ranks"] == 2 and run["status"] == "completed" and run["step"] == STEPS, run
    assert_each_step_once(two_nodes["records"], run["id"], STEPS)
    assert "2 rank(s)" in two_nodes["records"].events(run["id"])[0]["message"]
    # rank 0 wrote the config, the checkpoints and the final policy into the directory both nodes share
    out = two_nodes["out"]
    assert json.loads((out / "config.json").read_text())["loop"]["steps"] == STEPS
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:06d}"
    assert (out / "final" / "config.json").exists()


def test_a_resume_where_the_nodes_see_different_checkpoints_is_refused(two_nodes):
    """Node 1 is given a directory that has the run's config but not its checkpoints (as a node without the shared
    storage would): both nodes stop before training, naming the problem, and the run's checkpoints stay."""
    tmp, out = two_nodes["tmp"], two_nodes["out"]
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out / "config.json", elsewhere / "config.json")
    results = finish(start_nodes(tmp, [out, elsewhere], "--resume", "--steps", str(STEPS + 2)))
    for code, log in results:
        assert code != 0 and "every node must see the run's directory" in log, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:06d}"
    assert not (elsewhere / "checkpoints").exists()


@pytest.mark.parametrize("flags, problem", [
    (["--node-rank", "0"], "--node-rank and --rdzv-endpoint need --nnodes"),
    (["--rdzv-endpoint", "node0:29500"], "--node-rank and --rdzv-endpoint need --nnodes"),
    (["--nnodes", "0"], "--nnodes must be at least 1, not 0"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0:29500"], "--nnodes needs --node-rank"),
    (["--nnodes", "2", "--node-rank", "1"], "--nnodes needs --node-rank (this machine's index) and --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node0:29500"],
     "--node-rank must be 0 to 1 with --nnodes 2, not 2"),
    (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "node0:29500"], "--node-rank must be 0 to 1"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node0:29500", "--no-out"], "--nnodes needs --out"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node0"], "argument --rdzv-endpoint: 'node0' is not "
                                                                         "HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node0:http"], "argument --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", ":29500"], "argument --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node0:70000"], "argument --rdzv-endpoint"),
    # 4 groups a step split over 1 rank per node, but not over 3 nodes
    (["--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", "node0:29500"],
     "loop.groups_per_step (4) must split evenly over the 3 ranks (dist.nproc x dist.nnodes)"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node0:29500", "--nproc", "4"],
     "loop.groups_per_step (4) must split evenly over the 8 ranks"),
    (["--config-nnodes"], "dist.nnodes is 2: run each node with --nnodes, --node-rank and --rdzv-endpoint"),
])
def test_bad_multi_node_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, problem):
    """In this process (the CLI's own main): nothing starts, no directory is made."""
    nnodes = 2 if "--config-nnodes" in flags else 1  # a config that asks for 2 nodes, run without the flags
    (tmp_path / "run.json").write_text(json.dumps({**CONFIG, "dist": {**CONFIG["dist"], "nnodes": nnodes}}))
    out = [] if "--no-out" in flags else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit:
        main(["train", "--config", str(tmp_path / "run.json"), *out,
              *[f for f in flags if f not in ("--no-out", "--config-nnodes")]])
    assert exit.value.code == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
