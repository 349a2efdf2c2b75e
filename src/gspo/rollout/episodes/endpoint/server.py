"""The recording endpoint: an OpenAI-compatible HTTP server on the loopback, backed by the run's
engine, that records every call's ids for training (docs/agents.md).

Routes, under each episode's base URL ``http://127.0.0.1:<port>/e/<batch>.<episode>/v1``:

* ``POST /chat/completions`` (streaming SSE or not): the messages rendered by the chat template
  (or continued, ``recorder``), sampled by the run's engine with the run's sampling parameters;
  the response carries ``prompt_token_ids``, ``choices[0].token_ids``, schema-complete
  ``logprobs`` (``content[i] = {token, logprob, bytes, top_logprobs: []}``) and the hermes
  tool calls of the turn parsed into ``message.tool_calls``;
* ``GET /models``: the model's name and ``max_model_len``;
* ``POST /e/<batch>.<episode>/inference/v1/generate`` (vLLM-shaped token-in: ``token_ids``,
  ``sampling_params``) for clients that render themselves.

Every request needs ``Authorization: Bearer <key>`` (a per-batch key; 401 otherwise, counted).
What is refused with a one-line 4xx, counted: ``n > 1``, stop strings, a context beyond the
budget, malformed JSON, an unknown or ended episode. The agent's sampling parameters
(temperature, top_p, ...) never change the sampler; requests that ask for others are counted.
``max_tokens`` may only shorten a turn. This module owns the HTTP side only: ``recorder`` stitches
ids, ``batcher`` owns the engine calls. It binds 127.0.0.1 and nothing else.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gspo.rollout.episodes.endpoint.batcher import Batcher, Closed, Request
from gspo.rollout.episodes.endpoint.recorder import Pending, Recorder, Refused, parse_reply

HOST = "127.0.0.1"
EPISODE_PATH = re.compile(r"^/e/(\d+)\.(\d+)(/.*)$")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
"""Sampling parameters an agent may send: counted as an override when they differ from the run's."""
OTHER_SAMPLING_KEYS = ("seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "logit_bias", "min_p")
"""Parameters the run's sampler does not take: counted as an override when set."""


@dataclass
class Session:
    """One batch being collected: its episodes' record, the batcher, what a turn decodes with."""

    batch: int
    recorder: Recorder
    batcher: Batcher
    tokenizer: object
    params: object
    deadlines: list[float]
    """Monotonic deadline of each episode."""
    ended: set = field(default_factory=set)
    """Episodes no longer served (their agent returned, failed or ran out of time)."""


class Endpoint:
    """The server: ``open`` binds a free port on 127.0.0.1 and serves in a thread, ``serve`` puts a
    batch's ``Session`` behind it, ``close`` stops it and joins its thread."""

    def __init__(self, model_name: str, max_model_len: int):
        self.model_name, self.max_model_len = model_name, max_model_len
        self.key = secrets.token_urlsafe(24)
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self.session: Session | None = None
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def open(self) -> "Endpoint":
        self.httpd = Server((HOST, 0), Handler)
        self.httpd.endpoint = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="gspo-agent-endpoint", daemon=True)
        self.thread.start()
        return self

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def base_url(self, e: int) -> str:
        """Episode ``e``'s OpenAI base URL in the current session."""
        return f"http://{HOST}:{self.port}/e/{self.session.batch}.{e}/v1"

    def serve(self, session: Session | None) -> None:
        self.session = session

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd.close_connections()
            self.thread.join()
            self.httpd = self.thread = None

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    # ----------------------------------------------------------------------- dispatch
    def handle(self, method: str, path: str, auth: str | None, body: bytes) -> tuple[int, dict | bytes, str]:
        """(status, JSON payload or SSE bytes, content type) of one request."""
        if not hmac.compare_digest((auth or "").encode(), f"Bearer {self.key}".encode()):
            self.count("unauthorized")
            return error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        path = path.split("?")[0]
        found = EPISODE_PATH.match(path)
        route = found.group(3) if found else path
        if method == "GET" and route in ("/v1/models", "/models"):
            return 200, self.models(), JSON
        session = self.session
        if found is None or session is None or int(found.group(1)) != session.batch \
                or not 0 <= int(found.group(2)) < len(session.deadlines):
            self.count("refused")
            return error(404, f"unknown episode or route {path!r}: use the base_url the agent was given")
        e = int(found.group(2))
        handler = ROUTES.get((method, route))
        if handler is None:
            self.count("refused")
            return error(404, f"no route {method} {route}")
        if e in session.ended:
            self.count("late")
            return error(410, "this episode has ended (its agent returned or ran out of time)")
        try:
            request = json.loads(body or b"null")
            if not isinstance(request, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as err:
            self.count("malformed")
            return error(400, f"malformed JSON: {err}".splitlines()[0][:200])
        try:
            return handler(self, session, e, request)
        except Refused as err:
            self.count(err.counter)
            return error(err.status, err.reason)
        except Closed as err:
            self.count("late")
            return error(408, f"not sampled: {err}")

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "gspo", "max_model_len": self.max_model_len}]}

    # ----------------------------------------------------------------------- sampling
    def check(self, session: Session, request: dict) -> None:
        """Refuse ``n > 1`` and stop strings; count sampling parameters the run overrides."""
        if request.get("n") not in (None, 1):
            raise Refused(400, "n > 1 is not served: an episode is one trajectory, ask one choice per call")
        if request.get("stop"):
            raise Refused(400, "stop strings are not served: a turn ends at the end-of-turn token")
        p = session.params
        run = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}
        asked = [k for k in SAMPLING_KEYS if request.get(k) is not None and request[k] != run[k]
                 and not (k == "top_k" and request[k] in (0, -1) and run[k] == 0)]
        asked += [k for k in OTHER_SAMPLING_KEYS if request.get(k) not in (None, 0, {}, 0.0)]
        if asked:
            self.count("overridden")

    def sample(self, session: Session, e: int, pending: Pending, limit) -> tuple[list[int], list[float]]:
        """The engine's turn for ``pending`` (``limit``, the agent's max_tokens, may shorten it)."""
        room = pending.room
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            room = min(room, limit)
        self.count("calls")
        wait = max(0.0, session.deadlines[e] - time.monotonic())
        return session.batcher.submit(Request(e, pending.context, room, pending.opens), timeout=wait)

    def chat(self, session: Session, e: int, request: dict):
        self.check(session, request)
        messages = request.get("messages")
        pending = session.recorder.chat_context(e, messages, request.get("tools"))
        ids, logp = self.sample(session, e, pending, request.get("max_completion_tokens") or request.get("max_tokens"))
        tok = session.tokenizer
        ended = bool(ids) and ids[-1] == tok.eos_token_id
        text = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=True)
        content, calls = parse_reply(text) if ended else (text, [])     # a cut turn calls nothing
        call = session.recorder.commit(e, pending, ids, logp, text, calls, messages)
        finish = "length" if not ended else "tool_calls" if calls else "stop"
        tool_calls = [{"id": f"call_{session.batch}_{e}_{len(session.recorder.logs[e].calls)}_{i}",
                       "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                      for i, c in enumerate(calls)]
        entries = logprob_entries(tok, ids, logp)
        head = {"id": f"chatcmpl-{session.batch}-{e}-{call.end}", "created": int(time.time()),
                "model": self.model_name, "prompt_token_ids": pending.context}
        if request.get("stream"):
            return 200, sse(head, content, tool_calls, entries, ids, finish, usage(pending, ids)), SSE
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return 200, {**head, "object": "chat.completion", "usage": usage(pending, ids), "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "token_ids": ids,
             "logprobs": {"content": entries, "refusal": None}}]}, JSON

    def generate(self, session: Session, e: int, request: dict):
        params = request.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise Refused(400, "sampling_params must be an object", "malformed")
        self.check(session, params)
        pending = session.recorder.token_context(e, request.get("token_ids") or request.get("prompt_token_ids"))
        ids, logp = self.sample(session, e, pending, params.get("max_tokens"))
        tok = session.tokenizer
        ended = bool(ids) and ids[-1] == tok.eos_token_id
        text = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=True)
        session.recorder.commit(e, pending, ids, logp, text, parse_reply(text)[1] if ended else [], None)
        return 200, {"request_id": f"gen-{session.batch}-{e}-{len(session.recorder.logs[e].calls)}",
                     "prompt_token_ids": pending.context, "choices": [
                         {"index": 0, "token_ids": ids, "text": text, "finish_reason": "stop" if ended else "length",
                          "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": float(lp)}
                                                   for i, lp in zip(ids, logp)]}}]}, JSON


