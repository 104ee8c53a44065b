"""Store URLs mean what they say (issue 15): one parser behind open_store, shared_store, the
manager and the CLI; anything scheme-like that is not exactly ``s3://`` or ``file://`` is refused
with a hint, and never becomes a local folder named ``s3:`` (or ``gs:``, ``C:``...)."""

from __future__ import annotations

import os
import string
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.errors import ConfigError
from cloudckpt.runtime.loop import shared_store
from cloudckpt.storage import LocalStore, S3Store, open_store, parse_store_url
from cloudckpt.storage.urls import parse_s3_url
from tests.cli_forkserver import run_cli
from tests.reliability.stores import REPO, cli_env

SCHEME_LIKE = [
    "s3:/bucket/x",
    "s3:bucket/x",
    "s3:",
    "s3:/",
    "S3://bucket/x",
    "S3:/bucket",
    "s3a://bucket/x",
    "s3n://bucket/x",
    "gs://bucket/x",
    "gcs://bucket/x",
    "http://127.0.0.1:9000/bucket/x",
    "https://s3.amazonaws.com/bucket/x",
    "az://container/x",
    "abfs://c@acct/x",
    "hdfs://nn/x",
    "ftp://host/x",
    "FILE:///tmp/x",
    "File:///tmp/x",
    "file:relative",
    "file:/",
    "C:\\runs\\x",
    "c:/x",
    "ckpt:v1",
    "run:1/step",
]


def _entries(path) -> list[str]:
    return sorted(os.listdir(path))


# -- the parser -----------------------------------------------------------------------------


def test_accepted_forms():
    assert parse_store_url("s3://bucket") == parse_store_url("s3://bucket")
    root = parse_store_url("s3://bucket")
    assert (root.kind, root.bucket, root.prefix) == ("s3", "bucket", "")
    assert parse_store_url("s3://bucket/").prefix == ""
    assert parse_store_url("s3://bucket/a/b").prefix == "a/b/"
    assert parse_store_url("file:///tmp/x").path == "/tmp/x"
    assert parse_store_url("file://localhost/tmp/x").path == "/tmp/x"
    for path in ("/abs/path", "rel/path", "./a:b", "/tmp/with:colon", "name", "../up"):
        parsed = parse_store_url(path)
        assert parsed.kind == "local" and parsed.path == path


@pytest.mark.parametrize(
    "url",
    SCHEME_LIKE
    + [
        "s3://",
        "s3:///x",
        "",
        "   ",
        "s3://b/x",
        "s3://bucket/a/../b",
        "s3://bucket/a?x=1",
        "s3://bucket/a//b",
        "file://otherhost/x",
    ],
)
def test_refused_with_a_hint(url):
    with pytest.raises(ConfigError) as err:
        parse_store_url(url)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert "s3://" in message or "file:" in message or "bucket" in message, message
    assert "\n" not in message


def test_hints_say_what_to_write():
    def message(url):
        with pytest.raises(ConfigError) as err:
            parse_store_url(url)
        return str(err.value)

    assert "did you mean 's3://bucket/x'?" in message("s3:/bucket/x")
    assert "did you mean 's3://bucket/x'?" in message("S3://bucket/x")
    assert "did you mean 's3://bucket/x'?" in message("s3a://bucket/x")
    assert "names no bucket" in message("s3://")
    assert "AWS_ENDPOINT_URL" in message("http://127.0.0.1:9000/bucket")
    assert "storage.googleapis.com" in message("gs://bucket/x")
    assert "./ckpt:v1" in message("ckpt:v1")


_SCHEME = st.from_regex(r"\A[A-Za-z][A-Za-z0-9+.\-]{0,7}\Z")
_REST = st.text(string.ascii_letters + string.digits + "/._-:\\", max_size=20)


@st.composite
def scheme_like(draw) -> str:
    """Strings that begin like a URL scheme: ``SCHEME:`` then anything."""
    return draw(_SCHEME) + ":" + draw(st.sampled_from(["", "/", "//", "///", "\\"])) + draw(_REST)


def _meant_valid(url: str) -> bool:
    return url.startswith("s3://") or url.startswith("file://")


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(url=scheme_like())
def test_scheme_like_strings_never_become_local_folders(url, tmp_path, monkeypatch):
    """Generated: every scheme-like string is either a well-formed s3:// / file:// URL or a
    ConfigError from the parser and from open_store, and no folder appears in the working
    directory."""
    monkeypatch.chdir(tmp_path)
    try:
        parsed = parse_store_url(url)
    except ConfigError:
        with pytest.raises(ConfigError):
            open_store(url)
        with pytest.raises(ConfigError):
            shared_store(url)
    else:
        assert _meant_valid(url), url
        assert (parsed.kind == "s3") == url.startswith("s3://")
        if parsed.kind == "local":
            assert os.path.isabs(parsed.path)
    assert _entries(tmp_path) == []


