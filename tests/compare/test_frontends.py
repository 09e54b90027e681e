"""Two frontends compared request by request, from two recordings of one workload made by this project's recorder:
vLLM 0.32.0's Python frontend (recordings/vllm-0.32.0-python.db) and smg 1.13.0 (recordings/smg-1.13.0.db,
run's requests and an n=2 completion), each with a real 0.32.0 engine. Every request of the workload is matched,
and what smg sends otherwise is named with its class: compatible, or what the engine does otherwise."""

import json

from replay_proxy.compare.rules import load_rules
from replay_proxy.store.session import load_session, match_requests, request_key, stop_ids_beyond_eos
from tests.helpers import ROOT, cli

PYTHON, SMG = ROOT / "recordings" / "vllm-0.32.0-python.db", ROOT / "recordings" / "smg-1.13.0.db"


def test_every_request_of_the_workload_is_matched_across_the_two_frontends():
    python, smg = load_session(PYTHON, "python-frontend"), load_session(SMG, "smg-frontend")
    matching = match_requests(python, smg, load_rules().match_sampling_keys)
    assert (len(matching.pairs), matching.missing) == (6, [])
    assert len(matching.extra) == 2  # (n=2, which the Python frontend's recording of run does not have)


def test_the_eos_token_among_the_stop_ids_stops_nothing_eos_does_not_unless_eos_is_ignored():
    schema = load_session(SMG, "smg-frontend").schema
    smg = {"stop_token_ids": [1, 7], "_eos_token_id": 1}
    assert stop_ids_beyond_eos(schema, smg) == [7]
    assert stop_ids_beyond_eos(schema, {**smg, "ignore_eos": True}) == [1, 7]
    keys = ["stop_token_ids", "ignore_eos"]
    assert request_key(schema, [5], {"stop_token_ids": [1], "_eos_token_id": 1}, keys) == request_key(
        schema, [5], {"stop_token_ids": [], "_eos_token_id": 1}, keys)
    assert request_key(schema, [5], {"stop_token_ids": [1], "_eos_token_id": 1, "ignore_eos": True}, keys) != \
        request_key(schema, [5], {"_eos_token_id": 1, "ignore_eos": True}, keys)


def test_diff_names_each_difference_of_smg_with_its_class(tmp_path):
    done = cli("diff", "--db", str(SMG), "--baseline-db", str(PYTHON), "--baseline", "python-frontend",
               "--candidate", "smg-frontend", "--json")
    report = json.loads(done.stdout)
    by_field = {(f["code"], f.get("field")): f["severity"] for f in report["findings"]}
    # Compatible: the EOS token among the stop ids, a false flag left out, a float32 for a double, a shorter array.
    assert by_field[("sampling_key_eos_named", "stop_token_ids")] == "info"
    assert by_field[("sampling_key_default_omitted", "watermarking")] == "info"
    assert by_field[("sampling_key_f32", "temperature")] == "info"
    assert by_field[("array_shorter", None)] == "info"
    assert not any(code in ("sampling_key_changed", "sampling_key_dropped") for code, _ in by_field)
    # What the engine does otherwise: smg aborts a request its client left later than the Python frontend did.
    assert ("abort_progress", None) in by_field
    # The same greedy and seeded tokens, request by request.
    assert {v["tier"]: v["passed"] for v in report["verdicts"] if v["tier"] == "exact"} == {"exact": True}
    assert sum(v["tier"] == "exact" for v in report["verdicts"]) == 5
