"""pytest-llmload: catch the ways Hugging Face model loading breaks when a model is spread over devices.

Importing this package is cheap: torch and the Hugging Face stack are imported only by the code that
loads a model.
"""

from pytest_llmload.loading import LoaderContractError, LoaderSpecError, LoadResult, call_loader
from pytest_llmload.request import LoadRequest

__version__ = "0.1.0"
__all__ = ["LoadRequest", "LoadResult", "LoaderContractError", "LoaderSpecError", "call_loader", "__version__"]
