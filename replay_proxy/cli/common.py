"""What every command shares: the typer apps, the two consoles, and how a command ends."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import click
import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from replay_proxy.compare.findings import Report, exit_code
from replay_proxy.compare.rules import Rules, load_rules
from replay_proxy.errors import ExitCode

class PanelledCommand(TyperCommand):
    """Help as click lays it out, each option's name whole and its help wrapped beside or under it (a rich
    table cuts names at 80 columns), in a section per ``rich_help_panel`` where a command groups its options."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {"Options": []}  # the command's own first
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for name, records in panels.items():
            if records:
                with formatter.section(name):
                    formatter.write_dl(records)


class App(typer.Typer):
    """A Typer whose commands are ``PanelledCommand``s, with plain (unstyled) help."""

    def __init__(self, **kwargs):
        super().__init__(rich_markup_mode=None, **kwargs)

    def command(self, *args, **kwargs):
        return super().command(*args, cls=kwargs.pop("cls", PanelledCommand), **kwargs)


app = App(
    help="Record and replay the ZeroMQ link between vLLM frontends and engines.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
schema_app = App(help="Per-release wire schemas.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")
sim_app = App(help="Protocol-faithful fake peers, to try the proxy without vLLM.", no_args_is_help=True)
app.add_typer(sim_app, name="sim")
peers_app = App(help="Real vLLM peers, fetched from pip into the cache ($REPLAY_PROXY_CACHE).",
                no_args_is_help=True)
app.add_typer(peers_app, name="peers")
# Query results are wide: piped, they are not folded at 80 columns, but at what COLUMNS says (200 if it says none).
out = Console(width=None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 200))
err = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: ExitCode = ExitCode.ERROR) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(int(code))


JSON_HELP = "Print the report's document (what report.json holds) on stdout instead of the summary."


def finish_report(report: Report, report_dir: Path | None, show_info: bool = False, as_json: bool = False
                  ) -> NoReturn:
    """The ending of every command that produces a report: summary (or, ``as_json``, the report's document),
    report files, exit code."""
    from replay_proxy.compare.findings import report_json
    from replay_proxy.report.render import print_summary, write_reports

    if as_json:
        sys.stdout.buffer.write(report_json(report) + b"\n")
        sys.stdout.flush()
    else:
        print_summary(report, out, show_info)
    if report_dir is not None:
        for path in write_reports(report, report_dir):
            err.print(f"wrote {path}")
    raise typer.Exit(int(exit_code(report.findings)))


def check_address(value: str | None) -> str | None:
    """A ZMQ address the proxy can bind or dial as given: libzmq takes a port past 65535 modulo 65536, and an
    unknown host fails only when the socket is used, deep in a session."""
    if value is None:
        return None
    if not value.startswith(("tcp://", "ipc://")):
        raise typer.BadParameter(f"{value!r} is not a ZMQ address: use tcp://HOST:PORT or ipc:///PATH")
    if value.startswith("ipc://"):
        return value
    host, _, port = value.removeprefix("tcp://").rpartition(":")
    if not port.isdigit():
        raise typer.BadParameter(f"{value!r} has no port: use tcp://HOST:PORT")
    if not 0 <= int(port) <= 65535:
        raise typer.BadParameter(f"{value!r}: port {port} is not 0-65535")
    if host not in ("*", "") and not _resolves(host.strip("[]")):
        raise typer.BadParameter(f"{value!r}: {host} is neither a host this machine resolves nor one of its "
                                 "network interfaces")
    return value


def _resolves(host: str) -> bool:
    import socket

    try:
        socket.getaddrinfo(host, None)
        return True
    except (socket.gaierror, UnicodeError):
        return host in {name for _, name in socket.if_nameindex()}


def check_http(value: str | None) -> str | None:
    """An HTTP base URL a frontend serves (its host and port checked as ``check_address`` checks them)."""
    if value is None:
        return None
    if not value.startswith("http://"):
        raise typer.BadParameter(f"{value!r} is not an HTTP address: use http://HOST:PORT")
    try:
        check_address("tcp://" + value.removeprefix("http://").rstrip("/"))
    except typer.BadParameter as exc:  # (said of the address as given)
        raise typer.BadParameter(str(exc).replace("'tcp://", "'http://", 1)) from None
    return value


def check_frontend(value: str | None) -> str | None:
    """``NAME==VERSION`` or ``NAME``: a frontend as pip names a package (``smg==1.13.0``, ``vllm-rs==0.32.0``)."""
    if value is None:
        return None
    name, _, version = value.partition("==")
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or "==" in value and not version:
        raise typer.BadParameter(f"{value!r} is not NAME==VERSION (e.g. smg==1.13.0) or NAME")
    return value


def check_host_port(value: str | None) -> str | None:
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise typer.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9464, or 0.0.0.0:0 for any free port)")
    return value


VOCAB_SIZE_HELP = ("The model's vocabulary size (its config.json's vocab_size): bounds the top-p nucleus on flat "
                   "distributions and above temperature 1 (rules: judging.vocab_size).")


def rules_option(path: Path | None, vocab_size: int | None = None) -> Rules:
    """``--rules FILE`` over the defaults, and ``--vocab-size`` over that; a file that cannot be used is an input
    error (exit 1, ``cli.run``), as a --db is."""
    rules = load_rules(path)
    if vocab_size is None:
        return rules
    return msgspec.structs.replace(rules, judging=msgspec.structs.replace(rules.judging, vocab_size=vocab_size))
