"""Images and documents: an agent that reads a photo and a PDF, then calls a tool about them.

    python examples/vision.py [--db PATH] [--backend asyncio|trio]

The user sends a picture (a small PNG made here) and an invoice (a one-page
PDF made here) with their question, as an :class:`~stepmachine.ImagePart` and
a :class:`~stepmachine.DocumentPart` of one message. The agent looks the
invoice up with the ``lookup_invoice`` tool and answers. The session is
stored in SQLite (``demo-data/vision.sqlite3`` by default), the image and the
PDF with it.

With no provider configured the model is the testing kit's scripted model --
no network, no API key -- and the example says so. With one configured, the
real model sees the image and the PDF: ``GEMINI_API_KEY`` (or
``GOOGLE_API_KEY``) for Gemini, ``ANTHROPIC_API_KEY`` for Anthropic,
``OPENAI_API_KEY`` for OpenAI (Chat Completions; ``STEPMACHINE_OPENAI_API=responses``
for the Responses API), ``OPENAI_COMPATIBLE_BASE_URL`` for an OpenAI-compatible
server; ``STEPMACHINE_MODEL`` names the model.
"""

from __future__ import annotations

import argparse
import struct
import time
import zlib
from pathlib import Path
from typing import Literal

import anyio
from hello_world import choose_model, print_message  # the example beside this one

from stepmachine import (
    DocumentPart,
    ImagePart,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    Tools,
    tool,
)
from stepmachine.providers import HTTPModel
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

INVOICES = {"INV-42": "paid on 2026-11-20, 120.00 EUR, by bank transfer"}


@tool
def lookup_invoice(number: str) -> str:
    """Look an invoice up by its number (e.g. INV-42): its status."""
    return INVOICES.get(number, f"no invoice {number}")


def png(width: int = 8, height: int = 8, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A small solid-colour PNG, made here so the example needs no file."""
    row = b"\x00" + bytes(rgb) * width
    raw = row * height

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def pdf(text: str) -> bytes:
    """A one-page PDF showing ``text``, made here so the example needs no file."""
    stream = f"BT /F1 18 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        (
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>"
        ),
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def scripted_model() -> ScriptedModel:
    """The stand-in model: looks the invoice up, then answers."""
    return ScriptedModel(
        [
            call(("lookup_invoice", {"number": "INV-42"}), text="The PDF is invoice INV-42."),
            reply("The photo is a red square; invoice INV-42 (120 EUR) was paid on 2026-11-20."),
        ],
        name="scripted (no provider configured)",
    )


async def main(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    model = choose_model(fallback=scripted_model)
    print(f"model: {model.name}")
    print(f"store: SQLite at {db}")
    try:
        async with await SQLiteStore.open(db) as store:
            session_id = f"vision-{time.time_ns()}"
            question = Message.user(
                "What is in the photo, and has this invoice been paid?",
                id="u1",
                media=[
                    ImagePart(media_type="image/png", data=png()),
                    DocumentPart(
                        media_type="application/pdf",
                        data=pdf("Invoice INV-42: 120.00 EUR"),
                        title="invoice.pdf",
                    ),
                ],
            )
            await store.create(session_id, conversation=[question])
            steps = [Tools([lookup_invoice]), ModelInference(instructions="Be brief.")]
            report = await StateMachine(steps).run_report(
                Runtime(store=store, model=model), session_id
            )
            stored = await store.load(session_id)  # the image and the PDF, read back
            print(f"image and PDF stored intact: {stored.conversation[0] == question}")
            revision = report.session.revision
            print(f"session {session_id}: {report.reason.kind} at revision {revision}\n")
            for message in report.session.conversation:
                print_message(message)
    finally:
        if isinstance(model, HTTPModel):
            await model.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("demo-data") / "vision.sqlite3")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    anyio.run(main, args.db, backend=backend)
