"""The runner a prediction simulates in this process (pytest_llmload.prediction.simulated_machine): it never starts a
real process group nor compiles an op (issue 49 point 6).

Before: a prediction of a launcher job on 2 GPUs whose loader started the job's process group itself (accelerate's
``Accelerator()``, DeepSpeed's ``init_distributed``) compiled DeepSpeed's shared-memory op for minutes, then waited on
port 29500 for ranks that never come, deaf to SIGTERM and SIGINT. Each case runs in an isolated child, so that the
code before the fix fails at the child's deadline instead of hanging this run."""

import pytest

from pytest_llmload.placement import architectures, profiles
from pytest_llmload.prediction import predict
from pytest_llmload.runners.isolation import run_isolated

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _imported_before_the_children_fork():
    """What the prediction imports (the stack, peft), here once: each child inherits it instead of importing it."""
    from pytest_llmload.runners.preload import preload_for_isolated_checks

    preload_for_isolated_checks()


def starts_a_process_group(request):
    import torch.distributed as dist

    dist.init_process_group("gloo")  # what Accelerator() and deepspeed.init_distributed come to under torchrun


def compiles_an_op(request):
    from torch.utils.cpp_extension import load

    load("llmload_never_built", ["never.cpp"])  # what DeepSpeed's CPU backend does for its shared-memory op


for loader in (starts_a_process_group, compiles_an_op):
    loader.llmload_purposes = ("train",)


def _predict_zero3_on_two_gpus(loader, workdir):
    profile, config = profiles.load_profile("2xH100-80GB"), architectures.load_config("llama-3-8b")
    return predict.predict_zero3(loader, profile, config, "llama-3-8b", workdir)


@pytest.mark.parametrize(("loader", "what", "line"), [
    (starts_a_process_group, "torch.distributed.init_process_group", 'dist.init_process_group("gloo")'),
    (compiles_an_op, "an op compiled by torch.utils.cpp_extension.load", 'load("llmload_never_built"')])
def test_a_prediction_starts_no_rendezvous_and_compiles_nothing(loader, what, line, tmp_path):
    with pytest.raises(pytest.skip.Exception) as skipped:
        run_isolated(_predict_zero3_on_two_gpus, (loader, tmp_path), timeout=60, label="the prediction")
    reason = str(skipped.value)
    lineno = next(n for n, text in enumerate(open(__file__).read().splitlines(), 1) if text.strip().startswith(line))
    assert reason.startswith(f"not exercised: the loader starts the job's process group itself ({what} at "
                             f"{loader.__name__} ({__file__}:{lineno})): a prediction runs one rank"), reason
