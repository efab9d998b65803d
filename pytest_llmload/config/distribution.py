"""The installed distribution, read from its metadata (``importlib.metadata``) so that what the tool prints cannot drift
from pyproject.toml: its version, its project URLs (where to report a bug), its extras (what each installs, whether
that is here, what it serves) and the stack this release was tested with.

A copy of the package that is not installed (a checkout put on ``sys.path``) reads the checkout's pyproject.toml
instead. Nothing is read before it is asked for: pytest imports this layer on every run.
"""

from __future__ import annotations

import functools
import re
import textwrap
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional

DISTRIBUTION = "pytest-llmload"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The versions the newest stack of the version matrix pinned when this release was tested: a copy of
# constraints/newest.txt shipped as package data (tests/test_release.py keeps it the same).
TESTED_CONSTRAINTS = PACKAGE_ROOT / "configs" / "tested-constraints.txt"
# What an extra serves that no check declares (a check names the extras it needs: Check.extras). The extras that
# neither a check nor this names (test, docs) are this repository's own, and no table lists them.
SERVES_BESIDES_CHECKS = {"report": "the pictures of `--llmload-html` (device maps, memory per phase)"}
# Every check needs this one; a check's `extras` name what it needs besides.
BASE_EXTRA = "hf"
# The one address in the package that is not this project's (those come from the metadata): a field report
# ("owner/repo#123", as the catalog cites them) on its own tracker.
FIELD_REPORT_URL = "https://github.com/{repo}/issues/{number}"


