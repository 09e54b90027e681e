"""Shipped schemas: what they say about real releases, and how one is chosen."""

import msgspec

from replay_proxy.wire.registry import load_schema, schema_for, shipped_releases


def test_every_release_from_0_22_to_0_34_ships_oldest_first():
    assert shipped_releases() == ("0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
                                  "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
                                  "0.34.0")


def test_schema_for_picks_exact_then_nearest_older():
    assert [(s.release, exact) for s, exact in (schema_for("0.32.0"), schema_for("0.31.0+cpu"))] == [
        ("0.32.0", True), ("0.31.0", True)]
    assert (schema_for("0.32.1")[0].release, schema_for("0.32.1")[1]) == ("0.32.0", False)
    assert (schema_for("0.35.0")[0].release, schema_for("0.35.0")[1]) == ("0.34.0", False)
    assert schema_for("0.8.5")[0].release == "0.22.0"
    assert schema_for(None)[0].release == "0.34.0"


def test_schemas_carry_the_release_drift_extracted_from_vllm():
    # Read from the releases' own classes by extract.py, not typed by hand.
    names = {r: [f.name for f in load_schema(r).structs["EngineCoreRequest"].fields] for r in shipped_releases()}
    assert names["0.30.0"][-1] == "session_id" and names["0.31.0"][-1] == "kv_hints"
    lora = {r: [f.name for f in load_schema(r).structs["LoRARequest"].fields] for r in ("0.31.0", "0.32.0")}
    assert "tensorizer_config_dict" in lora["0.31.0"] and "tensorizer_config_dict" not in lora["0.32.0"]
    outputs = load_schema("0.32.0").structs["EngineCoreOutputs"]
    assert outputs.encoding == "array" and outputs.fields[8].name == "weight_version"
    sampling = load_schema("0.32.0").structs["SamplingParams"]
    assert sampling.encoding == "map" and sampling.omit_defaults
    assert load_schema("0.32.0").enums["FinishReason"] == {"STOP": 0, "LENGTH": 1, "ABORT": 2, "ERROR": 3,
                                                          "REPETITION": 4}


def test_a_release_added_by_the_user_is_known_and_read_before_the_package(tmp_path, monkeypatch):
    from replay_proxy.matrix import Frontend, recording_of
    from replay_proxy.wire.registry import SCHEMAS, added_releases, forget_schemas

    monkeypatch.setenv("REPLAY_PROXY_ADDED_RELEASES", str(tmp_path))
    (tmp_path / "schemas").mkdir()
    newer = msgspec.json.decode((SCHEMAS / "0.34.0.json").read_bytes())
    (tmp_path / "schemas" / "0.35.0.json").write_bytes(msgspec.json.encode({**newer, "release": "0.35.0"}))
    (tmp_path / "recordings").mkdir()
    (tmp_path / "recordings" / "vllm-0.35.0-vllm-rs.db").write_bytes(b"")
    forget_schemas()
    try:
        assert added_releases() == tmp_path and shipped_releases()[-2:] == ("0.34.0", "0.35.0")
        assert load_schema("0.35.0").release == "0.35.0" and schema_for("0.36.1")[0].release == "0.35.0"
        assert recording_of(Frontend("vllm-rs", "0.35.0")) == (tmp_path / "recordings" / "vllm-0.35.0-vllm-rs.db",
                                                                "vllm-rs-frontend")
    finally:
        monkeypatch.delenv("REPLAY_PROXY_ADDED_RELEASES")
        forget_schemas()
    assert shipped_releases()[-1] == "0.34.0"
