"""One attempt of a run: `python -m daemon.worker RUN_ID --attempt ID --home DIR`, started by the supervisor."""
import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from sqlalchemy import func, select, update
from sqlmodel import Session

from .db import connect, data_home, finish_run, hold_lock, run_dir
from .models import ACTIVE, Attempt, Metric, Run, now
from .report import HttpSink
from .sink import DbSink
from .trackers import Mirror
from .system import SystemSampler

DUPLICATE = 75          # exit code: another worker of this run is alive (EX_TEMPFAIL); this one never started
TRACEBACK_LINES = 40
_held = []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m daemon.worker")
    p.add_argument("run_id", type=int)
    p.add_argument("--attempt", type=int, required=True, help="the attempt row's id")
    p.add_argument("--home", help="data directory (default $MOLT_HOME, else the user data directory)")
    # One node of an attempt placed on Ray (daemon/ray_place.py): launches this node's ranks and records nothing;
    # why they failed goes to --cause-file, which the node's Ray task reads.
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int)
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0 (torchrun's static rendezvous)")
    p.add_argument("--cause-file", type=Path)
    p.add_argument("--attempt-file", type=Path, help="the run's config and where rank 0 reports (ray_place.place)")
    args = p.parse_args(argv)
    home = data_home(args.home)
    directory = run_dir(home, args.run_id)
    directory.mkdir(parents=True, exist_ok=True)

    # More than one process: this worker launches the ranks through torchrun and holds the lock; each rank runs
    # this module too (torchrun sets RANK); rank 0 reports and records, the others only train.
    rank = os.environ.get("RANK")
    worker = rank is None and args.node_rank is None  # the supervisor's own worker: it holds the lock and records
    if not worker and sys.platform == "linux":
        # torchrun starts each rank in a session of its own, out of reach of the daemon's kill of the worker's group:
        # a rank dies with its launching worker, or a killed or hung attempt's ranks would train on beside the next
        # (and a node's launcher with its Ray task, which Ray kills to end the attempt)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the worker died before that
            return 1

    # The run's lock, held until this process dies: a second worker of the same run can never train beside this
    # one, and the daemon tells a live worker from a dead one (even one it did not start) by probing the lock.
    # Retry briefly: the daemon's probe holds it for a moment.
    deadline = time.monotonic() + 5
    while worker and (lock := hold_lock(directory / "worker.lock", f"{os.getpid()} {args.attempt}")) is None:
        if time.monotonic() > deadline:
            print(f"molt worker: another worker holds run {args.run_id}; exiting", file=sys.stderr)
            return DUPLICATE
        time.sleep(0.1)

    # A node of a Ray attempt reads the run from the file its worker wrote; reporting to a dashboard, it never opens
    # the database (only the daemon's machine needs it; the nodes share the run directory, for the checkpoints).
    given = json.loads(args.attempt_file.read_text()) if args.attempt_file else {}
    engine = None if given.get("report_to") else connect(home, migrate=False)
    if given:
        config, number, name = given["config"], given["number"], f"run {args.run_id}"
    else:
        with Session(engine) as s:
            run = s.get(Run, args.run_id)
            config, number, name = run.config, s.get(Attempt, args.attempt).number, f"{run.name} #{args.run_id}"
            if worker:
                s.execute(update(Attempt).where(Attempt.id == args.attempt).values(pid=os.getpid()))
                s.execute(update(Run).where(Run.id == args.run_id).values(pid=os.getpid()))
                s.commit()
    print(f"molt worker: run {args.run_id}, attempt {number}, pid {os.getpid()}"
          + (f", rank {rank}" if rank else ""), flush=True)
    if worker:
        rewind_to_recorded(engine, args.run_id, directory / "checkpoints")
    nproc = config.get("dist", {}).get("nproc", 1)
    ray = os.environ.get("MOLT_RAY_ADDRESS") if worker else None  # the daemon's `--ray`: place it on the cluster
    node_launcher = rank is None and not worker  # one node's launcher, started by a Ray task
    if ray or (worker and nproc > 1) or node_launcher:
        if ray:
            from .ray_place import place  # here: importing ray takes seconds, and only --ray needs it
            values = place(engine, ray, args, number, config, directory)
        else:
            values = launch(args, nproc)
        if values and node_launcher:
            args.cause_file.write_text(json.dumps(values))
        elif values:
            print(f"molt worker: attempt {number} ended: {values['cause']}", flush=True)
            _record(engine, args.run_id, args.attempt, number, values, None)
        if worker:
            _held.append(lock)
        return 1 if values else 0

    sink = None  # first: it beats while torch imports
    if rank in (None, "0") and engine is None:  # rank 0 on Ray: to the dashboard, into the attempt the worker opened
        sink = HttpSink(given["report_to"], "", config, directory, attach=(args.run_id, given["ingest_token"]))
    elif rank in (None, "0"):
        sink = DbSink(engine, args.run_id, args.attempt, spool_dir=directory,
                      keep_samples=config.get("record", {}).get("keep_steps"),
                      full_disk_at=config.get("drills", {}).get("db_full_disk_at", ()))
    summary, values, code, mirror = None, {}, 0, None
    sampler = SystemSampler(engine, args.run_id, args.attempt, sink) if isinstance(sink, DbSink) else None
    if sampler:
        sampler.start()
    try:
        from molt_engine import RunConfig, train
        cfg = RunConfig.model_validate(config)
        mirror = Mirror(sink, cfg, directory, name) if sink and cfg.report.to else None  # rank 0 only
        summary = train(cfg, mirror or sink, out_dir=directory, resume=True)
        values["outcome"] = summary.get("status", "completed")
    except BaseException as e:  # anything at all: recorded, so the attempt's cause is never a mystery
        traceback.print_exc()
        tb = traceback.format_exception(e)
        lines = "".join(tb).splitlines()
        values.update(outcome="error", cause=f"{type(e).__name__}: {e}"[:4000],
                      error="\n".join(lines[-TRACEBACK_LINES:]))
        code = 1
        if rank is not None and (error_file := os.environ.get("TORCHELASTIC_ERROR_FILE")):
            # torchrun's error file, which the launching worker reads (what @record writes). Whole or not at all:
            # torchrun SIGTERMs this rank when another dies and then parses the file, and a half-written one makes
            # torchrun itself raise, so the attempt would end as a bare "exit code 1".
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler
            os.environ["TORCHELASTIC_ERROR_FILE"] = error_file + ".part"
            get_error_handler().record_exception(e)
            os.replace(error_file + ".part", error_file)
    finally:
        # Training is over and the engine gave SIGTERM back its default (die at once). A stop arriving now, such as
        # the one torchrun passes on after rank 0 already stopped at the dashboard's word, must not kill the process
        # before its end is recorded: that end would be lost and the attempt's cause a bare "exit code 0".
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if mirror:  # before the sink closes: the trackers' last events go through it
            mirror.close(values.get("outcome", "error"))
        if sampler:
            sampler.stop()
        if isinstance(sink, HttpSink) and values.get("outcome") not in (None, "error"):
            sink.end(values["outcome"], summary)  # the dashboard records the end as _record does (an error's
        elif sink:                                # cause reaches the worker through torchrun and Ray instead)
            sink.close()
    print(f"molt worker: attempt {number} ended: {values['outcome']}", flush=True)
    if isinstance(sink, DbSink):
        _record(engine, args.run_id, args.attempt, number, values, summary)
    if worker:
        _held.append(lock)  # released by the kernel at exit, not before: the process is gone when the lock is free
    return code


def launch(args, nproc: int) -> dict | None:
    """Run the attempt as `nproc` ranks through torchrun (on this node of `--nnodes` when a Ray task started this).
    It never restarts them (the daemon decides restarts) and ends them all when one dies; then this returns which
    rank died first and why (its exit, and the exception its error file holds) as the attempt's cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    where = ["--standalone"] if args.node_rank is None else [
        f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    try:
        torchrun([*where, f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", "daemon.worker",
                  str(args.run_id), "--attempt", str(args.attempt), "--home", str(data_home(args.home)),
                  *([f"--attempt-file={args.attempt_file}"] if args.attempt_file else [])])
        return None
    except ChildFailedError as e:
        def order(item):  # killed by a signal torchrun did not send, then raised, then stopped by torchrun
            rank, f = item
            signal = f.signal_name() if f.exitcode < 0 else None
            return (signal is None) + 2 * (signal == "SIGTERM"), f.timestamp, rank

        def how(f):
            return f"killed by {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"

        # torchrun ends the other ranks when one dies, and they may fail on the lost peer first: all are named
        failures = sorted(e.failures.items(), key=order)
        texts, stacks = [], []
        for r, f in failures:  # an error file's message may nest: {"message": ..., "extraInfo": {"py_callstack"}}
            text = f.message
            while isinstance(text, dict):
                stacks.append(text.get("extraInfo", {}).get("py_callstack", ""))
                text = text.get("message")
            texts.append(f"rank {r} (pid {f.pid}) {how(f)}: {text}")
        stacks = [s for s in stacks if s]
        return {"outcome": "error", "cause": "; ".join(texts)[:4000],
                "error": "\n".join(stacks[0].splitlines()[-TRACEBACK_LINES:]) if stacks else None}


def rewind_to_recorded(engine, run_id: int, root: Path):
    """Resume from the newest checkpoint whose steps are all recorded. The engine reports a step's metrics before
    it saves that step's checkpoint, and the sink's spool (replayed before this attempt) keeps what was reported,
    so normally nothing is missing. If metrics were lost all the same (a spool on a full disk, a deleted file), a
    checkpoint past the records would leave those steps without metrics forever: point `latest` back to one at or
    before the first unrecorded step instead. Resume is exact, so those steps are trained again and reported."""
    from molt_engine import checkpoint  # here, not at the top: the supervisor imports this module, never torch

    latest = checkpoint.latest(root)
    if latest is None:
        return
    with Session(engine) as s:
        last = s.scalar(select(func.max(Metric.step)).where(Metric.run_id == run_id, Metric.name == "version"))
    recorded = -1 if last is None else last  # steps 0..recorded have metrics
    if checkpoint.step_of(latest) <= recorded + 1:
        return
    older = [p for p in checkpoint.complete(root) if checkpoint.step_of(p) <= recorded + 1]
    if older:
        print(f"molt worker: checkpoint {latest.name} is past the recorded steps (0..{recorded}); resuming from "
              f"{older[-1].name}", flush=True)
        checkpoint.point_latest(root, older[-1])


def _record(engine, run_id: int, attempt_id: int, number: int, values: dict, summary: dict | None):
    """The outcome, and for a clean end (completed, stopped, tripped) the run's final status too, compare-and-set as
    the supervisor does it: a run that ends while no daemon watches is final at once. Retried: losing it would turn
    a success into an unexplained death."""
    outcome = values["outcome"]
    for i in range(30):
        try:
            with Session(engine) as s:
                if outcome != "error":
                    values.update(ended_at=now(), cause=outcome, end_step=s.get(Run, run_id).step)
                s.execute(update(Attempt).where(Attempt.id == attempt_id).values(**values))
                if summary is not None:
                    s.execute(update(Run).where(Run.id == run_id).values(summary=summary))
                if outcome != "error":
                    finish_run(s, run_id, outcome, outcome, number, ACTIVE)
                s.commit()
            return
        except Exception as e:
            print(f"molt worker: could not record the outcome ({e}); retrying", file=sys.stderr, flush=True)
            time.sleep(1)


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # not sys.exit: interpreter teardown can wait on library threads; everything is recorded
