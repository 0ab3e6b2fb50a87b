"""One MCP tool as the ``Tools`` step runs it: definition, side-effect class, call, result.

:class:`McpTool` is a :class:`~stepmachine.ToolLike`: the journal, approval,
budgets and invalid-call handling treat it exactly like a local tool.

Side-effect class (what the journal does after a crash left a call with an
intent and no result), decided in this order:

1. the tool's annotations, only when the server is trusted
   (``trust_annotations=True``; not the default: annotations are the
   server's hints, and by default they never lower a tool's class) and
   they say anything:
   ``readOnlyHint: true`` is ``"pure"``; else ``idempotentHint: true`` is
   ``"idempotent"``; else any hint given (``readOnlyHint: false``,
   ``idempotentHint: false``, ``destructiveHint``) is ``"non_idempotent"``
   (MCP's own defaults for what was not said);
2. the server's configuration (``side_effects=``);
3. ``"non_idempotent"``.

Results (:func:`result_output`): text blocks as they are, one per line; a
structured result (``structuredContent``) as JSON when no text came with it;
an embedded text resource as its text. An image block, and an embedded blob
resource that is an image (PNG, JPEG, GIF or WebP: what every provider takes),
a PDF (``application/pdf``) or a text file (``text/...``), become an
:class:`~stepmachine.ImagePart` or a :class:`~stepmachine.DocumentPart` stored
after the result in its ``tool`` message (:class:`~stepmachine.ToolOutput`);
when no text came with them, the result's text is one line per part saying it
follows (``[image follows: image/png, 1,234 bytes]``). What a result cannot
carry -- audio, other images (SVG, BMP...), other binary resources, base64
that does not decode, empty data -- is named in a line (``[audio: audio/wav,
1,234 bytes; not shown]``) and not stored. An ``isError`` result is an error
result with the server's text (:class:`~stepmachine.ToolError`), its media
named in lines, not stored. The server's configured secrets (its ``env=``
values, its headers; see ``McpServer.redact``) are replaced by
``[redacted]`` in every result's text, text documents and document titles
(an embedded resource's URI), and in every error; and in what the catalog
shows the model of each tool (:func:`redacted_schema`, and the description).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from stepmachine import (
    DocumentPart,
    ImagePart,
    InvalidFieldError,
    SideEffects,
    ToolArgumentsError,
    ToolContext,
    ToolDefinition,
    ToolError,
    ToolOutput,
)

from ._mcp_link import Link, McpUnavailableError, describe_error
from ._mcp_servers import McpServer

if TYPE_CHECKING:
    from mcp.types import CallToolResult, Tool

__all__ = [
    "IDEMPOTENCY_META",
    "MAX_SCHEMA_DEPTH",
    "McpTool",
    "redacted",
    "redacted_schema",
    "result_output",
    "result_text",
    "side_effects_of",
]

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


def _decoded(data: str) -> bytes | None:
    """The bytes of base64 ``data``, or ``None`` when it does not decode."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None


def _size(data: bytes | None) -> str:
    """A decoded size, for a line naming what is not shown."""
    return "undecodable base64" if data is None else f"{len(data):,} bytes"


_SENDABLE_IMAGES = frozenset(("image/png", "image/jpeg", "image/gif", "image/webp"))
"""The image types every provider takes; others (SVG, BMP, TIFF) are named in a line."""


def _media(
    kind: type[ImagePart | DocumentPart], mime_type: str, data: bytes | None, title: str | None
) -> ImagePart | DocumentPart | None:
    """A media part for decoded ``data``, or ``None`` when it is none (a media type of
    another kind, undecodable base64)."""
    if data is None:
        return None
    try:
        if kind is ImagePart:
            if mime_type.lower() not in _SENDABLE_IMAGES:
                return None  # an image no provider takes would break every later request
            return ImagePart(media_type=mime_type, data=data)
        return DocumentPart(media_type=mime_type, data=data, title=title)
    except InvalidFieldError:
        return None


def _not_shown(part: ImagePart | DocumentPart) -> str:
    kind = "image" if isinstance(part, ImagePart) else "document"
    return f"[{kind}: {part.media_type}, {_size(part.data)}; not shown]"


