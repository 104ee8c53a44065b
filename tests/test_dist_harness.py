"""The multi-rank harness: collectives, per-rank failures, timeouts, restarts, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudckpt.testing.ranks.world import ProcessWorld, RankFailedError, WorldTimeoutError

REPO = Path(__file__).resolve().parents[1]


# -- functions run on the ranks (module level, so workers import them by reference) ----------


def all_reduce_rank_plus_one() -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(tensor)
    return tensor.tolist()


def describe_rank(tag: str, *, scale: int = 1) -> tuple:
    import torch.distributed as dist

    return (
        dist.get_rank(),
        dist.get_world_size(),
        tag,
        scale * dist.get_rank(),
        os.environ.get("RANK"),
        os.environ.get("HARNESS_MARK"),
    )


def fail_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one refuses this tensor")
    dist.barrier()  # the other ranks block here until the world is torn down
    return dist.get_rank()


def sleep_forever_on_last_rank() -> int:
    import torch.distributed as dist

    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(3600)
    return dist.get_rank()


def exit_on_rank_zero() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(3)


def put_object_with_env_credentials(bucket: str, prefix: str) -> str:
    """Each rank writes one object using only what the AWS_* variables say."""
    import botocore.session
    import torch.distributed as dist
    from botocore.config import Config

    # what boto3.client("s3") does, without boto3 (not a dependency)
    client = botocore.session.get_session().create_client(
        "s3", config=Config(s3={"addressing_style": "path"})
    )
    key = f"{prefix}/rank{dist.get_rank()}"
    client.put_object(Bucket=bucket, Key=key, Body=str(dist.get_rank()).encode())
    return key


# -- tests -----------------------------------------------------------------------------------


def test_three_ranks_all_reduce(world3):
    assert world3.run(all_reduce_rank_plus_one) == [[6.0] * 4] * 3


def test_arguments_results_and_env_reach_every_rank():
    with ProcessWorld(2, env={"HARNESS_MARK": "seen"}) as world:
        assert world.run(describe_rank, "t", scale=10) == [
            (0, 2, "t", 0, "0", "seen"),
            (1, 2, "t", 10, "1", "seen"),
        ]
        assert world.generation == 1  # successful calls reuse the same workers
        world.run(describe_rank, "again")
        assert world.generation == 1


def test_exception_on_rank_one_reports_its_traceback_and_world_recovers(world3):
    world3.run(all_reduce_rank_plus_one)
    generation = world3.generation
    with pytest.raises(RankFailedError) as exc:
        world3.run(fail_on_rank_one)
    message = str(exc.value)
    assert "rank 1" in message
    assert "ValueError: rank one refuses this tensor" in message
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError("rank one refuses this tensor")' in message
    assert list(exc.value.failures) == [1]
    assert world3.run(all_reduce_rank_plus_one) == [[6.0] * 4] * 3
    assert world3.generation == generation + 1


@pytest.mark.timeout(90)  # the harness must give up by itself well before this
def test_hanging_rank_is_reported_and_world_recovers(world3):
    with pytest.raises(WorldTimeoutError) as exc:
        world3.run(sleep_forever_on_last_rank, timeout=10)
    assert exc.value.missing == (2,)
    assert "ranks [2]" in str(exc.value)
    assert "sleep_forever_on_last_rank" in exc.value.stacks[2]  # the stuck rank's stack
    assert world3.run(all_reduce_rank_plus_one) == [[6.0] * 4] * 3


def test_a_rank_that_dies_is_reported():
    with ProcessWorld(2, timeout=60) as world:
        with pytest.raises(RankFailedError) as exc:
            world.run(exit_on_rank_zero)
        assert "rank 0 died (exit code 3)" in str(exc.value)
        assert world.run(describe_rank, "after") == [
            (0, 2, "after", 0, "0", None),
            (1, 2, "after", 1, "1", None),
        ]


def test_workers_see_the_s3_server_through_aws_variables(world2, s3_server, s3_url):
    prefix = s3_url.split("/", 3)[3]
    keys = world2.run(put_object_with_env_credentials, s3_server.bucket, prefix)
    listed = s3_server.boto3_client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)
    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(keys)
    assert len(keys) == 2


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def test_sigkill_of_owner_leaves_no_workers():
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from cloudckpt.testing.ranks.world import ProcessWorld, _ZYGOTE\n"
            "w = ProcessWorld(2, timeout=60); w.start()\n"
            "print(*w.pids, _ZYGOTE._proc.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if _alive(p)] == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
