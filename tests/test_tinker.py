"""The Tinker API (issue 68): the unchanged `tinker` SDK (pinned) against a real `molt serve`, on CPU."""
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from app.auth import Auth
from app.queue import queue_notes
from app.tinker.sampler import Sampler
from app_support import ROOT, child_env, serve
from daemon.records import Records
from conftest import wait_until
from test_eval_faults import fill
from molt_engine.models import char_tokenizer

TOKENIZER = char_tokenizer()  # the tiny presets' (one token per character)
TEXTS = ["the cat sat on the mat", "molt studio trains agents", "hello world again", "one two three four"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # a tiny model: more threads only contend (30 steps: 3 s, not 40)
        # slots enough for every training client of the module's session (each holds one while the session lives)
        with serve(tmp_path_factory.mktemp("home"), "--concurrency", "64") as s:
            yield s


@pytest.fixture(scope="module")
def client(served):
    service = tinker.ServiceClient(base_url=f"{served.base}/tinker", api_key=Auth(served.token).tinker)
    yield service
    service.close("success").result()


def datum(text: str) -> types.Datum:
    ids = TOKENIZER(text)["input_ids"]
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], np.int64),
                                       "weights": np.ones(len(ids) - 1, np.float32)})


def test_molt_token_tinker_prints_the_key_the_server_takes(served, tmp_path):
    printed = subprocess.run([sys.executable, "-m", "app.cli", "token", "--tinker", "--home", str(served.home)],
                             capture_output=True, text=True, cwd=ROOT, env=child_env(served.home), check=True)
    assert printed.stdout.strip() == Auth(served.token).tinker and printed.stdout.startswith("tml-")


def test_supervised_cross_entropy_halves_in_30_steps_and_the_run_charts_it(served, client):
    data = [datum(t) for t in TEXTS]
    trainer = client.create_lora_training_client(base_model="tiny-dense", rank=16, seed=1).result()
    losses = []
    for _ in range(30):
        fwd_bwd = trainer.forward_backward(data, "cross_entropy")  # both submitted before either result is read
        step = trainer.optim_step(types.AdamParams(learning_rate=2e-3, grad_clip_norm=1.0))
        out = fwd_bwd.result()
        losses.append(out.metrics["loss:sum"])
        assert step.result().metrics["loss"] == pytest.approx(losses[-1], rel=1e-5)
    assert losses[-1] < losses[0] / 2, losses
    # per-token log-probs, one per target token, whose weighted sum is the loss
    logprobs = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert [len(lp) for lp in logprobs] == [len(t) - 1 for t in TEXTS]
    assert -sum(lp.sum() for lp in logprobs) == pytest.approx(losses[-1], rel=1e-4)

    run = run_of(served, trainer.model_id)
    assert (run["status"], run["host"], run["step"], run["tags"]) == ("running", "tinker", 30, ["tinker"])
    series = served.client.get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "loss"}).json()["series"]
    assert series["loss"]["step"] == list(range(30))
    assert series["loss"]["value"] == pytest.approx(losses, rel=1e-5)


def test_refusals_name_what_is_wrong(served, client):
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=f"{served.base}/tinker", api_key="tml-not-the-key").holder
    with pytest.raises(Exception, match="unknown base model 'no-such-model'"):
        client.create_lora_training_client(base_model="no-such-model", rank=4).result()
    trainer = client.create_lora_training_client(base_model="tiny-dense", rank=4).result()
    with pytest.raises(Exception, match="loss_fn 'stable_reinforce' is not supported here.*record_stability_info"):
        trainer.forward_backward([datum("abc")], "stable_reinforce").result()
    with pytest.raises(Exception, match="past the model's context of 512"):
        trainer.forward_backward([datum("x" * 600)], "cross_entropy").result()


def test_a_request_naming_a_model_of_another_session_is_refused_naming_both(served, client):
    trainer = client.create_lora_training_client(base_model="tiny-dense", rank=4).result()
    other = tinker.ServiceClient(base_url=f"{served.base}/tinker", api_key=Auth(served.token).tinker)
    mine, theirs = client.holder.get_session_id(), other.holder.get_session_id()
    with httpx.Client(base_url=f"{served.base}/tinker/api/v1", headers={"X-API-Key": Auth(served.token).tinker}) as api:
        body = {"session_id": theirs, "model_id": trainer.model_id, "optimizer": False,
                "path": f"tinker://{trainer.model_id}/weights/any"}
        refused = api.post("/load_weights", json=body)
        assert refused.status_code == 400
        assert refused.json()["detail"].startswith(f"model {trainer.model_id} is of session {mine}, not of session "
                                                   f"{theirs}")
        # a model id of a session this server does not have (one from before a restart)
        unknown = api.post("/optim_step", json={"model_id": "molt-0123456789ab:train:0", "seq_id": 1})
        assert unknown.status_code == 404
        assert "its session molt-0123456789ab is not one of this server's" in unknown.json()["detail"]
    other.close("success").result()


