"""Runs placed on a Ray cluster (`molt daemon --ray`): two Ray nodes on this machine (ray.cluster_utils.Cluster), a
real daemon, torchrun on each node (gloo); and what refuses more than one node without Ray."""
import contextlib
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table
from sqlmodel import Session

from app_support import hook, logged_in, new_run, serve, web, web_thread  # noqa: F401 (hook, web: fixtures)
from conftest import wait_until
from daemon.db import DASHBOARD, add_event, set_run
from daemon.models import Run, now
from daemon.records import Records
from molt_engine import RunConfig
from molt_engine.config import ValidationError, config_errors
from test_daemon_supervisor import START, Studio, assert_each_step_once, config
from test_dist import rank_pid

# max_digit learns from a warm start (as tests/test_dist.py's two ranks do); a checkpoint to restart from every 10
LEARNS = {"env": "max_digit", "seed": 0, "loop": {"steps": 40, "eval_every": 20, "eval_episodes": 64},
          "checkpoint": {"every": 10}, "dist": {"nnodes": 2, "nproc": 1}}


def test_dist_nnodes_is_validated_and_the_batch_splits_over_every_rank_of_every_node():
    assert RunConfig.model_validate({"env": "max_digit"}).dist.nnodes == 1
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate({"env": "max_digit", "dist": {"nnodes": 0}})
    assert config_errors(e.value)[0].startswith("dist.nnodes:")
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate({"env": "max_digit", "loop": {"groups_per_step": 4}, "dist": {"nnodes": 3}})
    assert "over the 3 ranks (dist.nproc x dist.nnodes)" in config_errors(e.value)[0]
    RunConfig.model_validate({"env": "max_digit", "loop": {"groups_per_step": 6}, "dist": {"nnodes": 3}})


def test_a_daemon_without_ray_refuses_a_run_on_more_than_one_node_naming_dist_nnodes(tmp_path):
    """Queued, or due to restart (its daemon came back without --ray): it fails at once, never started locally."""
    studio = Studio(tmp_path)
    try:
        queued, restarting = (studio.api.create_run(config(5, dist={"nnodes": 2}))["id"] for _ in range(2))
        with Session(studio.api.engine) as s:
            assert set_run(s, restarting, ("queued",), status="restarting", next_start_at=now())
            s.commit()
        studio.start_daemon()
        for run in (queued, restarting):
            final = studio.api.wait_run(run, timeout=START)
            assert final["status"] == "failed" and final["last_error"].startswith(
                "dist.nnodes is 2 but this daemon has no Ray cluster"), final["last_error"]
            assert studio.api.attempts(run) == []  # never started
    finally:
        studio.close()


def test_the_run_page_links_the_ray_dashboard_of_its_newest_placement(web):
    run = new_run(web)["id"]
    browser, _ = logged_in(web)
    assert 'id="ov-ray"' not in browser.get(f"/runs/{run}").text
    with Session(web["records"].engine) as s:  # what the worker records as Ray placed the attempt
        add_event(s, run, "ray", "attempt 1 placed on Ray", attempt=1, dashboard="http://10.0.0.5:8265")
        s.commit()
    assert '<a id="ov-ray" href="http://10.0.0.5:8265">Ray dashboard</a>' in browser.get(f"/runs/{run}").text


def test_a_nodes_task_passes_the_stop_file_on_as_sigterm_and_returns_why_its_launcher_ended(tmp_path):
    """The node's side of a Ray attempt's stop, without Ray: the launcher runs until the attempt's stop file
    appears, then gets SIGTERM (here it exits 3 on it, and says so); a launcher that ends by itself with 0 is None."""
    from daemon.ray_place import run_node
    stop_file, started = tmp_path / "attempt-1.stop", tmp_path / "started"
    launcher = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3));"
                f" open({str(started)!r}, 'w').close(); time.sleep(120)"]
    with ThreadPoolExecutor(1) as pool:
        ended = pool.submit(run_node, launcher, str(stop_file))
        wait_until(started.exists, 30, message="the launcher started")
        assert not ended.done()
        stop_file.touch()
        assert ended.result(timeout=30) == {"outcome": "error", "cause": "exit code 3"}
    assert run_node([sys.executable, "-c", "pass"], str(tmp_path / "never.stop")) is None


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """Two Ray nodes of one CPU each (STRICT_SPREAD puts one bundle on each), and a daemon placing runs on them."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    studio = Studio(tmp_path_factory.mktemp("home"))
    try:
        studio.start_daemon("--ray", cluster.address)
        yield studio, cluster
    finally:
        studio.close()
        cluster.shutdown()


def our_placement_groups(cluster) -> list[str]:
    """The states of every placement group the cluster ever had (each attempt reserved one)."""
    ray.init(address=cluster.address)
    try:
        return [pg["state"] for pg in placement_group_table().values()]
    finally:
        ray.shutdown()


def node_processes(home) -> list[int]:
    """Live processes of this data directory's workers, with their node launchers and ranks."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{entry}/cmdline", "rb").read().decode().split("\0")
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "daemon.worker" in args and str(home) in args and state != "Z":
            found.append(int(entry))
    return found


def node_database_use(home) -> dict[int, bool]:
    """The node launchers and ranks of this data directory's Ray attempts (they are given the attempt file), and
    whether each has the database (molt.db, its -wal or -shm) open."""
    found = {}
    for pid in node_processes(home):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
            opened = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(a.startswith("--attempt-file=") for a in args):
            found[pid] = any(path.startswith(str(home / "molt.db")) for path in opened)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("reports", ["to the dashboard", "into the database"])
