"""The plugin's fixtures. Each is an override point: define a fixture of the same name and scope in a
conftest.py and the fixtures built on it follow (override ``llmload_loader`` to plug in your own loader).

Heavy libraries are imported inside the fixtures, so a run that uses none of them never pays for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest

from pytest_llmload.config.stash_keys import UNCONFIGURED, Configuration, configuration_key

if TYPE_CHECKING:
    from pytest_llmload.loader.seam import LoaderUnderTest, LoadResult

# pytest imports this module on every run (the plugin registers these fixtures): everything else is imported
# by the fixture that needs it.


def read_configuration(config: pytest.Config, every_setting: dict) -> Configuration:
    """The run's one :class:`~pytest_llmload.config.stash_keys.Configuration` (its precedence is stated there), read
    at configure by the plugin from ``every_setting`` (:func:`pytest_llmload.config.settings.every_setting`); a bad
    value is a usage error naming it and where it came from."""
    import types

    from pytest_llmload.config.vocabulary import HOOK_INI, LOADER_INI, TRAINING_DECLARATIONS
    from pytest_llmload.fixes.reference_loader import REFERENCE
    from pytest_llmload.loader import seam

    try:
        loader = seam.choose_loader(config.getoption("llmload_loader"), os.environ, config.getini(LOADER_INI),
                                    default=REFERENCE)
        hook = seam.choose_training_args_hook(config.getoption("llmload_training_args_hook"), config.getini(HOOK_INI))
        declared = ((field, every_setting[key], parse) for key, field, parse in seam.declaration_parsers())
        loader_declarations = tuple((field, parse(*given)) for field, given, parse in declared if given)
    except seam.LoaderSpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    return Configuration(loader=loader, training_args_hook=hook, loader_declarations=loader_declarations,
                         trains=frozenset(key for key in TRAINING_DECLARATIONS if every_setting[key]),
                         strict=bool(every_setting["strict"]), settings=types.MappingProxyType(every_setting),
                         import_spec=seam.import_loader)


def configuration_of(config: pytest.Config) -> Configuration:
    """The run's configuration as the plugin read it at configure; every default where the run configured nothing."""
    return config.stash.get(configuration_key, UNCONFIGURED)


def _with_a_loader(config: pytest.Config) -> Configuration:
    """The run's configuration, with the reference loader where the run configured none (kept for the run)."""
    configuration = configuration_of(config)
    if configuration.loader is None:
        from pytest_llmload.fixes.reference_loader import REFERENCE
        from pytest_llmload.loader import seam

        configuration = config.stash[configuration_key] = Configuration(loader=REFERENCE,
                                                                        import_spec=seam.import_loader)
    return configuration


@pytest.fixture(scope="session")
def llmload_offline():
    """Request it to run a test offline: during the test's setup, call and teardown (and only then) the hub is
    offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE set) and connections and name lookups to
    anything but loopback fail, naming who tried. Every llmload fixture requests it.

    The fixture itself does nothing: the plugin enters the guard around each phase of every test whose fixture
    closure contains it (``pytest_llmload.system.offline.offline()``) and restores the process afterwards, so that
    the tests of a suite that never asked for it run as they would without the plugin."""
    return None


