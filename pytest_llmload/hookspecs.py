"""The hooks pytest-llmload calls, for a conftest.py or another plugin to implement (registered through
``pytest_addhooks``, as pytest-xdist's ``newhooks.py``)."""

import pytest


@pytest.hookspec
def pytest_llmload_check_result(item: pytest.Item, check, result: dict) -> None:
    """Called once for each check or prediction row, in the process that ran it (an xdist worker included), with
    its ``result``: ``check`` (the row's name), ``verdict`` (passed, failed, predicted, error, not exercised,
    skipped), ``failure`` (the known failure observed or predicted, else ``None``), ``guards`` (the failure the
    check guards against), ``cause`` (for an error: loader, contract, model, hang, died, check), ``loader``,
    ``note`` and ``sentence``. ``check`` is the :class:`~pytest_llmload.failures.base.Check` (or the prediction
    scenario) itself."""
