"""Where an S3 client's endpoint, region, addressing style, credentials and TLS trust come from.

boto3 is the reference: for the same environment, config files and options, the client resolves
what a boto3 client built with the same arguments resolves, because the resolution is botocore's
own (boto3 is a thin layer over botocore's session). cloudckpt passes on only what the user set in
``StorageOptions`` and leaves everything else ``None`` for botocore to fill in. The order, first
match wins:

- endpoint: ``StorageOptions.endpoint_url``; ``AWS_ENDPOINT_URL_S3``; ``AWS_ENDPOINT_URL``; the
  profile's ``services`` section (``s3 =`` / ``endpoint_url =``); the profile's ``endpoint_url``.
  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`` (or the profile's
  ``ignore_configured_endpoint_urls``) skips all but the first. Else AWS S3 for the region.
- region: ``StorageOptions.region``; ``AWS_DEFAULT_REGION``; the profile's ``region``; then
  ``AWS_REGION`` -- the one addition to boto3, which ignores ``AWS_REGION``; it is read only where
  boto3 would find no region at all, so it never overrides what boto3 resolves --; else botocore's
  default (``us-east-1``).
- addressing style: ``StorageOptions.addressing_style``; the profile's ``s3 =`` /
  ``addressing_style =``; else botocore's default: path style with a configured endpoint (what
  S3-compatible servers need), virtual hosted on AWS S3.
- credentials: ``StorageOptions.access_key_id`` / ``secret_access_key`` / ``session_token``; else
  botocore's chain (environment, ``AWS_PROFILE`` or ``StorageOptions.profile``, the credentials
  and config files, SSO, web identity, container and instance roles).
- TLS trust (``StorageOptions.verify_tls``): ``False`` turns verification off; a path trusts that
  PEM bundle; ``None`` (default) or ``True`` verify with botocore's chain: ``AWS_CA_BUNDLE``, the
  profile's ``ca_bundle``, ``REQUESTS_CA_BUNDLE``, then certifi's bundle.

Pure apart from reading the environment, the config files (through the session) and, for
``check_ca_bundle``, whether a file exists.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import botocore.exceptions

from cloudckpt.errors import ConfigError
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.s3.shapes import ConfigSession, S3Client

__all__ = [
    "ResolvedS3",
    "check_ca_bundle",
    "client_kwargs",
    "describe",
    "endpoint_source",
    "is_aws_endpoint",
    "resolve_region",
    "ssl_context",
    "verify_arg",
]

_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def resolve_region(options: StorageOptions, session: ConfigSession) -> str | None:
    """The region to give botocore, or None to let it pick its default (see the module's order).
    ``session`` is the botocore (or aiobotocore) session the client is made from."""
    return (
        options.region
        or session.get_config_variable("region")
        or os.environ.get("AWS_REGION")
        or None
    )


def endpoint_source(
    options: StorageOptions, session: ConfigSession | None = None
) -> tuple[str | None, str]:
    """``(endpoint URL, the setting that names it)`` in botocore's order (the module's), e.g.
    ``("http://h:8333", "AWS_ENDPOINT_URL")``; ``(None, "")`` when no setting names one (AWS S3).
    Without ``session`` only the options and the environment are read (the profile's settings
    are then not seen)."""
    if options.endpoint_url:
        return options.endpoint_url, "StorageOptions.endpoint_url"
    if session is not None:
        try:
            ignore = session.get_config_variable("ignore_configured_endpoint_urls")
        except botocore.exceptions.BotoCoreError:  # a missing profile: the client says so
            return None, ""
    else:
        ignore = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
    if ignore:
        return None, ""
    for name in _ENDPOINT_VARIABLES:
        if os.environ.get(name):
            return os.environ[name], name
    if session is None:
        return None, ""
    try:
        scoped = session.get_scoped_config()
        profile = f"AWS profile {session.profile or 'default'!r}"
        section = scoped.get("services")
        if section:
            url = (
                session.full_config.get("services", {})
                .get(section, {})
                .get("s3", {})
                .get("endpoint_url")
            )
            if url:
                return url, f"services section {section!r} of {profile}"
        if scoped.get("endpoint_url"):
            return scoped["endpoint_url"], f"endpoint_url of {profile}"
    except botocore.exceptions.BotoCoreError:
        pass
    return None, ""


def is_aws_endpoint(url: str | None) -> bool:
    """Whether ``url`` is one of AWS S3's own endpoints (``*.amazonaws.com[.cn]``)."""
    host = (urlsplit(url).hostname or "") if url else ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def verify_arg(options: StorageOptions) -> bool | str | None:
    """The ``verify`` argument for botocore: None (its own CA chain) unless the options turn
    verification off or name a CA bundle. ``True`` means "verify", as None does: botocore would
    otherwise skip ``AWS_CA_BUNDLE`` and the profile's ``ca_bundle``."""
    verify = options.verify_tls
    if verify is None or verify is True:
        return None
    return verify


