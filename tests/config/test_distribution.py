"""The installed distribution's metadata is the one source of what the tool prints about itself: its version, where to
report a bug, and which extra a check needs (a check whose extra is missing skips, naming the pip command)."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

import pytest_llmload
from pytest_llmload.config import distribution
from pytest_llmload.failures import REGISTRY, distributed_device_map, dp_dtype, quantized_cast, zero3_device_map

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_metadata(monkeypatch):
    """As if the package were not installed: a checkout on sys.path."""
    monkeypatch.setattr(distribution, "_metadata", lambda: None)
    distribution.extras.cache_clear()
    yield
    distribution.extras.cache_clear()


def test_the_version_is_the_installed_distributions():
    assert pytest_llmload.__version__ == metadata.version("pytest-llmload") == distribution.version()
    from pytest_llmload import __version__  # (the from-import form too)

    assert __version__ == pytest_llmload.__version__


def test_the_version_follows_the_metadata_and_falls_back_to_pyprojects_fallback_version(monkeypatch, no_metadata):
    import tomllib

    fallback = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools_scm"]["fallback_version"]
    assert pytest_llmload.__version__ == fallback
    monkeypatch.setattr(distribution, "_metadata", lambda: {"Version": "9.8.7"})
    assert pytest_llmload.__version__ == "9.8.7"


def test_no_url_is_written_in_the_package():
    # Every URL of this project the tool prints comes from the metadata ([project.urls] in pyproject.toml, declared
    # there once); the only other address is the template of a field report's own tracker, declared once.
    template = f"FIELD_REPORT_URL = {distribution.FIELD_REPORT_URL!r}".replace("'", '"')
    written = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "pytest_llmload").rglob("*.py"))
               for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
               if re.search(r"https?://", line) and line != template]
    assert not written, written


def test_a_crash_of_a_check_asks_for_a_report_at_the_metadatas_issues_url(monkeypatch):
    from pytest_llmload.checks import judgement

    issues = metadata.metadata("pytest-llmload").get_all("Project-URL")
    assert any(entry.startswith("Issues, https://") for entry in issues), issues
    monkeypatch.setattr(distribution, "project_urls", lambda: {"issues": "https://tracker.invalid/llmload"})
    try:
        raise KeyError("boom")
    except KeyError as exc:
        sentence = judgement.check_broke(exc).sentence
    assert sentence.endswith("please report it with this traceback: https://tracker.invalid/llmload"), sentence


def test_without_metadata_the_checkouts_pyproject_gives_the_urls_and_extras(no_metadata):
    assert distribution.project_url("Issues").endswith("/issues")
    assert distribution.distributions("quant") == ("bitsandbytes",)
    assert "deepspeed" in distribution.distributions("all")
    assert distribution.installs("all") == (("hf", "quant", "deepspeed"), ())


def test_nothing_at_all_still_says_where_to_report(monkeypatch, no_metadata):
    monkeypatch.setattr(distribution, "_pyproject", lambda: {})
    assert distribution.bug_report_address() == "the issue tracker of pytest-llmload (its project page)"
    assert distribution.version() == "0+unknown"


def test_every_extra_a_check_declares_exists_and_the_table_says_which_serves_which():
    table = distribution.extras_table(REGISTRY)
    rows = {re.match(r"\| `(\w+)`", line).group(1): line for line in table.splitlines()[2:]}
    assert list(rows) == ["hf", "quant", "deepspeed", "report", "all"]  # not the repo's own test and docs extras
    assert "| every check |" in rows["hf"] and "torch" in rows["hf"]
    for check in REGISTRY:
        for extra in check.extras:
            assert f"`{check.name}` ({check.failure.id})" in rows[extra]
    assert {check.name for check in REGISTRY if check.extras} == {
        "check_trainer_does_not_wrap_placed_model", "check_quantized_request_keeps_dtype",
        "check_distributed_train_step", "check_zero3_load"}
    assert "--llmload-html" in rows["report"] and "matplotlib" in rows["report"]
    assert rows["all"].endswith("| every check | `[hf]`, `[quant]`, `[deepspeed]` |")
    with pytest.raises(ValueError, match=r"checks declare extras \['gpu'\]"):
        distribution.extras_table([REGISTRY[0]._replace(extras=("gpu",))])


def test_the_terminal_table_fits_its_width():
    text = distribution.extras_table(REGISTRY, width=78)
    assert max(len(line) for line in text.splitlines()) <= 78, text
    assert "pip install 'pytest-llmload[EXTRA]'" in text and "  deepspeed  check_distributed_train_step" in text


def _loader(request):  # never called: the checks skip first
    raise AssertionError("the loader was called")


@pytest.mark.parametrize("check, extra, distribution_name", [
    (zero3_device_map.CHECK, "deepspeed", "deepspeed"),
    (distributed_device_map.CHECK, "deepspeed", "deepspeed"),
    (quantized_cast.CHECK, "quant", "bitsandbytes"),
    (dp_dtype.CHECK, "quant", "bitsandbytes"),
], ids=lambda value: getattr(value, "name", None))
def test_a_check_whose_extra_is_missing_skips_naming_the_extra(check, extra, distribution_name, monkeypatch, tmp_path):
    monkeypatch.setattr(distribution, "is_installed", lambda name: name != distribution_name)
    expected = f"{check.name}: {distribution_name} is not installed; needs pip install 'pytest-llmload[{extra}]'"
    with pytest.raises(pytest.skip.Exception) as skipped:
        check(_loader, tmp_path, tmp_path)
    assert str(skipped.value) == expected
    assert check.missing_extra_reason() == expected
    monkeypatch.setattr(distribution, "is_installed", lambda name: True)
    assert check.missing_extra_reason() is None


@pytest.mark.parametrize("function, words", [
    (zero3_device_map.check_zero3_load, ""),
    (distributed_device_map.check_distributed_train_step, " for mode 'deepspeed'; pass modes=('ddp',)"),
    (quantized_cast.check_quantized_request_keeps_dtype, "; no quantized load exercised"),
])
def test_the_check_functions_called_directly_skip_the_same_way(function, words, monkeypatch, tmp_path):
    monkeypatch.setattr(distribution, "is_installed", lambda name: name not in ("deepspeed", "bitsandbytes"))
    with pytest.raises(pytest.skip.Exception, match=re.escape(f"is not installed; needs pip install 'pytest-llmload[")
                       ) as skipped:
        function(_loader, tmp_path, tmp_path)
    assert words in str(skipped.value)


def test_an_installed_distribution_is_found_by_its_metadata_or_its_module(monkeypatch, tmp_path):
    assert distribution.is_installed("pytest") and distribution.is_installed("huggingface-hub")
    assert not distribution.is_installed("source-copy-llmload")
    # a copy on sys.path without metadata (a source checkout of DeepSpeed, say) counts
    (tmp_path / "source_copy_llmload").mkdir()
    (tmp_path / "source_copy_llmload" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert distribution.is_installed("source-copy-llmload")
