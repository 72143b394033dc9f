"""The Evaluations page: every evaluation with its metrics and the difference to a chosen baseline (with its standard
error), a form that queues one (the run page's Evaluate action opens it), and the same table as CSV."""
import csv
import io
import math
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, HTTPException, Query, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError

from daemon import eval_records
from daemon.eval_records import EvalInvalid, EvalRequest

from .pages import check_csrf, guarded, render

router = APIRouter(include_in_schema=False)
FIRST = ("mean_reward", "mean_reward_se", "pass@1")  # then pass@k, avg@k and the env's own metrics


def table(request: Request, run_id: int | None, baseline: int | None) -> tuple[list[dict], list[str], dict | None]:
    """The evaluations (of one run, or all), the metric columns, and the baseline row if one is chosen."""
    rows = eval_records.list_evals(request.app.state.records.engine, run_id)
    found = {name for r in rows for name in (r["metrics"] or {})}
    names = [n for n in FIRST if n in found] + sorted(found - set(FIRST) - {"episodes", "errors"})
    base = next((r for r in rows if r["id"] == baseline and r["metrics"]), None)
    for r in rows:
        m, b = r["metrics"] or {}, (base or {}).get("metrics") or {}
        r["diff"] = {n: m[n] - b[n] for n in names if n in m and n in b and n != "mean_reward_se"}
        if "mean_reward" in r["diff"]:  # the difference of two independent means: their errors add in quadrature
            r["diff_se"] = math.hypot(m.get("mean_reward_se", 0.0), b.get("mean_reward_se", 0.0))
    return rows, names, base


@router.get("/evals")
@guarded
def evals_page(request: Request, run_id: Annotated[int | None, Query(ge=1)] = None,
               baseline: Annotated[int | None, Query(ge=1)] = None):
    rows, names, base = table(request, run_id, baseline)
    return render(request, "evals.html", rows=rows, names=names, base=base, run_id=run_id, error=None,
                  form={"run_id": run_id or "", "checkpoint": "best", "env": "", "episodes": 64, "k": 1,
                        "temperature": ""})


@router.get("/evals/{eval_id}/samples")
@guarded
def eval_samples_page(request: Request, eval_id: int):
    """The samples view on an evaluation's episodes: a run's evaluation opens on its run's samples at its step; a
    model section's, which no run holds, on its own (GET /api/v1/evals/{id}/samples)."""
    e = eval_records.get_eval(request.app.state.records.engine, eval_id)
    if e is None:
        raise HTTPException(404, f"no evaluation {eval_id}")
    if e["run_id"]:
        query = urlencode({**request.query_params, "kind": "evaluation", "step": eval_id})  # the colouring too
        return RedirectResponse(f"/runs/{e['run_id']}/samples?{query}", status_code=303)
    c = e["config"]
    source = f"{c['model'].get('path') or c['model'].get('preset')} on {c['env']}"
    return render(request, "samples.html", run={"id": eval_id, "name": source, "status": e["status"]}, evaluation=e,
                  page={"api": f"/api/v1/evals/{eval_id}", "status": e["status"]})


@router.post("/evals")
@guarded
def queue_from_form(request: Request, run_id: Annotated[int | None, Form()] = None,
                    checkpoint: Annotated[str, Form()] = "best",
                    env: Annotated[str, Form()] = "", episodes: Annotated[int, Form()] = 64,
                    k: Annotated[int, Form()] = 1, temperature: Annotated[float | None, Form()] = None,
                    csrf_token: Annotated[str | None, Form()] = None):
    """Queue an evaluation of a run's checkpoint from the form; a bad field comes back on the form, named."""
    check_csrf(request, csrf_token)
    records = request.app.state.records
    form = {"run_id": run_id, "checkpoint": checkpoint, "env": env, "episodes": episodes, "k": k,
            "temperature": "" if temperature is None else temperature}
    try:
        request_ = EvalRequest(run_id=run_id, checkpoint=int(checkpoint) if checkpoint.isascii() and
                               checkpoint.isdigit() else checkpoint, env=env.strip() or None,
                               episodes=episodes, k=k, temperature=temperature)
        eval_records.queue_eval(records.engine, records.home, request_)
    except (EvalInvalid, ValidationError) as e:
        field = e.loc[0] if isinstance(e, EvalInvalid) else e.errors()[0]["loc"][0]
        message = str(e) if isinstance(e, EvalInvalid) else e.errors()[0]["msg"]
        rows, names, base = table(request, run_id, None)
        return render(request, "evals.html", status_code=422, rows=rows, names=names, base=base, run_id=run_id,
                      error=f"{field}: {message}", form=form)
    return RedirectResponse(f"/evals?run_id={run_id}", status_code=303)


@router.get("/evals.csv")
@guarded
def evals_csv(request: Request, run_id: Annotated[int | None, Query(ge=1)] = None,
              baseline: Annotated[int | None, Query(ge=1)] = None):
    """The table as CSV: one row per evaluation, its source and target, its metrics and (with a baseline) the
    differences to it."""
    rows, names, base = table(request, run_id, baseline)
    out = io.StringIO()
    writer = csv.writer(out)
    diffs = [f"{n} - baseline" for n in names if n != "mean_reward_se"] if base else []
    writer.writerow(["id", "run_id", "checkpoint", "step", "env", "episodes", "k", "temperature", "status", *names,
                     *diffs, *(["mean_reward - baseline se"] if base else [])])
    for r in rows:
        c, m = r["config"], r["metrics"] or {}
        writer.writerow([r["id"], r["run_id"], r["checkpoint"], r["step"], c["env"], c["episodes"], c["k"],
                         c["temperature"], r["status"], *(m.get(n, "") for n in names),
                         *(r["diff"].get(n, "") for n in names if n != "mean_reward_se" and base),
                         *([r.get("diff_se", "")] if base else [])])
    return Response(out.getvalue(), media_type="text/csv",
                    headers={"Content-Disposition": 'attachment; filename="evaluations.csv"'})
