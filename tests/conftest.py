"""Shared test helpers: wait_until (poll a condition with a deadline, never sleep-then-assert), watch_errors (a page's
console errors), and Debian's Chromium for the Playwright tests (the README's test command installs it; without it
those tests fail, they never skip)."""
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"   # the UI tests' screenshots
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# Browser test modules are named test_ui*.py: pytest-playwright's sync API keeps an event loop running in the main
# thread from the first browser test to the end of the session, and asyncio.run() refuses to start inside it, so
# they run after the modules that use asyncio.run.
@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    # pytest-playwright cannot find the system browser by itself, and its own download host is unreachable
    return {**browser_type_launch_args, "executable_path": "/usr/bin/chromium", "args": CHROMIUM_ARGS}


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def watch_errors(page) -> list[str]:
    """Every console error and uncaught page error from now on (a list the test asserts empty)."""
    errors = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    return errors


def wait_until(predicate, timeout: float, interval: float = 0.1, message: str = ""):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {message or predicate}")
        time.sleep(interval)


def freeze(pgids, db: Path):
    """SIGSTOP the process groups at a moment none of them holds the SQLite database's write lock: a writer frozen
    inside its transaction would block every other writer (the daemon, `molt daemon stop`) for as long as it is held."""
    while True:
        for pgid in pgids:
            os.killpg(pgid, signal.SIGSTOP)
        probe = sqlite3.connect(db, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")  # takes the write lock, or fails at once while another holds it
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            for pgid in pgids:
                os.killpg(pgid, signal.SIGCONT)
            time.sleep(0.01)  # a moment of the writers' own, to finish their transactions
        finally:
            probe.close()
