"""Metric buckets: per (run, name) and 64 or 512 steps, the rows holding the min, the max and the first NaN.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 12:00:00

Kept by triggers: every writer of `metric` (the worker's sink, a replayed spool, scripts) then keeps the summary
exact in the same transaction, and nothing in Python has to remember it. An inserted row is merged into its level-0
bucket (64 steps); an updated row (a replayed step) or a deleted one makes its bucket be recomputed from its rows.
Level 1 (512 steps) follows level 0 the same way, from the 8 level-0 buckets it covers.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision: str = '0002'
down_revision: Union[str, Sequence[str], None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# Bucket shifts when this revision was written (daemon.models.BUCKET_SHIFTS): level 0 = step >> 6, level 1 = >> 9.
COLUMNS = "run_id, name, level, bucket, n, lo_step, lo_value, lo_time, hi_step, hi_value, hi_time, nan_step, nan_time"

# Merge bucket-shaped rows (the {rows} query) into metric_bucket. In an upsert's SET every column still reads the
# old row, so the iif()s do not see each other's results. NULL is NaN: it is never a min or a max.
MERGE = f"""INSERT INTO metric_bucket ({COLUMNS}) {{rows}}
ON CONFLICT (run_id, name, level, bucket) DO UPDATE SET
    n = n + excluded.n,
    lo_step = iif(lo_value IS NULL OR excluded.lo_value < lo_value, excluded.lo_step, lo_step),
    lo_time = iif(lo_value IS NULL OR excluded.lo_value < lo_value, excluded.lo_time, lo_time),
    lo_value = iif(lo_value IS NULL OR excluded.lo_value < lo_value, excluded.lo_value, lo_value),
    hi_step = iif(hi_value IS NULL OR excluded.hi_value > hi_value, excluded.hi_step, hi_step),
    hi_time = iif(hi_value IS NULL OR excluded.hi_value > hi_value, excluded.hi_time, hi_time),
    hi_value = iif(hi_value IS NULL OR excluded.hi_value > hi_value, excluded.hi_value, hi_value),
    nan_step = iif(nan_step IS NULL OR excluded.nan_step < nan_step, excluded.nan_step, nan_step),
    nan_time = iif(nan_step IS NULL OR excluded.nan_step < nan_step, excluded.nan_time, nan_time);
