"""A pytest plugin for bench_test_command.py --by-file: each test's CPU time, appended to $LLMLOAD_BENCH_CPU_LOG.

Per test: the CPU (user + system) of the pytest process running it, and of the children it waited for in that time
(new interpreters, forked children, ranks, xdist workers of an inner run: a child counts once reaped), and its wall
time. Loaded with ``-p _cpu_per_test`` and this directory on ``PYTHONPATH``; xdist's workers append to the same file.
"""

import os
import resource
import time

import pytest


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own, children), start = _cpu(), time.monotonic()
    yield
    own_after, children_after = _cpu()
    line = f"{item.nodeid}\t{own_after - own:.3f}\t{children_after - children:.3f}\t{time.monotonic() - start:.3f}\n"
    fd = os.open(os.environ["LLMLOAD_BENCH_CPU_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of one line: the workers' lines never interleave
    finally:
        os.close(fd)
