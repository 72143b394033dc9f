"""Molt Studio daemon: supervises training runs and records them in SQLite (imports nothing heavy)."""


def cli_main(argv=None) -> int:
    """`molt daemon [--home DIR] [--concurrency N] ...`: supervise runs until SIGTERM / Ctrl-C;
    `molt daemon stop [--home DIR]`: stop the daemon that owns DIR, its workers checkpointing first;
    `molt daemon start [--home DIR]`: start it again (the `molt serve` that watches DIR starts it)."""
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["stop"]:
        from .keeper import stop_main
        return stop_main(argv[1:])
    if argv[:1] == ["start"]:
        from .keeper import start_main
        return start_main(argv[1:])
    from .cli import cli_main as main
    return main(argv)
