"""Tinker sessions, their models and futures: each model runs its requests one at a time in the client's seq_id
order on a thread of its own, and is a run on the dashboard (an external run on host "tinker"), a metric a step. A
model holds one of the daemon's slots and, on a machine with GPUs, one of its GPUs (daemon/slots.py): it waits
`queued` in the line until its turn and a free GPU."""
import itertools
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, select, update
from sqlmodel import Session

from daemon.db import add_event, set_run
from daemon.models import ACTIVE, Attempt, Run, Sample, now
from daemon.records import Records
from daemon.sink import write_records
from daemon.slots import EVAL_HOLDS_A_SLOT, TINKER, free_gpus, runs_held, turn
from daemon.supervisor import visible_gpus
from molt_engine.config import ELSEWHERE, RunConfig

from ..ingest import finish
from .trainer import Refused, TrainedModel, model_config

log = logging.getLogger("molt.app")
HOST = TINKER  # the runs list shows "external · tinker"
# The SDK beats every 10 s; a session silent this long has lost its client (killed, or its machine gone)
HEARTBEAT_TIMEOUT_S = float(os.environ.get("MOLT_TINKER_HEARTBEAT_TIMEOUT", 60))
# A loop samples many groups a step: the Samples view gets the first this many sample requests of each step
RECORD_GROUPS = int(os.environ.get("MOLT_TINKER_RECORD_GROUPS", 8))
KEEP_RESULTS_S = 600  # a result read by the client is dropped this long after (outputs can be large)


class Unknown(LookupError):
    """A session, model, sampler or request id this server process does not know (404)."""


class Gone(Exception):
    """The session or model has ended: the SDK stops (410)."""


@dataclass
class Model:
    id: str
    session_id: str
    run_id: int
    base_model: str
    rank: int
    attempt_id: int | None = None                   # None while it waits for a slot
    gpu: str | None = None                          # the daemon's GPU it was given; None = the CPU
    admitted: threading.Event = field(default_factory=threading.Event)  # its turn came (or it ended waiting)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    trained: TrainedModel | None = None
    next_seq: int = 1
    waiting: dict = field(default_factory=dict)     # seq_id -> (work, future): arrived before their turn
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_request: float = field(default_factory=time.time)
    ended: str | None = None                        # why no more requests run (a stop from the dashboard)


@dataclass
class TinkerSession:
    id: str
    beat: float
    models: list[str] = field(default_factory=list)
    ended: bool = False


