"""Predictions for the runner profiles the run names (``--llmload-runner``, ``--llmload-model`` or the ini keys):
each scenario, as the loader under test would meet it there. Collected only when a runner is named.

Which PREDICTED rows fail the run is the repo's to say (:mod:`pytest_llmload.prediction.gating`): the runner/model
pairs it gates on (``llmload_gate_runners``) and the rows it expects (``llmload_expected_predictions``, xfails)."""

import pytest

from pytest_llmload.config.stash_keys import prediction_key, prediction_record_key

gating_key = pytest.StashKey["object"]()  # the run's Gating, read once at collection


def _gating(config: pytest.Config):
    """The repo's gating, read from its settings; a bad entry is a usage error naming it."""
    from pytest_llmload.config import settings
    from pytest_llmload.plugin.parametrize import parse_expected_failures
    from pytest_llmload.prediction.gating import Gating, GatingError, expected_rows, gated_pairs
    from pytest_llmload.prediction.predict import scenarios

    pairs, expected = settings.given(config, "gate_runners"), settings.given(config, "expected_predictions")
    run = tuple(runner.name for runner in config.stash[prediction_key][0])
    try:
        return Gating(gated_pairs(*pairs, run) if pairs else (), expected_rows(
            parse_expected_failures(*expected), [s.name for s in scenarios()], expected[1], run) if expected else {})
    except GatingError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_generate_tests(metafunc):
    if "check" in metafunc.fixturenames:
        from pytest_llmload.prediction.predict import PredictedFailure, scenarios

        runners, (model_name, _) = metafunc.config.stash[prediction_key]
        gating = metafunc.config.stash[gating_key] = _gating(metafunc.config)

        def marks(scenario, runner) -> list:
            reason = gating.expected_reason(scenario.name, runner.name)
            return [] if reason is None else [pytest.mark.xfail(reason=reason, raises=PredictedFailure,
                                                                strict=gating.gates(runner.name, model_name))]

        metafunc.parametrize(("check", "runner"), [pytest.param(scenario, runner, id=f"{scenario.name}@{runner.name}",
                                                                marks=marks(scenario, runner))
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
    from pytest_llmload.prediction.predict import PredictedFailure, bare_record

    # whether a PREDICTED row fails the run travels with the row (the plugin and the main job read it there)
    gated = {"gated": request.config.stash[gating_key].gates(runner.name, model_name)}
    try:
        prediction = check.function(llmload_loader, runner, config, model_name, tmp_path, llmload_checkpoint)
    except PredictedFailure as predicted:  # where the model would go travels with the row, failing or not
        request.node.stash[prediction_record_key] = {**(predicted.prediction or bare_record(
            check.name, runner.name, model_name, predicted.failure, str(predicted))), **gated}
        raise
    request.node.stash[prediction_record_key] = {**prediction.record(), **gated}
    contract.note(f"PREDICTED: {prediction.summary()}")
