"""The `molt` command line: `molt serve` (the dashboard with its daemon), `molt train` (headless, no server),
`molt daemon` and `molt web` (the two halves of serve, for production); `molt runs ...` and `molt eval` (the REST
API's client, for CI) are in remote.py."""
import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from . import remote
from .remote import EXIT_CODES, read_json

STOP_GRACE = 120.0  # seconds a stopping worker gets to finish its step and checkpoint before SIGKILL


def main(argv=None):
    parser = argparse.ArgumentParser(prog="molt", description="Molt Studio: RL for language-model agents.")
    commands = parser.add_subparsers(dest="command", required=True)

    t = commands.add_parser("train", help="train a policy in this terminal (no server)")
    t.add_argument("--config", type=Path, help="JSON run config; the flags below override it")
    t.add_argument("--env", help="environment name, e.g. max_digit, calculator, guess_number, shapes")
    t.add_argument("--preset", help="built-in model, e.g. tiny-dense, tiny-vlm")
    t.add_argument("--model-path", help="local Hugging Face causal-LM or vision-language directory instead of a preset")
    t.add_argument("--steps", type=int, help="optimizer steps")
    t.add_argument("--max-staleness", type=int, help="policy versions a sample may lag; 0 = on-policy")
    t.add_argument("--seed", type=int)
    t.add_argument("--out", type=Path, help="output directory (default runs/<env>-<time>); with --nnodes the same "
                                            "directory on every node, on storage they all see (config, checkpoints)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out (its saved config is used unless --config; "
                        "with --report-to, the same dashboard run goes on)")
    t.add_argument("--nproc", type=int, help="processes (data-parallel ranks, started through torchrun); sets "
                                             "dist.nproc")
    t.add_argument("--nnodes", type=int, help="machines of a multi-node run started by hand: run this command on "
                                              "each, with its --node-rank and the same --rdzv-endpoint and --out "
                                              "(shared storage); --nproc ranks per node, all in one data-parallel run")
    t.add_argument("--node-rank", type=int, help="this machine's index, 0 to nnodes-1; node 0 holds rank 0, which "
                                                 "writes the config, checkpoints and final policy, and reports")
    t.add_argument("--rdzv-endpoint", type=endpoint, metavar="HOST:PORT",
                   help="node 0's address and a free port there, where the nodes meet (the same on every node)")
    t.add_argument("--report-to", metavar="URL", help="a dashboard to report this run to, as an external run")
    t.add_argument("--report-to-tracker", metavar="NAMES", help="experiment trackers to mirror the run to, "
                   "comma-separated: wandb, mlflow, tensorboard, trackio (sets report.to; settings: the config's report)")
    t.add_argument("--token", default=os.environ.get("MOLT_TOKEN"),
                   help="its report token (`molt token --report` there) or its token; default $MOLT_TOKEN, better "
                        "than this flag, which any user of the machine sees in `ps`")
    envs_option(t)
    t.set_defaults(func=cmd_train)

    s = commands.add_parser("serve", help="the dashboard and its daemon in one command (migrates the database, "
                                          "prints the URL to open; Ctrl-C stops both)")
    web_options(s)
    s.add_argument("--concurrency", type=int, default=1, help="runs trained at once (default 1)")
    s.add_argument("--gpus", help="comma-separated GPU ids the daemon gives its runs, e.g. 0,1; '' = none "
                                  "(default: every visible GPU)")
    s.add_argument("--ray", metavar="ADDRESS", help="place runs on this Ray cluster (auto, or HOST:PORT) instead of "
                                                    "this machine")
    s.add_argument("--stop-grace", type=float, default=STOP_GRACE,
                   help=f"on Ctrl-C, seconds the running workers get to checkpoint and stop (default {STOP_GRACE:g})")
    s.add_argument("--keep-daemon", action="store_true",
                   help="on Ctrl-C, leave the daemon and its runs running (`molt daemon stop` stops it later)")
    s.set_defaults(func=cmd_serve)

    w = commands.add_parser("web", help="only the web app and REST API (run `molt daemon` beside it)")
    web_options(w)
    w.set_defaults(func=cmd_web)

    k = commands.add_parser("token", help="print the dashboard's token; with --report its report token, which may "
                                          "only register and report runs (for MOLT_TOKEN on a training machine)")
    k.add_argument("--home", help="data directory (default $MOLT_HOME, else the user data directory)")
    k.add_argument("--report", action="store_true", help="the report token (it changes with the token)")
    k.add_argument("--tinker", action="store_true", help="the Tinker API's key (TINKER_API_KEY for the tinker SDK, "
                                                         "with base_url http://HOST:PORT/tinker; docs/tinker.md)")
    k.set_defaults(func=cmd_token)

    # `molt daemon ...` hands its arguments to the daemon's own parser (molt daemon --help lists them)
    d = commands.add_parser("daemon", help="only the daemon that runs and supervises queued runs "
                                                 "(`molt daemon stop` stops one)", add_help=False)
    d.add_argument("daemon_args", nargs=argparse.REMAINDER, help="see `molt daemon --help`")

    remote.add_commands(commands)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["daemon"]:  # argparse's REMAINDER would swallow `--help` itself
        sys.exit(__import__("daemon").cli_main(argv[1:]))
    args = parser.parse_args(argv)
    sys.exit(args.func(args))


