"""One train_step on a fixed global batch, in one process or as a rank of
`torchrun --nproc-per-node 2 tests/dist_support.py OUT STRATEGY [spike]`, which writes each rank's result to
OUT/rank-R.pt for tests/test_dist.py."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_minibatches import make_cfg, sampled_groups  # noqa: E402

from molt_engine import dist  # noqa: E402
from molt_engine.breaker import Breaker  # noqa: E402
from molt_engine.models import char_tokenizer, load_policy  # noqa: E402
from molt_engine.update import train_step  # noqa: E402


def config(strategy="ddp", spike=False):
    return make_cfg().model_validate({**make_cfg().model_dump(), "dist": {"nproc": 2, "strategy": strategy},
                                      "breaker": {"abs_max": 100.0}, "drills": {"spike_at": [0] if spike else []}})


def step(cfg) -> dict:
    """This rank's share of the 4 groups (all of them in one process), one train_step. Plain SGD at lr 1, so the
    weights move by exactly the clipped gradient: AdamW's first step is lr x sign(gradient), which turns the
    summation-order noise of gradients within ~1e-8 of zero into differences of up to 2 lr."""
    tok = char_tokenizer()
    model, _ = load_policy(cfg.model, seed=0)
    groups = sampled_groups(model, tok)  # the same global batch on every rank
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg.dist)
    metrics, weights, _, _ = train_step(model, optimizer, groups[dist.rank()::dist.world()], cfg, step=0,
                                        breaker=Breaker(cfg.breaker), published=start, pad_id=tok.pad_token_id)
    return {"metrics": metrics, "weights": weights, "model": dist.full_weights(model), "start": start}


if __name__ == "__main__":
    cfg = config(sys.argv[2], "spike" in sys.argv[3:])
    dist.init(cfg.dist)
    torch.save(step(cfg), Path(sys.argv[1]) / f"rank-{dist.rank()}.pt")
    dist.close()