def test_a_custom_loss_runs_in_the_client_over_forward_and_a_weighted_cross_entropy(client):
    trainer, data = client.create_lora_training_client(base_model="tiny-dense", rank=4).result(), [datum("abcd")]

    def twice_the_nll(data, logprobs_list):
        loss = -2 * sum(lp.sum() for lp in logprobs_list)
        return loss, {"nll": loss.item() / 2}
    custom = trainer.forward_backward_custom(data, twice_the_nll).result()
    plain = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert custom.metrics["nll"] == pytest.approx(plain, rel=1e-5)
    # the backward is cross_entropy with weights -d(loss)/d(logprobs) = 2: the custom loss's gradient
    assert custom.metrics["surrogate_loss:sum"] == pytest.approx(2 * plain, rel=1e-5)


def test_importance_sampling_and_ppo_weigh_the_advantages_by_the_ratio_and_ppo_clips_it(client):
    trainer, (tokens, targets) = client.create_lora_training_client(base_model="tiny-dense", rank=4).result(), \
        (TOKENIZER("abcde")["input_ids"][:-1], TOKENIZER("abcde")["input_ids"][1:])
    now = trainer.forward([datum("abcde")], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    sampled = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
        "target_tokens": np.array(targets, np.int64), "logprobs": (now - 0.5).astype(np.float32),  # ratio e^0.5
        "advantages": np.array([1, -1, 1, -1], np.float32)})
    ratio = np.exp(0.5)
    for loss_fn, expected in [("importance_sampling", [-ratio, ratio, -ratio, ratio]),
                              ("ppo", [-1.2, ratio, -1.2, ratio])]:  # min(r A, clip(r, 0.8, 1.2) A)
        out = trainer.forward([sampled], loss_fn).result()
        assert out.loss_fn_outputs[0]["elementwise_loss"].to_numpy() == pytest.approx(expected, rel=1e-5)
        assert out.metrics["loss:sum"] == pytest.approx(sum(expected), abs=1e-4)


def test_cispo_dro_and_gspo_run_through_the_sdk_with_per_token_outputs(client):
    trainer, (tokens, targets) = client.create_lora_training_client(base_model="tiny-dense", rank=4).result(), \
        (TOKENIZER("abcde")["input_ids"][:-1], TOKENIZER("abcde")["input_ids"][1:])
    now = trainer.forward([datum("abcde")], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    advantages = np.array([1, -1, 1, -1], np.float32)
    sampled = {"target_tokens": np.array(targets, np.int64), "logprobs": (now - 0.5).astype(np.float32),  # ratio e^0.5
               "advantages": advantages, "sequence_ratio_mask": np.array([0, 1, 1, 1], np.float32)}
    ratio = np.exp(0.5)  # the sequence's ratio too (every token's log-ratio is 0.5), clipped to 1.2
    for loss_fn, config, expected in [("cispo", None, -1.2 * now * advantages),
                                      ("dro", {"beta": 0.1}, -(now * advantages - 0.05 * 0.25)),
                                      ("gspo", None, [-1.2, ratio, -1.2, ratio])]:
        out = trainer.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                                    loss_fn_inputs=sampled)], loss_fn, config).result()
        assert out.loss_fn_outputs[0]["logprobs"].to_numpy() == pytest.approx(now, abs=1e-5)
        assert out.loss_fn_outputs[0]["elementwise_loss"].to_numpy() == pytest.approx(expected, rel=1e-4), loss_fn
        assert out.metrics["loss:sum"] == pytest.approx(np.sum(expected), abs=1e-4)


