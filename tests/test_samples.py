"""Recorded samples: the engine's records (per-token numbers, the chosen groups), the daemon's table (idempotent
writes, retention) and the REST API over them (filters, pagination, JSONL export)."""
import json

import httpx
import pytest
import torch

from app_support import web_thread
from daemon.records import Records
from daemon.sink import DbSink, write_records
from molt_engine import train
from molt_engine.episode import Episode, collate, uncollated
from molt_engine.loop import NullSink
from molt_engine.config import ModelConfig
from molt_engine.models import load_policy
from molt_engine.samples import record, training_samples

# guess_number: 5 turns, env feedback between them; max_staleness 2 makes episodes span policy versions
CONFIG = {"env": "guess_number", "seed": 3, "warm_start": {"steps": 10},
          "loop": {"steps": 8, "groups_per_step": 3, "group_size": 3, "max_staleness": 2, "eval_every": 4,
                   "eval_episodes": 3},
          "record": {"samples_per_step": 2, "eval_samples": 2, "keep_steps": 6}}


def test_training_samples_pick_groups_with_signal_and_put_trainer_logprobs_on_their_tokens():
    _, tokenizer = load_policy(ModelConfig(), 0)

    def episode(group, reward, prompt, actions):
        e = Episode(seed=group, group=group, reward=reward)
        e.extend(prompt)
        e.extend(actions, action=True, logprobs=[-0.5] * len(actions), versions=[3] * len(actions),
                 entropies=[0.25] * len(actions))
        return e
    a, b = episode(0, 1.0, [5, 6, 7], [8]), episode(0, 1.0, [5, 6, 7], [9])          # no signal: equal rewards
    c, d = episode(1, 0.0, [5, 6], [9, 9, 9]), episode(1, 1.0, [5, 6], [8])
    groups, keep = [[a, b], [c, d]], [1, 2, 3]        # b, c, d went through the training forward, a did not
    width = collate([b, c, d], pad_id=0)["prompt_width"]
    logp = torch.arange(15, dtype=torch.float32).view(3, 5)  # row r, column t: token t+1 of row r (left-padded)
    trainer = dict(zip(keep, uncollated(logp, range(3), [b, c, d], width)))
    out = training_samples(groups, [0.0, 0.0, -0.5, 0.5], trainer, n=1, processor=tokenizer, version=4)
    assert [r["group"] for r in out] == [1, 1] and [r["advantage"] for r in out] == [-0.5, 0.5]
    # c's prompt is one token shorter than b's, so its row starts one column later
    assert out[0]["tokens"]["trainer_logprob"] == [None, None, 7.0, 8.0, 9.0]
    assert out[1]["tokens"]["trainer_logprob"] == [None, None, 12.0]
    assert out[0]["tokens"]["logprob"] == [None, None, -0.5, -0.5, -0.5]
    assert out[0]["tokens"]["entropy"] == [None, None, 0.25, 0.25, 0.25]
    assert out[0]["tokens"]["version"] == [-1, -1, 3, 3, 3] and out[0]["version"] == 4
    assert out[0]["tokens"]["action"] == [False, False, True, True, True]
    assert out[0]["tokens"]["text"] == [tokenizer.decode([t]) for t in [5, 6, 9, 9, 9]]
    assert out[0]["prompt"] == tokenizer.decode([5, 6]) and out[0]["text"] == tokenizer.decode([5, 6, 9, 9, 9])
    # both groups, in batch order; a was not in the forward: no trainer log-probs
    out = training_samples(groups, [0.0, 0.0, -0.5, 0.5], trainer, 2, tokenizer, 4)
    assert [r["group"] for r in out] == [0, 0, 1, 1]
    assert out[0]["tokens"]["trainer_logprob"] == [None] * 4
    assert out[1]["tokens"]["trainer_logprob"] == [None, None, None, 2.0]
    # an eval record: no advantage, no trainer log-probs
    assert record(c, tokenizer, 4)["advantage"] is None
    assert record(c, tokenizer, 4)["tokens"]["trainer_logprob"] == [None] * 5


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A run trained in this process into a real database through the daemon's sink; the records it wrote."""
    home = tmp_path_factory.mktemp("home")
    records = Records(home)
    run = records.create_run(CONFIG)
    spool = tmp_path_factory.mktemp("spool")
    sink = DbSink(records.engine, run["id"], 0, spool_dir=spool, keep_samples=CONFIG["record"]["keep_steps"])
    sent = []

    class Both(NullSink):  # the daemon's sink, and a copy of what it was given
        def metrics(self, step, values):
            sink.metrics(step, values)

        def samples(self, step, kind, records):
            sink.samples(step, kind, records)
            sent.append((step, kind, records))
    try:
        train(CONFIG, Both())
    finally:
        sink.close()
    return home, records, run["id"], sent


