"""Write-up 003: Trainer wraps a placed 4-bit LoRA model in nn.DataParallel; fix ``training_args._n_gpu = 1``.

On CPU, "more than one GPU" is set where Trainer reads it (``TrainingArguments.n_gpu``); Trainer's own
code decides the rest. What it decides depends on the installed transformers, and each test says which
behaviour it saw:

- 4.57: ``_wrap_model`` wraps whenever ``n_gpu > 1`` except 8-bit models (trainer.py:2077-2078), so the
  write-up's 4-bit model is wrapped; from_pretrained sets ``hf_device_map`` for any ``device_map``
  (modeling_utils.py:5115-5140, accelerate big_modeling.py:516). 4.56 and 4.46 do the same (4.46
  trainer.py:1886); 4.56 was seen to wrap here, 4.46 cannot load a 4-bit model on CPU (below).
- 5.23: ``_wrap_model`` also skips 4-bit (trainer.py:2667-2672), but the batch is still ``n_gpu`` times
  the per-device batch (trainer.py:627) and the loss is scaled by ``n_gpu`` (trainer.py:2207), x2.000
  measured; from_pretrained sets ``hf_device_map`` only for a map over more than one device
  (modeling_utils.py:4455-4457).
- Both reset ``n_gpu`` to 1 only when ``hf_device_map`` names more than one device other than cpu/disk,
  or one that is not ``args.device`` (4.57 trainer.py:500-507 and 615-616; 5.23 trainer.py:460-465 and
  507-508); ``n_gpu`` itself is ``torch.cuda.device_count()`` (training_args.py 4.57:2344, 5.23:1949).

On CPU the write-up's 4-bit model needs bitsandbytes' CPU backend (bitsandbytes >= 0.47 here) and a
transformers that lets it run: 4.46 accepts 4-bit on CPU only with intel_extension_for_pytorch
(integrations/bitsandbytes.py:498), which has no build for torch 2.13. Tests that load it skip there with
transformers' own refusal in the reason, and say whether that Trainer would wrap the model.

The mechanism the write-up names (DataParallel worker threads without the caller's autocast, so float
activations reach a bf16 ``lm_head``) has no test here: it cannot fail for real on this machine. On CPU,
``nn.DataParallel`` keeps no device ids and calls the module directly, with no worker threads
(torch 2.13 data_parallel.py:145-149, 174-175), and ``parallel_apply`` refuses to run without an
accelerator (parallel_apply.py:71-73). Where it does run, it re-enters autocast in each worker with the
caller's enabled flag (parallel_apply.py:77-80, 109) though not its dtype, so "no autocast" is not the
whole story either; trl 1.16 gives another reason (replicas run a forward bound to the original model,
sft_trainer.py:1115-1123). The two-GPU test below asserts the error itself where it can happen.

The check judges the placement the loader asks for on the 2 GPUs it simulates (issue 35): what the loader passes
to ``from_pretrained`` is planned by the predictions' planner and set as the model's ``hf_device_map`` (the weights
stay on the cpu), and Trainer decides with ``args.device`` reading ``cuda:0``. A spread over both GPUs is model
parallelism Trainer sees (``n_gpu`` 1): it passes, ``"balanced"`` included, which is why the before-loader hands
its model on without ``hf_device_map`` (its docstring). A repo that declares nothing about Trainer, and imports no
Trainer class, is never FAILED: a skip that says what was assumed.

On one GPU it did not happen (H100, torch 2.11, transformers 5.17; docs/gpu.md): ``nn.DataParallel`` with
``device_ids=[0, 0]`` (two replicas on cuda:0, in two threads) over the write-up's model trained a step with
and without Trainer's bf16 autocast. There ``"balanced"`` puts everything on cuda:0, transformers records no
``hf_device_map``, and ``prepare_model_for_kbit_training`` has cast the head to float32: no bf16 ``lm_head``
for float activations to meet. So no ``needs_gpus(1)`` test: the error stays with the 2-GPU tests.
"""

from __future__ import annotations

import doctest
import importlib.util
import inspect
import logging

import pytest

from fixtures import warm_runs
from fixtures.loaders import before_dp_dtype
from fixtures.loaders.trainer_mentioned_only import model_loader as mentioned_only
from pytest_llmload import LoadRequest
from pytest_llmload.failures.dp_dtype import (
    _upstream_reading,
    check_trainer_does_not_wrap_placed_model,
    write_stage1_checkpoint,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="write-up 003 loads in 4-bit: needs bitsandbytes"
)


