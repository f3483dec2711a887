"""The study's storage (``--storage``): checked before anything starts, and never shown with its password.

:func:`check_storage` turns every way a storage URL can fail into one line that names the flag and the
reason, so a study never starts Ray or loads weights and then dies on its database:

- a string SQLAlchemy cannot parse as a URL;
- a database kind SQLAlchemy does not know;
- a database whose Python driver is not installed (with the ``pip install`` that adds it);
- an SQLite file that cannot be written: a folder on its path is a file, the file or its folder is read-only
  (permission bits without write permission count as read-only, also for root, who could write anyway), the
  file is not an SQLite database, or the file system is read-only.

A server database (PostgreSQL, MySQL, ...) is only checked as far as its driver: reaching the server is
Optuna's first call, which reports its own error. :func:`redact` hides the password of a URL wherever a
storage is printed.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import tempfile
from pathlib import Path
from typing import Any

# module a SQLAlchemy dialect imports -> the package that provides it
DRIVER_PACKAGES = {
    "psycopg2": "psycopg2-binary",
    "psycopg": "psycopg[binary]",
    "asyncpg": "asyncpg",
    "pg8000": "pg8000",
    "pymysql": "PyMySQL",
    "MySQLdb": "mysqlclient",
    "mysql": "mysql-connector-python",
    "mariadb": "mariadb",
    "oracledb": "oracledb",
    "cx_Oracle": "cx_Oracle",
    "pyodbc": "pyodbc",
    "pymssql": "pymssql",
}
EXAMPLE_URLS = "sqlite:///studies/kvtune.db or postgresql://user@host/db"


class StorageError(ValueError):
    """A storage URL that cannot hold a study; the message is one line naming the flag."""


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (unchanged when it does not parse or has none)."""
    try:
        parsed = _parse(url)
    except Exception:
        return url
    return url if parsed.password is None else parsed.render_as_string(hide_password=True)


def _parse(url: str) -> Any:
    from sqlalchemy.engine import make_url

    return make_url(url)


def check_storage(
    url: str, workdir: Path | None = None, flag: str = "--storage", writable: bool = True
) -> str:
    """``url`` resolved (a relative SQLite file lives under ``workdir``, default the working directory, and
    its folder is created when ``writable``), after the checks of the module docstring.

    Raises :class:`StorageError`; with ``writable=False`` (reading a study) only the URL and the driver are
    checked."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    shown = redact(url)
    try:
        parsed = _parse(url)
    except (ArgumentError, ValueError):
        raise StorageError(f"{flag} {shown}: not a database URL (expected e.g. {EXAMPLE_URLS})") from None
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        raise StorageError(
            f"{flag} {shown}: unknown database kind {parsed.drivername!r} (expected e.g. {EXAMPLE_URLS})"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as e:
        module = (e.name or "").split(".")[0] or "its driver"
        package = DRIVER_PACKAGES.get(module, module)
        raise StorageError(
            f"{flag} {shown}: the {parsed.get_backend_name()} driver {module!r} is not installed "
            f"(pip install {package if '[' not in package else repr(package)})"
        ) from None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return url
    path = Path(parsed.database)
    if not path.is_absolute():
        path = (workdir or Path.cwd()) / path
    if writable:
        _check_sqlite_file(flag, shown, path)
    return url if path == Path(parsed.database) else parsed.set(database=str(path)).render_as_string(False)


def _check_sqlite_file(flag: str, shown: str, path: Path) -> None:
    """The SQLite file ``path`` can be created or written (see the module docstring)."""
    where = f"{flag} {shown}"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise StorageError(f"{where}: {parent} is a file, not a directory")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"{where}: cannot create the folder {path.parent} ({e.strerror or e})") from None
    _check_writable_dir(where, path.parent)
    if path.is_dir():
        raise StorageError(f"{where}: {path} is a directory, not an SQLite file")
    if path.exists():
        _check_writable_file(where, path)


def _read_only_bits(path: Path) -> bool:
    return not stat.S_IMODE(path.stat().st_mode) & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


def _check_writable_dir(where: str, folder: Path) -> None:
    if _read_only_bits(folder) or not os.access(folder, os.W_OK):
        raise StorageError(f"{where}: the folder {folder} is not writable (SQLite writes its journal there)")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise StorageError(f"{where}: the folder {folder} is not writable ({e.strerror or e})") from None


def _check_writable_file(where: str, path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if _read_only_bits(path) or not os.access(path, os.W_OK):
        raise StorageError(f"{where}: {path} is read-only (mode {mode:04o}); the study writes every trial")
    try:
        db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10.0)
    except sqlite3.Error as e:
        raise StorageError(f"{where}: cannot open {path} ({e})") from None
    try:
        db.execute("BEGIN IMMEDIATE")  # takes the write lock: a read-only file or file system fails here
        db.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        if "locked" not in str(e):  # another study writing now is no reason to refuse
            raise StorageError(f"{where}: {path} cannot be written ({e})") from None
    except sqlite3.DatabaseError as e:
        raise StorageError(f"{where}: {path} is not an SQLite database ({e})") from None
    finally:
        db.close()


def sqlite_file(url: str) -> Path | None:
    """The file of an SQLite URL (None for another database or an in-memory one)."""
    parsed = _parse(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def private_sqlite_file(url: str) -> Path | None:
    """Create the SQLite file of ``url``, empty and readable by its owner only (0600), when it does not exist
    yet (SQLite gives its journal the file's mode); the path created, or None."""
    path = sqlite_file(url)
    if path is None:
        return None
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return None
    return path


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from, as SQLAlchemy and Optuna wrap it) says the disk or
    the database is full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "database or disk is full" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False
