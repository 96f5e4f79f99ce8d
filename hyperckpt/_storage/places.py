"""Which storage a path names: a local directory, or a prefix in object storage.

Every entry point that takes a path asks here first, so a URL no store serves is refused
before anything is read or written: a bucket URL handed to a local writer would otherwise
become a local folder named ``s3:`` on one node's disk.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.protocol import Storage
from hyperckpt._storage.remote import SCHEMES, S3Storage
from hyperckpt.errors import CheckpointError

__all__ = ["READ_SCHEMES", "WRITE_SCHEMES", "is_remote", "local_path", "storage_at", "url_scheme"]

#: The URL schemes whose objects are read (``s3://bucket/prefix``).
READ_SCHEMES: Final = tuple(scheme.removesuffix("://") for scheme in SCHEMES)
#: The URL schemes written to: none yet, checkpoints are written to local directories.
WRITE_SCHEMES: Final[tuple[str, ...]] = ()
#: What looks like a URL: a scheme, a colon and a slash (``s3:/b/p`` is what
#: ``pathlib.Path("s3://b/p")`` makes of one).  RFC 3986's scheme characters.
_URL: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):/")
#: The usual tools that copy a checkpoint from each store and to it.
_COPY: Final = {
    "s3": ("aws s3 cp --recursive",) * 2,
    "gs": ("gcloud storage cp -r",) * 2,
    "gcs": ("gcloud storage cp -r",) * 2,
    "az": ("azcopy copy --recursive",) * 2,
    "abfs": ("azcopy copy --recursive",) * 2,
    "abfss": ("azcopy copy --recursive",) * 2,
    "hf": ("huggingface_hub.snapshot_download", "huggingface_hub.upload_folder"),
}


def url_scheme(path: object) -> str | None:
    """The scheme of a path that looks like a URL (``"s3"`` for ``s3://b/p`` and for the
    ``s3:/b/p`` a :class:`pathlib.Path` makes of it; ``"S3"`` for ``S3://b``), else ``None``.
    """
    if not isinstance(path, str | os.PathLike):
        return None
    text = os.fspath(path)
    if not isinstance(text, str):
        return None
    found = _URL.match(text)
    return None if found is None else found.group(1)


def is_remote(path: object) -> bool:
    """Whether ``path`` names objects in a bucket to read (``s3://bucket/prefix``).

    Every read entry point asks this before it opens anything, so a path that looks like a
    URL of anything else (another scheme, upper case, a ``pathlib.Path`` that folded the
    ``//``) is refused here rather than looked up as a local folder.

    Raises:
        CheckpointError: ``path`` looks like a URL that is not read (``path.unsupported_url``).
    """
    scheme = url_scheme(path)
    if scheme is None:
        return False
    if isinstance(path, str) and scheme in READ_SCHEMES and path.startswith(f"{scheme}://"):
        return True
    assert isinstance(path, str | os.PathLike), "url_scheme found a scheme in a path"
    raise _unsupported("the checkpoint path", path, scheme, READ_SCHEMES, "read")


def local_path(name: str, path: str | os.PathLike[str], *, writes: bool) -> Path:
    """``path`` as a local :class:`~pathlib.Path`, refusing anything that looks like a URL.

    Args:
        name: The argument, for the message (``"path"``, ``"output"``, ``"like"``).
        path: What the caller gave.
        writes: Whether it is written to (then no bucket is served yet) or only read.

    Raises:
        CheckpointError: ``path`` looks like a URL (``path.unsupported_url``) or is the
            empty string (``path.empty``); nothing was read or written.
    """
    if os.fspath(path) == "":
        # Path("") is the working directory: an unset variable would write into it.
        raise CheckpointError(
            f"{name}='': the empty string is not a path (pathlib reads it as the working "
            f"directory, so an unset variable would write there): pass the directory you "
            f"mean, '.' for the working directory",
            path="''",
            rule="path.empty",
        )
    scheme = url_scheme(path)
    if scheme is not None:
        served = WRITE_SCHEMES if writes else ()
        raise _unsupported(name, path, scheme, served, "written" if writes else "read")
    local = Path(path)
    if writes and local.name in ("", ".."):
        # ".", ".." or "/" named by itself: a write's temporary directory is made beside its
        # destination, which needs the directory's own name and parent.
        return local.resolve()
    return local


def storage_at(root: str | os.PathLike[str]) -> Storage:
    """The storage of the checkpoint at ``root``: :class:`S3Storage` for ``s3://bucket/prefix``,
    else :class:`LocalStorage` for a local directory.

    Raises:
        CheckpointError: A URL that is not read, an ``s3://`` URL without a bucket, or one
            without the ``s3`` extra.
    """
    if is_remote(root):
        return S3Storage(str(root))
    return LocalStorage(root)


def _unsupported(
    name: str, path: str | os.PathLike[str], scheme: str, served: tuple[str, ...], verb: str
) -> CheckpointError:
    """The refusal of a URL-looking ``path``: what it is, what is served, what to do."""
    text = os.fspath(path)
    lower = scheme.lower()
    rest = text[len(scheme) + 1 :]
    reads = verb == "read"
    if lower != scheme and lower in served:
        why = f"URL schemes are lower-case here: write {lower}:{rest}"
    elif lower in served and not rest.startswith("//"):
        why = (
            f"it looks like the URL {lower}:/{rest} with a slash lost (pathlib.Path folds "
            "'//' into '/'): pass the URL as a str"
        )
    elif lower == "file":
        local = rest[2:] if rest.startswith("///") else rest
        why = f"pass the local path {local!r} instead of a file URL"
    else:
        tools = _COPY.get(lower)
        how = f" ({tools[0 if reads else 1]})" if tools else ""
        if reads:
            why = f"copy the checkpoint to a local or mounted directory first{how} and pass that"
        else:
            why = f"write to a local or mounted directory, then upload it{how}"
    kinds = ", ".join(f"{s}://" for s in served)
    where = f"local directories and {kinds} are" if served else "only local directories are"
    return CheckpointError(
        f"{name} {text!r} looks like a URL of scheme {scheme!r}, which is not {verb} here "
        f"({where}); {why}. Nothing was {verb}. A local directory whose name holds ':/' is "
        "given by its absolute path.",
        path=text,
        rule="path.unsupported_url",
    )
