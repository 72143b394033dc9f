"""The evaluations' REST API under /api/v1/evals: queue one, read its status and metrics, list, stop, its episodes."""
import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from sqlalchemy import func, select
from sqlmodel import Session

from daemon import eval_records
from daemon.db import eval_dir
from daemon.eval_records import EvalInvalid, EvalRequest
from daemon.models import Sample
from daemon.records import Records

from .rest import _problem, authenticated, known_query, records_of, sample_filters
from .schemas import BadRequest, Invalid, Out, SampleOut, SamplesOut, SampleStep

EvalId = Annotated[int, Path(ge=1, le=2**62, description="the evaluation's id")]


class EvalOut(Out):
    id: int
    run_id: int | None
    checkpoint: str | None
    step: int | None
    policy_path: str | None
    config: dict[str, Any]
    status: str
    metrics: dict[str, float | int | None] | None
    done: int
    restarts: int
    max_restarts: int
    pid: int | None
    gpus: str | None
    last_error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None


router = APIRouter(prefix="/api/v1", tags=["evals"], dependencies=[Depends(known_query), Depends(authenticated)],
                   responses={400: {"model": BadRequest, "description": "the body is not JSON"},
                              422: {"model": Invalid, "description": "invalid input; each error names its field"},
                              401: _problem("missing or wrong token"), 403: _problem("cross-site request")})
with_eval = {404: _problem("no such evaluation")}


@router.post("/evals", status_code=201, response_model=EvalOut)
def create_eval(request: Request, body: EvalRequest):
    """Queue an evaluation of a run's checkpoint (`run_id`, `checkpoint`: best, final, latest or a step) or of a
    `model` section, on an env (`env`, `env_args`; default the run's) or a `dataset` file: `episodes` episodes,
    `k` per prompt, greedy when `temperature` is 0 (left out: greedy with k 1, the run's own loop.temperature
    with k > 1). 422 names the field that is wrong."""
    records = records_of(request)
    try:
        return eval_records.queue_eval(records.engine, records.home, body)
    except EvalInvalid as e:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", *e.loc), "msg": str(e)}]) from None


@router.get("/evals", response_model=list[EvalOut])
def list_evals(request: Request, run_id: Annotated[int | None, Query(ge=1, le=2**62)] = None):
    """Evaluations, newest first; of one source run with `run_id`."""
    return eval_records.list_evals(records_of(request).engine, run_id)


@router.get("/evals/{eval_id}", response_model=EvalOut, responses=with_eval)
def get_eval(request: Request, eval_id: EvalId):
    """Status, progress (`done` episodes) and, once completed, the metrics: mean_reward, pass@1, pass@k, avg@k,
    episodes, errors and the env's own metrics."""
    return _found(eval_records.get_eval(records_of(request).engine, eval_id), eval_id)


@router.get("/evals/{eval_id}/wait", response_model=EvalOut, responses=with_eval)
async def wait_eval(request: Request, eval_id: EvalId,
                    timeout: Annotated[float, Query(ge=0, le=3600, allow_inf_nan=False)] = 30):
    """Return when the evaluation has ended (completed, failed, stopped) or the timeout passed."""
    deadline = time.monotonic() + timeout
    while True:
        found = _found(await asyncio.to_thread(eval_records.get_eval, records_of(request).engine, eval_id), eval_id)
        if found["status"] in eval_records.ENDED or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


@router.post("/evals/{eval_id}/stop", status_code=202, response_model=EvalOut,
             responses={**with_eval, 409: _problem("the evaluation has already ended")})
def stop_eval(request: Request, eval_id: EvalId):
    engine = records_of(request).engine
    found = _found(eval_records.get_eval(engine, eval_id), eval_id)
    if not eval_records.stop_eval(engine, eval_id):
        raise HTTPException(409, f"evaluation {eval_id} is {found['status']}")
    return eval_records.get_eval(engine, eval_id)


@router.get("/evals/{eval_id}/samples", response_model=SamplesOut, responses=with_eval, tags=["samples"])
def eval_samples(request: Request, eval_id: EvalId, filters: Annotated[dict, Depends(sample_filters)],
                 limit: Annotated[int, Query(ge=1, le=500)] = 50,
                 cursor: Annotated[int | None, Query(ge=0, le=2**62, description="the last page's next_cursor")] = None,
                 order: Literal["oldest", "newest"] = "oldest"):
    """The evaluation's recorded episodes, filtered and paged as a run's samples are (its step is the evaluation's
    id, its kind `evaluation`). Those of a model section, which no run holds, have run_id 0."""
    run_id, engine, query = _samples_of(request, eval_id, filters)
    if engine is None:
        return {"run_id": run_id, "samples": [], "next_cursor": None, "total": 0}
    with Session(engine) as s:
        total = s.scalar(select(func.count()).select_from(query.subquery()))
        rows = Records.sample_page(s, query, limit, cursor, order == "newest")
    return {"run_id": run_id, "samples": rows, "next_cursor": rows[-1]["id"] if len(rows) == limit else None,
            "total": total}


@router.get("/evals/{eval_id}/samples/steps", response_model=list[SampleStep], responses=with_eval,
            tags=["samples"])
def eval_sample_steps(request: Request, eval_id: EvalId):
    """The evaluation's one step of samples (its id), with their count; none before its first episode."""
    total = eval_samples(request, eval_id, sample_filters(), limit=1)["total"]
    return [{"step": eval_id, "kind": "evaluation", "count": total}] if total else []


@router.get("/evals/{eval_id}/samples.jsonl", tags=["samples"], responses={
    **with_eval, 200: {"content": {"application/x-ndjson": {}}, "description": "one SampleOut per line"}})
def eval_samples_jsonl(request: Request, eval_id: EvalId, filters: Annotated[dict, Depends(sample_filters)]):
    """Every recorded episode of the evaluation that passes the filters, one JSON object per line."""
    _, engine, query = _samples_of(request, eval_id, filters)

    def lines():
        cursor = -1
        while engine is not None:
            with Session(engine) as s:
                rows = Records.sample_page(s, query, 200, cursor)
            if not rows:
                return
            yield "".join(SampleOut.model_validate(r).model_dump_json() + "\n" for r in rows)
            cursor = rows[-1]["id"]

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers={
        "Content-Disposition": f'attachment; filename="evaluation-{eval_id}-samples.jsonl"'})


def _samples_of(request: Request, eval_id: int, filters: dict):
    """(run_id, the database that holds the evaluation's episodes, the query of those that pass the filters): a
    run's evaluation's are in the records; a model section's in its own database (None until it records one)."""
    records = records_of(request)
    found = _found(eval_records.get_eval(records.engine, eval_id), eval_id)
    run_id, directory = found["run_id"] or 0, eval_dir(records.home, eval_id)
    query = Records.sample_query(run_id, **{**filters, "step": None, "kind": None}).where(Sample.eval_id == eval_id)
    if run_id:
        return run_id, records.engine, query
    return run_id, eval_records.samples_db(directory) if (directory / "samples.db").exists() else None, query


def _found(evaluation: dict | None, eval_id: int) -> dict:
    if evaluation is None:
        raise HTTPException(404, f"not found: evaluation {eval_id}")
    return evaluation
