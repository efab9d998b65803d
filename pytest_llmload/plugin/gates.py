"""The sub-plugins' gates: each sub-plugin (:data:`SUB_PLUGINS`) is registered once, as a light :class:`Gate`, and
switched on by one stash flag, set where the run's need becomes known; the gate imports and registers its module the
first time it finds the flag set:

- :data:`in_use_key`, the sub-plugins every use of the plugin needs: set when the run configures the plugin (one of
  its options, ini keys or ``$PYTEST_LLMLOAD_LOADER`` set: a bad value is then a usage error at once), runs under
  ``pytest -n`` (the controller sums up what its workers report) or under torchrun/srun/mpirun, or, after
  collection, when a collected test uses an llmload fixture or marker, or the test modules imported the plugin's
  checks (``parametrize_with_loader_checks``);
- :data:`xdist_controller_key` (``pytest -n``'s controller), :data:`launched_key` (torchrun/srun/mpirun): one
  sub-plugin each.
"""

from __future__ import annotations

import os

import pytest

# The flags that switch the sub-plugins on: what this run needs, each set where that becomes known.
in_use_key = pytest.StashKey[bool]()  # the run uses the plugin (configures it, xdist's controller, a launcher, a test)
xdist_controller_key = pytest.StashKey[bool]()  # pytest -n's controller (pytest_cmdline_main)
launched_key = pytest.StashKey[bool]()  # under torchrun/srun/mpirun (pytest_cmdline_main)

XDIST_GPUS = "pytest_llmload.plugin.xdist_gpus"  # under pytest -n: each xdist worker its own GPUs
LAUNCHER = "pytest_llmload.plugin.launched_run"  # under torchrun/srun/mpirun: distributed_env tests on every rank

# The sub-plugins, by module name (their hooks only: every option, ini key and marker is declared in
# config.vocabulary), and the one flag that switches each on.
SUB_PLUGINS = {
    "pytest_llmload.plugin.isolated_marker": in_use_key,  # llmload_isolated: the test body in a forked child
    "pytest_llmload.reports.sections": in_use_key,  # phase tables, device-map summaries, the session summary
    "pytest_llmload.plugin.memory_limit": in_use_key,  # limit_torch_memory
    "pytest_llmload.plugin.loader_hang": in_use_key,  # after the loader hangs once, the rest fail at once
    "pytest_llmload.plugin.phase_state": in_use_key,  # markers enforced; offline mode, DeepSpeed only where needed
    "pytest_llmload.reports.html_report": in_use_key,  # --llmload-html, pytest-html extras: device maps, memory
    "pytest_llmload.plugin.interruption": in_use_key,  # SIGTERM/SIGHUP, the run deadline: the reports still written
    "pytest_llmload.plugin.command_items": in_use_key,  # llmload_commands: the repo's commands as test items
    XDIST_GPUS: xdist_controller_key,
    LAUNCHER: launched_key,
}
# The two a run needs before it configures (xdist asks xdist_gpus for `-n auto`'s count in its own
# pytest_cmdline_main; a launcher's rank meets the others at configure, first): their gates are registered in
# pytest_cmdline_main, the others' in pytest_configure, after the flags a configuration sets.
BEFORE_CONFIGURE = (XDIST_GPUS, LAUNCHER)


class Gate:
    """A sub-plugin as the run registers it, once: a light stand-in that imports and registers the module (the one
    place any sub-plugin is registered) the first time it finds the module's flag set: when the gate is
    registered, or after collection. A module registered after configure has its ``pytest_configure`` called at
    once (pytest replays the historic hook)."""

    def __init__(self, module: str) -> None:
        self.module = module

    def open(self, config: pytest.Config) -> None:
        if config.stash.get(SUB_PLUGINS[self.module], False) and not config.pluginmanager.has_plugin(self.module):
            from importlib import import_module

            config.pluginmanager.register(import_module(self.module), self.module)

    @pytest.hookimpl(trylast=True)  # after this plugin's own, which sets the flag when a collected test uses it
    def pytest_collection_modifyitems(self, config: pytest.Config) -> None:
        self.open(config)


def register_gates(config: pytest.Config, modules) -> None:
    for module in modules:
        gate = Gate(module)
        config.pluginmanager.register(gate, f"{module} (gate)")
        gate.open(config)


def under_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None)
                                                       or getattr(config.option, "tx", None))


@pytest.hookimpl(wrapper=True)  # before xdist's own (tryfirst) one, which asks xdist_gpus for `-n auto`'s count
def pytest_cmdline_main(config: pytest.Config):
    # Every launcher sets MASTER_ADDR and MASTER_PORT (launcher.detect reads the rest).
    config.stash[launched_key] = bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
    config.stash[xdist_controller_key] = under_xdist_controller(config)
    if config.stash[launched_key] or config.stash[xdist_controller_key]:
        config.stash[in_use_key] = True
    register_gates(config, BEFORE_CONFIGURE)
    return (yield)
