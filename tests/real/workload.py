"""The HTTP workload run against real frontends: what a user does, one request at a time (completion,
chat, streaming, a seeded request, logprobs, a client abort).

Requests run sequentially: on this CPU build, greedy requests batched
together do not reproduce run to run (REAL_VLLM.md), single ones do. A
request that fails (a frontend that cannot read its engine answers 500) is
noted as its HTTP status and the workload goes on, so that a broken pair's
recording still holds everything its frontend sends.
"""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path

from tests.real.peers import MODEL, post, stream

GREEDY = {"temperature": 0.0}


def _text(events: list[dict]) -> tuple[str, str | None]:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), next(
        (e["choices"][0]["finish_reason"] for e in reversed(events)
         if e["choices"] and e["choices"][0]["finish_reason"]), None)


def run(http_port: int, model: Path = MODEL) -> dict[str, object]:
    """Run the workload; return what the user saw, by request name."""
    steps = {
        "completion": lambda: post(http_port, "/v1/completions", {
            "model": str(model), "prompt": "hello world one two", "max_tokens": 8, **GREEDY})["choices"][0],
        "chat": lambda: post(http_port, "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "the quick brown fox"}],
            "max_tokens": 6, **GREEDY})["choices"][0],
        "stream": lambda: _text(stream(http_port, "/v1/completions", {
            "model": str(model), "prompt": "one two three", "max_tokens": 6, **GREEDY})),
        "seeded": lambda: post(http_port, "/v1/completions", {
            "model": str(model), "prompt": "five six seven", "max_tokens": 6, "temperature": 0.8,
            "seed": 1234})["choices"][0],
        "logprobs": lambda: post(http_port, "/v1/completions", {
            "model": str(model), "prompt": "seven eight nine", "max_tokens": 4, "logprobs": 2, **GREEDY})["choices"][0],
    }
    seen: dict[str, object] = {}
    for name, step in steps.items():
        try:
            answer = step()
        except urllib.error.HTTPError as exc:
            seen[name] = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
            continue
        if isinstance(answer, dict):  # a choice: completion text or chat message
            answer = answer.get("text", (answer.get("message") or {}).get("content")), answer["finish_reason"]
        seen[name] = answer
    # A stream the client closes after two events, so that the frontend sends ABORT. Whether it
    # does is a race the product does not decide: the tiny model can finish all 240 tokens before
    # the frontend notices the closed connection (on a busy machine the Python frontend even sends
    # them as one event). The client tries up to three times to close a stream that is still
    # generating; the tests then assert only what holds either way (every request ends, finished
    # or aborted, and the recording says which).
    for attempt in range(1, 4):
        try:
            aborted = stream(http_port, "/v1/completions", {
                "model": str(model), "prompt": "engines stream tokens", "max_tokens": 240, **GREEDY}, stop_after=2)
        except urllib.error.HTTPError as exc:
            seen["abort"] = f"HTTP {exc.code}"
            break
        if len(aborted) == 2 and not any(c.get("finish_reason") for e in aborted for c in e["choices"]):
            break
    seen["abort_attempts"] = attempt
    time.sleep(1.0)  # let the frontend notice the closed connection and send its ABORT
    return seen
