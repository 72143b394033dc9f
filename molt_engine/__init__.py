"""molt_engine: a compact async RL engine for language-model agents (plain PyTorch + transformers, no server)."""
from .config import RunConfig, config_errors
from .envs import ENVS, Env, Observation, Result, load_agents_dir, load_env_packages, register
from .serving.agents import Agent, AgentContext
from .sink import NullSink, Sink
from . import data  # noqa: E402,F401  registers the dataset env

__all__ = ["ENVS", "Agent", "AgentContext", "Env", "EnvFailure", "NullSink", "Observation", "Result", "RunConfig",
           "Sink", "config_errors", "load_agents_dir", "register", "train"]


def __getattr__(name):
    # Training needs torch and transformers; validating a config or listing envs does not (the web process).
    if name in ("EnvFailure", "train"):
        from . import loop
        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


load_env_packages()  # last: the packages import the engine's contracts from this one
