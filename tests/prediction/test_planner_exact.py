"""The planner against from_pretrained's own map (issue 38), on whatever stack runs the tests.

from_pretrained's map is taken from from_pretrained itself (:mod:`fixtures.from_pretrained_map`: the real
``from_pretrained`` on a config + header-only checkpoint, on the runner's simulated devices, stopped once it has
placed the model), with none of the planner's code in its path. Every shipped architecture x GPU profile x
strategy, with the profile's capacities as ``max_memory`` and with none (from_pretrained's own headroom); and
4-bit (bitsandbytes, as write-up 003 and the dp-dtype check load) with ``auto``, where the quantizer's own check
may refuse the map.

To stay fast, the test takes a covering subset of that grid: every architecture on every profile once, and every
pair of architecture, profile, strategy and budget in some cell (:data:`CELLS`, checked below); the 4-bit cells
likewise. benchmarks/bench_planner_exact.py compares the full grid (448 cells), calling from_pretrained for each.
Here a from_pretrained call (it builds its model, 0.1-0.8 s) runs once per architecture, strategy, budget and
quantization, on one of the profiles (each has its turn); for the other profiles its ``_get_device_map`` is called
again with the arguments from_pretrained gave it, the strategy and ``max_memory`` (which from_pretrained hands over
as the caller passed them: checked) being the cell's.
"""

from __future__ import annotations

import threading
from collections import Counter
from itertools import combinations
from typing import Callable

import pytest

from fixtures import from_pretrained_map as own_map
from pytest_llmload.placement import architectures, profiles
from pytest_llmload.placement.simulated_devices import Machine, simulated

ARCHITECTURES = architectures.shipped_names()
GPU_PROFILES = [name for name in profiles.shipped_names() if profiles.load_profile(name).devices]
STRATEGIES = ("auto", "balanced", "sequential")



def _covering(arch: int, runner: int) -> tuple[str, str]:
    """The strategy and budget of the cell of architecture ``arch`` on profile ``runner`` (indices): the strategy
    turns with both, the budget with the architecture and the strategy, so that every pair of the four is in some
    cell while each architecture needs from_pretrained for 3 of its 6 strategy x budget calls."""
    strategy = (arch + runner) % len(STRATEGIES)
    return STRATEGIES[strategy], own_map.BUDGETS[(arch + strategy) % len(own_map.BUDGETS)]


# Grouped by from_pretrained's call (architecture, strategy, budget): the `taken` fixture keeps only its latest.
GRID = sorted(((arch, *_covering(a, r), runner) for a, arch in enumerate(ARCHITECTURES)
               for r, runner in enumerate(GPU_PROFILES)),
              key=lambda cell: (cell[0], STRATEGIES.index(cell[1]), own_map.BUDGETS.index(cell[2])))
FOUR_BIT_GRID = sorted((arch, own_map.BUDGETS[(a + r) % len(own_map.BUDGETS)], runner)
                       for a, arch in enumerate(ARCHITECTURES) for r, runner in enumerate(GPU_PROFILES))
CELLS = [pytest.param(*cell, id="{}-{}-{}@{}".format(*cell)) for cell in GRID]
FOUR_BIT_CELLS = [pytest.param(*cell, id="{}-4bit-auto-{}@{}".format(*cell)) for cell in FOUR_BIT_GRID]


def test_the_table_covers_eight_architectures_and_every_gpu_profile():
    assert len(ARCHITECTURES) >= 8 and len(GPU_PROFILES) >= 7


def test_the_cells_cover_every_pair_of_architecture_profile_strategy_and_budget():
    values = (ARCHITECTURES, STRATEGIES, own_map.BUDGETS, GPU_PROFILES)
    for grid, factors in (([cell.values for cell in CELLS], (0, 1, 2, 3)),
                          ([cell.values for cell in FOUR_BIT_CELLS], (0, 2, 3))):
        for first, second in combinations(range(len(factors)), 2):
            pairs = {(cell[first], cell[second]) for cell in grid}
            wanted = len(values[factors[first]]) * len(values[factors[second]])
            assert len(pairs) == wanted, (factors[first], factors[second])


