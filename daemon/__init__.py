"""Molt Studio daemon: supervises training runs and records them in SQLite."""
