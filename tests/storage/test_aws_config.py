"""The AWS configuration chain, with boto3 as the oracle.

For generated environments (``AWS_ENDPOINT_URL[_S3]``, ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``,
``AWS_REGION``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ``AWS_CA_BUNDLE``, ``REQUESTS_CA_BUNDLE``,
``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``, access keys), config and credentials files
(profiles with ``region``, ``endpoint_url``, ``s3 = addressing_style``, ``ca_bundle``,
``ignore_configured_endpoint_urls``, ``services`` sections, keys) and ``StorageOptions``, the
client cloudckpt builds sends its first request to the same URL (endpoint and addressing style),
signed with the same access key for the same region, and trusts the same CA bundle as the boto3
client built from the same environment and the same explicit values. Nothing is contacted: the
request is captured by a ``before-send`` hook and stopped there.

Deliberate, asserted differences:
- ``AWS_REGION`` is read where boto3's own chain finds no region (boto3 ignores it).
- ``verify_tls=True`` verifies with the AWS CA chain (boto3's ``verify=True`` skips
  ``AWS_CA_BUNDLE``); a CA bundle that is not a file is a ``ConfigError`` before any request
  (boto3 fails at its first request).
- Where boto3 fails (an unknown profile, no credentials, an empty ``AWS_CA_BUNDLE``) cloudckpt
  raises ``ConfigError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

# boto3 is the oracle only: no dependency of cloudckpt declares it (tests/test_dependencies.py
# forbids it in pyproject.toml), but the test extra's moto[s3] requires boto3, so it is installed
# wherever the suite runs.
import boto3
import botocore.exceptions as bex
import botocore.loaders
import botocore.session
import pytest
from botocore.config import Config
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ConfigError
from cloudckpt.storage import StorageOptions
from cloudckpt.storage.s3 import aws_config
from cloudckpt.storage.s3.client import open_client
from cloudckpt.storage.s3.conn import S3Connection
from cloudckpt.storage.s3.errors import classify

PROFILE_ENDPOINT = "http://profile-endpoint.test:9000"
SERVICES_ENDPOINT = "http://services-endpoint.test:9001"
NESTED_ENDPOINT = "http://nested-endpoint.test:9003"
ENV_ENDPOINT = "http://env-endpoint.test:9004"
ENV_S3_ENDPOINT = "https://env-s3-endpoint.test:9005"
OPTIONS_ENDPOINT = "http://options-endpoint.test:9002"
CA, MISSING_CA = "{dir}/ca.pem", "{dir}/missing-ca.pem"


class _Sent(Exception):
    """Raised by the before-send hook: the request was built and is not sent."""


@pytest.fixture(autouse=True, scope="module")
def _shared_loader():
    """One botocore data loader for every session of this module (the service models are parsed
    once instead of per client); resolution is untouched."""
    original = botocore.session.create_loader
    botocore.session.create_loader = functools.lru_cache(maxsize=None)(
        botocore.loaders.create_loader
    )
    yield
    botocore.session.create_loader = original


# --- one case --------------------------------------------------------------------------------


@dataclass
class Case:
    env: dict[str, str] = field(default_factory=dict)
    config: dict[str, dict[str, object]] = field(default_factory=dict)  # profile -> settings
    credentials: dict[str, dict[str, str]] = field(default_factory=dict)
    files_via_env: bool = True  # AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE, else ~/.aws
    options: dict[str, object] = field(default_factory=dict)
    bucket: str = "mybucket"


def _section(name: str) -> str:
    return "[default]" if name == "default" else f"[profile {name}]"


def _config_text(config: dict[str, dict[str, object]]) -> str:
    lines: list[str] = []
    for profile, settings_ in config.items():
        lines.append(_section(profile))
        services = None
        for key, value in settings_.items():
            if key == "s3":
                lines.append("s3 =")
                lines += [f"  {k} = {v}" for k, v in value.items()]
            elif key == "services":
                services = value
                lines.append(f"services = {profile}-services")
            else:
                lines.append(f"{key} = {value}")
        if services:
            lines += [f"[services {profile}-services]", "s3 ="]
            lines += [f"  {k} = {v}" for k, v in services.items()]
    return "\n".join(lines) + "\n"


def _credentials_text(credentials: dict[str, dict[str, str]]) -> str:
    lines: list[str] = []
    for profile, keys in credentials.items():
        lines.append(f"[{profile}]")
        lines += [f"{k} = {v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def environment(case: Case):
    """os.environ holding only the case's AWS variables (HOME a fresh directory), config files
    written; everything restored afterwards. Yields the directory."""
    saved = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="awscfg-") as tmp:
        d = Path(tmp)
        (d / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
        fill = functools.partial(_fill, tmp)
        try:
            for key in list(os.environ):
                if key.startswith("AWS_") or key == "REQUESTS_CA_BUNDLE":
                    del os.environ[key]
            os.environ.update(HOME=tmp, AWS_EC2_METADATA_DISABLED="true")
            if case.files_via_env:
                config, creds = d / "cfg" / "config", d / "cfg" / "credentials"
                os.environ.update(
                    AWS_CONFIG_FILE=str(config), AWS_SHARED_CREDENTIALS_FILE=str(creds)
                )
            else:
                config, creds = d / ".aws" / "config", d / ".aws" / "credentials"
            config.parent.mkdir(exist_ok=True)
            config.write_text(fill(_config_text(case.config)))
            creds.write_text(_credentials_text(case.credentials))
            os.environ.update({k: fill(v) for k, v in case.env.items()})
            yield tmp
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _fill(tmp: str, value):
    return value.replace("{dir}", tmp) if isinstance(value, str) else value


# --- what each client does -------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    url: str | None = None
    access_key: str | None = None
    region: str | None = None
    resolved: aws_config.ResolvedS3 | None = None
    error: BaseException | None = None
    #: cloudckpt's only: the setting that named the endpoint (``OpenedClient.endpoint_source``)
    endpoint_source: str | None = field(default=None, compare=False)


def _capture(client, seen: dict):
    def hook(request, **kwargs):
        seen["url"] = request.url
        seen["auth"] = request.headers["Authorization"]
        raise _Sent

    client.meta.events.register("before-send", hook)


def _outcome(client, seen: dict) -> Outcome:
    auth = seen["auth"].decode() if isinstance(seen["auth"], bytes) else seen["auth"]
    m = re.search(r"Credential=([^/]+)/\d{8}/([^/]+)/s3/aws4_request", auth)
    assert m, auth
    return Outcome(
        url=seen["url"],
        access_key=m.group(1),
        region=m.group(2),
        resolved=aws_config.describe(client),
    )


def run_cloudckpt(options: StorageOptions, bucket: str) -> Outcome:
    """Open cloudckpt's client and build one HEAD request; errors as the store reports them."""

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            try:
                client, _, source = await open_client(options, stack)
            except Exception as exc:
                return Outcome(error=classify(exc, "head", "k", "s3://b/").error or exc)
            seen: dict = {}
            _capture(client, seen)
            with pytest.raises(_Sent):
                await client.head_object(Bucket=bucket, Key="k")
            return replace(_outcome(client, seen), endpoint_source=source)

    return asyncio.run(main())


