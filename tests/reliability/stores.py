"""Reaching a checkpoint's objects behind cloudckpt's back (boto3 for S3, the filesystem for
file://), and running the ``cloudckpt`` command as a subprocess."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.cli_forkserver import run_cli

REPO = str(Path(__file__).resolve().parents[2])


class RawCheckpoint:
    """Raw bytes of the objects of one checkpoint (``url``: s3://bucket/prefix or a path)."""

    def __init__(self, url: str, s3_server=None):
        self.url = url
        self.s3_server = s3_server
        if url.startswith("s3://"):
            self.bucket, _, self.prefix = url[len("s3://") :].partition("/")
            self.client = s3_server.boto3_client()
        else:
            self.root = Path(url[len("file://") :] if url.startswith("file://") else url)

    def read(self, key: str) -> bytes:
        if self.url.startswith("s3://"):
            return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")[
                "Body"
            ].read()
        return (self.root / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        if self.url.startswith("s3://"):
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)
            return
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def flip(self, key: str, offset: int) -> bytes:
        """Flip every bit of one byte; returns the original object."""
        original = self.read(key)
        data = bytearray(original)
        data[offset] ^= 0xFF
        self.write(key, bytes(data))
        return original

    def truncate(self, key: str, size: int) -> bytes:
        original = self.read(key)
        self.write(key, original[:size])
        return original


def cli_env(s3_server=None, **overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if s3_server is not None:
        env.update(s3_server.env())
    env.update(
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        CLOUDCKPT_DEBUG="",
        PYTHONPATH=REPO,
    )
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def cli(s3_server, *args, **env_overrides) -> subprocess.CompletedProcess:
    """``python -m cloudckpt ARGS`` with the server's credentials in the environment (a child
    of the test process's CLI fork server: the same process, without the imports' seconds)."""
    return run_cli(args, cwd=REPO, env=cli_env(s3_server, **env_overrides), timeout=120)
