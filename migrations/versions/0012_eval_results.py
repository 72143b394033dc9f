"""eval_result: an evaluation's finished episodes, a row each (appended as they end), instead of evaluation.results,
a JSON of them all rewritten after every episode (quadratic up to 100,000 episodes).

Revision ID: 0012_eval_results
Revises: 0011_sweeps
Create Date: 2026-12-07 04:50:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0012_eval_results'
down_revision: Union[str, Sequence[str], None] = '0011_sweeps'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'eval_result',
        sa.Column('eval_id', sa.Integer(), nullable=False),
        sa.Column('position', sa.Integer(), nullable=False),
        sa.Column('reward', sa.Float(), nullable=True),
        sa.Column('success', sa.Boolean(), nullable=False),
        sa.Column('metrics', sa.JSON(), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['eval_id'], ['evaluation.id'], name=op.f('fk_eval_result_eval_id_evaluation'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('eval_id', 'position', name=op.f('pk_eval_result')))
    # each position's [reward, success, env metrics, error] of the earlier JSON becomes its row
    op.execute("INSERT INTO eval_result (eval_id, position, reward, success, metrics, error) "
               "SELECT e.id, CAST(r.key AS INTEGER), json_extract(r.value, '$[0]'), json_extract(r.value, '$[1]'), "
               "json(coalesce(json_extract(r.value, '$[2]'), '{}')), json_extract(r.value, '$[3]') "
               "FROM evaluation AS e, json_each(e.results) AS r")
    # in place (SQLite 3.35+): a rebuild would have to keep the table's AUTOINCREMENT
    op.execute("ALTER TABLE evaluation DROP COLUMN results")


def downgrade() -> None:
    op.add_column('evaluation', sa.Column('results', sa.JSON(), nullable=False, server_default='{}'))
    op.execute("UPDATE evaluation SET results = (SELECT json_group_object(r.position, json_array(r.reward, "
               "json(CASE WHEN r.success THEN 'true' ELSE 'false' END), json(r.metrics), r.error)) FROM eval_result AS r WHERE r.eval_id = evaluation.id) "
               "WHERE id IN (SELECT eval_id FROM eval_result)")
    op.drop_table('eval_result')
