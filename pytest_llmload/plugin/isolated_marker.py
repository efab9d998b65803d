"""The ``llmload_isolated`` marker: run a test's body in a child forked from the test process.

::

    @pytest.mark.timeout(60)
    @pytest.mark.llmload_isolated(timeout=30)
    def test_guard_patches_sockets(llmload_checkpoint):
        os.environ["HF_HUB_OFFLINE"] = "1"  # gone with the child
        ...

Fixtures are set up and torn down here, in the test process; the child inherits their values (a loaded
model too, copy-on-write: the child may change it, the next test sees the original). The test process
enforces the deadline and, when it is hit, fails the test with the child's thread stacks; a child that dies
fails it with the signal or exit code; an exception fails it with the child's own report (pytest's
assertion text included). An isolated test cannot run in a process that has initialised CUDA (a forked
child cannot use it): do CUDA work inside isolated tests, never in the fixtures they use.
"""

from __future__ import annotations

import functools
import inspect
import sys

import pytest

from pytest_llmload.plugin.markers import fail_invalid_markers, read_marker
from pytest_llmload.config.vocabulary import ISOLATED_MARKER as MARKER


def _isolated_signature(*, timeout=None):  # Python itself rejects positional or unknown arguments
    return timeout


def isolated_timeout(item: pytest.Item):
    """``(True, timeout)`` for a valid marker, ``(False, None)`` without one; the test fails on a bad one."""
    return fail_invalid_markers(item, _read_isolated)


def _read_isolated(item: pytest.Item):
    call = read_marker(item, MARKER, _isolated_signature,
                       f"expected @pytest.mark.{MARKER} or @pytest.mark.{MARKER}(timeout=<positive seconds>)")
    if call is None:
        return False, None
    timeout = call.value
    if timeout is not None:
        from pytest_llmload.runners.isolation import check_timeout  # (every isolated test imports it anyway)

        try:
            check_timeout(timeout)
        except ValueError:
            raise call.invalid(item, f"timeout={timeout!r} is not a positive, finite number") from None
    return True, timeout


def pytest_runtest_setup(item: pytest.Item) -> None:
    isolated_timeout(item)  # a bad marker errors the test before its fixtures run


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    isolated, timeout = isolated_timeout(pyfuncitem)
    if not isolated or inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    from pytest_llmload.runners import children, isolation  # imported by the first isolated test, not at plugin load

    if children.cuda_initialised():
        pytest.fail(
            f"{pyfuncitem.nodeid}: @pytest.mark.{MARKER} cannot run here: this process has initialised CUDA, and a "
            "child forked from it cannot use CUDA (its first CUDA call hangs or fails), while the test's fixtures "
            "cannot be sent to a fresh process. Do CUDA work inside isolated tests (not in fixtures such as "
            "gpu_model), or drop the marker from this test.", pytrace=False,
        )
    funcargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    isolation.run_isolated(_call_test, (pyfuncitem.obj, funcargs), timeout=timeout, start="fork",
                           label=f"isolated test {pyfuncitem.name}", render=functools.partial(_render, pyfuncitem))
    return True


def _call_test(function, funcargs) -> None:
    function(**funcargs)  # what a test returns stays in the child (it need not pickle)


def _render(item: pytest.Function, exc: BaseException):
    """In the child: the failure as pytest would report it in-process (style from --tb, assertion text). (A child
    without a test item, an isolated check, renders with :func:`pytest_llmload.runners.isolation.render_failure`.)"""
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        return None
    return str(item.repr_failure(pytest.ExceptionInfo.from_exception(exc)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if not report.failed or call.excinfo is None:
        return report
    exc = call.excinfo.value
    isolation = sys.modules.get("pytest_llmload.runners.isolation")
    if isolation is None:  # nothing ran isolated
        return report
    if isinstance(exc, isolation.IsolationFailed):
        # The test process only waited: its frames say nothing. The message has the child's stacks or signal.
        report.longrepr = str(exc)
    elif getattr(exc, "llmload_child_report", None):
        report.longrepr = exc.llmload_child_report
    return report
