"""The daemon's own timeline (daemon_event): its starts, clean stops, and deaths with their cause.

Revision ID: 0004_daemon
Revises: 0003_samples
Create Date: 2026-11-30 23:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0004_daemon'
down_revision: Union[str, Sequence[str], None] = '0003_samples'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('daemon_event',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('time', sa.Float(), nullable=False),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('cause', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('message', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_daemon_event'))
    )


def downgrade() -> None:
    op.drop_table('daemon_event')
