"""Every known failure has its homes, all found from its id: its module in ``pytest_llmload/failures/`` (catalog
entry and checks), its before-loader ``fixtures/loaders/before_<id>.py`` and its regression tests
``tests/failures/test_<id>.py``; the catalog, the check registry, the predictions' failures and the docs' tables
are built from those modules alone (docs/contributing.md: adding a failure touches those three files)."""

import importlib
import inspect
import pickle
from pathlib import Path

import pytest

from fixtures.docs_hooks import docs_hooks
from pytest_llmload import failures
from pytest_llmload.checks.base import Check, KnownFailure

ROOT = Path(__file__).resolve().parents[2]
IDS = [module.FAILURE.id for module in failures.MODULES]


@pytest.mark.parametrize("failure_id", IDS)
def test_every_failure_has_its_module_before_loader_and_tests(failure_id):
    stem = failure_id.replace("-", "_")
    failure = failures.BY_ID[failure_id]
    module = importlib.import_module(f"pytest_llmload.failures.{stem}")
    assert module.FAILURE is failure
    homes = docs_hooks().homes(failure)  # this repository's files: the docs and these tests name them, not the package
    assert homes == {"catalog entry and checks": f"pytest_llmload/failures/{stem}.py",
                     "before-loader": f"fixtures/loaders/before_{stem}.py",
                     "regression tests": f"tests/failures/test_{stem}.py"}
    missing = [path for path in homes.values() if not (ROOT / path).is_file()]
    assert not missing, f"{failure_id} lacks {missing}"
    assert importlib.import_module(f"fixtures.loaders.before_{stem}").load


def test_no_module_in_the_package_or_the_loaders_without_a_failure():
    stems = {failure_id.replace("-", "_") for failure_id in IDS}
    package = {p.stem for p in (ROOT / "pytest_llmload" / "failures").iterdir() if p.name != "__pycache__"}
    before = {p.stem.removeprefix("before_") for p in (ROOT / "fixtures" / "loaders").glob("before_*.py")}
    tests = {p.stem.removeprefix("test_") for p in (ROOT / "tests" / "failures").glob("test_*.py")} - {"homes"}
    assert package - {"__init__"} == stems and before == stems and tests == stems


def test_the_modules_are_found_not_listed_and_come_in_the_catalogs_order():
    # pytest_llmload/failures/__init__.py names no module: every module of the package is a failure, in the order
    # its FAILURE.order gives (the registry's, the main job's rows', the tables').
    init = (ROOT / "pytest_llmload" / "failures" / "__init__.py").read_text()
    assert not any(f"{module.__name__.rpartition('.')[2]}," in init for module in failures.MODULES)
    orders = [failure.order for failure in failures.CATALOG]
    assert orders == sorted(orders) and len(set(orders)) == len(orders) and 0 not in orders
    assert IDS[:5] == ["meta-backward", "offload-hang", "inference-stall", "dp-dtype", "distributed-device-map"]


def test_the_docs_tables_have_every_failure_and_are_current():
    # The known-failures table of README.md and of the docs' home page, and the failures' index page, are made from
    # the catalog (docs/hooks.py); a new failure appears in each with nothing else edited but its module.
    hooks = docs_hooks()
    for linked in (False, True):
        rows = [line for line in hooks.known_failures_table(linked).splitlines()[2:]]
        assert [row.split(" | ")[0] for row in rows] == [
            f"| [`{failure_id}`](failures/{failure_id}.md)" if linked else f"| `{failure_id}`" for failure_id in IDS]
    index = hooks.failures_index()
    assert all(f"| [{failure_id}]({failure_id}.md) |" in index for failure_id in IDS)
    for name, linked in hooks.TABLE_HOMES.items():
        text = (ROOT / name).read_text(encoding="utf-8")
        assert hooks.with_known_failures_table(text, linked) == text, (
            f"{name}'s known-failures table is not the catalog's: run `python docs/hooks.py`")


def test_a_failures_record_holds_what_the_failure_is_and_nothing_of_this_repository_or_its_docs():
    # An installed wheel has no fixtures/ or tests/, and the docs' table cells are the docs' (issue 47, 5).
    assert not {"homes", "module", "symptom", "occurs_briefly", "reproduced_here", "predicted_by"} & set(dir(KnownFailure))
    hooks = docs_hooks()
    assert set(hooks.TABLE_CELLS) <= set(IDS)
    new = failures.BY_ID[IDS[0]]._replace(id="made-up", title="a made-up failure", occurs="on no machine")
    cells = hooks.table_cells(new)  # a failure without its row yet: its title and where it occurs
    assert (cells.symptom, cells.occurs_briefly, cells.reproduced_here) == ("a made-up failure", "on no machine", "")


@pytest.mark.parametrize("failure_id", IDS)
def test_every_check_function_is_registered_under_its_own_failure(failure_id):
    module = importlib.import_module(f"pytest_llmload.failures.{failure_id.replace('-', '_')}")
    assert isinstance(module.FAILURE, KnownFailure)
    defined = {name for name, f in inspect.getmembers(module, inspect.isfunction)
               if name.startswith("check_") and f.__module__ == module.__name__}
    assert {check.name.removesuffix("_cuda") for check in module.CHECKS} == defined
    assert all(isinstance(check, Check) and check.failure is module.FAILURE for check in module.CHECKS)


def test_the_catalog_and_the_registry_are_built_from_the_modules():
    assert failures.CATALOG == tuple(module.FAILURE for module in failures.MODULES)
    assert set(failures.REGISTRY) == {check for module in failures.MODULES for check in module.CHECKS}
    assert len({check.name for check in failures.REGISTRY}) == len(failures.REGISTRY)
    names = [c.name for c in failures.REGISTRY]
    on_gpus = [c for c in failures.REGISTRY if c.needs_gpus]
    assert on_gpus and all(c.name.endswith("_cuda") and c.name.removesuffix("_cuda") in names for c in on_gpus)
    assert names.index(on_gpus[0].name) == len(names) - len(on_gpus)  # the CPU checks first, then the GPU ones
    assert all(c.summary for c in failures.REGISTRY), [c.name for c in failures.REGISTRY if not c.summary]


def test_every_check_function_goes_by_pickle_to_a_forkserver_child():
    # From a process that has initialised CUDA (a GPU test run), an isolated check starts in a forkserver child and
    # its function travels by pickle: a closure there broke every *_cuda check on the first H200 run.
    from pytest_llmload.plugin.parametrize import all_checks

    for check in all_checks():
        copy = pickle.loads(pickle.dumps(check.function))
        assert getattr(copy, "__name__", None) == getattr(check.function, "__name__", None), check.name


def report_device(loader, checkpoint, workdir, *, device="cpu"):
    return device


def test_a_gpu_variant_runs_in_a_forkserver_child_on_cuda_0(tmp_path):
    from pytest_llmload.runners.isolation import run_isolated

    on_cuda = Check(report_device, failures.BY_ID[IDS[0]]).on_gpu()
    assert on_cuda.name == "report_device_cuda" and on_cuda.needs_gpus == 1
    assert run_isolated(on_cuda.function, (None, tmp_path, tmp_path), start="forkserver", timeout=50) == "cuda:0"
