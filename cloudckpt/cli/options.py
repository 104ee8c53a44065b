"""Options every ``cloudckpt`` command takes, the one ``StorageOptions`` made of them, and
argparse with one-line errors.

``--endpoint-url URL``, ``--profile NAME`` and ``--timeout SECONDS`` are accepted before or after
the command's name (as ``aws`` does). :func:`storage_options` turns them into the one
``StorageOptions`` every command of the run uses, and refuses (:class:`UsageError`, exit 2) an
endpoint that is not an ``http(s)://`` URL, from the option or from ``AWS_ENDPOINT_URL[_S3]``,
and a profile the AWS config files do not define.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

from cloudckpt.errors import ConfigError

#: The command's exit statuses (141, stdout closed by its reader: cloudckpt.cli.stdout).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A command-line mistake detected after parsing (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``cloudckpt ls: error: MESSAGE (see cloudckpt ls --help)``
    on stderr and exit 2, instead of the usage block."""

    def error(self, message: str):
        text = " ".join(message.split())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


_WHOLE = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def whole_number(minimum: int):
    """ASCII digits only (``int()`` also takes ``٣``, ``1_0`` and spaces)."""

    def parse(text: str) -> int:
        if not _WHOLE.fullmatch(text):
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def seconds(*, positive: bool):
    """A decimal number in ASCII (``float()`` also takes ``nan``, ``١.٥`` and ``1_0``)."""

    def parse(text: str) -> float:
        if not _DECIMAL.fullmatch(text):
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}")
        value = float(text)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if positive else '>='} 0 seconds, got {text}"
            )
        return value

    return parse


def global_options(parser: argparse.ArgumentParser, *, default: Any) -> None:
    """The options every command takes, before or after its name (``default`` SUPPRESS on the
    subcommands so that a value given before the command is kept)."""
    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument(
        "--endpoint-url",
        metavar="URL",
        default=default,
        help="S3 endpoint, http://HOST[:PORT] or https://... (default: AWS_ENDPOINT_URL_S3, "
        "AWS_ENDPOINT_URL, the profile's, else AWS S3)",
    )
    group.add_argument(
        "--profile",
        metavar="NAME",
        default=default,
        help="profile of the AWS config and credentials files (default: "
        "AWS_PROFILE, else 'default')",
    )
    group.add_argument(
        "--timeout",
        type=seconds(positive=True),
        metavar="SECONDS",
        default=default,
        help="give up on an endpoint that does not answer after about SECONDS "
        "(default: about 60; StorageOptions.with_timeout)",
    )


def storage_options(args) -> Any:
    """The one ``StorageOptions`` every command of this run uses, from ``--endpoint-url``,
    ``--profile`` and ``--timeout`` (None when none is given: the standard AWS chain). An endpoint
    (the option's, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) that is not an http(s)
    URL, and a profile the AWS config files do not define, are ``UsageError``s."""
    from cloudckpt.storage.options import StorageOptions, check_endpoint_url

    for source in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if args.endpoint_url is None and os.environ.get(source):
            _usage_from(check_endpoint_url, os.environ[source], source)
    if args.endpoint_url is not None:
        _usage_from(check_endpoint_url, args.endpoint_url, "--endpoint-url")
    if args.profile is not None:
        _check_profile(args.profile)
    if args.endpoint_url is None and args.profile is None and args.timeout is None:
        return None
    options = StorageOptions(endpoint_url=args.endpoint_url, profile=args.profile)
    if args.timeout is not None:
        options = options.with_timeout(args.timeout)
    return options


def _usage_from(check, *args) -> None:
    try:
        check(*args)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def _check_profile(name: str) -> None:
    from botocore.session import Session

    known = Session().available_profiles
    if name not in known:
        listed = ", ".join(sorted(known)[:10]) or "none"
        raise UsageError(
            f"--profile {name!r} is not defined in the AWS config or credentials "
            f"files (profiles there: {listed})"
        )
