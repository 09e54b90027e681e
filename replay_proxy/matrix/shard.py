"""One matrix run split across CI runners (``matrix --shard I/N``), and its shards merged (``merge``).

A shard predicts every cell, as the whole run does, and observes its share
of the cells the run observes. The replays to one engine release stay in
one shard where they can (one engine start serves them,
``observe.EngineBatch``): with at least N engine releases, each release's
cells go whole to the shard with the fewest cells so far, the largest
first; with fewer, the cells, ordered by engine release and then frontend,
are cut into N runs of equal length. Its report folder gains
``shard.json``: which shard of how many, every cell the whole run observes,
and how long it took. ``merge_shards`` takes each shard's folder once,
checks that they are the shards of one run (the same cells and plan, every
shard there once) and gives the cells that one run would have: each cell's
prediction, with its observation from the shard that made it. The replays
the evidence names (``replays/`` of each folder) are copied beside the
merged reports, so that every reference still opens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec

from replay_proxy.matrix import Cell, Frontend, MatrixError
from replay_proxy.replay.shard import SHARD_JSON, Shard, cut
from replay_proxy.wire.schema import release_key



class ShardPlan(msgspec.Struct, frozen=True):
    """shard.json: a shard, and what the whole run it is part of observes."""

    shard: Shard
    observe: list[str]  # every cell the whole run observes, FRONTEND@ENGINE, in the order shards cut
    seconds: float  # this shard's wall time


def planned(cells: list[tuple[Frontend, str]]) -> list[tuple[Frontend, str]]:
    """The cells a run observes, in the order its shards cut them: by engine release, then frontend."""
    return sorted(cells, key=lambda cell: (release_key(cell[1]), cell[0].kind, release_key(cell[0].release)))


def share(plan: list[tuple[Frontend, str]], shard: Shard) -> list[tuple[Frontend, str]]:
    """Shard ``shard``'s cells of ``plan`` (``planned``; the module's docstring)."""
    engines: dict[str, list[tuple[Frontend, str]]] = {}
    for cell in plan:
        engines.setdefault(cell[1], []).append(cell)
    if len(engines) < shard.count:
        return cut(plan, shard)
    shares: list[list[tuple[Frontend, str]]] = [[] for _ in range(shard.count)]
    for cells in sorted(engines.values(), key=len, reverse=True):  # (stable: engine order among equals)
        min(shares, key=len).extend(cells)  # (the first of the least loaded)
    return shares[shard.index - 1]


def name(cell: tuple[Frontend, str]) -> str:
    return f"{cell[0]}@{cell[1]}"


def merge_shards(folders: list[Path], into: Path) -> tuple[list[Cell], float]:
    """The cells of the run whose shards wrote ``folders`` (their report folders), and its wall time (its
    slowest shard's); the replays their evidence names copied under ``into``. MatrixError if they are not
    every shard of one run, each once."""
    shards: dict[int, tuple[ShardPlan, list[Cell], Path]] = {}
    for folder in folders:
        try:
            plan = msgspec.json.decode((folder / SHARD_JSON).read_bytes(), type=ShardPlan)
            cells = msgspec.json.decode((folder / "matrix.json").read_bytes(), type=list[Cell])
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise MatrixError(f"{folder} holds no shard of a matrix run (matrix --shard I/N --report-dir): "
                              f"{exc}") from None
        if plan.shard.index in shards:
            raise MatrixError(f"shard {plan.shard} twice: {shards[plan.shard.index][2]} and {folder}")
        shards[plan.shard.index] = plan, cells, folder
    first, first_cells, first_folder = shards[min(shards)]
    for plan, cells, folder in shards.values():
        if (plan.shard.count, plan.observe) != (first.shard.count, first.observe) or \
                [(c.frontend, c.engine) for c in cells] != [(c.frontend, c.engine) for c in first_cells]:
            raise MatrixError(f"{folder} and {first_folder} are shards of different matrix runs")
    missing = sorted(set(range(1, first.shard.count + 1)) - set(shards))
    if missing:
        raise MatrixError(f"shard(s) {', '.join(f'{i}/{first.shard.count}' for i in missing)} missing: "
                          f"their cells are not observed")
    merged = [msgspec.structs.replace(cell, observed=None, observed_at=None) for cell in first_cells]
    for _, cells, folder in shards.values():
        for cell, shard_cell in zip(merged, cells):
            if shard_cell.observed is not None:
                if cell.observed is not None:
                    raise MatrixError(f"{cell.frontend}@{cell.engine} observed by two shards")
                cell.observed, cell.observed_at = shard_cell.observed, shard_cell.observed_at
    for _, _, folder in shards.values():  # (once every check has passed: a refused merge writes nothing)
        _copy_replays(folder, into)
    return merged, max(plan.seconds for plan, _, _ in shards.values())


def _copy_replays(folder: Path, into: Path) -> None:
    """``folder``/replays/ under ``into``/replays/ (a replay two shards both ran, cut between them, once)."""
    if not (folder / "replays").is_dir() or folder.resolve() == into.resolve():
        return
    for replay in (folder / "replays").iterdir():
        target = into / "replays" / replay.name
        if not target.exists():
            shutil.copytree(replay, target)
