"""Start ``python -m MODULE ARGS`` in a child forked from this process, not in a new interpreter.

``popen_forked`` takes the :class:`subprocess.Popen` arguments that the main job (``MainJob(popen=...)``) and
pytester (``Pytester.popen``) pass, and returns a handle with Popen's ``pid``, ``returncode``, ``poll()``,
``wait()``, ``send_signal()``, ``terminate()`` and ``kill()``: whoever follows the child, signals it or kills its
process group does what it does with a Popen. The child runs the module in-process (``runpy``, as ``-m`` does), so
a process that has already imported torch and the Hugging Face stack (a test process) starts a pytest run without
paying seconds for those imports again. This repo's tests use it where their subject is what a run prints or
decides; the process itself (signals, the process tree, exit codes) is tested on the real command.

The child is made to look like a new interpreter started with those arguments: its cwd, ``os.environ`` (with
``tempfile``'s directory read from it again), ``sys.path`` (the cwd, ``$PYTHONPATH``, then what a new interpreter
of this executable has), ``sys.argv``, default signal handlers and mask, stdin, stdout and stderr on the given
files, its own process group if asked, no atexit handler or logging handler of this process's pytest, no pytest
assertion-rewriting import hook and no multiprocessing forkserver of this process's; this process's objects are
frozen out of its garbage collections (``gc.freeze``). The start every forked child shares (tied to its parent,
faulthandler, coverage, one OpenMP thread) is :func:`.isolation.start_child`'s. It always ends with ``os._exit``:
it never returns into this process's code (pytest's, a test's), also when the module raises.

What a forked child keeps, and a new interpreter would not have: the modules this process imported and their
state, this process's open file descriptors, its warnings filters. Where any of that is the subject, start the
real command.

This module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from pytest_llmload.runners import child_coverage, isolation

# Blocked from before the fork until the child has its default handlers: a Ctrl-C or SIGTERM that arrives in
# between reaches neither this process's handlers in the child nor a child that returns into this process's code.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
# What sys.path of a new interpreter depends on, besides $PYTHONPATH (the user site-packages: $HOME and these).
_PATH_ENV = ("HOME", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONPLATLIBDIR", "PYTHONSAFEPATH")
_new_interpreter_paths: dict[tuple, list[str]] = {}


class ForkedChild:
    """The :class:`subprocess.Popen`-like handle of a child started by :func:`popen_forked`."""

    stdin = stdout = stderr = None  # no pipes: the child writes to the files it was given

    def __init__(self, args, pid: int):
        self.args, self.pid = args, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): dead, its status unknown, as Popen says
                pid, status = self.pid, 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:  # Popen.wait(timeout) polls too, with the same back-off
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedChild pid={self.pid} returncode={self.returncode}>"


def popen_forked(args, *, stdout=None, stderr=None, stdin=None, env=None, cwd=None, process_group=None,
                 **ignored) -> ForkedChild:
    """``subprocess.Popen(args, ...)`` for ``args = [sys.executable, "-m", MODULE, ...]``, the child forked from
    this process. ``stdout``/``stderr``: a file (an object with ``fileno()``, or an fd), ``None`` (this process's),
    ``subprocess.DEVNULL``, and ``stderr=subprocess.STDOUT``; no pipes. ``stdin``: ``None``, ``DEVNULL`` or
    ``PIPE`` (closed at once: the child reads end-of-file, as pytester's ``CLOSE_STDIN``). Popen's other keywords
    (``close_fds``, ...) are accepted and ignored.

    From a process that has initialised CUDA it starts a new interpreter (:class:`subprocess.Popen`): a forked
    child would inherit a CUDA context it cannot use."""
    if isolation.cuda_initialised():
        return subprocess.Popen(args, stdout=stdout, stderr=stderr, stdin=stdin, env=env, cwd=cwd,
                                process_group=process_group, **ignored)
    module, argv = _module_and_argv(args)
    out_fd, err_fd, devnull = _output_fds(stdout, stderr)
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    first = [] if env.get("PYTHONSAFEPATH") else [cwd]  # (-m puts the cwd first, unless told not to)
    path = [*first, *_pythonpath(env, cwd), *_interpreter_path(env)]  # (the probe runs here, before the fork)
    coverage, parent = child_coverage.parent_settings(), os.getpid()
    with contextlib.suppress(Exception):  # what this process has buffered is written once, by this process
        sys.stdout.flush()
        sys.stderr.flush()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        with isolation.forking_quietly():
            pid = os.fork()
        if pid == 0:
            _child(module, argv, out_fd, err_fd, stdin is not None, env, cwd, path, process_group, mask, parent,
                   coverage)
        if process_group is not None:  # (the child does it too: whoever is first, the group exists on return)
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid if process_group == 0 else process_group)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if devnull is not None:
            os.close(devnull)
    return ForkedChild(list(args), pid)


def _module_and_argv(args) -> tuple[str, list[str]]:
    args = [os.fspath(a) for a in args]
    if len(args) >= 2 and args[0] == sys.executable and args[1].startswith("-m"):
        if args[1] != "-m":  # -mpytest (pytester's spelling)
            return args[1][2:], args[2:]
        if len(args) >= 3:
            return args[2], args[3:]
    raise ValueError(f"popen_forked runs 'python -m MODULE ...' with this interpreter ({sys.executable}); got {args}")


def _output_fds(stdout, stderr) -> tuple[int, int, Optional[int]]:
    if subprocess.PIPE in (stdout, stderr):
        raise ValueError("popen_forked writes the child's output to files, not pipes: pass a file")
    devnull = os.open(os.devnull, os.O_WRONLY) if subprocess.DEVNULL in (stdout, stderr) else None

    def fd(stream, default: int) -> int:
        if stream is None:
            return default
        if stream == subprocess.DEVNULL:
            return devnull
        return stream if isinstance(stream, int) else stream.fileno()

    out_fd = fd(stdout, 1)
    return out_fd, out_fd if stderr == subprocess.STDOUT else fd(stderr, 2), devnull


def _pythonpath(env: dict, cwd: str) -> list[str]:
    """``$PYTHONPATH``'s entries as a new interpreter puts them on ``sys.path``: relative to the cwd, an empty one
    the cwd itself."""
    value = env.get("PYTHONPATH")
    return [os.path.abspath(os.path.join(cwd, entry)) for entry in value.split(os.pathsep)] if value else []


def _interpreter_path(env: dict) -> list[str]:
    """``sys.path`` of a new interpreter of this executable with ``env``, after its first entry (the script's
    directory) and without ``$PYTHONPATH``: the standard library, site-packages, what their ``.pth`` files add.
    Asked once per process and environment that decides it (~20 ms)."""
    key = tuple(env.get(name) for name in _PATH_ENV)
    if key not in _new_interpreter_paths:
        probe_env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "COVERAGE_PROCESS_START")}
        probe = subprocess.run([sys.executable, "-c", "import sys; print(repr(sys.path[sys.path[:1] == ['']:]))"],
                               env=probe_env, capture_output=True, text=True, check=True, timeout=60)
        import ast

        _new_interpreter_paths[key] = list(ast.literal_eval(probe.stdout.strip()))
    return _new_interpreter_paths[key]


def _child(module, argv, out_fd, err_fd, stdin_given, env, cwd, path, process_group, mask, parent, coverage) -> None:
    """In the child: become ``python -m module *argv`` and run it; never returns."""
    code = 1
    try:
        if process_group is not None:
            os.setpgid(0, process_group)
        _default_signal_handlers()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal that came meanwhile is handled now, by default
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        import tempfile

        tempfile.tempdir = None  # read from $TMPDIR again
        sys.path[:] = path
        _xdist_sees_this_start()
        if stdin_given:
            _stdin_at_end_of_file()
        cov = isolation.start_child(parent, out_fd, err_fd, coverage)
        _fresh_logging()
        _no_assertion_rewriting_of_this_process()
        _no_forkserver_of_this_process()
        import atexit

        atexit._clear()  # this process's handlers (pytest's temp dirs, logging's flush) are not the child's
        if cov is not None:
            atexit.register(child_coverage.save, cov)  # os._exit skips coverage's own save
        import gc

        # What this process made stays out of the child's collections: pytest collects twice at its end (0.25 s
        # each over a test process's heap), and a collection would copy every page it touches.
        gc.freeze()
        code = _run_module(module, argv)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - everything ends here, in this child
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _xdist_sees_this_start() -> None:
    """pytest-xdist keeps ``sys.path`` as it was when its plugin was imported, the interpreter's start
    (``xdist.plugin._sys_path``, which ``xdist.workermanage`` imports by name), and gives it to every worker it
    starts. Imported already in this process, it held this process's start: the workers of a forked run then lacked
    the run's cwd and ``$PYTHONPATH`` (a loader module there never imported; the checks ran another loader). A new
    interpreter's is the path this child now has."""
    for name in ("xdist.plugin", "xdist.workermanage"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "_sys_path"):
            module._sys_path = list(sys.path)


def _run_module(module: str, argv: list[str]) -> int:
    """``python -m module *argv``'s exit code; ``KeyboardInterrupt`` ends it by SIGINT, as the interpreter does."""
    import importlib
    import runpy

    importlib.invalidate_caches()  # files this process's import system has not seen yet (the test just wrote them)
    sys.argv = ["-m", *argv]  # (runpy puts the module's path first, as -m does)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 128 + signal.SIGINT
    return 0


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _default_signal_handlers() -> None:
    """A new interpreter's: SIGINT raises KeyboardInterrupt, every other Python handler of this process (the main
    job's, pytest-timeout's) back to the default action; the ignored ones (SIGPIPE) stay ignored."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


def _stdin_at_end_of_file() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115


def _fresh_logging() -> None:
    """No handler of this process's pytest (its capture handlers, caplog's); a library's own stream handler
    (transformers') writes to the child's stdout or stderr, as it would in a new interpreter."""
    import logging

    old_out = {id(sys.__stdout__)}
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest."):
                logger.removeHandler(handler)
            elif type(handler) is logging.StreamHandler:
                handler.stream = sys.stdout if id(handler.stream) in old_out else sys.stderr


def _no_forkserver_of_this_process() -> None:
    """A forkserver this process started is its own (its children are the server's, reaped by this process): the
    child starts one of its own if it needs one, as a new interpreter would."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    for name in ("_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_authkey"):
        if getattr(server, name, None) is not None:
            setattr(server, name, None)


def _no_assertion_rewriting_of_this_process() -> None:
    """This process's pytest rewrites the asserts of the modules it was told to; the child's pytest installs its own
    hook for its own run."""
    sys.meta_path[:] = [finder for finder in sys.meta_path
                        if type(finder).__module__ != "_pytest.assertion.rewrite"]
