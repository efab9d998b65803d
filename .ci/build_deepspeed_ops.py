"""Build DeepSpeed's CPU shared-memory comm op before the tests run (tox's commands_pre, .ci/run).

DeepSpeed JIT-compiles it (C++, ninja) in the first ``init_distributed`` of a CPU run: 30-90 s on a
loaded 2-core machine, inside the distributed tests' 60 s deadline, with every rank waiting on the build
lock. Built once here into ``$TORCH_EXTENSIONS_DIR``, each rank only loads it. Without DeepSpeed, or where
its op builder says the op does not apply, there is nothing to do.

Run it with the PATH that pytest will have (the env activated): torch builds with the first ``ninja`` on
PATH, and a ninja of another version rejects the build log ("build log version is too old") and rebuilds.
"""

import glob
import importlib.util
import os
import shutil
import sys
import time

STALE_LOCK_S = 600


def main() -> int:
    if importlib.util.find_spec("deepspeed") is None:
        print("build_deepspeed_ops: deepspeed is not installed, nothing to build")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        print(f"build_deepspeed_ops: accelerator {get_accelerator().device_name()!r}, not cpu: nothing to build")
        return 0
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible():
        print(f"build_deepspeed_ops: DeepSpeed {deepspeed.__version__} has no compatible CPU shm op, nothing to build")
        return 0
    where = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    # A build killed midway (a rank at its deadline) leaves torch's lock file behind, and every later load
    # waits on it forever. No build takes 10 minutes; a lock that old is such a leftover.
    for lock in glob.glob(os.path.join(where, "**", builder.NAME, "lock"), recursive=True):
        age = time.time() - os.stat(lock).st_mtime
        if age > STALE_LOCK_S:
            print(f"build_deepspeed_ops: removing a stale build lock {lock} ({age / 60:.0f} min old)")
            os.remove(lock)
    start = time.monotonic()
    builder.load()
    print(f"build_deepspeed_ops: DeepSpeed {deepspeed.__version__} {builder.NAME} ready in {where} "
          f"({time.monotonic() - start:.1f} s, ninja {shutil.which('ninja')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