def test_a_two_node_run_learns_survives_a_sigkill_on_the_second_node_and_leaves_no_placement(placed, reports):
    """dist {nnodes: 2, nproc: 1}: rank 1 (on the second node) is SIGKILLed mid-run. The attempt ends naming that
    node, its rank and the signal; the daemon restarts it from the checkpoint on both nodes; the run completes
    with every step recorded once and a greedy eval reward of at least 0.9, above the warm start's; no placement
    group is left. Rank 0 reports to the dashboard over HTTP when one listens on the data directory (each attempt
    with a new token), else into the shared database."""
    studio, cluster = placed
    api = studio.api
    before = len(our_placement_groups(cluster))
    with contextlib.ExitStack() as stack:
        if reports == "to the dashboard":
            base, _ = stack.enter_context(web_thread(studio.home, "secret"))
            (studio.home / DASHBOARD).write_text(json.dumps({"url": base}))
            stack.callback((studio.home / DASHBOARD).unlink)
        run = api.create_run(LEARNS)["id"]
        studio.wait_step(run, 13, timeout=START + 300)
        pid = wait_until(lambda: rank_pid(studio.home, 1), 30, message="rank 1")
        os.kill(pid, signal.SIGKILL)
        final = api.wait_run(run, timeout=900)
    attempts = api.attempts(run)
    print("attempts:", [(a["number"], a["cause"][:300], a["start_step"], a["end_step"]) for a in attempts])
    print("summary:", {k: final["summary"].get(k) for k in ("step", "eval_reward", "best_step", "reward_mean")})
    assert final["status"] == "completed", final["last_error"]
    ip = cluster.head_node.node_ip_address
    assert len(attempts) == 2
    assert attempts[0]["cause"].startswith(f"node {ip} (node rank 1): rank 1 (pid {pid}) killed by SIGKILL")
    assert attempts[1]["start_step"] % 10 == 0 and 10 <= attempts[1]["start_step"] <= attempts[0]["end_step"]
    assert_each_step_once(api, run, 40)
    evals = [m["value"] for m in api.metrics(run, names=["eval_reward"])]  # the first is of the warm start alone
    assert final["summary"]["eval_reward"] >= 0.9 and evals[-1] > evals[0], evals
    placements = api.events(run, kind="ray")
    assert [e["data"]["attempt"] for e in placements] == [1, 2]
    assert all(e["message"].endswith(f": {ip}, {ip}") for e in placements)
    wait_until(lambda: not node_processes(studio.home), 30, message="the worker, node launchers and ranks gone")
    states = our_placement_groups(cluster)  # the worker removes its placement group before it exits
    assert len(states) == before + 2 and set(states) == {"REMOVED"}, states


@pytest.mark.slow
def test_a_stop_reaches_every_node_rank_0_checkpoints_and_nothing_of_the_attempt_is_left_on_ray(placed, tmp_path):
    """`molt serve --ray ADDRESS` (its daemon gets the address); rank 0 reports to the dashboard over HTTP with a
    token for this run, so no node's process opens the database. The dashboard's stop (SIGTERM to the worker) is
    passed on to each node's task, so the ranks checkpoint at one step and the run is `stopped`; its placement group
    is removed and no node launcher or rank lives on."""
    _, cluster = placed
    before = len(our_placement_groups(cluster))
    with serve(tmp_path, "--ray", cluster.address):
        api = Records(tmp_path)
        run = api.create_run(config(60, dist={"nnodes": 2}))["id"]
        wait_until(lambda: api.get_run(run)["step"] >= 4, START + 300, message="step 4")
        nodes = node_database_use(tmp_path)
        assert len(nodes) >= 4 and not any(nodes.values()), nodes  # two launchers and two ranks, none on the db
        with Session(api.engine) as s:
            assert s.get(Run, run).ingest_token is not None
        assert api.stop_run(run)["status"] == "stopping"
        stopped = api.wait_run(run, timeout=120)
        assert stopped["status"] == "stopped" and 4 <= stopped["step"] < 60, stopped["last_error"]
        assert api.checkpoints(run)[-1]["step"] == stopped["step"]
        assert [a["cause"] for a in api.attempts(run)] == ["stopped"]
        assert [e["data"]["attempt"] for e in api.events(run, kind="ray")] == [1]
        wait_until(lambda: not node_processes(tmp_path), 30, message="the worker, node launchers and ranks gone")
        assert not list((tmp_path / "runs" / str(run)).glob("attempt-*.json")), "the attempt file (a credential)"
    states = our_placement_groups(cluster)
    assert len(states) == before + 1 and set(states) == {"REMOVED"}, states


@pytest.mark.slow
def test_a_run_on_more_nodes_than_the_cluster_has_ends_its_attempt_as_a_placement_failure(placed):
    """dist.nnodes 3 on two nodes: the placement group cannot be placed; after the placement timeout the attempt's
    cause says so (with no restart allowed the run fails), and the unplaced group is removed as well."""
    studio, cluster = placed
    before = len(our_placement_groups(cluster))
    run = studio.api.create_run(config(5, loop={"groups_per_step": 3}, dist={"nnodes": 3}), max_restarts=0)["id"]
    final = studio.api.wait_run(run, timeout=START + 120)
    assert final["status"] == "failed"
    attempts = studio.api.attempts(run)
    assert len(attempts) == 1 and attempts[0]["cause"].startswith("placement: no 3 different nodes with {'CPU': 1}")
    wait_until(lambda: not node_processes(studio.home), 30, message="the worker gone")
    states = our_placement_groups(cluster)
    assert len(states) == before + 1 and set(states) == {"REMOVED"}, states
