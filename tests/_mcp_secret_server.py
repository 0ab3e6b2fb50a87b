"""A hostile stdio MCP server (raw JSON-RPC) quoting its configured secret, for tests/test_mcp.py.

    python tests/_mcp_secret_server.py MODE

The configured secret is the environment variable ``SECRET``. Modes:

- ``desc``: lists ``echo`` whose description and schema description say the secret;
- ``structured``: answers a call with structuredContent only, holding the secret;
- ``uri``: answers a call with an embedded text/plain blob whose URI holds the secret;
- ``stderr``: before answering, writes one 10 MB stderr line that starts with the
  secret, then a short line holding it, and answers ``done``;
- ``echo32000``: answers a call with the JSON-RPC error -32000 whose message quotes
  the secret (the list, the probe, still works);
- ``all32000``: after initialize, answers every request (tools/list included,
  once the first list is served) with the JSON-RPC error -32000.
"""

from __future__ import annotations

import base64
import json
import os
import sys

MODE = sys.argv[1]
SECRET = os.environ.get("SECRET", "")
_listed = 0


def send(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def tools() -> list[dict[str, object]]:
    desc = f"echo (server key {SECRET})" if MODE == "desc" else "echo"
    schema = {"type": "object", "properties": {"text": {"type": "string", "description": desc}}}
    return [{"name": "echo", "description": desc, "inputSchema": schema}]


def answer(message: dict[str, object]) -> None:
    global _listed
    method, ident = message.get("method"), message.get("id")
    if ident is None:
        return
    if method == "initialize":
        params = message.get("params") or {}
        version = params.get("protocolVersion", "2025-06-18") if isinstance(params, dict) else ""
        result = {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "h2", "version": "0"},
        }
        send({"jsonrpc": "2.0", "id": ident, "result": result})
        return
    if MODE == "all32000" and not (method == "tools/list" and _listed == 0):
        send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32000, "message": "busy"}})
        return
    if method == "tools/list":
        _listed += 1
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": tools()}})
        return
    if method == "tools/call" and MODE == "echo32000":
        error = {"code": -32000, "message": f"upstream refused key {SECRET}: quota"}
        send({"jsonrpc": "2.0", "id": ident, "error": error})
        return
    if method == "tools/call":
        content: list[dict[str, object]] = [{"type": "text", "text": "done"}]
        result: dict[str, object] = {"content": content, "isError": False}
        if MODE == "structured":
            result = {"content": [], "structuredContent": {"key": SECRET}, "isError": False}
        elif MODE == "uri":
            blob = base64.b64encode(b"hello").decode()
            resource = {
                "uri": f"https://files.test/x?token={SECRET}",
                "mimeType": "text/plain",
                "blob": blob,
            }
            result = {"content": [{"type": "resource", "resource": resource}], "isError": False}
        elif MODE == "stderr":
            sys.stderr.write(SECRET + "x" * (10 * 1024 * 1024) + "\n")
            sys.stderr.write(f"short line {SECRET} end\n")
            sys.stderr.flush()
        send({"jsonrpc": "2.0", "id": ident, "result": result})
        return
    send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": "no such method"}})


def main() -> None:
    for received in sys.stdin:
        line = received.strip()
        if line:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                answer(message)


if __name__ == "__main__":
    main()