def endpoint(text: str) -> str:
    """--rdzv-endpoint: HOST:PORT (argparse names the flag in its error)."""
    host, _, port = text.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT, e.g. node0.example:29500")
    return text


def envs_option(p):
    p.add_argument("--envs", action="append", type=Path, metavar="DIR",
                   help="a directory of your own envs (*.py files), repeatable; default $MOLT_ENVS. Every process "
                        "molt starts (daemon, workers) loads it too")


def use_envs(dirs: list[Path] | None, who: str):
    """--envs: exported as $MOLT_ENVS for this process and all it starts, loaded now to say what it holds."""
    from molt_engine.envs import ENVS, load_user_envs
    before = set(ENVS)
    errors = load_user_envs(dirs)
    if os.environ.get("MOLT_ENVS"):
        print(f"{who}: envs from {os.environ['MOLT_ENVS']}: {', '.join(sorted(set(ENVS) - before)) or 'none'}",
              flush=True)
    for error in errors.values():
        print(f"{who}: env file failed to load: {error}", file=sys.stderr, flush=True)


def web_options(p):
    envs_option(p)
    p.add_argument("--home", help="data directory (default $MOLT_HOME, else the user data directory)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--webhook-url", default=os.environ.get("MOLT_WEBHOOK_URL"),
                   help="POST every alert as JSON here (Slack-compatible `text`; default $MOLT_WEBHOOK_URL)")
    p.add_argument("--public-url", default=os.environ.get("MOLT_PUBLIC_URL"),
                   help="the address users open, for links in webhook posts (default $MOLT_PUBLIC_URL)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics (Prometheus) without the token, e.g. to a scraper inside a private network")


# ---- serve / web / daemon ---------------------------------------------------------------------------------------------

def cmd_serve(args) -> int:
    from daemon.records import Records
    from daemon.keeper import Keeper
    records = Records(args.home)  # applies the migrations before anything else touches the database
    print(f"molt serve: data directory {records.home}", flush=True)
    use_envs(args.envs, "molt serve")
    keeper = Keeper(records, daemon_command(records.home, args))  # starts the daemon, or adopts a running one
    keeper.start()
    try:
        serve_web(records.home, args)
    finally:
        shutdown(records, keeper, args)
    return 0


def cmd_web(args) -> int:
    from daemon.records import Records
    home = Records(args.home).home
    print(f"molt web: data directory {home}", flush=True)
    use_envs(args.envs, "molt web")
    if not Records(home, migrate=False).daemon_status()["running"]:
        print("molt web: no daemon owns this data directory yet: queued runs wait until `molt daemon` runs",
              file=sys.stderr)
    serve_web(home, args)
    return 0


def daemon_command(home: Path, args) -> list[str]:
    # $MOLT_ENVS reaches the daemon and its workers through the environment
    return [sys.executable, "-m", "daemon", "--home", str(home), "--concurrency", str(args.concurrency),
            "--stop-grace", str(args.stop_grace), *(["--gpus", args.gpus] if args.gpus is not None else []),
            *(["--ray", args.ray] if args.ray else [])]


