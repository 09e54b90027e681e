"""Every shipped release against the next: the findings are held to a reviewed snapshot; and field
histories across all of them."""

import json
from pathlib import Path

from replay_proxy.compare.schema_diff import diff_schemas
from replay_proxy.compare.schema_history import struct_history
from replay_proxy.wire.registry import load_schema, shipped_releases
from tests.helpers import cli

SNAPSHOT = Path(__file__).with_name("snapshots") / "consecutive_schema_diffs.json"


def consecutive_diffs() -> dict[str, list[list]]:
    releases = shipped_releases()
    return {f"{a} -> {b}": sorted([f.severity.name.lower(), f.code, f.struct, f.field, f.position, list(f.breaks)]
                                  for f in diff_schemas(load_schema(a), load_schema(b)))
            for a, b in zip(releases, releases[1:])}


def test_each_consecutive_pair_matches_the_reviewed_snapshot():
    assert consecutive_diffs() == json.loads(SNAPSHOT.read_text())


def test_history_of_engine_core_output():
    schemas = [load_schema(r) for r in shipped_releases()]
    history = {h.field: h for h in struct_history(schemas, "EngineCoreOutput")}
    assert (history["request_id"].first, history["request_id"].last, history["request_id"].changes) == (
        "0.22.0", "0.34.0", ())
    assert (history["prompt_token_id_logprobs"].first, history["prompt_token_id_logprobs"].position) == ("0.31.0", 17)
    assert (history["error"].first, history["error"].position) == ("0.33.0", 18)
    assert [h.field for h in history.values()][:2] == ["request_id", "new_token_ids"]


def test_history_of_engine_core_request_and_the_registration():
    schemas = [load_schema(r) for r in shipped_releases()]
    request = {h.field: h for h in struct_history(schemas, "EngineCoreRequest")}
    assert request["kv_hints"].first == "0.31.0" and request["kv_hints"].last == "0.34.0"
    assert request["block_hashes"].first == "0.34.0" and request["block_hashes"].position == 22
    assert [(c.release, c.before, c.after) for c in request["prompt_token_ids"].changes if c.what == "type"] == [
        ("0.34.0", "list[int] | None", "ndarray | None")]  # the prompt as a numpy array
    assert all(h.first == "0.22.0" for h in list(request.values())[:9])  # the required head never moved
    registration = {h.field: h for h in struct_history(schemas, "EngineCoreReadyResponse")}
    assert registration["effective_attention_block_size"].first == "0.31.0"
    assert registration["block_size"].position is None  # a map: keys have no position


def test_schema_history_cli_table_json_and_bad_names():
    table = cli("schema", "history", "EngineCoreOutput", "prompt_token_id_logprobs")
    assert table.returncode == 0 and "0.31.0" in table.stdout and "0.34.0" in table.stdout
    [row] = json.loads(cli("schema", "history", "EngineCoreOutput", "error", "--json").stdout)
    assert (row["first"], row["last"], row["position"]) == ("0.33.0", "0.34.0", 18)
    missing = cli("schema", "history", "EngineCoreOutput", "nope")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "EngineCoreOutput.nope" in missing.stderr


if __name__ == "__main__":  # python -m tests.compare.test_schema_history: rewrite the snapshot, then review its diff
    SNAPSHOT.write_text(json.dumps(consecutive_diffs(), indent=1) + "\n")
