"""Predictions for the runner profiles the run names (``--llmload-runner``, ``--llmload-model`` or the ini keys):
each scenario, as the loader under test would meet it there. Collected only when a runner is named."""

import pytest

from pytest_llmload.config.stash_keys import prediction_key, prediction_record_key


def pytest_generate_tests(metafunc):
    if "check" in metafunc.fixturenames:
        from pytest_llmload.prediction.predict import scenarios

        runners, _ = metafunc.config.stash[prediction_key]
        metafunc.parametrize(("check", "runner"), [pytest.param(scenario, runner, id=f"{scenario.name}@{runner.name}")
                                                   for runner in runners for scenario in scenarios()])


def test_prediction(check, runner, llmload_loader, llmload_checkpoint, tmp_path, request):
    from pytest_llmload.checks import contract

    model_name, config = request.config.stash[prediction_key][1]
    if runner.devices < check.needs_gpus:
        pytest.skip(f"not applicable: {runner.name} has {runner.devices} GPU(s); {check.name} needs "
                    f"{check.needs_gpus}")
    declared = check.inapplicable_reason(llmload_loader)  # what the repo declares, as a check honours it
    if declared is not None:
        pytest.skip(declared)
    from pytest_llmload.prediction.predict import PredictedFailure

    try:
        prediction = check.function(llmload_loader, runner, config, model_name, tmp_path, llmload_checkpoint)
    except PredictedFailure as predicted:  # where the model would go travels with the row, failing or not
        if predicted.prediction is not None:
            request.node.stash[prediction_record_key] = predicted.prediction
        raise
    request.node.stash[prediction_record_key] = prediction.record()
    contract.note(f"PREDICTED: {prediction.summary()}")
