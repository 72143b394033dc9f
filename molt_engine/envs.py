"""Environments the agents train on: the Env contract, the registry, and loading envs and agents from installed
packages (the built-ins are one: molt_envs) and from users' directories."""
import importlib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

# The seeds an env's reset gets: training prompts are (run seed << 32) + cursor, far below these.
DEMO_SEEDS = 1 << 61        # warm-start demonstrations
EVAL_SEEDS = 1 << 62        # held-out evals


@dataclass
class Observation:
    text: str = ""
    images: list = field(default_factory=list)  # PIL images, one per "<image>" placeholder in the text, in order
    messages: list = field(default_factory=list)  # chat envs: OpenAI-style messages, rendered by the chat template


@dataclass
class Result:
    reward: float
    observation: str = ""  # feedback appended to the context as non-trained tokens ("" = none); chat: a user message
    terminated: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)  # "tool_call" (tool_call_rate), "tool_error", "metrics": {name: x}
    images: list = field(default_factory=list)  # as Observation.images, for the feedback text


class Env:
    """Subclass, set the class attributes, implement reset/step/demonstration."""

    name: str = ""
    max_turns: int = 1  # policy turns per episode; the engine truncates after this many
    max_tokens: int = 8  # max generated tokens per policy turn (the turn also ends at eos)
    success_reward: float = 1.0  # an episode whose reward reaches this counts as passed (pass_rate)
    # Chat-native envs speak messages (Observation.messages) through the policy's chat template; step() gets the
    # content of an assistant turn without tool calls. Tool calls run the `tools` (typed Python functions, sync or
    # async, documented Google-style: their schemas go to the template) and come back as `tool` messages.
    chat: bool = False
    tools: tuple = ()
    tool_timeout: float = 30.0  # seconds per tool call
    notes: tuple = ()  # lines reported as an `env` event when a run starts

    def __init__(self, **kwargs):
        # Env args come from run configs, so a typo must fail loudly instead of being ignored.
        if kwargs:
            raise TypeError(f"env {self.name!r} got unknown args: {', '.join(sorted(kwargs))}")

    async def reset(self, seed: int) -> Observation:
        raise NotImplementedError

    async def step(self, action: str) -> Result:
        raise NotImplementedError

    def demonstration(self, seed: int) -> list[str]:
        """The actions of a good episode; chat envs: its assistant messages (content, or tool_calls)."""
        raise NotImplementedError

    @classmethod
    def tool_names(cls) -> list[str]:
        """Its tools' names: of Python functions (envs) or of OpenAI tool schemas (agents)."""
        return [t["function"]["name"] if isinstance(t, dict) else t.__name__ for t in cls.tools]


ENVS: dict[str, type[Env]] = {}


def register(cls: type[Env]) -> type[Env]:
    """Class decorator: make an env available to configs under cls.name."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in ENVS:
        raise ValueError(f"env {cls.name!r} is already registered (by {ENVS[cls.name].__name__})")
    ENVS[cls.name] = cls
    return cls


def make_env(name: str, args: dict | None = None) -> Env:
    # Names are only looked up, never imported: configs can arrive over the network.
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known envs: {', '.join(sorted(ENVS))}")
    return ENVS[name](**(args or {}))


class EnvLoadError(ImportError):
    """Env files that failed to import: `errors` maps each file to `file:line: Type: message`."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(errors.values()))
        self.errors = errors


def where(e: BaseException, file: str) -> str:
    """`file:line: Type: message`, at the deepest line of `file` the error came through (a user's own code)."""
    line = e.lineno if isinstance(e, SyntaxError) and e.filename == file else next(
        (f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == file), "?")
    return f"{file}:{line}: {type(e).__name__}: {e}"


def load_agents_dir(path) -> list[str]:
    """Import every *.py file of a local directory; return the env names they registered. A file that fails does
    not stop the others: they all load first, then one EnvLoadError names each failed file and line."""
    before, errors = set(ENVS), {}
    for file in sorted(Path(path).resolve().glob("*.py")):
        module_name = f"molt_agents.{file.stem}"
        # A daemon may load the same directory for every run; re-running it would re-register.
        if getattr(sys.modules.get(module_name), "__file__", None) == str(file):
            continue
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        # Registered before exec so that dataclasses and pickling inside the file can find it.
        sys.modules[module_name] = module
        registered = set(ENVS)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            for name in set(ENVS) - registered:  # half-run: the next try registers them again
                del ENVS[name]
            errors[str(file)] = where(e, str(file))
    if errors:
        raise EnvLoadError(errors)
    return [name for name in ENVS if name not in before]


def resolve(name: str, builtin: dict, what: str):
    """A function by name: a built-in one, or `module:function` of a user's env directory (its file module.py)."""
    if name in builtin:
        return builtin[name]
    module, _, function = name.partition(":")
    if function and f"molt_agents.{module}" not in sys.modules:
        load_user_envs()
    found = getattr(sys.modules.get(f"molt_agents.{module}"), function, None) if function else None
    if not callable(found):
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(builtin)}, or module:function of a file "
                         f"in an env directory (--envs)")
    return found


BUILTIN_PACKAGES = ("molt_envs",)  # loaded by name as any env package, as pytest loads its own plugins


def load_env_packages():
    """Import the env packages: the built-ins (molt_envs) and each installed package that names itself in the entry
    point group `molt.envs`. The engine never imports them: they import its contracts and register. One that fails to
    import is said on stderr and left out; the others load."""
    for name in dict.fromkeys([*BUILTIN_PACKAGES, *(p.module for p in entry_points(group="molt.envs"))]):
        try:
            importlib.import_module(name)
        except Exception as e:
            print(f"molt: the env package {name} did not load: {type(e).__name__}: {e}", file=sys.stderr)


LOAD_ERRORS: dict[str, str] = {}  # file -> why it failed, as of the latest load_user_envs()


def load_user_envs(dirs: list | None = None) -> dict[str, str]:
    """Load the env directories named in $MOLT_ENVS (os.pathsep-separated), as every molt process does: files that
    failed before are tried again. `dirs` (the CLI's --envs) replace $MOLT_ENVS first, for the processes this one
    starts too. Returns (and keeps in LOAD_ERRORS) the failures."""
    if dirs:
        os.environ["MOLT_ENVS"] = os.pathsep.join(str(Path(d).resolve()) for d in dirs)
    LOAD_ERRORS.clear()
    for directory in filter(None, os.environ.get("MOLT_ENVS", "").split(os.pathsep)):
        if not Path(directory).is_dir():
            LOAD_ERRORS[directory] = f"{directory}: not a directory"
            continue
        try:
            load_agents_dir(directory)
        except EnvLoadError as e:
            LOAD_ERRORS.update(e.errors)
    return LOAD_ERRORS
