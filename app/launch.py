"""The launch form (/runs/new): a run's config from the form's fields and its advanced JSON, errors shown inline."""
import difflib
import json
from typing import Annotated

from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import BaseModel, ValidationError, create_model

from daemon.records import RunNotFound
from molt_engine.config import PRESETS, RunConfig
from molt_engine.envs import ENVS, load_user_envs
from molt_engine.serving.agents import Agent

from .auth import CSRF_FIELD
from .pages import check_csrf, guarded, render
from .schemas import RunBody

router = APIRouter(include_in_schema=False)

# The launch form's fields: (form name, path in the config, type, label). The rest goes in "advanced JSON".
FORM_FIELDS = [
    ("steps", ("loop", "steps"), int, "steps"),
    ("groups_per_step", ("loop", "groups_per_step"), int, "groups per step"),
    ("group_size", ("loop", "group_size"), int, "group size"),
    ("max_staleness", ("loop", "max_staleness"), int, "max staleness"),
    ("lr", ("algo", "lr"), float, "learning rate"),
    ("estimator", ("algo", "estimator"), str, "estimator"),
    ("warm_start", ("warm_start", "steps"), int, "warm-start steps"),
    ("eval_every", ("loop", "eval_every"), int, "eval every"),
    ("checkpoint_every", ("checkpoint", "every"), int, "checkpoint every"),
    ("seed", ("seed",), int, "seed"),
]
# The README's recipes, offered as one-click presets that fill the form (/runs/new?recipe=...)
RECIPES = {
    "calculator warm start": {"env": "calculator", "warm_start": {"steps": 100, "lr": 1e-3}},
    "vision (shapes, tiny-vlm)": {"env": "shapes", "model": {"preset": "tiny-vlm"}, "seed": 0,
                                  "loop": {"steps": 800, "eval_every": 25, "eval_episodes": 200},
                                  "algo": {"lr": 1e-4, "kl_coef": 0.1}, "warm_start": {"steps": 55, "lr": 3e-4}},
    "dataset (GSM8K-format)": {"env": "dataset", "model": {"preset": "tiny-chat"},
                               "env_args": {"path": "train.jsonl", "eval_path": "test.jsonl", "reward": "gsm8k",
                                            "max_tokens": 24},
                               "loop": {"groups_per_step": 8, "group_size": 8, "eval_episodes": 100},
                               "warm_start": {"steps": 200, "lr": 1e-3}, "algo": {"lr": 1e-4, "kl_coef": 0.1}},
    # docs/rewards.md's: reasoning-gym's tasks by name (the .[tasks] extra), a reward model, an LLM judge, a teacher
    "reasoning-gym task": {"env": "reasoning_gym", "model": {"preset": "tiny-chat"}, "seed": 0,
                           "env_args": {"task": "leg_counting", "min_animals": 1, "max_animals": 1,
                                        "max_instances": 1, "answer_format": "plain", "max_tokens": 4},
                           "warm_start": {"steps": 100, "lr": 1e-3}, "algo": {"lr": 1e-4, "kl_coef": 0.1},
                           "loop": {"steps": 80, "eval_every": 40, "eval_episodes": 50, "groups_per_step": 8,
                                    "group_size": 8}},
    "reward model": {"env": "max_digit", "rewards": {"env_weight": 0.0, "terms": [
        {"name": "rm", "model": "/models/my-reward-model", "device": "trainer", "normalize": "group"}]}},
    "LLM judge (group)": {"env": "max_digit", "loop": {"max_staleness": 1}, "rewards": {"env_weight": 1.0, "terms": [
        {"name": "judge", "weight": 0.5, "judge": {
            "base_url": "http://127.0.0.1:8000/v1", "model": "Qwen/Qwen3-8B", "api_key_env": "JUDGE_API_KEY",
            "mode": "group", "rubric": "Score how correct the answer is.", "timeout_s": 30.0, "on_error": "zero"}}]}},
    "distillation teacher": {"env": "max_digit", "rewards": {"env_weight": 0.0, "teacher": {
        "path": "runs/teacher/final", "coef": 1.0}}},
}
DATASET_FIELDS = ("path", "eval_path", "reward")  # env_args of the dataset env that the launch form asks for
LORA_FIELDS = {"r": int, "alpha": float, "target_modules": str}  # model.lora; no rank: all weights train
# What the launch form posts, all as the text typed: the handler converts it, so a bad number is an inline error
LaunchForm = create_model("LaunchForm", **{field: (str, "") for field in [
    "env", "preset", "path", "name", "tags", "max_restarts", "advanced", CSRF_FIELD, *(f[0] for f in FORM_FIELDS),
    *(f"dataset_{f}" for f in DATASET_FIELDS), *(f"lora_{f}" for f in LORA_FIELDS)]})


