"""Devices, precision and memory on a CPU: bf16, the OOM split, micro-batches, the KV budget, the daemon's GPU queue."""
import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import wait_until
import molt_engine.update as update_mod
from molt_engine import RunConfig, checkpoint, train
from molt_engine.config import ValidationError, config_errors
from sqlalchemy import update
from sqlmodel import Session

from daemon.models import Evaluation, Run
from daemon.records import Records
from daemon.slots import free_gpus
from daemon.supervisor import Supervisor
from molt_engine.models import char_tokenizer, device_of, load_policy
from molt_engine.inference.sampler import Sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_daemon_supervisor import START, Studio, config as daemon_config  # noqa: E402
from test_robustness import Recorder, config  # noqa: E402


def test_device_and_dtype_are_validated_and_a_missing_gpu_is_named():
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate(config(model={"device": "gpu", "dtype": "fp8"}))
    errors = config_errors(e.value)
    assert any(x.startswith("model.device:") for x in errors) and any(x.startswith("model.dtype:") for x in errors)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="model.device is 'cuda:1' but torch sees no CUDA device"):
            train(config(model={"device": "cuda:1"}, loop={"steps": 1}))


def test_each_rank_of_a_cuda_run_asks_for_its_own_gpu(monkeypatch):
    """Under torchrun (LOCAL_RANK), `auto` and `cuda` mean the rank's own GPU; too few GPUs for the ranks is named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = RunConfig.model_validate(config()).model
    assert device_of(model) == torch.device("cuda")  # not launched by torchrun: the first visible GPU
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        for name in ("auto", "cuda"):
            assert device_of(model.model_copy(update={"device": name})) == torch.device(f"cuda:{rank}")
    assert device_of(model.model_copy(update={"device": "cuda:0"})) == torch.device("cuda:0")  # as asked
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="rank 2 of this node needs GPU 2 but torch sees 2"):
        device_of(model)


def test_a_run_of_several_ranks_asks_for_one_gpu_per_rank_by_default(tmp_path):
    sup = Supervisor(tmp_path, gpus=["0", "1", "2"])
    needed = lambda **cfg: sup.gpus_needed(Run(config={"env": "max_digit", **cfg}))  # noqa: E731
    assert (needed(), needed(dist={"nproc": 2}), needed(dist={"nproc": 2}, resources={"gpus": 1})) == (1, 2, 1)
    assert Supervisor(tmp_path, gpus=[]).gpus_needed(Run(config={"env": "max_digit", "dist": {"nproc": 2}})) == 0


def holders(home, *jobs):
    """Real records: (kind, status, host, gpus) a run or evaluation each, in id order."""
    records = Records(home)
    with Session(records.engine) as s:
        for kind, status, host, gpus in jobs:
            s.add(Run(name="r", config={}, total_steps=1, status=status, host=host, gpus=gpus) if kind == "run" else
                  Evaluation(config={}, status=status, gpus=gpus))
        s.commit()
    return records


def test_a_free_gpu_is_the_first_of_the_pool_that_no_run_holding_a_slot_nor_running_evaluation_holds(tmp_path):
    records = holders(tmp_path, ("run", "running", None, "0"), ("run", "running", "tinker", "1"),
                      ("evaluation", "running", None, "2"), ("run", "restarting", None, "3"),  # its restart's
                      ("run", "completed", None, "4"), ("evaluation", "completed", None, "5"),
                      ("run", "running", "laptop", "6"))  # an external run's GPUs are another machine's
    pool = [str(i) for i in range(8)]
    with Session(records.engine) as s:
        assert free_gpus(s, pool) == ["4", "5", "6", "7"]
        assert free_gpus(s, pool, held={"4"}, but=3) == ["3", "5", "6", "7"]  # run 3 restarts on its own GPU
        assert free_gpus(s, ["0", "1", "2", "3"]) == []  # none free: a client waits
        assert free_gpus(s, []) == []  # no pool (a CPU machine): nothing to take, none needed


def test_the_daemon_leaves_to_tinker_clients_the_gpus_they_hold_and_those_their_turn_takes(tmp_path):
    """An active Tinker client's recorded GPU is not the daemon's to give; a queued one whose turn has come takes the
    first free GPU, so the daemon's runs after it in line, and evaluations, start on the next."""
    records = holders(tmp_path, ("run", "running", "tinker", "0"), ("run", "queued", "tinker", None),
                      ("run", "queued", None, None))
    sup = Supervisor(tmp_path, gpus=["0", "1", "2"], concurrency=3)
    with Session(records.engine) as s:
        assert sup.free_gpus(s) == ["2"]  # an evaluation
        assert sup.free_gpus(s, s.get(Run, 3)) == ["2"]  # the daemon's run behind the client
    with Session(records.engine) as s:  # the client started on GPU 1: the daemon's run still gets 2
        s.execute(update(Run).where(Run.id == 2).values(status="running", gpus="1"))
        assert sup.free_gpus(s, s.get(Run, 3)) == ["2"]
        s.execute(update(Run).where(Run.id == 1).values(status="completed"))
        assert sup.free_gpus(s, s.get(Run, 3)) == ["0", "2"]


