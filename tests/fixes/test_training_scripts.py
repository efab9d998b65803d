"""pytest_llmload.fixes.training_scripts: the fixes the checks recommend, importable by a training script without a test framework."""

import subprocess
import sys

import pytest

from pytest_llmload.fixes import training_scripts as fixes


def test_importing_the_fixes_pulls_in_neither_pytest_nor_hypothesis_nor_the_plugin():
    # The process is the subject here: what a fresh interpreter has imported after `import pytest_llmload.fixes.training_scripts`.
    code = ("import sys, pytest_llmload.fixes.training_scripts as f; f.prepare_training_args_for_placed_model; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest', 'hypothesis', 'torch') "
            "or m in ('pytest_llmload.plugin.hooks', 'pytest_llmload.failures')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("environ", "deepspeed", "expected"), [
    ({}, False, "auto"),
    ({"LOCAL_RANK": "-1"}, False, "auto"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, False, {"": "cuda:1"}),
    ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, False, {"": "cuda:0"}),  # torchrun --nproc-per-node 1
    ({}, True, {"": "cuda:0"}),
])
def test_device_map_for_rank_pins_a_rank_to_its_own_device(environ, deepspeed, expected):
    assert fixes.device_map_for_rank(environ, deepspeed=deepspeed) == expected


def test_device_map_for_rank_on_cpu_ranks_and_a_bad_variable():
    assert fixes.device_map_for_rank({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, device="cpu") == {"": "cpu"}
    with pytest.raises(ValueError, match=r"LOCAL_RANK='x' is not an integer"):
        fixes.device_map_for_rank({"LOCAL_RANK": "x"})


def test_the_checks_and_the_reference_loader_use_the_one_definition():
    from pytest_llmload.failures import distributed_device_map

    assert distributed_device_map.local_rank is fixes.local_rank
