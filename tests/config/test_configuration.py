"""The run's configuration is read once, into one frozen record on ``config.stash`` that every reader takes as it is:
every setting read at configure, the loader (and the training-args hook) imported once a run, and a value given by
an option, the ini file, the environment or the loader's own attribute seen the same by the plugin, its fixtures and
the checks."""

import re

import pytest

from pytest_llmload.loader import seam

LOADERS = """
def load(request):
    raise AssertionError("not called in these tests")

def declaring(request):
    raise AssertionError("not called in these tests")

declaring.llmload_trains_with_trainer = True  # the loader's own attribute

def hook(model, args):
    return args
"""

# Every reader of the loader spec and of one training declaration, printed one line each.
READERS = """
import dataclasses

import pytest

from pytest_llmload.checks.base import Check, KnownFailure
from pytest_llmload.config import settings
from pytest_llmload.config.stash_keys import configuration_key
from pytest_llmload.fixes.reference_loader import chosen_loader


def spy(loader, checkpoint, workdir, *, trains_with_trainer=False, prepare_args=None):
    print(f"READ check {trains_with_trainer} {prepare_args is not None}")


SPY = Check(spy, KnownFailure("spy", "a spy", "-", (), "-", "-", "-"))


@pytest.mark.parametrize("check", [SPY])
def test_a_check_gets_the_configuration_without_asking(check, llmload_loader, tmp_path):
    check(llmload_loader, tmp_path, tmp_path)


def test_every_reader_sees_the_same(request, monkeypatch, llmload_loader, llmload_check_options, tmp_path):
    configuration = request.config.stash[configuration_key]
    with pytest.raises(dataclasses.FrozenInstanceError):
        configuration.strict = True
    # read once, at configure: an option or a variable changed afterwards is no reader's business
    monkeypatch.setattr(request.config.option, "llmload_loader", "changed:later")
    monkeypatch.setenv("PYTEST_LLMLOAD_LOADER", "changed:later")
    print(f"READ setting {settings.value(request.config, 'loader')}")
    print(f"READ loader {llmload_loader.name} ({llmload_loader.source}) = {chosen_loader(request.config)}")
    print(f"READ configuration {configuration.declares('trains_with_trainer', llmload_loader)}")
    print(f"READ fixture {llmload_check_options.get('trains_with_trainer', False)}")
    SPY(llmload_loader, tmp_path, tmp_path, **llmload_check_options)
"""


@pytest.fixture
def repo(pytester, monkeypatch):
    pytester.makepyfile(my_loaders=LOADERS, test_readers=READERS)
    monkeypatch.syspath_prepend(pytester.path)
    monkeypatch.delenv("PYTEST_LLMLOAD_LOADER", raising=False)
    return pytester


# Each value by one source, the others beneath it where one is (the loader: option > env > ini; a training
# declaration: option > ini > the loader's attribute); every reader prints the same, and the loader and the hook are
# imported once (before: the loader at collection and by its fixture; the hook at collection, by its fixture and
# around every check's call: 5 imports in this run).
@pytest.mark.parametrize(("argv", "env", "ini", "loader"), [
    (["--llmload-loader=my_loaders:load", "--llmload-trains-with-trainer"], "my_loaders:declaring",
     "llmload_loader = my_loaders:declaring\n", "my_loaders:load (--llmload-loader)"),
    ([], "my_loaders:declaring", "llmload_loader = my_loaders:load\n",
     "my_loaders:declaring ($PYTEST_LLMLOAD_LOADER)"),
    ([], None, "llmload_loader = my_loaders:load\nllmload_trains_with_trainer = true\n",
     "my_loaders:load (ini 'llmload_loader')"),
], ids=["option", "env-and-the-loaders-attribute", "ini"])
def test_every_reader_sees_a_value_as_its_source_gave_it_and_the_loader_is_imported_once(repo, monkeypatch, argv,
                                                                                          env, ini, loader):
    imports = []

    def counted(choice):
        imports.append(choice.spec)
        return real(choice)

    real = seam.import_loader
    monkeypatch.setattr(seam, "import_loader", counted)
    if env:
        monkeypatch.setenv("PYTEST_LLMLOAD_LOADER", env)
    repo.makeini(f"[pytest]\nllmload_training_args_hook = my_loaders:hook\n{ini}")
    result = repo.runpytest("-s", *argv)
    result.assert_outcomes(passed=2)
    spec, source = loader.split(" ", 1)
    assert f"llmload: loader {spec} (from {source[1:-1]}); " in result.stdout.str()  # the header
    reads = re.findall(r"READ .*", result.stdout.str())  # (after the progress dots: -s)
    assert reads == ["READ check True True",
                     f"READ setting {spec}",
                     f"READ loader {spec} {source} = LoaderChoice(spec={spec!r}, source={source[1:-1]!r})",
                     "READ configuration True", f"READ fixture {'my_loaders:declaring' not in loader}",
                     "READ check True True"]
    assert sorted(imports) == sorted(["my_loaders:hook", spec])
