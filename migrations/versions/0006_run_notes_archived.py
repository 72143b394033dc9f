"""run.notes and run.archived: the runs list's notes and its archive (archived runs are hidden by default).

Revision ID: 0006_run_notes_archived
Revises: 0005_gpus
Create Date: 2026-12-01 20:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0006_run_notes_archived'
down_revision: Union[str, Sequence[str], None] = '0005_gpus'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    # constant server defaults: SQLite adds the columns in place (an expression default would rebuild the table,
    # which the foreign keys of the recorded rows forbid)
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.add_column(sa.Column('notes', sa.Text(), server_default='', nullable=False))
        batch_op.add_column(sa.Column('archived', sa.Boolean(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.drop_column('archived')
        batch_op.drop_column('notes')
