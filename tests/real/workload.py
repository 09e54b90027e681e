"""The HTTP workload run against real frontends: what a user does, one request at a time.

Requests run sequentially: on this CPU build, greedy requests batched
together do not reproduce run to run (REAL_VLLM.md), single ones do.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.real.peers import MODEL, post, stream

GREEDY = {"temperature": 0.0}


def run(http_port: int, model: Path = MODEL) -> dict[str, object]:
    """Run the workload; return what the user saw, by request name."""
    seen: dict[str, object] = {}
    completion = post(http_port, "/v1/completions", {
        "model": str(model), "prompt": "hello world one two", "max_tokens": 8, **GREEDY})
    seen["completion"] = completion["choices"][0]["text"], completion["choices"][0]["finish_reason"]
    chat = post(http_port, "/v1/chat/completions", {
        "model": str(model), "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": 6, **GREEDY})
    seen["chat"] = chat["choices"][0]["message"]["content"], chat["choices"][0]["finish_reason"]
    events = stream(http_port, "/v1/completions", {
        "model": str(model), "prompt": "one two three", "max_tokens": 6, **GREEDY})
    seen["stream"] = "".join(e["choices"][0]["text"] for e in events if e["choices"]), next(
        e["choices"][0]["finish_reason"] for e in reversed(events) if e["choices"] and e["choices"][0]["finish_reason"])
    seeded = post(http_port, "/v1/completions", {
        "model": str(model), "prompt": "five six seven", "max_tokens": 6, "temperature": 0.8, "seed": 1234})
    seen["seeded"] = seeded["choices"][0]["text"], seeded["choices"][0]["finish_reason"]
    # A stream the client closes after two events, so that the frontend sends ABORT. Whether it
    # does is a race the product does not decide: the tiny model can finish all 240 tokens before
    # the frontend notices the closed connection (on a busy machine the Python frontend even sends
    # them as one event). The client tries up to three times to close a stream that is still
    # generating; the tests then assert only what holds either way (every request ends, finished
    # or aborted, and the recording says which).
    for attempt in range(1, 4):
        aborted = stream(http_port, "/v1/completions", {
            "model": str(model), "prompt": "engines stream tokens", "max_tokens": 240, **GREEDY}, stop_after=2)
        if len(aborted) == 2 and not any(c.get("finish_reason") for e in aborted for c in e["choices"]):
            break
    seen["abort_attempts"] = attempt
    time.sleep(1.0)  # let the frontend notice the closed connection and send its ABORT
    return seen
