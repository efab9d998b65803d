"""Summarise JUnit XML files from pytest runs of the version matrix.

    python .ci/matrix_report.py newest=.venv-ci/newest/junit.xml hf-4.56=.venv-ci/hf-4.56/junit.xml
    python .ci/matrix_report.py --regressions py=py.xml hf457=hf457.xml ...

Prints one line of counts per env and a closing line summing them ("ci: N passed, N failed, N skipped");
with ``--regressions``, also each regression test that did not pass in every env, its outcome per env with
its skip or xfail reason, as a Markdown table: what docs/version_matrix.md's "counts per env" section is filled from.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

REGRESSIONS = "tests.failures."  # one module per known failure


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, reason) from one JUnit file; outcome is passed/failed/error/skipped/xfailed."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, reason = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, reason = ("xfailed" if xfail else "skipped"), child.get("message", "")
        found[test] = (outcome, reason)
    return found


def counts_line(name: str, found: dict) -> str:
    c = Counter(outcome for outcome, _ in found.values())
    shown = ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped", "xfailed") if c[k])
    return f"{name}: {len(found)} tests: {shown}"


def regression_table(runs: dict[str, dict]) -> list[str]:
    """The regression tests that did not pass in every env, an outcome (and its reason) per env."""
    tests = sorted({t for found in runs.values() for t in found if t.startswith(REGRESSIONS)})
    everywhere = [t for t in tests if all(found.get(t, ("",))[0] == "passed" for found in runs.values())]
    lines = [f"{len(everywhere)} of {len(tests)} regression tests passed in every env; the others:", "",
             "| test | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for test in (t for t in tests if t not in everywhere):
        cells = []
        for found in runs.values():
            outcome, reason = found.get(test, ("not collected", ""))
            reason = reason.replace("|", "\\|").replace("\n", " ")
            cells.append(outcome if outcome in ("passed", "not collected") else f"{outcome}: {reason[:160]}")
        lines.append(f"| `{test[len(REGRESSIONS):]}` | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> int:
    show_regressions = "--regressions" in argv
    runs = {}
    for arg in (a for a in argv if a != "--regressions"):
        name, sep, path = arg.partition("=")
        if not sep:
            name, path = arg, arg
        try:
            runs[name] = outcomes(path)
        except (OSError, ET.ParseError) as exc:
            print(f"{name}: no readable JUnit XML at {path} ({exc}); counted as nothing")
            runs[name] = {}
    for name, found in runs.items():
        print(counts_line(name, found))
    if show_regressions:
        print("\n".join(regression_table(runs)))
    total = Counter(outcome for found in runs.values() for outcome, _ in found.values())
    # xfails are skips to JUnit and to the CI line; errors are failures.
    print(f"ci: {total['passed']} passed, {total['failed'] + total['error']} failed, "
          f"{total['skipped'] + total['xfailed']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
