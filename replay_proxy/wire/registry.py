"""Which release schemas there are, and where: the package's own files (``schemas/``, ``rust_schemas/``, one a
release, extracted from its own classes or sources), and those a user added since (``add-release``) under
``added_releases()``, read first. The one module of ``wire/`` that reads files and the environment; each schema
is read once (``forget_schemas`` after one is added).

A recording names the release its engines announced; ``schema_for`` gives that release's schema and says
whether it is that release's (``exact``): where it is not, the newest release not newer than it stands in,
and whoever decodes with it records so (``sessions.schema_exact``, and each drift alarm says "nearest").
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import msgspec

from replay_proxy.wire.rust import RustSchema
from replay_proxy.wire.schema import Schema, release_key

SCHEMAS = Path(__file__).resolve().parent / "schemas"
RUST_SCHEMAS = Path(__file__).resolve().parent / "rust_schemas"


def added_releases() -> Path:
    """Where releases are added on the day they ship (``add-release``): their schemas in schemas/ (read
    before the package's), what their Rust frontend sends in recordings/. The user's, since the installed
    package may be read-only: $REPLAY_PROXY_ADDED_RELEASES, else added-releases/ in $REPLAY_PROXY_CACHE
    (default ~/.cache/replay-proxy)."""
    cache = os.environ.get("REPLAY_PROXY_CACHE") or Path.home() / ".cache" / "replay-proxy"
    return Path(os.environ.get("REPLAY_PROXY_ADDED_RELEASES") or Path(cache) / "added-releases")


@functools.cache
def shipped_releases() -> tuple[str, ...]:
    """Releases with a schema, oldest first: in the package, and added since (``added_releases``)."""
    folders = [f for f in (SCHEMAS, added_releases() / "schemas") if f.is_dir()]
    names = {p.name.removesuffix(".json") for f in folders for p in f.iterdir() if p.name.endswith(".json")}
    return tuple(sorted(names, key=release_key))


def shipped_path(release: str) -> Path:
    """A release's schema file: one added by the user (``added_releases``), else the package's."""
    added = added_releases() / "schemas" / f"{release}.json"
    return added if added.exists() else SCHEMAS / f"{release}.json"


@functools.cache
def load_schema(release: str) -> Schema:
    return msgspec.json.decode(shipped_path(release).read_bytes(), type=Schema)


def forget_schemas() -> None:
    """After a schema was added: the next look is at the files again."""
    shipped_releases.cache_clear()
    load_schema.cache_clear()


def schema_for(version: str | None) -> tuple[Schema, bool]:
    """The schema for a reported ``vllm_version``, and whether it is that release's own (``exact``).

    An unknown or missing version gets the newest shipped release not newer than it (the oldest one if it
    predates them all), with ``exact`` False: the caller says so where it decodes with it.
    """
    releases = shipped_releases()
    if not version:
        return load_schema(releases[-1]), False
    wanted = release_key(version)
    for release in releases:
        if release_key(release) == wanted:
            return load_schema(release), True
    older = [r for r in releases if release_key(r) <= wanted]
    return load_schema(older[-1] if older else releases[0]), False


def rust_schema_path(release: str) -> Path:
    """A release's Rust schema file: one added by the user (``added_releases``), else the package's."""
    added = added_releases() / "rust_schemas" / f"{release}.json"
    return added if added.exists() else RUST_SCHEMAS / f"{release}.json"


def load_rust_schema(release: str) -> RustSchema | None:
    """The shipped (or added) Rust schema of ``release``; None if it has none."""
    path = rust_schema_path(release)
    return msgspec.json.decode(path.read_bytes(), type=RustSchema) if path.exists() else None
