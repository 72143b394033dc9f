"""The queue as the daemon's slot rule sees it (daemon/supervisor.py start_due, daemon/evals.py EvalWorkers.tick):
queued local runs in id order, then the waiting evaluations (restarts first); the slots are held by the active local
runs and the running evaluations. External runs (molt train --report-to) take no local slot."""
from sqlalchemy import select
from sqlalchemy.engine import Engine

from daemon.models import ACTIVE, Evaluation, Run

HOLDING_RUNS = select(Run.id, Run.name).where(Run.status.in_(ACTIVE), Run.host.is_(None)).order_by(Run.id)
HOLDING_EVALS = select(Evaluation.id).where(Evaluation.status.in_(("running", "stopping"))).order_by(Evaluation.id)
QUEUED_RUNS = select(Run.id).where(Run.status == "queued", Run.host.is_(None)).order_by(Run.id)  # no config read
WAITING_EVALS = (select(Evaluation.id).where(Evaluation.status.in_(("restarting", "queued")))
                 .order_by(Evaluation.status != "restarting", Evaluation.id))


def queue_notes(engine: Engine, concurrency: int | None) -> dict[tuple[str, int], str]:
    """("run" | "evaluation", id) -> what that queued job waits for, e.g. "2nd in line; 2 slots (concurrency 2)
    held by run #3 'big', evaluation #4" (the run page adds the GPUs a run asks for, from its config)."""
    with engine.connect() as c:
        holders = [f"run #{i} '{name}'" for i, name in c.execute(HOLDING_RUNS)]
        holders += [f"evaluation #{i}" for (i,) in c.execute(HOLDING_EVALS)]
        line = [("run", i) for (i,) in c.execute(QUEUED_RUNS)]
        line += [("evaluation", i) for (i,) in c.execute(WAITING_EVALS)]
    slots = (f"concurrency {concurrency}" if concurrency else "the daemon's --concurrency")
    if holders:
        held = f"{len(holders)} slot{'s' if len(holders) > 1 else ''} ({slots}) held by {', '.join(holders)}"
    else:
        held = f"no slot taken ({slots}): starts when the daemon next looks, if it runs"
    notes = {}
    for position, job in enumerate(line, 1):
        suffix = "th" if 10 <= position % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(position % 10, "th")
        ordinal = f"{position}{suffix}"
        notes[job] = f"{ordinal} in line; {held}"
    return notes
