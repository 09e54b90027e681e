"""Which frontend release works with which engine release: the compatibility matrix.

Theory of operation. A cell is one frontend build (``vllm-rs:X``, the Rust
frontend, or ``vllm:X``, the Python API server) and one engine release. Its
two directions are judged apart, each from what really crosses the wire in
the project's workloads (``recordings/``), one per kind of request (``KINDS``):

* to the engine: what frontend F sent (its recording) as engine E reads it;
* to the frontend: what engine E sent (its recording) as frontend F reads it.

``predict`` names those messages with the reader's release schema and asks
the readers' rules (compare/readers.json) what the reader does with each
difference, by struct, field and position. ``observe`` runs the real peers:
F's recording replayed against a real engine E, and E's recording replayed
against a real frontend F (docs/matrix.md: why the composition is sound). A
cell's verdict is the observation where there is one, else the prediction;
the two are kept side by side, and a disagreement is a finding about the rules.
Each kind of request gets its own verdict, from the recordings of its own
workload: a pair may serve completions and break every LoRA request. A kind
with no recording on either side of a cell is not judged there (never read
as works).

For others: this module (``Cell``, ``Verdict``, ``Evidence``, parsing builds and
ranges), ``run`` (``run``, ``MatrixRun``) and ``deploy`` (``can_i_deploy``,
``Answer``, ``bisect``). ``predict``, ``observe`` and ``database`` are the
matrix's own (pyproject.toml: [tool.importlinter]).
"""

from __future__ import annotations

import enum
from pathlib import Path

import msgspec

from replay_proxy.errors import ExitCode, ReplayProxyError
from replay_proxy.peers import SMG, Frontend
from replay_proxy.wire.messages import Direction
from replay_proxy.wire.schema import release_key
from replay_proxy.wire.registry import added_releases, shipped_releases

RECORDINGS = Path(__file__).resolve().parents[2] / "recordings"
# The kinds of request a cell is judged for, and the suffix of their recordings' file names. completion:
# the fixed workload (completion, chat, streaming, a seeded request, logprobs, a client abort, the start-up
# utility calls). lora: a completion, a LoRA adapter loaded through the frontend's API (the add_lora call,
# its LoRARequest) and a request naming it (an ADD carrying that LoRARequest), peers started with LoRA on.
# pooling: embeddings of two texts and a score of one against two (PoolingParams in, pooling_output tensors
# out), the tiny model served as an embedding model.
KINDS = {"completion": "", "lora": "-lora", "pooling": "-pooling"}


class MatrixError(ReplayProxyError):
    """A matrix argument or input that cannot be used."""


class Verdict(str, enum.Enum):
    WORKS = "works"
    DEGRADED = "degraded"  # it runs, with behaviour findings (a sampling key ignored, other tokens)
    BREAKS = "breaks"  # a peer rejects a message, requests fail
    UNKNOWN = "unknown"  # could not be judged: never read as works

    @property
    def exit_code(self) -> ExitCode:
        return {Verdict.WORKS: ExitCode.OK, Verdict.BREAKS: ExitCode.SCHEMA_BREAKING,
                Verdict.DEGRADED: ExitCode.BEHAVIOUR, Verdict.UNKNOWN: ExitCode.REPLAY_FAILED}[self]


def worst(verdicts) -> Verdict:
    """breaks over unknown over degraded over works."""
    order = (Verdict.BREAKS, Verdict.UNKNOWN, Verdict.DEGRADED, Verdict.WORKS)
    return min(verdicts, key=order.index, default=Verdict.WORKS)


class Evidence(msgspec.Struct, frozen=True, omit_defaults=True):
    """One reason for a verdict: a predicted change, a finding of a replay, a peer's log line."""

    verdict: Verdict
    direction: Direction | None  # the messages' direction (their reader's verdict); None: both
    message: str
    reader: str | None = None
    kind: str = "completion"  # the kind of request whose workload showed it (KINDS)
    struct: str | None = None
    field: str | None = None
    position: int | None = None
    rule: str | None = None  # readers.json rule, or the replay finding's code
    source: str | None = None  # where the reader's rule comes from, or the replay's report


class Judgement(msgspec.Struct, omit_defaults=True):
    """A verdict (over every kind it judged) with all its evidence."""

    verdict: Verdict
    evidence: list[Evidence] = []
    how: str = ""  # what produced it: the recordings read, the replays run
    seconds: float | None = None
    kinds: tuple[str, ...] = ("completion",)  # the kinds of request it judged

    def verdict_for(self, kind: str) -> Verdict:
        if self.kinds == (kind,):  # its verdict is that kind's
            return self.verdict
        return worst(e.verdict for e in self.evidence if e.kind == kind)


