"""Shared test helpers: wait_until (poll a condition with a deadline, never sleep-then-assert)."""
import time


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