def test_a_tinker_client_takes_the_free_gpu_of_the_pool_in_its_turn_and_the_next_waits_for_one(tmp_path, monkeypatch):
    """The web process's side, on real records: the daemon's run holds GPU 0, so the first client takes 1 and the
    second waits queued until the first one's session ends. This process sees no GPU (CUDA_VISIBLE_DEVICES empty),
    so building on the pool's GPU fails, naming it: no CUDA is started."""
    from app.tinker.service import Service
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    records = holders(tmp_path, ("run", "running", None, "0"))
    service = Service(records, concurrency=3, gpus=["0", "1"])
    status = lambda run_id: records.get_run(run_id)  # noqa: E731
    first, second = (service.session(service.create_session()) for _ in range(2))
    a, request = service.create_model(first.id, 0, "tiny-dense", 4, None, True, True, True)
    b, _ = service.create_model(second.id, 0, "tiny-dense", 4, None, True, True, True)
    with pytest.raises(Exception, match=r"GPU 1 of the daemon's pool \(molt serve --gpus\) is not one this process "
                                        r"sees \(none\)"):
        service.futures[request].result(timeout=30)
    ran, waits = status(service.models[a].run_id), status(service.models[b].run_id)
    assert (ran["status"], ran["gpus"], waits["status"], waits["gpus"]) == ("running", "1", "queued", None)
    service.end_session(first.id)
    taken = status(service.models[b].run_id)
    assert (taken["status"], taken["gpus"]) == ("running", "1")


def test_bf16_shows_its_precision_gap_and_its_checkpoint_resumes_in_fp32_and_loads_with_transformers(tmp_path):
    fp32 = Recorder()
    train(config(loop={"steps": 2}), fp32)
    bf16 = Recorder()
    summary = train(config(model={"dtype": "bfloat16"}, loop={"steps": 4}, checkpoint={"every": 2}), bf16, tmp_path)
    assert summary["status"] == "completed"
    (device,) = [e for e in bf16.events if e["kind"] == "device"]
    assert device["message"].startswith("training on cpu in bfloat16, eager decoding; memory plan of ")
    plan = device["memory_plan"]  # bytes: 4 a parameter of weights, 2 of each sampler's copy (bf16)
    assert plan["weights"] == 4 * device["parameters"] and plan["kv"][0] > 0
    assert plan["samplers"] == len(plan["kv"]) * 2 * device["parameters"]
    # The sampler decodes in bf16, the trainer recomputes under bf16 autocast from fp32 weights: the gap shows.
    assert all(fp32.steps[s]["mismatch_abs"] < 1e-5 for s in fp32.steps)
    assert all(bf16.steps[s]["mismatch_abs"] > 1e-4 for s in bf16.steps)
    assert all(bf16.steps[s]["rss_gb"] > 0.05 for s in bf16.steps)

    resumed = Recorder()
    summary = train(config(model={"dtype": "float32"}, loop={"steps": 6}, checkpoint={"every": 2}), resumed,
                    tmp_path, resume=True)
    assert summary["status"] == "completed" and sorted(resumed.steps) == [4, 5]
    assert [e["step"] for e in resumed.events if e["kind"] == "resumed"] == [4]
    assert all(resumed.steps[s]["mismatch_abs"] < 1e-5 for s in resumed.steps)  # fp32 again: no gap
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert all(p.dtype == torch.float32 for p in final.parameters())
    model, tok = load_policy(RunConfig.model_validate(config()).model, 0)
    ids = torch.tensor([tok.encode("max of 3 9 4:")])
    model.load_state_dict(final.state_dict())
    assert torch.equal(final(ids).logits, model(ids).logits)


def test_micro_batches_accumulate_the_same_update_and_an_oom_splits_the_step(tmp_path):
    whole, micro, oom = Recorder(), Recorder(), Recorder()
    train(config(loop={"steps": 2}), whole, tmp_path / "whole")
    train(config(loop={"steps": 2}, algo={"micro_batch_size": 3}), micro, tmp_path / "micro")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "micro" / "final").state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert abs(whole.steps[1]["policy_loss"] - micro.steps[1]["policy_loss"]) < 1e-6

    summary = train(config(loop={"steps": 3}, drills={"oom_at": [1]}), oom)
    assert summary["status"] == "completed" and sorted(oom.steps) == [0, 1, 2]
    events = [e for e in oom.events if e["kind"] == "oom"]
    assert [(e["step"], e["micro_batch_size"]) for e in events] == [(1, 8)], events  # 16 episodes, halved


