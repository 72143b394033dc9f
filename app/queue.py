"""The queue as the daemon's slot rule (daemon/slots.py) sees it: queued local runs and Tinker training clients in id
order, then the waiting evaluations (restarts first); the slots are held by the active ones and the running
evaluations."""
from sqlalchemy import select
from sqlalchemy.engine import Engine

from daemon.models import Evaluation, Run
from daemon.slots import EVAL_HOLDS_A_SLOT, EVAL_ORDER, EVAL_WAITS, RUN_HOLDS_A_SLOT, RUN_WAITS


def queue_notes(engine: Engine, concurrency: int | None) -> dict[tuple[str, int], str]:
    """("run" | "evaluation", id) -> what that queued job waits for, e.g. "2nd in line; 2 slots (concurrency 2)
    held by run #3 'big', evaluation #4" (the run page adds the GPUs a run asks for, from its config)."""
    with engine.connect() as c:
        holders = [f"run #{i} '{name}'" for i, name in c.execute(select(Run.id, Run.name).where(RUN_HOLDS_A_SLOT)
                                                                   .order_by(Run.id))]
        holders += [f"evaluation #{i}" for (i,) in c.execute(select(Evaluation.id).where(EVAL_HOLDS_A_SLOT)
                                                             .order_by(Evaluation.id))]
        line = [("run", i) for (i,) in c.execute(select(Run.id).where(RUN_WAITS).order_by(Run.id))]
        line += [("evaluation", i) for (i,) in c.execute(select(Evaluation.id).where(EVAL_WAITS).order_by(*EVAL_ORDER))]
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
