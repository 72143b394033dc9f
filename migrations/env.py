"""Alembic environment: the daemon's SQLModel metadata on MOLT_HOME/molt.db (or a connection handed in by daemon.db)."""
from logging.config import fileConfig

from alembic import context
from sqlmodel import SQLModel

import daemon.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from daemon.db import data_home, db_url, sqlite_engine

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = SQLModel.metadata


def _url() -> str:
    if config.get_main_option("sqlalchemy.url"):
        return config.get_main_option("sqlalchemy.url")
    data_home().mkdir(parents=True, exist_ok=True)
    return db_url(data_home())


def run_migrations_offline():
    url = _url()
    # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table instead.
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True, render_as_batch=True,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online():
    connection = config.attributes.get("connection")
    if connection is None:  # the alembic command line
        engine = sqlite_engine(_url())
        with engine.connect() as connection:
            _run(connection)
            connection.commit()
    else:  # daemon.db.upgrade, inside its transaction
        _run(connection)


def _run(connection):
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
