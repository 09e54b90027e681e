"""Redaction on real vLLM: a real session redacted as it is recorded and after the fact, then replayed.

One run of the real Python frontend and a 0.32.0 engine (prefix caching on, as vLLM has it by default)
through two recorders in a chain: the one next to the frontend records as it is, the one next to the
engine redacts as it records. The workload: a three-turn chat whose turns share their prefix,
completions with a stop string, a stop token, logprobs and n=2, a structured-output request, a request of prompt
embeddings (both sides run with --enable-prompt-embeds), a client abort.
"""

import json
import sqlite3
import subprocess
import sys

import pytest
import sqlite_utils

from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store.copy import redact_database
from tests.real import peers, workload
from tests.real.vllm_reads import read_as_vllm_does
from tests.redact.leaks import file_bytes, leaks, shape, tokens_of

pytestmark = pytest.mark.real_vllm

VOCAB = json.loads((peers.MODEL / "config.json").read_text())["vocab_size"] if peers.MODEL.exists() else 0
GREEDY = {"temperature": 0.0}
STOP = "acme secret stop"
SCHEMA_PROPERTY = "acme_secret_property"
WORDS = workload.WORDS_OF_A_CHAT
EMBEDS = workload.PROMPT_EMBEDS  # the frontend's and every engine's


