"""Where a running local S3 endpoint is and how to sign requests to it (`S3ServerInfo`), and the
error of a test server that could not start (`S3ServerError`).

Returned by every test server (:mod:`cloudckpt.testing.servers.seaweed`,
:mod:`cloudckpt.testing.servers.moto`, the simulated cluster's); never imported by library code.
Secrets never appear in its repr.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["DEFAULT_BUCKET", "DEFAULT_REGION", "S3ServerError", "S3ServerInfo"]

DEFAULT_BUCKET = "cloudckpt-test"
DEFAULT_REGION = "us-east-1"


class S3ServerError(RuntimeError):
    """A local test S3 server could not be found, started or reached."""


@dataclass(frozen=True, kw_only=True)
class S3ServerInfo:
    """Where a running local S3 endpoint is and how to sign requests to it."""

    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = DEFAULT_REGION
    bucket: str = DEFAULT_BUCKET
    readonly_access_key: str
    readonly_secret_key: str = field(repr=False)
    https_endpoint_url: str | None = None
    ca_file: str | None = None

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point an S3 client at this endpoint (admin identity)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def readonly_env(self) -> dict[str, str]:
        """Like `env()`, with the read-only identity (Read, List: every write gets 403)."""
        return {
            **self.env(),
            "AWS_ACCESS_KEY_ID": self.readonly_access_key,
            "AWS_SECRET_ACCESS_KEY": self.readonly_secret_key,
        }

    def url(self, path: str = "") -> str:
        """`s3://<bucket>/<path>` (a leading slash in `path` is dropped)."""
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def boto3_client(
        self,
        *,
        readonly: bool = False,
        access_key: str | None = None,
        secret_key: str | None = None,
    ):
        """A path-style S3 client for this endpoint (admin identity unless told otherwise).

        It is the client ``boto3.client("s3", ...)`` returns, built with botocore directly (which
        aiobotocore brings): boto3 is not a dependency of cloudckpt, nor of its test extras."""
        from botocore.config import Config

        if readonly:
            access_key = access_key or self.readonly_access_key
            secret_key = secret_key or self.readonly_secret_key
        return _create_botocore_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path", "payload_signing_enabled": False},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                retries={"max_attempts": 2},
                connect_timeout=5,
                read_timeout=60,
                proxies={},
            ),
        )


_BOTOCORE_SESSION = None
_BOTOCORE_LOCK = threading.Lock()


def _create_botocore_client(service: str, **kwargs):
    """``boto3.client(service, **kwargs)`` without boto3: one shared botocore session (its loaded
    service models are reused, as boto3's default session does), clients created under a lock."""
    global _BOTOCORE_SESSION
    import botocore.session

    with _BOTOCORE_LOCK:
        if _BOTOCORE_SESSION is None:
            _BOTOCORE_SESSION = botocore.session.get_session()
        return _BOTOCORE_SESSION.create_client(service, **kwargs)
