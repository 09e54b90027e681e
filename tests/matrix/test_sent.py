"""``replay-proxy readers``: a session's requests held to every engine release's reader, on real recordings made
by this project's recorder: smg 1.13.0 (a third-party frontend) and vLLM 0.32.0's own frontends, each with a real
0.32.0 engine."""

import json

import pytest

from replay_proxy.matrix import RECORDINGS, Verdict, parse_build
from replay_proxy.matrix.predict import predict
from replay_proxy.matrix.sent import f32_decimal, read_sent
from replay_proxy.wire.registry import shipped_releases
from tests.helpers import ROOT, cli

SMG = ROOT / "recordings" / "smg-1.13.0.db"
PYTHON = ROOT / "recordings" / "vllm-0.32.0-python.db"


def test_smg_is_named_and_held_to_every_release():
    reading = read_sent(SMG, "smg-frontend")
    assert (reading.frontend, reading.engine, reading.requests) == ("smg==1.13.0", "0.32.0", 8)
    assert [r.engine for r in reading.readings] == list(shipped_releases())
    by_release = {r.engine: r for r in reading.readings}
    # 21 elements a request: 0.28.0-0.30.0's layout, one short of 0.31.0's (kv_hints), two of 0.34.0's
    assert reading.exact_layouts == ["0.28.0", "0.29.0", "0.30.0"]
    assert [(f.field, f.position, f.default, f.messages) for f in by_release["0.32.0"].filled] == [
        ("kv_hints", 21, None, 8)]
    assert [f.field for f in by_release["0.34.0"].filled] == ["block_hashes", "kv_hints"]
    assert by_release["0.27.0"].filled == [] and any(
        e.position == 20 and e.rule == "extra_trailing_elements" for e in by_release["0.27.0"].evidence)
    assert by_release["0.34.0"].verdict is Verdict.BREAKS  # (0.34.0 reads prompt_token_ids as a tensor)
    assert reading.verdict is Verdict.WORKS and reading.judged == ["0.32.0"]
    assert {(r.field, r.sent, r.meant) for r in reading.rounded} == {
        ("temperature", 0.800000011920929, "0.8"), ("top_p", 0.8999999761581421, "0.9")}
    assert reading.unread_by_any == []


def test_vllms_own_frontend_is_its_releases_layout_and_rounds_nothing():
    reading = read_sent(PYTHON, "python-frontend")
    assert reading.frontend is None and "0.32.0" in reading.exact_layouts
    assert next(r for r in reading.readings if r.engine == "0.32.0").filled == []
    assert reading.rounded == []


@pytest.mark.parametrize(("value", "meant"), [(0.8999999761581421, "0.9"), (0.949999988079071, "0.95"),
                                              (0.9, None), (1.0, None), (0.25, None), (0.1 + 0.2, None)])
def test_a_float32_is_named_by_the_decimal_the_user_wrote(value, meant):
    assert f32_decimal(value) == meant


def test_the_exit_code_judges_the_engines_asked_about():
    done = cli("readers", "--db", str(SMG), "--session", "smg-frontend", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["frontend"] == "smg==1.13.0"
    done = cli("readers", "--db", str(SMG), "--session", "smg-frontend", "--engines", "0.31.0..0.34.0")
    assert done.returncode == 3 and "0.34.0" in done.stdout and "rounded to float32" in done.stdout, done.stdout
    done = cli("readers", "--db", str(SMG), "--session", "smg-frontend", "--engines", "9.9")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_can_i_deploy_answers_for_smg_from_what_it_was_recorded_sending_until_the_cell_is_observed():
    predicted = predict(parse_build("smg==1.13.0"), "0.32.0", RECORDINGS)
    by_direction = {e.direction.value: e.verdict for e in predicted.evidence}
    assert by_direction == {"to_engine": Verdict.WORKS, "to_frontend": Verdict.UNKNOWN}  # (its reader: its own code)
    done = cli("can-i-deploy", "--frontend", "smg==1.13.0", "--engine", "vllm==0.32.0", "--json")
    answer = json.loads(done.stdout)
    assert (done.returncode, answer["verdict"], answer["upgrade"]) == (6, "unknown", []), done.stdout
    assert "observe the cell" in answer["kinds"][0]["evidence"][0]["message"]
    done = cli("can-i-deploy", "--frontend", "smg==1.13.0", "--engine", "vllm==0.34.0")
    assert done.returncode == 3 and "prompt_token_ids" in done.stdout, done.stdout
    done = cli("can-i-deploy", "--frontend", "smg==1.12.0", "--engine", "vllm==0.32.0")
    assert done.returncode == 2 and "never recorded here" in done.stderr and len(done.stderr.splitlines()) == 1
