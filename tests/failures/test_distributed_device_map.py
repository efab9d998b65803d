"""Write-up 004 (device_map under DeepSpeed): a model loaded with a spreading ``device_map`` cannot be
prepared by accelerate in any distributed mode. Reproduced on CPU with the write-up's error text, on 2 real
ranks, with real DeepSpeed (``DistributedType.DEEPSPEED``) and with plain multi-CPU (``MULTI_CPU``); then the
check of :mod:`pytest_llmload.failures.distributed_device_map` shown to fail on the write-up's "before" loader and to pass
on the reference loader; then the write-up's rule "is this process distributed?" tested over environments.
"""

from __future__ import annotations

import os
import re
import unittest.mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fixtures.loaders import before_distributed_device_map
from pytest_llmload import LoadRequest, call_loader
from pytest_llmload.system import gpus
from pytest_llmload.failures import distributed_device_map as check
from pytest_llmload.fixes.training_scripts import is_distributed
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference_loader
from pytest_llmload.fixes.reference_loader import placement_kwargs

pytestmark = pytest.mark.llmload_deepspeed  # DeepSpeed is imported before the deadlines start

DEVICE_MAP_ERROR = (
    "You can't train a model that has been loaded with `device_map='auto'` in any distributed mode. Please rerun "
    "your script specifying `--num_processes=1` or by launching with `python {{myscript.py}}`."
)
SPREAD = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
          "model.layers.3": "disk", "model.norm": "disk", "model.rotary_emb": "disk", "lm_head": "disk"}


def _no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


# --- the failure, reproduced -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_device_map_auto_alone_does_not_spread_on_a_cpu_only_machine(llmload_checkpoint):
    # Why the reproduction needs a budget here: one device, so "auto" maps everything to it and
    # transformers drops the one-entry map. accelerate has nothing to refuse.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llmload_checkpoint, device_map="auto", local_files_only=True)
    assert getattr(model, "hf_device_map", {}) in ({}, {"": "cpu"})


@pytest.mark.timeout(60)
def test_before_loader_spreads_the_model_over_cpu_and_disk(llmload_checkpoint, tmp_path, monkeypatch):
    _no_launcher_env(monkeypatch)
    request = LoadRequest(llmload_checkpoint, purpose="train", offload_folder=tmp_path / "offload")
    model = call_loader(before_distributed_device_map.load, request).model
    assert model.hf_device_map == SPREAD


