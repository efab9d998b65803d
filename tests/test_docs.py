"""The docs site's generated pages (docs/hooks.py, run by ``mkdocs build``): one page per known failure from the
catalog, and a settings reference with every setting, so the docs cannot drift from the code; the README keeps
no link that breaks once installed. The full ``mkdocs build --strict`` is CI's (.ci/run), and runs here only where
MkDocs is installed (``pip install -e '.[docs]'``)."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.docs_hooks import docs_hooks

from pytest_llmload.plugin import fixtures as plugin_fixtures
from pytest_llmload.failures import CATALOG, REGISTRY
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.config.vocabulary import SETTINGS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hooks():
    return docs_hooks()


@pytest.fixture(scope="module")
def pages(hooks):
    return hooks.generated_pages()


@pytest.mark.parametrize("failure", CATALOG, ids=[failure.id for failure in CATALOG])
def test_every_known_failure_has_its_generated_page(failure, pages, hooks):
    page = pages[f"failures/{failure.id}.md"]
    assert page.startswith(f"# {failure.id}: ")
    # the report section as printed (raw text), and the same fields as Markdown
    assert failure.explain() in page
    for text in (failure.title, failure.root_cause, failure.occurs, failure.write_up):
        assert hooks.plain(text) in page or hooks.cell(hooks.plain(text)) in page, text
    assert hooks.linked(failure.fix, f"../{hooks.API_PAGE}") in page  # the fix, its helpers linked (tests/docs/)
    for pattern in failure.signatures:
        assert hooks.code(pattern) in page
    checks = [check for check in REGISTRY if check.failure.id == failure.id]
    for check in checks:
        assert f"### {check.name}\n\n{hooks.plain(check.summary)}" in page
    stem = failure.id.replace("-", "_")
    for home in (f"fixtures/loaders/before_{stem}.py", f"tests/failures/test_{stem}.py"):
        assert f"`{home}`" in page and f"({home} is missing)" not in page
    assert f"| [{failure.id}]({failure.id}.md) |" in pages["failures/index.md"]


def test_the_settings_reference_lists_every_setting_marker_and_fixture(pages):
    page = pages["reference/settings.md"]
    rows = [line for line in page.splitlines() if line.startswith("| `--llmload-")]
    assert len(rows) == len(SETTINGS)
    for setting, row in zip(SETTINGS, rows):
        assert row.startswith(f"| `{setting.option}`") and f"| `{setting.ini}` | `{setting.kind}` |" in row, row
        assert all(f"`{alias}`" in row for alias in setting.aliases)
    assert "`--llmload-phase-progress`" in page  # the old spelling, still accepted, is named
    for name in ("needs_gpus", "gpu", "llmload_deepspeed", "llmload_isolated", "limit_torch_memory"):
        assert re.search(rf"^- `{name}(\(.*?\))?`: ", page, re.M), name
    fixtures = [name for name, obj in vars(plugin_fixtures).items()
                if type(obj).__name__ == "FixtureFunctionDefinition" or hasattr(obj, "_pytestfixturefunction")]
    assert fixtures and all(f"\n### {name}\n" in page for name in fixtures), fixtures
    assert "`--checks` `MODULE:ATTRIBUTE`" in page  # the main job's own options, from its parser


def test_the_load_request_table_has_every_field(hooks):
    table = hooks.load_request_fields()
    assert [re.match(r"\| `(\w+)`", line).group(1) for line in table.splitlines()[2:]] == \
        [field.name for field in dataclasses.fields(LoadRequest)]
    assert hooks.FIELDS_MARK in (ROOT / "docs" / "loader-contract.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("home", ["docs/loader-contract.md", "docs/extension.md"])
def test_the_tables_written_into_the_pages_are_current(hooks, home):
    # Written into the page, not only at build time, so the page reads whole on GitHub too.
    text = (ROOT / home).read_text(encoding="utf-8")
    assert hooks.BLOCK_HOMES[home](text) == text, f"{home}'s generated table is stale: run python docs/hooks.py"


def test_the_readme_has_no_link_that_breaks_once_installed():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    relative = re.findall(r"\]\((?!https?://|#)([^)]*)\)", readme)
    assert not relative, f"README.md links {relative}: on PyPI these break; name the docs page instead"
    assert "shared/seeds" not in readme


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]'); CI builds it")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "failures" / f"{CATALOG[0].id}" / "index.html").is_file()
