"""Every row speaks the user's words: no internal id ("seed 003") and no bare figures ("136 -> 68") in what a check
says. Read from the source of the checks and failures (their string literals, never comments), so a new row text
is held to it too.

Before (issue 46): dp-dtype's row began "seed 003 (DataParallel over a placed model)" and ended "(the write-up's
136 -> 68)".
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_llmload"
SPOKEN = sorted(path for folder in ("failures", "checks", "prediction", "reports", "loader")
                for path in (PACKAGE / folder).glob("*.py"))
INTERNAL_ID = re.compile(r"\bseed \d{3}\b")  # a write-up's id as this project files it
BARE_FIGURES = re.compile(r"\b\d+ -> \d+\b")  # two numbers and an arrow: what changed into what, unsaid


def _literals(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
    return found


@pytest.mark.parametrize("path", SPOKEN, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_no_internal_id_or_bare_figures_in_what_a_row_says(path):
    said = [f"{path.name}:{line}: {text!r}" for line, text in _literals(path)
            if INTERNAL_ID.search(text) or BARE_FIGURES.search(text)]
    assert not said, "\n".join(said)
