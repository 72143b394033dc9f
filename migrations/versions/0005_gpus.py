"""run.gpus: the GPU ids the daemon gave a run's worker.

Revision ID: 0005_gpus
Revises: 0004_daemon
Create Date: 2026-12-01 00:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0005_gpus'
down_revision: Union[str, Sequence[str], None] = '0004_daemon'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpus', sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.drop_column('gpus')
