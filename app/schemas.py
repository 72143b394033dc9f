"""The REST API's JSON bodies (pydantic): what each route returns, as /docs and /openapi.json document them."""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from daemon.models import STATUSES
from daemon.records import RunRequest
from molt_engine.config import untrained_lora

# A metric value: a number, or one of the strings JSON needs for NaN and the infinities (see series.py).
Number = Annotated[float, WithJsonSchema({"anyOf": [{"type": "number"},
                                                    {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]})]


class Out(BaseModel):
    # ser_json_inf_nan: a NaN/inf reaching a response becomes "NaN"/"Infinity" instead of breaking the JSON
    model_config = ConfigDict(ser_json_inf_nan="strings")


class Health(Out):
    status: Literal["ok", "degraded", "stopped"] = Field(
        description="ok: the web server and the daemon are both alive; stopped: the daemon was stopped on request")
    version: str
    daemon: dict[str, Any]
    time: float


class EnvInfo(Out):
    name: str
    description: str
    max_turns: int
    max_tokens: int
    source: str | None = Field(description="the file of a user's env (from --envs or an installed env package); "
                               "null for a built-in one")
    chat: bool = Field(False, description="speaks chat messages through the policy's chat template (needs one)")
    tools: list[str] = Field(default_factory=list, description="the tools a chat env's policy calls natively")
    agent: bool = Field(False, description="an agent: its own code drives the episode through an OpenAI client "
                        "against the run's loopback server")


class RunOut(Out):
    id: int
    name: str
    status: Literal[STATUSES]
    config: dict[str, Any]
    tags: list[str]
    step: int
    total_steps: int
    version: int
    reward: Number | None
    restarts: int
    retries: int
    max_restarts: int
    pid: int | None
    last_error: str | None
    summary: dict[str, Any] | None
    alerts_open: int
    notes: str = ""
    archived: bool = Field(False, description="hidden from the runs list unless asked for")
    best_eval: Number | None = Field(None, description="the highest eval_reward recorded, if any")
    host: str | None = Field(None, description="an external run's machine (`molt train --report-to`); null: ours")
    ranks: int | None = Field(None, description="an external run's processes")
    sweep_id: int | None = Field(None, description="the sweep that created it (GET /api/v1/sweeps/{id})")
    sweep_point: int | None = Field(None, description="its point in that sweep")
    created_at: float
    started_at: float | None
    finished_at: float | None
    next_start_at: float | None
    duration_s: float | None = Field(None, description="training time in seconds: its attempts' own time, not the "
                                     "time queued or stopped between them (an external run: start to end); null "
                                     "before it started. The runs list, the run page and compare show this one")


class RunEnd(BaseModel):
    """The body of POST /api/v1/runs/{id}/end: the status an external run that no longer reports is given."""
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [{"status": "failed"}]})
    status: Literal["stopped", "failed"]


class RunPatch(BaseModel):
    """The body of PATCH /api/v1/runs/{id}: the fields to change; those left out stay as they are."""
    model_config = ConfigDict(strict=True, extra="forbid",
                              json_schema_extra={"examples": [{"name": "lr-3e-4", "notes": "baseline"}]})
    name: str | None = Field(None, min_length=1, max_length=200, pattern=r"\S")
    notes: str | None = Field(None, max_length=10000)
    archived: bool | None = Field(None, description="archived runs are hidden from the runs list by default")


class SeriesOut(Out):
    step: list[int]
    value: list[Number]
    time: list[float]


class MetricsOut(Out):
    run_id: int
    names: list[str] = Field(description="every metric name the run has recorded")
    series: dict[str, SeriesOut]
    downsampled: bool = Field(description="true when some series had more than max_points points")


class AlertOut(Out):
    id: int
    run_id: int
    time: float
    step: int | None
    kind: str
    message: str
    data: dict[str, Any]
    acknowledged: bool


