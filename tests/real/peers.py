"""The real vLLM peers the tests start (command lines: replay_proxy/peers.py).

Every process is a ``Child`` (own process group, log file, stopped by PID);
every wait is bounded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import sys
import urllib.request
from pathlib import Path

from replay_proxy import peers as real
from replay_proxy.matrix import RECORDINGS
from replay_proxy.peers import Frontend, command
from replay_proxy.processes import Child, ChildError, free_port
from replay_proxy.releases import cache_dir

CACHE = cache_dir()
VENV = CACHE / "vllm-0.32.0"
ENGINE_RELEASES = ("0.32.0", "0.31.0")
MODEL = CACHE / "tiny-model"
MOE_MODEL = CACHE / "tiny-moe"
TRAINED = CACHE / "tiny-trained"  # the tiny model trained: peaked distributions (scripts/make_tiny_model.py --trained)
# A frontend and engine that serve LoRA adapters (the frontend also loads them through its API), in the
# cache folder, where the tiny adapter's relative path (real.ADAPTER) finds it.
LORA = real.SERVING["lora"]
NO_KIND = real.SERVING["completion"]
# The tiny model served as an embedding model, by vLLM's pooling runner (its frontend and engine alike).
POOLING = real.SERVING["pooling"]
VLLM_RS = {v: CACHE / "bin" / f"vllm-rs-{v}" for v in ("0.27.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")}
# How long a real peer may take to be ready: 25-60 s on this machine alone, over 300 s with a second suite
# beside it on its two cores (seen); one replay, at most, is that and its finish and set-up besides.
READY_TIMEOUT_S = 600
REPLAY_S = READY_TIMEOUT_S + 180


def installed() -> bool:
    return all((m / ".complete").exists() for m in (MODEL, MOE_MODEL, TRAINED)) and real.smg_program().exists() and all(
        p.exists() for p in VLLM_RS.values()) and all(real.engine_installed(r) for r in ENGINE_RELEASES)


def real_child(argv: list[str], log: Path, name: str, serving: real.Serving = NO_KIND, **env: str) -> Child:
    """A real vLLM process in the vLLM environment, serving what ``serving`` says, its scratch folder removed
    when it is stopped."""
    scratch = real.scratch_dir()
    return Child([*argv, *serving.flags], log, env=real.vllm_env(scratch, **serving.env, **env), name=name,
                 owns=scratch, cwd=CACHE if serving.adapter else None)


def python_frontend(logs: Path, http_port: int, rpc_port: int, dp: int = 1, model: Path = MODEL,
                    release: str = "0.32.0", flags: tuple[str, ...] = (), serving: real.Serving = NO_KIND,
                    **env: str) -> Child:
    return real_child([*python_frontend_argv(http_port, rpc_port, dp, model, release), *flags],
                      logs / "frontend.log", f"vllm {release} frontend", serving, **env)


def rust_frontend(logs: Path, http_port: int, rpc_port: int, version: str = "0.32.0", dp: int = 1) -> Child:
    return real_child(rust_frontend_argv(http_port, rpc_port, version, dp), logs / f"vllm-rs-{version}.log",
                      f"vllm-rs {version}")


SMG_FRONTEND = Frontend("smg", real.SMG)


def smg_frontend(logs: Path, http_port: int, rpc_port: int, model: Path = MODEL) -> Child:
    """smg (a third-party frontend) binding its handshake at ``rpc_port`` (one of ``real.SMG_PORTS``:
    ``real.handshake_port``), its ipc sockets in a scratch folder."""
    return Child(real.frontend_argv(SMG_FRONTEND, http_port, rpc_port, model_dir=model), logs / "smg.log",
                 name=str(SMG_FRONTEND))


def headless_engine(logs: Path, rpc_port: int, dp: int = 1, start_rank: int = 0, local: int = 1,
                    name: str = "engine", model: Path = MODEL, release: str = "0.32.0", flags: tuple[str, ...] = (),
                    serving: real.Serving = NO_KIND, **env: str) -> Child:
    return real_child([*real.engine_argv(rpc_port, release, dp, start_rank, local, model), *flags],
                      logs / f"{name}.log", f"{name} {release}", serving, **env)


def engine_command(rpc_port: int, release: str = "0.32.0", flags: tuple[str, ...] = (),
                   serving: real.Serving = NO_KIND, **extra: str) -> str:
    return command([*real.engine_argv(rpc_port, release), *flags], serving=serving, **extra)


# A vLLM general plugin that injects one real regression into the engine that loads it (its docstring).
INJECT = Path(__file__).resolve().parents[2] / "scripts" / "inject"


def injected_engine_command(rpc_port: int, kind: str = "", slot: int = 100, model: Path = TRAINED) -> str:
    """A 0.32.0 engine serving ``model`` (the trained one) with scripts/inject on its PYTHONPATH, injecting
    ``kind`` (none: the same build, loaded the same way); ``slot``: the token ``vocab-slot`` breaks."""
    return command(real.engine_argv(rpc_port, "0.32.0", model_dir=model), PYTHONPATH=str(INJECT),
                   REPLAY_PROXY_INJECT=kind, REPLAY_PROXY_INJECT_TOKEN=str(slot))


def python_frontend_argv(http_port: int, rpc_port: int, dp: int = 1, model: Path = MODEL,
                         release: str = "0.32.0") -> list[str]:
    return real.frontend_argv(Frontend("vllm", release), http_port, rpc_port, dp, model)


def rust_frontend_argv(http_port: int, rpc_port: int, version: str = "0.32.0", dp: int = 1) -> list[str]:
    return real.frontend_argv(Frontend("vllm-rs", version), http_port, rpc_port, dp)


def proxy(logs: Path, listen_port: int, upstream_port: int, db: Path, session: str, *extra: str) -> Child:
    child = Child([sys.executable, "-m", "replay_proxy", "record", "--listen", f"tcp://127.0.0.1:{listen_port}",
                   "--upstream", f"tcp://127.0.0.1:{upstream_port}", "--db", str(db), "--session", session,
                   *extra], logs / f"proxy-{session}.log", name="replay-proxy record")
    child.wait_for_log("listening on", timeout=30)
    return child


def wait_http_ready(port: int, children: list[Child], timeout: float = READY_TIMEOUT_S, path: str = "/v1/models"
                    ) -> None:
    real.wait_http_ready(port, children, timeout, path)  # (the suite's wait: longer, for a second suite beside it)


def post(port: int, path: str, body: dict, timeout: float = 60, text: bool = False) -> dict | str:
    """POST ``body`` as JSON; the answer's JSON (``text``: its text, for an endpoint that answers in words)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode() if text else json.load(response)


