"""Translation of S3 / botocore / aiohttp failures into ``cloudckpt.errors``, and which of them
are retried.

Retried: HTTP 500/502/503/504/429, throttling codes (SlowDown, ...), request timeouts, BadDigest
(a body damaged in transit), ConditionalRequestConflict (concurrent conditional writes),
connection resets, refused or dropped connections, truncated bodies and attempts past their cap.
Never retried: 403 (AccessDenied), 404 (ObjectNotFound), 412 (ObjectExists for a create,
otherwise StorageError), 416 (InvalidRange), missing credentials (ConfigError), TLS failures (an
untrusted certificate is a ConfigError saying how to trust a private CA), other 4xx.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import botocore.exceptions as bex

from cloudckpt.errors import (
    AccessDenied,
    BucketNotFound,
    CloudCkptError,
    ConfigError,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    StorageError,
)
from cloudckpt.http_numbers import http_int
from cloudckpt.storage.retry import AttemptTimeout, Verdict
from cloudckpt.storage.s3.client import SendStall

#: Error codes that name a transient server condition: the one list of them, used both for whole
#: requests (``classify``) and for the per-key errors of a DeleteObjects answer.
RETRIABLE_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "BadDigest",
        "ConditionalRequestConflict",
        "OperationAborted",
        "IncompleteBody",
        "XAmzContentSHA256Mismatch",
        "EC2ThrottledException",
    }
)
RETRIABLE_STATUS = frozenset({429, 500, 502, 503, 504})

#: Error code -> error class, for codes that are never retried.
CODE_TABLE: dict[str, type[StorageError]] = {
    "AccessDenied": AccessDenied,
    "SignatureDoesNotMatch": AccessDenied,
    "InvalidAccessKeyId": AccessDenied,
    "InvalidToken": AccessDenied,
    "ExpiredToken": AccessDenied,
    "TokenRefreshRequired": AccessDenied,
    "AllAccessDisabled": AccessDenied,
    "AccountProblem": AccessDenied,
    "InvalidSecurity": AccessDenied,
    "InvalidObjectState": AccessDenied,
    "NoSuchKey": ObjectNotFound,
    "NotFound": ObjectNotFound,
    "NoSuchUpload": ObjectNotFound,
    "NoSuchBucket": BucketNotFound,
    "InvalidRange": InvalidRange,
}
STATUS_TABLE: dict[int, type[StorageError]] = {
    403: AccessDenied,
    404: ObjectNotFound,
    416: InvalidRange,
}

#: Operations whose 412 means "the key already exists".
CREATE_OPS = frozenset({"put", "complete_multipart", "probe"})


class TruncatedBody(ConnectionError):
    """A response body ended before its Content-Length (retried). Messages name the object
    and the byte range where the caller knows them."""


class TransientServerError(ConnectionError):
    """A server answer that asks for another try (per-key errors of DeleteObjects, ...)."""


_TRANSPORT_ERRORS = (
    bex.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError...
    bex.HTTPClientError,  # ReadTimeoutError and the rest of the transport failures
    bex.ResponseStreamingError,
    bex.IncompleteReadError,
    aiohttp.ClientError,  # ClientPayloadError, ServerDisconnectedError, ClientOSError
    ConnectionError,  # resets, broken pipes, TruncatedBody
    asyncio.TimeoutError,
    TimeoutError,
    AttemptTimeout,
    asyncio.IncompleteReadError,
)


def is_retriable(code: str, status: int = 0) -> bool:
    """Whether an S3 error (code, HTTP status) names a transient condition worth another try."""
    return code in RETRIABLE_CODES or (status in RETRIABLE_STATUS and code not in CODE_TABLE)


def error_code(exc: bex.ClientError) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a ClientError ('' / 0 when absent)."""
    resp = getattr(exc, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", "") or "")
    status = http_int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)) or 0
    if not status:
        status = http_int(code) or 0
    return code, status


