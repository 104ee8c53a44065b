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
from cloudckpt.storage.retry import AttemptTimeout, Verdict

#: Error codes that name a transient server condition: the one list of them, used both for whole
#: requests (``classify``) and for the per-key errors of a DeleteObjects answer.
RETRIABLE_CODES = frozenset({
    "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestThrottled", "RequestLimitExceeded", "TooManyRequests",
    "TooManyRequestsException", "BadDigest", "ConditionalRequestConflict", "OperationAborted",
    "IncompleteBody", "XAmzContentSHA256Mismatch", "EC2ThrottledException",
})
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
    """A response body ended before its Content-Length (retried)."""


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
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    if not status and code.isdigit():
        status = int(code)
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
        fix = ("for a private CA, set AWS_CA_BUNDLE (or ca_bundle in the AWS profile) to its "
               "PEM file, or pass StorageOptions(verify_tls='/path/to/ca.pem')")
    return ConfigError(f"the TLS certificate of {endpoint} is not trusted ({reason}): {fix}")


def classify(exc: BaseException, op: str, key: str | None, where: str) -> Verdict:
    """The ``Verdict`` for one failed S3 attempt of operation ``op`` on ``key`` (``where`` names
    the object in messages)."""
    name = f" {where}"
    if isinstance(exc, CloudCkptError):
        return Verdict(False)
    if isinstance(exc, bex.ClientError):
        code, status = error_code(exc)
        message = str(exc.response.get("Error", {}).get("Message", "") or code or status)
        if is_retriable(code, status):
            return Verdict(True, reason=f"{status} {code}".strip())
        if status == 412 or code == "PreconditionFailed":
            if op in CREATE_OPS:
                return Verdict(False, ObjectExists(f"{op}{name}: the object already exists",
                                                   key=key, operation=op))
            return Verdict(False, StorageError(f"{op}{name}: precondition failed", key=key,
                                               operation=op))
        cls = CODE_TABLE.get(code) or STATUS_TABLE.get(status) or StorageError
        what = " ".join(str(x) for x in (status or "", code) if x)
        return Verdict(False, cls(f"{op}{name}: {what}: {message}", key=key, operation=op))
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return Verdict(False, ConfigError(
            "no usable AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or StorageOptions(access_key_id=..., secret_access_key=...)"))
    if isinstance(exc, (bex.NoRegionError, bex.ParamValidationError, bex.UnknownEndpointError,
                        bex.InvalidEndpointConfigurationError, bex.InvalidRegionError,
                        bex.ProfileNotFound, bex.InvalidConfigError)):
        return Verdict(False, ConfigError(f"{op}{name}: {exc}"))
    if isinstance(exc, bex.SSLError):
        untrusted = untrusted_certificate(exc)
        if untrusted is not None:
            return Verdict(False, untrusted)
        return Verdict(False, StorageError(f"{op}{name}: TLS failure: {exc}", key=key,
                                           operation=op))
    if isinstance(exc, _TRANSPORT_ERRORS):
        return Verdict(True, reason=f"{type(exc).__name__}: {exc}"[:200])
    if isinstance(exc, bex.BotoCoreError):
        return Verdict(False, StorageError(f"{op}{name}: {exc}", key=key, operation=op))
    return Verdict(False)
