"""More than one process on CPU (gloo, 2 torchrun ranks): the data-parallel update equals the single-process one,
and a gradient spike on one rank makes every rank skip the step."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_support import config, step

ROOT = Path(__file__).resolve().parent.parent


def two_ranks(tmp_path, strategy: str, *extra) -> list[dict]:
    """Run tests/dist_support.py on 2 ranks; what each rank got."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "dist_support.py"), str(tmp_path), strategy, *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_update_on_two_ranks_gives_the_weights_of_one_process(tmp_path, strategy):
    """Each rank trains 2 of the 4 groups (with different token counts: the token mean must be the global one);
    the published weights equal one process training all 4 within 1e-5."""
    one = step(config(strategy))
    single, start = one["weights"], one["start"]
    for got in two_ranks(tmp_path, strategy):
        diff = max(float((got["weights"][k] - single[k]).abs().max()) for k in single)
        moved = max(float((got["weights"][k] - start[k]).abs().max()) for k in single)
        assert diff < 1e-5 and moved > 100 * diff, (diff, moved)
        assert got["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
        assert all(torch.equal(got["model"][k], got["weights"][k]) for k in single)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_gradient_spike_on_one_rank_makes_every_rank_skip_the_step(tmp_path, strategy):
    """The drill spikes rank 0's gradient only; the breaker judges the norm gathered over the ranks, so both skip:
    nothing is published and both models are back at the weights the step started from."""
    for got in two_ranks(tmp_path, strategy, "spike"):
        start = got["start"]
        assert got["weights"] is None and got["metrics"]["breaker_tripped"] == 1.0
        assert got["metrics"]["grad_norm"] > 100
        assert all(torch.equal(got["model"][k], start[k]) for k in start)