def form_values(config: dict) -> tuple[dict, dict]:
    """Split a config into the form's fields and the rest (shown as advanced JSON, non-defaults only)."""
    rest_config = json.loads(json.dumps(config))
    values = {"env": rest_config.pop("env", ""), "preset": "", "path": ""}
    env_args = rest_config.get("env_args", {})
    if values["env"] == "dataset":
        for field in DATASET_FIELDS:
            values[f"dataset_{field}"] = str(env_args.pop(field, "") or "")
        if not env_args:
            rest_config.pop("env_args", None)
    model = rest_config.pop("model", {}) or {}
    values["preset"], values["path"] = model.get("preset") or "", model.get("path") or ""
    lora = model.get("lora") or {}
    for field in LORA_FIELDS:  # a list of module names shows comma-separated, a regex as it is
        value = lora.get(field, "")
        values[f"lora_{field}"] = ", ".join(value) if isinstance(value, list) else str(value)
    if lora and not values["lora_r"]:
        values["lora_r"] = "8"
    for name, path, _, _ in FORM_FIELDS:
        node = rest_config
        for key in path[:-1]:
            node = node.get(key, {})
        if path[-1] in node:
            values[name] = node.pop(path[-1])
    defaults = RunConfig(env="max_digit").model_dump(mode="json")  # the same for every env; some need env_args
    return values, non_default(rest_config, defaults)


