"""The evaluations' REST API under /api/v1/evals: queue one, read its status and metrics, list, stop, its episodes."""
import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError

from daemon import evals
from daemon.evals import EvalInvalid, EvalRequest

from .rest import _problem, authenticated, known_query, records_of
from .schemas import BadRequest, Invalid, Out

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
    `k` per prompt, greedy when `temperature` is 0. 422 names the field that is wrong."""
    records = records_of(request)
    try:
        return evals.queue_eval(records.engine, records.home, body)
    except EvalInvalid as e:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", *e.loc), "msg": str(e)}]) from None


@router.get("/evals", response_model=list[EvalOut])
def list_evals(request: Request, run_id: Annotated[int | None, Query(ge=1, le=2**62)] = None):
    """Evaluations, newest first; of one source run with `run_id`."""
    return evals.list_evals(records_of(request).engine, run_id)


@router.get("/evals/{eval_id}", response_model=EvalOut, responses=with_eval)
def get_eval(request: Request, eval_id: EvalId):
    """Status, progress (`done` episodes) and, once completed, the metrics: mean_reward, pass@1, pass@k, avg@k,
    episodes, errors and the env's own metrics."""
    return _found(evals.get_eval(records_of(request).engine, eval_id), eval_id)


@router.get("/evals/{eval_id}/wait", response_model=EvalOut, responses=with_eval)
async def wait_eval(request: Request, eval_id: EvalId,
                    timeout: Annotated[float, Query(ge=0, le=3600, allow_inf_nan=False)] = 30):
    """Return when the evaluation has ended (completed, failed, stopped) or the timeout passed."""
    deadline = time.monotonic() + timeout
    while True:
        found = _found(await asyncio.to_thread(evals.get_eval, records_of(request).engine, eval_id), eval_id)
        if found["status"] in evals.ENDED or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


@router.post("/evals/{eval_id}/stop", status_code=202, response_model=EvalOut,
             responses={**with_eval, 409: _problem("the evaluation has already ended")})
def stop_eval(request: Request, eval_id: EvalId):
    engine = records_of(request).engine
    found = _found(evals.get_eval(engine, eval_id), eval_id)
    if not evals.stop_eval(engine, eval_id):
        raise HTTPException(409, f"evaluation {eval_id} is {found['status']}")
    return evals.get_eval(engine, eval_id)


def _found(evaluation: dict | None, eval_id: int) -> dict:
    if evaluation is None:
        raise HTTPException(404, f"not found: evaluation {eval_id}")
    return evaluation