@pytest.fixture(scope="module")
def taken(tmp_path_factory) -> Callable[..., tuple[str, own_map.Taken]]:
    """``taken(arch, strategy, budget, quantization_config=None)``: the runner it was taken on and from_pretrained's
    own call. Only the latest call is kept (the cells come in its order): each holds the model from_pretrained
    built, and models kept alive side by side leave the heap too fragmented to reuse (on 4.56, whose
    ``init_empty_weights`` allocates each weight on the host before moving it to meta, tens of GiB of address
    space, past which this process can no longer fork)."""
    checkpoints: dict = {}
    calls: dict = {}

    def take(arch: str, strategy: str, budget: str, quantization_config=None) -> tuple[str, own_map.Taken]:
        if arch not in checkpoints:
            checkpoints[arch] = own_map.checkpoint_for(arch, tmp_path_factory.mktemp(arch))
        key = (arch, strategy, budget, quantization_config is not None)
        if key not in calls:
            calls.clear()
            turn = ARCHITECTURES.index(arch) + STRATEGIES.index(strategy) * 2 + own_map.BUDGETS.index(budget)
            runner = GPU_PROFILES[(turn + 3 * key[3]) % len(GPU_PROFILES)]
            profile = profiles.load_profile(runner)
            calls[key] = runner, own_map.take(checkpoints[arch], strategy, own_map.budget_of(profile, budget),
                                              own_map.machine_of(profile), quantization_config)
        return calls[key]

    return take


def _compare(taken, arch: str, strategy: str, budget: str, runner: str, quantization_config=None) -> None:
    profile = profiles.load_profile(runner)
    taken_on, call = taken(arch, strategy, budget, quantization_config)
    max_memory = own_map.budget_of(profile, budget)
    expected = (call.decided if taken_on == runner
                else call.again(strategy, max_memory, own_map.machine_of(profile)))
    got = own_map.predicted(arch, strategy, max_memory, profile, quantization_config)
    assert got == expected, own_map.differences(expected, got)


@pytest.mark.parametrize(("arch", "strategy", "budget", "runner"), CELLS)
def test_the_plan_is_from_pretrained_s_own_map(arch, strategy, budget, runner, taken):
    _compare(taken, arch, strategy, budget, runner)


@pytest.fixture(scope="module")
def four_bit():
    pytest.importorskip("bitsandbytes")
    return own_map.four_bit()


@pytest.mark.parametrize(("arch", "budget", "runner"), FOUR_BIT_CELLS)
def test_a_4bit_plan_is_from_pretrained_s_own_map_or_its_refusal(arch, budget, runner, taken, four_bit):
    """The quantizer that prepared the empty model is the one that plans it (a fresh one, on transformers 4.56,
    counts the lm_head it leaves unquantized as 4-bit: Llama-3-8B then differed in 4 of 36 entries over 2 GPUs,
    the dp-dtype check's runner, and 11 of 36 over 8)."""
    _compare(taken, arch, "auto", budget, runner, four_bit)


def test_without_max_memory_a_70b_keeps_from_pretrained_s_headroom_on_one_h100(taken):
    """The issue's case: Llama-3-70B, device_map="auto" and no max_memory on 1xH100: from_pretrained keeps a tenth
    of the card free and puts 42 of the 80 layers there, with the embeddings 43 of the map's 84 entries (planned on
    the full card, 48 entries were predicted)."""
    profile = profiles.load_profile("1xH100-80GB")
    expected = taken("llama-3-70b", "auto", "none")[1].again("auto", None, own_map.machine_of(profile))
    got = own_map.predicted("llama-3-70b", "auto", None, profile)
    on_gpu = sum(1 for name, where in got.items() if name.startswith("model.layers.") and where == "0")
    assert (on_gpu, Counter(got.values())["0"]) == (42, 43)
    assert got == expected


# --- the simulated devices -------------------------------------------------------------------------------------


def test_inside_the_simulation_accelerate_finds_the_profiles_devices_and_host():
    import psutil
    import torch
    from accelerate.utils import get_max_memory

    real = (torch.cuda.device_count(), torch.cuda.is_available())
    machine = Machine(gpus=13, gpu_memory=80 * 2**30, host_memory=512 * 2**30)
    with simulated(machine):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 13
        assert torch.device(12) == torch.device("cuda", 12) and isinstance(torch.device(0), torch.device)
        assert get_max_memory() == {**{i: 80 * 2**30 for i in range(13)}, "cpu": 512 * 2**30}
        assert psutil.virtual_memory().available == 512 * 2**30
    assert (torch.cuda.device_count(), torch.cuda.is_available()) == real
    if not real[1]:  # and torch resolves a bare index as before: to no device at all
        with pytest.raises(RuntimeError):
            torch.device(0)


def test_only_the_planning_thread_sees_the_simulated_devices():
    import torch

    real = (torch.cuda.device_count(), torch.cuda.is_available())
    answers: dict = {}
    inside, leave = threading.Event(), threading.Event()

    def plan():
        with simulated(Machine(gpus=13, gpu_memory=2**30, host_memory=2**30)):
            answers["planning"] = torch.cuda.device_count()
            inside.set()
            leave.wait(10)

    planner = threading.Thread(target=plan)
    planner.start()
    inside.wait(10)
    answers["beside"] = (torch.cuda.device_count(), torch.cuda.is_available())
    leave.set()
    planner.join(10)
    assert answers == {"planning": 13, "beside": real}