def _prepare_before_loader_model(checkpoint: str, offload_folder: str, deepspeed: bool) -> tuple[str, str]:
    """On a rank: load with the write-up's loader, prepare with accelerate; (distributed type, what prepare raised)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    request = LoadRequest(checkpoint, purpose="train", deepspeed=deepspeed,
                          offload_folder=os.path.join(offload_folder, f"rank{dist.get_rank()}"))
    model = call_loader(before_distributed_device_map.load, request).model
    if deepspeed:
        from accelerate.utils import DeepSpeedPlugin

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(check.DEEPSPEED_CONFIG)))
    else:
        accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        accelerator.prepare(model, optimizer)
    except ValueError as exc:
        return str(accelerator.distributed_type), str(exc)
    return str(accelerator.distributed_type), "prepare() did not raise"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("deepspeed", "distributed_type"),
    [(True, "DistributedType.DEEPSPEED"), (False, "DistributedType.MULTI_CPU")],
    ids=["deepspeed-zero2", "multi-cpu"],
)
def test_prepare_raises_the_writeups_error_on_every_rank(
    distributed_env, llmload_checkpoint, tmp_path, deepspeed, distributed_type
):
    if deepspeed:
        pytest.importorskip("deepspeed")
    results = distributed_env.run(
        _prepare_before_loader_model, world_size=2, backend="gloo", deepspeed=deepspeed,
        args=(os.fspath(llmload_checkpoint), os.fspath(tmp_path), deepspeed),
    )
    assert results == [(distributed_type, DEVICE_MAP_ERROR)] * 2


@pytest.mark.timeout(60)
def test_one_rank_of_world_size_one_is_distributed_too(distributed_env, llmload_checkpoint, tmp_path):
    # torchrun --nproc-per-node 1 gives WORLD_SIZE=1, RANK=0, LOCAL_RANK=0: accelerate takes it as MULTI_CPU and
    # refuses the spread model, so is_distributed() must say True for it (the write-up's rule does).
    results = distributed_env.run(
        _prepare_before_loader_model, world_size=1, backend="gloo",
        args=(os.fspath(llmload_checkpoint), os.fspath(tmp_path), False),
    )
    assert results == [("DistributedType.MULTI_CPU", DEVICE_MAP_ERROR)]
    assert is_distributed({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})


# --- the check -------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_check_fails_on_the_before_loader(llmload_checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    # A bypass set in the test process must not reach the ranks, or the failure would silently vanish.
    monkeypatch.setenv("ACCELERATE_BYPASS_DEVICE_MAP", "true")
    with pytest.raises(AssertionError) as excinfo:
        check.check_distributed_train_step(before_distributed_device_map.load, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    assert message.startswith("write-up 004: the loader's model does not train on every rank of a 2-rank gloo "
                              "group (6 problems):")
    for mode in ("deepspeed", "ddp", "ddp-budget"):
        for rank in (0, 1):
            assert (f"{mode}: rank {rank}: accelerator.prepare() raised ValueError: {DEVICE_MAP_ERROR} "
                    f"(hf_device_map has 8 entries: {SPREAD})") in message


@pytest.mark.timeout(120)
def test_check_passes_on_the_reference_loader(llmload_checkpoint, tmp_path):
    pytest.importorskip("deepspeed")
    check.check_distributed_train_step(reference_loader, llmload_checkpoint, tmp_path)


@pytest.mark.timeout(60)
def test_check_fails_when_the_ranks_disagree_on_the_loss(llmload_checkpoint, tmp_path, monkeypatch):
    # The loss comparison is not decoration: ranks that end the step with different weights fail it.
    monkeypatch.setattr(check, "_load_prepare_and_step", _drifting(check._load_prepare_and_step))
    with pytest.raises(AssertionError, match=r"ddp: the loss after the step \(weights out of sync\) differs"):
        check.check_distributed_train_step(reference_loader, llmload_checkpoint, tmp_path, modes=("ddp",))


def _drifting(original):
    """The rank's step as usual, then rank 1's weights drift: what ranks that skip the all-reduce would see."""

    def drifting(loader, checkpoint, workdir, mode, backend):
        import torch.distributed as dist

        result = original(loader, checkpoint, workdir, mode, backend)
        result.data["probe_loss_after"] += 0.01 * dist.get_rank()
        return result

    return drifting


@pytest.mark.timeout(120)
@pytest.mark.needs_gpus(1)
@pytest.mark.parametrize("loader", [reference_loader, before_distributed_device_map.load], ids=["reference", "before"])
def test_check_with_nccl_on_the_gpus(llmload_checkpoint, tmp_path, loader):
    world_size = min(2, gpus.visible_gpu_count())
    if loader is reference_loader:
        check.check_distributed_train_step(loader, llmload_checkpoint, tmp_path, backend="nccl",
                                           world_size=world_size)
    else:
        with pytest.raises(AssertionError, match="accelerator.prepare"):
            check.check_distributed_train_step(loader, llmload_checkpoint, tmp_path, backend="nccl",
                                               world_size=world_size)


# --- the reference loader's decision ---------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("environ", "fields", "expected"),
    [
        ({}, {"purpose": "train"}, {"device_map": {"": "cpu"}}),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, {"purpose": "train"}, {}),
        ({"LOCAL_RANK": "1"}, {"purpose": "train", "device": "cuda:0"}, {"device_map": {"": "cuda:1"}}),
        ({"LOCAL_RANK": "1"}, {"purpose": "train", "device": "cuda:0", "deepspeed": True}, {}),
        ({}, {"purpose": "train", "deepspeed": True}, {}),
        ({"RANK": "0"}, {"max_memory": {"cpu": 1000}}, {}),
        ({"LOCAL_RANK": "-1"}, {"max_memory": {"cpu": 1000}}, {"device_map": "auto", "max_memory": {"cpu": 1000}}),
    ],
    ids=["single", "rank", "rank-gpu", "deepspeed-gpu", "deepspeed-flag", "rank-budget", "local-rank-minus-one"],
)
def test_reference_loader_placement(monkeypatch, environ, fields, expected):
    _no_launcher_env(monkeypatch)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert placement_kwargs(LoadRequest("/nowhere", **fields)) == expected


def _load_with_budget(checkpoint: str, budget: dict, offload_folder: str) -> dict:
    request = LoadRequest(checkpoint, purpose="inference", max_memory=budget, offload_folder=offload_folder)
    model = call_loader(reference_loader, request).model
    return dict(getattr(model, "hf_device_map", None) or {})


@pytest.mark.timeout(60)
def test_reference_loader_does_not_spread_on_a_rank(distributed_env, llmload_checkpoint, tmp_path, monkeypatch):
    # The same inference request with a budget: spread over cpu and disk in a single process, whole on a rank.
    _no_launcher_env(monkeypatch)
    budget = {"cpu": before_distributed_device_map.half_the_weights(llmload_checkpoint)}
    args = (os.fspath(llmload_checkpoint), budget, os.fspath(tmp_path / "offload"))
    assert _load_with_budget(*args) == SPREAD
    assert distributed_env.run(_load_with_budget, world_size=2, backend="gloo", args=args) == [{}, {}]


# --- is_distributed over environments --------------------------------------------------------------------


def writeups_rule(environ, use_deepspeed):
    """The write-up's own expression, verbatim."""
    return (
        use_deepspeed
        or environ.get("WORLD_SIZE", "1") != "1"
        or environ.get("LOCAL_RANK") is not None
        or environ.get("RANK") is not None
    )


NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
canonical = st.fixed_dictionaries(
    {},
    optional={"WORLD_SIZE": st.integers(1, 64).map(str), "RANK": st.integers(0, 63).map(str),
              "LOCAL_RANK": st.integers(0, 7).map(str)},
)
odd_values = st.one_of(
    st.sampled_from(["", " ", "abc", "1.0", "0x1", "1_0", "\u0661", "nan", "-", "--1", "2 2", "one", "1e3"]),
    st.text(max_size=4).filter(lambda s: not re.fullmatch(r"-?[0-9]+", s.strip())),
)
others = st.dictionaries(st.sampled_from(["PATH", "HOME", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "X"]),
                         st.text(max_size=5), max_size=3)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(environ=canonical, use_deepspeed=st.booleans(), extra=others)
@example(environ={"WORLD_SIZE": "1", "RANK": "0"}, use_deepspeed=False, extra={})
@example(environ={"WORLD_SIZE": "1"}, use_deepspeed=False, extra={})
@example(environ={}, use_deepspeed=False, extra={})
def test_is_distributed_agrees_with_the_writeups_rule(environ, use_deepspeed, extra):
    assert is_distributed({**extra, **environ}, deepspeed=use_deepspeed) == writeups_rule(environ, use_deepspeed)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(NAMES), value=odd_values, rest=canonical, use_deepspeed=st.booleans())
@example(name="WORLD_SIZE", value="", rest={}, use_deepspeed=False)
@example(name="RANK", value="", rest={"WORLD_SIZE": "1"}, use_deepspeed=True)
@example(name="LOCAL_RANK", value="zero", rest={}, use_deepspeed=False)
def test_odd_values_are_a_clear_error_naming_the_variable(name, value, rest, use_deepspeed):
    with pytest.raises(ValueError) as excinfo:
        is_distributed({**rest, name: value}, deepspeed=use_deepspeed)
    assert f"environment variable {name}={value!r} is not an integer" in str(excinfo.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("name", "value", "minimum"), [("WORLD_SIZE", "0", 1), ("WORLD_SIZE", "-1", 1),
                                                        ("RANK", "-2", -1), ("LOCAL_RANK", "-5", -1)])
