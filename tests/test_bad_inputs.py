"""One table of bad inputs, every command: each database a command reads, given as each kind of file that is not
one, is answered in one line that names it, with exit code 1 (docs/commands.md: "Exit codes"), before anything
slow starts; the input keeps its bytes and nothing is made beside it. A new command that takes a path joins the
table, or this file fails."""

import inspect
import shlex
import shutil
import sqlite3
import typing
from pathlib import Path

import pytest

from replay_proxy.cli import app
from replay_proxy.processes import free_port
from tests.helpers import ROOT, cli

DEMO = ROOT / "recordings" / "demo.db"

# How each command is run with the input under test as {input}: a valid recording is {recording} (session demo),
# outputs go under {out}, {port} is a free port. A database a command writes (record, matrix) may be missing or
# empty (it makes one there): WRITTEN says which.
COMMANDS = {
    ("record", "db"): "record --listen tcp://127.0.0.1:{port} --upstream tcp://127.0.0.1:{port2} --db {input}",
    ("redact", "db"): "redact --db {input} --out {out}/r.db --key-file {key} --vocab-size 1000",
    ("cut", "db"): "cut --db {input} --session demo --out {out}/c.db",
    ("sessions", "db"): "sessions --db {input}",
    ("decode", "db"): "decode --db {input}",
    ("migrate", "db"): "migrate --db {input}",
    ("export", "db"): "export --db {input} --parquet {out}/lake",
    ("query", "db"): "query --db {input} 'SELECT 1'",
    ("datasette-metadata", "databases"): "datasette-metadata {input}",
    ("diff", "db"): "diff --db {input} --baseline-db {recording} --baseline demo --candidate demo",
    ("diff", "baseline_db"): "diff --db {recording} --baseline-db {input} --baseline demo --candidate demo",
    ("replay", "db"): "replay --db {input} --session demo --against engine --listen tcp://127.0.0.1:{port} "
                      "--engine-cmd false --out {out}/replay.db",
    ("shrink", "db"): "shrink --db {input} --session demo --out {out}/shrunk --against engine --engine-cmd "
                      "'false {{port}}'",
    ("bisect", "db"): "bisect --db {input} --session demo --against engine --releases 0.30.0..0.31.0",
    ("readers", "db"): "readers --db {input} --session demo",
    ("can-i-deploy", "db"): "can-i-deploy --frontend vllm==0.32.0 --engine vllm==0.32.0 --db {input}",
    ("matrix", "db"): "matrix --predict-only --frontends vllm:0.32.0..0.32.0 --engines 0.32.0 --db {input}",
    ("add-release", "db"): "add-release 9.9.9 --db {input}",
    ("merge", "db"): "merge {out}/shard-1 --report-dir {out}/matrix --db {input}",
}
WRITTEN = {("record", "db"), ("matrix", "db"), ("add-release", "db"), ("merge", "db")}
# Paths that are not databases: where a command writes (it makes them), or sources, keys, policies and rules, whose
# own checks their commands' tests cover.
NOT_DATABASES = {"out", "parquet", "report_dir", "out_db", "output", "key_file", "policy", "redact_key",
                 "redact_policy", "rules", "recordings", "python", "vllm_src", "rust_src", "schema", "shards",
                 "tokenizer"}


def path_options() -> set[tuple[str, str]]:
    """Every (command, parameter) of the CLI whose value is a path."""
    found = set()

    def walk(typer_app, prefix):
        for command in typer_app.registered_commands:
            name = prefix + (command.name or command.callback.__name__.replace("_", "-"))
            for parameter, hint in typing.get_type_hints(command.callback, include_extras=True).items():
                if "Path" in str(hint) and parameter in inspect.signature(command.callback).parameters:
                    found.add((name, parameter))
        for group in typer_app.registered_groups:
            walk(group.typer_instance, prefix + group.name + " ")

    walk(app, "")
    return found


def test_every_database_a_command_takes_is_in_the_table():
    databases = {option for option in path_options() if option[1] not in NOT_DATABASES}
    assert databases == set(COMMANDS)


def make_input(kind: str, folder: Path) -> Path:
    path = folder / "input.db"
    if kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.touch()
    elif kind == "text":
        path.write_text("session,requests\nstaging,5\n")
    elif kind == "truncated":
        path.write_bytes(DEMO.read_bytes()[:DEMO.stat().st_size // 2])
    elif kind == "foreign":
        with sqlite3.connect(path) as other:
            other.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
            other.execute("INSERT INTO notes (body) VALUES ('not a recording')")
        other.close()
    return path


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {p.name: p.read_bytes() if p.is_file() else None for p in folder.iterdir()}


KINDS = ["missing", "folder", "empty", "text", "truncated", "foreign"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_a_bad_input_gets_one_line_naming_it_and_exit_1_and_is_left_as_it_was(tmp_path, command, kind):
    if command in WRITTEN and kind in ("missing", "empty"):
        pytest.skip(f"{command[0]} makes a database where its --{command[1]} is {kind}")
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    bad = make_input(kind, inputs)
    recording = Path(shutil.copy(DEMO, out / "recording.db"))
    key = out / "key"
    key.write_bytes(bytes(range(32)))
    before = snapshot(inputs)
    argv = COMMANDS[command].format(input=bad, recording=recording, out=out, key=key, port=free_port(),
                                    port2=free_port())
    done = cli(*shlex.split(argv), timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(bad) in lines[0] and lines[0].startswith("error:"), done.stderr
    assert done.returncode == 1, done.stderr
    assert snapshot(inputs) == before