def _guard():
    from pytest_llmload.fixes.trainer_guard import prepare_training_args_for_placed_model

    return prepare_training_args_for_placed_model


def _require_4bit_here() -> None:
    """Skip unless bitsandbytes 4-bit loads on this machine, naming transformers' refusal and what its
    Trainer would do with the write-up's model where it does load (on a GPU)."""
    from pytest_llmload.failures.dp_dtype import four_bit_refusal

    refusal = four_bit_refusal()
    if refusal is not None:
        behaviour = ("skips 4-bit models in nn.DataParallel but counts n_gpu" if _trainer_skips_4bit()
                     else "wraps 4-bit models in nn.DataParallel (it skips 8-bit only)")
        pytest.skip(f"write-up 003 loads in 4-bit: {refusal}. Not reproduced here; by its source this Trainer "
                    f"{behaviour}")


def _trainer_skips_4bit() -> bool:
    """What the installed Trainer's own source says: does ``_wrap_model`` skip 4-bit models?"""
    from transformers import Trainer

    return "is_loaded_in_4bit" in inspect.getsource(Trainer._wrap_model)


@pytest.fixture(scope="module")
def stage1(llmload_checkpoint, tmp_path_factory):
    """The write-up's stage 1: the full model saved in bf16."""
    return write_stage1_checkpoint(llmload_checkpoint, tmp_path_factory.mktemp("seed003") / "stage1")


def _before_model(stage1, quantization="4bit"):
    request = LoadRequest(stage1, purpose="train", dtype="bfloat16", quantization=quantization, lora=True)
    return before_dp_dtype.load(request)[0]


@pytest.mark.timeout(120)
def test_check_fails_on_the_write_up_setup(llmload_checkpoint, tmp_path, caplog, record_property):
    _require_4bit_here()
    caplog.set_level(logging.INFO, logger="pytest_llmload")
    with pytest.raises(AssertionError) as failure:
        check_trainer_does_not_wrap_placed_model(before_dp_dtype.load, llmload_checkpoint, tmp_path)
    message = str(failure.value)
    record_property("upstream", message.splitlines()[1])
    print(message)
    # Either way the run is data-parallel in Trainer's eyes: the write-up's step-count tell.
    assert "rows per device became 4 per step" in message
    if _trainer_skips_4bit():  # transformers 5.x
        assert "wrapped the model in nn.DataParallel" not in message
        assert "skips nn.DataParallel for 4-bit/8-bit models but still counts n_gpu" in message
        assert "loss is x2.000" in message
    else:  # transformers <= 4.57 (seen on 4.56 and 4.57)
        assert "Trainer wrapped the model in nn.DataParallel" in message
        assert "wraps quantized (4-bit) models in nn.DataParallel" in message


@pytest.mark.timeout(120)
def test_check_passes_with_the_fix(llmload_checkpoint, tmp_path, caplog, record_property):
    _require_4bit_here()
    caplog.set_level(logging.INFO, logger="pytest_llmload")
    check_trainer_does_not_wrap_placed_model(
        before_dp_dtype.load, llmload_checkpoint, tmp_path, prepare_args=_guard()
    )
    (seen,) = [r.getMessage() for r in caplog.records if r.name == "pytest_llmload.failures.dp_dtype"]
    record_property("upstream", seen)
    assert "n_gpu used=1; not wrapped; batch 2 per device -> 2 per step" in seen
    assert any(
        "loaded in 4-bit (bitsandbytes), so TrainingArguments.n_gpu is set from 2 to 1" in r.getMessage()
        for r in caplog.records
    ), "the guard did not log why it changed n_gpu"


def _load_with_an_lm_head_outside_autocast(request):
    """The write-up's loader, with a bf16 lm_head that runs outside autocast on float input: the state the
    write-up blames on DataParallel's workers, produced here on purpose to test the check's report."""
    import torch

    model, tokenizer = before_dp_dtype.load(request)
    head = model.get_output_embeddings().to(torch.bfloat16)
    forward = head.forward

    def forward_without_autocast(hidden_states):
        with torch.autocast("cpu", enabled=False):
            return forward(hidden_states.float())

    head.forward = forward_without_autocast
    return model, tokenizer


