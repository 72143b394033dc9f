"""The slot rule, its one home: which jobs hold the daemon's --concurrency slots and in which order waiting ones take
them. The supervisor starts runs and evaluations by it; the dashboard's queue notes (app/queue.py) read it."""
from sqlalchemy import and_

from .models import ACTIVE, Evaluation, Run

LOCAL = Run.host.is_(None)  # external runs hold no slot: they train elsewhere (a dead one must block nothing here)
RUN_HOLDS_A_SLOT = and_(Run.status.in_(ACTIVE), LOCAL)
RUN_WAITS = and_(Run.status == "queued", LOCAL)  # in id order, after the due restarts
EVAL_HOLDS_A_SLOT = Evaluation.status.in_(("running", "stopping"))  # its worker lives
EVAL_WAITS = Evaluation.status.in_(("restarting", "queued"))
EVAL_ORDER = (Evaluation.status != "restarting", Evaluation.id)  # restarts first, then in id order