def ca_bundle_source(options: StorageOptions, session: ConfigSession) -> tuple[str | bool, str]:
    """``(bundle, where it came from)``, resolved in botocore's order: a path, or True for the
    default bundle (certifi), or False when verification is off."""
    verify = verify_arg(options)
    if verify is not None:
        return verify, "StorageOptions.verify_tls"
    bundle = session.get_config_variable("ca_bundle")
    if bundle is not None:
        if "AWS_CA_BUNDLE" in os.environ:
            return bundle, "AWS_CA_BUNDLE"
        return bundle, f"ca_bundle of AWS profile {session.profile or 'default'!r}"
    if "REQUESTS_CA_BUNDLE" in os.environ:
        return os.environ["REQUESTS_CA_BUNDLE"], "REQUESTS_CA_BUNDLE"
    return True, "the default CA bundle"


def check_ca_bundle(options: StorageOptions, session: ConfigSession) -> None:
    """Raise ``ConfigError`` when the CA bundle that would be used is empty or not a file (botocore
    would fail later, at the first request, with a less helpful message)."""
    bundle, source = ca_bundle_source(options, session)
    if not isinstance(bundle, str):
        return
    if not bundle.strip():
        raise ConfigError(f"the CA bundle from {source} is empty: unset it or give a PEM file")
    if not os.path.isfile(bundle):
        raise ConfigError(
            f"the CA bundle {bundle!r} from {source} is not a file: "
            "give the path of a PEM file of trusted certificates"
        )


def client_kwargs(options: StorageOptions, session: ConfigSession) -> dict[str, Any]:
    """Keyword arguments of ``session.create_client("s3", ...)`` other than ``config``: only what
    the options set, plus the region (``resolve_region``); botocore resolves the rest."""
    return dict(
        region_name=resolve_region(options, session),
        endpoint_url=options.endpoint_url,
        verify=verify_arg(options),
        aws_access_key_id=options.access_key_id,
        aws_secret_access_key=options.secret_access_key,
        aws_session_token=options.session_token,
    )


@dataclass(frozen=True, kw_only=True)
class ResolvedS3:
    """What a created S3 client resolved; safe to log (no secret, no access key).

    ``addressing_style``: ``"path"``, ``"virtual"`` or ``"auto"`` (virtual hosted where the bucket
    name allows it, the AWS default); ``verify``: False, True (the default bundle) or a path;
    ``credentials``: botocore's name for where the credentials came from (``"env"``,
    ``"shared-credentials-file"``, ``"explicit"``, ...), None when there are none.
    """

    endpoint_url: str
    region: str | None
    addressing_style: str
    verify: bool | str | None
    credentials: str | None


def describe(client: S3Client) -> ResolvedS3:
    """The ``ResolvedS3`` of a botocore or aiobotocore S3 client (for logs and tests)."""
    s3 = client.meta.config.s3 or {}
    style = s3.get("addressing_style") or "auto"
    builtins = getattr(getattr(client, "_ruleset_resolver", None), "_builtins", None) or {}
    if builtins.get("AWS::S3::ForcePathStyle"):
        style = "path"  # botocore's rule: a configured endpoint and no "virtual"
    credentials = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    return ResolvedS3(
        endpoint_url=client.meta.endpoint_url,
        region=client.meta.region_name,
        addressing_style=style,
        verify=getattr(session, "_verify", None),
        credentials=getattr(credentials, "method", None) if credentials else None,
    )


def ssl_context(verify: bool | str | None) -> ssl.SSLContext:
    """The TLS context aiobotocore builds for a client's ``verify`` (False: no verification;
    True or None: botocore's CA bundle; a path: that bundle), for connections made beside it
    (``s3_rangeget``)."""
    from botocore.httpsession import create_urllib3_context, get_cert_path

    context: ssl.SSLContext = create_urllib3_context()  # botocore is untyped
    if verify is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    context.check_hostname = True
    bundle = get_cert_path(True if verify is None else verify)
    if bundle:
        context.load_verify_locations(bundle, None, None)
    return context
