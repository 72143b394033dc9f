"""The records of recorded episodes (samples): filtered, paged, counted; a part of Records (records.py)."""
from sqlalchemy import func, select, tuple_
from sqlmodel import Session

from .db import row_dict
from .models import Sample


class SampleRecords:
    """Records' queries of samples (it provides self.engine and self._get)."""

    def samples(self, run_id: int, limit: int = 50, cursor: int | None = None, newest_first: bool = False,
                **filters) -> list[dict]:
        """Recorded episodes, filtered (`sample_query`), a page of them (`sample_page`)."""
        with Session(self.engine) as s:
            self._get(s, run_id)
            return self.sample_page(s, self.sample_query(run_id, **filters), limit, cursor, newest_first)

    @staticmethod
    def sample_page(s: Session, query, limit: int, cursor: int | None = None, newest_first: bool = False):
        """In the order recorded, or newest step first (an eval may be recorded after later steps), after `cursor`."""
        if cursor is not None:  # the id of the last one already seen
            step = select(Sample.step).where(Sample.id == cursor).scalar_subquery()
            after = tuple_(Sample.step, Sample.id) < tuple_(step, cursor) if newest_first else Sample.id > cursor
            query = query.where(after)
        order = (Sample.step.desc(), Sample.id.desc()) if newest_first else (Sample.id,)
        return [row_dict(r) for r in s.scalars(query.order_by(*order).limit(limit))]

    def count_samples(self, run_id: int, **filters) -> int:
        """How many recorded episodes pass the filters (`sample_query`)."""
        with Session(self.engine) as s:
            self._get(s, run_id)
            return s.scalar(select(func.count()).select_from(self.sample_query(run_id, **filters).subquery()))

    @staticmethod
    def sample_query(run_id: int, step: int | None = None, kind: str | None = None, min_reward: float | None = None,
                     passed: bool | None = None, tool_errors: bool | None = None, q: str | None = None,
                     prompt: str | None = None):
        """The run's episodes that pass the filters: `q` matches the text (ASCII, any case), `prompt` exactly."""
        query = select(Sample).where(Sample.run_id == run_id)
        if step is not None:
            query = query.where(Sample.step == step)
        if kind is not None:
            query = query.where(Sample.kind == kind)
        if min_reward is not None:
            query = query.where(Sample.reward >= min_reward)
        if passed is not None:
            query = query.where(Sample.success == passed)
        if tool_errors is not None:
            query = query.where((Sample.tool_errors > 0) == tool_errors)
        if q:
            query = query.where(Sample.text.contains(q, autoescape=True))
        if prompt is not None:
            query = query.where(Sample.prompt == prompt)
        return query

    def sample_steps(self, run_id: int) -> list[dict]:
        """The steps that have samples: {step, kind, count}, by step."""
        query = (select(Sample.step, Sample.kind, func.count()).where(Sample.run_id == run_id)
                 .group_by(Sample.step, Sample.kind).order_by(Sample.step, Sample.kind))
        with Session(self.engine) as s:
            self._get(s, run_id)
            return [{"step": st, "kind": k, "count": n} for st, k, n in s.execute(query)]