def run_boto3(options: StorageOptions, bucket: str, *, region_addition: bool = True) -> Outcome:
    """The oracle: a boto3 client from the same environment, given the options' explicit values.
    ``region_addition``: apply cloudckpt's one addition (``AWS_REGION`` where boto3 finds no
    region)."""
    try:
        session = boto3.Session(profile_name=options.profile)
        region = options.region
        if region is None and session.region_name is None and region_addition:
            region = os.environ.get("AWS_REGION")
        verify = None if options.verify_tls in (None, True) else options.verify_tls
        style = options.addressing_style
        client = session.client(
            "s3",
            endpoint_url=options.endpoint_url,
            region_name=region,
            verify=verify,
            aws_access_key_id=options.access_key_id,
            aws_secret_access_key=options.secret_access_key,
            config=Config(s3={"addressing_style": style}) if style else None,
        )
        seen: dict = {}
        _capture(client, seen)
        with pytest.raises(_Sent):
            client.head_object(Bucket=bucket, Key="k")
    except (bex.ProfileNotFound, bex.NoCredentialsError, bex.InvalidConfigError) as exc:
        return Outcome(error=exc)
    return _outcome(client, seen)


def check(case: Case) -> tuple[Outcome, Outcome]:
    """Run both clients on ``case`` and assert they agree (or differ only as documented)."""
    with environment(case) as tmp:
        options = StorageOptions(**{k: _fill(tmp, v) for k, v in case.options.items()})
        ours = run_cloudckpt(options, case.bucket)
        oracle = run_boto3(options, case.bucket)
        if oracle.error is not None:
            assert isinstance(ours.error, ConfigError), (case, oracle.error, ours.error)
            return ours, oracle
        verify = oracle.resolved.verify
        if isinstance(verify, str) and not os.path.isfile(verify):
            # boto3 would fail at its first request; cloudckpt refuses before any.
            assert isinstance(ours.error, ConfigError) and repr(verify) in str(ours.error), (
                case,
                ours.error,
            )
            return ours, oracle
        assert ours.error is None, (case, ours.error)
        assert ours == oracle, case
        assert_source_names_endpoint(ours.endpoint_source, oracle.resolved.endpoint_url, case)
        return ours, oracle


