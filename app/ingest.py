"""External runs (`molt train --report-to URL`): registering one, and the ingest endpoint its HTTP sink posts to."""
import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from daemon.db import add_event, digest, finish_run, set_run
from daemon.models import ACTIVE, TERMINAL, Attempt, Run, now
from daemon.records import RunRequest
from daemon.sink import write_records
from molt_engine.config import ELSEWHERE, RunConfig

from . import rest
from .rest import RunId, _problem, authenticated, bearer, known_query, records_of
from .schemas import RunOut, SampleTokens

# JSON's integers: 3.0 is one (as JSON Schema reads it), true is not; bounds exact as doubles (checkers compare those)
Whole = BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)
Int = Annotated[int, Field(ge=0, le=10**15), Whole]
Signed = Annotated[int, Field(ge=-10**15, le=10**15), Whole]
# An episode's seed: SQLite's 64-bit integers (held-out eval seeds start at 2**62); 2**63 - 1024 is the largest
# double below 2**63
Seed = Annotated[int, Field(ge=-2**63, le=2**63 - 1024), Whole]
Text = Annotated[str, Field(max_length=100_000)]
Name = Annotated[str, Field(min_length=1, max_length=200)]


class Where(BaseModel):
    """Where an external run's process trains."""
    model_config = ConfigDict(strict=True, extra="forbid")
    host: str = Field(min_length=1, max_length=255, pattern=r"\S", description="the machine it trains on")
    pid: int = Field(ge=1, le=2**31, description="its (rank 0) process id there")
    ranks: int = Field(1, ge=1, le=1_000_000, description="its processes (world size)")


class ExternalRunBody(RunRequest, Where):
    """A run trained elsewhere that reports here: its config, and where it trains. Only the config's schema is checked
    here: its model, datasets and user envs are files on that machine, which the training process checks."""
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"config": {"env": "max_digit", "loop": {"steps": 60}}, "host": "gpu-node-7", "pid": 4242, "ranks": 1}]})

    @field_validator("config", mode="wrap")
    @classmethod
    def _schema_only(cls, config, _handler):
        return RunConfig.model_validate(config, context=ELSEWHERE)


class ResumedBody(Where):
    """The process that resumes an external run (`molt train --resume --report-to`)."""
    model_config = ConfigDict(json_schema_extra={"examples": [{"host": "gpu-node-7", "pid": 5151, "steps": 120}]})
    steps: int | None = Field(None, ge=1, le=10**9, description="the steps it trains to, if its config changed them")


class Registered(BaseModel):
    run: RunOut
    ingest_token: str = Field(description="may write only this run's records (POST .../ingest); shown once")


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    time: float = Field(allow_inf_nan=False)


class MetricsRecord(_Record):
    t: Literal["metrics"]
    step: Int
    values: dict[Name, float | None]


class NoteRecord(_Record):
    t: Literal["alert", "event"]
    kind: Name
    message: Text
    data: dict[str, Any] = Field(default_factory=dict)
    uid: Name = Field(description="the client's id of this alert or event: a re-sent one is written once")


class CheckpointInfo(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    size_bytes: Int = Field(description="measured where it was saved: the dashboard cannot see that machine's files")
    version: Int | None = None


class CheckpointRecord(_Record):
    t: Literal["checkpoint"]
    step: Int
    path: Annotated[str, Field(max_length=4096)]
    info: CheckpointInfo


class Episode(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    group: Signed
    seed: Seed
    version: Signed
    reward: float | None
    advantage: float | None
    success: bool
    turns: Int
    tool_calls: Int
    tool_errors: Int
    prompt: Text
    text: Text
    tokens: SampleTokens  # as the samples API shows them: a record it could not show is refused here
    images: list[str] = Field(default_factory=list)


class SamplesRecord(_Record):
    t: Literal["samples"]
    step: Int
    kind: Literal["train", "eval"]
    records: list[Episode] = Field(max_length=10_000)
    keep: Annotated[int, Field(ge=1, le=10**15), Whole] | None = None


class EndRecord(_Record):
    t: Literal["end"]
    status: Literal["completed", "stopped", "tripped", "failed"]
    summary: dict[str, Any] | None = None
    error: Text | None = None


class IngestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    records: list[Annotated[MetricsRecord | NoteRecord | CheckpointRecord | SamplesRecord | EndRecord,
                            Field(discriminator="t")]] = Field(max_length=5000)
    heartbeat_age: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False,
                                        description="seconds since the engine's latest heartbeat")


class Ingested(BaseModel):
    run_id: int
    status: str
    stop: bool = Field(description="a stop was requested: checkpoint and exit")
    written: int


router = APIRouter(prefix="/api/v1", tags=["external runs"], dependencies=[Depends(known_query)],
                   responses=rest.router.responses)  # 400 not JSON, 422 invalid
refused = {401: _problem("missing or unknown ingest token"), 403: _problem("the token belongs to another run"),
           409: _problem("the run has ended (or a resume would reopen a completed run)")}
# A retried request whose first answer was lost (a timeout) must not do its work twice: the client sends one key
# per request (as Stripe's and the IETF draft's Idempotency-Key), the same on every retry of it.
IdempotencyKey = Annotated[str | None, Header(min_length=1, max_length=200, description=(
    "the same on each retry of one request: a retry after a lost answer then creates nothing new"))]


def may_register(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)):
    """The dashboard's report token (`molt token --report`: it may register runs, nothing else), or its token."""
    if credentials is None or not request.app.state.auth.is_report_token(credentials.credentials):
        authenticated(request)