def test_the_micro_batch_size_an_oom_halved_is_kept_across_a_restart(tmp_path, monkeypatch):
    """drills.oom_at 1 halves the whole minibatch (16 episodes) to 8; the checkpoint keeps 8, so the restarted run
    trains with 8 rather than running out again at the config's size."""
    cfg = config(loop={"steps": 2}, drills={"oom_at": [1]}, checkpoint={"every": 2})
    train(cfg, Recorder(), tmp_path)
    state = torch.load(checkpoint.latest(tmp_path / "checkpoints") / "state.pt", weights_only=False)
    assert state["micro_batch_size"] == 8
    sizes, real = [], update_mod.train_step

    def spy(*args, micro_batch_size, **kw):
        sizes.append(micro_batch_size)
        return real(*args, micro_batch_size=micro_batch_size, **kw)
    monkeypatch.setattr(update_mod, "train_step", spy)
    train({**cfg, "loop": {**cfg["loop"], "steps": 4}}, Recorder(), tmp_path, resume=True)
    assert sizes == [8, 8]


def test_kv_budget_queues_requests_beyond_it_and_all_finish():
    tok = char_tokenizer()
    model, _ = load_policy(RunConfig.model_validate(config()).model, 0)
    text = model.config
    token_bytes = 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4
    context, new = tok.encode("max of 3 9 4:"), 6
    budget = 3 * (len(context) + new) * token_bytes / 1e9  # three requests' worth
    sampler = Sampler(model, stop_ids=[], pad_id=tok.pad_token_id, temperature=1.0, kv_budget_gb=budget)
    seen, real_step = [], sampler.step

    def step():
        finished = real_step()
        if sampler.cache is not None:
            cache_bytes = sum(t.numel() * t.element_size() for layer in sampler.cache.layers
                              for t in (layer.keys, layer.values))
            seen.append((len(sampler.active), len(sampler.pending), cache_bytes))
        return finished
    sampler.step = step

    async def main():
        task = asyncio.create_task(sampler.run())
        done = await asyncio.gather(*(sampler.generate(context, new, seed=i) for i in range(10)))
        task.cancel()
        return done

    done = asyncio.run(main())
    assert [len(r.ids) for r in done] == [new] * 10
    assert max(active for active, _, _ in seen) == 3
    assert max(pending for _, pending, _ in seen) == 7  # queued, not dropped
    assert max(cache for _, _, cache in seen) <= budget * 1e9


@pytest.mark.slow  # three runs through a real daemon: about 25 s
def test_daemon_gives_each_worker_its_own_gpu_and_queues_runs_until_one_frees(tmp_path):
    studio = Studio(tmp_path)
    try:
        api = studio.api
        gpu = {"gpus": 1}
        runs = [api.create_run(daemon_config(steps, resources=gpu), name=f"gpu-{i}")["id"]
                for i, steps in enumerate((12, 12, 6))]
        greedy = api.create_run(daemon_config(6, resources={"gpus": 3}), name="three-gpus")["id"]
        studio.start_daemon("--concurrency", "3", "--gpus", "0,1")
        visible = {}  # run id -> the CUDA_VISIBLE_DEVICES its worker process was started with

        def all_done():
            for pid, run_id in studio.workers().items():
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                visible.setdefault(run_id, {e.split(b"=", 1)[1].decode() for e in env
                                            if e.startswith(b"CUDA_VISIBLE_DEVICES=")})
            return all(api.get_run(r)["status"] in ("completed", "failed") for r in runs)
        wait_until(all_done, START + 240, 0.05, message="the three runs to end")

        finals = [api.get_run(r) for r in runs]
        assert [f["status"] for f in finals] == ["completed"] * 3, [f["last_error"] for f in finals]
        assert studio.max_total == 2, "two GPUs: never three workers at once"
        assert {r: visible[r] for r in runs} == {r: {f["gpus"]} for r, f in zip(runs, finals)}
        assert {finals[0]["gpus"], finals[1]["gpus"]} == {"0", "1"}
        attempt = lambda r: api.attempts(r)[0]  # noqa: E731
        # The third started on a GPU of the first two, after the run that held it had ended. (Not necessarily the
        # first to end: a worker records its own end before the daemon reaps it and frees its GPU.)
        ended = {finals[i]["gpus"]: attempt(runs[i])["ended_at"] for i in (0, 1)}
        assert finals[2]["gpus"] in ended and attempt(runs[2])["started_at"] >= ended[finals[2]["gpus"]]
        refused = api.get_run(greedy)
        assert refused["status"] == "failed" and "resources.gpus is 3 but this daemon has 2 GPU(s)" in \
            refused["last_error"] and api.attempts(greedy) == []
        # Each worker trained where its CUDA_VISIBLE_DEVICES let it: on the GPU it was given where torch has that GPU
        # (then it is the worker's cuda:0), else on the CPU (model.device auto falls back; this machine has none).
        for r, f in zip(runs, finals):
            devices = [e["message"] for e in api.events(r) if e["kind"] == "device"]
            sees_gpu = int(f["gpus"]) < torch.cuda.device_count()
            assert len(devices) == 1, devices
            assert devices[0].startswith("training on cuda:0 (" if sees_gpu else "training on cpu in float32"), devices
    finally:
        studio.close()
