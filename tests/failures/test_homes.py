"""Every known failure has its homes, all found from its id: its module in ``pytest_llmload/failures/`` (catalog
entry and checks), its before-loader ``fixtures/loaders/before_<id>.py`` and its regression tests
``tests/failures/test_<id>.py``; the catalog, the check registry, the predictions' failures and the docs' tables
are built from those modules alone (docs/contributing.md: adding a failure touches those three files)."""

import importlib
import inspect
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
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


# A 12th failure as a contributor adds it (docs/contributing.md): its module, its before-loader, its regression tests.
MADE_UP_FAILURE = {
    "pytest_llmload/failures/made_up_failure.py": '''
        """made-up-failure: a failure made up by tests/failures/test_homes.py, added with its three files only."""
        from pytest_llmload.checks.base import Check, KnownFailure

        FAILURE = KnownFailure(id="made-up-failure", order={order}, title="a made-up failure", write_up="a test",
                               signatures=(r"made-up failure text",), root_cause="none", fix="none", occurs="nowhere")


        def check_made_up_failure(loader, checkpoint, workdir):
            """The made-up failure's check."""


        CHECKS = (Check(check_made_up_failure, FAILURE),)
    ''',
    "fixtures/loaders/before_made_up_failure.py": '''
        """made-up-failure, the loader before its fix."""


        def load(request):
            raise AssertionError("made-up failure text")
    ''',
    "tests/failures/test_made_up_failure.py": '''
        """made-up-failure, reproduced by this module."""


        def test_made_up_failure():
            pass
    ''',
}

# What reads the failures, run on the copy: the catalog, the registry and the shipped suite's checks, the docs'
# generated pages and tables, and every rule of tests/test_layout.py that takes no argument.
ON_THE_COPY = '''
import importlib.util, inspect, json, sys
from pathlib import Path

root = Path(sys.argv[1])
sys.path.insert(0, str(root))
import pytest_llmload
from pytest_llmload import failures
from pytest_llmload.plugin.parametrize import all_checks

assert Path(pytest_llmload.__file__).parent == root / "pytest_llmload", pytest_llmload.__file__


def loaded(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = loaded("hooks", root / "docs" / "hooks.py")
layout = loaded("layout", root / "tests" / "test_layout.py")
rules = [name for name, rule in vars(layout).items()
         if name.startswith("test_") and callable(rule) and not inspect.signature(rule).parameters]
for name in rules:
    getattr(layout, name)()
failure = failures.BY_ID["made-up-failure"]
print(json.dumps({"catalog": [f.id for f in failures.CATALOG], "registry": [c.name for c in failures.REGISTRY],
                  "suite": [c.name for c in all_checks()], "matched": [f.id for f in failures.match("made-up failure text")],
                  "readme": hooks.with_known_failures_table((root / "README.md").read_text(), False),
                  "index": hooks.failures_index(), "page": hooks.failure_page(failure), "rules": rules}))
'''


def test_a_12th_failure_is_its_three_files_and_nothing_else(tmp_path):
    # A copy of the repository's package, docs generator and layout rules, with a made-up failure's three files
    # added: every reader accepts it, and no other file was edited (issue 47, 6).
    shutil.copytree(ROOT / "pytest_llmload", tmp_path / "pytest_llmload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path in ("docs/hooks.py", "docs/layout.md", "tests/test_layout.py", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    order = max(failure.order for failure in failures.CATALOG) + 1
    for path, text in MADE_UP_FAILURE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text).lstrip().replace("{order}", str(order)))
    run = subprocess.run([sys.executable, "-c", ON_THE_COPY, str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["catalog"] == IDS + ["made-up-failure"] and seen["matched"] == ["made-up-failure"]
    assert "check_made_up_failure" in seen["registry"] and "check_made_up_failure" in seen["suite"]
    assert "| `made-up-failure` | a made-up failure | a test | nowhere | `tests/failures/test_made_up_failure.py` |" \
        in seen["readme"]
    assert "| [made-up-failure](made-up-failure.md) |" in seen["index"]
    assert "made-up-failure, the loader before its fix." in seen["page"]
    assert "made-up-failure, reproduced by this module." in seen["page"]
    assert {"test_no_module_imports_a_higher_layer", "test_no_string_in_the_code_names_a_module_of_a_higher_layer",
            "test_the_layout_page_names_every_module_and_the_layers_in_order"} <= set(seen["rules"])