@pytest.mark.timeout(120)
def test_check_reports_a_first_step_dtype_error(llmload_checkpoint, tmp_path):
    _require_4bit_here()
    # The text of the write-up's error: torch 2.13 on CPU raises it from the 3-d matmul of the lm_head
    # ("m1 and m2"; CUDA says "mat1 and mat2").
    error = r"expected m(at)?1 and m(at)?2 to have the same dtype, but got: float != c10::BFloat16"
    with pytest.raises(AssertionError, match=f"mixed dtypes at the lm_head: RuntimeError: {error}") as failure:
        check_trainer_does_not_wrap_placed_model(
            _load_with_an_lm_head_outside_autocast, llmload_checkpoint, tmp_path, prepare_args=_guard()
        )
    headline = str(failure.value).splitlines()[0]
    assert "wrapped the model" not in headline and "counts n_gpu" not in headline, headline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("quantization", ["4bit", None], ids=["4bit-lora", "bf16-lora"])
def test_what_a_stock_trainer_does_with_the_write_up_model(stage1, tmp_path, quantization, record_property):
    """Trainer's own decisions for the write-up's stage-2 model with 2 GPUs, without and with the guard."""
    from pytest_llmload.fixes.trainer_guard import observe_trainer

    if quantization == "4bit":
        _require_4bit_here()
    stock = observe_trainer(_before_model(stage1, quantization), tmp_path / "stock")
    record_property("upstream", f"{stock.describe()} -- {_upstream_reading(stock)}")
    print(stock.describe())
    assert not stock.is_model_parallel, "on CPU hf_device_map names no accelerator, so Trainer sees no model parallelism"
    assert (stock.n_gpu, stock.train_batch_size) == (2, 4)
    expect_wrapped = quantization is None or not _trainer_skips_4bit()
    assert stock.data_parallel == expect_wrapped, stock.describe()
    assert stock.error is None and not stock.dtype_mismatches, stock.describe()

    guarded = observe_trainer(_before_model(stage1, quantization), tmp_path / "guarded", prepare_args=_guard())
    if quantization == "4bit":
        assert (guarded.n_gpu, guarded.train_batch_size, guarded.data_parallel) == (1, 2, False), guarded.describe()
        assert guarded.loss_ratio == pytest.approx(1, abs=0.1), guarded.describe()
        assert guarded.first_step_grad_norm and guarded.first_step_grad_norm > 0, guarded.describe()
    else:
        # One device, not quantized: nn.DataParallel can replicate it, and the guard leaves it to Trainer.
        assert (guarded.n_gpu, guarded.data_parallel) == (2, True), guarded.describe()


@pytest.mark.timeout(60)
def test_guard_trainer_fixes_an_already_built_trainer(stage1, tmp_path):
    _require_4bit_here()
    from transformers import Trainer, TrainingArguments

    from pytest_llmload.fixes.trainer_guard import guard_trainer

    model = _before_model(stage1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, use_cpu=True, report_to=[])
    args._n_gpu = 2
    trainer = Trainer(model=model, args=args)
    assert (trainer.args.n_gpu, trainer._train_batch_size) == (2, 6)
    assert guard_trainer(trainer) is True
    assert (trainer.args.n_gpu, trainer._train_batch_size) == (1, 3)
    assert guard_trainer(trainer) is False  # n_gpu is 1 now: nothing to do


