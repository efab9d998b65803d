"""The main job's terminal: its width, read as pytest reads its own, and text broken or cut to fit it.

pytest cuts its ``-r`` summary to the terminal's width; the main job's lines fit it too, so that a CI log (80
columns where nothing says otherwise, as for pytest; ``COLUMNS=120`` for more) shows no line wider than the log.
What is cut here is whole in ``--json`` and in pytest's log.
"""

from __future__ import annotations

import os
import re

FALLBACK_COLUMNS = 80  # pytest's where nothing says the width (a pipe, a CI log), and for a width under 40
MARK = "..."  # what ends a cut text (pytest's own mark)
# Where a line may break: prose after a space (a path or a name stays whole where it fits a line); a table's
# names also after an underscore, a slash or a hyphen inside a word (an option's leading dashes stay with it).
SPACES = re.compile(r"(?<=\s)")
NAME_PARTS = re.compile(r"(?<=[\s_/])|(?<=[^\W_]-)")


def columns(out) -> int:
    """The width ``out`` is shown at: ``$COLUMNS``, else the terminal's where ``out`` is one, else 80; a width under
    40 reads as 80. (pytest's own reading, ``shutil.get_terminal_size``, asks ``sys.__stdout__``: here it is
    ``out``, the stream the main job prints to.)"""
    try:
        width = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        try:
            width = os.get_terminal_size(out.fileno()).columns
        except (AttributeError, OSError, ValueError):  # not a terminal (a pipe, a file, a StringIO)
            width = FALLBACK_COLUMNS
    return width if width >= 40 else FALLBACK_COLUMNS


def wrap(text: str, width: int, indent: str = "", breaks: re.Pattern = SPACES) -> list[str]:
    """``text`` (one line) in lines of at most ``width`` characters, each after the first starting with
    ``indent``; broken where ``breaks`` allows (:data:`SPACES`, :data:`NAME_PARTS`), inside a word only where the
    word is longer than a line. Nothing is dropped but the spaces at the breaks."""
    indent = indent if len(indent) < width // 2 else ""
    lines: list[str] = []
    line = ""
    for piece in breaks.split(text):
        while piece:
            if len(line) + len(piece.rstrip()) <= width:
                line += piece
                piece = ""
                if not line.strip():  # (leading spaces: at most half a line of them, so that a word has room)
                    line = line[: width // 2]
            elif line.strip():  # this line has words: the piece starts the next one
                lines.append(line.rstrip())
                line, piece = indent, piece.lstrip()
            else:  # a piece longer than a whole line: cut inside it
                room = width - len(line)
                lines.append(line + piece[:room])
                line, piece = indent, piece[room:]
    if line.strip() or not lines:
        lines.append(line.rstrip())
    return lines


def wrapped(text: str, width: int, indent: str = "    ") -> str:
    """Every line of ``text`` wrapped (:func:`wrap`), each continued under its own indentation plus ``indent``."""
    out = []
    for line in text.split("\n"):
        own = line[: len(line) - len(line.lstrip())]
        out += wrap(line, width, own + indent)
    return "\n".join(out)


def cut(text: str, width: int) -> str:
    """``text`` as it is where it fits in ``width`` characters, else its start and ``...``."""
    return text if len(text) <= width else text[: width - len(MARK)].rstrip() + MARK


def at_most(lines: list[str], count: int, width: int) -> tuple[list[str], bool]:
    """The first ``count`` of ``lines``, the last ending with ``...`` where lines were left out; and whether any
    were."""
    if len(lines) <= count:
        return lines, False
    return lines[: count - 1] + [lines[count - 1][: width - len(MARK)].rstrip() + MARK], True
