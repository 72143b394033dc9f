"""molt_envs: the built-in environments and agents, a package of envs like any a user installs (the engine loads it
by name, molt_engine/envs.py), written against the engine's public Env and Agent contracts."""
from . import agents, builtin, reasoning_tasks  # noqa: F401  register them
