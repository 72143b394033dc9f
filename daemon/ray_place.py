"""An attempt placed on a Ray cluster (`molt daemon --ray`): a bundle per node, on each a task running its torchrun."""
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from sqlalchemy import update
from sqlmodel import Session

from .db import DASHBOARD, add_event, data_home, digest
from .models import Run

PLACE_TIMEOUT_S = 60   # under the supervisor's first-heartbeat limit (FIRST_BEAT_S), which would call it a hang
FAILED_GRACE_S = 5     # after a node fails, the others get this long to fail too (on the lost peer) and say so
# What the supervisor gives its worker that the node's launcher and ranks need as well
PASSED_ON = ("PYTHONPATH", "MOLT_HOME", "MOLT_ENVS", "PYTHONUNBUFFERED", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")


def place(engine, address: str, args, number: int, config: dict, directory: Path) -> dict | None:
    """Reserve `dist.nnodes` bundles of `dist.nproc` CPUs (or GPUs), one per node (STRICT_SPREAD), start one task per
    bundle that runs that node's ranks, and watch them as launch() watches local ranks: the first node to fail ends
    the attempt (the others are cancelled) and its cause names the node, rank and signal; a SIGTERM (the daemon's
    stop) is passed on to every node through a stop file in the run directory, so rank 0 checkpoints. With a
    dashboard listening on the data directory, rank 0 reports to it over HTTP (HttpSink), so the nodes never open the
    database. The placement group and the Ray job end with this attempt, however it ends. Returns the attempt's
    failure, or None."""
    dist = config.get("dist", {})
    nnodes, nproc = dist.get("nnodes", 1), dist.get("nproc", 1)
    marker = directory / f"attempt-{args.attempt}.placed"  # a node that cannot see it cannot see the checkpoints
    attempt_file = directory / f"attempt-{args.attempt}.json"
    stop_file = directory / f"attempt-{args.attempt}.stop"
    marker.write_text(str(os.getpid()))
    stop, pg = threading.Event(), None
    try:
        context = ray.init(address=address, runtime_env={"env_vars": {k: os.environ[k] for k in PASSED_ON
                                                                      if k in os.environ}})
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after ray.init, which sets its own (exit at once)
        gpus = (config.get("resources") or {}).get("gpus")
        gpus = (nproc if ray.cluster_resources().get("GPU") else 0) if gpus is None else gpus
        bundle = {"GPU": gpus} if gpus else {"CPU": nproc}
        pg = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD")
        try:
            ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            has = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            return {"outcome": "error", "cause": f"placement: no {nnodes} different nodes with {bundle} free each "
                    f"within {PLACE_TIMEOUT_S}s (the cluster has {has} on {len(ray.nodes())} nodes)"}
        on = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(nnodes)]
        nodes = ray.get([probe.options(num_cpus=0, scheduling_strategy=on[i]).remote(str(marker))
                         for i in range(nnodes)])
        if stop.is_set():  # stopped while it waited for its nodes: nothing ran
            return None
        blind = [f"node {ip} (node rank {i})" for i, (ip, sees, _) in enumerate(nodes) if not sees]
        if blind:
            return {"outcome": "error", "cause": f"{', '.join(blind)} cannot see the run directory {directory}: "
                    "checkpoints and data must be on storage every node sees (a shared data directory)"}
        url = context.dashboard_url and ("" if "://" in context.dashboard_url else "http://") + context.dashboard_url
        with Session(engine) as s:
            add_event(s, args.run_id, "ray", f"attempt {number} placed on Ray: {nnodes} node(s) with {bundle} each: "
                      f"{', '.join(ip for ip, _, _ in nodes)}", attempt=number, dashboard=url or None)
            s.commit()
        # What the nodes' launchers and ranks read instead of the database: the run's config and, with a dashboard
        # listening, where rank 0 reports (with a token for this run alone, new each attempt). Owner-only: a credential.
        home, report = data_home(args.home), {}
        if (dashboard := home / DASHBOARD).exists():
            token = secrets.token_urlsafe(24)
            with Session(engine) as s:
                s.execute(update(Run).where(Run.id == args.run_id).values(ingest_token=digest(token)))
                s.commit()
            report = {"report_to": json.loads(dashboard.read_text())["url"], "ingest_token": token}
        with os.fdopen(os.open(attempt_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"config": config, "number": number, **report}, f)
        command = [sys.executable, "-m", "daemon.worker", str(args.run_id), "--attempt", str(args.attempt),
                   "--home", str(home), f"--nnodes={nnodes}",
                   f"--rdzv-endpoint={nodes[0][0]}:{nodes[0][2]}", f"--attempt-file={attempt_file}"]
        tasks = {node.options(num_cpus=0 if gpus else nproc, num_gpus=gpus, max_retries=0,
                              scheduling_strategy=on[i]).remote(command + [f"--node-rank={i}"], str(stop_file)): i
                 for i in range(nnodes)}

        def failure(ref):
            try:
                values = ray.get(ref)
            except ray.exceptions.RayError as e:  # the task itself died: its worker process, or its node
                values = {"outcome": "error", "cause": f"{type(e).__name__}: {e}"[:1000]}
            return values and (tasks[ref], nodes[tasks[ref]][0], values)

        pending, failures = list(tasks), []
        while pending and not failures:
            if stop.is_set() and not stop_file.exists():  # each node's task passes it on to its launcher as SIGTERM
                stop_file.touch()
            done, pending = ray.wait(pending, timeout=0.5)
            failures = [] if stop.is_set() else [f for ref in done if (f := failure(ref))]  # rank 0 recorded the stop
        if failures and pending:  # the others get a moment to fail as well (on the lost peer) and say why
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=FAILED_GRACE_S)
            failures += [f for ref in done if (f := failure(ref))]
        for ref in pending:
            ray.cancel(ref, force=True)
        if not failures:
            return None
        # as launch() orders ranks: a node whose rank was killed by a signal nobody sent first, SIGTERMed ones last
        failures.sort(key=lambda f: ("killed by" not in f[2]["cause"]) + 2 * ("SIGTERM" in f[2]["cause"]))
        return {"outcome": "error", "cause": "; ".join(f"node {ip} (node rank {i}): {v['cause']}"
                                                      for i, ip, v in failures)[:4000],
                "error": failures[0][2].get("error")}
    except Exception as e:  # e.g. no cluster at that address: said as the attempt's cause
        return {"outcome": "error", "cause": f"ray: {type(e).__name__}: {e}"[:4000]}
    finally:
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()
        marker.unlink(missing_ok=True)
        attempt_file.unlink(missing_ok=True)
        stop_file.unlink(missing_ok=True)