def untrusted_certificate(exc: bex.SSLError) -> ConfigError | None:
    """A one-line ``ConfigError`` for a server certificate that failed verification (None for
    other TLS failures)."""
    cause = exc.kwargs.get("error")
    cert_error = getattr(cause, "certificate_error", cause)  # aiohttp's, else the ssl error
    if not isinstance(cert_error, ssl.SSLCertVerificationError):
        if "CERTIFICATE_VERIFY_FAILED" not in str(exc):
            return None
        reason = "certificate verify failed"
    else:
        reason = cert_error.verify_message or cert_error.reason or "certificate verify failed"
    url = urlsplit(str(exc.kwargs.get("endpoint_url") or ""))
    endpoint = f"{url.scheme}://{url.netloc}" if url.netloc else "the S3 endpoint"
    if "mismatch" in reason or "not valid for" in reason:
        fix = "use the host name the certificate was issued for in the endpoint URL"
    else:
        fix = (
            "for a private CA, set AWS_CA_BUNDLE (or ca_bundle in the AWS profile) to its "
            "PEM file, or pass StorageOptions(verify_tls='/path/to/ca.pem')"
        )
    return ConfigError(f"the TLS certificate of {endpoint} is not trusted ({reason}): {fix}")


def _bucket_of(where: str) -> str:
    """The bucket of an ``s3://bucket/...`` location ('?' when it is not one)."""
    return where.removeprefix("s3://").partition("/")[0] if where.startswith("s3://") else "?"


def cause_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of the server answer behind ``exc``: ``exc`` itself or the
    ``ClientError`` it was raised from ('' / 0 when there is none)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, bex.ClientError):
            return error_code(cur)
        cur, seen = cur.__cause__, seen + 1
    return "", 0


def is_not_implemented(exc: BaseException) -> bool:
    """Whether ``exc`` is the server saying it does not implement the request (501
    NotImplemented): the caller may fall back to another request form."""
    code, status = cause_code(exc)
    return code == "NotImplemented" or status == 501


@dataclass(frozen=True)
class Endpoint:
    """Where a store's requests go, and as whom: for messages.

    ``url``: the endpoint URL (None until known); ``source``: the setting that named it
    (``aws_config.endpoint_source``: ``"AWS_ENDPOINT_URL"``, ``"StorageOptions.endpoint_url"``,
    ``"endpoint_url of AWS profile 'p'"``, ...; ``""``: none, botocore's default, i.e. AWS S3;
    before the client exists the profile is not read); ``aws``: whether ``url`` is AWS S3's own;
    ``access_key_id``: the id of the credentials in use (never the secret)."""

    url: str | None = None
    source: str = ""
    aws: bool = False
    access_key_id: str | None = None

    def describe(self) -> str:
        """``"endpoint http://host:port (from AWS_ENDPOINT_URL)"``; for AWS S3 reached because
        nothing was configured, also how to point elsewhere."""
        where = f"endpoint {self.url}" if self.url else "the default endpoint"
        if self.source:
            return f"{where} (from {self.source})"
        if self.aws or self.url is None:
            return (
                f"{where}: AWS S3, as no endpoint is configured (for another S3-compatible "
                "store set AWS_ENDPOINT_URL or StorageOptions(endpoint_url=...))"
            )
        return f"{where} (from the AWS profile)"

    def key_words(self) -> str:
        return (
            f"access key id {self.access_key_id!r}"
            if self.access_key_id
            else "the access key id in use"
        )


#: Codes that say the credentials themselves were refused, with what to check.
_REFUSED = {
    "SignatureDoesNotMatch": "the secret key does not match {key} (the request signature is "
    "wrong): check AWS_SECRET_ACCESS_KEY, or the profile's "
    "aws_secret_access_key, for that key",
    "InvalidAccessKeyId": "{key} is unknown to {endpoint}: check AWS_ACCESS_KEY_ID or "
    "AWS_PROFILE, and that the key belongs to this endpoint",
    "InvalidToken": "the session token of {key} is invalid: refresh the temporary credentials "
    "(AWS_SESSION_TOKEN, aws sso login, the role)",
    "ExpiredToken": "the session token of {key} has expired: refresh the temporary credentials "
    "(AWS_SESSION_TOKEN, aws sso login, the role)",
    "TokenRefreshRequired": "the session token of {key} must be refreshed: refresh the "
    "temporary credentials (AWS_SESSION_TOKEN, aws sso login, the role)",
}
_BARE_403 = frozenset({"", "403", "Forbidden"})


def is_bare_403(exc: BaseException) -> bool:
    """A 403 without an error code (HEAD answers have no body to carry one)."""
    if not isinstance(exc, bex.ClientError):
        return False
    code, status = error_code(exc)
    return status == 403 and code in _BARE_403