@pytest.fixture(scope="session")
def llmload_checkpoint_factory(tmp_path_factory, llmload_offline) -> Callable[..., Path]:
    """Build tiny sharded safetensors checkpoints: ``factory(arch="llama"|"qwen2", dtype=..., seed=0) -> Path``.

    Cached per session and per xdist worker (each worker has its own base temp dir).
    """
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("llmload-checkpoints")

    def factory(arch: str = "llama", *, dtype: str = "float32", seed: int = 0) -> Path:
        key = (arch, dtype, seed)
        if key not in cache:
            cache[key] = build_tiny_checkpoint(root / f"{arch}-{dtype}-seed{seed}", arch, dtype=dtype, seed=seed)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def llmload_checkpoint(llmload_checkpoint_factory) -> Path:
    """Path of a tiny Llama checkpoint (float32, several safetensors shards, local tokenizer, no pad token)."""
    return llmload_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def llmload_loader(request, llmload_offline) -> LoaderUnderTest:
    """The loader under test (``--llmload-loader``, ``$PYTEST_LLMLOAD_LOADER``, ini ``llmload_loader``,
    else the built-in reference loader), called as ``llmload_loader(LoadRequest) -> LoadResult``."""
    from pytest_llmload.loader.seam import LoaderSpecError, as_loader_under_test

    configuration = _with_a_loader(request.config)
    choice = configuration.loader
    try:
        loader = declared_by_configuration(as_loader_under_test(configuration.loader_function, name=choice.spec,
                                                                source=choice.source), request.config)
    except LoaderSpecError as exc:  # normally caught at collection; here for plugins loaded by hand
        pytest.fail(str(exc), pytrace=False)
    return loader


def declared_by_configuration(loader: "LoaderUnderTest", config: pytest.Config) -> "LoaderUnderTest":
    """``loader`` with what the configuration declares about it (``llmload_loader_purposes`` and
    ``llmload_loader_dtypes`` win over the loader's own attribute; ``llmload_not_applicable`` adds to it, the
    configuration's reason first), and its not-applicable declarations checked against the checks' names."""
    from pytest_llmload.loader.seam import LoaderSpecError

    for field, value in configuration_of(config).loader_declarations:
        if field == "not_applicable":
            value += tuple(pair for pair in loader.not_applicable if pair[0] not in dict(value))
        loader = loader._replace(**{field: value})
    if loader.not_applicable:
        from pytest_llmload.plugin.parametrize import all_checks
        from pytest_llmload.config.stash_keys import checks_key

        names = {check.name for check in config.stash.get(checks_key, None) or all_checks()}
        unknown = sorted({name for name, _ in loader.not_applicable} - names - {n.removesuffix("_cuda") for n in names})
        if unknown:
            raise LoaderSpecError(
                f"loader {loader.name} declares {unknown} not applicable, which are not checks; the checks are: "
                f"{', '.join(sorted(names))}. Fix the name in llmload_not_applicable.")
    return loader


@pytest.fixture(scope="session")
def llmload_device() -> str:
    """``"cuda:0"`` where a GPU is visible, else ``"cpu"``."""
    from pytest_llmload.system import gpus

    return "cuda:0" if gpus.visible_gpu_count() > 0 else "cpu"


@pytest.fixture
def llmload_load(llmload_loader, llmload_checkpoint, llmload_device) -> Callable[..., LoadResult]:
    """Load through the loader under test: ``llmload_load(purpose="train", lora=True) -> LoadResult``.

    Keyword arguments are :class:`~pytest_llmload.LoadRequest` fields; the model path defaults to the
    tiny checkpoint and the device to ``llmload_device``.
    """
    from pytest_llmload.loader.seam import as_loader_under_test
    from pytest_llmload.loader.request import LoadRequest

    def load(**fields) -> LoadResult:
        fields.setdefault("model_path", llmload_checkpoint)
        fields.setdefault("device", llmload_device)
        return as_loader_under_test(llmload_loader)(LoadRequest(**fields))

    return load


@pytest.fixture
def llmload_run(request, tmp_path):
    """Run one of the repo's own commands as ``python -m pytest_llmload run`` does (tiny weights, bounded, every
    known failure watched): ``llmload_run(command, steps=None, deadline=None, models=None, cwd=None)`` returns its
    rows (:class:`~pytest_llmload.plugin.command_items.CommandResult`: ``.rows``, ``.command_row``,
    ``.row("fp16-unscale")``, ``.assert_no_known_failure()``). The options default to the settings
    ``llmload_command_steps``, ``_deadline``, ``_models``; the command runs in the rootdir, its temporary files
    under ``tmp_path``::

        def test_training_runs(llmload_run):
            llmload_run("python train.py --config configs/ci.json").assert_no_known_failure()
    """
    from pytest_llmload.plugin.command_items import command_runner

    return command_runner(request.config, tmp_path)


