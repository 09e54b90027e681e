"""The matrix's predictions, read from the committed real recordings with each reader's release schema.

Each expectation below was also observed by real peers (docs/compatibility.md):
the prediction must name the struct, field and position that the real reader
rejected.
"""

import sqlite3
from pathlib import Path

import msgspec
import pytest

from replay_proxy.matrix import (Cell, Frontend, MatrixError, RECORDINGS, Verdict, engine_recording, engine_release,
                                 frontends_in, parse_build, recording_of, releases_in)
from replay_proxy.matrix.predict import predict, read_direction
from replay_proxy.store.queries import sent_frames
from replay_proxy.wire.messages import Direction
from replay_proxy.wire.rust import RustField, rust_layouts
from replay_proxy.wire.registry import load_rust_schema, load_schema

ALL_FRONTENDS = "vllm-rs:0.22.0..0.33.0,vllm:0.27.0..0.32.0"


def reasons(judgement, verdict):
    return {(e.direction, e.reader, e.struct, e.field, e.position, e.rule) for e in judgement.evidence
            if e.verdict is verdict}


def test_ranges_cover_the_shipped_releases_between_their_ends():
    assert releases_in("0.27.0..0.29.0") == ["0.27.0", "0.27.1", "0.28.0", "0.29.0"]
    assert releases_in("0.30.0,0.32.0") == ["0.30.0", "0.32.0"]
    frontends = frontends_in(ALL_FRONTENDS)
    assert len(frontends) == 15 + 7 and frontends[0] == Frontend("vllm-rs", "0.22.0")
    assert parse_build("vllm-rs==0.31.0") == Frontend("vllm-rs", "0.31.0")
    assert engine_release("vllm==0.30.0") == "0.30.0"
    for bad in ("0.99.0", "0.27.0..0.99.0"):
        with pytest.raises(MatrixError, match="no shipped schema"):
            releases_in(bad)
    with pytest.raises(MatrixError, match="say which frontend"):
        frontends_in("0.27.0")
    with pytest.raises(MatrixError, match="vllm-rs==RELEASE"):
        parse_build("sglang==1.0")


def test_every_cell_of_the_full_matrix_has_recordings_for_both_directions():
    engines = releases_in("0.27.0..0.32.0")
    missing = [str(f) for f in frontends_in(ALL_FRONTENDS) if recording_of(f) is None]
    missing += [e for e in engines if recording_of(Frontend("vllm", e)) is None]
    assert missing == []
    unknown = [(str(f), e) for f in frontends_in(ALL_FRONTENDS) for e in engines
               if predict(f, e, RECORDINGS).verdict is Verdict.UNKNOWN]
    assert unknown == []


def test_a_newer_python_frontend_rejects_an_older_engines_registration():
    judgement = predict(Frontend("vllm", "0.29.0"), "0.28.0", RECORDINGS)
    assert judgement.verdict is Verdict.BREAKS
    assert reasons(judgement, Verdict.BREAKS) == {
        (Direction.TO_FRONTEND, "python-frontend", "EngineCoreReadyResponse", key, None, "missing_required_key")
        for key in ("max_loras", "supports_lora")}


def test_an_older_python_frontend_reads_a_newer_engine_its_extra_elements_ignored():
    judgement = predict(Frontend("vllm", "0.27.0"), "0.32.0", RECORDINGS)
    assert judgement.verdict is Verdict.WORKS
    ignored = {(e.struct, e.position) for e in judgement.evidence if e.rule == "extra_trailing_elements"}
    assert ("EngineCoreOutputs", 8) in ignored and ("EngineCoreOutput", 14) in ignored


@pytest.mark.parametrize("release, position", [("0.30.0", 8), ("0.31.0", 8)])
def test_vllm_rs_before_0_32_rejects_weight_version_in_engine_core_outputs(release, position):
    judgement = predict(Frontend("vllm-rs", release), "0.32.0", RECORDINGS)
    assert judgement.verdict is Verdict.BREAKS
    assert (Direction.TO_FRONTEND, "rust-frontend", "EngineCoreOutputs", None, position, "extra_trailing_elements") in \
        reasons(judgement, Verdict.BREAKS)


