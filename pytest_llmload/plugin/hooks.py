"""pytest-llmload's pytest plugin (entry point ``pytest11: llmload``): what pytest imports on every run, and the one
place its hooks are gathered for the entry point's module (``plugin/__init__.py``), where pytest finds them by name.

Most runs of a repo that installs the plugin never use it, so at start-up this module imports only the plugin's
vocabulary (:mod:`pytest_llmload.config.vocabulary`: every option, ini key and marker, declared there), its fixtures
(:mod:`pytest_llmload.plugin.fixtures`) and its hooks, one module a concern, each importing what it works with only
when a run needs it:

- :mod:`~pytest_llmload.plugin.gates`: the sub-plugins (``SUB_PLUGINS``), each a light gate opened on one stash flag;
- :mod:`~pytest_llmload.plugin.configuration`: every setting read once at configure, into the one ``Configuration``;
- :mod:`~pytest_llmload.plugin.collection`: whether a run uses the plugin, what its tests require, the configured
  loader imported before any test runs, the header line;
- :mod:`~pytest_llmload.plugin.check_row`: a check's row at its report, and the known-failure section of any
  failing test (the catalog is imported on the first failure).
"""

from __future__ import annotations

import pytest

from pytest_llmload.plugin.check_row import (  # noqa: F401  (the hooks pytest finds on the entry point's module)
    pytest_report_teststatus,
    pytest_runtest_call,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)
from pytest_llmload.plugin.collection import (  # noqa: F401
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_ignore_collect,
    pytest_report_header,
    pytest_sessionstart,
    pytest_xdist_node_collection_finished,
)
from pytest_llmload.plugin.configuration import pytest_addoption, pytest_configure, pytest_unconfigure  # noqa: F401
from pytest_llmload.plugin.fixtures import (  # noqa: F401  (pytest discovers fixtures on the plugin module)
    distributed_env,
    gpu_model,
    llmload_check_options,
    llmload_checkpoint,
    llmload_checkpoint_factory,
    llmload_device,
    llmload_load,
    llmload_loader,
    llmload_offline,
    llmload_run,
    llmload_tokenizer,
    lora_model,
)
from pytest_llmload.plugin.gates import pytest_cmdline_main  # noqa: F401


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_llmload.plugin import hookspecs

    pluginmanager.add_hookspecs(hookspecs)