def key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the config schema by its dotted path ("loop.steps"), for "did you mean" on an unknown key."""
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            paths += key_paths(field.annotation, f"{prefix}{name}.")
    return paths


CONFIG_KEYS = key_paths(RunConfig)


def did_you_mean(where: str) -> str:
    """The known key closest to an unknown one: by its whole path, or by its last part (`steps` -> `loop.steps`)."""
    key = where.rsplit(".", 1)[-1]

    def score(path: str) -> tuple[float, float]:
        whole = difflib.SequenceMatcher(None, where, path).ratio()
        return max(whole, difflib.SequenceMatcher(None, key, path.rsplit(".", 1)[-1]).ratio()), whole
    best = max(CONFIG_KEYS, key=score)
    return f"; did you mean `{best}`?" if score(best)[0] >= 0.75 else ""


def non_default(config: dict, defaults: dict) -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            if sub := non_default(value, defaults[key]):
                out[key] = sub
        elif key not in defaults or defaults[key] != value:
            out[key] = value
    return out


def launch_context(values: dict, advanced: str, errors: dict | None = None, name: str = "", tags: str = "",
                   max_restarts: str = "") -> dict:
    load_user_envs()  # the user's env directories (--envs): a file added or fixed since start is offered now
    defaults = RunConfig(env="max_digit").model_dump(mode="json")
    placeholders = {}
    for field, path, _, _ in FORM_FIELDS:
        node = defaults
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        placeholders[field] = "" if node is None else node
    errors = errors or {}
    order = ["name", "tags", "env", "max_restarts", "preset", "path", "lora", *(f[0] for f in FORM_FIELDS), "advanced"]
    return {"values": values, "advanced": advanced, "errors": errors, "envs": sorted(ENVS),
            "first_error": next((field for field in order if field in errors), None),
            "descriptions": {name: ((cls.__doc__ or "").strip().splitlines() or [""])[0] for name, cls in ENVS.items()},
            "recipes": RECIPES,
            "chat_envs": {name: cls.tool_names() for name, cls in ENVS.items() if cls.chat},
            "agents": {name for name, cls in ENVS.items() if issubclass(cls, Agent)},
            "presets": PRESETS, "fields": FORM_FIELDS, "placeholders": placeholders, "name": name,
            "tags": tags, "max_restarts": max_restarts}


@router.get("/runs/new")
@guarded
def launch_page(request: Request, clone: int | None = None, recipe: str | None = None):
    values, advanced, name, tags = {"env": "max_digit", "preset": "tiny-dense", "path": ""}, {}, "", ""
    if recipe is not None:
        if recipe not in RECIPES:
            raise HTTPException(404, f"no recipe {recipe!r}; there are: {', '.join(RECIPES)}")
        values, advanced = form_values(RECIPES[recipe])
        values["preset"] = values["preset"] or "tiny-dense"
    if clone is not None:
        try:
            run = request.app.state.records.get_run(clone)
        except RunNotFound:
            raise HTTPException(404, f"no run {clone}") from None
        values, advanced = form_values(run["config"])
        name, tags = f"{run['name']} (clone)", ", ".join(run["tags"])
    return render(request, "launch.html", **launch_context(values, json.dumps(advanced, indent=2) if advanced else "",
                                                           name=name, tags=tags))


@router.post("/runs/new")
@guarded
def launch(request: Request, form: Annotated[LaunchForm, Form()]):
    check_csrf(request, getattr(form, CSRF_FIELD))
    values = {k: getattr(form, k).strip() for k in ["env", "preset", "path"] + [f[0] for f in FORM_FIELDS]
              + [f"dataset_{f}" for f in DATASET_FIELDS] + [f"lora_{f}" for f in LORA_FIELDS]}
    advanced, name, tags, max_restarts = form.advanced, form.name.strip(), form.tags, form.max_restarts.strip()
    errors: dict[str, list[str]] = {}
    config: dict = {"env": values["env"]}
    if values["env"] == "dataset":  # the dataset env's own inputs; other envs take env_args in the advanced JSON
        config["env_args"] = {f: values[f"dataset_{f}"] for f in DATASET_FIELDS if values[f"dataset_{f}"]}
    if values["path"]:
        config["model"] = {"preset": None, "path": values["path"]}
    elif values["preset"]:
        config["model"] = {"preset": values["preset"]}
    if values["lora_r"]:  # LoRA: a rank turns it on; alpha and the target modules keep their defaults when empty
        lora = config.setdefault("model", {}).setdefault("lora", {})
        for field, kind in LORA_FIELDS.items():
            if raw := values[f"lora_{field}"]:
                try:
                    lora[field] = kind(raw)
                except ValueError:
                    errors.setdefault("lora", []).append(f"LoRA {field}: must be a "
                                                         + ("whole number" if kind is int else "number"))
        if "," in lora.get("target_modules", ""):  # names, comma-separated (one name or a regex: as typed)
            lora["target_modules"] = [m.strip() for m in lora["target_modules"].split(",") if m.strip()]
    for field, path, kind, _ in FORM_FIELDS:
        raw = values[field]
        if raw == "":
            continue  # the default
        try:
            value = kind(raw)
        except ValueError:
            errors.setdefault(field, []).append("must be " + ("a whole number" if kind is int else "a number"))
            continue
        node = config
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    extra: dict = {}  # the advanced JSON's keys: their errors show under it, not under a field
    if advanced.strip():
        try:
            extra = json.loads(advanced)
            if not isinstance(extra, dict):
                raise ValueError("must be a JSON object")
        except ValueError as e:
            errors.setdefault("advanced", []).append(f"not valid JSON: {e}")
            extra = {}
        config = deep_merge(config, extra)
    wanted = {"config": config, "name": name or None, "tags": [t.strip() for t in tags.split(",") if t.strip()]}
    try:
        if max_restarts:
            wanted["max_restarts"] = int(max_restarts)
    except ValueError:
        errors.setdefault("max_restarts", []).append("must be a whole number")
    # Checked even when a field could not be read (it keeps its default here): every error shows in one pass
    # pydantic checks across fields (group_size >= 2 with a group estimator) only once every field is valid: each
    # pass drops the keys that failed, so that those checks' errors show in the same answer
    checked = None
    for _ in range(3):
        try:
            checked = RunBody.model_validate(wanted)
            break
        except ValidationError as e:
            dropped = False
            for err in e.errors():
                loc = err["loc"]
                where = ".".join(map(str, loc[1:] if loc[:1] == ("config",) and len(loc) > 1 else loc))
                msg = err["msg"].removeprefix("Value error, ")
                hint = did_you_mean(where) if err["type"] == "extra_forbidden" and loc[:1] == ("config",) else ""
                if loc == ("config", "env") and isinstance(config.get("env"), str):
                    close = difflib.get_close_matches(config["env"], list(ENVS), n=1, cutoff=0.6)
                    hint = f"; did you mean `{close[0]}`?" if close else ""
                text = f"{msg}{hint}" if where == "config" else f"{where}: {msg}{hint}"
                field = form_field(loc, extra, msg)
                if text not in errors.get(field, []):
                    errors.setdefault(field, []).append(text)
                dropped |= drop(wanted, loc)
            if not dropped:
                break
    run = None if errors else request.app.state.records.queue_run(checked)
    if run is not None:
        target = f"/runs/{run['id']}"
        if request.headers.get("hx-request"):
            return Response(status_code=201, headers={"HX-Redirect": target})
        return RedirectResponse(target, status_code=303)
    context = launch_context(values, advanced, errors, name, tags, max_restarts)
    if request.headers.get("hx-request"):
        # 200 so that htmx swaps the form with its inline errors in (it ignores 4xx bodies by default)
        return render(request, "_launch_form.html", **context)
    return render(request, "launch.html", status_code=422, **context)


def drop(wanted: dict, loc: tuple) -> bool:
    """Remove the key an error is about (its default then applies), to check the rest again; False if none."""
    node = wanted
    for key in loc[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if len(loc) < 2 or not isinstance(node, dict) or loc[-1] not in node:
        return False
    del node[loc[-1]]
    return True


def form_field(loc: tuple, extra: dict, msg: str = "") -> str:
    """Which input of the launch form a RunRequest error belongs to: "advanced" for config keys that the advanced
    JSON set (it overrides the fields) or that have no input of their own; a check across fields goes to the
    first field its message names (e.g. "loop.group_size must be >= 2 ...": group size)."""
    if loc[:1] != ("config",):
        return str(loc[0])
    path = tuple(str(p) for p in loc[1:])
    if not path and "model.lora" in msg:  # the config as a whole: RunBody's rule, LoRA on a trained base
        return "lora"
    if not path:
        named = [(field, p) for field, p, _, _ in FORM_FIELDS if ".".join(p) in msg]
        if not named:
            return "advanced"
        path = named[0][1]  # as that key's own error would go: under advanced if the JSON set it
    node = extra
    for key in path:
        if not isinstance(node, dict) or key not in node:
            break
        node = node[key]
    else:
        return "advanced"
    if path[:1] == ("env",) or path[:1] == ("env_args",):
        return "env"
    if path[:1] == ("model",):
        return {"path": "path", "lora": "lora"}.get(path[1] if len(path) > 1 else "", "preset")
    for field, field_path, _, _ in FORM_FIELDS:
        if path[:len(field_path)] == field_path:
            return field
    return "advanced"


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


