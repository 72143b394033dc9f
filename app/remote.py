"""`molt runs ...` and `molt eval`: the REST API's client, for CI (talks to a running `molt serve`/`molt web`)."""
import json
import os
import re
import sys
import time
from pathlib import Path

# `molt train`, `molt runs create --wait` / `molt runs wait`: the exit status says how the run ended
EXIT_CODES = {"completed": 0, "failed": 1, "tripped": 3, "stopped": 4}
EXIT_BAD_INPUT, EXIT_UNREACHABLE, EXIT_TIMEOUT = 2, 5, 124
EXIT_MISSED = 6  # `molt eval --min`: a metric is below its threshold


def add_commands(commands):
    """The `runs` and `eval` subcommands of `molt`."""
    r = commands.add_parser("runs", help="create, watch and control runs through the REST API (for CI)",
                            description="Talks to a running `molt serve`/`molt web`. Exit status of create --wait "
                                        "and wait: 0 completed, 1 failed, 3 tripped, 4 stopped, 124 timed out, "
                                        "2 invalid input, 5 server unreachable or token refused.")
    server_options(r)
    rc = r.add_subparsers(dest="runs_command", required=True)
    c = rc.add_parser("create", help="queue a run from a JSON config")
    c.add_argument("--config", type=Path, required=True, help="a run config (or a request body with a config key)")
    c.add_argument("--name")
    c.add_argument("--tag", action="append", default=None, help="repeatable")
    c.add_argument("--max-restarts", type=int)
    wait_options(c, "wait until the run ends; the exit status says how")
    lst = rc.add_parser("list", help="runs, newest first")
    lst.add_argument("--status", action="append")
    lst.add_argument("--tag")
    for name, text in [("get", "a run as JSON"), ("stop", "stop a run (it checkpoints first)"),
                       ("resume", "continue a stopped, failed or tripped run from its latest checkpoint")]:
        sub = rc.add_parser(name, help=text)
        sub.add_argument("id", type=int)
    wt = rc.add_parser("wait", help="wait until a run ends; the exit status says how")
    wt.add_argument("id", type=int)
    wt.add_argument("--timeout", type=float)
    for sub in (c, lst, wt):  # create and wait print a summary unless --json (the config alone is ~130 lines)
        sub.add_argument("--json", action="store_true", help="the whole record (config included), not a summary")
    m = rc.add_parser("metrics", help="a run's metrics as JSON (or CSV)")
    m.add_argument("id", type=int)
    m.add_argument("--names", help="comma-separated")
    m.add_argument("--max-points", type=int, help="min/max-bucketed to this many points per series")
    m.add_argument("--csv", action="store_true", help="every value, as CSV")
    r.set_defaults(func=cmd_runs)

    e = commands.add_parser("eval", help="evaluate a run's checkpoint (or a model) through the REST API (for CI)",
                            description="Queues an evaluation; with --wait prints its metrics as JSON. Exit status: "
                                        "0 completed (every --min met), 6 a --min threshold missed, 1 failed, "
                                        "4 stopped, 124 timed out, 2 invalid input, 5 server unreachable.")
    server_options(e)
    e.add_argument("--run", type=int, help="the run whose checkpoint is evaluated")
    e.add_argument("--checkpoint", default="best", help="best (default), final, latest or a step number")
    e.add_argument("--model", help="a model section as JSON (e.g. '{\"preset\": \"tiny-dense\"}') instead of --run")
    e.add_argument("--env", help="the env (default: the run's)")
    e.add_argument("--env-args", help="the env's arguments as JSON")
    e.add_argument("--dataset", help="a dataset file to evaluate on instead of an env")
    e.add_argument("--episodes", type=int, default=64, help="episodes in all (default 64): episodes/k prompts")
    e.add_argument("--k", type=int, default=1, help="samples per prompt, for pass@k (default 1)")
    e.add_argument("--temperature", type=float, help="0 = greedy; default: greedy with --k 1, with a larger --k "
                   "the run's own loop.temperature")
    e.add_argument("--seed", type=int, default=0)
    wait_options(e, "wait until it ends and print its metrics")
    e.add_argument("--min", action="append", default=[], metavar="METRIC=VALUE",
                   help="repeatable: exit 6 if METRIC (e.g. pass@1, pass@4, mean_reward) is below VALUE; "
                        "implies --wait")
    e.set_defaults(func=cmd_runs, runs_command="eval")

    w = commands.add_parser("sweep", help="queue a sweep from a YAML (or JSON) file through the REST API",
                            description="Queues the sweep (docs/sweeps.md); with --wait prints its best "
                                        "configuration as JSON once it ends. Exit status: 0 completed, 1 failed, "
                                        "4 stopped, 124 timed out, 2 invalid input, 5 server unreachable.")
    server_options(w)
    w.add_argument("file", type=Path, help="the sweep: name, config, params, method, metric, ...")
    wait_options(w, "wait until it ends and print the best configuration")
    w.set_defaults(func=cmd_runs, runs_command="sweep")


def wait_options(p, what: str):
    """--wait (`what` it does) and --timeout, as runs create, eval and sweep take them."""
    p.add_argument("--wait", action="store_true", help=what)
    p.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds (exit 124)")

