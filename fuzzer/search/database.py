"""Hypothesis's example database as campaigns share it (`--db PATH|redis://host:port/n`), and the signature
index beside it that records which findings are saved already, across workers, runs and hosts."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Protocol

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from fuzzer.errors import UsageError

SIGNATURES_DIR = "attnfuzz-signatures"  # the signature index, inside a directory database
SIGNATURES_HASH = "attnfuzz:signatures"  # the signature index, in a Redis database


def is_redis(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://", "unix://"))


def _redis_client(spec: str):
    try:
        import redis
    except ImportError as e:
        raise UsageError(f"--db {spec}: a Redis database needs the `redis` package (pip install redis)") from e
    client = redis.Redis.from_url(spec)
    try:
        client.ping()
    except redis.RedisError as e:
        raise UsageError(f"--db {spec}: Redis does not answer ({type(e).__name__}: {e})") from e
    return client


def example_database(spec: str | None) -> ExampleDatabase | None:
    """`--db`: a directory (on a shared filesystem for several hosts) or redis://host:port/n. None: the
    campaign's own default (.attnfuzz/examples)."""
    if spec is None:
        return None
    if is_redis(spec):
        client = _redis_client(spec)
        from hypothesis.extra.redis import RedisExampleDatabase

        return RedisExampleDatabase(client)
    if "://" in spec:
        raise UsageError(f"--db {spec}: not a directory or redis://host:port/n")
    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--db {spec}: exists and is not a directory")
    return DirectoryBasedExampleDatabase(str(path))


class KeepStoredFailures(ExampleDatabase):
    """The database as a campaign sees it once some of its bugs are settled: those no longer raise (they are
    counted), so Hypothesis would take their stored failures for fixed and delete them, and the next run, or
    another worker, could not replay them. Deletes from the failures (a test's primary key) are dropped; the
    rest goes through (Hypothesis's .secondary and .pareto corpora stay bounded). A run's first batch, which
    settles nothing, still clears the failures of bugs that are really gone."""

    def __init__(self, db: ExampleDatabase) -> None:
        super().__init__()
        self.db = db

    def save(self, key: bytes, value: bytes) -> None:
        self.db.save(key, value)

    def fetch(self, key: bytes):
        return self.db.fetch(key)

    def delete(self, key: bytes, value: bytes) -> None:
        if key.endswith((b".secondary", b".pareto")):
            self.db.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:  # a shrink's downgrade: primary to secondary
        self.db.move(src, dest, value)


# -- the signature index: which findings are saved already, across workers, runs and hosts ----------------------

class SignatureIndex(Protocol):
    def claim(self, key: str, record: dict) -> dict | None:
        """Record `key` as saved (by `record`): None when this call recorded it, else the earlier record."""


class DirectorySignatureIndex:
    """One small JSON file per signature; os.link makes each claim atomic, on NFS too."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def claim(self, key: str, record: dict) -> dict | None:
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"
        tmp = self.path / f".{final.name}.{socket.gethostname()}.{os.getpid()}"
        tmp.write_text(json.dumps(dict(record, key=key), indent=1) + "\n")
        try:
            os.link(tmp, final)
            return None
        except FileExistsError:
            try:
                return json.loads(final.read_text())
            except (OSError, ValueError):
                return {"key": key}
        finally:
            tmp.unlink(missing_ok=True)


class RedisSignatureIndex:
    def __init__(self, client) -> None:
        self.client = client

    def claim(self, key: str, record: dict) -> dict | None:
        if self.client.hsetnx(SIGNATURES_HASH, key, json.dumps(dict(record, key=key))):
            return None
        return json.loads(self.client.hget(SIGNATURES_HASH, key) or b"{}")


def signature_index(spec: str) -> SignatureIndex:
    if is_redis(spec):
        return RedisSignatureIndex(_redis_client(spec))
    return DirectorySignatureIndex(Path(spec) / SIGNATURES_DIR)