def test_a_state_saved_with_its_optimizer_goes_on_exactly(served, client):
    data, adam = [datum(t) for t in TEXTS[:2]], types.AdamParams(learning_rate=1e-2)
    first = client.create_lora_training_client(base_model="tiny-dense", rank=4, seed=3).result()
    for _ in range(3):
        first.forward_backward(data, "cross_entropy")
        first.optim_step(adam)
    path = first.save_state("three").result().path
    assert path == f"tinker://{first.model_id}/weights/three"
    again = client.create_training_client_from_state_with_optimizer(path).result()
    fresh_adam = client.create_training_client_from_state(path).result()  # the same weights, new moments

    def after_a_step(trainer) -> np.ndarray:
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam).result()
        out = trainer.forward(data, "cross_entropy").result()
        return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])

    before = [np.concatenate([o["logprobs"].to_numpy() for o in t.forward(data, "cross_entropy").result()
                              .loss_fn_outputs]) for t in (first, again, fresh_adam)]
    assert np.abs(before[0] - before[1]).max() == 0 and np.abs(before[0] - before[2]).max() == 0
    stepped = [after_a_step(t) for t in (first, again, fresh_adam)]
    assert np.abs(stepped[0] - stepped[1]).max() == 0  # the moments came back too
    assert np.abs(stepped[0] - stepped[2]).max() > 1e-4  # (without them the same step goes elsewhere)
    checkpoints = served.client.get(f"/api/v1/runs/{run_of(served, first.model_id)['id']}/checkpoints").json()
    assert [c["path"].endswith("three.pt") for c in checkpoints] == [True]
    rest = tinker.RestClient(base_url=f"{served.base}/tinker", api_key=Auth(served.token).tinker)
    assert [c.tinker_path for c in rest.list_checkpoints(first.model_id).result().checkpoints] == [path]
    listed = rest.get_training_run(first.model_id).result()
    assert (listed.base_model, listed.lora_rank, listed.last_checkpoint.tinker_path) == ("tiny-dense", 4, path)
    assert first.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]


def test_a_stop_from_the_dashboard_ends_the_training_client_with_a_clear_error(served, client):
    trainer, adam = client.create_lora_training_client(base_model="tiny-dense", rank=4).result(), types.AdamParams()
    trainer.forward_backward([datum("abc")], "cross_entropy")
    trainer.optim_step(adam).result()
    run = run_of(served, trainer.model_id)
    assert served.client.post(f"/api/v1/runs/{run['id']}/stop").json()["status"] == "stopping"
    trainer.forward_backward([datum("abc")], "cross_entropy")
    trainer.optim_step(adam).result()  # the step that reads the stop
    assert run_of(served, trainer.model_id)["status"] == "stopped"
    with pytest.raises(Exception, match=f"run {run['id']} was stopped from the dashboard"):
        trainer.forward_backward([datum("abc")], "cross_entropy").result()


def run_of(served, model_id: str) -> dict:
    return next(r for r in served.client.get("/api/v1/runs").json() if model_id in r["name"])


def test_sampling_a_base_model_with_stops_log_probs_and_prompt_log_probs(client):
    sampler = client.create_sampling_client(base_model="tiny-dense").result()
    prompt = types.ModelInput.from_ints(TOKENIZER("hello")["input_ids"])
    out = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=5),
                         include_prompt_logprobs=True).result()
    assert [(len(s.tokens), len(s.logprobs), s.stop_reason) for s in out.sequences] == [(6, 6, "length")] * 3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    assert all(lp < 0 for s in out.sequences for lp in s.logprobs)
    greedy = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result()
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens  # temperature 0: the argmax each time
    tokens = greedy.sequences[0].tokens
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[tokens[-1]])).result()
    until = tokens[:tokens.index(tokens[-1]) + 1]  # the first time the stop token comes, included
    assert (stopped.sequences[0].tokens, stopped.sequences[0].stop_reason) == (until, "stop")