@ray.remote
def probe(marker: str) -> tuple[str, bool, int]:
    """This node's address, whether it sees the run directory, and a free port (node 0's is the rendezvous)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), Path(marker).exists(), s.getsockname()[1]


def run_node(command: list[str], stop_file: str) -> dict | None:
    """This node's ranks: `python -m daemon.worker ... --node-rank I`, which runs torchrun. The attempt's stop (the
    stop file appears) is passed on as SIGTERM, as the daemon stops a local run. Not through Ray's non-forced cancel:
    its KeyboardInterrupt can be lost (ray-project/ray#32954), and a launcher that never hears the stop while its own
    ranks already stopped (at the dashboard's word) waits in torchrun's exit barrier for 300 s, and the attempt,
    its placement group included, with it."""
    cause_file = Path(tempfile.mkdtemp()) / "cause.json"
    proc = subprocess.Popen(command + [f"--cause-file={cause_file}"], stdin=subprocess.DEVNULL)
    stopping = False
    while proc.poll() is None:
        if not stopping and os.path.exists(stop_file):
            proc.send_signal(signal.SIGTERM)
            stopping = True
        time.sleep(0.2)
    if proc.returncode == 0:
        return None
    if cause_file.exists():
        return json.loads(cause_file.read_text())
    code = proc.returncode
    return {"outcome": "error", "cause": f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"}


node = ray.remote(run_node)