class Cell(msgspec.Struct, omit_defaults=True):
    frontend: str  # "vllm-rs:0.31.0"
    engine: str  # "0.30.0"
    predicted: Judgement
    observed: Judgement | None = None
    observed_at: str | None = None

    @property
    def kinds(self) -> list[str]:
        """The kinds of request judged, observed or predicted."""
        judged = set(self.predicted.kinds) | set(self.observed.kinds if self.observed else ())
        return [k for k in KINDS if k in judged]

    def judgement_of(self, kind: str) -> Judgement | None:
        """What ``kind``'s verdict rests on: the observation where it judged the kind, else the prediction."""
        for judgement in (self.observed, self.predicted):
            if judgement is not None and kind in judgement.kinds:
                return judgement
        return None

    def verdict_for(self, kinds: list[str] | tuple[str, ...] | None = None) -> Verdict:
        """The worst verdict of ``kinds`` (default: every kind judged); a kind not judged is unknown."""
        judgements = {kind: self.judgement_of(kind) for kind in kinds or self.kinds}
        return worst(j.verdict_for(kind) if j else Verdict.UNKNOWN for kind, j in judgements.items())

    @property
    def verdict(self) -> Verdict:
        return self.verdict_for()

    @property
    def agrees(self) -> bool | None:
        """Whether observation and prediction agree on the kinds observed (None: not observed, the
        observation could not run, or nothing was predicted: a third-party frontend's cell)."""
        if self.observed is None or self.observed.verdict is Verdict.UNKNOWN or \
                self.predicted.verdict is Verdict.UNKNOWN:
            return None
        return all(self.observed.verdict_for(k) is self.predicted.verdict_for(k) for k in self.observed.kinds)


def kinds_in(spec: str) -> list[str]:
    """``lora,completion``: kinds of request (KINDS)."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise MatrixError(f"{spec!r}: kinds of request are {', '.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def releases_in(spec: str) -> list[str]:
    """``0.27.0..0.32.0`` (inclusive, over the shipped schemas), ``0.30.0``, or a comma list of either."""
    shipped = shipped_releases()
    found: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("..")
        high = high or low
        for end in (low, high):
            if end not in shipped:
                raise MatrixError(f"no shipped schema for release {end!r}; shipped: {', '.join(shipped)}")
        found += [r for r in shipped if release_key(low) <= release_key(r) <= release_key(high) and r not in found]
    if not found:
        raise MatrixError(f"{spec!r} names no release")
    return found


def frontends_in(spec: str) -> list[Frontend]:
    """``vllm-rs:0.22.0..0.33.0,vllm:0.27.0..0.32.0,smg:1.13.0``: each part is a kind and a release range (smg:
    its versions, each one recorded here: ``SMG_VERSIONS``)."""
    frontends: list[Frontend] = []
    kind = None
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if ":" in part:
            kind, part = part.split(":", 1)
        if kind not in ("vllm-rs", "vllm", "smg"):
            raise MatrixError(f"{part!r}: say which frontend, vllm-rs:RELEASES, vllm:RELEASES or smg:VERSION")
        frontends += [Frontend(kind, r) for r in (smg_versions(part) if kind == "smg" else releases_in(part))
                      if Frontend(kind, r) not in frontends]
    return frontends


# The smg versions with a recording of what they send (recordings/smg-X.db): a third-party frontend has no
# schema here, so it is judged by what it was seen to send.
SMG_VERSIONS = (SMG,)


def smg_versions(spec: str) -> list[str]:
    if spec not in SMG_VERSIONS:
        raise MatrixError(f"smg {spec!r} was never recorded here; recorded: {', '.join(SMG_VERSIONS)}")
    return [spec]


def parse_build(text: str) -> Frontend:
    """``vllm-rs==0.31.0``, ``vllm==0.30.0`` or ``smg==1.13.0`` (can-i-deploy's spelling), or ``vllm-rs:0.31.0``."""
    kind, sep, release = text.replace("==", ":").partition(":")
    if not sep or kind not in ("vllm-rs", "vllm", "smg"):
        raise MatrixError(f"{text!r}: use vllm-rs==RELEASE, vllm==RELEASE or smg==VERSION")
    return Frontend(kind, smg_versions(release)[0] if kind == "smg" else releases_in(release)[0])


def engine_release(text: str) -> str:
    """``vllm==0.30.0`` or ``0.30.0``: an engine is always the Python EngineCore of a release."""
    return releases_in(text.removeprefix("vllm==").removeprefix("vllm:"))[0]


def recording_of(build: Frontend, folder: Path = RECORDINGS, kind: str = "completion") -> tuple[Path, str] | None:
    """The committed recording of what ``build`` sends in ``kind``'s workload, and its session; None where
    there is none.

    ``vllm:X`` is also engine X's recording: its own Python frontend and engine. One made by ``matrix
    add-release`` (``added_recording``) is read first."""
    if build.kind == "smg":  # (its completion workload: its recording is of the clients' one, which holds it)
        name, session = f"smg-{build.release}{KINDS[kind]}.db", "smg-frontend"
    elif build.kind == "vllm-rs":
        name, session = f"vllm-{build.release}-vllm-rs{KINDS[kind]}.db", "vllm-rs-frontend"
    else:
        name, session = f"vllm-{build.release}-python{KINDS[kind]}.db", "python-frontend"
    path = next((p for p in (added_recording(name), folder / name) if p.exists()), None)
    return (path, session) if path is not None else None


def added_recording(name: str) -> Path:
    """A recording ``add-release`` makes, beside the release's schema, outside the package."""
    return added_releases() / "recordings" / name


def engine_recording(engine: str, folder: Path = RECORDINGS, kind: str = "completion") -> tuple[Path, str] | None:
    """What engine ``engine`` sends in ``kind``'s workload, as recorded with its own release's Python frontend."""
    return recording_of(Frontend("vllm", engine), folder, kind)