def test_top_k_and_top_p_sample_from_the_most_likely_tokens_with_their_renormalised_log_probs(client):
    sampler = client.create_sampling_client(base_model="tiny-dense").result()
    prompt = TOKENIZER("hello")["input_ids"]

    def sample(**params):
        return sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(
            max_tokens=6, stop=[], seed=3, **params)).result().sequences
    greedy = sample(temperature=0.0)[0].tokens
    assert [s.tokens for s in sample(temperature=1.0, top_k=1)] == [greedy] * 2
    assert [s.tokens for s in sample(temperature=1.0, top_p=1e-6)] == [greedy] * 2
    # top_k=3: each token is one of the 3 most likely after its prefix, and its log-prob is over those 3 alone
    model = Sampler.of_base("tiny-dense").model  # the server's base weights (seed 0)
    for seq in sample(temperature=1.0, top_k=3):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + seq.tokens])).logits[0, len(prompt) - 1:-1].float()
        top = logits.topk(3, -1)
        assert all(t in ids for t, ids in zip(seq.tokens, top.indices.tolist()))
        top_lp = torch.log_softmax(top.values, -1)
        expected = [top_lp[i, ids.index(t)].item() for i, (t, ids) in enumerate(zip(seq.tokens, top.indices.tolist()))]
        assert seq.logprobs == pytest.approx(expected, abs=1e-4)
    with pytest.raises(Exception, match="top_k must be -1 .all tokens. or at least 1, and top_p in"):
        sample(temperature=1.0, top_p=0.0)


def test_samples_of_a_training_clients_weights_show_on_its_runs_samples_view(served, client):
    trainer = client.create_lora_training_client(base_model="tiny-dense", rank=4).result()
    trainer.forward_backward([datum("abc")], "cross_entropy")
    trainer.optim_step(types.AdamParams()).result()
    prompt = TOKENIZER("hello")["input_ids"]
    params = types.SamplingParams(max_tokens=5, temperature=1.0, stop=[], seed=2)
    drawn = trainer.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(prompt), 2, params).result().sequences
    path = trainer.save_weights_for_sampler("one").result().path  # a sampling client made from a path: the same run
    by_path = client.create_sampling_client(model_path=path).result().sample(
        types.ModelInput.from_ints(prompt), 1, params).result().sequences
    run = run_of(served, trainer.model_id)
    page = served.client.get(f"/api/v1/runs/{run['id']}/samples").json()
    assert page["total"] == 3
    texts = ["hello" + TOKENIZER.decode(s.tokens) for s in drawn + by_path]
    assert [(r["step"], r["kind"], r["group_id"], r["position"], r["text"]) for r in page["samples"]] == \
        [(1, "train", 0, 0, texts[0]), (1, "train", 0, 1, texts[1]), (1, "train", 1, 2, texts[2])]
    first = page["samples"][0]["tokens"]
    assert first["action"] == [False] * 5 + [True] * 5 and first["logprob"][5:] == pytest.approx(drawn[0].logprobs)
    assert served.client.get(f"/api/v1/runs/{run['id']}/samples", params={"q": texts[2]}).json()["total"] == 1
    assert served.client.get(f"/runs/{run['id']}/samples").status_code == 200


@pytest.mark.slow  # about 25 s: the default suite keeps the supervised acceptance
def test_rl_in_the_cookbook_style_raises_the_mean_reward(client):
    """Groups sampled from the trainer's latest saved weights, scored (a digit: 0.5; the prompt's largest: 1),
    advantages centred per group, importance_sampling on the sampled tokens."""
    rng, trainer = np.random.default_rng(0), client.create_lora_training_client(base_model="tiny-dense", rank=8,
                                                                                  seed=0).result()
    means = []
    for step in range(40):
        if step % 2 == 0:
            sampler = trainer.save_weights_and_get_sampling_client().result()
        prompts = ["".join(map(str, rng.integers(0, 10, 3))) + ":" for _ in range(8)]
        params = types.SamplingParams(max_tokens=1, temperature=1.0, stop=[])
        futures = [sampler.sample(types.ModelInput.from_ints(TOKENIZER(p)["input_ids"]), 8, params) for p in prompts]
        data, rewards = [], []
        for prompt, future in zip(prompts, futures):
            group = future.result().sequences
            scores = [0.5 * TOKENIZER.decode(s.tokens).isdigit() + 0.5 * (TOKENIZER.decode(s.tokens) == max(prompt))
                      for s in group]
            rewards += scores
            for s, advantage in zip(group, np.array(scores) - np.mean(scores)):
                tokens = TOKENIZER(prompt)["input_ids"] + s.tokens
                only_last = np.zeros(len(tokens) - 1, np.float32)  # the prompt's tokens are not trained
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": np.array(tokens[1:], np.int64),
                    "logprobs": np.concatenate([only_last[:-1], s.logprobs]).astype(np.float32),
                    "advantages": np.concatenate([only_last[:-1], [advantage]]).astype(np.float32)}))
        trainer.forward_backward(data, "importance_sampling")
        trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        means.append(np.mean(rewards))
    assert np.mean(means[-10:]) > np.mean(means[:5]) + 0.3, np.round(means, 3)


