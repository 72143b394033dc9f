"""Tests for molt_engine.envs: built-in envs, demonstrations, tool latency and the env registry."""
import asyncio
import re
import subprocess
import sys

import numpy as np
import pytest

from molt_engine.envs import ENVS, Env, Observation, Result, load_agents_dir, make_env, register

BUILTINS = ["max_digit", "calculator", "guess_number"]
SEEDS = range(20)


async def replay(env: Env, seed: int, actions: list[str]) -> tuple[Observation, list[Result]]:
    observation = await env.reset(seed)
    return observation, [await env.step(action) for action in actions]


@pytest.fixture
def clean_registry():
    """Envs registered by a test must not leak into the others."""
    saved_envs, saved_modules = dict(ENVS), set(sys.modules)
    yield
    ENVS.clear()
    ENVS.update(saved_envs)
    for name in set(sys.modules) - saved_modules:
        del sys.modules[name]


@pytest.mark.parametrize("name", BUILTINS)
def test_demonstration_solves_every_seed(name):
    for seed in SEEDS:
        env = make_env(name)
        actions = env.demonstration(seed)
        assert 1 <= len(actions) <= env.max_turns
        observation, results = asyncio.run(replay(make_env(name), seed, actions))
        assert len(observation.text) <= 40
        assert all(not r.terminated for r in results[:-1])
        assert results[-1].terminated and results[-1].reward == env.success_reward
        assert all(len(action) <= env.max_tokens for action in actions)


@pytest.mark.parametrize("name", BUILTINS)
def test_task_is_deterministic_in_seed(name):
    env = make_env(name)
    prompts = [asyncio.run(env.reset(seed)).text for seed in SEEDS]
    assert prompts == [asyncio.run(make_env(name).reset(seed)).text for seed in SEEDS]
    # The demonstrations pin down the hidden task, including guess_number's fixed-prompt secret.
    assert len({tuple(env.demonstration(seed)) for seed in SEEDS}) > 5


@pytest.mark.parametrize("name", ["max_digit", "calculator"])
def test_prompt_differs_across_seeds(name):
    prompts = {asyncio.run(make_env(name).reset(seed)).text for seed in SEEDS}
    assert len(prompts) >= 15


@pytest.mark.parametrize("name", BUILTINS)
def test_wrong_final_answer_gets_zero(name):
    for seed in SEEDS:
        env = make_env(name)
        right = env.demonstration(seed)[-1]
        wrong = str(int(right) + 1)
        _, results = asyncio.run(replay(env, seed, [wrong]))
        assert results[-1].reward == 0.0


def test_max_digit_format_and_leniency():
    env = make_env("max_digit")
    prompt = asyncio.run(env.reset(3)).text
    digits = prompt.removesuffix("=").split(" ")
    assert 3 <= len(digits) <= 5 and all(len(d) == 1 and d.isdigit() for d in digits)
    assert asyncio.run(env.step(f" {max(digits)}\n")).reward == 1.0
    asyncio.run(env.reset(3))
    assert asyncio.run(env.step(f"{max(digits)}0")).reward == 0.0


def test_calculator_tool_call_returns_exact_result():
    env = make_env("calculator")
    asyncio.run(env.reset(0))
    result = asyncio.run(env.step("calc 347*29"))
    assert result.observation == "=10063\n"
    assert result.info["tool_call"] is True and result.reward == 0.0 and not result.terminated
    assert asyncio.run(env.step("calc 10-99")).observation == "=-89\n"


@pytest.mark.parametrize("action", ["calc 3**2", "calc __import__('os')", "calc 1/2", "calc"])
def test_calculator_malformed_tool_call_is_feedback(action):
    env = make_env("calculator")
    asyncio.run(env.reset(0))
    result = asyncio.run(env.step(action))
    assert result.observation == "err\n" and result.info["tool_call"] is True and not result.terminated


def test_calculator_final_answer_parsing():
    env = make_env("calculator")
    answer = env.demonstration(5)[-1]
    for action, reward in [(f" {answer}\n", 1.0), (f"{answer}x", 0.0), ("", 0.0), ("1e3", 0.0)]:
        asyncio.run(env.reset(5))
        result = asyncio.run(env.step(action))
        assert (result.reward, result.terminated) == (reward, True)


async def timed_tool_call(env: Env) -> float:
    loop = asyncio.get_running_loop()
    await env.reset(0)
    start = loop.time()
    await env.step("calc 1+1")
    return loop.time() - start


