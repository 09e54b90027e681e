"""The command line: each command parses its options, makes the library calls it needs and renders the result.

The commands live by group (``recording``, ``comparing``, ``matrix``, ``peers``); ``common`` holds
the apps, the consoles and how a command ends; ``run`` is the console script.
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer
import zmq
from rich.markup import escape

from replay_proxy import __version__
# Importing them registers their commands, in the order `-h` lists them.
from replay_proxy.cli import recording, comparing, matrix, peers  # noqa: F401
from replay_proxy.cli.common import app, err, out
from replay_proxy.errors import ExitCode, ReplayProxyError, leaf
from replay_proxy.processes import stop_groups


def _version(value: bool) -> None:
    if value:
        out.print(f"replay-proxy {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    """Record and replay the ZeroMQ link between vLLM frontends and engines."""


def run() -> None:
    """The console script: click's errors as one line, Ctrl-C and SIGTERM as exit code 130.

    SIGTERM is turned into SIGINT so that it unwinds like Ctrl-C (trio raises it at a
    safe point): cleanup runs, a replay's peer under test is stopped; what runs in a group
    of its own (``processes.run_group``: installs, the replays of matrix and shrink) is
    stopped first. `record` handles both signals itself and exits 0 once its recording
    is complete.
    """
    # SIGINT as Python handles it, even where it was ignored (a job a shell started in the background, as CI
    # runners do): SIGTERM is turned into it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (stop_groups(), signal.raise_signal(signal.SIGINT)))
    try:
        code = app(standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        code = ExitCode.INTERRUPTED
    except BaseExceptionGroup as group:  # from a trio nursery: say what went wrong, in one line
        error = leaf(group)
        if isinstance(error, KeyboardInterrupt):  # (a replay's, raised inside its nursery)
            code = ExitCode.INTERRUPTED
        elif isinstance(error, (ReplayProxyError, OSError, zmq.ZMQError)):
            err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
            code = ExitCode.ERROR
        else:
            raise
    except ReplayProxyError as error:  # what the arguments name cannot be used: the input's class, exit 1
        err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
        code = ExitCode.ERROR
    except typer.TyperException as exc:  # click's usage errors, as vendored by typer
        ctx = getattr(exc, "ctx", None)
        hint = f" (see {ctx.command_path} -h)" if ctx is not None else ""
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        err.print(f"[bold red]error:[/] {message}{hint}", highlight=False)
        code = getattr(exc, "exit_code", ExitCode.USAGE)
    sys.exit(code if isinstance(code, int) else 0)
