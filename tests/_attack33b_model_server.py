"""Attack 33b: a tiny OpenAI-compatible Chat Completions server, run as a child process.

``python _attack33b_model_server.py PORT_FILE`` listens on 127.0.0.1 (a free port,
written to PORT_FILE once it listens). Every request to ``/v1/chat/completions`` is
counted and answered by the next action of its script (``POST /control/script`` with a
JSON list; once the script is used up, the default action, ``POST /control/default``).
``GET /control/stats`` returns ``{"requests": n, "in_flight": k, "open": [numbers of the
requests in flight, from 1], "bodies": [...]}``.

Actions (dicts, ``kind`` says which):

- ``text``: a reply with ``text``;
- ``call``: a reply with tool calls ``calls`` = ``[[id, name, raw_arguments], ...]``
  (``{n}`` in an id is replaced by the request's number);
- ``hang``: answer nothing for ``seconds`` (default 120), then a text reply;
- ``status``: HTTP ``code`` with an OpenAI error body (``retry_after`` header if given);
- ``cut``: (streaming) one text chunk, then the connection is closed;
- ``raw``: status 200 with ``body`` as given (content type JSON).

Streaming requests (``"stream": true``) get the same reply as server-sent events.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOCK = threading.Lock()
STATE: dict[str, Any] = {
    "requests": 0,
    "in_flight": 0,
    "open": [],
    "bodies": [],
    "script": [],
    "default": {"kind": "text", "text": "default answer"},
}
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def _message(action: dict[str, Any], number: int) -> tuple[dict[str, Any], str]:
    if action["kind"] == "call":
        calls = [
            {
                "id": cid.replace("{n}", str(number)),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for cid, name, args in action["calls"]
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": action.get("text", "ok")}, "stop"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "test-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        with LOCK:
            stats = {k: STATE[k] for k in ("requests", "in_flight", "open", "bodies")}
        self._send(200, json.dumps(stats).encode())

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        if self.path.startswith("/control/"):
            with LOCK:
                STATE[self.path.removeprefix("/control/")] = json.loads(raw)
            self._send(200, b"{}")
            return
        body = json.loads(raw)
        with LOCK:
            STATE["requests"] += 1
            STATE["in_flight"] += 1
            number = STATE["requests"]
            STATE["open"].append(number)
            STATE["bodies"].append(body)
            script = STATE["script"]
            action = script.pop(0) if script else STATE["default"]
        try:
            self._answer(action, bool(body.get("stream")), number)
        finally:
            with LOCK:
                STATE["in_flight"] -= 1
                STATE["open"].remove(number)

    def _answer(self, action: dict[str, Any], stream: bool, number: int) -> None:
        kind = action["kind"]
        if kind == "hang":
            time.sleep(float(action.get("seconds", 120)))
            action = {"kind": "text", "text": "late"}
            kind = "text"
        if kind == "status":
            error = {"error": {"message": "scripted", "type": "server_error", "code": None}}
            headers = {}
            if "retry_after" in action:
                headers["Retry-After"] = str(action["retry_after"])
            self._send(int(action["code"]), json.dumps(error).encode(), headers)
            return
        if kind == "raw":
            self._send(200, action["body"].encode())
            return
        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(_chunk({"role": "assistant", "content": ""}))
            if kind == "cut":
                self.wfile.write(_chunk({"content": "partial"}))
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            message, finish = _message(action, number)
            if message.get("content"):
                self.wfile.write(_chunk({"content": message["content"]}))
            for index, call in enumerate(message.get("tool_calls") or ()):
                self.wfile.write(_chunk({"tool_calls": [{"index": index, **call}]}))
            self.wfile.write(_chunk({}, finish))
            tail = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "test-model",
                "choices": [],
                "usage": USAGE,
            }
            self.wfile.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        if kind == "cut":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        message, finish = _message(action, number)
        reply = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "test-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": USAGE,
        }
        self._send(200, json.dumps(reply).encode())


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with open(sys.argv[1] + ".tmp", "w") as out:
        out.write(str(server.server_address[1]))
    import os

    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