class EventOut(Out):
    id: int
    run_id: int
    time: float
    step: int | None
    kind: str
    source: str
    message: str
    data: dict[str, Any]


class AttemptOut(Out):
    id: int
    run_id: int
    number: int
    pid: int | None
    started_at: float
    ended_at: float | None
    heartbeat_at: float | None
    start_step: int | None
    outcome: str | None
    exit_code: int | None
    signal: str | None
    cause: str | None
    error: str | None
    log_path: str | None


class CheckpointOut(Out):
    id: int
    run_id: int
    step: int
    path: str
    size_bytes: int | None
    version: int | None
    time: float
    exists: bool


class Problem(BaseModel):
    detail: str


class FieldError(BaseModel):
    loc: list[str | int] = Field(description='where: ["body", "config", "loop", "steps"], ["query", "status"]')
    msg: str
    type: str


class Invalid(BaseModel):
    detail: list[FieldError]


class BadRequest(BaseModel):
    detail: str | list[FieldError]


class SampleTokens(Out):
    """The episode's tokens, column-wise. Log-probs and entropy are null for non-action tokens (prompt, env text),
    trainer_logprob also for an episode that skipped the training forward (advantage 0) or an eval's; version is
    -1 for non-action tokens."""
    id: list[int]
    text: list[str] = Field(description="each token decoded on its own")
    action: list[bool] = Field(description="generated by the policy (trained), or not (prompt, env feedback)")
    logprob: list[Number | None] = Field(description="behaviour log-prob, recorded when the token was sampled")
    trainer_logprob: list[Number | None] = Field(description="the trainer's log-prob of the token (before its update)")
    version: list[int] = Field(description="the policy version that sampled the token")
    entropy: list[Number | None] = Field(description="entropy of the distribution the token was sampled from")


class SampleOut(Out):
    id: int
    run_id: int
    step: int
    kind: Literal["train", "eval", "evaluation"]
    position: int
    group_id: int = Field(description="the prompt's training group (its cursor); -1 for eval")
    seed: int
    version: int = Field(description="the trainer's version; a token's staleness is this minus its version")
    reward: Number | None
    advantage: Number | None
    success: bool
    turns: int
    tool_calls: int
    tool_errors: int
    prompt: str
    text: str
    tokens: SampleTokens
    images: list[str] = Field(description="PNG thumbnails as data: URLs, in the order of their tokens")
    time: float


class SamplesOut(Out):
    run_id: int
    samples: list[SampleOut]
    next_cursor: int | None = Field(description="pass as `cursor` for the next page; null on the last page")
    total: int = Field(description="how many recorded episodes pass the filters, on every page")


class SampleStep(Out):
    step: int
    kind: Literal["train", "eval", "evaluation"]
    count: int


def _request_or_bare_config(schema: dict):
    """The documented body: RunRequest's own shape, or a bare run config."""
    request = {**schema, "title": "RunRequest", "description": "a run config with its name, tags and max_restarts"}
    schema.clear()
    schema.update(title="RunBody", anyOf=[request, {"$ref": request["properties"]["config"]["$ref"]}],
                  description="a run request ({\"config\": {...}, \"name\": ...}) or a bare run config "
                              "({\"env\": \"max_digit\"}), whose name, tags and max_restarts take their defaults",
                  examples=[*RunRequest.model_config["json_schema_extra"]["examples"], {"env": "max_digit"}])


class RunBody(RunRequest):
    """The body of POST /api/v1/runs: a RunRequest, or a bare config (a body without a `config` key), wrapped."""
    model_config = ConfigDict(json_schema_extra=_request_or_bare_config)

    @model_validator(mode="before")
    @classmethod
    def wrap_a_bare_config(cls, data):
        return {"config": data} if isinstance(data, dict) and "config" not in data else data

    @field_validator("config")
    @classmethod
    def lora_on_a_trained_base(cls, config):
        if problem := untrained_lora(config):  # the engine's rule, on every path that queues or starts a run
            raise ValueError(problem)
        return config
