"""The hooks pytest-llmload calls, for a conftest.py or another plugin to implement (registered through
``pytest_addhooks``, as pytest-xdist's ``newhooks.py``)."""

import pytest


@pytest.hookspec
def pytest_llmload_check_result(item: pytest.Item, check, result: dict) -> None:
    """Called once for each check or prediction row, in the process that ran it (an xdist worker included), with
    its ``result``, the row's fields (:class:`pytest_llmload.reports.row.Row`): ``check`` (the row's name), ``verdict``
    (passed, failed, predicted, error, not exercised, not applicable, skipped, xfailed, xpassed), ``failure`` (the
    known failure observed or predicted, else ``None``), ``guards`` (the failure the check guards against),
    ``cause`` (for an error: loader, contract, model, hang, died, check), ``loader`` (the loader that ran),
    ``sentence`` (the whole reason), ``notes`` (how the check judged; ``note``: them joined) and ``fix``. ``check``
    is the :class:`~pytest_llmload.checks.base.Check` (or the prediction scenario) itself."""
