"""Exceptions that reach users as one line naming the offending file, shard, key or field."""

__all__ = ["FastioError", "DatasetError", "ConvertError", "LoaderStateError", "CheckpointError"]


class FastioError(Exception):
    """Bad input or state. The CLI prints ``str(err)`` on one line and exits with code 2."""


class DatasetError(FastioError):
    """A fastio dataset (DEST) is missing, incomplete, corrupt or asked for something it lacks."""


class ConvertError(FastioError):
    """``fastio convert`` cannot proceed: bad SOURCE, bad DEST or a sample that failed with --on-error fail."""


class LoaderStateError(FastioError):
    """A loader ``state_dict`` does not fit the loader it is loaded into."""


class CheckpointError(FastioError):
    """A checkpoint cannot be written, found or restored."""
