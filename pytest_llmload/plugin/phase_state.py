"""Process-wide state the plugin sets for the tests that need it, and only while they run.

A downstream suite's other tests must run as they would without the plugin, whatever ran before them in the
same process (or xdist worker). So each phase of a test (setup, call, teardown; session fixtures set up inside
it included) enters, and leaves again:

- offline mode (:func:`pytest_llmload.system.offline.offline`: the hub's offline variables and constant, the network
  guard), for a test whose fixture closure has ``llmload_offline``: every llmload fixture requests it;
- DeepSpeed without its JIT-built CPU comm op, for a test that starts DeepSpeed
  (:func:`pytest_llmload.runners.ranks.deepspeed_without_shm_op`).

Before that, at setup, an invalid llmload marker errors the test, too few GPUs skip it, and after the loader
under test hung once, a later test that uses it fails at once (:mod:`pytest_llmload.plugin.loader_hang`).

Imports nothing heavy: the modules that set the state load with the first test that needs it.
"""

from __future__ import annotations

import contextlib

import pytest

from pytest_llmload.plugin import loader_hang, markers

# Why DeepSpeed cannot start in this run (set after collection, when importing it failed):
# the tests that need it error with this sentence, the others run.
deepspeed_error_key = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    # DeepSpeed's import (seconds) is paid here, outside any test's deadline, and only when a collected test
    # will start DeepSpeed; its ranks, forked later, inherit it. (They never build DeepSpeed's CPU comm op: see
    # runners/ranks.py.)
    if any(markers.will_start_deepspeed(item) for item in session.items):
        from importlib.util import find_spec

        if find_spec("deepspeed") is not None:
            from pytest_llmload.runners import ranks as distributed

            try:
                distributed.preload(("deepspeed", "deepspeed.comm.torch"))
            except Exception as exc:  # DS_ACCELERATOR='tpu', say: the DeepSpeed tests error with it, not the run
                session.config.stash[deepspeed_error_key] = distributed.deepspeed_setup_error(exc)


@pytest.hookimpl(specname="pytest_runtest_setup")  # after the skip marks (tryfirst), before the fixtures
def pytest_runtest_setup_checks(item: pytest.Item) -> None:  # (pytest reads only names starting pytest_)
    markers.enforce_needs_gpus(item)
    if deepspeed_error_key in item.config.stash and markers.will_start_deepspeed(item):
        pytest.fail(item.config.stash[deepspeed_error_key], pytrace=False)
    loader_hang.fail_if_hung_before(item)


def _state_for(item: pytest.Item) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if "llmload_offline" in getattr(item, "fixturenames", ()):
        from pytest_llmload.system.offline import offline

        stack.enter_context(offline())
    if markers.needs_deepspeed(item):
        from pytest_llmload.runners.ranks import deepspeed_without_shm_op

        stack.enter_context(deepspeed_without_shm_op())
    return stack


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _state_for(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _state_for(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    with _state_for(item):
        return (yield)
