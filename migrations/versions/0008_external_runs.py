"""run.host, run.ranks, run.ingest_token: external runs (`molt train --report-to`) and their ingest tokens.

Revision ID: 0008_external_runs
Revises: 0007_evals
Create Date: 2026-12-01 23:55:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0008_external_runs'
down_revision: Union[str, Sequence[str], None] = '0007_evals'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    # nullable columns without defaults: SQLite adds them in place (no table rebuild)
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.add_column(sa.Column('host', sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column('ranks', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('ingest_token', sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.create_index(batch_op.f('ix_run_ingest_token'), ['ingest_token'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_ingest_token'))
        batch_op.drop_column('ingest_token')
        batch_op.drop_column('ranks')
        batch_op.drop_column('host')
