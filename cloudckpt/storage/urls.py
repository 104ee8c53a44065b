"""Store URLs: the one parser every entry point uses (``open_store``, ``shared_store``, the
manager, the CLI).

A store URL is exactly one of:

- ``s3://BUCKET`` or ``s3://BUCKET/PATH``: a prefix of an S3 bucket. ``s3://BUCKET`` (with or
  without a trailing slash) is the bucket's root, a valid checkpoint or run root like any prefix.
  ``s3://`` with no bucket is refused.
- ``file:///ABSOLUTE/PATH`` (``file://localhost/...`` too): a local directory.
- a plain path, absolute or relative: a local directory.

Anything else that begins like a URL scheme (letters, digits, ``+ - .`` then ``:``) is refused
with a ``ConfigError`` that says what to write instead: ``s3:/b/x``, ``s3:b/x``, ``S3://b/x``,
``s3a://b/x``, ``gs://b/x``, ``http://host/x``, ``C:\\x``, ``name:x``... so a typo never
becomes a local folder named ``s3:``. A local folder whose name contains a colon is reachable as
``./name:x`` or by its absolute path. Pure (no I/O).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlparse

from cloudckpt.errors import ConfigError

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$", re.IGNORECASE)

#: Schemes people reach for, with what to do instead.
_OTHER_STORES = {
    "gs": "for Google Cloud Storage use its S3-compatible API: AWS_ENDPOINT_URL="
    "https://storage.googleapis.com with HMAC keys, and s3://BUCKET/PATH",
    "gcs": "for Google Cloud Storage use its S3-compatible API: AWS_ENDPOINT_URL="
    "https://storage.googleapis.com with HMAC keys, and s3://BUCKET/PATH",
    "http": "an endpoint is not a checkpoint URL: set AWS_ENDPOINT_URL (or "
    "StorageOptions(endpoint_url=...)) to the server and use s3://BUCKET/PATH",
    "https": "an endpoint is not a checkpoint URL: set AWS_ENDPOINT_URL (or "
    "StorageOptions(endpoint_url=...)) to the server and use s3://BUCKET/PATH",
}
_S3_LIKE = ("s3", "s3a", "s3n")
_USE = "use s3://BUCKET/PATH, file:///ABSOLUTE/PATH or a plain path"


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``kind`` is ``"s3"`` (``bucket``, ``prefix``: "" or "a/b/") or
    ``"local"`` (``path``). ``url`` is the text that was parsed."""

    kind: Literal["s3", "local"]
    url: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""

    @property
    def bucket_url(self) -> str:
        """``s3://BUCKET`` of an S3 URL."""
        return f"s3://{self.bucket}"


def _text(url: object) -> str:
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise ConfigError(f"a store URL must be a string or a path, not {type(url).__name__}")
    return url


def parse_store_url(url: str | os.PathLike[str]) -> StoreURL:
    """Parse ``url`` (see the module docstring); ``ConfigError`` with a hint otherwise."""
    text = _text(url)
    if not text.strip():
        raise ConfigError("empty store URL: " + _USE)
    if text.startswith("s3://"):
        bucket, prefix = parse_s3_url(text)
        return StoreURL("s3", text, bucket=bucket, prefix=prefix)
    if text.startswith("file:"):
        return StoreURL("local", text, path=_file_path(text))
    m = _SCHEME_RE.match(text)
    if m is not None:
        raise ConfigError(_scheme_hint(text, m.group(1)))
    if "\0" in text:
        raise ConfigError(f"a path cannot contain a NUL character: {text!r}")
    return StoreURL("local", text, path=text)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")``; ``s3://bucket`` ->
    ``("bucket", "")`` (the bucket root)."""
    if not url.startswith("s3://"):
        raise ConfigError(f"not an s3:// URL: {url!r}")
    parsed = urlparse(url)
    if not parsed.netloc:
        raise ConfigError(f"{url!r} names no bucket: write s3://BUCKET or s3://BUCKET/PATH")
    if parsed.query or parsed.fragment or "@" in parsed.netloc:
        raise ConfigError(f"s3 URLs take no query, fragment or credentials: {url!r}")
    bucket = parsed.netloc
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(
            f"bad bucket name {bucket!r} in {url!r} (3-255 letters, digits, '.', '-', '_')"
        )
    prefix = parsed.path.strip("/")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", ".."):
                raise ConfigError(
                    f"bad path {parsed.path!r} in {url!r} (no empty, '.' or '..' segments)"
                )
        prefix += "/"
    return bucket, prefix


def _file_path(text: str) -> str:
    parsed = urlparse(text)
    if not text.startswith("file://"):
        raise ConfigError(
            f"malformed file URL {text!r}: write file:///ABSOLUTE/PATH "
            "(three slashes) or a plain path"
        )
    if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise ConfigError(f"unsupported file URL {text!r}: write file:///ABSOLUTE/PATH")
    path = unquote(parsed.path)
    if not path.startswith("/"):
        raise ConfigError(f"file URL needs an absolute path: {text!r}")
    if "\0" in path:
        raise ConfigError(f"a path cannot contain a NUL character: {text!r}")
    return path


def _scheme_hint(text: str, scheme: str) -> str:
    """The refusal of a scheme-like ``text`` that is neither ``s3://`` nor ``file://``."""
    lower = scheme.lower()
    rest = text[len(scheme) + 1 :]
    if lower in _S3_LIKE:
        target = "s3://" + rest.lstrip("/\\")
        guess = f"; did you mean {target!r}?" if target != "s3://" else ""
        return (
            f"malformed S3 URL {text!r}: an S3 URL is s3://BUCKET/PATH (lowercase s3, two "
            f"slashes){guess}"
        )
    if lower == "file":
        return (
            f"malformed file URL {text!r}: write file:///ABSOLUTE/PATH (lowercase) or a plain path"
        )
    if lower in _OTHER_STORES:
        return f"unsupported store URL {text!r}: {_OTHER_STORES[lower]}"
    if rest.startswith("//"):
        return (
            f"unsupported store URL {text!r}: {scheme}:// is not supported (cloudckpt "
            f"works with S3-compatible stores and local paths); {_USE}"
        )
    if len(scheme) == 1:
        return f"unsupported store URL {text!r}: Windows drive paths are not supported; {_USE}"
    return (
        f"unsupported store URL {text!r}: it starts like a URL scheme ({scheme}:); {_USE} "
        f"(./{text} for a local folder whose name contains ':')"
    )


def is_s3_url(url: object) -> bool:
    """Whether ``url`` is meant as an S3 URL (starts with ``s3://``; it may still be malformed)."""
    return isinstance(url, str) and url.startswith("s3://")
