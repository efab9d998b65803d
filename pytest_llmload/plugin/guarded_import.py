"""A repo's own module imported by the plugin before any test runs (the loader's, the training-args hook's, its
checks' and the installed extensions'), one way for all of them: offline, as the checks run it (a refused network
attempt the module caught is named on the console); a progress line on the console every
``llmload_phase_progress_seconds`` while it runs long (under the main job too, through its progress file); and past
``llmload_import_timeout`` a usage error naming the line it was blocked in, with every thread's stack, from a
deadline the module cannot remove (:func:`~pytest_llmload.instruments.probes.deadline`: its own ``SIGALRM`` handler
included); where the module is blocked where no exception reaches it, the run ends with that usage error."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

import pytest


def say(config: pytest.Config, line: str) -> None:
    """``line`` on the console at once: on stderr (a plain run's console, the main job's log) and, where the main job
    follows this run, as its progress file's ``console`` event, which it prints."""
    from pytest_llmload.instruments.heartbeat import stderr_line
    from pytest_llmload.config.stash_keys import progress_key

    stderr_line(line)
    writer = config.stash.get(progress_key, None)
    if writer is not None:
        writer.write(event="console", line=line)


@contextlib.contextmanager
def importing(config: pytest.Config, module: str, what: str, source: str, remedy: str) -> Iterator[None]:
    """The block imports ``what`` (``the loader's module 'mypkg.loading'``), named by ``module`` where the user is
    told what to make quick, given by ``source`` (``--llmload-loader``); ``remedy`` says where the work at import
    belongs instead (``put it in the loader function``)."""
    from pytest_llmload.config import settings
    from pytest_llmload.instruments.heartbeat import heartbeat
    from pytest_llmload.instruments.probes import DeadlineExceeded, deadline
    from pytest_llmload.system.offline import offline

    every, limit = settings.value(config, "phase_progress_seconds"), settings.value(config, "import_timeout")
    started, key, refused = time.monotonic(), ("llmload-import", what), []
    if every:
        heartbeat().schedule(key, every, lambda _: say(
            config, f"llmload: still importing {what} ({time.monotonic() - started:.0f}s)"), every=every)

    def advice(failure: str) -> str:
        return (f"{failure}\nMake importing {module!r} quick (no work at import: {remedy}), or raise "
                "--llmload-import-timeout.")

    def end_the_run(failure: str) -> None:
        # On the watchdog's thread: the import is blocked where no exception reaches it, so the usage error is said
        # here as pytest says one (on stderr, where the main job reads every other) and the run ends with its status.
        from pytest_llmload.instruments.heartbeat import stderr_line

        with contextlib.suppress(Exception):
            sys.stdout.flush()
        stderr_line(f"ERROR: {advice(failure)}")
        os._exit(pytest.ExitCode.USAGE_ERROR)

    try:
        with offline(refused), deadline(limit, f"importing {what} ({source})", on_stuck=end_the_run):
            yield
    except DeadlineExceeded as exc:
        raise pytest.UsageError(advice(str(exc))) from None
    finally:
        heartbeat().cancel(key)
    if refused:  # the module caught the refusal and went on: it imported, but it reaches out where nothing may
        say(config, f"llmload: importing {what} ({source}) reached for the network {len(refused)} time(s), refused "
                    f"(the checks run offline): {refused[0]}{' (and more)' if len(refused) > 1 else ''}; make "
                    f"importing {module!r} need no network.")