@settings(max_examples=200, deadline=None)
@given(
    bucket=st.from_regex(r"\A[a-z0-9][a-z0-9.\-]{2,20}\Z"),
    parts=st.lists(
        st.text(string.ascii_letters + string.digits + "._-=", min_size=1, max_size=8).filter(
            lambda p: p not in (".", "..")
        ),
        max_size=4,
    ),
    slash=st.booleans(),
)
def test_well_formed_s3_urls_parse(bucket, parts, slash):
    url = f"s3://{bucket}" + "".join("/" + p for p in parts) + ("/" if slash else "")
    parsed = parse_store_url(url)
    assert (parsed.kind, parsed.bucket) == ("s3", bucket)
    assert parsed.prefix == "".join(p + "/" for p in parts)
    assert parse_s3_url(url) == (bucket, parsed.prefix)
    assert isinstance(open_store(url), S3Store)


def test_open_store_routes(tmp_path):
    assert isinstance(open_store("s3://bucket"), S3Store)
    assert open_store("s3://bucket/").url == "s3://bucket"
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(tmp_path.as_uri()), LocalStore)


# -- every entry point ------------------------------------------------------------------------


@pytest.mark.parametrize("url", SCHEME_LIKE + ["s3://"])
def test_python_entry_points_refuse_before_touching_anything(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.zeros(3), "step": 1}
    for call in (
        lambda: cloudckpt.save(state, url),
        lambda: cloudckpt.load(state, url),
        lambda: cloudckpt.load_full(url),
        lambda: cloudckpt.verify(url),
        lambda: cloudckpt.async_save(state, url).result(),
        lambda: CheckpointManager(url),
    ):
        with pytest.raises(ConfigError) as err:
            call()
        assert isinstance(err.value, ValueError)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "s3://"],
        ["ls", "s3:/bucket/run"],
        ["ls", "S3://b/run"],
        ["ls", "gs://bucket/run"],
        ["show", "s3:bucket/x"],
        ["verify", "http://127.0.0.1:9/b/x"],
        ["rm", "s3:/b/run/x"],
        ["prune", "s3:/b/run", "--keep-last", "1"],
        ["export", "s3:/b/x", "out.pt"],
    ],
)
def test_cli_refuses_malformed_urls_as_usage_errors(args, tmp_path):
    res = run_cli(
        args,
        cwd=str(tmp_path),
        env=cli_env(
            None,
            AWS_ACCESS_KEY_ID="k",
            AWS_SECRET_ACCESS_KEY="s",
            AWS_ENDPOINT_URL="http://127.0.0.1:9",
        ),
        timeout=120,
    )
    assert res.returncode == 2, (args, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cloudckpt {args[0]}: error: "), lines
    assert "s3://" in lines[0]
    assert _entries(tmp_path) == []


def test_bucket_root_is_a_run_and_checkpoint_root(s3_server, s3_env):
    """Decided: ``s3://BUCKET`` (no key) is the bucket's root, usable like any prefix."""
    bucket = f"root-{uuid.uuid4().hex[:10]}"
    s3_server.boto3_client().create_bucket(Bucket=bucket)
    state = {"w": torch.arange(6.0), "step": 3}
    cloudckpt.save(state, f"s3://{bucket}")
    out = {"w": torch.zeros(6), "step": 0}
    cloudckpt.load(out, f"s3://{bucket}/")
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
    keys = [o["Key"] for o in s3_server.boto3_client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert "manifest.msgpack" in keys

    run_bucket = f"run-{uuid.uuid4().hex[:10]}"
    s3_server.boto3_client().create_bucket(Bucket=run_bucket)
    mgr = CheckpointManager(f"s3://{run_bucket}", keep_last=1)
    mgr.save(1, state)
    mgr.save(2, state)
    assert [i.step for i in mgr.list()] == [2]
    assert mgr.latest().url == f"s3://{run_bucket}/step-000000000002"
    res = run_cli(["ls", f"s3://{run_bucket}"], cwd=REPO, env=cli_env(s3_server), timeout=120)
    assert res.returncode == 0 and res.stdout.splitlines()[1].split()[0] == "2", res