@router.post("/external-runs", status_code=201, response_model=Registered, dependencies=[Depends(may_register)],
             responses={401: _problem("missing or wrong token"), 403: _problem("cross-site request")})
def register(request: Request, body: ExternalRunBody, idempotency_key: IdempotencyKey = None):
    """Register a run that trains elsewhere and reports here (`molt train --report-to`): it shows as running, is
    never started, restarted or failed by the daemon, and is `unreachable` while its heartbeats are missing. Returns
    the run and its ingest token (kept only as a hash here). The same Idempotency-Key again returns the same run,
    with a new ingest token (the first answer, and its token, were lost)."""
    token, cfg, t = secrets.token_urlsafe(32), body.config, now()
    # External keys have their own namespace: a client's key can name no daemon or sweep run ("sweep:ID:POINT:SEED")
    key = idempotency_key and f"external:{idempotency_key}"
    for _ in range(2):  # a second look when a concurrent registration with the same key committed first
        with Session(records_of(request).engine) as s:
            again = key and s.scalar(select(Run.id).where(Run.idempotency_key == key, Run.host.is_not(None)))
            if again:
                s.execute(update(Run).where(Run.id == again).values(ingest_token=digest(token)))
                s.commit()
                return {"run": records_of(request).get_run(again), "ingest_token": token}
            run = Run(name=(body.name or f"{cfg.env}@{body.host}-{time.strftime('%Y%m%d-%H%M%S')}").strip(),
                      tags=body.tags, config=cfg.model_dump(mode="json"), total_steps=cfg.loop.steps, max_restarts=0,
                      status="running", started_at=t, pid=body.pid, host=body.host, ranks=body.ranks,
                      ingest_token=digest(token), idempotency_key=key)
            s.add(run)
            try:
                s.flush()
            except IntegrityError:  # the key's unique constraint: the other registration's run is the one
                continue
            s.add(Attempt(run_id=run.id, number=1, pid=body.pid, started_at=t, heartbeat_at=t))
            add_event(s, run.id, "external", f"external run on {body.host} (pid {body.pid}, {body.ranks} rank(s))",
                      host=body.host, pid=body.pid, ranks=body.ranks)
            s.commit()
            return {"run": records_of(request).get_run(run.id), "ingest_token": token}
    raise HTTPException(409, f"Idempotency-Key {idempotency_key!r} is taken and its run is not found")


