"""pytest-llmload: catch the ways Hugging Face model loading breaks when a model is spread over devices.

Importing this package is cheap: pytest imports it on every run through the plugin entry point, so its
public names are resolved on first use (PEP 562), and torch and the Hugging Face stack are imported only
by the code that loads a model.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "LoadRequest": "pytest_llmload.loader.request",
    "LoadResult": "pytest_llmload.loader.seam",
    "LoaderContractError": "pytest_llmload.loader.seam",
    "LoaderSpecError": "pytest_llmload.loader.seam",
    "call_loader": "pytest_llmload.loader.seam",
    # Writing a repo's own check (docs: the extension API): its records, the premise layer, the skip for a check
    # whose scenario did not happen.
    "Check": "pytest_llmload.checks.base",
    "KnownFailure": "pytest_llmload.checks.base",
    "not_exercised": "pytest_llmload.checks.base",
    "contract": "pytest_llmload.checks",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name == "__version__":  # the installed distribution's (set from the git tag), read on first use
        from pytest_llmload.config.distribution import version

        return version()
    if name in _PUBLIC:
        home = importlib.import_module(_PUBLIC[name])
        # a module of the package (``contract``) or a name in one
        return getattr(home, name) if hasattr(home, name) else importlib.import_module(f"{home.__name__}.{name}")
    raise AttributeError(f"module 'pytest_llmload' has no attribute {name!r}")
