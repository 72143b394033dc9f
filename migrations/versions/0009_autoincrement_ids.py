"""run, evaluation, alert: AUTOINCREMENT ids (never given again after a delete); run.idempotency_key and
attempt.idempotency_key (a retried registration or resume of an external run finds the first).

Revision ID: 0009_autoincrement_ids
Revises: 0008_external_runs
Create Date: 2026-12-06 03:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0009_autoincrement_ids'
down_revision: Union[str, Sequence[str], None] = '0008_external_runs'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

REBUILT = ('run', 'evaluation', 'alert')


def upgrade() -> None:
    # AUTOINCREMENT is part of a table's definition: SQLite adds it only by a rebuild (batch mode copies the table;
    # daemon.db.upgrade turns the foreign keys off around it, as the run table is referred to)
    for table in REBUILT:
        with op.batch_alter_table(table, recreate='always', table_kwargs={'sqlite_autoincrement': True}) as batch_op:
            if table == 'run':
                batch_op.add_column(sa.Column('idempotency_key', sqlmodel.sql.sqltypes.AutoString(), nullable=True))
                batch_op.create_unique_constraint(batch_op.f('uq_run_idempotency_key'), ['idempotency_key'])
    with op.batch_alter_table('attempt', schema=None) as batch_op:
        batch_op.add_column(sa.Column('idempotency_key', sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempt', schema=None) as batch_op:
        batch_op.drop_column('idempotency_key')
    for table in REBUILT:
        with op.batch_alter_table(table, recreate='always', table_kwargs={'sqlite_autoincrement': False}) as batch_op:
            if table == 'run':
                batch_op.drop_constraint(batch_op.f('uq_run_idempotency_key'), type_='unique')
                batch_op.drop_column('idempotency_key')
