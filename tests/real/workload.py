"""The HTTP workloads run against real frontends: what a user does, one request at a time (``run``:
completion, chat, streaming, a seeded request, logprobs, a client abort; and the other kinds of request below).

Requests run sequentially: on vLLM's CPU build, greedy requests batched
together do not reproduce run to run (docs/real-vllm.md), single ones do. A
request that fails (a frontend that cannot read its engine answers 500) is
noted as its HTTP status and the workload goes on, so that a broken pair's
recording still holds everything its frontend sends.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import shutil
import subprocess
import time
import urllib.error
from pathlib import Path

from replay_proxy.peers import ADAPTER
from tests.real.peers import CACHE, MODEL, TRAINED, post, stream

GREEDY = {"temperature": 0.0}


def _text(events: list[dict]) -> tuple[str, str | None]:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), next(
        (e["choices"][0]["finish_reason"] for e in reversed(events)
         if e["choices"] and e["choices"][0]["finish_reason"]), None)


def _each(steps: dict[str, object]) -> dict[str, object]:
    """Run the steps in order: what each returned, by name, or its HTTP failure (status and the start of the
    body), and the rest go on."""
    seen: dict[str, object] = {}
    for name, step in steps.items():
        try:
            seen[name] = step()
        except urllib.error.HTTPError as exc:
            seen[name] = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
    return seen


def _choice(choice: dict) -> tuple[str, str]:
    """A completion's text or a chat's message, with its finish reason."""
    return choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]


def run(http_port: int, model: Path = MODEL, *, hold_engine=contextlib.nullcontext,
        abort_seen=None) -> dict[str, object]:
    """Run the workload; return what the user saw, by request name (``_abort`` says what
    ``hold_engine`` and ``abort_seen`` are for)."""
    steps = {
        "completion": lambda: _choice(post(http_port, "/v1/completions", {
            "model": str(model), "prompt": "hello world one two", "max_tokens": 8, **GREEDY})["choices"][0]),
        "chat": lambda: _choice(post(http_port, "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "the quick brown fox"}],
            "max_tokens": 6, **GREEDY})["choices"][0]),
        "stream": lambda: _text(stream(http_port, "/v1/completions", {
            "model": str(model), "prompt": "one two three", "max_tokens": 6, **GREEDY})),
        "seeded": lambda: _choice(post(http_port, "/v1/completions", {
            "model": str(model), "prompt": "five six seven", "max_tokens": 6, "temperature": 0.8,
            "seed": 1234})["choices"][0]),
        "logprobs": lambda: _choice(post(http_port, "/v1/completions", {
            "model": str(model), "prompt": "seven eight nine", "max_tokens": 4, "logprobs": 2,
            **GREEDY})["choices"][0]),
    }
    seen = _each(steps)
    seen["abort"], seen["abort_attempts"] = _abort(http_port, model, hold_engine, abort_seen)
    return seen


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def staging(http_port: int, model: Path = MODEL, requests: int = 30, **_) -> dict[str, object]:
    """``requests`` users of a staging day, one after another, each of one of the kinds ``run`` has
    (greedy and seeded completions, a chat, a stream, logprobs) in turn, with prompts of their own:
    what ``shrink`` is given to find the one request a break needs. Returns what each user saw. (It has no
    abort: the keywords ``run`` takes for one are accepted and not used.)"""
    kinds = [
        lambda prompt: post(http_port, "/v1/completions", {
            "model": str(model), "prompt": prompt, "max_tokens": 8, **GREEDY})["choices"][0]["text"],
        lambda prompt: post(http_port, "/v1/completions", {
            "model": str(model), "prompt": prompt, "max_tokens": 6, "temperature": 0.7, "top_p": 0.9,
            "seed": len(prompt)})["choices"][0]["text"],
        lambda prompt: post(http_port, "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": prompt}], "max_tokens": 5,
            **GREEDY})["choices"][0]["message"]["content"],
        lambda prompt: _text(stream(http_port, "/v1/completions", {
            "model": str(model), "prompt": prompt, "max_tokens": 6, **GREEDY}))[0],
        lambda prompt: post(http_port, "/v1/completions", {
            "model": str(model), "prompt": prompt, "max_tokens": 4, "logprobs": 1, **GREEDY})["choices"][0]["text"],
    ]
    prompts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 5)) for i in range(requests)]
    return _each({f"user-{i}": functools.partial(kinds[i % len(kinds)], prompt) for i, prompt in enumerate(prompts)})


# A real client's traffic (``bench_serve``): runs of ``vllm bench serve``, 4 users at a time, on random prompts;
# sampled as OpenAI-style clients sample (temperature and top-p alone, no top-k, no seed), greedy, and seeded with
# stop tokens and a min_tokens.
BENCH_SERVE_RUNS = {
    "top-p 0.9": ["--num-prompts", "10", "--temperature", "0.8", "--top-p", "0.9"],
    "top-p 0.95": ["--num-prompts", "10", "--temperature", "1.0", "--top-p", "0.95"],
    "greedy": ["--num-prompts", "10", "--temperature", "0"],
    "seeded": ["--num-prompts", "8", "--temperature", "0.9", "--min-p", "0.02"],  # and stop_token_ids (below)
}
STOP_TOKENS = 40  # the seeded requests' stop ids: those the model's tokenizer gives text most often


def frequent_tokens(model: Path, count: int = STOP_TOKENS) -> list[int]:
    """The ``count`` ids ``model``'s tokenizer gives the standard library's text most often (the text
    scripts/make_tiny_model.py trains on): stop ids that the model generates, trained or random. (The
    tokenizer is the 0.32.0 venv's: the project's venv has none.)"""
    from replay_proxy import peers as real

    program = (
        "import collections, json, pathlib, sys, sysconfig\n"
        "from tokenizers import Tokenizer\n"
        "paths = sorted(pathlib.Path(sysconfig.get_paths()['stdlib']).glob('*.py'))[:20]\n"
        "ids = Tokenizer.from_file(sys.argv[1]).encode(''.join(p.read_text(errors='replace') for p in paths)).ids\n"
        "print(json.dumps([t for t, _ in collections.Counter(ids).most_common(int(sys.argv[2]))]))")
    done = subprocess.run([str(real.venv("0.32.0") / "bin" / "python"), "-c", program, str(model / "tokenizer.json"),
                           str(count)], check=True, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout)


def bench_serve(http_port: int, model: Path = TRAINED, **_) -> dict[str, object]:
    """``BENCH_SERVE_RUNS`` through the frontend at ``http_port`` serving ``model``, one run after another;
    returns each run's summary (requests completed, output tokens) as vllm bench serve reports it."""
    from replay_proxy import peers as real

    seen = {}
    for i, (name, flags) in enumerate(BENCH_SERVE_RUNS.items()):
        scratch = real.scratch_dir()
        out = scratch / "result.json"
        try:
            subprocess.run(
                [str(real.venv("0.32.0") / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
                 "--base-url", f"http://127.0.0.1:{http_port}", "--endpoint", "/v1/completions",
                 "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random",
                 "--random-input-len", "24", "--random-output-len", "24", "--random-range-ratio", "0.5",
                 "--max-concurrency", "4", "--seed", str(i), "--disable-tqdm", "--save-result",
                 "--result-dir", str(scratch), "--result-filename", out.name, *flags, *(
                     ["--extra-body", json.dumps({"seed": 11, "min_tokens": 3,
                                                  "stop_token_ids": frequent_tokens(model)})]
                     if name == "seeded" else [])],
                env=real.vllm_env(scratch), check=True, capture_output=True, timeout=600)
            result = json.loads(out.read_text())
            seen[name] = {"completed": result["completed"], "output_tokens": result["total_output_tokens"]}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return seen


def lora(http_port: int, model: Path = MODEL, **_) -> dict[str, object]:
    """A user of a LoRA adapter (the frontend and engine serving peers.LORA): a completion of the
    base model, the adapter loaded through the frontend's API (an ``add_lora`` utility call on the wire, its
    LoRARequest the argument, the adapter named by its path relative to the peers' folder, the same on every
    machine), then the same prompt naming the adapter (an ADD carrying that LoRARequest).
    A step that fails is noted as its HTTP status and the rest go on. (No abort: the keywords ``run`` takes
    for one are accepted and not used.)"""
    prompt = {"prompt": "hello world one two", "max_tokens": 6, **GREEDY}
    steps = {
        "base": lambda: post(http_port, "/v1/completions", {"model": str(model), **prompt})["choices"][0]["text"],
        "load": lambda: post(http_port, "/v1/load_lora_adapter", {"lora_name": "tiny-lora",
                                                                  "lora_path": ADAPTER}, text=True),
        "adapter": lambda: post(http_port, "/v1/completions", {"model": "tiny-lora", **prompt})["choices"][0]["text"],
    }
    return _each(steps)


# What the frontend and the engine need for ngram speculative decoding (``fan_out``'s repeating prompt).
NGRAM = ("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1}))


def clients(http_port: int, model: Path = MODEL, **kw) -> dict[str, object]:
    """What every client of the engine is recorded doing, vLLM's frontends and third-party ones alike: ``run``'s
    requests, then an n=2 completion sampled with top-p alone (each frontend fans it out in its own way)."""
    seen = run(http_port, model, **kw)
    seen["n2"] = _each({"n2": lambda: [_choice(c) for c in post(http_port, "/v1/completions", {
        "model": str(model), "prompt": "one two three", "max_tokens": 5, "n": 2, "temperature": 0.8,
        "top_p": 0.9})["choices"]]})["n2"]
    return seen


def fan_out(http_port: int, model: Path = MODEL, **_) -> dict[str, object]:
    """Requests the frontend fans out (beam search, n=2) and one an ngram drafter proposes for (its prompt
    repeats itself): each step's JSON answer, or its HTTP status. (No abort: ``run``'s keywords are accepted
    and not used.)"""
    steps = {
        "beam": lambda: post(http_port, "/v1/completions", {"model": str(model), "prompt": "hello world one two",
                                                            "max_tokens": 5, "n": 2, "use_beam_search": True,
                                                            **GREEDY}),
        "n2": lambda: post(http_port, "/v1/completions", {"model": str(model), "prompt": "one two three",
                                                          "max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 7}),
        "repeating": lambda: post(http_port, "/v1/completions", {"model": str(model), "max_tokens": 8, **GREEDY,
                                                                 "prompt": "one two three one two three"}),
    }
    return _each(steps)


def pooling(http_port: int, model: Path = MODEL, **_) -> dict[str, object]:
    """A user of an embedding model (the frontend and engine serving peers.POOLING): two texts
    embedded in one request, then a score of one text against two (the frontend embeds and compares).
    Each step's JSON answer, or its HTTP status. (No abort: ``run``'s keywords are accepted and not used.)"""
    steps = {
        "embeddings": lambda: post(http_port, "/v1/embeddings", {"model": str(model),
                                                                 "input": ["hello world", "one two three"]}),
        "score": lambda: post(http_port, "/score", {"model": str(model), "text_1": "hello world",
                                                    "text_2": ["one two", "three four five"]}),
    }
    return _each(steps)


PROMPT_EMBEDS = ("--enable-prompt-embeds",)  # what the frontend and the engine need to serve prompt embeds
EMBED_ROWS = 6
STRUCTURED = {  # the four forms of StructuredOutputsParams a completion request names, and what each allows
    "regex": ("[0-9]{3}-[a-z]{2}", r"[0-9]{3}-[a-z]{2}"),
    "choice": (["red", "green", "blue"], "red|green|blue"),
    "grammar": ('root ::= "yes" | "no" | "maybe"', "yes|no|maybe"),
}
COLOUR = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}  # a JSON schema
WORDS_OF_A_CHAT = "the quick brown fox jumps over the lazy dog while seven wise owls watch from the old oak tree"
OPENING = " ".join([WORDS_OF_A_CHAT] * 4)  # more than one 128-token block: what prefix caching shares


# What crosses for ``varied``'s structured outputs, in order: the frontend hands a choice to its backend as
# the grammar of its alternatives.
STRUCTURED_ON_THE_WIRE = [{"json": COLOUR}, {"regex": STRUCTURED["regex"][0]},
                          {"grammar": 'root ::= "red" | "green" | "blue"'}, {"grammar": STRUCTURED["grammar"][0]}]


def structured_forms(adds: list[dict]) -> list[dict]:
    """The structured outputs each ADD (named fields) asked for: the forms it set, not the backend's own keys."""
    return [{form: value for form, value in a["sampling_params"]["structured_outputs"].items()
             if value not in (None, False) and not form.startswith("_")} for a in adds
            if (a["sampling_params"] or {}).get("structured_outputs")]


def prompt_embeds(release: str = "0.32.0") -> tuple[str, bytes]:
    """A seeded (EMBED_ROWS, hidden size) float32 tensor, as the completions API takes it (base64 of
    torch.save), and its raw bytes (as they go on the wire), made by ``release``'s own torch."""
    code = ("import base64, io, sys, torch; torch.manual_seed(7); "
            f"t = torch.randn({EMBED_ROWS}, int(sys.argv[1]), dtype=torch.float32); b = io.BytesIO(); "
            "torch.save(t, b); print(base64.b64encode(b.getvalue()).decode()); "
            "print(base64.b64encode(t.numpy().tobytes()).decode())")
    hidden = json.loads((MODEL / "config.json").read_text())["hidden_size"]
    saved, raw = subprocess.run([str(CACHE / f"vllm-{release}" / "bin" / "python"), "-c", code, str(hidden)],
                                capture_output=True, text=True, check=True, timeout=120).stdout.split()
    return saved, base64.b64decode(raw)


def chat_turns(http_port: int, model: Path = MODEL, turns: int = 3) -> list[str]:
    """A chat of ``turns`` turns, each turn's prompt the last one's, its answer and a new question (a prefix
    the engine's cache serves): each turn's answer."""
    messages, answers = [{"role": "user", "content": OPENING}], []
    for turn in range(turns):
        answer = post(http_port, "/v1/chat/completions", {"model": str(model), "messages": messages, "max_tokens": 6,
                                                          **GREEDY})["choices"][0]["message"]["content"]
        answers.append(answer)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and {turn} more"}]
    return answers


def varied(http_port: int, model: Path = MODEL, *, embeds: str, **_) -> dict[str, object]:
    """The other shapes a request takes (the frontend and engine serving PROMPT_EMBEDS): a three-turn chat
    whose turns share their prefix, structured outputs in each form (a JSON schema through response_format;
    a regex, a choice and a grammar through structured_outputs), and a request of prompt embeds
    (``embeds``: ``prompt_embeds()``'s first). All greedy, so that a replay ends each where it ended. Each
    step's answer, or its HTTP status. (No abort: ``run``'s keywords are accepted and not used.)"""
    steps = {
        "turns": lambda: chat_turns(http_port, model),
        "json": lambda: _choice(post(http_port, "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "a colour as JSON"}], "max_tokens": 12,
            "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}},
            **GREEDY})["choices"][0]),
        **{form: functools.partial(lambda form: _choice(post(http_port, "/v1/completions", {
            "model": str(model), "prompt": f"answer by {form}:", "max_tokens": 10,
            "structured_outputs": {form: STRUCTURED[form][0]}, **GREEDY})["choices"][0]), form)
           for form in STRUCTURED},
        "embeds": lambda: _choice(post(http_port, "/v1/completions", {
            "model": str(model), "prompt_embeds": embeds, "max_tokens": 4, **GREEDY})["choices"][0]),
    }
    return _each(steps)


def _abort(http_port: int, model: Path, hold_engine, abort_seen) -> tuple[object, int]:
    """A stream the client closes after its first event, so that the frontend sends ABORT: (what the
    client saw, how many streams that took).

    The engine is held still (``hold_engine``: SIGSTOP on its process group) from that event until the
    frontend has noticed, so it cannot finish the request first: without that, the tiny model could
    finish all its tokens before the frontend saw the closed connection, and the ABORT was a race. The
    Python frontend notices a closed stream at once; vllm-rs when it next writes, so the engine is let
    go after a while. Only a first event that already ends the request (a busy Python frontend can send
    everything as one event) leaves nothing to abort: then the client tries again, three times at most.
    With ``abort_seen`` (a recording: has the ABORT crossed?), that it came is checked, not assumed."""
    for attempt in range(1, 4):
        try:
            with contextlib.ExitStack() as held:
                events = stream(http_port, "/v1/completions", {
                    "model": str(model), "prompt": "engines stream tokens", "max_tokens": 240, **GREEDY},
                    stop_after=1, before_close=lambda: held.enter_context(hold_engine()))
                finished = any(c.get("finish_reason") for e in events for c in e["choices"])
                if not finished:
                    _wait(abort_seen, HELD_S)
        except urllib.error.HTTPError as exc:  # a pair that cannot serve a request: nothing to abort
            return f"HTTP {exc.code}", attempt
        if not finished:
            break
    if abort_seen is not None and not _wait(abort_seen, ABORT_S):
        raise AssertionError(f"no ABORT crossed within {ABORT_S:g} s of the client closing its stream "
                             f"({attempt} stream(s))")
    return events, attempt


HELD_S, ABORT_S = 5.0, 30.0


def _wait(condition, seconds: float) -> bool:
    """Until ``condition()`` holds, or ``seconds`` (None: no condition, just the wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition is not None and condition():
            return True
        time.sleep(0.1)
    return condition is None
