"""An MLflowLogger's ``tracking_uri``: which store it names, checked when the logger is made.

MLflow itself says little and late: ``bogus://x`` fails at the first call with "Model registry
functionality is unavailable", and a sqlite database in a folder it cannot create retries
"unable to open database file" for some 100 s at every call. These checks only look (and
create one unnamed file, gone at once, in the database's nearest existing folder), so a logger
can still be made on every rank.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path
from urllib.parse import unquote, urlparse

from distkit._validate import unwritable_reason
from distkit.errors import ConfigurationError
from distkit.loggers._base import check_no_file_in_the_way

#: the schemes of MLflow's own tracking stores (mlflow.tracking._tracking_service.utils);
#: a database's scheme may name its driver, ``postgresql+psycopg2``
STORE_SCHEMES = ("file", "http", "https", "databricks", "sqlite", "postgresql", "mysql", "mssql")
#: the entry point group of the tracking stores other packages add
PLUGIN_GROUP = "mlflow.tracking_store"


def check_scheme(call: str, uri: str | None) -> None:
    """Refuse a ``uri`` whose scheme no tracking store serves (MLflow's, or a plugin's)."""
    if uri is None or file_store(uri):
        return
    scheme = urlparse(uri).scheme
    if scheme.split("+")[0] in STORE_SCHEMES:
        return
    plugins = sorted({entry.name for entry in entry_points(group=PLUGIN_GROUP)})
    if scheme in plugins:
        return
    installed = f", or one that an installed plugin adds ({', '.join(plugins)})" if plugins else ""
    raise ConfigurationError(
        f"{call}: MLflow has no tracking store for the scheme {scheme!r}; allowed: a folder "
        f"path, or a URI of scheme {', '.join(STORE_SCHEMES[:-1])} or {STORE_SCHEMES[-1]} (a "
        f"database's may name its driver: 'postgresql+psycopg2://...'){installed}. E.g. "
        "tracking_uri='sqlite:///runs/mlflow.db' (a local database, no server) or "
        "'http://host:5000' (a tracking server)"
    )


def check_database_folder(call: str, database: Path) -> None:
    """Refuse a sqlite ``database`` whose folder is a file, or cannot be made and written."""
    check_no_file_in_the_way(call, database.parent, "tracking_uri")
    unwritable = unwritable_reason(database.parent)
    if unwritable is not None:
        raise ConfigurationError(
            f"{call}: {unwritable}, and the sqlite database {str(database)!r} is created there "
            "at the first call; pass a tracking_uri whose folder this process can create and "
            "write, e.g. 'sqlite:///runs/mlflow.db' (relative to the working directory; four "
            "slashes for an absolute path: 'sqlite:////data/runs/mlflow.db')"
        )


def file_store(uri: str | None) -> bool:
    """Whether ``uri`` names MLflow's file store: a ``file:`` URI or a folder path."""
    if uri is None:
        return False
    scheme = urlparse(uri).scheme
    return scheme == "file" or scheme == "" or (len(scheme) == 1 and os.name == "nt")


def sqlite_file(uri: str | None) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other URIs and in-memory ones).

    ``sqlite:///runs/mlflow.db`` is relative to the working directory,
    ``sqlite:////abs/mlflow.db`` absolute. None is MLflow's default, ``sqlite:///mlflow.db``
    in the working directory, unless ``MLFLOW_TRACKING_URI`` says otherwise.
    """
    if uri is None:
        return None
    parsed = urlparse(uri)
    if parsed.scheme.split("+")[0] != "sqlite":
        return None
    path = unquote(parsed.path)
    if path.startswith("/"):
        path = path[1:]  # sqlite:///x -> "x", sqlite:////x -> "/x"
    if not path or path == ":memory:":
        return None
    return Path(path)