def test_every_step_and_eval_records_its_samples_and_old_steps_are_dropped(recorded):
    _, records, run_id, sent = recorded
    train_steps = sorted(step for step, kind, _ in sent if kind == "train")
    assert train_steps == list(range(8))
    assert all(len(recs) == 2 * 3 for _, kind, recs in sent if kind == "train")   # 2 groups of 3
    assert sorted(step for step, kind, _ in sent if kind == "eval") == [0, 4, 8]  # the final eval at version 8
    assert all(len(recs) == 2 for _, kind, recs in sent if kind == "eval")
    # retention: the newest 6 steps (3..8) remain; every kept record is in the table exactly once
    steps = records.sample_steps(run_id)
    assert min(s["step"] for s in steps) == 8 - 6 + 1
    kept = [(step, kind, recs) for step, kind, recs in sent if step >= 3]
    assert sum(s["count"] for s in steps) == sum(len(recs) for _, _, recs in kept)
    rows = records.samples(run_id, limit=500)
    by_key = {(r["step"], r["kind"], r["position"]): r for r in rows}
    for step, kind, recs in kept:
        for i, rec in enumerate(recs):
            row = by_key[(step, kind, i)]
            assert row["tokens"] == rec["tokens"] and row["prompt"] == rec["prompt"] and row["seed"] == rec["seed"]
    # per token: behaviour numbers on actions only; the trainer's on the trained episodes' actions
    train_rows = [r for r in rows if r["kind"] == "train"]
    for r in train_rows:
        t = r["tokens"]
        assert all((lp is not None) == a for lp, a in zip(t["logprob"], t["action"]))
        assert all((h is not None) == a for h, a in zip(t["entropy"], t["action"]))
        assert all(v <= r["version"] for v, a in zip(t["version"], t["action"]) if a)
    assert any(tl is not None for r in train_rows for tl in r["tokens"]["trainer_logprob"])
    assert all(r["advantage"] is None and set(r["tokens"]["trainer_logprob"]) == {None}
               for r in rows if r["kind"] == "eval")


def test_writing_the_same_samples_again_changes_nothing(recorded):
    _, records, run_id, sent = recorded
    before = records.samples(run_id, limit=500)
    step, kind, recs = sent[-1]
    with records.engine.begin() as conn:  # a replayed spool or a resumed attempt writes the same step again
        write_records(conn, run_id, 0, [{"t": "samples", "time": 1.0, "step": step, "kind": kind, "records": recs,
                                         "keep": None}])
    after = records.samples(run_id, limit=500)
    assert [(r["id"], r["step"], r["kind"], r["position"]) for r in after] == \
        [(r["id"], r["step"], r["kind"], r["position"]) for r in before]


