"""What one start of weed is told: its credentials (the identities file), its command line, its
environment, and its watchdog's command line (used by
:mod:`cloudckpt.testing.servers.seaweed.server`; never imported by library code).

Secrets are written only to the 0600 identities file, never to a command line; ``AWS_*`` (and
weed's own ``S3_BUCKET`` / ``S3_TABLE_BUCKET``) never reach weed's environment.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from cloudckpt.testing.servers.seaweed.host import (
    GRPC_OFFSET,
    GRPC_SOCKET_SERVICES,
    WATCHDOG_SCRIPT,
)
from cloudckpt.testing.servers.tlsca import TLSFiles


def new_keys() -> dict[str, str]:
    """Fresh random keys of the admin and read-only identities, named as S3ServerInfo's fields."""
    return {
        "access_key": "CK" + secrets.token_hex(9).upper(),
        "secret_key": secrets.token_urlsafe(30),
        "readonly_access_key": "CR" + secrets.token_hex(9).upper(),
        "readonly_secret_key": secrets.token_urlsafe(30),
    }


def write_identities(path: Path, keys: Mapping[str, str]) -> None:
    """Write weed's ``-s3.config`` file (mode 0600, created exclusively): one admin identity
    (Admin, Read, List, Tagging, Write) and one read-only identity (Read, List)."""
    identities = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": keys["access_key"], "secretKey": keys["secret_key"]}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {
                "name": "readonly",
                "credentials": [
                    {
                        "accessKey": keys["readonly_access_key"],
                        "secretKey": keys["readonly_secret_key"],
                    }
                ],
                "actions": ["Read", "List"],
            },
        ]
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(identities, f)


def weed_argv(
    *,
    weed: str,
    work: Path,
    host: str,
    ports: Mapping[str, int],
    identities: Path,
    s3_auto_create_bucket: bool,
    tls: TLSFiles | None,
) -> list[str]:
    """The command line of ``weed mini`` in the work directory ``work`` (data in ``work/data``,
    logs and local sockets in ``work/log``), every port explicit; https on ``ports["s3https"]``
    with the files of ``tls`` when given."""
    argv = [
        weed,
        f"-logdir={work / 'log'}",
        "mini",
        f"-dir={work / 'data'}",
        f"-ip={host}",
        f"-ip.bind={host}",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",  # nobody to drain: stop in ~1 s instead of ~2 s
        f"-filer.localSocket={work / 'log' / 'filer.sock'}",
        f"-s3.localSocket={work / 'log' / 's3.sock'}",
        f"-s3.config={identities}",
        f"-s3.autoCreateBucket={'true' if s3_auto_create_bucket else 'false'}",
        f"-webdav.port={ports['webdav']}",
    ]
    for service in GRPC_SOCKET_SERVICES:  # (webdav has no gRPC port)
        argv += [
            f"-{service}.port={ports[service]}",
            f"-{service}.port.grpc={ports[service] + GRPC_OFFSET}",
        ]
    if tls is not None:
        argv += [
            f"-s3.cert.file={tls.cert_file}",
            f"-s3.key.file={tls.key_file}",
            f"-s3.port.https={ports['s3https']}",
        ]
    return argv


def weed_environment() -> dict[str, str]:
    """This process's environment without ``AWS_*``, ``S3_BUCKET`` and ``S3_TABLE_BUCKET``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.pop("S3_BUCKET", None)
    env.pop("S3_TABLE_BUCKET", None)
    return env


def watchdog_argv(weed: str, workdir: str, sockets: Sequence[str]) -> list[str]:
    """The command line of the watchdog of one start (see ``watchdog``'s docstring)."""
    return [sys.executable, "-I", WATCHDOG_SCRIPT, str(os.getpid()), weed, workdir, *sockets]