def rich(http: int, embeds: str) -> dict:
    """The requests; what each answered."""
    model = str(peers.MODEL)
    seen = {f"turn {i + 1}": answer for i, answer in enumerate(workload.chat_turns(http))}
    seen["stop"] = peers.post(http, "/v1/completions", {"model": model, "prompt": WORDS, "max_tokens": 8,
                                                        "stop": [STOP], **GREEDY})["choices"][0]["text"]
    # A stop token: the second token this prompt makes greedily, which the engine then stops at and names.
    owls = {"model": model, "prompt": "wise owls watch", "max_tokens": 4, **GREEDY}
    second = peers.post(http, "/v1/completions", {**owls, "return_token_ids": True})["choices"][0]["token_ids"][1]
    seen["stop token"] = peers.post(http, "/v1/completions", {**owls, "stop_token_ids": [second]})
    seen["logprobs"] = peers.post(http, "/v1/completions", {"model": model, "prompt": "seven wise owls",
                                                            "max_tokens": 4, "logprobs": 2, **GREEDY})["choices"]
    seen["n=2"] = peers.post(http, "/v1/completions", {"model": model, "prompt": "the old oak", "max_tokens": 4,
                                                       "n": 2, "temperature": 0.8, "seed": 7})["choices"]
    seen["embeds"] = peers.post(http, "/v1/completions", {"model": model, "prompt_embeds": embeds, "max_tokens": 4,
                                                          **GREEDY})["choices"]
    schema = {"type": "object", "properties": {SCHEMA_PROPERTY: {"type": "string"}}}
    # Greedy: replayed under its grammar, the request ends where it did (sampled, it might not).
    seen["structured"] = peers.post(http, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "json please"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "acme", "schema": schema}}, **GREEDY})
    peers.stream(http, "/v1/completions", {"model": model, "prompt": WORDS, "max_tokens": 200, **GREEDY},
                 stop_after=2)  # the client goes away: the frontend aborts the request
    return seen


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(the plain recording, the one redacted as recorded, the key file, what the user saw, the prompt
    embeddings' raw bytes)."""
    folder = tmp_path_factory.mktemp("redact-vllm")
    key = folder / "redaction.key"
    key.write_bytes(b"the real tier's redaction key, 32+ bytes")
    plain, redacted = folder / "staging.db", folder / "redacted-live.db"
    http, upstream, middle, listen = (peers.free_port() for _ in range(4))
    embeds, embeds_raw = workload.prompt_embeds()
    children = [peers.python_frontend(folder, http, upstream, flags=EMBEDS)]
    try:
        children.append(peers.proxy(folder, middle, upstream, plain, "chat"))
        children.append(peers.proxy(folder, listen, middle, redacted, "chat", "--redact-key", str(key),
                                    "--vocab-size", str(VOCAB)))
        children.append(peers.headless_engine(folder, listen, flags=EMBEDS))
        peers.wait_http_ready(http, children)
        seen = rich(http, embeds)
    finally:
        for child in reversed(children):
            child.stop()
    for recorder in children[1:3]:
        assert recorder.process.returncode == 0, recorder.log_tail()
    return plain, redacted, key, seen, embeds_raw


def test_a_rich_real_session_redacted_as_recorded_and_after_keeps_its_shape_and_nothing_else(recorded, tmp_path):
    plain, redacted, key, seen, embeds_raw = recorded
    assert seen["turn 3"] and len(seen["n=2"]) == 2 and seen["embeds"][0]["finish_reason"] == "length"
    assert isinstance(json.loads(seen["structured"]["choices"][0]["message"]["content"]), dict)  # served
    after = tmp_path / "redacted-after.db"
    redact_database(plain, after, Redaction(RedactionSettings(str(key), VOCAB)))
    prompts, outputs = tokens_of(plain, 1)
    assert max(map(len, prompts)) > 128  # the turns share at least one whole block
    ids = [r for (r,) in sqlite3.connect(plain).execute("SELECT request_id FROM requests")]
    long_prompts, texts = [p for p in prompts if len(p) >= 8], [*ids, STOP, SCHEMA_PROPERTY]
    embeds_window = embeds_raw[64:128]  # 16 floats of the tensor, as sent
    # What the scan looks for is there to find in the plain recording (outputs come a few tokens a frame).
    assert len(leaks(plain, long_prompts, texts)) == len(long_prompts) + len(texts)
    assert embeds_window in file_bytes(plain)
    for db in (redacted, after):
        assert leaks(db, long_prompts + [o for o in outputs if len(o) >= 8], texts) == []
        assert embeds_window not in file_bytes(db)  # noised
        assert shape(db, 1) == shape(plain, 1)  # lengths, finish reasons, every pair's common prefix
        row = sqlite_utils.Database(db)["sessions"].get(1)
        assert "blanked" not in json.loads(row["redaction_counts"])  # every field vLLM sent has its action
    redacted_prompts, redacted_outputs = tokens_of(after, 1)
    assert tokens_of(redacted, 1) == (redacted_prompts, redacted_outputs)  # one key: the same pseudonyms
    # EOS (1) and the stop token are fixed points by design; any other token is redacted to itself by chance,
    # one in VOCAB for each context (prompt and output so far), about 0.3 a run here. A context that repeats
    # (n=2, the same prompt again) repeats its draw, so each is counted once. Left plain, every one would count.
    fixed = {1, seen["stop token"]["choices"][0]["stop_reason"]}
    contexts = {(tuple(p), tuple(o[:i + 1])) for p, o in zip(prompts, outputs) for i in range(len(o))}
    same = {(tuple(p), tuple(o[:i + 1])) for p, o, r in zip(prompts, outputs, redacted_outputs)
            for i, (a, b) in enumerate(zip(o, r)) if a == b and a not in fixed}
    assert len(contexts) > 20 and len(same) <= 5 + len(contexts) * 3 // VOCAB  # more than 5: one run in a million


def test_every_value_of_the_rich_session_is_what_vllm_0_32_0s_own_decoder_reads(recorded):
    """Multi-turn chat, a stop string and a stop token, logprobs, n=2, prompt embeddings and a structured
    output, as recorded and as vLLM's decoder reads the same frames: the embeddings tensor value by value,
    the stop reason with its type (token 852 and the string "852" stay two things)."""
    plain = recorded[0]
    adds = [fields for kind, fields in read_as_vllm_does(plain) if kind == "ADD"]
    [embeds] = [f["prompt_embeds"] for f in adds if f.get("prompt_embeds") is not None]
    assert embeds.shape == [workload.EMBED_ROWS, json.loads((peers.MODEL / "config.json").read_text())["hidden_size"]]
    assert [f["sampling_params"]["structured_outputs"]["json"] for f in adds
            if f["sampling_params"].get("structured_outputs")] != []
    # vLLM's engine reports a stop token (a stop string is the frontend's to find): stored as the integer it is.
    stops = sqlite3.connect(plain).execute("SELECT typeof(stop_reason), stop_reason FROM outputs "
                                           "WHERE stop_reason IS NOT NULL").fetchall()
    [choice] = recorded[3]["stop token"]["choices"]
    assert choice["finish_reason"] == "stop" and stops == [("integer", choice["stop_reason"])], (stops, choice)


def replay_against_engine(db, tmp_path):
    """`replay --hold-lengths` against a fresh real 0.32.0 engine; the replay's prefix-cache hits and queries
    (the engine's scheduler stats), prompt lengths and output lengths, and the report."""
    listen = peers.free_port()
    result = subprocess.run(
        [sys.executable, "-m", "replay_proxy", "replay", "--db", str(db), "--session", "chat", "--against", "engine",
         "--listen", f"tcp://127.0.0.1:{listen}", "--engine-cmd", peers.engine_command(listen, flags=EMBEDS),
         "--hold-lengths",
         "--ready-timeout", str(peers.READY_TIMEOUT_S), "--finish-timeout", "60", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=peers.REPLAY_S)
    replayed = tmp_path / "replay.db"  # (the default --out, in --report-dir)
    connection = sqlite3.connect(replayed)
    replay_id = connection.execute("SELECT MAX(id) FROM sessions").fetchone()[0]
    hits, queries = connection.execute(
        "SELECT SUM(prefix_cache_hits), SUM(prefix_cache_queries) FROM scheduler_stats WHERE session_id = ?",
        [replay_id]).fetchone()
    lengths = shape(replayed, replay_id)
    return result, json.loads((tmp_path / "report.json").read_text()), (hits, queries), lengths


def test_prefix_cache_hits_agree_between_the_plain_and_the_redacted_replay(recorded, tmp_path):
    plain, _, key, _, _ = recorded
    redacted = tmp_path / "redacted.db"
    redact_database(plain, redacted, Redaction(RedactionSettings(str(key), VOCAB)))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain_result, _, plain_cache, plain_lengths = replay_against_engine(plain, tmp_path / "a")
    redacted_result, report, redacted_cache, redacted_lengths = replay_against_engine(redacted, tmp_path / "b")
    assert plain_result.returncode in (0, 4, 5), plain_result.stderr
    assert redacted_result.returncode in (0, 5), redacted_result.stderr  # behaviour is not judged: 5 is timing
    assert "redacted_recording" in {f["code"] for f in report["findings"]}
    # Prefix caching works on whole blocks of token ids, and the redacted prompts share exactly the blocks
    # the plain ones do; with each request held to its recorded length, the engine does the same work:
    # the same hits, exactly.
    assert redacted_cache == plain_cache and plain_cache[0] > 0
    assert redacted_lengths["prompt_lengths"] == plain_lengths["prompt_lengths"]
    assert [tokens for tokens, _ in redacted_lengths["outputs"][:-1]] == \
        [tokens for tokens, _ in plain_lengths["outputs"][:-1]]  # the last, aborted, ends where its ABORT lands


def test_a_redacted_real_recording_replays_clean_against_the_rust_frontend(tmp_path):
    key = tmp_path / "redaction.key"
    key.write_bytes(b"the real tier's redaction key, 32+ bytes")
    redacted = tmp_path / "redacted.db"
    redact_database(peers.RECORDINGS / "vllm-0.32.0-vllm-rs.db", redacted,
                    Redaction(RedactionSettings(str(key), VOCAB)))
    http, rpc = peers.free_port(), peers.free_port()
    result = subprocess.run(
        [sys.executable, "-m", "replay_proxy", "replay", "--db", str(redacted), "--session", "vllm-rs-frontend",
         "--against", "frontend", "--upstream", f"tcp://127.0.0.1:{rpc}", "--http", f"http://127.0.0.1:{http}",
         "--frontend-cmd", peers.command(peers.rust_frontend_argv(http, rpc, "0.32.0")),
         "--ready-timeout", str(peers.READY_TIMEOUT_S), "--finish-timeout", "60", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=peers.REPLAY_S)
    findings = json.loads((tmp_path / "report.json").read_text())["findings"]
    assert [f["code"] for f in findings if f["severity"] != "info" and f["category"] != "performance"] == [], \
        result.stdout + result.stderr
    assert result.returncode in (0, 5)  # 5: timing only, never judged here
