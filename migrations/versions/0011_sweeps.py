"""sweep (a search over config keys) and run.sweep_id, run.sweep_point (a sweep's runs).

Revision ID: 0011_sweeps
Revises: 0010_eval_samples
Create Date: 2026-12-06 04:10:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0011_sweeps'
down_revision: Union[str, Sequence[str], None] = '0010_eval_samples'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'sweep',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column('status', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column('request', sa.JSON(), nullable=False),
        sa.Column('points', sa.JSON(), nullable=False),
        sa.Column('judged', sa.JSON(), nullable=False),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_sweep')),
        sqlite_autoincrement=True)
    with op.batch_alter_table('sweep', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sweep_status'), ['status'], unique=False)
    # plain columns: SQLite adds them in place (no rebuild of the run table, which others refer to)
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sweep_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('sweep_point', sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f('ix_run_sweep_id'), ['sweep_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_sweep_id'))
        batch_op.drop_column('sweep_point')
        batch_op.drop_column('sweep_id')
    with op.batch_alter_table('sweep', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sweep_status'))
    op.drop_table('sweep')
