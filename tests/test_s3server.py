"""The local SeaweedFS launcher: credentials, isolation, clean stop, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from cloudckpt.testing.s3server import S3Server, S3ServerInfo, start_s3_server

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    """True while `pid` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def _pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_until(predicate, limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _error_code(exc_info) -> str:
    return exc_info.value.response["Error"]["Code"]


def test_start_put_get_stop_leaves_nothing(record_property):
    server = S3Server(bucket="start-stop")
    info = server.start()
    pid, workdir = server.pid, server.workdir
    record_property("s3_server_start_seconds", round(server.start_seconds, 2))
    print(f"SeaweedFS ready after {server.start_seconds:.2f}s")
    try:
        client = info.boto3_client()
        client.put_object(Bucket=info.bucket, Key="a/b.bin", Body=b"hello")
        assert client.get_object(Bucket=info.bucket, Key="a/b.bin")["Body"].read() == b"hello"
        assert _alive(pid)
        assert pid in _pids_mentioning(workdir)  # weed, and its watchdog
    finally:
        server.stop()
    assert not _alive(pid)
    assert _pids_mentioning(workdir) == []
    assert not Path(workdir).exists()
    assert server.pid is None
    server.stop()  # idempotent


def test_two_servers_at_once_are_isolated():
    with S3Server(bucket="first") as one, S3Server(bucket="second") as two:
        assert one.endpoint_url != two.endpoint_url
        assert one.access_key != two.access_key
        one.boto3_client().put_object(Bucket="first", Key="k", Body=b"1")
        two.boto3_client().put_object(Bucket="second", Key="k", Body=b"2")
        assert one.boto3_client().get_object(Bucket="first", Key="k")["Body"].read() == b"1"
        assert two.boto3_client().get_object(Bucket="second", Key="k")["Body"].read() == b"2"
        assert [b["Name"] for b in one.boto3_client().list_buckets()["Buckets"]] == ["first"]
        crossed = two.boto3_client(access_key=one.access_key, secret_key=one.secret_key)
        with pytest.raises(ClientError) as exc:
            crossed.list_objects_v2(Bucket="second")
        assert _error_code(exc) == "InvalidAccessKeyId"


def test_wrong_secret_is_rejected(s3_server: S3ServerInfo):
    client = s3_server.boto3_client(secret_key="not-the-secret")
    with pytest.raises(ClientError) as exc:
        client.list_objects_v2(Bucket=s3_server.bucket)
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert _error_code(exc) in ("SignatureDoesNotMatch", "AccessDenied")


def test_readonly_identity_reads_but_cannot_write(s3_server: S3ServerInfo, s3_url: str):
    key = s3_url.split("/", 3)[3] + "/object"
    s3_server.boto3_client().put_object(Bucket=s3_server.bucket, Key=key, Body=b"data")
    reader = s3_server.boto3_client(readonly=True)
    assert reader.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"data"
    listed = reader.list_objects_v2(Bucket=s3_server.bucket, Prefix=key)
    assert [o["Key"] for o in listed["Contents"]] == [key]
    with pytest.raises(ClientError) as exc:
        reader.put_object(Bucket=s3_server.bucket, Key=key + "2", Body=b"nope")
    assert _error_code(exc) == "AccessDenied"
    with pytest.raises(ClientError) as exc:
        reader.delete_object(Bucket=s3_server.bucket, Key=key)
    assert _error_code(exc) == "AccessDenied"


def test_secrets_stay_out_of_repr_cmdline_and_logs():
    server = start_s3_server(bucket="secrets")
    try:
        info = server.info
        assert info.secret_key not in repr(info) and info.secret_key not in repr(server)
        assert info.readonly_secret_key not in repr(info)
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert info.secret_key.encode() not in cmdline
        environ = Path(f"/proc/{server.pid}/environ").read_bytes()
        assert b"AWS_" not in environ
        info.boto3_client().put_object(Bucket="secrets", Key="x", Body=b"x")
        logs = [p for p in Path(server.workdir).rglob("*") if p.is_file()
                and p.name != "s3-identities.json" and "data" not in p.relative_to(
                    server.workdir).parts]
        assert logs, "expected weed log files"
        for path in logs:
            assert info.secret_key.encode() not in path.read_bytes(), path
    finally:
        server.stop()


def test_without_bucket_creation_missing_bucket_is_reported():
    with S3Server(bucket="never-made", auto_create_bucket=False,
                  s3_auto_create_bucket=False) as info:
        client = info.boto3_client()
        assert client.list_buckets()["Buckets"] == []
        with pytest.raises(ClientError) as exc:
            client.put_object(Bucket="never-made", Key="k", Body=b"x")
        assert _error_code(exc) == "NoSuchBucket"


def _spawn_python(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True, **kw)


def test_sigkill_of_owner_leaves_no_weed():
    owner = _spawn_python(
        "import time\n"
        "from cloudckpt.testing.s3server import S3Server\n"
        "s = S3Server(); s.start()\n"
        "print(s.pid, s.workdir, flush=True)\n"
        "time.sleep(600)\n")
    try:
        line = owner.stdout.readline()
        assert line, "the owner process did not start a server"
        pid_text, workdir = line.split()
        weed_pid = int(pid_text)
        assert _alive(weed_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _wait_until(lambda: not _alive(weed_pid)), "weed outlived its owner"
        assert _wait_until(lambda: not _pids_mentioning(workdir))
        assert _wait_until(lambda: not Path(workdir).exists())
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_command_line_prints_exports_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloudckpt.testing.s3server", "--bucket", "cli-bucket"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        exports = {}
        for line in proc.stdout:
            if line.startswith("export "):
                key, _, value = line[len("export "):].strip().partition("=")
                exports[key] = value
            if "AWS_DEFAULT_REGION" in exports:
                break
        assert set(exports) == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
        info = S3ServerInfo(endpoint_url=exports["AWS_ENDPOINT_URL"],
                            access_key=exports["AWS_ACCESS_KEY_ID"],
                            secret_key=exports["AWS_SECRET_ACCESS_KEY"], bucket="cli-bucket",
                            readonly_access_key="", readonly_secret_key="")
        info.boto3_client().put_object(Bucket="cli-bucket", Key="k", Body=b"v")
        port = exports["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]
        weed = _pids_mentioning(f"-s3.port={port}\0")
        assert len(weed) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not _alive(weed[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_busy_port_makes_the_start_retry_on_fresh_ports(monkeypatch):
    import socket

    from cloudckpt.testing import s3server

    real_pick = s3server._pick_ports
    blockers: list[socket.socket] = []
    picks = []

    def pick_then_occupy_first_block(rng):
        ports = real_pick(rng)
        picks.append(ports)
        if not blockers:  # first attempt: someone else grabs the master port right away
            blocker = socket.socket()
            blocker.bind(("127.0.0.1", ports["master"]))
            blocker.listen()
            blockers.append(blocker)
        return ports

    monkeypatch.setattr(s3server, "_pick_ports", pick_then_occupy_first_block)
    try:
        with S3Server(bucket="retried") as info:
            assert info.endpoint_url
            info.boto3_client().put_object(Bucket="retried", Key="k", Body=b"x")
        assert len(blockers) == 1
        assert len(picks) == 2  # the first weed exited on the busy port; the second started
        assert info.endpoint_url.endswith(f":{picks[1]['s3']}")
    finally:
        for blocker in blockers:
            blocker.close()


def test_tls_serves_https_with_a_private_ca():
    import ssl
    import urllib.error
    import urllib.request

    import boto3
    from botocore.config import Config

    with S3Server(bucket="tls-bucket", tls=True) as info:
        assert info.https_endpoint_url.startswith("https://127.0.0.1:")
        assert info.https_endpoint_url != info.endpoint_url.replace("http:", "https:")
        info.boto3_client().put_object(Bucket=info.bucket, Key="k", Body=b"over http")
        https = boto3.client("s3", endpoint_url=info.https_endpoint_url, region_name=info.region,
                             aws_access_key_id=info.access_key,
                             aws_secret_access_key=info.secret_key, verify=info.ca_file,
                             config=Config(s3={"addressing_style": "path"}, proxies={}))
        assert https.get_object(Bucket=info.bucket, Key="k")["Body"].read() == b"over http"
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(info.https_endpoint_url + "/", timeout=10,
                                   context=ssl.create_default_context())  # nobody trusts it
        ca_file = info.ca_file
        assert Path(ca_file).is_file()
    assert not Path(ca_file).exists()  # removed with the work directory
