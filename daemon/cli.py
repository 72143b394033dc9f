"""`molt daemon` / `python -m daemon`: the command line that runs a Supervisor until SIGTERM or Ctrl-C."""
import argparse
import logging
import os
import signal
import sys
import threading

from .supervisor import DaemonRunning, Supervisor

log = logging.getLogger("molt.daemon")


def cli_main(argv=None) -> int:
    """`molt daemon` / `python -m daemon`: supervise until SIGTERM or Ctrl-C."""
    p = argparse.ArgumentParser(prog="molt daemon", description="Run queued training runs as supervised workers. "
                                                     "`molt daemon stop --home DIR` stops one gracefully.")
    p.add_argument("--home", help="data directory (default $MOLT_HOME, else the user data directory)")
    p.add_argument("--concurrency", type=int, default=1, help="runs trained at once (default 1)")
    p.add_argument("--heartbeat-timeout", type=float, default=float(os.environ.get("MOLT_HEARTBEAT_TIMEOUT", 60)),
                   help="seconds without a heartbeat before a worker counts as hung and is restarted (default "
                        "$MOLT_HEARTBEAT_TIMEOUT, else 60: `molt serve` passes it on to its daemon)")
    p.add_argument("--backoff", type=float, default=2.0,
                   help="seconds before the first restart; doubles with each further one (default 2)")
    p.add_argument("--backoff-max", type=float, default=60.0)
    p.add_argument("--stop-grace", type=float, default=120.0,
                   help="seconds a stopping worker gets to finish its step, checkpoint and exit before SIGKILL "
                        "(default 120)")
    p.add_argument("--envs", action="append", metavar="DIR",
                   help="a directory of your own envs (*.py), repeatable; default $MOLT_ENVS. Every worker loads it")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the database (default 0.5)")
    p.add_argument("--gpus", help="comma-separated GPU ids the daemon gives its runs' workers, e.g. 0,1; "
                                  "'' = none (default: every visible GPU)")
    p.add_argument("--ray", metavar="ADDRESS", default=os.environ.get("MOLT_RAY_ADDRESS") or None,
                   help="place runs on this Ray cluster (auto, or HOST:PORT) instead of this machine; default "
                        "$MOLT_RAY_ADDRESS")
    a = p.parse_args(argv)
    if a.concurrency < 1:
        p.error("--concurrency must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if a.envs or os.environ.get("MOLT_ENVS"):  # else the daemon needs nothing of the engine
        from molt_engine.envs import load_user_envs
        for error in load_user_envs(a.envs).values():  # said at start; a run naming it is refused at submit
            log.error("env file failed to load: %s", error)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sup = Supervisor(a.home, concurrency=a.concurrency, heartbeat_timeout=a.heartbeat_timeout, poll=a.poll,
                     backoff=a.backoff, backoff_max=a.backoff_max, stop_grace=a.stop_grace,
                     gpus=None if a.gpus is None else [g.strip() for g in a.gpus.split(",") if g.strip()], ray=a.ray)
    try:
        sup.run(stop)
    except DaemonRunning as e:
        print(f"molt daemon: {e}", file=sys.stderr)
        return 1
    return 0
