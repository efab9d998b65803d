"""``python -m pytest_llmload`` (``llmload``): the command line, the pytest process it starts and follows, and the
table it prints. ``from pytest_llmload.main_job import run`` keeps working."""

from pytest_llmload.main_job.job import (  # noqa: F401  (the public path)
    Interrupted,
    MainJob,
    UsageError,
    build_parser,
    json_document,
    json_records,
    pytest_command,
    run,
    summary_table,
    usable_cpus,
)