# --- the metadata, or the checkout's pyproject.toml -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _metadata() -> Optional[Any]:
    from importlib import metadata

    try:
        return metadata.metadata(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _pyproject() -> dict:
    """The checkout's pyproject.toml beside the package (``{}`` where there is none: an unpacked wheel, say)."""
    import tomllib

    path = PACKAGE_ROOT.parent / "pyproject.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if data.get("project", {}).get("name") == DISTRIBUTION else {}


def version() -> str:
    """This copy's version: the installed metadata's (set from the git tag when it was built), else the version a
    build without git metadata gets (pyproject.toml's ``fallback_version``)."""
    found = _metadata()
    if found is not None:
        return found["Version"]
    return _pyproject().get("tool", {}).get("setuptools_scm", {}).get("fallback_version", "0+unknown")


def project_urls() -> dict[str, str]:
    """``[project.urls]``: label -> URL."""
    found = _metadata()
    if found is not None:
        return dict(entry.split(", ", 1) for entry in found.get_all("Project-URL") or () if ", " in entry)
    return dict(_pyproject().get("project", {}).get("urls", {}))


def project_url(label: str) -> Optional[str]:
    """The project URL labelled ``label`` (compared as PEP 753 normalizes labels: ``Issues``, ``issues``)."""
    wanted = _normalized_label(label)
    return next((url for name, url in project_urls().items() if _normalized_label(name) == wanted), None)


def _normalized_label(label: str) -> str:
    return re.sub(r"[\s\W_]", "", label).lower()


def bug_report_address() -> str:
    """Where to report a bug in pytest-llmload: the Issues URL of its metadata."""
    return project_url("Issues") or f"the issue tracker of {DISTRIBUTION} (its project page)"


# --- the extras ------------------------------------------------------------------------------------------------------

class Requirement(NamedTuple):
    name: str  # a distribution, or this one's extras (``pytest-llmload[hf,quant]``)
    extras: tuple[str, ...]  # where ``name`` is this distribution: the extras it includes


@functools.lru_cache(maxsize=None)
def extras() -> dict[str, tuple[Requirement, ...]]:
    """Each extra, in pyproject.toml's order, and what it requires."""
    found = _metadata()
    if found is not None:
        from packaging.requirements import Requirement as Parsed

        by_extra: dict[str, list[Requirement]] = {name: [] for name in found.get_all("Provides-Extra") or ()}
        for line in found.get_all("Requires-Dist") or ():
            parsed = Parsed(line)
            for extra in by_extra:
                if parsed.marker is not None and parsed.marker.evaluate({"extra": extra}):
                    by_extra[extra].append(Requirement(parsed.name, tuple(sorted(parsed.extras))))
        return {extra: tuple(requirements) for extra, requirements in by_extra.items()}
    declared = _pyproject().get("project", {}).get("optional-dependencies", {})
    return {extra: tuple(_parse_plain(line) for line in lines) for extra, lines in declared.items()}


def _parse_plain(line: str) -> Requirement:
    """``name[a,b]>=1`` without packaging (a checkout's pyproject.toml, where the metadata is not there)."""
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", line)
    return Requirement(match.group(1), tuple(sorted(e.strip() for e in (match.group(2) or "").split(",") if e.strip())))


def _is_this(name: str) -> bool:
    return re.sub(r"[-_.]+", "-", name).lower() == DISTRIBUTION


def installs(extra: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What ``extra`` installs: ``(other extras it includes, distributions of its own)``."""
    included, own = [], []
    for requirement in extras().get(extra, ()):
        if _is_this(requirement.name):
            included += requirement.extras
        else:
            own.append(requirement.name)
    return tuple(name for name in extras() if name in included), tuple(own)


def distributions(extra: str) -> tuple[str, ...]:
    """Every distribution ``extra`` installs, through the extras it includes too."""
    included, own = installs(extra)
    return tuple(dict.fromkeys([*own, *(name for other in included for name in distributions(other))]))


def install_command(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def is_installed(name: str) -> bool:
    """Whether distribution ``name`` is here: its metadata, or a module of its name (a copy on ``sys.path``)."""
    import importlib.util
    from importlib import metadata

    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        pass
    try:
        return importlib.util.find_spec(re.sub(r"[-.]+", "_", name).lower()) is not None
    except (ImportError, ValueError):
        return False


def missing_extra_reason(extra: str) -> Optional[str]:
    """Why what needs ``extra`` cannot run here (``"deepspeed is not installed; needs pip install
    'pytest-llmload[deepspeed]'"``), or ``None`` when all it installs is here."""
    missing = [name for name in distributions(extra) if not is_installed(name)]
    if not missing:
        return None
    return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; needs {install_command(extra)}"


def _serves(checks: Iterable[Any]) -> dict[str, list[str]]:
    """Extra -> what it serves: the checks that declare it (``Check.extras``), or :data:`SERVES_BESIDES_CHECKS`; the
    base extra serves every check; an extra that only includes others serves what they do. In pyproject.toml's order."""
    checks = list(checks)
    needed = {extra for check in checks for extra in check.extras}
    unknown = needed - set(extras())
    if unknown:
        raise ValueError(f"checks declare extras {sorted(unknown)} that {DISTRIBUTION} does not have; its extras: "
                         f"{', '.join(extras())}")
    served: dict[str, list[str]] = {}
    for extra in extras():
        if extra == BASE_EXTRA:
            served[extra] = ["every check"]
        elif extra in needed:
            served[extra] = [f"`{check.name}` ({check.failure.id})" for check in checks if extra in check.extras]
        elif extra in SERVES_BESIDES_CHECKS:
            served[extra] = [SERVES_BESIDES_CHECKS[extra]]
    for extra in extras():
        included, own = installs(extra)
        if extra not in served and included and not own and set(included) <= set(served):
            served[extra] = ["every check" if BASE_EXTRA in included else ", ".join(included)]
    return {extra: served[extra] for extra in extras() if extra in served}


def extras_table(checks: Iterable[Any], width: Optional[int] = None) -> str:
    """Which extra to install for which check: a Markdown table, or with ``width`` the terminal's text (the main
    job's ``--help``). ``checks``: :class:`~pytest_llmload.checks.base.Check` records."""
    rows = []
    for extra, serves in _serves(checks).items():
        included, own = installs(extra)
        named = [f"`[{e}]`" if width is None else f"[{e}]" for e in included]
        rows.append((extra, ", ".join(serves), ", ".join([*named, *own])))
    if width is None:
        lines = ["| extra | what needs it | installs |", "|---|---|---|"]
        return "\n".join(lines + [f"| `{extra}` | {serves} | {what} |" for extra, serves, what in rows])
    lines = textwrap.wrap(f"Extras: {install_command('EXTRA')}. A check whose extra is missing skips, naming it.",
                          width=width, break_on_hyphens=False)
    column = max(len(extra) for extra, _, _ in rows) + 4
    for extra, serves, what in rows:
        text = f"{serves.replace('`', '')}; installs {what}"
        lines += textwrap.wrap(text, width=max(width, column + 20), initial_indent=f"  {extra}".ljust(column),
                               subsequent_indent=" " * column, break_on_hyphens=False)
    return "\n".join(lines)


# --- the tested stack ------------------------------------------------------------------------------------------------

def tested_constraints() -> str:
    """The pins of the stack this release was tested with, as a pip constraints file for a user's own repo."""
    pins = [line for line in TESTED_CONSTRAINTS.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    header = [
        f"# The stack {DISTRIBUTION} {version()} was tested with (python -m pytest_llmload --print-constraints).",
        f"# Use it as your constraints file: pip install -c constraints.txt '{DISTRIBUTION}[hf]'",
        "# torch: on a runner without GPUs, install its CPU build of this version first (PyTorch's CPU index);",
        "# from the default index pip pulls the CUDA build and several GB of packages.",
    ]
    return "\n".join(header + pins) + "\n"
