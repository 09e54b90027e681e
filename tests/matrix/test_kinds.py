"""Each kind of request judged apart, from the recordings of its own workload (recordings/*-lora.db, made by
scripts/make_recordings.py --kind lora through the recorder between real vLLM peers).

vLLM 0.32.0 removed ``LoRARequest.tensorizer_config_dict`` (position 4): a 0.32.0 frontend with a 0.31.0
engine serves completions and breaks every LoRA request (observed live and in a replay by
tests/real/test_lora_vllm.py)."""

import json
import subprocess

import sqlite_utils

from replay_proxy.matrix import Cell, Evidence, Frontend, Judgement, RECORDINGS, Verdict, database
from replay_proxy.matrix.deploy import can_i_deploy
from replay_proxy.matrix.predict import predict
from replay_proxy.report.matrix import label, main_reason, markdown
from replay_proxy.wire.messages import Direction
from tests.helpers import CLI

NEW_FRONTEND, OLD_ENGINE = Frontend("vllm", "0.32.0"), "0.31.0"


def test_a_cell_serves_completions_and_breaks_lora_requests_by_the_lora_recordings():
    judgement = predict(NEW_FRONTEND, OLD_ENGINE, RECORDINGS)
    cell = Cell(str(NEW_FRONTEND), OLD_ENGINE, judgement)
    assert judgement.kinds == ("completion", "lora", "pooling")
    assert (cell.verdict_for(["completion"]), cell.verdict_for(["lora"]), cell.verdict_for(["pooling"]),
            cell.verdict) == (Verdict.WORKS, Verdict.BREAKS, Verdict.WORKS, Verdict.BREAKS)
    # Where a 0.31.0 engine was seen to refuse it: "Expected `object | null`, got `bool` - at `$[4]`".
    breaking = {(e.kind, e.direction, e.struct, e.field, e.position, e.rule) for e in judgement.evidence
                if e.verdict is Verdict.BREAKS}
    assert breaking == {("lora", Direction.TO_ENGINE, "LoRARequest", "tensorizer_config_dict", 4, rule)
                        for rule in ("changed_type", "field_removed")}
    assert main_reason(cell).startswith("lora: to_engine: LoRARequest.tensorizer_config_dict: a value of another type")
    same = Cell("vllm:0.32.0", "0.32.0", predict(Frontend("vllm", "0.32.0"), "0.32.0", RECORDINGS))
    assert (same.kinds, same.verdict) == (["completion", "lora", "pooling"], Verdict.WORKS)


def test_a_kind_recorded_on_one_side_only_is_not_judged_and_never_read_as_works():
    rust = predict(Frontend("vllm-rs", "0.32.0"), "0.31.0", RECORDINGS)  # no LoRA recording of vllm-rs
    assert rust.kinds == ("completion",)
    cell = Cell("vllm-rs:0.32.0", "0.31.0", rust)
    assert (cell.verdict_for(["lora"]), cell.verdict) == (Verdict.UNKNOWN, Verdict.WORKS)


def test_an_observation_of_completions_leaves_lora_to_the_prediction_and_agrees_on_what_it_saw(tmp_path):
    cell = Cell(str(NEW_FRONTEND), OLD_ENGINE, predict(NEW_FRONTEND, OLD_ENGINE, RECORDINGS))
    cell.observed = Judgement(Verdict.WORKS, [Evidence(Verdict.WORKS, None, "replayed clean")], "two replays", 40.0)
    cell.observed_at = "2026-12-03T16:00:00+00:00"
    assert (cell.judgement_of("completion"), cell.judgement_of("lora")) == (cell.observed, cell.predicted)
    assert cell.verdict is Verdict.BREAKS and cell.agrees is True  # the prediction's break is in lora only
    assert label(cell) == "breaks*" and label(cell, "completion") == "works"
    db = tmp_path / "matrix.db"
    database.save(db, [cell], "test", 40.0)
    row = sqlite_utils.Database(db)["matrix_cells"].get((str(NEW_FRONTEND), OLD_ENGINE))
    assert (row["verdict"], row["observed"], row["agrees"], json.loads(row["by_kind"])) == (
        "breaks", "works", 1, {"completion": "works", "lora": "breaks", "pooling": "works"})
    answer = can_i_deploy(NEW_FRONTEND, OLD_ENGINE, db)
    assert answer.uses == ["completion", "lora", "pooling"] and answer.verdict is Verdict.BREAKS
    (_, works, seen_at, _), (_, breaks, predicted, reasons), _ = answer.by_kind()
    assert (works, breaks, predicted) == (Verdict.WORKS, Verdict.BREAKS, "predicted: not observed yet")
    assert seen_at.startswith("observed 2026-12-03") and reasons[0][0].struct == "LoRARequest"
    table = markdown(database.load(db))
    assert "lora requests, where recorded on both sides:" in table and "| vllm:0.32.0 | breaks* |" in table


def test_can_i_deploy_answers_for_the_kinds_a_deployment_uses():
    def ask(*uses):
        return subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.32.0", "--engine", "vllm==0.31.0", *uses],
                              capture_output=True, text=True, timeout=60)

    completions, lora, both = ask("--uses", "completion"), ask("--uses", "lora"), ask()
    assert completions.returncode == 0, completions.stdout + completions.stderr
    assert "vllm:0.32.0 with engine 0.31.0: works (predicted: not observed yet)" in completions.stdout
    assert lora.returncode == 3, lora.stdout
    assert "[breaks] lora to_engine: LoRARequest.tensorizer_config_dict: a value of another type" in lora.stdout
    assert both.returncode == 3
    assert ("vllm:0.32.0 with engine 0.31.0: breaks (works for completion; breaks for lora; works for pooling)"
            in both.stdout)
    assert "  for lora: breaks (predicted: not observed yet)" in both.stdout
    # A kind not recorded for the cell is judged from the schemas where its own structs break (vllm-rs 0.32.0's
    # LoRARequest), else unknown (exit 6), saying why (no script a user lacks).
    rust = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm-rs==0.32.0", "--engine", "0.31.0", "--uses",
                           "lora"], capture_output=True, text=True, timeout=60)
    assert rust.returncode == 3 and "(from the schemas: no recording of lora requests between vllm-rs:0.32.0 and " \
        "engine 0.31.0)" in rust.stdout, rust.stdout
    pooling = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm-rs==0.32.0", "--engine", "0.31.0", "--uses",
                              "pooling"], capture_output=True, text=True, timeout=60)
    assert pooling.returncode == 6 and "not judged: no recording of pooling requests on both sides" in \
        pooling.stdout, pooling.stdout
    bad = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.32.0", "--engine", "0.31.0", "--uses",
                          "images"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "kinds of request are completion, lora, pooling" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
