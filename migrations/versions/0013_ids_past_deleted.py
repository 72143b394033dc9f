"""run, evaluation, alert: each id sequence starts past every id still found anywhere, so that no id deleted before
0009_autoincrement_ids (which began the sequences at the highest row then kept) is given again: the rows that name
one (left by an earlier delete) and the data directory's runs/ID and evals/ID (an earlier delete of a run left its
evaluations' directories, and a worker may write its run's directory after a delete).

Revision ID: 0013_ids_past_deleted
Revises: 0012_eval_results
Create Date: 2026-12-07 04:50:00
"""
from pathlib import Path
from typing import Sequence, Union

from alembic import op


revision: str = '0013_ids_past_deleted'
down_revision: Union[str, Sequence[str], None] = '0012_eval_results'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

NAMED_BY = {  # the columns that name each table's ids, and the directory named by them
    'run': (['attempt.run_id', 'metric.run_id', 'metric_bucket.run_id', 'policy_version.run_id',
             'checkpoint.run_id', 'alert.run_id', 'event.run_id', 'sample.run_id', 'evaluation.run_id'], 'runs'),
    'evaluation': (['sample.eval_id', 'eval_result.eval_id'], 'evals'),
    'alert': ([], None)}


def upgrade() -> None:
    conn = op.get_bind()
    database = conn.engine.url.database
    home = Path(database).parent if database and database != ':memory:' else None
    for table, (columns, directory) in NAMED_BY.items():
        found = [conn.exec_driver_sql(f"SELECT max({c.split('.')[1]}) FROM {c.split('.')[0]}").scalar() or 0
                 for c in [f'{table}.id', *columns]]
        if home and directory and (home / directory).is_dir():
            found += [int(p.name) for p in (home / directory).iterdir() if p.name.isascii() and p.name.isdigit()]
        conn.exec_driver_sql("INSERT INTO sqlite_sequence (name, seq) SELECT ?, 0 WHERE NOT EXISTS "
                             "(SELECT 1 FROM sqlite_sequence WHERE name = ?)", (table, table))
        conn.exec_driver_sql("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = ?", (max(found), table))


def downgrade() -> None:
    pass  # a sequence past some ids is correct for the earlier schema too
