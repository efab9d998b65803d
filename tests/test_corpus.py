"""The checks against loaders adapted from public projects (fixtures/corpus, docs/corpus.md): every (loader, check)
cell gives the verdict judged from the project's own code. A false alarm on one of these is the worst defect the
plugin can ship; a pass that exercised nothing, the second worst."""

import pytest

from importlib import metadata

from packaging.specifiers import SpecifierSet

from fixtures.corpus.expected import BY_VERSION, EXPECTED, TOOL_WRONG
from fixtures.warm_runs import warm_forks  # noqa: F401  (a fixture: the checks' children start warm)
from pytest_llmload.plugin.parametrize import all_checks
from pytest_llmload.reports import verdict

CHECKS = {check.name: check for check in all_checks()}
TRANSFORMERS = metadata.version("transformers")


def _expected(spec: str, name: str, verdict: str, why: str) -> tuple[str, str]:
    versions, there, reason = BY_VERSION.get((spec, name), (None, verdict, why))
    if versions is not None and SpecifierSet(versions).contains(TRANSFORMERS):
        return there, f"transformers {TRANSFORMERS}: {reason}"
    return verdict, why


def _marks(spec: str, name: str) -> list:
    wrong = TOOL_WRONG.get((spec, name))
    return [pytest.mark.xfail(strict=True, reason=f"tool wrong (docs/corpus.md): {wrong}")] if wrong else []


CELLS = [pytest.param(spec, name, *_expected(spec, name, judged, why), marks=_marks(spec, name),
                      id=f"{spec.split('.')[2].split(':')[0]}-{name}")
         for spec, row in EXPECTED.items() for name, (judged, why) in row.items()]

# Every cell's check runs in children forked from this process: warm_forks does once, here, what each of them would
# redo (fixtures/warm_runs.py); the cells and their verdicts are the same.
pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(240), pytest.mark.usefixtures("warm_forks")]


def _verdict(check, loader, checkpoint, workdir) -> tuple[str, str]:
    """The cell as the plugin reports it: the one verdict of reports.verdict (a check's own crash is an error
    whose cause is "check", which no cell expects)."""
    try:
        check(loader, checkpoint, workdir)
    except pytest.skip.Exception as exc:
        return "skip", str(exc)
    except Exception as exc:  # noqa: BLE001 - judged by the plugin's own verdict
        judged = verdict.of_exception(exc, check.failure)
        kind = {"failed": "fail"}.get(judged.kind, judged.kind)
        if judged.cause == "check":
            kind = "check broke"
        return kind, judged.sentence
    return "pass", ""


@pytest.mark.parametrize(("spec", "check_name", "verdict", "why"), CELLS)
def test_each_check_says_what_the_projects_code_says(spec, check_name, verdict, why, llmload_checkpoint, tmp_path):
    from pytest_llmload.loader.seam import LoaderChoice, as_loader_under_test, import_loader

    loader = as_loader_under_test(import_loader(LoaderChoice(spec, "fixtures/corpus")), name=spec)
    got, detail = _verdict(CHECKS[check_name], loader, llmload_checkpoint, tmp_path)
    assert got == verdict, f"{spec} {check_name}: expected {verdict} ({why}), got {got}: {detail[:600]}"