def test_vllm_rs_0_30_rejects_the_extra_outputs_element_that_0_31_ignores():
    old, new = (predict(Frontend("vllm-rs", r), "0.31.0", RECORDINGS) for r in ("0.30.0", "0.31.0"))
    assert (Direction.TO_FRONTEND, "rust-frontend", "EngineCoreOutput", None, 17, "extra_trailing_elements") in \
        reasons(old, Verdict.BREAKS)
    assert new.verdict is Verdict.WORKS


def test_vllm_rs_before_0_26_misreads_the_inserted_ec_transfer_params():
    judgement = predict(Frontend("vllm-rs", "0.25.1"), "0.27.0", RECORDINGS)
    assert (Direction.TO_FRONTEND, "rust-frontend", "EngineCoreOutput", "ec_transfer_params", 9, "field_inserted") in \
        reasons(judgement, Verdict.BREAKS)


def test_an_ignored_sampling_key_that_asks_for_nothing_unusual_works():
    # vllm-rs 0.32.0 sends watermarking=true, the default of 0.30.0 and 0.31.0: a 0.29.0 engine ignores it and
    # gives the same tokens as an engine that honours it (observed: docs/compatibility.md).
    judgement = predict(Frontend("vllm-rs", "0.32.0"), "0.29.0", RECORDINGS)
    assert judgement.verdict is Verdict.WORKS
    assert (Direction.TO_ENGINE, "python-engine", "SamplingParams", "watermarking", None, "unknown_map_key") in \
        reasons(judgement, Verdict.WORKS)


def test_an_ignored_sampling_key_that_asks_for_something_is_degraded():
    """A real 0.32.0 request asking for prompt logprobs from position 3 on, read by a 0.30.0 engine."""
    sent = []
    for channel, parts in sent_frames(*recording_of(Frontend("vllm", "0.32.0")), Direction.TO_ENGINE):
        request = msgspec.msgpack.decode(parts[1]) if len(parts) > 1 and parts[0] == b"\x00" else None
        if request is not None:
            request[3]["prompt_logprob_start"] = 3
            parts = [parts[0], msgspec.msgpack.encode(request), *parts[2:]]
        sent.append((channel, parts))
    evidence = read_direction(Direction.TO_ENGINE, sent, load_schema("0.32.0"), load_schema("0.30.0"), "python-engine")
    [degraded] = [e for e in evidence if e.verdict is Verdict.DEGRADED]
    assert (degraded.struct, degraded.field) == ("SamplingParams", "prompt_logprob_start")
    assert "= 3 is sent, and a 0.30.0 engine does not know it" in degraded.message


def test_a_cells_verdict_is_its_observation_and_agreement_is_judged_only_when_it_ran():
    predicted = predict(Frontend("vllm", "0.32.0"), "0.32.0", RECORDINGS)
    cell = Cell("vllm:0.32.0", "0.32.0", predicted)
    assert (cell.verdict, cell.agrees) == (Verdict.WORKS, None)
    cell.observed = type(predicted)(Verdict.BREAKS)
    assert (cell.verdict, cell.agrees) == (Verdict.BREAKS, False)
    cell.observed = type(predicted)(Verdict.UNKNOWN)
    assert cell.agrees is None


def test_vllm_rs_0_34_is_predicted_from_what_it_sent_and_every_older_engine_rejects_its_prompt():
    """Its recording (tests/real: made with the sim engine of 0.34.0, since no engine that reads it runs here)."""
    frontend = Frontend("vllm-rs", "0.34.0")
    for engine in releases_in("0.27.0..0.32.0"):
        judgement = predict(frontend, engine, RECORDINGS)
        assert judgement.verdict is Verdict.BREAKS, engine
        assert (Direction.TO_ENGINE, "python-engine", "EngineCoreRequest", "prompt_token_ids", 1, "changed_type") in \
            reasons(judgement, Verdict.BREAKS), engine
    assert predict(Frontend("vllm-rs", "0.33.0"), "0.32.0", RECORDINGS).verdict is Verdict.WORKS