def result_output(result: CallToolResult) -> ToolOutput:
    """What the model is shown of ``result``: its text and the images and documents it
    carries (see the module docs)."""
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
    media: list[ImagePart | DocumentPart] = []
    texts = 0
    for block in result.content:
        if isinstance(block, TextContent):
            lines.append(block.text)
            texts += 1
        elif isinstance(block, ImageContent):
            data = _decoded(block.data)
            part = _media(ImagePart, block.mime_type, data, None)
            if part is not None:
                media.append(part)
            else:
                lines.append(f"[image: {block.mime_type}, {_size(data)}; not shown]")
        elif isinstance(block, AudioContent):
            lines.append(f"[audio: {block.mime_type}, {_size(_decoded(block.data))}; not shown]")
        elif isinstance(block, ResourceLink):
            lines.append(f"[resource link: {block.uri} ({block.name})]")
        elif isinstance(block, EmbeddedResource):
            resource = block.resource
            if isinstance(resource, TextResourceContents):
                lines.append(resource.text)
                texts += 1
            elif isinstance(resource, BlobResourceContents):
                mime = resource.mime_type or ""
                data = _decoded(resource.blob)
                kind = ImagePart if mime.startswith("image/") else DocumentPart
                document = mime == "application/pdf" or mime.startswith("text/")
                part = None
                if kind is ImagePart or document:
                    part = _media(kind, mime, data, str(resource.uri))
                if part is not None:
                    media.append(part)
                else:
                    kind_name = mime or "binary"
                    lines.append(
                        f"[resource {resource.uri}: {kind_name}, {_size(data)}; not shown]"
                    )
        else:
            lines.append(f"[{getattr(block, 'type', type(block).__name__)} content; not shown]")
    if result.structured_content is not None and texts == 0:
        lines.append(msgspec.json.encode(result.structured_content).decode())
    return ToolOutput("\n".join(lines), tuple(media))


def result_text(result: CallToolResult) -> str:
    """The text of :func:`result_output`: what the result says, the lines naming its
    images and documents when no text came with them."""
    return result_output(result).content


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

    async def call(self, arguments: Any, context: ToolContext) -> str | ToolOutput:
        """Call the tool on its server; the result as text, or a
        :class:`~stepmachine.ToolOutput` when it carries images or documents.

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
        output = result_output(result)
        text = output.content
        if len(text) > self.max_result_chars:
            raise ToolError(
                f"{server} returned {len(text):,} characters for {self.name!r}, more than "
                f"the {self.max_result_chars:,} allowed (max_result_chars); not stored"
            )
        output = redacted(output, config)
        text = output.content
        if result.is_error:
            # An error result carries no media: name them in lines instead.
            lines = [output.text] if output.text else []
            lines.extend(map(_not_shown, output.media))
            raise ToolError("\n".join(lines) or f"{server} reported an error for {self.name!r}")
        return output if output.media else text


def redacted(output: ToolOutput, server: McpServer) -> ToolOutput:
    """``output`` with ``server``'s configured secrets (see ``McpServer.redact``) replaced
    by ``[redacted]``: in its text, in every document's title (an embedded
    resource's URI, which the line naming the document repeats), and in the
    documents that are text (``text/...``).

    A server that echoes its environment or the headers it was sent (a token)
    cannot put them into a stored result. The bytes of images and PDFs are
    left as they are.
    """
    text = server.redact(output.text)
    media: list[ImagePart | DocumentPart] = []
    changed = text != output.text
    for part in output.media:
        kept = part
        if isinstance(part, DocumentPart):
            changes: dict[str, Any] = {}
            if part.title:
                title = server.redact(part.title)
                if title != part.title:
                    changes["title"] = title
            if part.data is not None and part.media_type.lower().startswith("text/"):
                said = part.data.decode("utf-8", errors="replace")
                cleaned = server.redact(said)
                if cleaned != said:
                    changes["data"] = cleaned.encode()
            if changes:
                kept = msgspec.structs.replace(part, **changes)
                changed = True
        media.append(kept)
    return ToolOutput(text, tuple(media)) if changed else output


MAX_SCHEMA_DEPTH = 100
"""How deeply :func:`redacted_schema` walks a tool's input schema; a deeper one is
not advertised (no real schema nests that far, and the walk stays bounded)."""


def redacted_schema(schema: Any, server: McpServer) -> Any:
    """A copy of ``schema`` (a tool's input schema, decoded JSON) with ``server``'s
    configured secrets replaced by ``[redacted]`` in every string in it, keys
    included (descriptions, titles, examples, enum values, defaults).

    Returns ``schema`` itself when the server has no secrets. The walk visits
    each node once and goes at most :data:`MAX_SCHEMA_DEPTH` levels deep (so
    it never meets Python's recursion limit); the schema's size is bounded by
    the message size limit of the server's connection. Done once per listing
    (the catalog is kept until a server's list changes).

    Raises:
        ValueError: ``schema`` nests deeper than :data:`MAX_SCHEMA_DEPTH`
            (the caller leaves the tool out and says so).
    """
    if not server.longest_secret():
        return schema

    def walk(value: Any, depth: int) -> Any:
        if isinstance(value, str):
            return server.redact(value)
        if isinstance(value, dict | list):
            if depth >= MAX_SCHEMA_DEPTH:
                raise ValueError(f"its input schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            if isinstance(value, list):
                return [walk(item, depth + 1) for item in value]
            return {
                (server.redact(k) if isinstance(k, str) else k): walk(v, depth + 1)
                for k, v in value.items()
            }
        return value

    return walk(schema, 0)
