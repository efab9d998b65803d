"""pytest-llmload: catch the ways Hugging Face model loading breaks when a model is spread over devices.

Importing this package is cheap: pytest imports it on every run through the plugin entry point, so its
public names are resolved on first use (PEP 562), and torch and the Hugging Face stack are imported only
by the code that loads a model.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "LoadRequest": "pytest_llmload.request",
    "LoadResult": "pytest_llmload.loading",
    "LoaderContractError": "pytest_llmload.loading",
    "LoaderSpecError": "pytest_llmload.loading",
    "call_loader": "pytest_llmload.loading",
    # Writing a repo's own check (docs: the extension API): its records, the premise layer, the skip for a check
    # whose scenario did not happen.
    "Check": "pytest_llmload.failures.base",
    "KnownFailure": "pytest_llmload.failures.base",
    "not_exercised": "pytest_llmload.failures.base",
    "contract": "pytest_llmload.failures",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pytest_llmload' has no attribute {name!r}")
