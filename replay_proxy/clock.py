"""The one wall clock of records that people read: sessions' and matrix runs' start and end."""

import datetime


def utc_now(timespec: str = "milliseconds") -> str:
    """Now, in UTC, as ISO 8601 (``2026-12-01T21:40:54.123+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec)