def stream(port: int, path: str, body: dict, stop_after: int | None = None, timeout: float = 60,
           before_close=lambda: None) -> list[dict]:
    """POST with stream=true; return the SSE events, closing early after ``stop_after`` of them (having
    called ``before_close`` first)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            events.append(json.loads(line[len(b"data: "):]))
            if stop_after is not None and len(events) >= stop_after:
                before_close()
                break  # closing the connection makes the frontend abort the request
    return events


def sim_engine(logs: Path, rpc_port: int, release: str) -> Child:
    """The project's sim engine speaking ``release``: for a release whose engine cannot run here."""
    return Child(real.sim_engine_argv(rpc_port, release), logs / f"sim-engine-{release}.log",
                 name=f"sim engine {release}")


def run_pair(logs: Path, frontend, db: Path | None = None, session: str | None = None,
             engine_release: str = "0.32.0", work=None, engine_flags: tuple[str, ...] = (),
             serving: real.Serving = NO_KIND, sim: bool = False, model: Path = MODEL, upstream: int | None = None,
             proxy_flags: tuple[str, ...] = (), ready_path: str = "/v1/models") -> dict:
    """Frontend + headless engine of ``engine_release`` (with ``engine_flags``, serving ``model`` as ``serving`` says;
    a sim engine of that release with ``sim``; + the recording proxy between them, with ``proxy_flags``, when ``db``
    is given). The frontend binds its handshake at ``upstream`` (default: a free port), and is ready when its
    ``ready_path`` answers.

    Runs the HTTP workload (``work``: another of tests/real/workload.py's) and returns what the user saw;
    every process is stopped by PID before returning.
    """
    from tests.real import workload

    http, upstream = free_port(), upstream or free_port()
    children = [frontend(logs, http, upstream)]
    try:
        listen = upstream
        if db is not None:
            listen = free_port()
            children.append(proxy(logs, listen, upstream, db, session, *proxy_flags))
        engine = sim_engine(logs, listen, engine_release) if sim else \
            headless_engine(logs, listen, release=engine_release, flags=engine_flags, serving=serving, model=model)
        children.append(engine)
        wait_http_ready(http, children, path=ready_path)
        return (work or workload.run)(http, hold_engine=engine.held,
                                      abort_seen=db and functools.partial(abort_recorded, db))
    finally:
        for child in reversed(children):
            child.stop()
        if db is not None and children[1].process.returncode != 0:
            raise ChildError(f"replay-proxy record exited with {children[1].process.returncode}:\n"
                             f"{children[1].log_tail()}")


def abort_recorded(db: Path) -> bool:
    """Whether an ABORT has crossed the recording proxy (the writer decodes within a second or so)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as connection:
            return connection.execute("SELECT COUNT(*) FROM frames WHERE kind = 'ABORT'").fetchone()[0] > 0
    except sqlite3.OperationalError:  # no frames table yet
        return False


RECORDING = RECORDINGS / "vllm-0.32.0-python.db"


def recording_of(release: str) -> Path:
    """The recording of ``release``'s own Python frontend and engine; 0.32.0's for a release with no
    engine that runs here (0.33.0 has no CPU build)."""
    own = RECORDINGS / f"vllm-{release}-python.db"
    return own if own.exists() else RECORDING


def replay_cli(tmp_path: Path, *target: str, edit=None, recording: Path = RECORDING,
               session: str = "python-frontend", finish_timeout_s: float = 60) -> tuple:
    """Run `replay-proxy replay` of a Python-frontend recording (of a copy changed by ``edit(db)`` if given),
    recorded into tmp_path/replay.db (its default --out); return (result, report JSON)."""
    import shutil
    import subprocess

    tmp_path.mkdir(parents=True, exist_ok=True)
    db = recording
    if edit is not None:
        db = tmp_path / "edited.db"
        shutil.copy(recording, db)
        edit(db)
    result = subprocess.run(
        [sys.executable, "-m", "replay_proxy", "replay", "--db", str(db), "--session", session,
         *target, "--ready-timeout", str(READY_TIMEOUT_S), "--finish-timeout", str(finish_timeout_s),
         "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=3 * REPLAY_S)  # a candidate and its noise runs, one by one
    return result, json.loads((tmp_path / "report.json").read_text())


__all__ = ["Child", "free_port", "headless_engine", "installed", "post", "proxy", "python_frontend",
           "run_pair", "rust_frontend", "stream", "wait_http_ready"]
