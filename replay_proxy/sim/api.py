"""The sim frontend's OpenAI-compatible HTTP API: just enough for `replay --against frontend`.

``GET /v1/models`` and ``POST /v1/completions`` with the prompt as token ids,
the sampling parameters vLLM's API server maps onto SamplingParams, streaming
(server-sent events) or not, and ``token_ids`` in every choice. As in vLLM, a
streaming client that disconnects gets its request aborted. One request per
connection (``Connection: close``): this is a test peer, not a web server.
"""

from __future__ import annotations

import functools
import json
import uuid

import trio

from replay_proxy.sim.frontend import SimFrontend

MODEL = "sim"


async def serve_api(frontend: SimFrontend, port: int = 0, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve on 127.0.0.1:``port``; hands the bound port to ``task_status``.

    Like vLLM's API server, it first asks every engine which tasks it supports."""
    calls = [await frontend.utility("get_supported_tasks", engine=engine) for engine in range(frontend.engines)]
    await frontend.wait_for(lambda: all(call in frontend.utility_results for call in calls))
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(functools.partial(_handle, frontend), listeners)


async def _handle(frontend: SimFrontend, stream: trio.SocketStream) -> None:
    async with stream:
        try:
            method, path, body = await _read_request(stream)
            if (method, path) == ("GET", "/v1/models"):
                await _respond(stream, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif (method, path) == ("POST", "/v1/completions"):
                await _complete(frontend, stream, json.loads(body))
            else:
                await _respond(stream, 404, {"error": f"no route {method} {path}"})
        except (ValueError, KeyError, TypeError) as exc:
            await _respond(stream, 400, {"error": f"bad request: {exc}"})
        except trio.BrokenResourceError:
            pass  # the client went away


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ValueError("connection closed inside the request head")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ValueError("connection closed inside the request body")
        body += chunk
    return method, path, body


async def _respond(stream: trio.SocketStream, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await stream.send_all(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                          "Connection: close\r\n\r\n".encode() + payload)


async def _complete(frontend: SimFrontend, stream: trio.SocketStream, body: dict) -> None:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streaming = bool(body.get("stream"))
    # Like vLLM's API server: every request field that names a SamplingParams field is one.
    params = {k: v for k, v in body.items() if k in frontend.schema.sampling_defaults}
    output_kind = frontend.schema.enums["RequestOutputKind"]["DELTA" if streaming else "FINAL_ONLY"]
    engine, client = await frontend.add_balanced(request_id, [int(t) for t in body["prompt"]],
                                                 output_kind=output_kind, **params)
    tokens = frontend.tokens[request_id]
    if not streaming:
        await frontend.wait_for(lambda: request_id in frontend.finish_reasons)
        finish = frontend.schema.finish_name(frontend.finish_reasons[request_id])
        await _respond(stream, 200, {"id": request_id, "object": "text_completion", "model": MODEL, "choices": [
            {"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish}]})
        return
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    async with trio.open_nursery() as nursery:
        async def abort() -> None:  # the client went away: as vLLM does, abort its request
            await frontend.abort([request_id], engine=engine, client=client)
            nursery.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while await stream.receive_some(4096):
                pass
            await abort()

        nursery.start_soon(watch_disconnect)
        sent = 0
        while True:
            await frontend.wait_for(lambda: len(tokens) > sent or request_id in frontend.finish_reasons)
            finish = frontend.schema.finish_name(frontend.finish_reasons.get(request_id))
            choice = {"index": 0, "text": "", "token_ids": tokens[sent:], "finish_reason": finish}
            sent = len(tokens)
            event = {"id": request_id, "object": "text_completion", "model": MODEL, "choices": [choice]}
            try:
                await stream.send_all(b"data: " + json.dumps(event).encode() + b"\n\n"
                                      + (b"data: [DONE]\n\n" if finish is not None else b""))
            except trio.BrokenResourceError:
                await abort()
                return
            if finish is not None:
                nursery.cancel_scope.cancel()
                return