@pytest.mark.timeout(60)
def test_guard_sees_a_model_spread_over_cpu_and_disk(llmload_checkpoint, tmp_path):
    """A spread Trainer itself ignores (it drops cpu and disk from hf_device_map) is still placed."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from pytest_llmload.fixes.trainer_guard import placement_of

    model = AutoModelForCausalLM.from_pretrained(
        llmload_checkpoint,
        device_map={"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                    "model.rotary_emb": "cpu", "lm_head": "disk"},
        offload_folder=tmp_path / "offload",
    )
    assert str(placement_of(model)).startswith("spread by device_map over cpu, disk")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    args._n_gpu = 2
    assert _guard()(args, model) is True and args.n_gpu == 1


@pytest.mark.timeout(120)
def test_docstring_example_runs(llmload_checkpoint):
    _require_4bit_here()
    # The checkpoint fixture imports the stack first: DeepSpeed prints a line on stdout when transformers
    # first imports it, and that line is not the example's output.
    from pytest_llmload.fixes import trainer_guard

    result = doctest.testmod(trainer_guard, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


# -- the real thing: two GPUs, no simulation ------------------------------------------------------


@pytest.mark.needs_gpus(2)
@pytest.mark.timeout(300)
def test_two_gpus_fixed_setup_trains_a_step(stage1, tmp_path, record_property):
    from pytest_llmload.fixes.trainer_guard import observe_trainer

    model = _before_model(stage1)
    obs = observe_trainer(model, tmp_path, simulated_n_gpu=None, prepare_args=_guard())
    record_property("upstream", obs.describe())
    assert not obs.data_parallel and obs.n_gpu == 1, obs.describe()
    assert obs.error is None and not obs.dtype_mismatches, obs.describe()
    assert obs.first_step_loss is not None and obs.first_step_grad_norm, obs.describe()


@pytest.mark.needs_gpus(2)
@pytest.mark.timeout(300)
def test_two_gpus_write_up_setup_fails_with_the_dtype_error(stage1, tmp_path, record_property):
    from pytest_llmload.fixes.trainer_guard import observe_trainer

    model = _before_model(stage1)
    obs = observe_trainer(model, tmp_path, simulated_n_gpu=None)
    record_property("upstream", f"{obs.describe()} -- {_upstream_reading(obs)}")
    if not obs.data_parallel:
        pytest.skip(f"this transformers does not wrap the write-up's setup ({_upstream_reading(obs)}): {obs.describe()}")
    assert obs.dtype_error, f"wrapped in nn.DataParallel but no dtype error: {obs.describe()}"
    assert "expected mat1 and mat2 to have the same dtype" in obs.error, obs.error


def _without_trainer(request):
    return before_dp_dtype.load(request)


_without_trainer.llmload_trains_without_trainer = True


def test_a_repo_that_trains_without_trainer_says_so_and_the_check_is_not_exercised(llmload_checkpoint, tmp_path):
    from pytest_llmload.failures import REGISTRY

    (check,) = [c for c in REGISTRY if c.name == "check_trainer_does_not_wrap_placed_model"]
    with pytest.raises(pytest.skip.Exception, match=r"not exercised: .*declared to train without transformers\.Trainer"):
        check(_without_trainer, llmload_checkpoint, tmp_path)


def _eval_mode(request):
    model, tokenizer = before_dp_dtype.load(request)
    return model.eval(), tokenizer  # from_pretrained's own mode; Trainer calls model.train() before its first step


@pytest.mark.timeout(120)
def test_the_check_trains_in_train_mode_as_trainer_does(llmload_checkpoint, tmp_path, caplog):
    """A 4-bit LoRA model returned in eval mode: its first step under Trainer trains (a gradient), as a stock
    Trainer's does; the check's own reference forward must not run it in eval mode first (issue 25, class 4)."""
    _require_4bit_here()
    caplog.set_level(logging.INFO, logger="pytest_llmload")
    check_trainer_does_not_wrap_placed_model(_eval_mode, llmload_checkpoint, tmp_path, prepare_args=_guard())


@pytest.mark.parametrize("how", ["ini", "option"])
def test_the_declaration_by_ini_key_or_option_reaches_a_repos_own_parametrized_test(pytester, how):
    pytester.makepyfile(test_mine="""
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        @parametrize_with_loader_checks([load_model_and_tokenizer])
        def test_loader(loader, check, llmload_checkpoint, tmp_path):
            check(loader, llmload_checkpoint, tmp_path)  # no llmload_check_options: the configuration applies itself
    """)
    args = ["-k", "check_trainer_does_not_wrap_placed_model", "-rs", "-p", "no:cacheprovider"]
    if how == "ini":
        pytester.makeini("[pytest]\nllmload_trains_without_trainer = true\n")
    else:
        args.append("--llmload-trains-without-trainer")
    result = warm_runs.runpytest(pytester, *args)  # its own process, forked from this one (fixtures/warm_runs.py)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not exercised: check_trainer_does_not_wrap_placed_model: the loader is declared to "
                                 "train without transformers.Trainer*"])


# -- issue 35, point 4: the placement the loader makes on the simulated GPUs; Trainer declared, observed or assumed --


def _judged(function, checkpoint, workdir, **options):
    """The check as the plugin runs it in-process, with the row's notes: ``(outcome, text, notes)``, the outcome
    ``"passed"``, ``"skipped"`` or ``"failed"``."""
    from pytest_llmload.config.stash_keys import collecting_notes

    with collecting_notes() as notes:
        try:
            check_trainer_does_not_wrap_placed_model(function, checkpoint, workdir, **options)
        except pytest.skip.Exception as exc:
            return "skipped", str(exc), notes
        except AssertionError as exc:
            return "failed", str(exc), notes
    return "passed", "", notes


def _model_parallel_repo(request):
    """A repo that spreads the model over its GPUs on purpose, trained by Trainer (the fixture's load_spread)."""
    return mentioned_only.load_spread(request)


_model_parallel_repo.llmload_trains_with_trainer = True


def _balanced_as_written(request):
    """Write-up 003's stage-2 load as its words state it (4-bit, ``device_map="balanced"``, LoRA), the placement left
    as from_pretrained makes it (the before-loader's stand-in line left out)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        request.model_path, local_files_only=True, dtype=torch.bfloat16, device_map="balanced",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    model = prepare_model_for_kbit_training(model)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


_balanced_as_written.llmload_trains_with_trainer = True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loader", [_model_parallel_repo, _balanced_as_written],
                         ids=["auto-with-a-budget-per-gpu", "balanced"])
def test_a_model_spread_over_both_gpus_on_purpose_is_model_parallel_for_trainer(llmload_checkpoint, tmp_path, loader):
    """Planned for the 2 simulated GPUs, the placement is spread over both: Trainer's own __init__ reads it in
    hf_device_map (through the peft wrapper), sets n_gpu to 1 and wraps nothing. Before, the check judged the model
    as the CPU runner placed it (whole on the cpu), or the loader's per-GPU budget could not load here at all."""
    _require_4bit_here()
    outcome, text, notes = _judged(loader, llmload_checkpoint, tmp_path)
    assert outcome == "passed", text
    (simulated,) = [n for n in notes if n.startswith("simulated: ")]
    assert "2 GPUs of 80 GiB" in simulated and "cuda:0 (" in simulated and "cuda:1 (" in simulated, simulated
    assert "the weights and the training step on the cpu" in simulated, simulated


@pytest.mark.timeout(120)
def test_a_4bit_model_pinned_to_one_gpu_is_what_trainer_data_parallelises(llmload_checkpoint, tmp_path):
    """The same 4-bit LoRA model on one GPU of the two: Trainer's hf_device_map reading sees one device, the one it
    trains on, so it keeps n_gpu=2 (4.56 wraps it, 5.x doubles the batch): FAILED where Trainer use is declared."""
    _require_4bit_here()
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def pinned(request):
        model = AutoModelForCausalLM.from_pretrained(
            request.model_path, local_files_only=True, dtype=torch.bfloat16, device_map={"": 0},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
        model = prepare_model_for_kbit_training(model)
        return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

    pinned.llmload_trains_with_trainer = True
    outcome, text, notes = _judged(pinned, llmload_checkpoint, tmp_path)
    assert outcome == "failed", text
    assert "2 rows per device became 4 per step" in text and "Trainer deciding for cuda:0 with hf_device_map on " \
        "cuda:0 (1 module)" in text, text
    assert "Trainer use declared (llmload_trains_with_trainer)" in text, text


# The write-up's loader without its llmload_trains_with_trainer, in a package that uses no Trainer (a loader defined
# in this module would be observed to: the tests here run Trainer).
_declares_nothing = mentioned_only.load


@pytest.mark.timeout(120)
def test_a_repo_that_declares_nothing_about_trainer_is_not_failed_and_its_row_says_what_was_assumed(
        llmload_checkpoint, tmp_path):
    _require_4bit_here()
    outcome, text, notes = _judged(_declares_nothing, llmload_checkpoint, tmp_path)
    assert outcome == "skipped", text
    assert text.startswith("not exercised: check_trainer_does_not_wrap_placed_model: assumed: this repo's training "
                           "does not hand the model to transformers.Trainer"), text
    assert "Were it handed to a stock Trainer on 2 GPUs: " in text and "rows per device became 4" in text, text
    (assumed,) = [n for n in notes if n.startswith("assumed: ")]
    assert assumed.startswith("assumed: this repo's training does not hand the model to transformers.Trainer"), notes
    # (issue 46) what settles it, for the summaries under the tables to list
    assert "declare `load.llmload_trains_with_trainer = True`" in assumed and \
        "`load.llmload_trains_without_trainer = True`" in assumed, assumed


@pytest.mark.timeout(120)
def test_a_repo_that_declares_nothing_and_passes_says_the_verdict_holds_either_way(llmload_checkpoint, tmp_path):
    _require_4bit_here()

    outcome, text, notes = _judged(mentioned_only.load_spread, llmload_checkpoint, tmp_path)
    assert outcome == "passed", text
    assert any(n.startswith("not declared: whether this repo trains with transformers.Trainer") and
               "verdict holds either way" in n for n in notes), notes
    # (issue 46) a verdict that holds either way rests on no assumption: not listed, not failed by --llmload-strict
    assert not any(n.startswith("assumed: ") for n in notes), notes


_TRAINING_MODULE = '''
from transformers import Trainer

class RecipeTrainer(Trainer):
    pass
'''
_ADAPTER_MODULE = '''
from llmload_probe_repo.train import RecipeTrainer  # noqa: F401  (the repo's training script, imported)
from fixtures.loaders import before_dp_dtype


def load(request):
    return before_dp_dtype.load(request)
'''


def test_trainer_classes_the_loaders_modules_bind_are_observed(monkeypatch):
    """A loader whose package's modules, as imported, bind a transformers.Trainer subclass (no source to read)."""
    import types

    from pytest_llmload.failures.dp_dtype import trainer_use_observed

    package = types.ModuleType("llmload_probe_repo")
    package.__path__ = []
    train, adapter = types.ModuleType("llmload_probe_repo.train"), types.ModuleType("llmload_probe_repo.adapter")
    for module in (package, train, adapter):
        monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    exec(_TRAINING_MODULE, train.__dict__)
    exec(_ADAPTER_MODULE, adapter.__dict__)
    assert trainer_use_observed(adapter.load) == [
        "llmload_probe_repo.adapter.RecipeTrainer (llmload_probe_repo.train.RecipeTrainer, a transformers.Trainer)"]
    assert trainer_use_observed(before_dp_dtype.load) == []


# -- issue 46, point 5: Trainer use read from the source of the loader's package and the modules it imports --------


def test_a_training_script_beside_the_loader_is_read_never_imported():
    """Issue 46's two repos: ``train.py`` beside ``model_loader.py`` in one package, the loader importing neither
    Trainer nor the script (which trains when imported). Before, nothing was observed and the row was an
    assumption, exit 0."""
    import sys

    from fixtures.loaders.trainer_beside_loader import model_loader
    from pytest_llmload.failures.dp_dtype import trainer_use_observed

    assert trainer_use_observed(model_loader.load) == [
        "trainer_beside_loader/train.py:12 defines RecipeTrainer, a subclass of transformers.trainer.Trainer",
        "trainer_beside_loader/train.py:20 calls RecipeTrainer (transformers.trainer.Trainer)"]
    assert "fixtures.loaders.trainer_beside_loader.train" not in sys.modules


def test_trainer_named_but_never_used_is_not_trainer_use():
    """Strings, comments, docstrings, annotations, an isinstance test, TrainerCallback, Lightning's Trainer: no
    false alarm, the row stays an assumption."""
    from fixtures.loaders.trainer_mentioned_only import model_loader
    from pytest_llmload.failures.dp_dtype import trainer_use_observed

    assert trainer_use_observed(model_loader.load) == []


LOADER = "def load(request):\n    return request\n"


@pytest.mark.parametrize(("files", "loader", "seen"), [
    pytest.param({"evalpkg/__init__.py": "", "evalpkg/loading.py": LOADER, "evalpkg/evaluate.py":
                  "import transformers as hf\n\ndef run(model, data):\n    return hf.Trainer(model=model, "
                  "eval_dataset=data).evaluate()\n"},
                 "evalpkg.loading", ["evalpkg/evaluate.py:4 calls hf.Trainer (transformers.trainer.Trainer)"],
                 id="evaluation-only: Trainer.evaluate wraps the model as training does"),
    pytest.param({"sftpkg/__init__.py": "", "sftpkg/models/__init__.py": "", "sftpkg/models/load.py": LOADER,
                  "sftpkg/recipes/sft.py": "from trl import SFTTrainer\n\ndef train(model):\n    "
                  "SFTTrainer(model=model).train()\n"},
                 "sftpkg.models.load", ["sftpkg/recipes/sft.py:4 calls SFTTrainer (trl.SFTTrainer (trl is not "
                                        "installed here; its trainers are transformers.Trainer subclasses))"],
                 id="trl's SFTTrainer elsewhere in the top-level package"),
    pytest.param({"chainpkg/__init__.py": "", "chainpkg/load.py": LOADER,
                  "chainpkg/base.py": "from transformers import Seq2SeqTrainer\n\nclass Base(Seq2SeqTrainer):\n"
                                      "    pass\n",
                  # (a module that never names "Trainer" is not parsed: the subclass it uses is seen where defined)
                  "chainpkg/run.py": "from .base import Base as RunTrainer\n\nRunTrainer(model=None)\n"},
                 "chainpkg.load", [
                     "chainpkg/base.py:3 defines Base, a subclass of transformers.trainer_seq2seq.Seq2SeqTrainer",
                     "chainpkg/run.py:3 calls RunTrainer (transformers.trainer_seq2seq.Seq2SeqTrainer)"],
                 id="the repo's subclass, followed through a relative import"),
    pytest.param({"flat_loader.py": "import flat_train_config\n" + LOADER,
                  "flat_train_config.py": "from transformers import Trainer\n\ndef train(model):\n"
                                          "    Trainer(model=model).train()\n"},
                 "flat_loader", ["flat_train_config.py:4 calls Trainer (transformers.trainer.Trainer)"],
                 id="a module the loader's module imports, outside any package"),
    pytest.param({"nsrepos/one_loader.py": LOADER,
                  "nsrepos/other_repo.py": "from transformers import Trainer\nTrainer(model=None)\n"},
                 "nsrepos.one_loader", [],
                 id="a namespace package's other modules: unrelated projects (the corpus's layout)"),
])
def test_trainer_use_in_the_loaders_package_and_imports(tmp_path, monkeypatch, files, loader, seen):
    import importlib
    import sys

    from pytest_llmload.failures.dp_dtype import trainer_use_in_source

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(tmp_path)
    before = set(sys.modules)
    try:
        function = importlib.import_module(loader).load
        assert trainer_use_in_source(function) == seen
        imported = {name for name in set(sys.modules) - before if not name.startswith(("transformers", "trl"))}
        assert imported <= {loader, loader.split(".")[0], loader.rpartition(".")[0], "flat_train_config"}, imported
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] in {path.split("/")[0].removesuffix(".py") for path in files}:
                del sys.modules[name]


@pytest.mark.timeout(120)
def test_trainer_use_read_beside_the_loader_is_judged(llmload_checkpoint, tmp_path):
    """Issue 46: the write-up's model from a repo whose train.py (beside its loader) runs a Trainer subclass: judged
    (FAILED) without a declaration, the row saying what it observed and where; before, a skip "assumed: ...",
    exit 0."""
    _require_4bit_here()
    from fixtures.loaders.trainer_beside_loader import model_loader

    outcome, text, notes = _judged(model_loader.load, llmload_checkpoint, tmp_path)
    assert outcome == "failed", text
    assert ("Trainer use observed in the loader's package or the modules it imports: trainer_beside_loader/train.py:12 "
            "defines RecipeTrainer, a subclass of transformers.trainer.Trainer") in text, text
    assert any(n.startswith("observed: Trainer use in the loader's package") for n in notes), notes
    assert not any(n.startswith("assumed: ") for n in notes), notes


@pytest.mark.timeout(120)
def test_the_write_up_loader_fails_and_with_its_fix_passes_through_the_registry(llmload_checkpoint, tmp_path):
    """As the plugin runs it (the registry's Check, isolated): write-up 003's before-loader, declared to train with
    Trainer, FAILS; the same loader naming the write-up's fix as its training-args hook passes."""
    _require_4bit_here()
    from pytest_llmload.failures import REGISTRY

    (check,) = [c for c in REGISTRY if c.name == "check_trainer_does_not_wrap_placed_model"]
    with pytest.raises(AssertionError, match="rows per device became 4 per step"):
        check(before_dp_dtype.load, llmload_checkpoint, tmp_path / "before")

    def fixed(request):
        return before_dp_dtype.load(request)

    fixed.llmload_training_args_hook = "pytest_llmload.fixes.trainer_guard:prepare_training_args_for_placed_model"
    check(fixed, llmload_checkpoint, tmp_path / "fixed")