def ingest_owner(request: Request, run_id: RunId,
                 credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> int:
    """The run that the bearer's ingest token may write: 401 without a known token, 403 for another run's token.
    A dependency, so that a refused token is refused before the body is read (not a 422 about the body)."""
    with Session(records_of(request).engine) as s:
        owner = s.scalar(select(Run.id).where(Run.ingest_token == digest(credentials.credentials))) \
            if credentials else None
    if owner is None:
        raise HTTPException(401, "missing or unknown ingest token", headers={"WWW-Authenticate": "Bearer"})
    if owner != run_id:
        raise HTTPException(403, f"this ingest token may write only run {owner}")
    return owner


@router.post("/runs/{run_id}/ingest", response_model=Ingested, responses=refused)
def ingest(request: Request, run_id: Annotated[int, Depends(ingest_owner)], body: IngestBody):
    """Write a batch of an external run's records, idempotently (metrics per step and name, samples per step,
    alerts and events by their uid): a batch sent again changes nothing. An `end` record gives the run its final
    status. The answer says whether a stop was requested. An ended run takes no more records (409): its token
    writes nothing after the end, except the batch that ended it sent again."""
    with Session(records_of(request).engine) as s:
        attempt = s.scalars(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc())).first()
        records, end = [], None
        for r in body.records:
            row = r.model_dump()
            if row["t"] in ("alert", "event"):
                row["uid"] = f"run{run_id}:{row['uid']}"  # uids are unique across runs: no run can shadow another's
            if row["t"] == "end":
                end = row
            else:
                records.append(row)
        status = s.scalar(select(Run.status).where(Run.id == run_id))
        if status in TERMINAL and not (end and end["time"] == attempt.ended_at):
            raise HTTPException(409, f"run {run_id} has ended ({status}): it takes no more records; "
                                "`molt train --resume --report-to` goes on as a new attempt")
        beat = None if body.heartbeat_age is None else now() - body.heartbeat_age
        write_records(s.connection(), run_id, attempt.id, records, heartbeat=beat)
        if set_run(s, run_id, ("unreachable",), status="running"):
            add_event(s, run_id, "reachable", "it reports again: running")
        if end:
            finish(s, run_id, attempt, end)
        s.commit()
        status = s.scalar(select(Run.status).where(Run.id == run_id))
    return {"run_id": run_id, "status": status, "stop": status == "stopping", "written": len(body.records)}


@router.post("/runs/{run_id}/attempts", status_code=201, response_model=RunOut, responses=refused)
def resume(request: Request, run_id: Annotated[int, Depends(ingest_owner)], body: ResumedBody,
           idempotency_key: IdempotencyKey = None):
    """A new attempt of an external run whose process was restarted with `--resume`: the same run goes on from its
    checkpoint (an attempt still open, its process gone, ends as lost). A completed run goes on only to train
    further (`steps` past its step); the same Idempotency-Key again opens no second attempt."""
    t = now()
    with Session(records_of(request).engine) as s:
        if idempotency_key and s.scalar(select(Attempt.id).where(Attempt.run_id == run_id,
                                                                 Attempt.idempotency_key == idempotency_key)):
            return records_of(request).get_run(run_id)
        run = s.get(Run, run_id)
        if run.status == "completed" and not (body.steps and body.steps > run.step):
            raise HTTPException(409, f"run {run_id} is completed ({run.step} steps): a resume must train further "
                                f"(--steps more than {run.step})")
        s.execute(update(Attempt).where(Attempt.run_id == run_id, Attempt.ended_at.is_(None)).values(
            ended_at=t, cause="lost: another process resumed the run"))
        number = (s.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run_id)) or 0) + 1
        s.add(Attempt(run_id=run_id, number=number, pid=body.pid, started_at=t, heartbeat_at=t,
                      idempotency_key=idempotency_key))
        s.execute(update(Run).where(Run.id == run_id).values(
            status="running", finished_at=None, pid=body.pid, host=body.host, ranks=body.ranks,
            **({"total_steps": body.steps} if body.steps else {})))
        add_event(s, run_id, "attempt", f"attempt {number} started on {body.host} (pid {body.pid}, {body.ranks} "
                  "rank(s)), resuming", attempt=number, host=body.host, pid=body.pid, ranks=body.ranks)
        s.commit()
    return records_of(request).get_run(run_id)


def finish(s: Session, run_id: int, attempt: Attempt, end: dict):
    """The run's final status, as a daemon worker records its own end."""
    status, step = end["status"], s.scalar(select(Run.step).where(Run.id == run_id))
    s.execute(update(Attempt).where(Attempt.id == attempt.id, Attempt.ended_at.is_(None)).values(
        ended_at=end["time"], outcome="error" if status == "failed" else status, end_step=step,
        cause=(end["error"] or "failed")[:4000] if status == "failed" else status))
    if end["summary"] is not None:
        s.execute(update(Run).where(Run.id == run_id).values(summary=end["summary"]))
    if status != "failed":
        finish_run(s, run_id, status, status, attempt.number, ACTIVE)
    elif set_run(s, run_id, ACTIVE, status="failed", pid=None, finished_at=now(), last_error=end["error"]):
        add_event(s, run_id, "failed", f"the external run failed: {end['error'] or 'no error given'}")
