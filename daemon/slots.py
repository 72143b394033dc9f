"""The slot rule, its one home: which jobs hold the daemon's --concurrency slots and in which order waiting ones take
them, and which of its GPUs they hold. The supervisor starts runs and evaluations by it; the dashboard's queue notes
(app/queue.py) and the Tinker API (app/tinker/service.py, which starts its own training clients in their turn) read
it."""
from sqlalchemy import and_, func, or_, select

from .models import ACTIVE, Evaluation, Run

TINKER = "tinker"  # the host of a Tinker training client: it trains in molt serve's web process, yet takes a slot
# Other external runs hold no slot: they train elsewhere (a dead one must block nothing here)
SCHEDULED = or_(Run.host.is_(None), Run.host == TINKER)
RUN_HOLDS_A_SLOT = and_(Run.status.in_(ACTIVE), SCHEDULED)
RUN_WAITS = and_(Run.status == "queued", SCHEDULED)  # in id order, daemon runs and Tinker clients alike
EVAL_HOLDS_A_SLOT = Evaluation.status.in_(("running", "stopping"))  # its worker lives
EVAL_WAITS = Evaluation.status.in_(("restarting", "queued"))
EVAL_ORDER = (Evaluation.status != "restarting", Evaluation.id)  # restarts first, then in id order


def runs_held(s) -> int:
    return s.scalar(select(func.count()).where(RUN_HOLDS_A_SLOT))


def turn(s, free: int) -> list[tuple[int, str | None]]:
    """The waiting runs whose turn has come with `free` slots free: (id, host), the first `free` of the line. The
    supervisor starts the daemon's among them; a Tinker client's slot is kept for the web process, which starts it."""
    return s.execute(select(Run.id, Run.host).where(RUN_WAITS).order_by(Run.id).limit(max(free, 0))).all()


def free_gpus(s, pool: list[str], held=(), but: int | None = None) -> list[str]:
    """The GPUs of `pool` (CUDA_VISIBLE_DEVICES names), in its order, that no job holds by the records: a run holding
    a slot holds its Run.gpus (a restarting one too: they wait for its restart), a running evaluation its own. Also
    not `held` (the supervisor's workers, known before their rows commit). `but`: a run whose own GPUs count as free
    (its restart takes them back)."""
    if not pool:
        return []
    runs = select(Run.gpus).where(RUN_HOLDS_A_SLOT, Run.gpus.is_not(None))
    if but is not None:
        runs = runs.where(Run.id != but)
    evals = select(Evaluation.gpus).where(EVAL_HOLDS_A_SLOT, Evaluation.gpus.is_not(None))
    rows = [*s.scalars(runs), *s.scalars(evals)]
    taken = set(held) | {g for row in rows for g in row.split(",")}
    return [g for g in pool if g not in taken]