#: Each setting that can name an endpoint, with the URL the cases give it (all different).
_SOURCE_URLS = [
    (r"StorageOptions\.endpoint_url", OPTIONS_ENDPOINT),
    (r"AWS_ENDPOINT_URL_S3", ENV_S3_ENDPOINT),
    (r"AWS_ENDPOINT_URL", ENV_ENDPOINT),
    (r"services section '(\w+)-services' of AWS profile '(\w+)'", SERVICES_ENDPOINT),
    (r"endpoint_url of AWS profile '(\w+)'", PROFILE_ENDPOINT),
]


def assert_source_names_endpoint(source: str, endpoint_url: str, case: Case) -> None:
    """The setting ``Endpoint.source`` names (for messages) is the one whose URL boto3 uses, and
    of the profile in use; ``""`` only where boto3 uses AWS S3's own endpoint."""
    if not source:
        assert aws_config.is_aws_endpoint(endpoint_url), (case, endpoint_url)
        return
    for pattern, url in _SOURCE_URLS:
        m = re.fullmatch(pattern, source)
        if m:
            assert endpoint_url == url, (case, source, endpoint_url)
            profile = case.options.get("profile") or case.env.get("AWS_PROFILE") or "default"
            assert all(name == profile for name in m.groups()), (case, source)
            return
    raise AssertionError(f"unknown endpoint source {source!r}")


# --- generated cases -------------------------------------------------------------------------


def _maybe(values):
    return st.one_of(st.none(), st.sampled_from(values))


def _settings(**choices):
    """A dict strategy: each key present with one of its values, or absent."""
    return st.fixed_dictionaries({k: _maybe(v) for k, v in choices.items()}).map(
        lambda d: {k: v for k, v in d.items() if v is not None}
    )


_KEYS = st.sampled_from([{}, {"aws_access_key_id": "AKFILE", "aws_secret_access_key": "s"}])

PROFILE = st.fixed_dictionaries(
    {
        "plain": _settings(
            region=["eu-west-1", "ap-south-1"],
            endpoint_url=[PROFILE_ENDPOINT],
            ca_bundle=[CA, MISSING_CA],
            ignore_configured_endpoint_urls=["true"],
        ),
        "s3": _settings(
            addressing_style=["path", "virtual", "auto"], endpoint_url=[NESTED_ENDPOINT]
        ),
        "services": _settings(endpoint_url=[SERVICES_ENDPOINT]),
        "keys": st.sampled_from(
            [{}, {"aws_access_key_id": "AKCONFIG", "aws_secret_access_key": "s"}]
        ),
    }
).map(
    lambda p: {
        **p["plain"],
        **({"s3": p["s3"]} if p["s3"] else {}),
        **({"services": p["services"]} if p["services"] else {}),
        **p["keys"],
    }
)