ROUTES = {("POST", "/v1/chat/completions"): Endpoint.chat,
          ("POST", "/inference/v1/generate"): Endpoint.generate}
JSON, SSE = "application/json", "text/event-stream"


def error(status: int, message: str) -> tuple[int, dict, str]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}, JSON


def logprob_entries(tokenizer, ids: list[int], logp: list[float]) -> list[dict]:
    """``logprobs.content``: one schema-complete entry per sampled token (the OpenAI SDK's shape)."""
    out = []
    for i, lp in zip(ids, logp):
        token = tokenizer.decode([i])
        out.append({"token": token, "logprob": float(lp), "bytes": list(token.encode("utf-8")),
                    "top_logprobs": []})
    return out


def usage(pending: Pending, ids: list[int]) -> dict:
    n = len(pending.context)
    return {"prompt_tokens": n, "completion_tokens": len(ids), "total_tokens": n + len(ids)}


def sse(head: dict, content, tool_calls: list, entries: list, ids: list[int], finish: str, use: dict) -> bytes:
    """The streamed answer: the content and its log-probs, the tool calls, the finish reason, [DONE]."""
    base = {**head, "object": "chat.completion.chunk"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": content or ""},
                                    "logprobs": {"content": entries, "refusal": None}, "token_ids": ids,
                                    "finish_reason": None}]}]
    if tool_calls:
        chunks.append({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {
            "tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}}]})
    chunks.append({**base, "usage": use, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


class Server(ThreadingHTTPServer):
    """A thread per connection, and a listen backlog for a batch's agents connecting at once (the
    default 5 refuses some of them). ``close_connections`` ends the connections still open (a
    client's keep-alive), so that their threads end with the server."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address, handler):
        super().__init__(address, handler)
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        with self.connections_lock:
            self.connections.add(request)
        threading.Thread(target=self.process_request_thread, args=(request, client_address),
                         name="gspo-agent-endpoint-connection", daemon=True).start()

    def shutdown_request(self, request) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that hung up before its answer was written (an agent past its deadline, a
        cancelled call) is not the server's fault: no traceback. Anything else: the base's."""
        if isinstance(sys.exc_info()[1], ConnectionError):     # broken pipe, reset, aborted
            return
        super().handle_error(request, client_address)

    def close_connections(self) -> None:
        with self.connections_lock:
            open_now = list(self.connections)
        for connection in open_now:
            try:
                connection.shutdown(socket.SHUT_RDWR)    # its thread reads EOF and ends
            except OSError:
                pass


class Handler(BaseHTTPRequestHandler):
    """Reads a request, hands it to the server's ``Endpoint``, writes its answer (quietly)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # noqa: A002  the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self.answer("POST")

    def answer(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            status, payload, kind = self.server.endpoint.handle(method, self.path,
                                                               self.headers.get("Authorization"), body)
        except Exception as err:  # noqa: BLE001  never a traceback to the agent or the run
            status, payload, kind = error(500, f"{type(err).__name__}: {err}".splitlines()[0][:200])
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
