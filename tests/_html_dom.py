"""A small DOM built with the standard library's ``html.parser``, for the HTML tests.

``parse(document)`` gives the root :class:`Node`; a node has its ``tag``,
``attrs`` (a dict), ``children`` (nodes and text strings) and helpers to
find elements and read text the way a browser's ``textContent`` does.
Character references are resolved (``&lt;`` reads ``<``), so a test compares
against the stored text itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from html.parser import HTMLParser

VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
)


class Node:
    """An element: tag, attributes, children (``Node`` or ``str``)."""

    def __init__(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tag = tag
        self.attrs = attrs
        self.children: list[Node | str] = []

    def iter(self) -> Iterator[Node]:
        """This element and every element inside it, in document order."""
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.iter()

    def find_all(self, tag: str | None = None, css: str | None = None) -> list[Node]:
        """The elements with this tag and/or class."""
        return [
            node
            for node in self.iter()
            if (tag is None or node.tag == tag) and (css is None or css in node.classes)
        ]

    def by_id(self, ident: str) -> Node:
        """The element with ``id=ident``; ``KeyError`` if there is none."""
        for node in self.iter():
            if node.attrs.get("id") == ident:
                return node
        raise KeyError(ident)

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def text(self, *, skip: frozenset[str] = frozenset({"script", "style"})) -> str:
        """The text inside, like ``textContent`` without script and style."""
        pieces: list[str] = []

        def walk(node: Node) -> None:
            for child in node.children:
                if isinstance(child, str):
                    pieces.append(child)
                elif child.tag not in skip:
                    walk(child)

        walk(self)
        return "".join(pieces)


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return
        raise AssertionError(f"end tag </{tag}> without a start tag")

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(document: str) -> Node:
    """The document as a tree; every element must be closed (no implied end tags)."""
    builder = _Builder()
    builder.feed(document)
    builder.close()
    open_tags = [node.tag for node in builder.stack[1:]]
    assert open_tags == [], f"unclosed elements: {open_tags}"
    return builder.root
