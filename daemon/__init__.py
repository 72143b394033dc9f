"""Molt Studio daemon: supervises training runs and records them in SQLite (imports nothing heavy)."""


def cli_main(argv=None) -> int:
    """`molt daemon [--home DIR] [--concurrency N] ...`: supervise runs until SIGTERM / Ctrl-C."""
    from .supervisor import cli_main as main
    return main(argv)
