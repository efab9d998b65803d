"""``python -m pytest_llmload`` (``llmload``): the command line and its usage errors (:mod:`.cli`), the pytest process
it starts and follows, with lanes, interrupts and exit codes (:mod:`.process`), and the table and ``--json``
document it prints from what that process reports (:mod:`.table`). The parent process imports no check: every
row, and what it guards against, comes from the child's progress file. ``from pytest_llmload.main_job import run``
keeps working."""

from pytest_llmload.main_job.cli import UsageError, build_parser, run  # noqa: F401  (the public path)
from pytest_llmload.main_job.process import (  # noqa: F401
    EXIT_FAILED,
    EXIT_NO_TESTS,
    EXIT_OK,
    EXIT_USAGE,
    INTERRUPTED,
    Interrupted,
    MainJob,
    pytest_command,
    usable_cpus,
)
from pytest_llmload.main_job.table import json_document, json_records, summary_table  # noqa: F401