# asyncio may fire a timer up to its clock resolution early; 1 µs covers that and nothing else.
EARLY = 1e-6


def test_calculator_tool_latency():
    assert asyncio.run(timed_tool_call(make_env("calculator", {"tool_latency_ms": 30}))) >= 0.030 - EARLY


def test_calculator_tail_latency():
    env = make_env("calculator", {"tool_latency_ms": 0, "tail_prob": 1.0, "tail_ms": 60})
    assert asyncio.run(timed_tool_call(env)) >= 0.060 - EARLY


def test_max_digit_largest_digit_is_spread_over_all_values():
    # Uniform maxima: with i.i.d. digits "always answer 9" would score about half.
    tops = [max(asyncio.run(make_env("max_digit").reset(seed)).text.removesuffix("=").split(" ")) for seed in range(500)]
    assert {str(d) for d in range(10)} == set(tops)
    assert tops.count("9") < 500 * 0.2


def test_calculator_operand_ranges():
    env = make_env("calculator", {"max_operand": 20, "max_second": 3})
    for seed in range(50):
        a, op, b = re.fullmatch(r"Q (\d+)([-+*])(\d+)\n", asyncio.run(env.reset(seed)).text).groups()
        assert 10 <= int(a) <= 20 and 2 <= int(b) <= 3


def test_calculator_rejects_bad_latency_knobs():
    for args in [{"tail_prob": 1.5}, {"tool_latency_ms": -1}, {"max_operand": 5}, {"max_second": 1}]:
        with pytest.raises(ValueError):
            make_env("calculator", args)


def test_guess_number_feedback():
    env = make_env("guess_number")
    prompt = asyncio.run(env.reset(0)).text
    assert prompt == "guess 1-16\n"
    secret = int(env.demonstration(0)[-1])
    results = [asyncio.run(env.step(a)) for a in [str(secret - 1), str(secret + 1), "eight", f" {secret} "]]
    assert [r.observation for r in results[:3]] == ["higher\n", "lower\n", "?\n"]
    assert not any(r.terminated or r.reward for r in results[:3])
    assert results[3].terminated and results[3].reward == 1.0


@pytest.mark.parametrize("high, turns", [(16, 5), (100, 7)])
def test_guess_number_binary_search_fits_turns(high, turns):
    env = make_env("guess_number", {"high": high, "turns": turns})
    assert env.max_turns == turns
    seen = set()
    for seed in range(2000):
        secret = int(env.demonstration(seed)[-1])
        if secret not in seen:
            seen.add(secret)
            assert len(env.demonstration(seed)) <= turns
    assert seen == set(range(1, high + 1))


def test_make_env_unknown_name_lists_known():
    with pytest.raises(ValueError) as error:
        make_env("no_such_env")
    assert all(name in str(error.value) for name in BUILTINS)


@pytest.mark.parametrize("name, args", [("max_digit", {"bogus": 1}), ("calculator", {"tool_latency": 5})])
def test_make_env_unknown_kwarg_is_named(name, args):
    with pytest.raises(TypeError, match=next(iter(args))):
        make_env(name, args)


def test_duplicate_register_rejected(clean_registry):
    @register
    class Once(Env):
        name = "once_env"

    assert ENVS["once_env"] is Once
    with pytest.raises(ValueError, match="once_env"):
        register(type("Twice", (Env,), {"name": "once_env"}))
    assert ENVS["once_env"] is Once


def test_load_agents_dir_registers_envs(tmp_path, clean_registry):
    (tmp_path / "my_agent.py").write_text(
        "from molt_engine.envs import Env, Observation, Result, register\n"
        "@register\n"
        "class Echo(Env):\n"
        "    name = 'echo_env'\n"
        "    async def reset(self, seed): return Observation('say hi\\n')\n"
        "    async def step(self, action): return Result(float(action == 'hi'), terminated=True)\n"
        "    def demonstration(self, seed): return ['hi']\n"
    )
    assert "echo_env" not in ENVS
    assert load_agents_dir(tmp_path) == ["echo_env"]
    assert sys.modules["molt_agents.my_agent"].Echo is ENVS["echo_env"]
    _, results = asyncio.run(replay(make_env("echo_env"), 0, ["hi"]))
    assert results[0].reward == 1.0
    # Loading the same directory again (say, for the next run) is a no-op, not a duplicate error.
    assert load_agents_dir(tmp_path) == []


