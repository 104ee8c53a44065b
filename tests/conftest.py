"""Shared fixtures: one local SeaweedFS per session, a fresh S3 prefix per test, and persistent
gloo worlds of 2, 3 and 4 ranks whose workers see the server through the standard AWS variables;
a second S3 implementation (moto's server mode, started on first use) for the storage
conformance suite and the compatibility tests.

Put tests under tests/<area>/ with an __init__.py so that functions run on workers are importable
as `tests.<area>.<module>.<function>`.
"""

from __future__ import annotations

import re
import uuid

import pytest
from hypothesis import HealthCheck, settings

from cloudckpt.testing.ranks.world import ProcessWorld
from cloudckpt.testing.servers.endpoint import S3ServerInfo
from cloudckpt.testing.servers.moto import MotoServer
from cloudckpt.testing.servers.seaweed.server import S3Server

# No timing asserts: a property test has no per-example deadline (on 2 shared cores a planning
# example may take a second), and a slow data generation is no failure.
settings.register_profile("cloudckpt", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cloudckpt")


@pytest.fixture(scope="session")
def s3_server() -> S3ServerInfo:
    """The session's SeaweedFS endpoint (bucket created, admin + read-only identities)."""
    with S3Server() as info:
        yield info


def _test_prefix(server: S3ServerInfo, request) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")[:60]
    return server.url(f"{name}-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def s3_url(s3_server: S3ServerInfo, request) -> str:
    """A fresh, unique prefix for this test: `s3://<bucket>/<testname>-<random>` (no slash)."""
    return _test_prefix(s3_server, request)


@pytest.fixture(scope="session")
def moto_server() -> S3ServerInfo:
    """The session's moto S3 endpoint (a subprocess; any credentials are accepted, checksums
    are not checked: see cloudckpt.testing.servers.moto)."""
    with MotoServer() as info:
        yield info


@pytest.fixture
def moto_url(moto_server: S3ServerInfo, request) -> str:
    """A fresh, unique prefix for this test on the moto server."""
    return _test_prefix(moto_server, request)


@pytest.fixture
def s3_env(s3_server: S3ServerInfo, monkeypatch) -> S3ServerInfo:
    """Point this (test) process at the session server through the standard AWS variables."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server


def _world(size: int, s3_server: S3ServerInfo):
    world = ProcessWorld(size, env=s3_server.env())  # workers start on the first run()
    yield world
    world.close()


@pytest.fixture(scope="session")
def world2(s3_server: S3ServerInfo):
    yield from _world(2, s3_server)


@pytest.fixture(scope="session")
def world3(s3_server: S3ServerInfo):
    yield from _world(3, s3_server)


@pytest.fixture(scope="session")
def world4(s3_server: S3ServerInfo):
    yield from _world(4, s3_server)
