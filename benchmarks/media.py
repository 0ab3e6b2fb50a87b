"""What a token estimate of hostile media costs: bounded work per part, whatever the bytes.

Forged parts of ``--mib`` MiB (20 by default: the stores' default
``max_media_bytes``), each measured side by side in one run:

* a JPEG of endless fill bytes, of endless standalone markers, and of endless
  empty segments: :func:`stepmachine.media_tokens` now, and the same walk
  without a bound on its steps (the reader as it was before issue 22, kept
  here as the "before" reference);
* a WAV of endless empty chunks, and a PDF with no page object (the search is
  bounded to its first 8 MiB);
* the session index rebuilt over a conversation holding three forged JPEGs
  (what a load, ``show`` or ``export`` does once per session).

Medians of ``--repeat`` runs after a warm-up, in milliseconds. Run from the
repository root against an installed ``stepmachine``:
``python benchmarks/media.py`` (``--quick``: 1 MiB parts, one repetition).
The last line is ``name=value`` figures; nothing here is a test threshold.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from stepmachine import AudioPart, DocumentPart, ImagePart, Message
from stepmachine.extend import media_tokens
from stepmachine.operations import estimate_tokens

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def unbounded_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The JPEG walk before issue 22: one Python step per fill byte or marker, no bound."""
    if not data.startswith(b"\xff\xd8"):
        return None
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):
            at += 2
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if marker in _SOF:
            return int.from_bytes(data[at + 7 : at + 9], "big"), int.from_bytes(
                data[at + 5 : at + 7], "big"
            )
        if length < 2:
            return None
        at += 2 + length
    return None


def median_ms(work: Callable[[], object], repeat: int) -> float:
    """The median wall time of ``work()`` in milliseconds, after one warm-up run."""
    work()
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        work()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=20, help="size of each forged part")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 MiB parts, one repetition")
    args = parser.parse_args()
    size = 1024 * 1024 * (1 if args.quick else args.mib)
    repeat = 1 if args.quick else args.repeat

    jpegs = {
        "fill bytes": b"\xff\xd8" + b"\xff" * size,
        "standalone markers": b"\xff\xd8" + b"\xff\xd0" * (size // 2),
        "empty segments": b"\xff\xd8" + b"\xff\xe0\x00\x02" * (size // 4),
    }
    print(f"forged parts of {size / 1024 / 1024:.0f} MiB, median of {repeat} (ms)")
    print(f"{'part':32} {'now':>10} {'unbounded':>10}")
    now_fill = before_fill = 0.0
    for name, data in jpegs.items():
        part = ImagePart(media_type="image/jpeg", data=data)
        now = median_ms(lambda part=part: media_tokens(part), repeat)
        before = median_ms(lambda data=data: unbounded_jpeg_size(data), repeat)
        if name == "fill bytes":
            now_fill, before_fill = now, before
        print(f"{'JPEG, ' + name:32} {now:10.2f} {before:10.1f}")
    wav = AudioPart(
        media_type="audio/wav", data=b"RIFF\0\0\0\0WAVE" + b"junk\0\0\0\0" * (size // 8)
    )
    pdf = DocumentPart(media_type="application/pdf", data=b"%PDF-1.7\n" + b"x" * size)
    print(f"{'WAV, empty chunks':32} {median_ms(lambda: media_tokens(wav), repeat):10.2f}")
    print(f"{'PDF, no page object':32} {median_ms(lambda: media_tokens(pdf), repeat):10.2f}")
    images = [
        ImagePart(media_type="image/jpeg", data=jpegs["fill bytes"] + bytes([n])) for n in range(3)
    ]
    conversation = [Message.user("look", id="u", media=images)]
    index = median_ms(lambda: estimate_tokens(conversation), repeat)
    print(f"{'index of three forged JPEGs':32} {index:10.2f}")
    print(
        f"forged_jpeg_ms={now_fill:.3f} unbounded_jpeg_ms={before_fill:.1f} "
        f"three_images_index_ms={index:.3f}"
    )


if __name__ == "__main__":
    main()