def test_with_no_recording_a_cell_is_predicted_from_the_two_schemas_and_never_works():
    python_0_34 = predict(Frontend("vllm", "0.34.0"), "0.32.0", RECORDINGS)
    assert python_0_34.verdict is Verdict.BREAKS
    assert (Direction.TO_ENGINE, "python-engine", "EngineCoreRequest", "prompt_token_ids", 1, "type_changed") in \
        reasons(python_0_34, Verdict.BREAKS)
    assert all("from the schemas: no recording of what vllm:0.34.0 sends" in e.message
               for e in python_0_34.evidence if e.verdict is Verdict.BREAKS)
    same_release = predict(Frontend("vllm-rs", "0.34.0"), "0.34.0", RECORDINGS)  # its engine's outputs: no recording
    [unknown] = [e for e in same_release.evidence if e.verdict is Verdict.UNKNOWN]
    assert same_release.verdict is Verdict.UNKNOWN and unknown.direction is Direction.TO_FRONTEND
    assert "no recording of what engine 0.34.0 sends" in unknown.message and "show no break" in unknown.message


def test_every_observed_cell_agrees_with_its_prediction_from_each_readers_own_layouts():
    """docs/compatibility.db's cells that real peers ran, each predicted anew: vllm-rs from its own Rust structs
    (a positional field each language names otherwise, 0.27.0's token_ranks, is the same element)."""
    database = sqlite3.connect(Path(__file__).resolve().parents[2] / "docs" / "compatibility.db")
    observed = database.execute("SELECT frontend, engine, observed FROM matrix_cells WHERE agrees IS NOT NULL")
    disagree = [(build, engine, seen, predict(parse_build(build), engine, RECORDINGS).verdict.value)
                for build, engine, seen in observed.fetchall()]
    assert len(disagree) == 161
    assert [d for d in disagree if d[2] != d[3]] == []


def test_vllm_rs_reads_with_its_own_struct_where_it_has_a_field_python_does_not():
    """0.30.0's Rust EngineCoreOutput given 0.31.0's 18th element (as if its source had it, with a default):
    engine 0.31.0's 18-element outputs are read, where 0.30.0 as shipped (17 elements) rejects them."""
    rust = load_rust_schema("0.30.0")
    output = rust.structs["EngineCoreOutput"]
    longer = msgspec.structs.replace(output, fields=[*output.fields, RustField(
        "prompt_token_id_logprobs", "prompt_token_id_logprobs", "Option<WireLogprobs>", len(output.fields),
        default=True)])
    ahead = msgspec.structs.replace(rust, structs={**rust.structs, "EngineCoreOutput": longer})
    sent = sent_frames(*engine_recording("0.31.0"), Direction.TO_FRONTEND)
    shipped, own = (read_direction(Direction.TO_FRONTEND, sent, load_schema("0.31.0"),
                                   rust_layouts(load_schema("0.30.0"), r), "rust-frontend") for r in (rust, ahead))
    assert ("EngineCoreOutput", 17) in {(e.struct, e.position) for e in shipped if e.verdict is Verdict.BREAKS}
    assert [e for e in own if e.verdict is Verdict.BREAKS] == []


def test_an_engine_without_a_recording_breaks_no_vllm_rs_by_a_field_vllm_rs_does_not_require():
    """Engine 0.33.0 made dp_stats_address required; vllm-rs 0.32.0 declares it an Option, and the engine always
    sends it (a registration is written whole): nothing breaks that the schemas can show."""
    judgement = predict(Frontend("vllm-rs", "0.32.0"), "0.33.0", RECORDINGS)
    assert judgement.verdict is Verdict.UNKNOWN
    assert not any(e.field == "dp_stats_address" for e in judgement.evidence)


def test_one_releases_engine_and_vllm_rs_without_a_recording_are_judged_by_its_drift():
    """Within 0.33.0 the Python classes and Rust structs differ nowhere an engine-written message breaks."""
    judgement = predict(Frontend("vllm-rs", "0.33.0"), "0.33.0", RECORDINGS)
    [unknown] = [e for e in judgement.evidence if e.direction is Direction.TO_FRONTEND]
    assert unknown.verdict is Verdict.UNKNOWN and "0.33.0's Python classes and Rust structs show no break" in \
        unknown.message
