"""Exceptions that reach users as one line naming the offending file, shard, key or field.

:class:`FastioError` and its kinds: :class:`DatasetError` (:class:`MixtureError`, also a ``ValueError``: datasets that
cannot be read as one stream), :class:`ConvertError`, :class:`LoaderStateError`,
:class:`LoaderArgumentError` (also a ``TypeError``: another loader's argument, with fastio's equivalent),
:class:`PipelineMemoryError` (also a ``MemoryError``: a batch's outputs that do not fit, not bad data),
:class:`CheckpointError`, :class:`StorageError` (``url``, ``transient``, ``missing``) and
:class:`StorageOptionsError` (also a ``ValueError``: a storage setting that cannot be used); and
:func:`install_hint`, what a message says to add an optional dependency (fastio installs from its checkout,
docs/install.md); :func:`os_error_text`, what a message says of an ``OSError`` (the limit of open files named
where that is the cause); :func:`dali_reason` and :func:`dali_out_of_memory`, what a DALI error says in one line
and whether it is an allocation that failed. Imports nothing of fastio."""

import re

__all__ = ["FastioError", "DatasetError", "MixtureError", "ConvertError", "LoaderStateError", "LoaderArgumentError",
           "PipelineMemoryError", "CheckpointError", "StorageError", "StorageOptionsError", "install_hint",
           "dali_out_of_memory", "dali_reason", "os_error_text"]


def install_hint(extra: str) -> str:
    """How to add the optional dependencies of fastio's ``extra`` (``media``, ``tokens``): fastio is installed from
    its checkout, not from the package index (whose ``fastio`` is someone else's package)."""
    return f"pip install -e '.[{extra}]' in fastio's checkout, as docs/install.md says"


def os_error_text(err: OSError) -> str:
    """``err``'s words; for too many open files (EMFILE) also the limit and what holds them: a token Loader keeps
    each shard's ``.idx`` and ``.bin`` (and a chat shard's ``.mask``) open, so a dataset of many shards needs a
    limit above a few files a shard (``ulimit -n``)."""
    import errno

    text = err.strerror or str(err)
    if err.errno != errno.EMFILE:
        return text
    try:
        import resource

        limit = f" of {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    except (ImportError, OSError, ValueError):
        limit = ""
    return (f"{text}: this process reached its limit{limit} open files (ulimit -n); a token Loader keeps each "
            "shard's .idx and .bin, and a chat shard's .mask, open: raise the limit (ulimit -n 65536), or use "
            "fewer, larger shards")


class FastioError(Exception):
    """Bad input or state. The CLI prints ``str(err)`` on one line and exits with code 2."""


class DatasetError(FastioError):
    """A fastio dataset (DEST) is missing, incomplete, corrupt or asked for something it lacks."""


class MixtureError(DatasetError, ValueError):
    """Datasets that a :class:`fastio.Mixture` cannot read as one stream: token datasets tokenized with different
    tokenizers (an id would mean another token in each). Also a ``ValueError``, as for any bad argument."""


class ConvertError(FastioError):
    """``fastio convert`` cannot proceed: bad SOURCE, bad DEST or a sample that failed with --on-error fail."""


class LoaderStateError(FastioError):
    """A loader ``state_dict`` does not fit the loader it is loaded into."""


class LoaderArgumentError(FastioError, TypeError):
    """A Loader argument that another loader takes (``num_workers=``, ``pin_memory=``, ``shuffle=True``); the
    message names fastio's equivalent. Also a ``TypeError``, as for any unexpected argument."""


class LoaderClosedError(FastioError, ValueError):
    """A closed Loader asked to move or deliver (iteration, ``load_state_dict``, ``set_epoch``): only its
    ``state_dict`` (the last position) and ``close`` still answer."""


class PipelineMemoryError(FastioError, MemoryError):
    """A Loader's DALI pipeline ran out of memory (host or GPU) making a batch: the outputs asked for (the batch size,
    a kind's output size, a graph's operators) do not fit, whatever the samples. Also a ``MemoryError``."""


class CheckpointError(FastioError):
    """A checkpoint cannot be written, found or restored."""


class StorageError(FastioError):
    """Bytes at a URL cannot be read or written (missing, refused, or still failing after the retries).

    ``url`` is the object or prefix concerned; ``transient`` is True when the last failure was one that
    retrying could cure (5xx, throttling, timeouts, cut connections) and the retry bound ran out; ``missing``
    is True when the object does not exist (404); ``precondition`` when a conditional write was refused
    because the object exists or changed (412).
    """

    def __init__(self, message: str, url: str = "", transient: bool = False, missing: bool = False,
                 precondition: bool = False):
        super().__init__(message)
        self.url, self.transient, self.missing, self.precondition = url, transient, missing, precondition


class StorageOptionsError(FastioError, ValueError):
    """A storage setting that cannot be used (an endpoint without ``http://``, a timeout of 0...), from
    ``storage_options=``, a CLI flag or the environment. Also a ``ValueError``, as for any bad argument."""


_DALI_OPERATOR = re.compile(r"Error in \w+ operator `(?:nvidia\.dali\.)?([\w.]+)`")


def dali_reason(err: BaseException) -> str:
    """One line of what a DALI pipeline error says, for a message naming the batch: the operator and the
    first line after DALI's ``encountered:`` (``fn.decoders.video: Failed to create video decoder ...``; without
    an ``Assert on "..." failed:`` prefix), not its ``Critical error in pipeline:`` header; else the first line.
    ``encountered:`` is a line of its own after the stack DALI recorded where the graph was defined, else it ends the
    operator's line (a graph built without that record: :mod:`fastio.pipelines.untraced`)."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    lines = [line.strip() for line in text.splitlines()]
    op = _DALI_OPERATOR.search(text)
    at = next((k for k, line in enumerate(lines) if line.endswith("encountered:")), None)
    after = lines[at + 1:] if at is not None else []
    said = next((line for line in after if line and not line.startswith("C++ context")), None)
    if said is None:
        return next(line for line in lines if line)[:160]
    said = re.sub(r'^Assert on ".*?" failed: ', "", re.sub(r"^Error in thread \d+: (\[[^\]]*\] )?", "", said))
    return f"{op.group(1) + ': ' if op else ''}{said}"[:200]


_DALI_OUT_OF_MEMORY = re.compile(r"bad_alloc|out of memory|CUDA allocation failed|cudaErrorMemoryAllocation|"
                                 r"CUDA_ERROR_OUT_OF_MEMORY|DALI_ERROR_OUT_OF_MEMORY|OutOfMemoryError|"
                                 r"NVJPEG_STATUS_ALLOCATOR_FAILURE|Failed to allocate", re.IGNORECASE)
"""How DALI (2.4: the strings in libdali*.so), CUDA, nvJPEG and OpenCV inside it say an allocation failed."""


def dali_out_of_memory(err: BaseException) -> bool:
    """Whether a DALI pipeline error is an allocation that failed (host ``std::bad_alloc``, or the GPU's): the
    outputs do not fit, whatever the samples."""
    return _DALI_OUT_OF_MEMORY.search(str(err)) is not None
