"""sample.eval_id: an evaluation job's episodes are its own, never pruned by its run's record.keep_steps.

Revision ID: 0010_eval_samples
Revises: 0009_autoincrement_ids
Create Date: 2026-12-06 03:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0010_eval_samples'
down_revision: Union[str, Sequence[str], None] = '0009_autoincrement_ids'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    # a nullable column without a default: SQLite adds it in place (no rebuild of the sample table)
    with op.batch_alter_table('sample', schema=None) as batch_op:
        batch_op.add_column(sa.Column('eval_id', sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f('ix_sample_eval_id'), ['eval_id'], unique=False)
    # until now an evaluation's episodes were kind "evaluation" with its id as their step
    op.execute("UPDATE sample SET eval_id = step WHERE kind = 'evaluation'")


def downgrade() -> None:
    with op.batch_alter_table('sample', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sample_eval_id'))
        batch_op.drop_column('eval_id')
