"""Ready to publish: the version from git tags (setuptools-scm, with a fallback for a tree without git metadata), the
project's URLs declared once in pyproject.toml, a changelog, and a release workflow that builds, checks, tests the
wheel outside the checkout and publishes on a tag (docs/ci.md, "Releasing pytest-llmload")."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = "https://github.com/pytest-llmload/pytest-llmload"


def test_the_version_comes_from_git_tags_with_a_fallback():
    assert "version" not in PYPROJECT["project"] and PYPROJECT["project"]["dynamic"] == ["version"]
    assert any(r.startswith("setuptools-scm") for r in PYPROJECT["build-system"]["requires"])
    fallback = PYPROJECT["tool"]["setuptools_scm"]["fallback_version"]
    from packaging.version import Version

    assert Version(fallback).is_devrelease  # a build without git metadata never passes for a release


def test_the_project_urls_are_declared_once():
    urls = PYPROJECT["project"]["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Issues", "Changelog"}
    assert all(url.startswith(PROJECT) for url in urls.values()) and urls["Homepage"] == PROJECT
    # nowhere else in what is shipped: the package reads them from its metadata (tests/config/test_distribution.py)
    assert not [p for p in (ROOT / "pytest_llmload").rglob("*.py") if PROJECT in p.read_text(encoding="utf-8")]


def test_the_changelog_keeps_an_unreleased_section_and_ships_in_the_sdist():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert changelog.startswith("# Changelog\n") and "Keep a Changelog" in changelog
    assert "\n## [Unreleased]\n" in changelog and "\n### Added\n" in changelog
    assert PYPROJECT["project"]["urls"]["Changelog"].endswith("/CHANGELOG.md")
    assert "include CHANGELOG.md" in (ROOT / "MANIFEST.in").read_text().splitlines()


def _workflow() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the workflow (installed with the docs and test extras)")
    workflow = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    workflow["on"] = workflow.pop(True, workflow.get("on"))  # (YAML 1.1 reads the key `on` as true)
    return workflow


def _runs(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_every_package_folder_ships_in_the_wheel():
    """setuptools ships only the packages pyproject.toml lists: a folder added to the package and not listed there is
    missing from every user's install (the `commands` layer of `python -m pytest_llmload run` once was)."""
    folders = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "pytest_llmload").rglob("__init__.py")}
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert folders <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(folders - listed)}"


def test_the_release_workflow_builds_checks_tests_the_wheel_outside_and_publishes_on_a_tag():
    workflow = _workflow()
    assert workflow["on"] == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"] == {"contents": "read"}  # only the publishing job gets more
    build, test, publish = (workflow["jobs"][name] for name in ("build", "test-wheel", "publish"))

    checkout = next(step for step in build["steps"] if step.get("uses", "").startswith("actions/checkout"))
    assert checkout["with"]["fetch-depth"] == 0  # the tags setuptools-scm reads
    assert "python -m build --outdir dist ." in _runs(build)
    assert "python -m twine check --strict dist/*" in _runs(build)
    assert "GITHUB_REF_NAME#v" in _runs(build)  # the wheel's version is the tag's

    assert test["needs"] == "build"
    assert '"$RUNNER_TEMP/venv/bin/python" -m pip install -c constraints-cpu.txt "$(ls dist/*.whl)[all]"' in _runs(test)
    outside = [step for step in test["steps"] if step.get("working-directory") == "${{ runner.temp }}"]
    runs = [step["run"] for step in outside]
    assert "venv/bin/python -m pytest_llmload" in runs
    assert any(run.startswith("venv/bin/python -m pytest --pyargs pytest_llmload.suite") for run in runs)
    assert any("--print-constraints" in run and "__version__" in run for run in runs)

    assert publish["needs"] == ["build", "test-wheel"]
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi"
    assert [step.get("uses") for step in publish["steps"]][-1] == "pypa/gh-action-pypi-publish@release/v1"
    assert not any("password" in step.get("with", {}) for step in publish["steps"])  # trusted publishing: no token


def test_docs_ci_describes_the_release():
    text = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    section = text[text.index("## Releasing pytest-llmload"):]
    for words in (".github/workflows/release.yml", "twine check --strict", "outside the checkout",
                  "python -m pytest_llmload", "pytest --pyargs pytest_llmload.suite", "trusted publishing",
                  "id-token: write", "fallback_version"):
        assert words in section, words


def _metadata_of(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(name).decode())
        files = archive.namelist()
    return {"version": message["Version"], "urls": message.get_all("Project-URL"),
            "content_type": message["Description-Content-Type"], "files": files}


@pytest.fixture(scope="module")
def build_wheel(tmp_path_factory):
    """``build_wheel(source, into)``: the wheel pyproject.toml's build backend builds from ``source``, as ``pip wheel``
    and ``python -m build`` do in an isolated environment: the build requirements installed once for this module's
    builds (pip installed them again for each), then the backend called in an interpreter that sees only them and the
    standard library (``-S``: not this environment's site-packages, whose setuptools plugins could change a build)."""
    requirements = tmp_path_factory.mktemp("build-requirements")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(requirements),
                           *PYPROJECT["build-system"]["requires"]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    backend = PYPROJECT["build-system"]["build-backend"]

    def build(source: Path, into: Path) -> Path:
        into.mkdir(exist_ok=True)
        call = f"import sys; sys.path.insert(0, sys.argv[1]); import {backend}; {backend}.build_wheel(sys.argv[2])"
        done = subprocess.run([sys.executable, "-S", "-c", call, str(requirements), str(into)], cwd=source,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (wheel,) = into.glob("pytest_llmload-*.whl")
        return wheel

    return build


def _head_is_tagged() -> bool:
    return subprocess.run(["git", "describe", "--exact-match", "--tags", "--match", "v*"], cwd=ROOT,
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_wheel_built_from_the_clone_carries_the_git_version_the_urls_and_passes_twine_check(build_wheel, tmp_path):
    wheel = build_wheel(ROOT, tmp_path)
    found = _metadata_of(wheel)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:  # (a copy of the tree without its git metadata)
        assert found["version"] == PYPROJECT["tool"]["setuptools_scm"]["fallback_version"]
    elif not _head_is_tagged():
        assert f"+g{head.stdout.strip()}" in found["version"] and ".dev" in found["version"], found["version"]
    assert sorted(found["urls"]) == sorted(f"{label}, {url}" for label, url in PYPROJECT["project"]["urls"].items())
    assert found["content_type"] == "text/markdown"
    assert "pytest_llmload/configs/tested-constraints.txt" in found["files"]
    if importlib.util.find_spec("twine") is None:
        pytest.skip("twine is not installed here (CI's wheel step and the release workflow run twine check --strict)")
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_a_tree_without_git_metadata_builds_its_fallback_version(build_wheel, tmp_path):
    # As a downloaded zip of the repository: the package and what its build reads, no .git.
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "pytest_llmload", tree / "pytest_llmload", ignore=shutil.ignore_patterns("__pycache__"))
    wheel = build_wheel(tree, tmp_path / "wheel")
    assert _metadata_of(wheel)["version"] == PYPROJECT["tool"]["setuptools_scm"]["fallback_version"]