def test_out_of_range_values_are_a_clear_error(name, value, minimum):
    with pytest.raises(ValueError, match=rf"^environment variable {name}='{value}' is out of range: it must be "
                                         rf"at least {minimum}\.$"):
        is_distributed({name: value})


@pytest.mark.timeout(30)
def test_minus_one_means_not_distributed_and_padding_is_accepted():
    assert not is_distributed({"LOCAL_RANK": "-1", "RANK": "-1", "WORLD_SIZE": "1"})
    assert is_distributed({"WORLD_SIZE": " 2\n"})
    with pytest.raises(TypeError, match="deepspeed='yes'"):
        is_distributed({}, deepspeed="yes")


def _accelerate_says_distributed(environ) -> bool:
    """accelerate's own decision for a CPU process (PartialState._prepare_backend, private: skip if gone)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    prepare_backend = getattr(PartialState, "_prepare_backend", None)
    if prepare_backend is None:
        pytest.skip("accelerate no longer has PartialState._prepare_backend")
    launcher = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE") + NAMES
    clean = {k: v for k, v in os.environ.items() if k not in launcher}
    with unittest.mock.patch.dict(os.environ, {**clean, **environ}, clear=True):
        _, distributed_type = prepare_backend(None, True, False, None)
    return distributed_type != DistributedType.NO


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(environ=st.fixed_dictionaries(
    {}, optional={"WORLD_SIZE": st.integers(1, 8).map(str), "RANK": st.integers(-1, 7).map(str),
                  "LOCAL_RANK": st.integers(-1, 7).map(str)}))
def test_whatever_accelerate_calls_distributed_is_distributed(environ):
    # No false negatives: where accelerate would refuse a spread model, the loader has already dropped it.
    if _accelerate_says_distributed(environ):
        assert is_distributed(environ)


@pytest.mark.timeout(30)
def test_accelerates_decision_is_read_correctly():
    # Keeps the property above from passing vacuously.
    assert _accelerate_says_distributed({"WORLD_SIZE": "2"})
    assert _accelerate_says_distributed({"WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert not _accelerate_says_distributed({})
    assert not _accelerate_says_distributed({"RANK": "0"})  # accelerate ignores RANK alone; the rule does not
    assert is_distributed({"RANK": "0"})



def auto_on_every_rank(request):
    """The write-up's mistake in its purest form: device_map="auto" whatever the environment says. On a CPU runner
    "auto" has one device; on a runner with GPUs it spreads even a small model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(request.model_path, device_map="auto", local_files_only=True)
    return model, AutoTokenizer.from_pretrained(request.model_path, local_files_only=True)


