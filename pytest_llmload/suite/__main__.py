"""``python -m pytest_llmload.suite [pytest arguments]``: pytest, as the main job runs it.

The same as ``python -m pytest``, except that the process ends with ``os._exit`` once pytest has returned, its
output is flushed and the ``atexit`` handlers have run: the interpreter's own teardown, with torch, transformers
and DeepSpeed loaded (C++ destructors, the module graph), takes about 2 s on 2 cores (main job measured 11.8 s
against 13.5-14.3 s) and does nothing this run needs.
"""

import atexit
import os
import sys

import pytest

if __name__ == "__main__":
    code = pytest.main(sys.argv[1:])
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