def test_env_names_are_never_imported(tmp_path, monkeypatch, clean_registry):
    marker = tmp_path / "imported"
    (tmp_path / "sneaky.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ["sneaky", "sneaky:Env", "sneaky.Env", "molt_engine.envs:MaxDigit"]:
        with pytest.raises(ValueError):
            make_env(name)
    assert not marker.exists() and "sneaky" not in sys.modules


# ---- shapes: images ---------------------------------------------------------------------------------------------------

def drawn_quadrants(image) -> tuple[set, int]:
    """The colours drawn (besides the black background) and how many 16x16 quadrants hold a shape."""
    pixels = image.load()
    colours = {pixels[x, y] for x in range(32) for y in range(32)} - {(0, 0, 0)}
    filled = sum(any(pixels[x, y] != (0, 0, 0) for x in range(qx, qx + 16) for y in range(qy, qy + 16))
                 for qx in (0, 16) for qy in (0, 16))
    return colours, filled


def test_shapes_renders_what_the_answers_say():
    from molt_envs.builtin import COLOURS, SHAPES
    for seed in range(40):
        env = make_env("shapes")
        observation = asyncio.run(env.reset(seed))
        assert re.fullmatch(r"<image>(color|shape|count)\?\n", observation.text)
        (image,) = observation.images
        assert image.size == (32, 32) and image.mode == "RGB"
        colour, shape, corners, question = env._scenes(seed)[0]
        assert colour in COLOURS and shape in SHAPES and 1 <= len(corners) <= 4
        assert observation.text == f"<image>{question}?\n"
        colours, filled = drawn_quadrants(image)
        assert COLOURS[colour] in colours and filled == len(corners)
    # Each shape leaves its own footprint: a square fills its box, a circle less, a triangle about half.
    areas = {shape: int(np.asarray(env.render("red", shape, [(2, 2)])).any(-1).sum()) for shape in SHAPES}
    assert areas["square"] > areas["circle"] > areas["triangle"] > 0


def test_shapes_grading_and_demonstration():
    answers = set()
    for seed in range(40):
        env = make_env("shapes")
        (right,) = env.demonstration(seed)
        answers.add(right)
        _, results = asyncio.run(replay(env, seed, [f" {right.upper()}\n"]))
        assert results[0].terminated and results[0].reward == 1.0 == env.success_reward
        for wrong in ["", "4" if right != "4" else "red", right + "s"]:
            _, results = asyncio.run(replay(make_env("shapes"), seed, [wrong]))
            assert results[0].terminated and results[0].reward == 0.0
        assert len(right) + 1 <= env.max_tokens  # + eos
    assert {"1", "4", "circle", "triangle", "red", "white"} <= answers


def test_shapes_multi_turn_feedback_brings_a_new_image():
    env = make_env("shapes", {"turns": 2})
    assert env.max_turns == 2
    for seed in range(20):
        first, second = env.demonstration(seed)
        observation, results = asyncio.run(replay(env, seed, [first, second]))
        assert not results[0].terminated and results[0].reward == 0.5
        assert re.fullmatch(r"yes\n<image>(color|shape|count)\?\n", results[0].observation)
        (second_image,) = results[0].images
        scenes = env._scenes(seed)
        assert second_image.tobytes() == env.render(*scenes[1][:3]).tobytes() != env.render(*scenes[0][:3]).tobytes()
        assert results[1].terminated and results[1].reward == 0.5  # both turns right: 1.0 = success_reward
        _, results = asyncio.run(replay(make_env("shapes", {"turns": 2}), seed, ["nope", second]))
        assert results[0].observation.startswith("no\n") and sum(r.reward for r in results) == 0.5
    with pytest.raises(ValueError):
        make_env("shapes", {"turns": 0})


def test_validating_a_config_and_listing_envs_import_no_torch():
    """The web process validates configs and lists envs and presets: none of that may load torch or transformers."""
    code = ("import sys\n"
            "from molt_engine import ENVS, RunConfig, config_errors\n"
            "from molt_engine.config import PRESETS\n"
            "RunConfig.model_validate({'env': 'calculator', 'model': {'preset': 'tiny-moe'}})\n"
            "assert sorted(ENVS) and PRESETS\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    from molt_engine.config import PRESETS
    from molt_engine.models import PRESETS as BUILT
    assert PRESETS == tuple(BUILT)  # the names the config accepts are the presets models builds