class Service:
    """What the API's handlers call; thread-safe. Request ids are this process's: a restarted server knows none."""

    def __init__(self, records: Records, concurrency: int | None = None, gpus: list[str] | None = None):
        """`concurrency`: the daemon's slots, as `molt serve` started it; None (`molt web`): models start at once.
        `gpus`: the daemon's GPU pool (`molt serve --gpus`), by default as the daemon's: every visible GPU."""
        self.records, self.root, self.concurrency = records, records.home / "tinker", concurrency
        self.visible = visible_gpus()  # the pool names GPUs as CUDA_VISIBLE_DEVICES does; torch counts these from 0
        self.gpus = list(self.visible if gpus is None else gpus)
        self.sessions: dict[str, TinkerSession] = {}
        self.models: dict[str, Model] = {}
        self.futures: dict[str, Future] = {}
        self.read_at: dict[str, float] = {}  # request id -> when its result was first read (kept a while for retries)
        self.by_seq: dict[tuple[str, int], str] = {}  # (model, seq_id) -> request id: a re-sent request runs once
        self.samplers: dict = {}                      # sampling session id -> sampler.Sampler
        self.recorded: dict[tuple[str, int], list[int]] = {}  # (model, step) -> [groups, samples] recorded
        self.sampling = ThreadPoolExecutor(1, thread_name_prefix="tinker-sampling")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._turns = threading.Lock()  # one admission at a time: two must not both count the same free slot
        self._end_orphans()
        threading.Thread(target=self._expire, daemon=True, name="tinker-sessions").start()
        threading.Thread(target=self._admit_loop, daemon=True, name="tinker-slots").start()

    def _end_orphans(self):
        """Runs of an earlier server process (killed, or stopped) end as failed: their sessions and futures died
        with it. Their saved states stay, for create_training_client_from_state."""
        with Session(self.records.engine) as s:
            for run_id in s.scalars(select(Run.id).where(Run.host == HOST, Run.status.in_(ACTIVE))).all():
                attempt = s.scalars(select(Attempt).where(Attempt.run_id == run_id)).first()
                finish(s, run_id, attempt, {"status": "failed", "time": now(), "summary": None,
                                            "error": "the server restarted: the Tinker session ended with it"})
            waited = "the server restarted: the Tinker session ended with it, before its turn in the queue"
            s.execute(update(Run).where(Run.host == HOST, Run.status == "queued").values(  # else they block the line
                status="failed", finished_at=now(), pid=None, last_error=waited))
            s.commit()

    # ---- sessions ----------------------------------------------------------------------------------------------

    def create_session(self) -> str:
        session = TinkerSession(id=f"molt-{secrets.token_hex(6)}", beat=time.monotonic())
        with self._lock:
            self.sessions[session.id] = session
        return session.id

    def session(self, session_id: str) -> TinkerSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise Unknown(f"unknown session {session_id!r}")
        if session.ended:
            raise Gone(f"session {session_id} has ended")
        return session

    def heartbeat(self, session_id: str):
        session = self.session(session_id)
        session.beat = time.monotonic()
        for model_id in session.models:
            model = self.models[model_id]
            if model.attempt_id is None:  # still queued: no attempt to beat for
                continue
            with Session(self.records.engine) as s:
                write_records(s.connection(), model.run_id, model.attempt_id, [], heartbeat=now())
                s.commit()

    def end_session(self, session_id: str, status: str = "completed", error: str | None = None):
        """Its models' runs end (completed, or failed when the client said so or went silent); their saved states
        stay on disk."""
        session = self.sessions.get(session_id)
        if session is None or session.ended:
            return
        session.ended = True
        for model_id in session.models:
            model = self.models[model_id]
            with self._turns:  # not while its turn is being given: it ends queued, or ends running
                model.ended = model.ended or f"model {model_id}: its session {session_id} has ended"
                if model.attempt_id is not None:
                    self._end_run(model, status, error)
                    continue
                if model.admitted.is_set():  # stopped from the dashboard while it waited: ended already
                    continue
                model.admitted.set()  # its creation fails with model.ended
                with Session(self.records.engine) as s:  # it leaves the queue, having held no slot
                    set_run(s, model.run_id, ("queued",), status="failed" if status == "failed" else "stopped",
                            finished_at=now(), pid=None, last_error=error if status == "failed" else None)
                    add_event(s, model.run_id, "tinker", f"its session ended while it waited for a slot ({status})")
                    s.commit()
        self._admit()  # its slots are free

    def retrieved(self, request_id: str):
        self.read_at.setdefault(request_id, time.monotonic())

    def _expire(self):
        while True:
            time.sleep(min(5.0, HEARTBEAT_TIMEOUT_S / 4))
            for request_id, read_at in list(self.read_at.items()):  # a lost answer's retry comes within seconds
                if time.monotonic() - read_at > KEEP_RESULTS_S:
                    self.futures.pop(request_id, None)
                    self.read_at.pop(request_id)
            for session in list(self.sessions.values()):
                if not session.ended and time.monotonic() - session.beat > HEARTBEAT_TIMEOUT_S:
                    self.end_session(session.id, "failed", f"no heartbeat from the client for "
                                                           f"{HEARTBEAT_TIMEOUT_S:.0f}s: the session was ended")

    # ---- models ------------------------------------------------------------------------------------------------

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, rank: int, seed: int | None,
                     train_attn: bool, train_mlp: bool, train_unembed: bool, then=None) -> tuple[str, str]:
        """The model's id and the request id of its creation (and of then(model), if given: loading a state); the
        run shows on the dashboard at once."""
        session = self.session(session_id)
        cfg = model_config(base_model, rank, train_attn, train_mlp, train_unembed)  # refuses an unknown base model
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise Refused(f"model {model_id} exists: model_seq_id {model_seq_id} was used in this session")
        config = RunConfig.model_validate({"env": "tinker", "model": cfg.model_dump(mode="json", exclude_unset=True)},
                                          context=ELSEWHERE)
        with Session(self.records.engine) as s:  # queued, in line with the daemon's runs: _admit starts it in its turn
            run = Run(name=f"tinker {base_model} {model_id}", tags=["tinker"], config=config.model_dump(mode="json"),
                      total_steps=0, max_restarts=0, status="queued", pid=os.getpid(), host=HOST, ranks=1)
            s.add(run)
            s.flush()
            add_event(s, run.id, "tinker", f"Tinker training client {model_id}: LoRA rank {rank} on {base_model}",
                      session_id=session_id, model_id=model_id, rank=rank, seed=seed)
            s.commit()
            model = Model(model_id, session_id, run.id, base_model, rank)
        with self._lock:
            self.models[model_id] = model
            session.models.append(model_id)
        self._admit()

        def build():  # the model's first request: its later ones wait behind it on its thread
            model.admitted.wait()
            if model.ended:
                raise Gone(model.ended)
            if model.gpu is not None and model.gpu not in self.visible:
                raise Refused(f"GPU {model.gpu} of the daemon's pool (molt serve --gpus) is not one this process "
                              f"sees ({','.join(self.visible) or 'none'}): check CUDA_VISIBLE_DEVICES")
            # no GPU in the pool: the CPU, as the daemon's runs then (CUDA_VISIBLE_DEVICES "")
            device = f"cuda:{self.visible.index(model.gpu)}" if model.gpu is not None else "cpu"
            model.trained = TrainedModel(base_model, rank, seed, train_attn, train_mlp, train_unembed, device)
            return then(model) if then else {"model_id": model_id, "type": "create_model"}
        return model_id, self._start(model.executor.submit(build))

    def _admit_loop(self):
        while True:  # a daemon run's end frees a slot without telling this process: look twice a second
            time.sleep(0.5)
            if any(not m.admitted.is_set() for m in list(self.models.values())):
                try:
                    self._admit()
                except Exception:  # e.g. the database busy: the next look tries again, this thread must not die
                    log.exception("starting the waiting Tinker training clients failed")

    def _admit(self):
        """Start the waiting models whose turn has come by the slot rule (daemon/slots.py: the line in id order,
        daemon runs and Tinker clients alike), each on the first free GPU of the pool where there is one. The daemon
        starts its own runs of that turn, never these; GPUs go in line order (a client waits for the daemon's runs
        ahead of it to take theirs, and one without a free GPU holds back those after it, as a daemon run does)."""
        with self._turns, Session(self.records.engine) as s:
            waiting = {m.run_id: m for m in list(self.models.values()) if not m.admitted.is_set()}
            if not waiting:
                return
            if self.concurrency is None:  # the daemon's slots unknown (`molt web`): start at once
                due = [(run_id, HOST) for run_id in waiting]
            else:
                held = runs_held(s) + s.scalar(select(func.count()).where(EVAL_HOLDS_A_SLOT))
                due = turn(s, self.concurrency - held)
            for run_id, host in due:
                if run_id not in waiting:
                    if self.gpus and host is None:  # the daemon starts it on its GPUs first
                        break
                    continue
                gpu = None
                if self.gpus:
                    free = free_gpus(s, self.gpus)
                    if not free:
                        break
                    gpu = free[0]
                model, t = waiting[run_id], now()
                if set_run(s, run_id, ("queued",), status="running", started_at=t, gpus=gpu):
                    attempt = Attempt(run_id=run_id, number=1, pid=os.getpid(), started_at=t, heartbeat_at=t)
                    s.add(attempt)
                    s.flush()
                    model.attempt_id, model.gpu = attempt.id, gpu
                    add_event(s, run_id, "tinker", f"started on GPU {gpu}: a slot and the GPU were free" if gpu
                              else "started: a slot was free")
                s.commit()
            for run_id, model in waiting.items():  # stopped from the dashboard while queued: its creation fails
                if model.attempt_id is None and s.scalar(select(Run.status).where(Run.id == run_id)) != "queued":
                    model.ended = f"run {run_id} was stopped from the dashboard before it started"
                    model.admitted.set()
                elif model.attempt_id is not None:
                    model.admitted.set()

    def model(self, model_id: str, session_id: str | None = None) -> Model:
        """The model; when the request names its session too, refused if the model is another session's."""
        model = self.models.get(model_id)
        if model is None:
            owner = model_id.split(":train:")[0]
            if ":train:" in model_id and owner not in self.sessions:  # a model id from before a restart, most likely
                raise Unknown(f"unknown model {model_id!r}: its session {owner} is not one of this server's (sessions "
                              "end with the server; create_training_client_from_state goes on from a saved state)")
            raise Unknown(f"unknown model {model_id!r}")
        if session_id is not None and session_id != model.session_id:
            raise Refused(f"model {model_id} is of session {model.session_id}, not of session {session_id}: a "
                          "session's requests name its own models")
        return model  # an ended one still takes requests, which fail in their turn (a 410 here: the SDK retries)

    def submit(self, model_id: str, seq_id: int, work) -> str:
        """Run work(trained model) in its turn: after every lower seq_id of the model (the SDK sends a
        forward_backward's chunks in parallel, the first last). Returns the request id (the same for a seq_id sent
        again: a retried request runs once)."""
        model = self.model(model_id)
        model.last_request = time.time()
        with model.lock:
            if (model_id, seq_id) in self.by_seq:
                return self.by_seq[(model_id, seq_id)]
            if seq_id < model.next_seq:
                raise Refused(f"seq_id {seq_id} of model {model_id} has already run (next is {model.next_seq})")
            future = Future()
            request_id = self._start(future)
            self.by_seq[(model_id, seq_id)] = request_id
            model.waiting[seq_id] = (work, future)
            while model.next_seq in model.waiting:  # hand every request whose turn has come to the model's thread
                work, future = model.waiting.pop(model.next_seq)
                model.executor.submit(self._run, model, work, future)
                model.next_seq += 1
        return request_id

    def _run(self, model: Model, work, future: Future):
        if not future.set_running_or_notify_cancel():
            return
        try:
            if model.ended:
                raise Gone(model.ended)
            future.set_result(work(model.trained))
        except BaseException as e:  # the client reads it from its future
            future.set_exception(e)

    def _start(self, future: Future) -> str:
        request_id = f"req-{next(self._ids)}"
        self.futures[request_id] = future
        return request_id

    def state_path(self, tinker_path: str) -> Path:
        """Where tinker://MODEL_ID/weights/NAME lies: under the data directory, so a restarted server still has it."""
        model_id, kind, name = (tinker_path.removeprefix("tinker://").split("/") + ["", "", ""])[:3]
        if not tinker_path.startswith("tinker://") or kind not in ("weights", "sampler_weights") or not name \
                or name.startswith(".") or not model_id or model_id.startswith(".") or tinker_path.count("/") != 4:
            raise Refused(f"{tinker_path!r} is not a state this server saved (tinker://MODEL_ID/weights/NAME or "
                          "tinker://MODEL_ID/sampler_weights/NAME)")
        return self.root / model_id.replace(":", "_") / kind / f"{name}.pt"

    # ---- sampling ----------------------------------------------------------------------------------------------

    def add_sampler(self, sampler) -> str:
        sampler_id = f"sampler-{secrets.token_hex(6)}"
        self.samplers[sampler_id] = sampler
        return sampler_id

    def sample(self, work) -> str:
        """Sampling requests run beside training (a sampler is a frozen copy), in the order they came."""
        return self._start(self.sampling.submit(work))

    # ---- the dashboard -----------------------------------------------------------------------------------------

    def record(self, model: Model, metrics: dict[str, float]):
        """One optim_step's metrics, as the step's points on the run's charts. A stop asked on the dashboard ends
        the model here: its next request fails saying so, and the run is stopped."""
        step = model.trained.steps - 1
        with Session(self.records.engine) as s:
            write_records(s.connection(), model.run_id, model.attempt_id,
                          [{"t": "metrics", "step": step, "values": metrics, "time": now()}], heartbeat=now())
            s.execute(update(Run).where(Run.id == model.run_id).values(step=step + 1, total_steps=step + 1))
            status = s.scalar(select(Run.status).where(Run.id == model.run_id))
            s.commit()
        if status == "stopping":
            model.ended = f"run {model.run_id} was stopped from the dashboard"
            self._end_run(model, "stopped", None)

    def checkpoint(self, model: Model, path: Path, name: str):
        with Session(self.records.engine) as s:
            write_records(s.connection(), model.run_id, model.attempt_id, [
                {"t": "checkpoint", "step": model.trained.steps, "path": str(path), "time": now(),
                 "info": {"size_bytes": path.stat().st_size}},
                {"t": "event", "kind": "tinker", "message": f"state {name!r} saved", "data": {"path": str(path)},
                 "time": now(), "uid": f"tinker:{model.id}:{name}:{time.time_ns()}"}])
            s.commit()

    def record_samples(self, sampler, prompt: list[int], sequences: list[dict], seed: int | None):
        """A sample request of a training client's weights, as a group of its run's samples (kind "train") at the
        step those weights train next. A base model's sampler, or one of a model an earlier server made, has no run."""
        model = self.models.get(sampler.model_id or "")
        if model is None:
            return
        with self._lock:
            counts = self.recorded.setdefault((model.id, sampler.step), [0, 0])
            group, first = counts
            if group >= RECORD_GROUPS:
                return
            counts[:] = group + 1, first + len(sequences)  # positions are unique per step and kind
        decode, rows = sampler.tokenizer.decode, []
        for seq in sequences:
            ids, n = prompt + seq["tokens"], len(seq["tokens"])
            rows.append(Sample(
                run_id=model.run_id, step=sampler.step, kind="train", position=first + len(rows),
                group_id=group, seed=seed or 0, version=sampler.step, success=False, turns=1, tool_calls=0,
                tool_errors=0, prompt=decode(prompt), text=decode(ids), images=[],
                tokens={"id": ids, "text": [decode([t]) for t in ids], "action": [False] * len(prompt) + [True] * n,
                        "logprob": [None] * len(prompt) + seq["logprobs"], "trainer_logprob": [None] * len(ids),
                        "version": [-1] * len(prompt) + [sampler.step] * n, "entropy": [None] * len(ids)}))
        with Session(self.records.engine) as s:
            s.add_all(rows)
            s.commit()

    def _end_run(self, model: Model, status: str, error: str | None):
        with Session(self.records.engine) as s:
            attempt = s.get(Attempt, model.attempt_id)
            finish(s, model.run_id, attempt, {"status": status, "time": now(), "summary": None, "error": error})
            s.commit()