@pytest.fixture
def gpu_model(llmload_load):
    """The tiny model loaded through the loader under test onto ``cuda:0``; marks the test ``gpu`` and skips
    it where no GPU is visible."""
    from pytest_llmload.system import gpus

    reason = gpus.skip_reason(1)
    if reason is not None:
        pytest.skip(f"gpu_model {reason}")
    return llmload_load(device="cuda:0").model


@pytest.fixture
def lora_model(llmload_load):
    """The tiny model, loaded for training through the loader under test and wrapped with a LoRA adapter
    (peft, on q_proj/v_proj) unless the loader already did; only adapter weights are trainable."""
    model = llmload_load(purpose="train", lora=True).model
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    model.train()
    return model


@pytest.fixture
def llmload_tokenizer(llmload_checkpoint):
    """The tiny checkpoint's tokenizer (local files only; its pad token is unset, as in write-up 000)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llmload_checkpoint, local_files_only=True)


@pytest.fixture
def distributed_env(request, llmload_offline):
    """Run a function on N ranks of a real torch.distributed process group and get each rank's result.

    ``distributed_env.run(fn, world_size=2, *, args=(), kwargs=None, backend=None, deepspeed=False,
    timeout=60, env=None) -> [result of rank 0, result of rank 1, ...]``. The ranks are forked from the test
    process (GPU ranks from a forkserver), with ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``MASTER_ADDR``/
    ``MASTER_PORT`` set and the default process group up: gloo on CPU, nccl (one GPU per rank) where a GPU
    is visible. Too few GPUs for the ranks skips the test with the counts. A rank that raises fails the test
    with its traceback; one still running at ``timeout`` with every rank's thread stacks; one that dies with
    its exit code or signal. Functions and results must pickle on GPU (forkserver); on CPU only results::

        def all_reduce_ranks():
            import torch, torch.distributed as dist
            t = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(t)
            return t.item()

        def test_all_reduce(distributed_env):
            assert distributed_env.run(all_reduce_ranks, world_size=2, backend="gloo") == [3.0, 3.0]

    When pytest itself runs under a launcher (``torchrun ... -m pytest``, see
    :mod:`pytest_llmload.plugin.launched_run`), the test runs on every rank, and ``run`` runs ``fn`` on this
    process's rank of the launcher's job instead of forking ranks; ``world_size`` must be the job's.
    """
    from pytest_llmload.plugin.launched_run import meeting_of
    from pytest_llmload.system import gpus

    if meeting_of(request.config) is not None:  # under a launcher: its object (imported only there)
        from pytest_llmload.plugin import launched_env

        return launched_env.distributed_env_for(request, gpus.visible_gpu_count, pytest.skip)
    from pytest_llmload.runners.ranks import DistributedEnv

    return DistributedEnv(gpus.visible_gpu_count, pytest.skip)


@pytest.fixture(scope="session")
def llmload_check_options(request) -> dict:
    """Options the configuration gives the checks: ``prepare_args``, the training script's hook for the Trainer
    check (``--llmload-training-args-hook``, else the ini key ``llmload_training_args_hook``; else the loader's
    own attribute, read by the check), and how the repo trains (``trains_without_trainer``,
    ``trains_under_deepspeed``: ``--llmload-trains-...``, the ini key, else the loader's attribute). A test with a ``check`` parameter gets them without asking; pass them
    on elsewhere: ``check(loader, checkpoint, tmp_path, **llmload_check_options)``."""
    return check_options(request.config)


def check_options(config: pytest.Config) -> dict:
    """The options of :func:`llmload_check_options`, read from the configuration (a bad hook fails the test)."""
    from pytest_llmload.loader.seam import LoaderSpecError

    try:  # normally checked at collection (a usage error); here for a plugin loaded by hand
        return configuration_of(config).check_options()
    except LoaderSpecError as exc:
        pytest.fail(str(exc), pytrace=False)
