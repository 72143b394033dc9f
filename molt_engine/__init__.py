"""molt_engine: a compact async RL engine for language-model agents (plain PyTorch + transformers, no server)."""
from .config import RunConfig, config_errors
from .envs import ENVS, Env, Observation, Result, load_agents_dir, register
from .loop import EnvFailure, NullSink, Sink, train

__all__ = ["ENVS", "Env", "EnvFailure", "NullSink", "Observation", "Result", "RunConfig", "Sink", "config_errors",
           "load_agents_dir", "register", "train"]