CLIENT = """
import json, sys
import numpy as np, tinker
from tinker import types
data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": np.array([6, 7, 8]), "weights": np.ones(3, np.float32)})]
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
trainer = client.create_lora_training_client(base_model="tiny-dense", rank=4).result()
trainer.forward_backward(data, "cross_entropy")
trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
path = trainer.save_state("kept").result().path
logprobs = trainer.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
print(json.dumps({"model_id": trainer.model_id, "path": path, "logprobs": logprobs}), flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.slow  # about a minute: two servers, and a heartbeat timeout to wait out
def test_a_killed_client_is_ended_by_its_heartbeats_and_a_killed_server_keeps_its_states(tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOLT_TINKER_HEARTBEAT_TIMEOUT", "15")  # the SDK beats every 10 s
        patch.setenv("OMP_NUM_THREADS", "1")
        with serve(tmp_path) as served:
            proc = subprocess.Popen([sys.executable, "-c", CLIENT, f"{served.base}/tinker", Auth(served.token).tinker],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            first = json.loads(proc.stdout.readline())
            assert run_of(served, first["model_id"])["status"] == "running"
            proc.kill()  # kill -9: no finish, no more heartbeats
            proc.wait()
            wait_until(lambda: run_of(served, first["model_id"])["status"] == "failed", timeout=15 + 15)
            assert "no heartbeat from the client for 15s" in run_of(served, first["model_id"])["last_error"]
            # a second session, live when its server is killed
            proc = subprocess.Popen([sys.executable, "-c", CLIENT, f"{served.base}/tinker", Auth(served.token).tinker],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            second = json.loads(proc.stdout.readline())
            served.proc.kill()
            served.proc.wait()
            proc.kill()
            proc.wait()
        with serve(tmp_path, "--concurrency", "2") as again:  # two restored clients in one session
            client = tinker.ServiceClient(base_url=f"{again.base}/tinker", api_key=Auth(again.token).tinker)
            for saved in (first, second):
                restored = client.create_training_client_from_state_with_optimizer(saved["path"]).result()
                out = restored.forward([datum_of([5, 6, 7, 8])], "cross_entropy").result()
                assert np.abs(out.loss_fn_outputs[0]["logprobs"].to_numpy() - saved["logprobs"]).max() == 0
            orphan = run_of(again, second["model_id"])
            assert orphan["status"] == "failed" and "the server restarted" in orphan["last_error"]
            client.close("success").result()


def datum_of(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], np.int64),
                                       "weights": np.ones(len(ids) - 1, np.float32)})


def test_a_save_on_a_full_disk_fails_its_future_saying_so_and_leaves_the_earlier_state_whole(tmp_path):
    """The states' directory on a 16 MiB tmpfs of its own, filled: save_state's future fails with the kernel's
    ENOSPC, nothing half-written is left, the state of that name is still the earlier one, training goes on, and
    once room is made the same save goes through."""
    states = tmp_path / "tinker"
    states.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(states)], check=True)
    try:
        with serve(tmp_path) as served:
            client = tinker.ServiceClient(base_url=f"{served.base}/tinker", api_key=Auth(served.token).tinker)
            trainer = client.create_lora_training_client(base_model="tiny-dense", rank=4, seed=1).result()
            data, adam = [datum(t) for t in TEXTS], types.AdamParams(learning_rate=1e-3)

            def step():
                trainer.forward_backward(data, "cross_entropy")
                trainer.optim_step(adam).result()
            step()
            path = trainer.save_state("kept").result().path
            [file] = states.rglob("kept.pt")
            step()
            fill(states / "filler")
            with pytest.raises(Exception, match="No space left on device"):
                trainer.save_state("kept").result()
            assert sorted(p.name for p in file.parent.iterdir()) == ["kept.pt"], "nothing half-written is left"
            assert torch.load(file, weights_only=True)["steps"] == 1, "the earlier state, whole"
            step()  # the session goes on
            (states / "filler").unlink()
            assert trainer.save_state("kept").result().path == path
            assert torch.load(file, weights_only=True)["steps"] == 3
            assert run_of(served, trainer.model_id)["status"] == "running"
            client.close("success").result()
    finally:
        subprocess.run(["umount", "-l", str(states)], check=True)


# ---- scheduling: a training client holds one of the daemon's slots, in line with its runs ------------------------

LONG = {"env": "max_digit", "loop": {"steps": 100000, "groups_per_step": 2, "group_size": 2, "eval_every": 0},
        "warm_start": {"steps": 0}, "checkpoint": {"every": 0}}  # runs until stopped


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        with serve(tmp_path_factory.mktemp("home"), "--concurrency", "1") as s:
            yield s


def note_of(served, run_id: int) -> str | None:
    return queue_notes(Records(served.home, migrate=False).engine, 1).get(("run", run_id))


def test_a_daemon_run_waits_for_the_slot_a_training_client_holds_until_its_session_ends(one_slot):
    service = tinker.ServiceClient(base_url=f"{one_slot.base}/tinker", api_key=Auth(one_slot.token).tinker)
    trainer = service.create_lora_training_client(base_model="tiny-dense", rank=4).result()
    holder = run_of(one_slot, trainer.model_id)
    assert holder["status"] == "running"
    queued = one_slot.create(LONG, name="after-tinker")
    assert note_of(one_slot, queued["id"]) == (f"1st in line; 1 slot (concurrency 1) held by run #{holder['id']} "
                                               f"'{holder['name']}'")
    trainer.forward_backward([datum("abc")], "cross_entropy")
    trainer.optim_step(types.AdamParams()).result()
    submitted = time.time()  # the daemon touches its lock file at every poll (twice a second): a few polls go by
    wait_until(lambda: (one_slot.home / "daemon.lock").stat().st_mtime > submitted + 1.5, timeout=30)
    assert status_of(one_slot, queued["id"]) == "queued"  # it started nothing meanwhile
    service.close("success").result()
    assert run_of(one_slot, trainer.model_id)["status"] == "completed"
    wait_until(lambda: status_of(one_slot, queued["id"]) == "running", timeout=30, message="the daemon starts it")
    one_slot.client.post(f"/api/v1/runs/{queued['id']}/stop")
    assert one_slot.wait(queued["id"])["status"] == "stopped"  # the slot is free for the next test


def queued_tinker_runs(served) -> list[dict]:
    return sorted((r for r in served.client.get("/api/v1/runs").json() if r["host"] == "tinker"
                   and r["status"] == "queued"), key=lambda r: r["id"])


def status_of(served, run_id: int) -> str:
    return served.client.get(f"/api/v1/runs/{run_id}").json()["status"]


def test_a_training_client_made_while_a_daemon_run_holds_the_slot_waits_queued_then_trains(one_slot):
    busy = one_slot.create(LONG, name="busy")
    wait_until(lambda: status_of(one_slot, busy["id"]) == "running", timeout=30)
    service, leaving = (tinker.ServiceClient(base_url=f"{one_slot.base}/tinker", api_key=Auth(one_slot.token).tinker)
                        for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        creating = pool.submit(lambda: service.create_lora_training_client(base_model="tiny-dense", rank=4).result())
        waiting = wait_until(lambda: queued_tinker_runs(one_slot), timeout=30)[0]
        held = f"1 slot (concurrency 1) held by run #{busy['id']} 'busy'"
        assert note_of(one_slot, waiting["id"]) == f"1st in line; {held}"
        # a second client waits behind it; its session ends before its turn: it leaves the line, having held nothing
        given_up = pool.submit(lambda: leaving.create_lora_training_client(base_model="tiny-dense", rank=4).result())
        behind = wait_until(lambda: queued_tinker_runs(one_slot)[1:], timeout=30)[0]
        assert note_of(one_slot, behind["id"]) == f"2nd in line; {held}"
        leaving.close("success").result()
        assert status_of(one_slot, behind["id"]) == "stopped"
        with pytest.raises(Exception, match="has ended"):
            given_up.result(timeout=60)
        assert not creating.done()  # the SDK polls its create future meanwhile
        assert one_slot.client.post(f"/api/v1/runs/{busy['id']}/stop").status_code == 202
        trainer = creating.result(timeout=120)
    assert one_slot.wait(busy["id"])["status"] == "stopped"
    assert run_of(one_slot, trainer.model_id)["id"] == waiting["id"]
    trainer.forward_backward([datum("abc")], "cross_entropy")
    assert trainer.optim_step(types.AdamParams()).result().metrics["loss"] > 0
    assert run_of(one_slot, trainer.model_id)["status"] == "running"
    service.close("success").result()
