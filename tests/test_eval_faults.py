"""An evaluation job meets a full disk: its data directory on a small tmpfs (a real ENOSPC from the kernel), filled
while a real daemon's worker records episodes; each episode's row and sample land together or not at all."""
import errno
import subprocess
import sys

import pytest
from sqlalchemy import select
from sqlmodel import Session

from app_support import ROOT, child_env
from conftest import wait_until
from daemon.eval_records import get_eval
from daemon.models import EvalResult, Sample
from daemon.records import Records
from test_evals import alive, ended, queue, recorded, run_with_a_policy


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs of its own (the tests run as root): filling it fails every later write with ENOSPC."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(path):
    """Write `path` until the disk is full."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12):  # large writes, then the last pages one at a time
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


def positions(records: Records, eval_id: int) -> tuple[list[int], list[int]]:
    """The evaluation's recorded results' positions and its samples' positions, sorted."""
    with Session(records.engine) as s:
        results = sorted(s.scalars(select(EvalResult.position).where(EvalResult.eval_id == eval_id)))
    return results, recorded(records, eval_id)


def test_an_eval_worker_on_a_full_disk_records_each_episode_with_its_sample_and_completes_when_freed(
        tmp_path, small_disk):
    records = Records(small_disk)
    run_id = run_with_a_policy(records)
    with open(tmp_path / "daemon.log", "ab") as log:  # off the full disk: what it says stays readable
        daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(small_disk), "--poll", "0.2",
                                   "--backoff", "0.2"], cwd=ROOT, env=child_env(small_disk), stdout=log,
                                  stderr=subprocess.STDOUT)
    filler = small_disk / "filler"
    try:
        eval_id = queue(records, run_id, episodes=256, k=4)
        running = wait_until(lambda: (e := get_eval(records.engine, eval_id))["done"] >= 8 and e, 300, 0.05,
                             message="8 episodes recorded")
        # An empty write-ahead log, so the worker's next commits need new pages of the disk, which then has none
        with records.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()[0] == 0
        fill(filler)
        wait_until(lambda: not alive(running["pid"]), 120, 0.05, message="the worker's end on the full disk")
        results, samples = positions(records, eval_id)
        assert results == samples and len(results) < 256, "a row without its sample, or the reverse"
        filler.unlink()
        final = ended(records, eval_id)
    finally:
        daemon.terminate()
        daemon.wait(60)
    assert final["status"] == "completed", final
    assert final["restarts"] == 1, final  # its end counted once the disk took it, not lost as a daemon's crash
    # what the user reads: the worker's own error when the database took it, else that it could not write it
    assert "database or disk is full" in final["last_error"] or final["last_error"] == (
        "worker exit code 2: it could not record its error (a full disk?)"), final
    assert final["metrics"]["episodes"] == 256 and positions(records, eval_id) == (list(range(256)),) * 2
