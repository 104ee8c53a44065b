"""CheckpointManager on S3 servers other than SeaweedFS (issue 16): end to end on moto (save,
load, prune, a corrupted byte moto stores without checking), a clean-up failure after a save
reported to the caller (result, ``prune()``, CLI exit status), and saves on a server without
ListMultipartUploads. Server behaviours are reproduced by the fault proxy in front of the real
SeaweedFS."""

from __future__ import annotations

import base64
import logging

import pytest
import torch
from botocore.exceptions import ClientError

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.checksum import crc32c
from cloudckpt.errors import AccessDenied, ChecksumError
from cloudckpt.layout import data_key, step_dir
from cloudckpt.runtime.loop import run_coroutine
from cloudckpt.testing.faults.faultproxy import FaultProxy
from tests.reliability.stores import cli
from tests.storage.conftest import s3_options

KILLED_ATTEMPT = "0123456789abcdef"


def state(step: int) -> dict:
    return {
        "model": {
            "w": torch.arange(50_000, dtype=torch.float32) * step,
            "b": torch.full((3, 4), step, dtype=torch.int64),
        },
        "meta": {"step": step},
    }


def blank() -> dict:
    return {
        "model": {"w": torch.zeros(50_000), "b": torch.zeros(3, 4, dtype=torch.int64)},
        "meta": {"step": -1},
    }


def assert_state(sd: dict, step: int) -> None:
    ref = state(step)
    assert torch.equal(sd["model"]["w"], ref["model"]["w"])
    assert torch.equal(sd["model"]["b"], ref["model"]["b"])
    assert sd["meta"] == ref["meta"]


@pytest.fixture
def fault_proxy(s3_server):
    """A FaultProxy in front of the session's SeaweedFS (nothing refused until configured)."""
    with FaultProxy(
        s3_server.endpoint_url,
        seed=16,
        credentials=(s3_server.access_key, s3_server.secret_key, s3_server.region),
    ) as proxy:
        yield proxy


def _warnings(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


def test_save_load_prune_and_corruption_on_moto(moto_server, moto_url, s3_server):
    storage = s3_options(moto_server)
    mgr = CheckpointManager(moto_url, keep_last=2, storage=storage)
    for step in (1, 2, 3, 4):
        result = mgr.save(step, state(step))
        assert result.retention_error is None
    assert [(i.step, i.complete) for i in mgr.list()] == [(3, True), (4, True)]
    sd = blank()
    assert mgr.load(sd) == 4
    assert_state(sd, 4)
    sd = blank()
    assert mgr.load(sd, step=3) == 3
    assert_state(sd, 3)
    assert mgr.prune() == []
    assert mgr.delete(3) >= 2
    assert [i.step for i in mgr.list()] == [4]

    # A byte flipped in a data object, re-stored with the crc32c of the original bytes: moto
    # takes it (SeaweedFS refuses the same request), and only the data's own crc32c catches it.
    url = mgr.step_url(4)
    manifest = cloudckpt.read_manifest(url, storage=storage)
    key = manifest.objects[0]
    bucket, _, root = url[len("s3://") :].partition("/")
    client = moto_server.boto3_client()
    original = client.get_object(Bucket=bucket, Key=f"{root}/{key}")["Body"].read()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    claimed = base64.b64encode(crc32c(original).to_bytes(4, "big")).decode()
    client.put_object(
        Bucket=bucket, Key=f"{root}/{key}", Body=bytes(damaged), ChecksumCRC32C=claimed
    )
    with pytest.raises(ClientError, match="BadDigest"):
        s3_server.boto3_client().put_object(
            Bucket=s3_server.bucket, Key="crc-check", Body=bytes(damaged), ChecksumCRC32C=claimed
        )
    with pytest.raises(ChecksumError) as err:
        mgr.load(blank(), step=4)
    assert key in str(err.value)
    assert not cloudckpt.verify(url, storage=storage).ok


def test_clean_up_failure_after_a_save_is_reported(s3_server, s3_url, fault_proxy, caplog):
    """The checkpoint commits and the save returns; the failed prune comes back as
    ``retention_error`` (blocking and asynchronous saves) with a WARNING; ``prune()`` raises;
    once deletes work again, ``prune()`` finishes the job."""
    storage = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url)
    mgr = CheckpointManager(s3_url, keep_last=1, storage=storage)
    assert mgr.save(1, state(1)).retention_error is None
    fault_proxy.configure(refuse=[("POST", "delete", 403, "AccessDenied")])
    with caplog.at_level(logging.WARNING, logger="cloudckpt.runs.manager"):
        result = mgr.save(2, state(2))
    assert isinstance(result.retention_error, AccessDenied)
    assert len(_warnings(caplog, "step 2 is saved, but the clean-up after it failed")) == 1
    assert [(i.step, i.complete) for i in mgr.list()] == [(1, True), (2, True)]
    sd = blank()
    assert mgr.load(sd) == 2
    assert_state(sd, 2)
    with pytest.raises(AccessDenied):
        mgr.prune()

    handle = mgr.save(3, state(3), blocking=False)
    assert isinstance(handle.result(timeout=120).retention_error, AccessDenied)
    fault_proxy.configure(refuse=[])
    assert [i.step for i in mgr.prune()] == [1, 2]
    assert [i.step for i in mgr.list()] == [3]


def test_cli_prune_exits_1_when_a_delete_fails(s3_server, s3_url, fault_proxy):
    mgr = CheckpointManager(s3_url, storage=s3_options(s3_server))
    for step in (1, 2):
        mgr.save(step, state(step))
    fault_proxy.configure(refuse=[("POST", "delete", 400, "InvalidRequest")])
    res = cli(
        s3_server, "prune", s3_url, "--keep-last", "1", AWS_ENDPOINT_URL=fault_proxy.endpoint_url
    )
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cloudckpt prune: error:"), res.stderr
    assert "InvalidRequest" in lines[0]
    assert [i.step for i in mgr.list()] == [1, 2]


def test_saves_on_a_server_without_list_multipart_uploads(s3_server, s3_url, fault_proxy, caplog):
    """ListMultipartUploads answering 501: saves, the clean-up of a killed attempt's leftovers,
    retention and deletes all work (unfinished uploads cannot be seen there: one WARNING)."""
    fault_proxy.configure(refuse=[("GET", "uploads", 501, "NotImplemented")])
    storage = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url)
    mgr = CheckpointManager(s3_url, keep_last=2, storage=storage)
    # a killed earlier attempt at step 3 left an object behind (a key the layout owns: only
    # those are ever deleted)
    killed = data_key(KILLED_ATTEMPT, 0, 0)
    run_coroutine(mgr.store.put(step_dir(3) + killed, b"leftover"))
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            assert mgr.save(step, state(step)).retention_error is None
        plain = cloudckpt.save(state(9), f"{s3_url}-plain", storage=storage)
    assert plain.retention_error is None
    assert [i.step for i in mgr.list()] == [2, 3]
    keys = [x.key for x in run_coroutine(_keys(mgr.store))]
    assert not any(KILLED_ATTEMPT in k for k in keys)
    sd = blank()
    assert mgr.load(sd) == 3
    assert_state(sd, 3)
    assert mgr.delete(2) >= 2
    assert [i.step for i in mgr.list()] == [3]
    assert fault_proxy.counters["refused"] >= 1
    assert len(_warnings(caplog, "does not implement ListMultipartUploads")) == 1
    assert not _warnings(caplog, "clean-up after it failed")


async def _keys(store):
    return [x async for x in store.list()]
