"""``python -m pytest_llmload`` (``llmload``): the command line and its usage errors (:mod:`.cli`), the pytest process
it starts and follows, with interrupts and exit codes (:mod:`.process`), and the table and ``--json``
document it prints from what that process reports (:mod:`.table`). The parent process imports no check: every
row, and what it guards against, comes from the child's progress file."""
