"""The forkserver that starts every child this process must not fork itself (GPU ranks; isolated checks once CUDA
is initialised here), warmed with the whole stack so that a child costs its work, not the imports.

A child forked from a process that has initialised CUDA cannot use it, so such children start from
multiprocessing's forkserver: a clean process that forks them. Preloaded with torch alone, each GPU rank then
imported transformers, accelerate and DeepSpeed itself and initialised DeepSpeed's accelerator: 33 s for a 1-rank
nccl check on the H100 (docs/gpu.md), against 0.4 s with gloo ranks forked from the warm test process. Here the
server imports the stack once (:data:`WARM_PRELOAD`), and every child of every later check forks from it.

What keeps the server clean: torch answers ``is_available()``/``device_count()`` from NVML when
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (set in the server; DeepSpeed 0.19 sets it itself at import, for the same
reason), so importing the stack never initialises CUDA there;
each child initialises its own device. DeepSpeed fixes its accelerator at import, so the server imports it with
the accelerator its children need (``DS_ACCELERATOR``: ``cuda`` for GPU children); a request for another one
restarts the server. ``PYTEST_LLMLOAD_COLD_FORKSERVER=1`` turns the warm preload off (torch only, as before).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

from pytest_llmload.config.vocabulary import COLD_FORKSERVER_ENV as COLD_ENV

# Set in the server only: CUDA availability from NVML, no CUDA context (torch's documented switch for forkservers).
SERVER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}

_started: Optional[tuple] = None  # (preload, DS_ACCELERATOR) of the server this process started


# Modules a child would otherwise import lazily, paying for them in every child of every run (what a child imports
# dies with it). DeepSpeed's engine imports its Muon optimizer, which calls torch.compile at import time and pulls in
# torch._inductor: about 3 s per rank on 2 cores. Forked ranks get them from the test process (runners.preload), the
# forkserver's children from the server. peft is not here: it imports bitsandbytes, which reads the GPUs' compute
# capability at import and so initialises CUDA.
HF_PRELOAD = (
    "torch.distributed",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.loss.loss_utils",
    "accelerate",
    "accelerate.utils",
)
DEEPSPEED_PRELOAD = HF_PRELOAD + (
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch._inductor.compile_fx",
    "accelerate.utils.deepspeed",
    "transformers.integrations.deepspeed",
    "deepspeed.comm.torch",
)


@contextlib.contextmanager
def quiet_deepspeed_import():
    """DeepSpeed's import logs through its own logger, to stdout (``[WARNING] ... Setting accelerator to CPU. If
    you have GPU or other accelerator, we were unable to detect it.``), and its modules warn about torch APIs they
    use (``torch.jit.script`` is deprecated): imported by the plugin at collection, none of it is the run's to read.
    Dropped while the block imports; what DeepSpeed logs or warns later goes out as usual."""
    import logging
    import warnings

    deepspeed_logger = logging.getLogger("DeepSpeed")  # (deepspeed.utils.logging's; the same object once imported)

    def drop(record) -> bool:
        return False

    deepspeed_logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        deepspeed_logger.removeFilter(drop)


# What the GPU-less server (``gpus_hidden``: the ranks of a check that simulates a runner without GPUs, on a machine
# with some) imports besides: peft, which cannot be preloaded in a process that sees a GPU (its bitsandbytes
# initialises CUDA at import) but can in a server that sees none, and the shipped tiny checkpoints' modeling modules
# (loader.tiny_models: Llama, Qwen2); every rank of the train checks imported them itself (issue 40).
GPU_LESS_PRELOAD = DEEPSPEED_PRELOAD + (
    "peft",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
)

# The runners' own modules: the children's entry point (children._child_main) and the callers that start them (a
# module that is not installed is skipped by the server).
RUNNERS = ("pytest_llmload.runners.children", "pytest_llmload.runners.isolation", "pytest_llmload.runners.ranks")


def ensure(*, accelerator: Optional[str], gpus_hidden: bool = False) -> None:
    """A forkserver runs whose children start with the runners and the stack imported (torch alone where
    ``$PYTEST_LLMLOAD_COLD_FORKSERVER`` is set) and DeepSpeed's ``accelerator`` (``None``: this process's
    ``DS_ACCELERATOR``); ``gpus_hidden``: with no GPU visible (``CUDA_VISIBLE_DEVICES=""``), for children that
    simulate a runner without accelerators on a machine that has some. Started once, restarted only for other
    settings. Call it between runs, with no child of it alive. It does not wait for the server's imports: the server
    imports while this process goes on, and its first child waits for them (:func:`start_early`)."""
    global _started
    from multiprocessing import forkserver
    from unittest import mock  # (here, not at import: the plugin imports this module after every collection)

    modules = ("torch", *RUNNERS, *(() if os.environ.get(COLD_ENV) else GPU_LESS_PRELOAD if gpus_hidden
                                    else DEEPSPEED_PRELOAD))
    accelerator = accelerator if accelerator is not None else os.environ.get("DS_ACCELERATOR")
    key = (modules, accelerator, gpus_hidden)
    server = forkserver._forkserver  # multiprocessing's one server for this process
    _usable_from_a_fork(server)
    if _started == key and _alive(server):
        return
    if server._forkserver_pid is not None:  # another preload or accelerator, or one it started elsewhere
        _stop_or_leave(server)
    server.set_forkserver_preload(list(modules))
    # The server inherits this process's environment when it is spawned: the server's settings, there only.
    with mock.patch.dict(os.environ, {**SERVER_ENV, **({"DS_ACCELERATOR": accelerator} if accelerator else {}),
                                      **({"CUDA_VISIBLE_DEVICES": ""} if gpus_hidden else {})}):
        server.ensure_running()
    _started = key


def starts_gpu_less_ranks(check) -> bool:
    """Whether ``check`` starts gloo ranks that simulate a runner without GPUs (the GPU-less server's children)."""
    return getattr(check, "world_size", 1) > 1 and not getattr(check, "needs_gpus", 0)


def start_early(checks, gpus_visible: int) -> bool:
    """Start the GPU-less server now where a GPU is visible and ``checks`` (the run's collected checks) include one
    that starts gloo ranks simulating a runner without GPUs (:func:`starts_gpu_less_ranks`): the server then imports
    the stack while this process runs the other checks, not inside the first such check (issue 40: 9.9 s in a new
    interpreter with the CUDA build of torch on a 2-core machine). Returns whether it started one."""
    if gpus_visible <= 0 or not any(map(starts_gpu_less_ranks, checks)):
        return False
    ensure(accelerator="cpu", gpus_hidden=True)
    return True


def forkserver_pid() -> Optional[int]:
    """The pid of the server running for this process, if one runs."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    return server._forkserver_pid if _alive(server) else None


# --- a server this process's parent started ---------------------------------------------------------------------
# A process forked after the GPU-less server started (start_early): an isolated test's child that starts ranks.
# multiprocessing checks its server with waitpid before each child, which a fork cannot call on its parent's child
# (ChildProcessError): in a fork, such a server counts as running while its process lives, and one that ended is let
# go of, this process starting its own.


def _parents(pid: int) -> bool:
    """Whether the server ``pid`` is not this process's child (its parent's: this process is a fork), not reaping it."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _let_go(server) -> None:
    os.close(server._forkserver_alive_fd)  # (this copy only: the server ends once its parent's closes too)
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


def _usable_from_a_fork(server) -> None:
    """multiprocessing's own check before each child, made to accept its parent's server (see above); once a process."""
    if getattr(server.ensure_running, "usable_from_a_fork", False):
        return
    own_check = server.ensure_running

    def ensure_running() -> None:
        pid = server._forkserver_pid
        if pid is not None and _parents(pid):
            if _running(pid):
                return
            _let_go(server)
        own_check()

    ensure_running.usable_from_a_fork = True
    server.ensure_running = ensure_running


def _stop_or_leave(server) -> None:
    """Stop this process's server; one its parent started is left to that parent, which still uses it."""
    if _parents(server._forkserver_pid):
        _let_go(server)
    else:
        server._stop()


def _alive(server) -> bool:
    pid = server._forkserver_pid
    if pid is None:
        return False
    if _parents(pid):
        return _running(pid)
    with contextlib.suppress(ChildProcessError):
        return os.waitpid(pid, os.WNOHANG)[0] == 0
    return False