def _denied_message(op: str, name: str, code: str, message: str, endpoint: Endpoint) -> str:
    key = endpoint.key_words()
    where = endpoint.url or "the endpoint"
    if code in _REFUSED:
        what = _REFUSED[code].format(key=key, endpoint=where)
        return f"{op}{name}: the credentials were refused (403 {code}): {what}"
    if code in _BARE_403:
        return (
            f"{op}{name}: access denied or credentials refused (403 without a reason): "
            f"check {key} and its secret key, and that this identity may {op} here "
            f"({endpoint.describe()})"
        )
    return (
        f"{op}{name}: access denied (403 {code}: {message}): {key} may not {op} here: "
        "check that identity's permissions (IAM or bucket policy; a read-only key cannot "
        "save or delete)"
    )


def _is_stall(exc: BaseException) -> bool:
    """An attempt that got no answer at all: a connect timeout, or silence past the read
    timeout (the server taking no byte of the request body, no answer, or a body that stops)."""
    return isinstance(
        exc,
        (
            bex.ConnectTimeoutError,
            bex.ReadTimeoutError,
            SendStall,
            aiohttp.ServerTimeoutError,
            aiohttp.ConnectionTimeoutError,
        ),
    )


def classify(
    exc: BaseException, op: str, key: str | None, where: str, endpoint: Endpoint | None = None
) -> Verdict:
    """The ``Verdict`` for one failed S3 attempt of operation ``op`` on ``key`` (``where`` names
    the object in messages; ``endpoint``, where the request went, for refusals)."""
    name = f" {where}"
    endpoint = endpoint or Endpoint()
    if isinstance(exc, CloudCkptError):
        return Verdict(False)
    if isinstance(exc, bex.ClientError):
        code, status = error_code(exc)
        message = str(exc.response.get("Error", {}).get("Message", "") or code or status)
        if is_retriable(code, status):
            return Verdict(True, reason=f"{status} {code}".strip())
        if (CODE_TABLE.get(code) or STATUS_TABLE.get(status)) is AccessDenied:
            return Verdict(
                False,
                AccessDenied(
                    _denied_message(op, name, code, message, endpoint), key=key, operation=op
                ),
            )
        if status == 412 or code == "PreconditionFailed":
            if op in CREATE_OPS:
                return Verdict(
                    False,
                    ObjectExists(f"{op}{name}: the object already exists", key=key, operation=op),
                )
            return Verdict(
                False, StorageError(f"{op}{name}: precondition failed", key=key, operation=op)
            )
        cls = CODE_TABLE.get(code) or STATUS_TABLE.get(status) or StorageError
        what = " ".join(str(x) for x in (status or "", code) if x)
        if cls is BucketNotFound:
            message = (
                f"the bucket {_bucket_of(where)!r} does not exist: check the bucket name "
                "in the URL (and the endpoint), or create the bucket"
            )
        return Verdict(False, cls(f"{op}{name}: {what}: {message}", key=key, operation=op))
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return Verdict(
            False,
            ConfigError(
                "no usable AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or StorageOptions(access_key_id=..., secret_access_key=...)"
            ),
        )
    if isinstance(
        exc,
        (
            bex.NoRegionError,
            bex.ParamValidationError,
            bex.UnknownEndpointError,
            bex.InvalidEndpointConfigurationError,
            bex.InvalidRegionError,
            bex.ProfileNotFound,
            bex.InvalidConfigError,
        ),
    ):
        return Verdict(False, ConfigError(f"{op}{name}: {exc}"))
    if isinstance(exc, bex.SSLError):
        untrusted = untrusted_certificate(exc)
        if untrusted is not None:
            return Verdict(False, untrusted)
        return Verdict(
            False, StorageError(f"{op}{name}: TLS failure: {exc}", key=key, operation=op)
        )
    if isinstance(exc, _TRANSPORT_ERRORS):
        return Verdict(True, reason=f"{type(exc).__name__}: {exc}"[:200], stalled=_is_stall(exc))
    if isinstance(exc, bex.BotoCoreError):
        return Verdict(False, StorageError(f"{op}{name}: {exc}", key=key, operation=op))
    return Verdict(False)
