"""matrix --shard I/N and merge: each cell observed by one shard, and the merged matrix the one a single run gives.

The observation is faked here (a verdict and a replay folder per cell, in place of two real replays), so that the
whole and the sharded runs see the same; tests/real/test_matrix_vllm.py shards real observations."""

import json

import pytest
import typer
from click.testing import CliRunner

from replay_proxy.cli import app
from replay_proxy.matrix import Evidence, Judgement, Verdict, frontends_in, releases_in
from replay_proxy.matrix.shard import planned, share
from replay_proxy.replay.shard import Shard

FRONTENDS, ENGINES = "vllm-rs:0.30.0..0.32.0,vllm:0.31.0", "0.28.0,0.31.0,0.32.0"


def fake_observe(cells, wanted, recordings, folder, keep, workers, ready_s, kinds, progress):
    for frontend, engine in wanted:
        cell = next(c for c in cells if (c.frontend, c.engine) == (str(frontend), engine))
        verdict = Verdict.BREAKS if (frontend.release, engine) in {("0.30.0", "0.32.0"), ("0.31.0", "0.28.0")} \
            else Verdict.WORKS
        replay = folder / "replays" / f"{frontend}-to-engine-{engine}".replace(":", "-")
        replay.mkdir(parents=True)
        (replay / "report.json").write_text(json.dumps({"cell": f"{frontend}@{engine}"}))
        evidence = Evidence(verdict, None, "faked", source=f"replays/{replay.name}/report.json")
        cell.observed = Judgement(verdict, [evidence], "faked", 1.0)
        cell.observed_at = "2026-12-07T00:00:00"


def invoke(*args):
    return CliRunner().invoke(typer.main.get_command(app), list(args), prog_name="replay-proxy")


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setattr("replay_proxy.matrix.run._observe", fake_observe)
    assert invoke("matrix", "--frontends", FRONTENDS, "--engines", ENGINES, "--report-dir",
                  str(tmp_path / "whole")).exit_code == 0
    for i in (1, 2, 3):
        done = invoke("matrix", "--frontends", FRONTENDS, "--engines", ENGINES, "--shard", f"{i}/3", "--report-dir",
                      str(tmp_path / f"shard-{i}"))
        assert done.exit_code == 0, done.output
    return tmp_path


def test_the_shards_merged_are_the_matrix_one_run_gives(runs):
    merged = invoke("merge", *(str(runs / f"shard-{i}") for i in (1, 2, 3)), "--report-dir", str(runs / "merged"),
                    "--db", str(runs / "matrix.db"))
    assert merged.exit_code == 0, merged.output
    whole = json.loads((runs / "whole" / "matrix.json").read_text())
    assert json.loads((runs / "merged" / "matrix.json").read_text()) == whole
    assert (runs / "merged" / "junit.xml").read_text() == (runs / "whole" / "junit.xml").read_text()
    assert sum(c["observed"] is not None for c in whole) == 12 and {c["verdict"] for c in whole} == {"works", "breaks"}
    # Every cell observed by one shard only, and every replay its evidence names there beside the merged reports.
    observed = [(c["frontend"], c["engine"]) for i in (1, 2, 3)
                for c in json.loads((runs / f"shard-{i}" / "matrix.json").read_text()) if c["observed"]]
    assert sorted(observed) == sorted((c["frontend"], c["engine"]) for c in whole)
    for cell in whole:
        [evidence] = cell["observed"]["evidence"]
        assert json.loads((runs / "merged" / evidence["source"]).read_text()) == {
            "cell": f"{cell['frontend']}@{cell['engine']}"}


@pytest.mark.parametrize("shards, said", [((1, 2), "shard(s) 3/3 missing"), ((1, 1, 2, 3), "shard 1/3 twice")])
def test_a_merge_of_other_than_every_shard_once_is_refused_in_one_line(runs, shards, said):
    done = invoke("merge", *(str(runs / f"shard-{i}") for i in shards), "--report-dir", str(runs / "merged"))
    assert done.exit_code == 1 and said in done.output and len(done.output.strip().splitlines()) == 1, done.output
    assert not (runs / "merged" / "matrix.json").exists()


def test_shards_of_different_runs_or_a_folder_of_no_shard_are_refused(runs, monkeypatch):
    other = invoke("matrix", "--frontends", FRONTENDS, "--engines", "0.31.0,0.32.0", "--shard", "3/3",
                   "--report-dir", str(runs / "other"))
    assert other.exit_code == 0, other.output
    done = invoke("merge", str(runs / "shard-1"), str(runs / "shard-2"), str(runs / "other"), "--report-dir",
                  str(runs / "merged"))
    assert done.exit_code == 1 and "shards of different matrix runs" in done.output, done.output
    done = invoke("merge", str(runs / "whole"), "--report-dir", str(runs / "merged"))
    assert done.exit_code == 1 and "holds no shard of a matrix run" in done.output, done.output


@pytest.mark.parametrize("args", [("--shard", "4/3", "--report-dir", "out"), ("--shard", "1/2"),
                                  ("--shard", "1/2", "--report-dir", "out", "--db", "m.db"), ("--shard", "one")])
def test_a_bad_shard_is_a_usage_error_in_one_line(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    done = invoke("matrix", "--predict-only", "--engines", "0.31.0", *args)
    assert done.exit_code == 2 and len(done.output.strip().splitlines()) == 1, done.output


@pytest.mark.parametrize("count", [1, 2, 3, 7, 9, 20])
def test_every_cell_is_in_one_share_the_shares_even_and_an_engine_whole_where_there_are_enough(count):
    frontends, engines = frontends_in("vllm-rs:0.22.0..0.34.0,vllm:0.27.0..0.34.0"), releases_in("0.27.0..0.34.0")
    plan = planned([(f, e) for f in frontends for e in engines])
    shares = [share(plan, Shard(i, count)) for i in range(1, count + 1)]
    assert sorted(c for s in shares for c in s) == sorted(plan)
    per_engine = len(plan) // len(engines)
    assert max(map(len, shares)) - min(map(len, shares)) <= (per_engine if count <= len(engines) else 1)
    if count <= len(engines):  # (each engine's replays in one shard: one engine start serves them)
        assert all(len({e for _, e in s}) * per_engine == len(s) for s in shares)


def test_a_cell_two_shards_observed_is_refused_and_nothing_is_written(runs):
    first, second = (json.loads((runs / f"shard-{i}" / "matrix.json").read_text()) for i in (1, 2))
    [taken] = [i for i, cell in enumerate(second) if cell["observed"]][:1]
    first[taken]["observed"] = second[taken]["observed"]
    (runs / "shard-1" / "matrix.json").write_text(json.dumps(first))
    done = invoke("merge", *(str(runs / f"shard-{i}") for i in (1, 2, 3)), "--report-dir", str(runs / "merged"))
    assert done.exit_code == 1 and "observed by two shards" in done.output, done.output
    assert not (runs / "merged").exists()