def test_rest_filters_pages_and_exports_the_samples(recorded):
    home, records, run_id, sent = recorded
    step, kind, recs = next((step, kind, recs) for step, kind, recs in sent if kind == "eval" and step == 4)
    with records.engine.begin() as conn:  # an eval of step 4 recorded after step 8's episodes (evals run beside steps)
        write_records(conn, run_id, 0, [{"t": "samples", "time": 1.0, "step": step, "kind": kind,
                                         "records": [*recs, recs[0]], "keep": None}])
    rows = records.samples(run_id, limit=500)
    assert rows[-1]["step"] == 4 and rows[-1]["position"] == len(recs)  # recorded last
    with web_thread(home, "samples-token") as (base, _app), \
            httpx.Client(base_url=base, headers={"Authorization": "Bearer samples-token"}) as client:
        url = f"/api/v1/runs/{run_id}/samples"
        step = rows[-1]["step"]
        got = client.get(url, params={"step": step}).json()["samples"]
        assert got and {r["step"] for r in got} == {step}
        assert len(got) == sum(r["step"] == step for r in rows)
        threshold = sorted(r["reward"] for r in rows)[len(rows) // 2]
        got = client.get(url, params={"min_reward": threshold, "limit": 500}).json()["samples"]
        assert [r["id"] for r in got] == [r["id"] for r in rows if r["reward"] >= threshold]
        for passed in (True, False):
            got = client.get(url, params={"passed": passed, "limit": 500}).json()["samples"]
            assert [r["id"] for r in got] == [r["id"] for r in rows if r["success"] == passed]
        for errors in (True, False):  # guess_number has no tools: every episode is without tool errors
            got = client.get(url, params={"tool_errors": errors, "limit": 500}).json()["samples"]
            assert [r["id"] for r in got] == ([] if errors else [r["id"] for r in rows])
        word = "higher"  # the env's feedback
        got = client.get(url, params={"q": word, "limit": 500}).json()["samples"]
        assert [r["id"] for r in got] == [r["id"] for r in rows if word in r["text"]] and got
        evals = [r for r in rows if r["kind"] == "eval"]
        got = client.get(url, params={"prompt": evals[0]["prompt"], "kind": "eval"}).json()["samples"]
        assert len({r["step"] for r in got}) >= 2  # the same held-out prompt at every eval
        # pages: the cursor walks through everything once, in order (oldest or newest first); each page has the total
        for order in ("oldest", "newest"):
            seen, cursor = [], None
            while True:
                page = client.get(url, params={"limit": 7, "order": order,
                                               **({"cursor": cursor} if cursor else {})}).json()
                seen += [r["id"] for r in page["samples"]]
                assert page["total"] == len(rows)
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            # newest first is the newest step first, then the newest recorded: the late eval among step 4's
            newest = sorted(rows, key=lambda r: (r["step"], r["id"]), reverse=True)
            assert seen == [r["id"] for r in (rows if order == "oldest" else newest)]
        assert client.get(url, params={"kind": "eval"}).json()["total"] == len(evals)
        export = client.get(f"/api/v1/runs/{run_id}/samples.jsonl", params={"kind": "train"})
        assert export.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in export.text.splitlines()]
        assert [r["id"] for r in lines] == [r["id"] for r in rows if r["kind"] == "train"]
        assert lines[0]["tokens"]["text"] == rows[[r["kind"] for r in rows].index("train")]["tokens"]["text"]
        # bad input names what is wrong
        bad = client.get(url, params={"min_reward": "lots"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "min_reward"]
        bad = client.get(url, params={"kind": "both"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "kind"]
        assert client.get("/api/v1/runs/999/samples").status_code == 404


def test_images_come_back_as_png_thumbnails_of_what_the_policy_saw():
    import base64
    import io

    import numpy as np
    from PIL import Image

    from molt_envs.builtin import Shapes
    _, processor = load_policy(ModelConfig(preset="tiny-vlm"), 0)
    image = Shapes.render("red", "square", [(2, 2), (18, 18)])
    inputs = processor(text="<image>colour?", images=[image], add_special_tokens=False, return_tensors="pt")
    e = Episode(seed=0, group=0, images=list(inputs["pixel_values"]))
    e.extend(inputs["input_ids"][0].tolist())
    [url] = record(e, processor, 0)["images"]
    assert url.startswith("data:image/png;base64,")
    thumb = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    original = image.resize(thumb.size).convert("RGB")
    worst = np.abs(np.asarray(thumb, dtype=int) - np.asarray(original, dtype=int)).max()
    assert worst <= 3  # normalization undone: the colours of the image the policy saw
