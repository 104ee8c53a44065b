"""Fixtures of the reliability suite.

- ``storage``: StorageOptions for the session's SeaweedFS with explicit credentials, small
  multipart parts (so modest states go multipart) and quick, bounded retries.
- ``figures``: a session-wide counter of what the suite tried (kill points, injected faults,
  fuzz cases, ...). Printed at the end of the session; with ``CLOUDCKPT_RELIABILITY_FIGURES=path``
  also written there as JSON (docs/reliability.md quotes the figures of the last long run).
- ``fault_proxy``: a FaultProxy in front of the SeaweedFS (no faults until configured).
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

from cloudckpt import SaveOptions
from cloudckpt.storage import RetryOptions, StorageOptions
from cloudckpt.testing.faults.faultproxy import FaultProxy

MiB = 1 << 20

QUICK_RETRY = RetryOptions(
    max_attempts=10, base_delay=0.01, max_delay=0.2, attempt_timeout=20.0, deadline=90.0
)

#: Small objects and blocks: a save of a few MiB makes several objects, multipart uploads and
#: many checksum blocks.
SAVE_OPTIONS = SaveOptions(object_size=256 << 10, checksum_block_size=64 << 10, timeout=60.0)


def storage_for(info, **overrides) -> StorageOptions:
    fields = dict(
        endpoint_url=info.endpoint_url,
        region=info.region,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
        multipart_threshold=5 * MiB,
        part_size=5 * MiB,
        retry=QUICK_RETRY,
    )
    fields.update(overrides)
    return StorageOptions(**fields)


@pytest.fixture(scope="session")
def storage(s3_server) -> StorageOptions:
    return storage_for(s3_server)


class Figures:
    """Counters of the suite's work (thread-safe enough for the test process)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.started = time.time()

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def as_dict(self) -> dict:
        return {
            "seconds": round(time.time() - self.started, 1),
            **dict(sorted(self.counts.items())),
        }


@pytest.fixture(scope="session")
def figures():
    fig = Figures()
    yield fig
    data = fig.as_dict()
    print("\nreliability figures: " + json.dumps(data, sort_keys=True))
    path = os.environ.get("CLOUDCKPT_RELIABILITY_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)


@pytest.fixture
def fault_proxy(s3_server):
    proxy = FaultProxy(
        s3_server.endpoint_url,
        seed=4321,
        credentials=(s3_server.access_key, s3_server.secret_key, s3_server.region),
    )
    proxy.start()
    yield proxy
    proxy.stop()
