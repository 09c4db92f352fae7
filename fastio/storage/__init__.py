"""Bytes by URL: local paths and ``file://``, ``s3://bucket/prefix`` (S3 and S3-compatible stores), and the
node-local cache that object-store datasets are read through.

``open_storage(dest, storage_options)`` is the entry point; see :mod:`fastio.storage.options` for where
endpoint, region and credentials come from, :mod:`fastio.storage.retry` for what is retried, and
:mod:`fastio.storage.lease` for the lease that keeps one writer per object-store prefix.
"""

from fastio.storage.base import LocalStorage, ObjectInfo, S3Storage, Storage, open_storage
from fastio.storage.options import StorageOptions
from fastio.storage.url import Location, is_remote, local_or_url, parse_location

__all__ = ["Location", "LocalStorage", "ObjectInfo", "S3Storage", "Storage", "StorageOptions", "is_remote",
           "local_or_url", "open_storage", "parse_location"]