ENV = _settings(
    AWS_ENDPOINT_URL=[ENV_ENDPOINT],
    AWS_ENDPOINT_URL_S3=[ENV_S3_ENDPOINT],
    AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=["true", "false"],
    AWS_REGION=["eu-central-1"],
    AWS_DEFAULT_REGION=["us-west-1"],
    AWS_PROFILE=["other"],
    AWS_CA_BUNDLE=[CA, MISSING_CA],
    REQUESTS_CA_BUNDLE=[CA],
).flatmap(
    lambda env: st.sampled_from(
        [{}, {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "s"}]
    ).map(lambda keys: {**env, **keys})
)

OPTIONS = _settings(
    endpoint_url=[OPTIONS_ENDPOINT],
    region=["us-west-2"],
    profile=["other"],
    addressing_style=["path", "virtual", "auto"],
    verify_tls=[True, False, CA, MISSING_CA],
).flatmap(
    lambda o: st.sampled_from([{}, {"access_key_id": "AKOPT", "secret_access_key": "s"}]).map(
        lambda keys: {**o, **keys}
    )
)

CASES = st.builds(
    Case,
    env=ENV,
    config=st.fixed_dictionaries({"default": PROFILE, "other": PROFILE}),
    credentials=st.dictionaries(st.sampled_from(["default", "other"]), _KEYS, max_size=2),
    files_via_env=st.booleans(),
    options=OPTIONS,
    bucket=st.sampled_from(["mybucket", "my.dotted.bucket"]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_resolution_matches_boto3(case):
    ours, oracle = check(case)
    if oracle.error:
        event(f"boto3 fails: {type(oracle.error).__name__}")
    elif ours.error:
        event("cloudckpt refuses a CA bundle that is not a file")
    else:
        event(f"same request, {ours.resolved.addressing_style} style")


# --- the reported problems, one by one -----------------------------------------------------------

KEYS = {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "s"}


def test_profile_virtual_addressing_with_a_custom_endpoint_is_honoured():
    ours, _ = check(
        Case(
            env=KEYS,
            config={
                "default": {"endpoint_url": PROFILE_ENDPOINT, "s3": {"addressing_style": "virtual"}}
            },
        )
    )
    assert ours.url == "http://mybucket.profile-endpoint.test:9000/k"
    assert ours.resolved.addressing_style == "virtual"
    ours, _ = check(
        Case(
            env=KEYS,
            options={"endpoint_url": OPTIONS_ENDPOINT},
            config={"default": {"s3": {"addressing_style": "virtual"}}},
        )
    )
    assert ours.url == "http://mybucket.options-endpoint.test:9002/k"
    # StorageOptions wins over the profile.
    ours, _ = check(
        Case(
            env=KEYS,
            options={"addressing_style": "path"},
            config={
                "default": {"endpoint_url": PROFILE_ENDPOINT, "s3": {"addressing_style": "virtual"}}
            },
        )
    )
    assert ours.url == "http://profile-endpoint.test:9000/mybucket/k"


@pytest.mark.parametrize("source", ["env", "env-s3", "profile", "services", "options"])
def test_a_configured_endpoint_defaults_to_path_style(source):
    case = {
        "env": Case(env={**KEYS, "AWS_ENDPOINT_URL": ENV_ENDPOINT}),
        "env-s3": Case(env={**KEYS, "AWS_ENDPOINT_URL_S3": ENV_S3_ENDPOINT}),
        "profile": Case(env=KEYS, config={"default": {"endpoint_url": PROFILE_ENDPOINT}}),
        "services": Case(
            env=KEYS, config={"default": {"services": {"endpoint_url": SERVICES_ENDPOINT}}}
        ),
        "options": Case(env=KEYS, options={"endpoint_url": OPTIONS_ENDPOINT}),
    }[source]
    ours, _ = check(case)
    assert ours.resolved.addressing_style == "path"
    assert urlsplit(ours.url).path == "/mybucket/k", ours.url
    assert urlsplit(ours.url).hostname.endswith("-endpoint.test"), ours.url


async def _store_endpoint(options: StorageOptions):
    conn = S3Connection(options, "mybucket", "")
    try:
        await conn.client()
        return conn.endpoint
    finally:
        await conn.close()


@pytest.mark.parametrize("unset", range(6))
def test_messages_name_the_setting_that_named_the_endpoint(unset):
    """Every setting that can name an endpoint, stacked; the first ``unset`` of them (in
    botocore's order) removed: ``Endpoint.source`` names the first left, in the profile in use,
    and says AWS S3 once none is left."""
    order = [
        ("options", "StorageOptions.endpoint_url", OPTIONS_ENDPOINT),
        ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_S3", ENV_S3_ENDPOINT),
        ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL", ENV_ENDPOINT),
        ("services", "services section 'other-services' of AWS profile 'other'", SERVICES_ENDPOINT),
        ("endpoint_url", "endpoint_url of AWS profile 'other'", PROFILE_ENDPOINT),
    ]
    kept = {name for name, _, _ in order[unset:]}
    env = {**KEYS, "AWS_PROFILE": "other"}
    env.update({k: url for k, _, url in order[1:3] if k in kept})
    profile = {
        "region": "eu-west-1",
        **({"endpoint_url": PROFILE_ENDPOINT} if "endpoint_url" in kept else {}),
    }
    if "services" in kept:
        profile["services"] = {"endpoint_url": SERVICES_ENDPOINT}
    config = {"other": profile, "default": {"endpoint_url": "http://not-this-profile.test:1"}}
    options = {"endpoint_url": OPTIONS_ENDPOINT} if "options" in kept else {}
    case = Case(env=env, config=config, options=options)
    ours, _ = check(case)
    with environment(case):  # what the store's messages say (S3Connection builds the Endpoint)
        described = asyncio.run(_store_endpoint(StorageOptions(**options))).describe()
    if unset < len(order):
        _, source, url = order[unset]
        assert (ours.endpoint_source, ours.resolved.endpoint_url) == (source, url)
        assert described == f"endpoint {url} (from {source})"
    else:
        assert ours.endpoint_source == ""
        assert ours.resolved.endpoint_url == "https://s3.eu-west-1.amazonaws.com"
        assert "AWS S3, as no endpoint is configured" in described


@pytest.mark.parametrize("where", ["env", "profile"])
def test_ignore_configured_endpoint_urls(where):
    flag = {"AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"} if where == "env" else {}
    profile = {"endpoint_url": PROFILE_ENDPOINT, "region": "eu-west-1"}
    if where == "profile":
        profile["ignore_configured_endpoint_urls"] = "true"
    ours, _ = check(
        Case(env={**KEYS, **flag, "AWS_ENDPOINT_URL": ENV_ENDPOINT}, config={"default": profile})
    )
    assert ours.url == "https://mybucket.s3.eu-west-1.amazonaws.com/k"
    # An endpoint given in StorageOptions is explicit, never ignored (as boto3's endpoint_url=).
    ours, _ = check(
        Case(
            env={**KEYS, **flag},
            config={"default": profile},
            options={"endpoint_url": OPTIONS_ENDPOINT},
        )
    )
    assert ours.url == "http://options-endpoint.test:9002/mybucket/k"


def test_aws_region_is_read_where_boto3_finds_no_region():
    case = Case(env={**KEYS, "AWS_REGION": "eu-central-1"})
    ours, _ = check(case)
    assert ours.region == "eu-central-1"
    assert ours.url == "https://mybucket.s3.eu-central-1.amazonaws.com/k"
    with environment(case):  # the documented difference: boto3 itself ignores AWS_REGION
        assert run_boto3(StorageOptions(), "mybucket", region_addition=False).region == "us-east-1"
    # boto3's chain, where it names a region, wins over AWS_REGION.
    for extra, config, expected in [
        ({"AWS_DEFAULT_REGION": "us-west-1"}, {}, "us-west-1"),
        ({}, {"default": {"region": "ap-south-1"}}, "ap-south-1"),
    ]:
        ours, _ = check(Case(env={**KEYS, "AWS_REGION": "eu-central-1", **extra}, config=config))
        assert ours.region == expected
    # With a custom endpoint too.
    ours, _ = check(
        Case(env={**KEYS, "AWS_REGION": "eu-central-1", "AWS_ENDPOINT_URL": ENV_ENDPOINT})
    )
    assert ours.region == "eu-central-1"


@pytest.mark.parametrize("where", ["env", "profile", "options", "requests"])
def test_the_ca_bundle_chain_is_used(where):
    env = dict(KEYS)
    config: dict = {}
    options: dict = {}
    if where == "env":
        env["AWS_CA_BUNDLE"] = CA
    elif where == "profile":
        config = {"default": {"ca_bundle": CA}}
    elif where == "options":
        options = {"verify_tls": CA}
        env["AWS_CA_BUNDLE"] = MISSING_CA  # the explicit path wins
    else:
        env["REQUESTS_CA_BUNDLE"] = CA
    ours, _ = check(Case(env=env, config=config, options=options))
    assert ours.resolved.verify.endswith("/ca.pem")
    # verify_tls=True verifies with the same chain (boto3's verify=True would skip it).
    if where != "options":
        ours, _ = check(Case(env=env, config=config, options={"verify_tls": True}))
        assert ours.resolved.verify.endswith("/ca.pem")


def test_no_ca_bundle_configured_uses_the_default_bundle_and_false_turns_it_off():
    ours, _ = check(Case(env=KEYS))
    assert ours.resolved.verify is True  # botocore's default: certifi's bundle
    ours, _ = check(Case(env={**KEYS, "AWS_CA_BUNDLE": CA}, options={"verify_tls": False}))
    assert ours.resolved.verify is False


@pytest.mark.parametrize("source", ["AWS_CA_BUNDLE", "profile", "options"])
def test_a_missing_ca_bundle_is_a_config_error_naming_its_source(source):
    case = {
        "AWS_CA_BUNDLE": Case(env={**KEYS, "AWS_CA_BUNDLE": MISSING_CA}),
        "profile": Case(env=KEYS, config={"default": {"ca_bundle": MISSING_CA}}),
        "options": Case(env=KEYS, options={"verify_tls": MISSING_CA}),
    }[source]
    ours, _ = check(case)
    message = str(ours.error)
    assert "\n" not in message
    assert {
        "AWS_CA_BUNDLE": "from AWS_CA_BUNDLE",
        "profile": "ca_bundle of AWS profile 'default'",
        "options": "StorageOptions.verify_tls",
    }[source] in message, message


def test_failures_of_the_chain_are_config_errors():
    for case in [
        Case(env={**KEYS, "AWS_PROFILE": "nowhere"}),
        Case(env={"AWS_ENDPOINT_URL": ENV_ENDPOINT}),  # no credentials at all
        Case(env={**KEYS, "AWS_CA_BUNDLE": ""}),
        Case(env=KEYS, options={"profile": "nowhere"}),
    ]:
        ours, oracle = check(case)
        assert oracle.error is not None and isinstance(ours.error, ConfigError), case


def test_credentials_follow_the_chain():
    creds = {
        "default": {"aws_access_key_id": "AKFILE", "aws_secret_access_key": "s"},
        "other": {"aws_access_key_id": "AKOTHER", "aws_secret_access_key": "s"},
    }
    assert check(Case(env=KEYS, credentials=creds))[0].access_key == "AKENV"
    assert check(Case(credentials=creds))[0].access_key == "AKFILE"
    assert check(Case(env={"AWS_PROFILE": "other"}, credentials=creds))[0].access_key == "AKOTHER"
    # An explicit profile in StorageOptions ignores the key variables, as boto3 does.
    assert (
        check(Case(env=KEYS, credentials=creds, options={"profile": "other"}))[0].access_key
        == "AKOTHER"
    )
    assert (
        check(
            Case(
                env=KEYS,
                options={"access_key_id": "AKOPT", "secret_access_key": "s"},
                credentials=creds,
            )
        )[0].access_key
        == "AKOPT"
    )


def test_verify_tls_values():
    assert StorageOptions().verify_tls is None
    assert StorageOptions(verify_tls=Path("/x/ca.pem")).verify_tls == "/x/ca.pem"
    for bad in ("", "  ", 1, b"/x"):
        with pytest.raises(ConfigError, match="verify_tls"):
            StorageOptions(verify_tls=bad)
    assert StorageOptions().addressing_style is None
    with pytest.raises(ConfigError):
        StorageOptions(addressing_style="sideways")