"""


def metric_as_bucket(r: str) -> str:
    """A metric row (`r` = "NEW." or "") as a one-row level-0 bucket. (A WHERE must follow: it also tells the
    parser that ON CONFLICT is not a join's ON.)"""
    return (f"SELECT {r}run_id, {r}name, 0, {r}step >> 6, 1, "
            f"iif({r}value IS NULL, NULL, {r}step), {r}value, iif({r}value IS NULL, NULL, {r}time), "
            f"iif({r}value IS NULL, NULL, {r}step), {r}value, iif({r}value IS NULL, NULL, {r}time), "
            f"iif({r}value IS NULL, {r}step, NULL), iif({r}value IS NULL, {r}time, NULL)")


def level0_as_level1(r: str) -> str:
    return (f"SELECT {r}run_id, {r}name, 1, {r}bucket >> 3, {r}n, {r}lo_step, {r}lo_value, {r}lo_time, {r}hi_step, "
            f"{r}hi_value, {r}hi_time, {r}nan_step, {r}nan_time")


def recompute_level0(r: str) -> str:
    """The level-0 bucket of row `r` ("OLD." or "NEW.") from its metric rows as they are now; gone if empty."""
    key = f"run_id = {r}run_id AND name = {r}name"
    rows = f"FROM metric WHERE {key} AND step >= ({r}step >> 6) << 6 AND step < (({r}step >> 6) + 1) << 6"
    bucket = f"WHERE {key} AND level = 0 AND bucket = {r}step >> 6"
    # a bare column beside min() or max() comes from the row holding that min or max (SQLite)
    return f"""UPDATE metric_bucket SET
    n = (SELECT count(*) {rows}),
    (lo_step, lo_value, lo_time) = (SELECT step, min(value), time {rows} AND value IS NOT NULL),
    (hi_step, hi_value, hi_time) = (SELECT step, max(value), time {rows} AND value IS NOT NULL),
    (nan_step, nan_time) = (SELECT min(step), time {rows} AND value IS NULL)
{bucket};
DELETE FROM metric_bucket {bucket} AND n = 0;
"""


def recompute_level1(r: str) -> str:
    """The level-1 bucket of level-0 bucket `r` from its level-0 buckets as they are now; gone if empty."""
    key = f"run_id = {r}run_id AND name = {r}name"
    rows = (f"FROM metric_bucket WHERE {key} AND level = 0 AND bucket >= ({r}bucket >> 3) << 3 "
            f"AND bucket < (({r}bucket >> 3) + 1) << 3")
    bucket = f"WHERE {key} AND level = 1 AND bucket = {r}bucket >> 3"
    return f"""UPDATE metric_bucket SET
    n = (SELECT coalesce(sum(n), 0) {rows}),
    (lo_step, lo_value, lo_time) = (SELECT lo_step, min(lo_value), lo_time {rows} AND lo_value IS NOT NULL),
    (hi_step, hi_value, hi_time) = (SELECT hi_step, max(hi_value), hi_time {rows} AND hi_value IS NOT NULL),
    (nan_step, nan_time) = (SELECT min(nan_step), nan_time {rows} AND nan_step IS NOT NULL)
{bucket};
DELETE FROM metric_bucket {bucket} AND n = 0;
"""


MOVED = "OLD.run_id != NEW.run_id OR OLD.name != NEW.name OR OLD.step >> 6 != NEW.step >> 6"
TRIGGERS = {
    "metric_bucket_insert": "AFTER INSERT ON metric BEGIN\n" + MERGE.format(rows=metric_as_bucket("NEW.")
                                                                              + " WHERE true"),
    # the old bucket (the usual replay rewrites value and time in place: that is the new bucket too)
    "metric_bucket_update": "AFTER UPDATE ON metric BEGIN\n" + recompute_level0("OLD."),
    "metric_bucket_move": f"AFTER UPDATE ON metric WHEN {MOVED} BEGIN\n"
                          + MERGE.format(rows=metric_as_bucket("NEW.") + " WHERE true"),
    "metric_bucket_delete": "AFTER DELETE ON metric BEGIN\n" + recompute_level0("OLD."),
    # level 1 follows level 0 (the WHEN: its own rows are in the same table)
    "metric_bucket_level1_insert": "AFTER INSERT ON metric_bucket WHEN NEW.level = 0 BEGIN\n"
                                   + MERGE.format(rows=level0_as_level1("NEW.") + " WHERE true"),
    "metric_bucket_level1_update": "AFTER UPDATE ON metric_bucket WHEN NEW.level = 0 BEGIN\n"
                                   + recompute_level1("NEW."),
    "metric_bucket_level1_delete": "AFTER DELETE ON metric_bucket WHEN OLD.level = 0 BEGIN\n"
                                   + recompute_level1("OLD."),
}


def upgrade() -> None:
    op.create_table('metric_bucket',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('level', sa.Integer(), nullable=False),
    sa.Column('bucket', sa.Integer(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('lo_step', sa.Integer(), nullable=True),
    sa.Column('lo_value', sa.Float(), nullable=True),
    sa.Column('lo_time', sa.Float(), nullable=True),
    sa.Column('hi_step', sa.Integer(), nullable=True),
    sa.Column('hi_value', sa.Float(), nullable=True),
    sa.Column('hi_time', sa.Float(), nullable=True),
    sa.Column('nan_step', sa.Integer(), nullable=True),
    sa.Column('nan_time', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], name=op.f('fk_metric_bucket_run_id_run')),
    sa.PrimaryKeyConstraint('run_id', 'name', 'level', 'bucket', name=op.f('pk_metric_bucket')),
    sqlite_with_rowid=False
    )
    # the metrics recorded before this revision, then the triggers for those to come
    op.execute(MERGE.format(rows=metric_as_bucket("") + " FROM metric WHERE true ORDER BY run_id, name, step"))
    op.execute(MERGE.format(rows=level0_as_level1("") + " FROM metric_bucket WHERE level = 0"))
    for name, body in TRIGGERS.items():
        op.execute(f"CREATE TRIGGER {name} {body}END")


def downgrade() -> None:
    for name in TRIGGERS:
        op.execute(f"DROP TRIGGER {name}")
    op.drop_table('metric_bucket')
