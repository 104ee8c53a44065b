"""Helpers of the interop tests: DCP states of every kind of leaf, copying a checkpoint prefix
between SeaweedFS and a local folder behind cloudckpt's back, and storage options."""

from __future__ import annotations

from pathlib import Path

import torch

from cloudckpt.storage import RetryOptions, StorageOptions

MiB = 1 << 20


def storage_for(info, **overrides) -> StorageOptions:
    """Explicit options for the session's SeaweedFS, small multipart parts, quick retries."""
    fields = dict(
        endpoint_url=info.endpoint_url,
        region=info.region,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
        multipart_threshold=5 * MiB,
        part_size=5 * MiB,
        retry=RetryOptions(max_attempts=4, base_delay=0.01, max_delay=0.2, deadline=60.0),
    )
    fields.update(overrides)
    return StorageOptions(**fields)


def odd_state(seed: int = 0) -> dict:
    """Every kind of leaf a DCP checkpoint holds: float32 (large enough for several checksum
    blocks and a multipart upload), bfloat16, int64, bool, a transposed view, a view into a larger
    storage, a 0-d tensor, an empty tensor, and non-tensor values (nested)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 40, generator=g)
    return {
        "big": torch.randn(3 * MiB // 4 + 123, generator=g),  # ~3 MiB, odd length
        "bf16": torch.randn(1000, 3, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(1 << 40), 1 << 40, (257,), generator=g),
        "mask": torch.rand(33, generator=g) > 0.5,
        "transposed": base.t(),  # not contiguous
        "slice": base[10:20],  # view into a larger one
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 7),
        "nested": {
            "w": torch.randn(5, 5, generator=g),
            "step": 12,
            "betas": (0.9, 0.95),
            "name": "run-a",
            "flags": {"amp": True, "note": None},
        },
    }


def zeros_like_state(state):
    """Destinations for a load: zeroed tensors (contiguous), containers of the same shape (DCP
    flattens the destination to find what to load), other values blanked to None."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return None


def assert_same(got, want, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, got)
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)) and any(isinstance(w, torch.Tensor) for w in want):
        assert type(got) is type(want) and len(got) == len(want), (path, got)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}.{i}")
    else:
        assert got == want, (path, got, want)


def split_url(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return bucket, prefix.rstrip("/")


def download_prefix(s3_server, url: str, folder: Path) -> list[str]:
    """Copy every object under ``url`` into ``folder`` (boto3, not cloudckpt); returns the keys
    relative to the prefix."""
    client = s3_server.boto3_client()
    bucket, prefix = split_url(url)
    names = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "/"
    ):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) + 1 :]
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            names.append(name)
    return sorted(names)


def upload_folder(s3_server, folder: Path, url: str) -> list[str]:
    """Copy every file of ``folder`` under ``url`` (boto3)."""
    client = s3_server.boto3_client()
    bucket, prefix = split_url(url)
    names = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            name = path.relative_to(folder).as_posix()
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=path.read_bytes())
            names.append(name)
    return names


def failure_of(exc: BaseException, rank: int = 0) -> BaseException:
    """The exception rank ``rank`` raised inside DCP's ``CheckpointException`` (a
    ``BaseException`` whose ``failures`` map ranks to ``(exception, traceback)``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and rank in failures:
        return failures[rank][0]
    return exc
