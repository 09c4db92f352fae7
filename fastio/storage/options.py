"""How to reach an object store: endpoint, region, credentials, retries and timeouts.

Values come from where the AWS tools look (``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
the profile ``AWS_PROFILE`` in ``~/.aws/credentials`` and ``~/.aws/config``), and ``storage_options=``
(or CLI flags) override them.
"""

from __future__ import annotations

import configparser
import dataclasses
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastio.errors import StorageOptionsError

__all__ = ["UPLOAD_RETRIES", "StorageOptions"]

UPLOAD_RETRIES = 6
"""Retries of one multipart-upload request when ``retries`` is None (uploads have no ``deadline_s``)."""


@dataclass(frozen=True)
class StorageOptions:
    """Connection settings of an object store; ``StorageOptions.resolve(overrides)`` fills them from the environment."""

    endpoint: str | None = None
    """Endpoint URL of an S3-compatible server (``http://`` works, e.g. MinIO or a test server); None: AWS."""
    region: str | None = None
    """Region (default ``us-east-1`` when none is configured)."""
    access_key_id: str | None = None
    """Access key; None with no secret either: the client's own chain (instance metadata, web identity)."""
    secret_access_key: str | None = None
    """Secret key belonging to ``access_key_id``."""
    session_token: str | None = None
    """Temporary-credential session token."""
    profile: str | None = None
    """Profile in ``~/.aws/credentials`` / ``~/.aws/config`` (default: ``AWS_PROFILE``, else ``default``)."""
    virtual_hosted: bool = False
    """Address buckets as ``bucket.endpoint`` instead of ``endpoint/bucket`` (path style, the default)."""
    retries: int | None = None
    """Attempts after the first for a transient fault (503 SlowDown, 5xx, timeouts, cut connections). None (the
    default): as many as fit in ``deadline_s``, so an endpoint that blips or throttles for tens of seconds
    costs time, not the run. Multipart uploads, which ``deadline_s`` does not bound, then retry each request
    up to :data:`UPLOAD_RETRIES` times (:attr:`upload_retries`)."""
    backoff_s: float = 0.1
    """First retry delay in seconds; doubles each retry (with full jitter), capped at ``backoff_max_s``."""
    backoff_max_s: float = 5.0
    """Largest retry delay in seconds."""
    timeout_s: float = 60.0
    """Timeout of one request (connect, send and read)."""
    deadline_s: float = 120.0
    """Longest time one read (GET, HEAD, LIST; small PUTs and DELETEs too) may take, its attempts and retry
    sleeps together, before it fails with a :class:`~fastio.errors.StorageError`. The first retry while a store
    is failing logs one warning (logger ``fastio.storage``) naming the URL, and the first answer after that
    one more (:mod:`fastio.storage.retry`). Multipart uploads are bounded by ``timeout_s`` per request and
    :attr:`upload_retries` instead."""
    connect_timeout_s: float = 5.0
    """Timeout of establishing a connection."""
    part_size: int = 16 << 20
    """Bytes per part of a multipart upload and per ranged GET of a parallel download."""
    concurrency: int = 8
    """Parts transferred at once by one upload or download."""
    lease_ttl_s: float = 60.0
    """Seconds a writer's lease on a prefix (``PREFIX/.fastio-lock``, :mod:`fastio.storage.lease`) lasts
    unless renewed; its holder renews it every third of that. A holder that dies without releasing it blocks
    other writers this long plus ``lease_skew_s`` (less on the same host or in a requeued Slurm job).
    0 turns the lease off, for stores that ignore conditional writes: one writer per prefix is then yours to keep."""
    lease_skew_s: float = 10.0
    """Seconds of clock difference between hosts tolerated when judging a lease expired: another writer takes
    it over only this long after the expiry its holder recorded (and after the server's last-modified time
    plus ``lease_ttl_s``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a YAML "120" or true: named here, not a TypeError further down
            value = getattr(self, f.name)
            if f.type in ("int", "float") and (isinstance(value, bool) or not isinstance(
                    value, numbers.Integral if f.type == "int" else numbers.Real)):
                kind = "an integer" if f.type == "int" else "a number"
                raise StorageOptionsError(f"{f.name} must be {kind}, got {value!r}")
        if self.retries is not None and (isinstance(self.retries, bool) or not isinstance(
                self.retries, numbers.Integral) or self.retries < 0):
            raise StorageOptionsError(f"retries must be None (until deadline_s) or an integer >= 0, got "
                                      f"{self.retries!r}")
        if not (0 <= self.backoff_s <= self.backoff_max_s):
            raise StorageOptionsError(f"backoff_s must be between 0 and backoff_max_s, got {self.backoff_s}")
        if not self.deadline_s > 0:
            raise StorageOptionsError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise StorageOptionsError(f"timeout_s and connect_timeout_s must be > 0, got {self.timeout_s}, "
                             f"{self.connect_timeout_s}")
        if self.part_size < 5 << 20:
            raise StorageOptionsError(f"part_size must be >= 5 MiB (the S3 minimum part), got {self.part_size}")
        if self.concurrency < 1:
            raise StorageOptionsError(f"concurrency must be >= 1, got {self.concurrency}")
        if not (self.lease_ttl_s == 0 or self.lease_ttl_s >= 1):
            raise StorageOptionsError(f"lease_ttl_s must be 0 (no lease) or >= 1 second, got {self.lease_ttl_s}")
        if self.lease_skew_s < 0:
            raise StorageOptionsError(f"lease_skew_s must be >= 0, got {self.lease_skew_s}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise StorageOptionsError(f"endpoint must be an http:// or https:// URL, got {self.endpoint!r}")

    @property
    def upload_retries(self) -> int:
        """Retries of one request of a multipart upload: ``retries``, or :data:`UPLOAD_RETRIES` when None."""
        return UPLOAD_RETRIES if self.retries is None else self.retries

    @classmethod
    def resolve(cls, overrides: StorageOptions | dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> StorageOptions:
        """The environment's settings (variables, then profile files) with ``overrides`` on top."""
        if isinstance(overrides, StorageOptions):
            return overrides
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise StorageOptionsError(f"storage_options has no {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(f.name for f in dataclasses.fields(cls))})")
        env = os.environ if env is None else env
        profile_name = overrides.get("profile") or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
        found = _profile(profile_name or "default", env, explicit=bool(profile_name))
        values: dict[str, Any] = {
            "endpoint": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or found.get("endpoint_url"),
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or found.get("region"),
            "profile": profile_name,
        }
        if env.get("AWS_ACCESS_KEY_ID"):
            values.update(access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                          session_token=env.get("AWS_SESSION_TOKEN"))
        else:
            values.update(access_key_id=found.get("aws_access_key_id"),
                          secret_access_key=found.get("aws_secret_access_key"),
                          session_token=found.get("aws_session_token"))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _profile(name: str, env: dict[str, str], explicit: bool) -> dict[str, str]:
    """The keys of profile ``name`` from the shared credentials and config files (credentials win)."""
    found: dict[str, str] = {}
    home = Path(env.get("HOME") or Path.home())
    files = [(Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"), f"profile {name}"),
             (Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"), name)]
    seen = False
    for path, section in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error as err:
            raise StorageOptionsError(f"{path}: cannot parse AWS profile file: {str(err).splitlines()[0]}") from None
        for sec in (section, name) if name == "default" else (section,):
            if parser.has_section(sec):
                seen = True
                found.update(parser.items(sec))
    if explicit and not seen:
        raise StorageOptionsError(f"profile {name!r} is in neither {files[0][0]} nor {files[1][0]}")
    return found