def pins_each_rank_to_its_gpu(request):
    """Write-up 004's usual fix on GPU runners: the whole model on the rank's own accelerator."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(request.model_path, device_map={"": int(os.environ["LOCAL_RANK"])},
                                                 local_files_only=True)
    return model, AutoTokenizer.from_pretrained(request.model_path, local_files_only=True)


@pytest.mark.timeout(180)
def test_auto_on_a_cpu_runner_fails_with_the_map_accelerate_plans_for_two_gpus(llmload_checkpoint, tmp_path):
    pytest.importorskip("deepspeed")
    with pytest.raises(AssertionError) as excinfo:
        check.check_distributed_train_step(auto_on_every_rank, llmload_checkpoint, tmp_path, modes=("ddp",))
    message = str(excinfo.value)
    assert f"ddp: rank 0: accelerator.prepare() raised ValueError: {DEVICE_MAP_ERROR}" in message
    assert ("(it passed {'device_map': 'auto'} to from_pretrained, which on a runner with 2 GPUs places the model "
            "as {'model.embed_tokens': '0'") in message and "(accelerate's planner))" in message
    planned = message[message.index("places the model as ") + len("places the model as "):].split("}")[0]
    assert "'0'" in planned and "'1'" in planned  # over both GPUs


@pytest.mark.timeout(180)
def test_pinning_each_rank_to_its_gpu_is_judged_on_the_cpu_on_a_runner_without_gpus_and_says_so(llmload_checkpoint,
                                                                                               tmp_path):
    """Write-up 004's fix pins each rank to its accelerator index; a CPU runner cannot load that, so the rank's
    device is simulated by the cpu (the pin is whole-on-one-device either way) and the prepare and step are real."""
    import inspect

    import torch

    from pytest_llmload.config.stash_keys import collecting_notes

    if torch.cuda.is_available():
        pytest.skip("on a runner with GPUs this loader is exercised for real")
    with collecting_notes() as notes:
        check.check_distributed_train_step(pins_each_rank_to_its_gpu, llmload_checkpoint, tmp_path, modes=("ddp",))
    source, start = inspect.getsourcelines(pins_each_rank_to_its_gpu)
    line = f"{os.path.relpath(__file__)}:{start + next(i for i, text in enumerate(source) if 'from_pretrained(' in text)}"
    assert sorted(notes) == [f"ran on cpu: the loader pins cuda:{rank} ({line}: device_map={{'': {rank}}}), a device "
                             "this runner lacks; a GPU runner (`pytest -m gpu`) judges it there" for rank in (0, 1)], notes


@pytest.mark.timeout(180)
def test_a_loader_that_honours_a_budget_on_every_rank_fails_the_budgeted_variant(llmload_checkpoint, tmp_path):
    """The budgeted variant: a rank whose request carries a max_memory that cannot hold the model. A loader that
    honours it with device_map="auto" offloads on every rank; the reference loader refuses it and passes."""
    def honours_the_budget(request):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = {} if request.max_memory is None else {"device_map": "auto", "max_memory": request.max_memory,
                                                        "offload_folder": request.offload_folder}
        return (AutoModelForCausalLM.from_pretrained(request.model_path, local_files_only=True, **kwargs),
                AutoTokenizer.from_pretrained(request.model_path, local_files_only=True))

    with pytest.raises(AssertionError, match=r"ddp-budget: rank 0: accelerator.prepare\(\) raised ValueError: "):
        check.check_distributed_train_step(honours_the_budget, llmload_checkpoint, tmp_path / "b",
                                           modes=("ddp", "ddp-budget"))
    check.check_distributed_train_step(reference_loader, llmload_checkpoint, tmp_path / "r", modes=("ddp-budget",))


def pins_without_a_budget_spreads_with_one(request):
    """Pins each rank to its accelerator index when no budget is given (a GPU runner's rule), but spreads the model
    with device_map='auto' under a budget: the first mode cannot run on a CPU runner, the budgeted one must still be
    judged (issue 25, class 7)."""
    from transformers import AutoModelForCausalLM

    if request.max_memory is None:
        placement = {"device_map": {"": int(os.environ.get("LOCAL_RANK", "0"))}}
    else:
        placement = {"device_map": "auto", "max_memory": request.max_memory, "offload_folder": request.offload_folder}
    return AutoModelForCausalLM.from_pretrained(request.model_path, dtype=request.torch_dtype, local_files_only=True,
                                                **placement)


@pytest.mark.timeout(120)
def test_every_mode_is_judged_even_when_the_first_cannot_run_here(llmload_checkpoint, tmp_path):
    pytest.importorskip("deepspeed")
    if gpus.visible_gpu_count():
        pytest.skip("the pinned modes run on this machine: the premise is a runner without accelerators")
    with pytest.raises(AssertionError) as excinfo:
        check.check_distributed_train_step(pins_without_a_budget_spreads_with_one, llmload_checkpoint, tmp_path)
    assert "ddp-budget: rank 0: accelerator.prepare() raised ValueError" in str(excinfo.value), str(excinfo.value)


def test_non_finite_probe_losses_are_no_verdict():
    from pytest_llmload.loader.seam import LoaderModelError

    from pytest_llmload.runners.ranks import RankResult

    results = [RankResult.ok(probe_loss_before=2.0, step_loss=float("nan"), probe_loss_after=float("nan"))] * 2
    with pytest.raises(LoaderModelError, match=r"the probe step produced non-finite losses on rank 0"):
        check._judge(results)
