"""The adapter to ``obstore`` (Rust ``object_store``): the only module that imports it.

Chosen by measurement on this project's machine (GET of 8 MiB objects from a loopback S3 server: obstore
~0.7-0.8 GB/s against boto3's ~0.45-0.6 GB/s, both limited by the Python test server) and for what it brings:
S3 and S3-compatible endpoints (plain HTTP too), GCS and Azure behind the same calls, native multipart
uploads, no Python in the data path. Reads run with obstore's own retries off: :mod:`fastio.storage.retry`
retries every call, so the bound and the error are fastio's; uploads keep obstore's per-request retries (a
faulted multipart part is retried alone), inside fastio's loop. Every obstore exception becomes
:class:`~fastio.storage.retry.Transient` or :class:`~fastio.storage.retry.Permanent` here; a refused
conditional write (HTTP 412, or 409 for a concurrent one) is a Permanent with ``precondition`` set.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    InvalidPathError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)
from obstore.store import S3Store

from fastio.storage.options import StorageOptions
from fastio.storage.retry import Permanent, Transient

__all__ = ["S3Client"]

_STATUS = re.compile(r"\b(?:status(?: code)?:?\s*|HTTP\s*)(\d{3})\b", re.IGNORECASE)


_CREDENTIAL_SERVICES = ("169.254.169.254", "169.254.170.2")  # EC2 instance metadata, ECS task credentials
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_CONNECT_STAGE = re.compile(r'ConnectError\(\s*"([^"]+)"')
_OS_REASON = re.compile(r'\b(?:message|error): "([^"]+)"')
_TLS_REASON = re.compile(r"\berror: (\w+)\(\s*(\w+)")  # rustls: InvalidMessage(InvalidContentType)
_TLS_REFUSALS = ("InvalidContentType", "InvalidCertificate", "UnknownIssuer", "HandshakeFailure",
                 "NotValidForName", "certificate verify failed")
"""A TLS handshake that retrying cannot cure: the server does not speak TLS, or its certificate is refused."""


def _cause(text: str) -> str:
    """Why a request got no answer, from the debug chain of an object_store HTTP error (its first line says only
    "error sending request"): ``timed out``, ``connect: Connection refused``, ``connect: dns error: ...``;
    "" when the chain names no HTTP error."""
    kind = _HTTP_KIND.search(text)
    if kind is None:
        return ""
    if kind[1] == "Timeout":
        return "timed out"
    stage, reason, tls = _CONNECT_STAGE.search(text), _OS_REASON.search(text), _TLS_REASON.search(text)
    said = [x for x in (stage[1] if stage and stage[1] != "tcp connect error" else "",
                        reason[1] if reason else f"{tls[1]}({tls[2]})" if tls else "") if x]
    return ": ".join([kind[1].lower(), *said])


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    # object_store messages are long multi-line chains; the status line, the server's code and, for a request that
    # got no answer, its cause are what matter
    status = _STATUS.search(text)
    code = re.search(r"<Code>([^<]+)</Code>", text)
    head = text.split("Debug source")[0].strip().splitlines()[0] if text else type(err).__name__
    head = re.sub(r"^.*?(Server returned|Error performing|error sending|request or response body)", r"\1", head)[:160]
    extra = ", ".join(x for x in (f"HTTP {status[1]}" if status else "", code[1] if code else "",
                                  "" if status else _cause(text)) if x)
    line = f"{head} ({extra})" if extra and extra not in head else head
    if any(host in text for host in _CREDENTIAL_SERVICES):  # the client's last resort for credentials failed
        return ("no credentials: none in storage_options, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile in "
                f"~/.aws, and the instance metadata service gave none ({line})")
    return line


_TRANSIENT_CODES = ("RequestTimeout", "OperationAborted", "Throttling", "ThrottlingException", "RequestThrottled",
                    "TooManyRequestsException", "RequestLimitExceeded")
"""S3 error codes sent with a 4xx status that retrying cures (as the AWS SDKs retry them): a request body that came
too slowly (400 RequestTimeout), a conflicting operation in progress (409 OperationAborted), throttling."""


def _retried_code(text: str) -> bool:
    code = re.search(r"<Code>([^<]+)</Code>", text)
    return code is not None and code[1] in _TRANSIENT_CODES


def _not_found(err: BaseException) -> str:
    """A 404's words: the bucket's absence (S3's NoSuchBucket) is not a missing object's."""
    return f"{'no such bucket' if 'NoSuchBucket' in str(err) else 'not found'} ({_first_line(err)})"


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except (NotFoundError, FileNotFoundError) as err:
        raise Permanent(_not_found(err), missing=True) from None
    except (AlreadyExistsError, PreconditionError) as err:
        raise Permanent(f"precondition failed ({_first_line(err)})", precondition=True) from None
    except (PermissionDeniedError, UnauthenticatedError, PermissionError) as err:
        raise Permanent(f"access denied ({_first_line(err)})") from None
    except (InvalidPathError, UnknownConfigurationKeyError) as err:
        raise Permanent(_first_line(err)) from None
    except BaseError as err:
        status = _STATUS.search(str(err))
        code = int(status[1]) if status else None
        if code is None and any(refusal in str(err) for refusal in _TLS_REFUSALS):
            raise Permanent("TLS handshake failed (the endpoint is https:// but the server does not speak TLS, or its "
                            f"certificate is not trusted): {_first_line(err)}") from None
        if "Received redirect" in str(err) or (code is not None and 300 <= code < 400):  # S3: PermanentRedirect
            raise Permanent("redirected: the bucket is in another region than the one configured (region=, "
                            f"AWS_REGION), or the endpoint is wrong ({_first_line(err)})") from None
        if code == 404:
            raise Permanent(_not_found(err), missing=True) from None
        if code == 412 or (code == 409 and "ConditionalRequestConflict" in str(err)):
            raise Permanent(f"precondition failed ({_first_line(err)})", precondition=True) from None
        if code is not None and 400 <= code < 500 and code not in (408, 429) and not _retried_code(str(err)):
            raise Permanent(_first_line(err)) from None
        raise Transient(_first_line(err)) from None
    except (OSError, TimeoutError) as err:  # raised while a response body streams in
        raise Transient(f"{type(err).__name__}: {err}") from None


class S3Client:
    """One bucket of an S3 or S3-compatible store; keys are full keys inside the bucket."""

    def __init__(self, bucket: str, options: StorageOptions):
        self.options = o = options
        config: dict[str, object] = {"region": o.region or "us-east-1",
                                     "virtual_hosted_style_request": o.virtual_hosted}
        if o.endpoint:
            config["endpoint"] = o.endpoint
        if o.access_key_id:
            config["access_key_id"] = o.access_key_id
            config["secret_access_key"] = o.secret_access_key or ""
            if o.session_token:
                config["session_token"] = o.session_token
        client = {"timeout": timedelta(seconds=o.timeout_s), "connect_timeout": timedelta(seconds=o.connect_timeout_s),
                  "allow_http": bool(o.endpoint and o.endpoint.startswith("http://"))}
        # Reads are retried by fastio (fastio.storage.retry: a cut body is retried too, attempts are counted).
        # Uploads are retried request by request inside obstore, so a 503 on part 7 of a multipart upload
        # retries that part, not the whole upload; fastio's loop still wraps what is left.
        backoff = {"init_backoff": timedelta(seconds=max(o.backoff_s, 0.001)),
                   "max_backoff": timedelta(seconds=max(o.backoff_max_s, 0.001)), "base": 2}
        with _translated():
            self._store = S3Store(bucket, config=config, client_options=client, retry_config={"max_retries": 0})
            self._put_store = S3Store(bucket, config=config, client_options=client, retry_config={
                "max_retries": o.upload_retries, "backoff": backoff,
                "retry_timeout": timedelta(seconds=o.timeout_s * (o.upload_retries + 1))})

    def get_buffer(self, key: str) -> memoryview:
        """The whole object as a read-only buffer over the client's memory (no copy into Python bytes)."""
        with _translated():
            return memoryview(obstore.get(self._store, key).bytes())

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or bytes ``[start, end)`` of it (a whole body is read; a cut one is Transient)."""
        with _translated():
            if start is None and end is None:
                return bytes(obstore.get(self._store, key).bytes())
            if end is None:
                return bytes(obstore.get(self._store, key, options={"range": {"offset": start}}).bytes())
            return bytes(obstore.get_range(self._store, key, start=start or 0, end=end))

    def head(self, key: str) -> int | None:
        """The object's size, or None if there is none."""
        try:
            with _translated():
                return int(obstore.head(self._store, key)["size"])
        except Permanent as err:
            if err.missing:
                return None
            raise

    def put_file(self, key: str, path: Path) -> None:
        o = self.options
        with _translated():
            obstore.put(self._put_store, key, Path(path), chunk_size=o.part_size, max_concurrency=o.concurrency)

    def put_bytes(self, key: str, data: bytes) -> None:
        with _translated():
            obstore.put(self._put_store, key, data, use_multipart=False)

    def put_if(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        """Write a small object only if none exists (``if_absent``: ``If-None-Match: *``) or only if its entity
        tag is still ``if_match`` (``If-Match``); returns the new entity tag. No retries inside the client: the
        caller's loop must tell a lost response from a refused write."""
        if if_absent == (if_match is not None):
            raise ValueError("put_if needs exactly one of if_absent=True and if_match=ETAG")
        mode = "create" if if_absent else {"e_tag": if_match}
        with _translated():
            result = obstore.put(self._store, key, data, mode=mode, use_multipart=False)
        if not result.get("e_tag"):
            raise Permanent(f"the store returned no entity tag for a conditional PUT of {key}")
        return str(result["e_tag"])

    def get_versioned(self, key: str) -> tuple[bytes, str, datetime] | None:
        """``(bytes, entity tag, last-modified time)`` of the object (one GET), or None if there is none."""
        try:
            with _translated():
                got = obstore.get(self._store, key)
                data = bytes(got.bytes())
        except Permanent as err:
            if err.missing:
                return None
            raise
        return data, str(got.meta.get("e_tag") or ""), got.meta["last_modified"]

    def list(self, prefix: str, limit: int | None = None) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix`` (a folder-like prefix ending in ``/``); with ``limit``,
        the first ``limit`` (S3 lists in key order; the pages after them are not asked for)."""
        with _translated():
            out: list[tuple[str, int]] = []
            for batch in obstore.list(self._store, prefix=prefix or None):
                out.extend((m["path"], int(m["size"])) for m in batch)
                if limit is not None and len(out) >= limit:
                    return out[:limit]
            return out

    def folders(self, prefix: str) -> list[str]:
        """The full keys of the common prefixes directly below ``prefix`` (one listing with a ``/`` delimiter)."""
        with _translated():
            return [str(p) for p in obstore.list_with_delimiter(self._store, prefix=prefix or None)["common_prefixes"]]

    def presign(self, keys: list[str], expires_s: float) -> list[str]:
        """Presigned GET URLs of ``keys`` (for tools without the credentials, e.g. ``curl``)."""
        with _translated():
            return list(obstore.sign(self._store, "GET", keys, timedelta(seconds=expires_s)))

    def delete(self, key: str) -> None:
        with _translated():
            obstore.delete(self._store, key)