def server_options(p):
    p.add_argument("--url", default=os.environ.get("MOLT_URL", "http://127.0.0.1:8000"),
                   help="the server (default $MOLT_URL, else http://127.0.0.1:8000)")
    p.add_argument("--token", default=None,
                   help="default $MOLT_TOKEN, else the token file of the local data directory ($MOLT_HOME, else "
                        "the user data directory)")

# ---- runs (REST client) ---------------------------------------------------------------------------------------

def cmd_runs(args) -> int:
    import httpx
    # error messages name the command typed
    who = {"eval": "molt eval", "sweep": "molt sweep"}.get(args.runs_command, "molt runs")
    token = args.token or os.environ.get("MOLT_TOKEN") or local_token()
    if not token:
        print(f"{who}: no token: pass --token, set MOLT_TOKEN, or run where the data directory is",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    client = httpx.Client(base_url=args.url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=60)
    try:
        return RUNS_COMMANDS[args.runs_command](client, args)
    except httpx.HTTPError as e:
        print(f"{who}: cannot reach {args.url}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ApiError as e:
        print(f"{who}: {e}", file=sys.stderr)
        return e.code


class ApiError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def local_token() -> str | None:
    from daemon.db import data_home
    path = data_home() / "token"
    return path.read_text().strip() if path.exists() else None


def call(client, method: str, path: str, **kwargs):
    response = client.request(method, path, **kwargs)
    if response.is_success:
        return response
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    if isinstance(detail, list):  # validation errors, each naming its field
        detail = "invalid input:\n  " + "\n  ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:] or e['loc'])}: {e['msg']}" for e in detail)
    code = EXIT_BAD_INPUT if response.status_code in (400, 404, 409, 422) else EXIT_UNREACHABLE
    raise ApiError(f"{response.status_code}: {detail}", code)


def read_json(path: Path):
    """A JSON file the user named: a missing file or invalid JSON is bad input with its reason, not a traceback."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        print(f"molt: cannot read {path} as JSON: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def runs_create(client, args) -> int:
    body = read_json(args.config)
    if not (isinstance(body, dict) and "config" in body and "env" not in body):
        body = {"config": body}
    for key, value in [("name", args.name), ("tags", args.tag), ("max_restarts", args.max_restarts)]:
        if value is not None:
            body[key] = value
    run = call(client, "POST", "/api/v1/runs", json=body).json()
    print(f"run {run['id']} queued: {run['name']}", file=sys.stderr)
    if not args.wait:
        print(json.dumps(run, indent=1) if args.json else summary(run, args.url))
        return 0
    return wait_for(client, args, run["id"])


def summary(run: dict, url: str) -> str:
    config, model = run["config"], run["config"].get("model") or {}
    rows = {"id": run["id"], "name": run["name"], "status": run["status"], "env": config.get("env"),
            "model": model.get("path") or model.get("preset"), "steps": f"{run['step']}/{run['total_steps']}",
            "url": f"{url.rstrip('/')}/runs/{run['id']}"}
    return "\n".join(f"{key:<7} {value}" for key, value in rows.items())


def wait_for(client, args, run_id: int) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    last = None
    while True:
        chunk = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
        run = call(client, "GET", f"/api/v1/runs/{run_id}/wait", params={"timeout": chunk}).json()
        if (run["status"], run["step"]) != last:
            last = (run["status"], run["step"])
            print(f"run {run_id}: {run['status']}, step {run['step']}/{run['total_steps']}", file=sys.stderr)
        if run["status"] in EXIT_CODES:
            print(json.dumps(run, indent=1) if args.json else summary(run, args.url))
            if run["last_error"] and run["status"] != "completed":
                print(f"run {run_id} {run['status']}: {run['last_error']}", file=sys.stderr)
            return EXIT_CODES[run["status"]]
        if deadline is not None and time.monotonic() >= deadline:
            print(f"run {run_id}: still {run['status']} after {args.timeout:g}s", file=sys.stderr)
            return EXIT_TIMEOUT


def runs_list(client, args) -> int:
    params = [("status", s) for s in args.status or []] + ([("tag", args.tag)] if args.tag else [])
    runs = call(client, "GET", "/api/v1/runs", params=params).json()
    if args.json:
        print(json.dumps(runs, indent=1))
        return 0
    print(f"{'id':>5}  {'status':<10} {'step':>11}  {'reward':>7}  {'restarts':>8}  {'alerts':>6}  name")
    for r in runs:
        reward = "" if r["reward"] is None else f"{float(r['reward']):.3f}"
        print(f"{r['id']:>5}  {r['status']:<10} {str(r['step']) + '/' + str(r['total_steps']):>11}  {reward:>7}  "
              f"{r['restarts']:>8}  {r['alerts_open']:>6}  {r['name']}")
    return 0


def runs_metrics(client, args) -> int:
    if args.csv:
        sys.stdout.write(call(client, "GET", f"/api/v1/runs/{args.id}/metrics.csv").text)
        return 0
    params = {k: v for k, v in [("names", args.names), ("max_points", args.max_points)] if v is not None}
    print(json.dumps(call(client, "GET", f"/api/v1/runs/{args.id}/metrics", params=params).json(), indent=1))
    return 0


def _print(response) -> int:
    print(json.dumps(response.json(), indent=1))
    return 0



def evaluate(client, args) -> int:
    """`molt eval`: queue the evaluation; with --wait (or --min), wait for it, print its metrics, check --min."""
    thresholds = {}
    for item in args.min:
        name, _, value = item.partition("=")
        try:
            thresholds[name.strip()] = float(value)
        except ValueError:
            print(f"molt eval: --min takes METRIC=VALUE (a number), not {item!r}", file=sys.stderr)
            return EXIT_BAD_INPUT
    step = args.checkpoint.isascii() and args.checkpoint.isdigit()
    body = {"checkpoint": int(args.checkpoint) if step else args.checkpoint,
            "episodes": args.episodes, "k": args.k, "temperature": args.temperature, "seed": args.seed}
    for key, value, as_json in [("run_id", args.run, False), ("model", args.model, True), ("env", args.env, False),
                                ("env_args", args.env_args, True), ("dataset", args.dataset, False)]:
        if value is not None:
            try:
                body[key] = json.loads(value) if as_json else value
            except json.JSONDecodeError as e:
                print(f"molt eval: --{key.replace('_', '-')} is not JSON: {e}", file=sys.stderr)
                return EXIT_BAD_INPUT
    evaluation = call(client, "POST", "/api/v1/evals", json=body).json()
    print(f"evaluation {evaluation['id']} queued", file=sys.stderr)
    if args.temperature is None and args.k > 1:  # the temperature it chose: pass@k needs sampling, not greedy
        print(f"molt eval: --k {args.k} without --temperature: sampling at the run's temperature "
              f"{evaluation['config']['temperature']:g}", file=sys.stderr)
    if not (args.wait or thresholds):
        print(json.dumps(evaluation, indent=1))
        return 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while evaluation["status"] not in ("completed", "failed", "stopped"):
        if deadline is not None and time.monotonic() >= deadline:
            print(f"evaluation {evaluation['id']}: still {evaluation['status']} after {args.timeout:g}s",
                  file=sys.stderr)
            return EXIT_TIMEOUT
        chunk = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
        evaluation = call(client, "GET", f"/api/v1/evals/{evaluation['id']}/wait", params={"timeout": chunk}).json()
    if evaluation["status"] != "completed":
        print(f"evaluation {evaluation['id']} {evaluation['status']}: {evaluation['last_error']}", file=sys.stderr)
        return EXIT_CODES[evaluation["status"]]
    metrics = evaluation["metrics"]
    print(json.dumps(metrics, indent=1))
    unknown = sorted(set(thresholds) - set(metrics))
    if unknown:
        print(f"molt eval: no metric {', '.join(unknown)}; it has {', '.join(metrics)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    missed = [f"{name} {metrics[name]:.4g} < {value:g}" for name, value in thresholds.items()
              if not metrics[name] >= value]
    for line in missed:
        print(f"molt eval: below threshold: {line}", file=sys.stderr)
    return EXIT_MISSED if missed else 0


def sweep(client, args) -> int:
    import yaml

    class Loader(yaml.SafeLoader):  # YAML 1.1 reads 1e-3 (no dot) as a string: a learning rate must be a number
        pass
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                 list("-+0123456789."))
    try:
        body = yaml.load(args.file.read_text(), Loader=Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ApiError(f"cannot read {args.file} as YAML: {e}", EXIT_BAD_INPUT) from None
    swept = call(client, "POST", "/api/v1/sweeps", json=body).json()
    print(f"sweep {swept['id']} queued: {args.url.rstrip('/')}/sweeps/{swept['id']}", file=sys.stderr)
    if not args.wait:
        return 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while (swept := call(client, "GET", f"/api/v1/sweeps/{swept['id']}").json())["status"] == "running":
        if deadline is not None and time.monotonic() > deadline:
            print(f"molt sweep: sweep {swept['id']} still running after {args.timeout:g}s", file=sys.stderr)
            return EXIT_TIMEOUT
        time.sleep(2.0)
    from daemon.sweeps import with_params
    best = swept["best"] or {}
    print(json.dumps({"sweep": swept["id"], "status": swept["status"], "metric": swept["metric"],
                      "score": best.get("score"), "params": best.get("params"),
                      "config": with_params(body["config"], best.get("params", {}))}, indent=2))
    return EXIT_CODES.get(swept["status"], 1) if best else 1


RUNS_COMMANDS = {
    "create": runs_create,
    "list": runs_list,
    "get": lambda client, a: _print(call(client, "GET", f"/api/v1/runs/{a.id}")),
    "stop": lambda client, a: _print(call(client, "POST", f"/api/v1/runs/{a.id}/stop")),
    "resume": lambda client, a: _print(call(client, "POST", f"/api/v1/runs/{a.id}/resume")),
    "wait": lambda client, a: wait_for(client, a, a.id),
    "metrics": runs_metrics,
    "eval": evaluate,
    "sweep": sweep,
}
