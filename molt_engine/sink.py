"""Where the engine reports: the Sink protocol (the CLI's sink prints, the daemon's writes the database) and a sink
that drops everything."""
from typing import Protocol


class Sink(Protocol):
    """Where the engine reports. The CLI prints; the daemon writes the database."""
    def metrics(self, step: int, values: dict[str, float]) -> None: ...
    def alert(self, kind: str, message: str, **data) -> None: ...
    def event(self, kind: str, message: str, **data) -> None: ...
    def checkpoint(self, step: int, path: str, **info) -> None: ...
    def samples(self, step: int, kind: str, records: list[dict]) -> None: ...  # optional; kind "train" or "eval"
    def heartbeat(self) -> None: ...  # optional; about every second while the event loop is alive


class NullSink:
    def metrics(self, step, values): pass
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): pass
    def checkpoint(self, step, path, **info): pass
    def samples(self, step, kind, records): pass
    def heartbeat(self): pass
