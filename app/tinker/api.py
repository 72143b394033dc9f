"""The Tinker API's routes (/tinker/api/v1/...), as the pinned `tinker` SDK calls them: JSON bodies, protobuf for
forward_backward and its output, every training request a future that the client polls (retrieve_future)."""
import asyncio
import hmac
from concurrent.futures import Future
from datetime import datetime, timezone

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from . import wire
from .service import Gone, Service, Unknown
from .sampler import Sampler
from .trainer import TEXT_PRESETS, Refused, TrainedModel, saved

LONG_POLL_S = 20.0  # retrieve_future waits this long for a result before "try_again" (the SDK's read timeout is 45 s)


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())  # the SDK's fields we do not use are ignored


class CreateSession(Body):
    sdk_version: str | None = None


class SessionRef(Body):
    session_id: str


class Lora(Body):
    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: Lora | None = None


class ModelRef(Body):
    model_id: str


class Adam(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: Adam | None = None


class SaveWeights(Body):  # save_state's, and save_weights_for_sampler's
    model_id: str
    path: str | None = None
    seq_id: int | None = None


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None      # load_state onto this model, in its turn
    seq_id: int | None = None
    session_id: str | None = None    # or: a new model of this session, made from the state
    model_seq_id: int | None = None


class SamplingSession(Body):
    session_id: str
    base_model: str | None = None
    model_path: str | None = None


class Params(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Prompt(Body):
    chunks: list[dict]


class Sample(Body):
    prompt: Prompt
    sampling_params: Params
    num_samples: int = 1
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None


class Retrieve(Body):
    request_id: str


def create(records, auth, concurrency: int | None = None, gpus: list[str] | None = None) -> FastAPI:
    """The app `molt serve` mounts at /tinker; its key is `molt token --tinker`, in X-API-Key as the SDK sends it.
    `concurrency`, `gpus`: the daemon's slots and GPU pool, which the training clients share with its runs."""
    service = Service(records, concurrency, gpus)

    def key(x_api_key: str | None = Header(None)):
        if not x_api_key or not hmac.compare_digest(x_api_key.encode(), auth.tinker.encode()):
            raise HTTPException(401, "missing or wrong Tinker API key: `molt token --tinker` on the server prints it")

    api = FastAPI(title="Molt Studio: Tinker API", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(key)])
    api.state.service = service

    @api.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @api.exception_handler(Unknown)
    async def unknown(request: Request, exc: Unknown):
        return JSONResponse({"detail": exc.args[0]}, status_code=404)

    @api.exception_handler(Gone)
    async def gone(request: Request, exc: Gone):
        return JSONResponse({"detail": str(exc)}, status_code=410)

    # ---- the client's setup ------------------------------------------------------------------------------------

    @api.get("/api/v1/healthz")
    def healthz():
        return {"status": "ok"}

    @api.post("/api/v1/client/config")
    def client_config():
        # No JWT exchange (the key itself is checked on every request); httpx rather than pyqwest; zstd bodies
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": True}

    @api.post("/api/v1/client/dynamic_config")
    def dynamic_config():
        return {}

    @api.post("/api/v1/telemetry")
    def telemetry():
        return {"status": "accepted"}  # the SDK's telemetry is not kept

    @api.get("/api/v1/get_server_capabilities")
    def capabilities():
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                     for name in TEXT_PRESETS]}

    @api.post("/api/v1/create_session")
    def create_session(body: CreateSession):
        return {"type": "create_session", "session_id": service.create_session()}

    @api.post("/api/v1/session_heartbeat")
    def heartbeat(body: SessionRef):
        service.heartbeat(body.session_id)
        return {"type": "session_heartbeat"}

    @api.post("/api/v1/sessions/{session_id}/finish")
    def finish(session_id: str, body: Body):
        reason = (getattr(body, "reason", None) or {}).get("type")  # success, errored or interrupted
        status = {"errored": "failed", "interrupted": "stopped"}.get(reason, "completed")
        service.end_session(session_id, status, getattr(body, "detail", None) or "the client exited with an error")
        return None

    # ---- training ----------------------------------------------------------------------------------------------

    @api.post("/api/v1/create_model")
    def create_model(body: CreateModel):
        lora = body.lora_config or Lora()
        model_id, request_id = service.create_model(body.session_id, body.model_seq_id, body.base_model, lora.rank,
                                                    lora.seed, lora.train_attn, lora.train_mlp, lora.train_unembed)
        return {"request_id": request_id, "model_id": model_id}

    @api.post("/api/v1/get_info")
    def get_info(body: ModelRef):
        model = service.model(body.model_id)
        return {"type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.rank,
                "model_name": model.base_model,
                "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model}}

    @api.post("/api/v1/forward_backward")
    async def forward_backward(request: Request, content_encoding: str | None = Header(None)):
        if "protobuf" not in request.headers.get("content-type", ""):
            raise HTTPException(415, "forward_backward takes the SDK's protobuf body (application/x-protobuf)")
        msg = wire.forward_backward_message(await request.body(), content_encoding)

        def work(trained):
            data, config = wire.forward_backward_inputs(msg)
            outputs, metrics = trained.forward_backward(data, msg.loss_fn, config, msg.forward_only)
            return wire.forward_backward_output(outputs, metrics)
        return {"request_id": service.submit(msg.model_id, msg.seq_id, work), "model_id": msg.model_id}

    @api.post("/api/v1/optim_step")
    def optim_step(body: OptimStep):
        adam = body.adam_params or Adam()
        model = service.model(body.model_id)

        def work(trained):
            metrics = trained.optim_step(adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay,
                                         adam.grad_clip_norm)
            service.record(model, metrics)
            return {"type": "optim_step", "metrics": metrics}
        return {"request_id": service.submit(body.model_id, body.seq_id or 0, work), "model_id": body.model_id}

    @api.post("/api/v1/save_weights")
    def save_weights(body: SaveWeights):
        model = service.model(body.model_id)
        name = body.path or f"step-{body.seq_id}"
        tinker_path = f"tinker://{model.id}/weights/{name}"
        path = service.state_path(tinker_path)

        def work(trained):
            trained.save(path)
            service.checkpoint(model, path, name)
            return {"type": "save_weights", "path": tinker_path}
        return {"request_id": service.submit(body.model_id, body.seq_id or 0, work), "model_id": body.model_id}

    @api.post("/api/v1/load_weights")
    def load_weights(body: LoadWeights):
        path = service.state_path(body.path)

        def load(model):
            model.trained.load(path, body.optimizer)
            return {"type": "load_weights", "path": body.path, "model_id": model.id}
        if body.model_id is not None:
            service.model(body.model_id, body.session_id)  # the SDK sends one or the other: both must agree
            return {"request_id": service.submit(body.model_id, body.seq_id or 0, lambda trained: load(
                service.model(body.model_id))), "model_id": body.model_id}
        if body.session_id is None or body.model_seq_id is None:
            raise Refused("load_weights needs a model_id, or a session_id and model_seq_id for a new model")
        state = saved(path)
        model_id, request_id = service.create_model(body.session_id, body.model_seq_id, state["base_model"],
                                                    state["rank"], None, *state["targets"], then=load)
        return {"request_id": request_id, "model_id": model_id}

    # ---- sampling ----------------------------------------------------------------------------------------------

    def sampler_of(base_model: str | None, model_path: str | None):
        if model_path:
            state = saved(service.state_path(model_path))
            model_id = model_path.removeprefix("tinker://").split("/")[0]  # its samples go to that model's run
            live = service.models.get(model_id)  # a live client's weights: on its GPU
            trained = TrainedModel(state["base_model"], state["rank"], None, *state["targets"],
                                   device=str(live.trained.device) if live and live.trained else None)
            trained.load(service.state_path(model_path), optimizer=False)
            return Sampler.snapshot(trained, model_path, model_id, state["steps"])
        if not base_model:
            raise Refused("a sampling client needs a base_model or a model_path")
        return Sampler.of_base(base_model)

    @api.post("/api/v1/create_sampling_session")
    def create_sampling_session(body: SamplingSession):
        service.session(body.session_id)
        return {"type": "create_sampling_session",
                "sampling_session_id": service.add_sampler(sampler_of(body.base_model, body.model_path))}

    @api.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str):
        sampler = service.samplers.get(sampler_id)
        if sampler is None:
            raise Unknown(f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @api.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(body: SaveWeights):
        model = service.model(body.model_id)

        def work(trained):
            if body.path is None:  # save_weights_and_get_sampling_client: a sampler of the weights now
                return {"type": "save_weights_for_sampler",
                        "sampling_session_id": service.add_sampler(Sampler.snapshot(trained, model_id=model.id))}
            tinker_path = f"tinker://{model.id}/sampler_weights/{body.path}"
            trained.save(service.state_path(tinker_path), optimizer=False)
            return {"type": "save_weights_for_sampler", "path": tinker_path}
        return {"request_id": service.submit(body.model_id, body.seq_id or 0, work), "model_id": body.model_id}

    @api.post("/api/v1/asample")
    def asample(body: Sample):
        sampler = service.samplers.get(body.sampling_session_id) if body.sampling_session_id else None
        if body.sampling_session_id and sampler is None:
            raise Unknown(f"unknown sampling session {body.sampling_session_id!r}")
        if any(c.get("type", "encoded_text") != "encoded_text" for c in body.prompt.chunks):
            raise Refused("prompts of text (encoded_text chunks) only")
        prompt = [t for c in body.prompt.chunks for t in c["tokens"]]
        params = body.sampling_params

        def work():
            chosen = sampler or sampler_of(body.base_model, body.model_path)
            sequences, prompt_lp = chosen.sample(prompt, body.num_samples, params.max_tokens, params.temperature,
                                                 params.stop, params.seed, bool(body.prompt_logprobs),
                                                 params.top_k, params.top_p)
            service.record_samples(chosen, prompt, sequences, params.seed)
            return wire.sample_response(sequences, prompt_lp)
        request_id = service.sample(work)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(body.num_samples)]}

    # ---- the REST client's listings -----------------------------------------------------------------------------

    def checkpoints(model_id: str) -> list[dict]:
        """The states saved from a model, read from disk: a restarted server lists them too."""
        folder = service.state_path(f"tinker://{model_id}/weights/x").parent.parent
        return [{"checkpoint_id": f"{kind}/{path.stem}", "checkpoint_type": kind_name,
                 "time": datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(),
                 "tinker_path": f"tinker://{model_id}/{kind}/{path.stem}", "size_bytes": path.stat().st_size}
                for kind, kind_name in (("weights", "training"), ("sampler_weights", "sampler"))
                for path in sorted((folder / kind).glob("*.pt"), key=lambda p: p.stat().st_mtime)]

    def training_run(model) -> dict:
        saved_ = checkpoints(model.id)
        return {"training_run_id": model.id, "base_model": model.base_model, "model_owner": "molt", "is_lora": True,
                "lora_rank": model.rank, "last_request_time": datetime.fromtimestamp(model.last_request, timezone.utc),
                "last_checkpoint": next((c for c in reversed(saved_) if c["checkpoint_type"] == "training"), None),
                "last_sampler_checkpoint": next((c for c in reversed(saved_) if c["checkpoint_type"] == "sampler"),
                                                None)}

    @api.get("/api/v1/training_runs")
    def list_training_runs(limit: int = 20, offset: int = 0):
        models = list(service.models.values())  # this server process's, oldest first
        return {"training_runs": [training_run(m) for m in models[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}

    @api.get("/api/v1/training_runs/{model_id}")
    def get_training_run(model_id: str):
        return training_run(service.model(model_id))

    @api.get("/api/v1/training_runs/{model_id}/checkpoints")
    def list_checkpoints(model_id: str):
        return {"checkpoints": checkpoints(model_id)}

    # ---- futures -----------------------------------------------------------------------------------------------

    @api.post("/api/v1/retrieve_future")
    async def retrieve_future(body: Retrieve):
        future: Future | None = service.futures.get(body.request_id)
        if future is None:
            raise Unknown(f"unknown request {body.request_id!r} (request ids do not outlive the server)")
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here, from `future`, not there
        done, _ = await asyncio.wait([waiting], timeout=LONG_POLL_S)  # a timeout cancels nothing
        if not done:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if (error := future.exception()) is not None:
            service.retrieved(body.request_id)
            user = isinstance(error, (Refused, Gone))
            return {"error": str(error) if user else f"{type(error).__name__}: {error}",
                    "category": "user" if user else "server"}
        service.retrieved(body.request_id)
        result = future.result()
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return result

    return api
