"""One MCP tool as the ``Tools`` step runs it: definition, side-effect class, call, result.

:class:`McpTool` is a :class:`~stepmachine.ToolLike`: the journal, approval,
budgets and invalid-call handling treat it exactly like a local tool.

Side-effect class (what the journal does after a crash left a call with an
intent and no result), decided in this order:

1. the tool's annotations, when the server is trusted
   (``trust_annotations=True``, the default) and they say anything:
   ``readOnlyHint: true`` is ``"pure"``; else ``idempotentHint: true`` is
   ``"idempotent"``; else any hint given (``readOnlyHint: false``,
   ``idempotentHint: false``, ``destructiveHint``) is ``"non_idempotent"``
   (MCP's own defaults for what was not said);
2. the server's configuration (``side_effects=``);
3. ``"non_idempotent"``.

Results (:func:`result_text`): text blocks as they are, one per line; a
structured result (``structuredContent``) as JSON when no text came with it;
an embedded text resource as its text. stepmachine has no image part yet, so
an image, audio or binary resource is named in a line
(``[image: image/png, 1,234 bytes]``) and not stored. An ``isError`` result
is an error result with the server's text (:class:`~stepmachine.ToolError`).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from stepmachine import SideEffects, ToolArgumentsError, ToolContext, ToolDefinition, ToolError

from ._mcp_link import Link, McpUnavailableError, describe_error
from ._mcp_servers import McpServer

if TYPE_CHECKING:
    from mcp.types import CallToolResult, Tool

__all__ = ["IDEMPOTENCY_META", "McpTool", "result_text", "side_effects_of"]

IDEMPOTENCY_META = "dev.stepmachine/idempotency-key"
"""The ``_meta`` key each ``tools/call`` carries the call's idempotency key under."""


def side_effects_of(tool: Tool, server: McpServer) -> SideEffects:
    """The side-effect class of ``tool`` of ``server``; see the module docs."""
    hints = tool.annotations
    if server.trust_annotations and hints is not None:
        if hints.read_only_hint is True:
            return "pure"
        if hints.idempotent_hint is True:
            return "idempotent"
        if any(
            h is not None
            for h in (hints.read_only_hint, hints.idempotent_hint, hints.destructive_hint)
        ):
            return "non_idempotent"
    configured = server.configured_side_effects(tool.name)
    return configured if configured is not None else "non_idempotent"


def _size(data: str) -> str:
    """The decoded size of base64 ``data``, for a line naming it."""
    try:
        return f"{len(base64.b64decode(data, validate=False)):,} bytes"
    except (binascii.Error, ValueError):
        return "undecodable base64"


def result_text(result: CallToolResult) -> str:
    """What the model is shown of ``result`` (see the module docs)."""
    from mcp.types import (  # noqa: PLC0415 - the extra is imported only when used
        AudioContent,
        BlobResourceContents,
        EmbeddedResource,
        ImageContent,
        ResourceLink,
        TextContent,
        TextResourceContents,
    )

    lines: list[str] = []
    texts = 0
    for block in result.content:
        if isinstance(block, TextContent):
            lines.append(block.text)
            texts += 1
        elif isinstance(block, ImageContent):
            lines.append(f"[image: {block.mime_type}, {_size(block.data)}; not shown]")
        elif isinstance(block, AudioContent):
            lines.append(f"[audio: {block.mime_type}, {_size(block.data)}; not shown]")
        elif isinstance(block, ResourceLink):
            lines.append(f"[resource link: {block.uri} ({block.name})]")
        elif isinstance(block, EmbeddedResource):
            resource = block.resource
            if isinstance(resource, TextResourceContents):
                lines.append(resource.text)
                texts += 1
            elif isinstance(resource, BlobResourceContents):
                kind = resource.mime_type or "binary"
                lines.append(
                    f"[resource {resource.uri}: {kind}, {_size(resource.blob)}; not shown]"
                )
        else:
            lines.append(f"[{getattr(block, 'type', type(block).__name__)} content; not shown]")
    if result.structured_content is not None and texts == 0:
        lines.append(msgspec.json.encode(result.structured_content).decode())
    return "\n".join(lines)


@dataclass(frozen=True, slots=True, eq=False)
class McpTool:
    """One tool of one server, as advertised this cycle.

    Attributes:
        name: the name the model calls it by (the server's, prefixed).
        remote_name: the server's name for it.
        definition: what models are shown (the server's description and
            input schema).
        side_effects: see the module docs.
        timeout: the server's per-call timeout, or ``None`` (the step's).
        link: the server's connection.
        max_result_chars: a longer result is an error result, not stored.
    """

    name: str
    remote_name: str
    definition: ToolDefinition
    side_effects: SideEffects
    timeout: float | None
    link: Link
    max_result_chars: int

    async def call(self, arguments: Any, context: ToolContext) -> str:
        """Call the tool on its server; the result as text.

        Raises:
            ToolArgumentsError: ``arguments`` is not a JSON object (the server
                validates the rest against its schema, and says so in an
                error result).
            ToolError: the server is down and did not start again, the
                connection closed during the call, the result says
                ``isError``, is not valid MCP, or is too long.

        Cancellation (the step's per-call timeout included): the SDK tells
        the server the request is cancelled; the result, if it comes, is
        dropped.
        """
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(
                f"arguments for tool {self.name!r} must be a JSON object, got "
                f"{type(arguments).__name__}"
            )
        config = self.link.server
        server = config.describe()
        meta = {IDEMPOTENCY_META: context.idempotency_key}
        try:
            result = await self.link.call(self.remote_name, arguments, meta)
        except McpUnavailableError as exc:
            raise ToolError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a server's failure is an error result
            from pydantic import ValidationError  # noqa: PLC0415 - a dependency of mcp

            if isinstance(exc, ValidationError):
                raise ToolError(
                    config.redact(
                        f"{server} answered with something that is not an MCP tool result: "
                        f"{describe_error(exc)}"
                    )
                ) from None
            message = config.redact(f"{server} failed the call: {describe_error(exc)}")
            raise ToolError(message) from None
        text = result_text(result)
        if len(text) > self.max_result_chars:
            raise ToolError(
                f"{server} returned {len(text):,} characters for {self.name!r}, more than "
                f"the {self.max_result_chars:,} allowed (max_result_chars); not stored"
            )
        if result.is_error:
            raise ToolError(text or f"{server} reported an error for {self.name!r}")
        return text
