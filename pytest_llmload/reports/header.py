"""The report header: which loader is under test, the stack's versions, the GPUs. Imports nothing heavy."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib import metadata

from pytest_llmload.system import gpus
from pytest_llmload.fixes.reference_loader import chosen_loader

STACK = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "deepspeed")


def _dist_info_versions() -> dict[str, str]:
    """Versions from ``*.dist-info`` directory names: one listdir per sys.path entry, no metadata parsing."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and "-" in name:
                project, _, version = name[: -len(".dist-info")].partition("-")
                found.setdefault(project.lower().replace("_", "-"), version)
    return found


def installed_versions(names=STACK) -> dict[str, str]:
    """``{distribution: version}`` for those installed, without importing them (plugin load must stay cheap)."""
    scanned = _dist_info_versions()
    versions = {}
    for name in names:
        if name in scanned:
            versions[name] = scanned[name]
            continue
        try:  # egg-info and other layouts: ask importlib.metadata
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def header_lines(config, loaders: Sequence[tuple[str, str]] = ()) -> list[str]:
    """One line: ``llmload: loader <spec> (from <source>); torch 2.13.0, ...; GPUs 0 visible (CUDA_VISIBLE_DEVICES
    unset)``. The loader is the one the run chose (option, ini key, environment, else the reference loader), or
    ``loaders``, ``(name, source)`` pairs, where the collected checks run their own
    (``parametrize_with_loader_checks``)."""
    if loaders:
        names = list(dict.fromkeys(name for name, _ in loaders))
        sources = " and ".join(dict.fromkeys(source for _, source in loaders))
        loader = f"loader{'s' if len(names) > 1 else ''} {', '.join(names)} (from {sources})"
    else:
        choice = chosen_loader(config)
        loader = f"loader {choice.spec} (from {choice.source})"
    versions = installed_versions()
    stack = ", ".join(f"{name} {version}" for name, version in versions.items()) or "none of the HF stack installed"
    names = gpus.gpu_names()
    gpu_part = f"{len(names)} visible ({gpus.visible_devices_label()})"
    if names:
        gpu_part += ": " + ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names))
    return [f"llmload: {loader}; {stack}; GPUs {gpu_part}"]
