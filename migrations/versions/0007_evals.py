"""evaluation: evaluation jobs (a policy on an env, pass@k), queued and supervised by the daemon like runs.

Revision ID: 0007_evals
Revises: 0006_run_notes_archived
Create Date: 2026-12-01 23:50:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0007_evals'
down_revision: Union[str, Sequence[str], None] = '0006_run_notes_archived'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'evaluation',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=True),
        sa.Column('checkpoint', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column('step', sa.Integer(), nullable=True),
        sa.Column('policy_path', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column('config', sa.JSON(), nullable=False),
        sa.Column('status', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column('results', sa.JSON(), nullable=False),
        sa.Column('metrics', sa.JSON(), nullable=True),
        sa.Column('restarts', sa.Integer(), nullable=False),
        sa.Column('max_restarts', sa.Integer(), nullable=False),
        sa.Column('pid', sa.Integer(), nullable=True),
        sa.Column('gpus', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('started_at', sa.Float(), nullable=True),
        sa.Column('finished_at', sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['run.id'], name=op.f('fk_evaluation_run_id_run')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluation')),
    )
    with op.batch_alter_table('evaluation', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evaluation_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_evaluation_status'), ['status'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('evaluation', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evaluation_status'))
        batch_op.drop_index(batch_op.f('ix_evaluation_run_id'))
    op.drop_table('evaluation')
