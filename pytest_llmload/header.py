"""The report header: which loader is under test, the stack's versions, the GPUs. Imports nothing heavy."""

from __future__ import annotations

from importlib import metadata

from pytest_llmload import gpus
from pytest_llmload.loading import LoaderChoice

STACK = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "deepspeed")


def installed_versions(names=STACK) -> dict[str, str]:
    """``{distribution: version}`` for those installed, read from metadata without importing them."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def header_lines(choice: LoaderChoice) -> list[str]:
    versions = installed_versions()
    stack = ", ".join(f"{name} {version}" for name, version in versions.items()) or "none of the HF stack installed"
    names = gpus.gpu_names()
    gpu_line = f"{len(names)} visible ({gpus.visible_devices_label()})"
    if names:
        gpu_line += ": " + ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names))
    return [
        f"llmload: loader {choice.spec} (from {choice.source})",
        f"llmload: {stack}",
        f"llmload: GPUs {gpu_line}",
    ]
