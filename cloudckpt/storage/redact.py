"""Redaction of credentials from the DEBUG records of botocore and aiobotocore.

botocore logs canonical requests and request headers at DEBUG level, which carry the session
token (``x-amz-security-token``) of temporary credentials; the secret key itself never leaves
the signer. :func:`install_redaction` adds a filter to the loggers that print requests, so those
values are replaced by ``<redacted>`` before any handler sees them. Idempotent.
"""

from __future__ import annotations

import logging
import re

_PATTERN = re.compile(
    r"(?i)(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)([^'\"\s,}&]+)"
    r"|(?i:(X-Amz-Security-Token=))([^&\s'\"]+)"
)

#: Loggers whose records may hold request headers, canonical requests or signed URLs.
_LOGGERS = (
    "botocore.auth",
    "botocore.endpoint",
    "botocore.hooks",
    "botocore.httpsession",
    "botocore.retryhandler",
    "botocore.parsers",
    "botocore.signers",
    "botocore.client",
    "aiobotocore.endpoint",
    "aiobotocore.httpsession",
    "aiobotocore.client",
    "aiobotocore.hooks",
    "aiobotocore.signers",
    "aiobotocore.parsers",
)


def redact(text: str) -> str:
    """``text`` with every session-token value replaced by ``<redacted>``."""
    return _PATTERN.sub(lambda m: (m.group(1) or m.group(3)) + "<redacted>", text)


class _RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is left as it is
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


_FILTER = _RedactingFilter()


def install_redaction() -> None:
    """Attach the redacting filter to every request-printing botocore/aiobotocore logger."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
