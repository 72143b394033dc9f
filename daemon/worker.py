"""One attempt of a run: `python -m daemon.worker RUN_ID --attempt ID --home DIR`, started by the supervisor."""
import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from sqlalchemy import func, select, update
from sqlmodel import Session

from .db import connect, data_home, hold_lock, run_dir
from .models import Attempt, Metric, Run
from .sink import DbSink

DUPLICATE = 75          # exit code: another worker of this run is alive (EX_TEMPFAIL); this one never started
TRACEBACK_LINES = 40
_held = []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m daemon.worker")
    p.add_argument("run_id", type=int)
    p.add_argument("--attempt", type=int, required=True, help="the attempt row's id")
    p.add_argument("--home", help="data directory (default $MOLT_HOME or ./var)")
    args = p.parse_args(argv)
    home = data_home(args.home)
    directory = run_dir(home, args.run_id)
    directory.mkdir(parents=True, exist_ok=True)

    # The run's lock, held until this process dies: a second worker of the same run can never train beside this
    # one, and the daemon tells a live worker from a dead one (even one it did not start) by probing the lock.
    # Retry briefly: the daemon's probe holds it for a moment.
    deadline = time.monotonic() + 5
    while (lock := hold_lock(directory / "worker.lock", f"{os.getpid()} {args.attempt}")) is None:
        if time.monotonic() > deadline:
            print(f"molt worker: another worker holds run {args.run_id}; exiting", file=sys.stderr)
            return DUPLICATE
        time.sleep(0.1)

    engine = connect(home, migrate=False)
    with Session(engine) as s:
        attempt = s.get(Attempt, args.attempt)
        config, number = s.get(Run, args.run_id).config, attempt.number
        s.execute(update(Attempt).where(Attempt.id == args.attempt).values(pid=os.getpid()))
        s.execute(update(Run).where(Run.id == args.run_id).values(pid=os.getpid()))
        s.commit()
    print(f"molt worker: run {args.run_id}, attempt {number}, pid {os.getpid()}", flush=True)

    rewind_to_recorded(engine, args.run_id, directory / "checkpoints")
    sink = DbSink(engine, args.run_id, args.attempt, spool_dir=directory,
                  keep_samples=config.get("record", {}).get("keep_steps"))
    summary, values, code = None, {}, 0
    try:
        from molt_engine import RunConfig, train
        summary = train(RunConfig.model_validate(config), sink, out_dir=directory, resume=True)
        values["outcome"] = summary.get("status", "completed")
    except BaseException as e:  # anything at all: recorded, so the attempt's cause is never a mystery
        traceback.print_exc()
        tb = traceback.format_exception(e)
        lines = "".join(tb).splitlines()
        values.update(outcome="error", cause=f"{type(e).__name__}: {e}"[:4000],
                      error="\n".join(lines[-TRACEBACK_LINES:]))
        code = 1
    finally:
        sink.close()
    print(f"molt worker: attempt {number} ended: {values['outcome']}", flush=True)
    _record(engine, args.run_id, args.attempt, values, summary)
    _held.append(lock)  # released by the kernel at exit, not before: the process is gone when the lock is free
    return code


def rewind_to_recorded(engine, run_id: int, root: Path):
    """Resume from the newest checkpoint whose steps are all recorded. The engine (today) saves checkpoint S before
    it reports step S-1's metrics, so a kill in between leaves a checkpoint past the records; resuming from it would
    leave step S-1 without metrics forever. Point `latest` back to a checkpoint at or before the first unrecorded
    step instead: resume is exact, so those steps are trained again identically and reported this time."""
    pointer = root / "latest"
    if not pointer.exists():
        return
    with Session(engine) as s:
        last = s.scalar(select(func.max(Metric.step)).where(Metric.run_id == run_id, Metric.name == "version"))
    recorded = -1 if last is None else last  # steps 0..recorded have metrics
    latest = _step(pointer.read_text().strip())
    if latest is None or latest <= recorded + 1:
        return
    older = [p for p in root.glob("step-*") if (p / "state.pt").exists() and (_step(p.name) or 0) <= recorded + 1]
    if older:
        target = max(older, key=lambda p: _step(p.name))
        print(f"molt worker: checkpoint {latest} is past the recorded steps (0..{recorded}); resuming from "
              f"{target.name}", flush=True)
        tmp = root / f".latest.{os.getpid()}"
        tmp.write_text(target.name)
        os.replace(tmp, pointer)


def _step(name: str) -> int | None:
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def _record(engine, run_id: int, attempt_id: int, values: dict, summary: dict | None):
    """The outcome, for the supervisor (which owns the run's status). Retried: losing it would turn a success into
    an unexplained death."""
    for i in range(30):
        try:
            with Session(engine) as s:
                s.execute(update(Attempt).where(Attempt.id == attempt_id).values(**values))
                if summary is not None:
                    s.execute(update(Run).where(Run.id == run_id).values(summary=summary))
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
