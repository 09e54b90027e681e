"""The project's exception base and its exit codes."""

import enum


class ReplayProxyError(Exception):
    """A user-facing error: bad input, bad configuration, a peer that broke the protocol."""


def leaf(exc: BaseException) -> BaseException:
    """The error inside the (nested, single-member) exception groups that trio nurseries raise."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class ExitCode(enum.IntEnum):
    """What a run of replay-proxy ended with (docs/commands.md: "Exit codes")."""

    OK = 0  # done; for replay and diff: no regression found
    ERROR = 1  # could not do what was asked (missing file, unreachable peer, ...)
    USAGE = 2  # bad command-line arguments
    SCHEMA_BREAKING = 3  # a schema change that breaks a real decoder
    BEHAVIOUR = 4  # tokens, finish reasons, utility results differ
    PERFORMANCE = 5  # latency or throughput beyond the thresholds
    REPLAY_FAILED = 6  # the replay could not run to the end (peer never ready, timeout)
    INTERRUPTED = 130  # Ctrl-C
