"""The import paths modules had before the package was arranged in folders by layer (issue 37), kept working.

``import pytest_llmload.request`` (or ``from pytest_llmload import loading``) gives the module at its new home, the
same module object, so that code and ``monkeypatch.setattr("pytest_llmload.gpus....")`` written against the old
path act on the one module. Installed by the package's ``__init__``; nothing here imports more than importlib.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old path -> new path, both under pytest_llmload.
OLD_TO_NEW = {
    "surface": "config.vocabulary",
    "settings": "config.settings",
    "keys": "config.stash_keys",
    "gpus": "system.gpus",
    "offline": "system.offline",
    "sizes": "system.sizes",
    "jsonl": "system.json_lines",
    "diagnostics.phases": "instruments.phases",
    "diagnostics.memory_probe": "instruments.memory_probe",
    "diagnostics.device_map_summary": "instruments.device_map_summary",
    "probes": "instruments.probes",
    "request": "loader.request",
    "loading": "loader.seam",
    "tiny_models": "loader.tiny_models",
    "transformers_compat": "loader.transformers_compat",
    "trainer_guard": "fixes.trainer_guard",
    "memory": "fixes.training_memory",
    "reference_loader": "fixes.reference_loader",
    "prediction.planner": "placement.planner",
    "prediction.architectures": "placement.architectures",
    "prediction.profiles": "placement.profiles",
    "failures.base": "checks.base",
    "failures.contract": "checks.contract",
    "scenarios": "checks.ground_truth",
    "row": "reports.row",
    "failures.verdict": "reports.verdict",
    "diagnostics.report": "reports.sections",
    "diagnostics.html_report": "reports.html_report",
    "diagnostics.known_failures": "reports.known_failures",
    "progress": "reports.progress",
    "fixtures": "plugin.fixtures",
    "markers": "plugin.markers",
    "header": "reports.header",
    "hookspecs": "plugin.hookspecs",
    "per_test": "plugin.phase_state",
    "hung_loader": "plugin.loader_hang",
    "extensions": "plugin.check_registry",
    "conformance": "plugin.parametrize",
    "diagnostics.memory_limit": "plugin.memory_limit",
    "runners.isolated_marker": "plugin.isolated_marker",
    "runners.launched_env": "plugin.launched_env",
    "runners.xdist_gpus": "plugin.xdist_gpus",
    "runners.lanes": "plugin.lanes",
    "diagnostics": "instruments",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path (the module object itself, not a copy)."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        if prefix != "pytest_llmload" or rest not in OLD_TO_NEW:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module("pytest_llmload." + OLD_TO_NEW[spec.name.partition(".")[2]])

    def exec_module(self, module):
        pass  # already executed at its new path


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder, which would load a second copy from the new folder