def serve_web(home: Path, args):
    """uvicorn in this thread until Ctrl-C or SIGTERM; the URL with the token is printed once it listens."""
    import uvicorn

    from daemon.db import DASHBOARD

    from .auth import load_or_create_token
    from .main import create_app
    token = load_or_create_token(home)
    app = create_app(home, token, webhook_url=args.webhook_url, public_url=args.public_url,
                     metrics_public=args.metrics_public, concurrency=getattr(args, "concurrency", None),
                     gpus=None if getattr(args, "gpus", None) is None else [g.strip() for g in args.gpus.split(",")
                                                                            if g.strip()])
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           ws_ping_interval=20, timeout_graceful_shutdown=3))

    def announce():
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        host = f"[{host}]" if ":" in host else host
        (home / DASHBOARD).write_text(json.dumps({"url": args.public_url or f"http://{host}:{port}"}))
        print(f"\nMolt Studio is ready: http://{host}:{port}/?token={token}\n"
              f"(REST API docs: http://{host}:{port}/docs; Ctrl-C stops)\n", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    # uvicorn turns Ctrl-C and SIGTERM into a graceful shutdown, then re-raises the signal to the handler that was
    # there before. A no-op handler there lets serve() return normally, so that `molt serve` can stop the runs
    # (with the default handlers SIGTERM would kill the process, and asyncio would log a KeyboardInterrupt).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        (home / DASHBOARD).unlink(missing_ok=True)


def _interrupt(*_):
    raise KeyboardInterrupt


def shutdown(records, keeper, args):
    """Stop watching the daemon, then stop it (its workers checkpoint; the next daemon resumes their runs), unless
    --keep-daemon. A second Ctrl-C skips the wait for the runs: their workers keep running, adopted later."""
    from daemon.keeper import stop_daemon
    for sig in (signal.SIGINT, signal.SIGTERM):  # from now on a second Ctrl-C cuts the wait short
        signal.signal(sig, _interrupt)
    keeper.close()
    if args.keep_daemon:
        print(f"molt serve: the daemon keeps running; `molt daemon stop --home {records.home}` stops it", flush=True)
    else:
        stopped = stop_daemon(records, args.stop_grace, say=lambda text: print(f"molt serve: {text}", flush=True))
        if keeper.proc is not None:
            if not stopped:  # our child has not taken the lock yet (still starting), so it has no runs to stop
                keeper.proc.terminate()
            keeper.proc.wait(15)  # our child: reaped here, or it would linger as a zombie
    print("molt serve: stopped", flush=True)


def cmd_token(args) -> int:
    from daemon.db import data_home

    from .auth import Auth, load_or_create_token
    token = load_or_create_token(data_home(args.home))
    auth = Auth(token)
    print(auth.report if args.report else auth.tinker if args.tinker else token)
    return 0


def cmd_train(args) -> int:
    # transformers' own bars ("Loading weights", "Writing model shards") would break our progress line
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    from molt_engine import RunConfig, config_errors, train
    from molt_engine.config import ValidationError, untrained_lora

    hf_logging.disable_progress_bar()
    use_envs(args.envs, "molt train")
    nodes = args.nnodes
    for wrong, message in [
            (args.report_to and not args.token, "--report-to needs the dashboard's token: --token or $MOLT_TOKEN"),
            (args.resume and not args.out, "--resume needs --out, the directory of the run to continue"),
            (nodes is None and (args.node_rank is not None or args.rdzv_endpoint),
             "--node-rank and --rdzv-endpoint need --nnodes, the number of machines"),
            (nodes is not None and nodes < 1, f"--nnodes must be at least 1, not {nodes}"),
            (nodes and (args.node_rank is None or not args.rdzv_endpoint),
             "--nnodes needs --node-rank (this machine's index) and --rdzv-endpoint (node 0's HOST:PORT)"),
            (nodes and not 0 <= (args.node_rank or 0) < nodes,
             f"--node-rank must be 0 to {(nodes or 1) - 1} with --nnodes {nodes}, not {args.node_rank}"),
            (nodes and not args.out, "--nnodes needs --out: the same directory on every node, on storage they all "
                                     "see (each node's default would differ)")]:
        if wrong:
            print(f"molt train: {message}", file=sys.stderr)
            return 2
    saved = args.out / "config.json" if args.out else None
    if "LOCAL_RANK" in os.environ and args.config == saved and not saved.exists():  # node 0 wrote it (our launch)
        print(f"molt train: {args.config} is missing on this node: every node must see --out (shared storage)",
              file=sys.stderr)
        return 2
    if args.config:
        config = read_json(args.config)
    elif args.resume and saved.exists():
        config = read_json(saved)
    else:
        config = {}
    for key, value in [("env", args.env), ("seed", args.seed)]:
        if value is not None:
            config[key] = value
    if args.preset or args.model_path:  # the flags pick the policy; the config's dtype, device and the rest stay
        config["model"] = {**(config.get("model") or {}), "preset": args.preset, "path": args.model_path}
    for key, value in [("steps", args.steps), ("max_staleness", args.max_staleness)]:
        if value is not None:
            config.setdefault("loop", {})[key] = value
    for key, value in [("nproc", args.nproc), ("nnodes", nodes)]:
        if value is not None:
            config.setdefault("dist", {})[key] = value
    if args.report_to_tracker is not None:
        config.setdefault("report", {})["to"] = [n.strip() for n in args.report_to_tracker.split(",") if n.strip()]
    try:
        cfg = RunConfig.model_validate(config)
    except ValidationError as e:
        print("invalid config:\n  " + "\n  ".join(config_errors(e)), file=sys.stderr)
        return 2
    if problem := untrained_lora(cfg):
        print(f"invalid config:\n  {problem}", file=sys.stderr)
        return 2
    if cfg.dist.nnodes > 1 and nodes is None and "LOCAL_RANK" not in os.environ:  # not one of our ranks
        print(f"molt train: dist.nnodes is {cfg.dist.nnodes}: run each node with --nnodes, --node-rank and "
              "--rdzv-endpoint (or queue the run on a daemon started with --ray)", file=sys.stderr)
        return 2
    ranks = cfg.dist.nnodes * cfg.dist.nproc
    out = args.out or Path("runs") / f"{cfg.env}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    # torchrun sets RANK in each process it starts; a launcher stands for its node's first rank
    rank = int(os.environ.get("RANK", (args.node_rank or 0) * cfg.dist.nproc))
    if rank == 0:  # whole or not at all: every rank, on every node, reads it as it starts
        (out / f".config.json.{os.getpid()}").write_text(cfg.model_dump_json(indent=1))
        os.replace(out / f".config.json.{os.getpid()}", out / "config.json")
    if ranks > 1 and "LOCAL_RANK" not in os.environ:  # not a rank yet: start them, each runs this command
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun
        # Several nodes: torchrun's static rendezvous, not c10d, because the node rank is given: node 0 is the one
        # that hosts the rendezvous store at the endpoint and holds global rank 0 (config, checkpoints, reports),
        # where c10d would number the nodes in the order they arrive. Nodes are not replaced mid-run either way.
        where = ["--standalone"] if not nodes else [f"--nnodes={nodes}", f"--node-rank={args.node_rank}",
                                                   "--rdzv-backend=static", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.report_to:  # the ranks read it from there: on their command lines `ps` would show it to anyone
            os.environ["MOLT_TOKEN"] = args.token
        try:
            # The ranks of every node read the config node 0 wrote (before its rendezvous, so before any rank starts)
            torchrun([*where, f"--nproc-per-node={cfg.dist.nproc}", "-m", "app.cli", "train",
                      "--config", str(out / "config.json"), "--out", str(out)] + ["--resume"] * args.resume
                     + ["--report-to", args.report_to] * bool(args.report_to))
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            print(f"molt train: rank {rank} failed: {failure.message}", file=sys.stderr)
            return EXIT_CODES["failed"]
        return 0
    sink = ProgressSink(cfg.loop.steps) if rank == 0 else None
    if sink and args.report_to:  # delivered by a thread from a spool in `out`: training never waits on the dashboard
        from daemon.report import HttpSink
        sink = HttpSink(args.report_to, args.token, cfg.model_dump(mode="json"), out, echo=sink,
                        ranks=int(os.environ.get("WORLD_SIZE", "1")), resume=args.resume)
    mirror = None
    if sink and cfg.report.to:  # rank 0 only
        from daemon.trackers import Mirror
        mirror = Mirror(sink, cfg, out, out.name)
    summary = {"status": "failed"}
    try:
        summary = train(cfg, mirror or sink, out_dir=out, resume=args.resume)
    finally:
        if mirror:  # first: its last events go through the sink
            mirror.close(summary["status"])
        if sink and args.report_to:  # the outcome is reported last, as a daemon's worker records its own
            sink.echo.bar.close()
            sink.end(summary["status"], summary, error=str(sys.exc_info()[1] or "") or None)
        elif sink:
            sink.bar.close()
    if rank == 0:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
    if "LOCAL_RANK" in os.environ:  # a torchrun rank, all written: end as the daemon's worker does, without the
        sys.stdout.flush()          # interpreter's teardown, which aborted a finished rank on a library thread once
        sys.stderr.flush()          # ("terminate called without an active exception")
        os._exit(EXIT_CODES[summary["status"]])
    return EXIT_CODES[summary["status"]]


class ProgressSink:
    """A progress bar with the step, the reward and its 10-step moving average."""

    def __init__(self, steps: int):
        from tqdm import tqdm
        self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)
        self.rewards = []
        self.postfix = {}

    def metrics(self, step, values):
        if "reward_mean" in values:
            self.rewards.append(values["reward_mean"])
            self.postfix.update(reward=f"{values['reward_mean']:.2f}", avg10=f"{sum(self.rewards[-10:]) / len(self.rewards[-10:]):.2f}")
            self.bar.update(step + 1 - self.bar.n)  # a resumed run starts mid-way
        if "eval_reward" in values:
            self.postfix["eval"] = f"{values['eval_reward']:.2f}"
        self.bar.set_postfix(self.postfix, refresh=True)

    def alert(self, kind, message, **data):
        self.bar.write(f"ALERT {kind}: {message}")

    def event(self, kind, message, **data):
        self.bar.write(f"{kind}: {message}")

    def checkpoint(self, step, path, **info):
        pass

    def samples(self, step, kind, records):
        pass


if __name__ == "__main__":
    main()
