"""Conformance checks for the offload write-ups: 000 (offload_state_dict "hang", GenerationConfig) and 002
(meta-tensor backward).

Each check is ``check_<name>(loader, checkpoint, workdir, *, device="cpu")``: ``loader`` takes a
:class:`~pytest_llmload.LoadRequest` and returns a model or ``(model, tokenizer)``; ``checkpoint`` is a local
tiny checkpoint (the ``llmload_checkpoint`` fixture); ``workdir`` an empty scratch directory (``tmp_path``).
A check returns ``None`` or raises ``AssertionError`` with the figures::

    from pytest_llmload.checks import offload

    @pytest.mark.timeout(60)
    def test_my_loader_trains(llmload_checkpoint, tmp_path):
        offload.check_train_request_trains(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

from pytest_llmload.conformance import Check
from pytest_llmload.loading import call_loader
from pytest_llmload.memory import checkpoint_tensors
from pytest_llmload.offline import _culprit
from pytest_llmload.phases import note_deadline, phase, track_model
from pytest_llmload.request import LoadRequest

Loader = Callable[[LoadRequest], Any]

# Libraries whose frames mean "raised while loading", not "refused before loading".
_LOADING_LIBRARIES = ("torch", "transformers", "accelerate", "peft", "safetensors", "huggingface_hub",
                      "bitsandbytes")


# --- budgets ---------------------------------------------------------------------------------------------


def offload_budget(checkpoint: os.PathLike | str, device: str = "cpu", fraction: float = 0.5,
                   dtype: Optional[str] = None) -> dict:
    """A ``max_memory`` that holds ``fraction`` of the checkpoint's weights on ``device`` and sends the rest
    one tier down: to disk when ``device`` is the CPU, to the CPU for ``cuda:N`` (write-up 002's
    ``{0: "14GB", "cpu": "50GB"}``). On the tiny Llama, 0.5 puts the embeddings and layer 0 on the
    device and layers 1-3, the norm and the head on the next tier.

    ``dtype`` is the dtype the weights are loaded in, when it is not the checkpoint's: a float32 budget
    holds the whole model once it loads in float16 (seen on an H100: only the head was offloaded)."""
    tensors = checkpoint_tensors(checkpoint)
    if dtype is None:
        total = sum(t.nbytes for t in tensors)
    else:
        import torch

        total = sum(t.numel * getattr(torch, dtype).itemsize for t in tensors)
    if device == "cpu":
        return {"cpu": int(total * fraction)}
    kind, _, index = device.partition(":")
    if kind != "cuda":
        raise ValueError(f"offload_budget: device {device!r} is neither 'cpu' nor 'cuda:N'.")
    return {int(index or 0): int(total * fraction), "cpu": total * 4}


# --- deadlines and stacks --------------------------------------------------------------------------------


class _DeadlinePassed(BaseException):
    """Raised by the alarm; a BaseException so that a loader's ``except Exception`` cannot swallow it."""


def _innermost_own_frame(frame) -> Optional[Any]:
    """The innermost frame that is not threading/queue/futures plumbing: where the code is stuck."""
    plumbing = ("threading.py", "queue.py", os.path.join("concurrent", "futures"), "selectors.py")
    while frame is not None and any(p in frame.f_code.co_filename for p in plumbing):
        frame = frame.f_back
    return frame


def thread_stacks(main_frame=None) -> str:
    """The stack of every thread of this process, named, innermost call last (``main_frame`` replaces
    the main thread's current frame, e.g. the frame a signal interrupted)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    if main_frame is not None:
        frames[threading.main_thread().ident] = main_frame
    out = []
    for ident, frame in frames.items():
        if frame is sys._getframe():
            continue
        out.append(f"~~~ thread {names.get(ident, '<unknown>')} (id {ident}) ~~~")
        out.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(out)


def _where(frame) -> str:
    own = _innermost_own_frame(frame)
    if own is None:
        return "<unknown frame>"
    return f"{own.f_code.co_name} ({own.f_code.co_filename}:{own.f_lineno})"


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail with ``AssertionError`` naming the blocked frame and every thread's stack when the block runs
    longer than ``seconds``, instead of hanging the job.

    Uses ``SIGALRM`` (main thread, POSIX) and nests under pytest-timeout's signal method: an outer timer
    due sooner is left alone, a later one is re-armed afterwards. Elsewhere the block is only timed, and
    a block that ends late still fails.
    """
    __tracebackhide__ = True
    start = time.monotonic()
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    outer_remaining, outer_interval = signal.getitimer(signal.ITIMER_REAL) if usable else (0.0, 0.0)
    if not usable or (outer_remaining and outer_remaining <= seconds):
        yield
        _fail_if_late(start, seconds, what)
        return
    captured: dict[str, str] = {}

    def on_alarm(signum, frame):
        captured["where"] = _where(frame)
        captured["stacks"] = thread_stacks(frame)
        raise _DeadlinePassed()

    outer_handler = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _DeadlinePassed:
        note_deadline(what, time.monotonic() - start, seconds)
        raise AssertionError(
            f"{what} did not return: deadline of {seconds:g} s exceeded, blocked in {captured['where']}.\n"
            f"Stacks of every thread:\n{captured['stacks']}"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_remaining:
            left = outer_remaining - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)
    _fail_if_late(start, seconds, what)


def _fail_if_late(start: float, seconds: float, what: str) -> None:
    elapsed = time.monotonic() - start
    note_deadline(what, elapsed, seconds)  # the session summary lists checks that came close
    if elapsed > seconds:
        raise AssertionError(f"{what} took {elapsed:.2f} s: deadline of {seconds:g} s exceeded.")


# --- spies -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _spy_classmethod(cls, name: str, calls: list) -> Iterator[None]:
    """Record ``(cls name, caller module, caller location)`` for each call of classmethod ``cls.name``."""
    original = cls.__dict__[name]

    def spy(klass, *args, **kwargs):
        caller = sys._getframe(1)
        calls.append((klass.__name__, caller.f_globals.get("__name__", "?"),
                      f"{caller.f_code.co_filename}:{caller.f_lineno}"))
        return original.__func__(klass, *args, **kwargs)

    setattr(cls, name, classmethod(spy))
    try:
        yield
    finally:
        setattr(cls, name, original)


@dataclasses.dataclass(frozen=True)
class Write:
    event: str  # the audit event: open, os.mkdir, os.rename, ...
    path: str
    at_import: bool  # made while importing a module (torch._dynamo makes its cache dir when first imported)


_recorders: list[list[Write]] = []
_hook_installed = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit_hook(event: str, args: tuple) -> None:
    if not _recorders:
        return
    dir_fd = None
    if event == "open":
        path, mode, flags = args
        if isinstance(mode, str):
            if not any(c in mode for c in "wax+"):
                return
        elif not (isinstance(flags, int) and flags & _WRITE_FLAGS):
            return
    elif event in ("os.mkdir", "os.rmdir", "os.remove", "shutil.rmtree", "shutil.copyfile"):
        path = args[0] if event != "shutil.copyfile" else args[1]
        dir_fd = args[-1] if event in ("os.mkdir", "os.rmdir", "os.remove") else None
    elif event in ("os.rename", "os.replace", "os.link", "os.symlink"):
        path, dir_fd = args[1], args[3] if len(args) > 3 else None
    else:
        return
    if path is None or isinstance(path, int):
        return
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
        # relative to an open directory (shutil.rmtree works this way): resolve it while the fd is open
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            path = f"<directory fd {dir_fd}>/{path}"
    path = os.path.realpath(path)
    frame, at_import = sys._getframe(1), False
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            at_import = True
            break
        frame = frame.f_back
    for record in _recorders:
        record.append(Write(event, path, at_import))


@contextlib.contextmanager
def record_writes() -> Iterator[list[Write]]:
    """Record every file or directory this process creates, writes, renames or removes meanwhile (Python
    audit events; writes made by native code without Python's ``open`` are not seen here)."""
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit_hook)  # cannot be removed; it returns at once while nothing records
        _hook_installed = True
    record: list[Write] = []
    _recorders.append(record)
    try:
        yield record
    finally:
        _recorders.remove(record)


@contextlib.contextmanager
def _system_tempdir(path: Path) -> Iterator[None]:
    """Point the system temp dir (``tempfile.tempdir`` and ``$TMPDIR``) at ``path`` meanwhile."""
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


@contextlib.contextmanager
def _record_network() -> Iterator[list[str]]:
    """Record (and refuse) every connection or name lookup to a non-loopback host meanwhile, even one the
    loader catches and swallows."""
    attempts: list[str] = []
    original_connect, original_connect_ex = socket.socket.connect, socket.socket.connect_ex
    original_getaddrinfo = socket.getaddrinfo

    def local(host) -> bool:
        return host in ("localhost", "", None) or str(host).startswith("127.") or host == "::1"

    def refuse(what: str):
        attempts.append(f"{what} from {_culprit()}")
        raise OSError(f"pytest-llmload: network access refused during an offline check: {what}")

    def connect(sock, address):
        if isinstance(address, tuple) and not local(address[0]):
            refuse(f"connect {address!r}")
        return original_connect(sock, address)

    def connect_ex(sock, address):
        if isinstance(address, tuple) and not local(address[0]):
            refuse(f"connect {address!r}")
        return original_connect_ex(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if not local(host):
            refuse(f"getaddrinfo {host!r}")
        return original_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
    try:
        yield attempts
    finally:
        socket.socket.connect, socket.socket.connect_ex = original_connect, original_connect_ex
        socket.getaddrinfo = original_getaddrinfo


# --- models ----------------------------------------------------------------------------------------------


def _plain_model(checkpoint, device: str, dtype: str = "float32"):
    """The checkpoint loaded whole on ``device`` with plain ``from_pretrained``: the ground truth."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    key = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    with phase("load", f"{Path(checkpoint).name} whole on {device}, plain from_pretrained") as timed:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, local_files_only=True, device_map={"": device}, **{key: getattr(torch, dtype)}
        ).eval()
    track_model(model, checkpoint, timed.seconds)
    return model


def _input_ids(model, device: str, batch: int = 2, length: int = 12):
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    return torch.randint(2, vocab, (batch, length), generator=generator).to(device)


def _placement_problems(model, device: str) -> list[str]:
    """Parameters on meta, on another device, or behind an offloading hook."""
    import torch

    want = torch.device(device)
    params = list(model.named_parameters())
    meta = [n for n, p in params if p.device.type == "meta"]
    elsewhere = [f"{n} on {p.device}" for n, p in params if p.device.type != "meta"
                 and (p.device.type != want.type or (want.index is not None and p.device.index != want.index))]
    hooked = [n for n, m in model.named_modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    device_map = getattr(model, "hf_device_map", None) or {}
    tiers = sorted({str(v) for v in device_map.values()} - {device, str(want.index)})
    problems = []
    if meta:
        problems.append(f"{len(meta)} of {len(params)} parameters are on meta (offloaded), e.g. {meta[:2]}")
    if elsewhere:
        problems.append(f"{len(elsewhere)} parameters are not on {device}, e.g. {elsewhere[:2]}")
    if hooked:
        problems.append(f"{len(hooked)} modules have an offloading accelerate hook, e.g. {hooked[:2]}")
    if tiers:
        spread = {k: v for k, v in device_map.items() if str(v) in tiers}
        problems.append(f"hf_device_map sends {len(spread)} modules to {tiers}: {dict(list(spread.items())[:4])}")
    return problems


def _train_step_problems(model, device: str) -> list[str]:
    """One forward + backward; every trainable parameter must get a finite gradient on a real device."""
    import torch

    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return ["no parameter requires grad: the returned model cannot train"]
    ids = _input_ids(model, device, batch=1, length=8)
    try:
        with phase("train step", f"forward+backward, batch 1 x {ids.shape[-1]} tokens"):
            loss = model(input_ids=ids, labels=ids).loss
            finite_loss = bool(torch.isfinite(loss).all())
            loss.backward()
    except Exception as exc:  # the failure under test: report it with its text
        return [f"forward+backward raised {type(exc).__name__}: {exc}"]
    problems = [] if finite_loss else [f"the loss is {loss.item()}"]
    missing = [n for n, p in trainable if p.grad is None]
    on_meta = [n for n, p in trainable if p.grad is not None and p.grad.device.type == "meta"]
    not_finite = [n for n, p in trainable if p.grad is not None and p.grad.device.type != "meta"
                  and not bool(torch.isfinite(p.grad).all())]
    for names, what in ((missing, "got no gradient"), (on_meta, "got a gradient on meta"),
                        (not_finite, "got a non-finite gradient")):
        if names:
            problems.append(f"{len(names)} of {len(trainable)} trainable parameters {what}, e.g. {names[:2]}")
    return problems


def _refusal_problem(exc: BaseException, loads: list) -> Optional[str]:
    """``None`` when ``exc`` is a clear refusal made before loading, else why it is not."""
    text = f"{type(exc).__name__}: {exc}"
    short = text if len(text) < 400 else text[:400] + "..."
    if not any(word in str(exc).lower() for word in ("max_memory", "budget", "memory")):
        return f"raised {short} -- not a refusal that names the memory budget"
    tb, module = exc.__traceback__, None
    while tb is not None:
        module, tb = tb.tb_frame.f_globals.get("__name__", ""), tb.tb_next
    if module and module.split(".")[0] in _LOADING_LIBRARIES:
        return f"raised {short} inside {module} while loading -- not a refusal before loading"
    if loads:
        return f"refused with {short} only after from_pretrained ran {len(loads)} time(s)"
    return None


# --- the checks ------------------------------------------------------------------------------------------

TRAIN_VARIANTS = tuple((budget, lora, gc) for budget in ("offloading", None) for lora in (False, True)
                       for gc in (False, True))


def check_train_request_trains(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                               variants=TRAIN_VARIANTS) -> None:
    """Guards 002 (meta-backward): a train request gives a model that trains, nothing on meta, or a clear early refusal.

    With or without LoRA and gradient checkpointing, under a ``max_memory`` that would offload part of the
    model and under none, the loader either refuses with a clear error before loading (offloading budget
    only: the message names the memory budget and no ``from_pretrained`` ran) or returns a model with no
    parameter on meta or offloaded whose trainable parameters all get a finite gradient on a real device
    after one forward and backward. ``variants`` are ``(budget, lora, gradient_checkpointing)`` triples, budget
    ``"offloading"`` or ``None`` (default: all eight). Needs peft for the LoRA variants."""
    from transformers import PreTrainedModel

    failures, outcomes = [], []
    for budget, lora, gc in variants:
        label = (f"{'max_memory=' + str(offload_budget(checkpoint, device)) if budget else 'no max_memory'}, "
                 f"lora={lora}, gradient_checkpointing={gc}")
        request = LoadRequest(
            checkpoint, purpose="train", device=device, lora=lora, gradient_checkpointing=gc,
            max_memory=offload_budget(checkpoint, device) if budget else None,
            offload_folder=Path(workdir) / f"offload-train-{len(outcomes)}",
        )
        loads: list = []
        try:
            with _spy_classmethod(PreTrainedModel, "from_pretrained", loads):
                model = call_loader(loader, request).model
        except Exception as exc:
            why = _refusal_problem(exc, loads) if budget else f"raised {type(exc).__name__}: {exc}"
            if why is not None:
                failures.append(f"[{label}]\n    {why}")
            outcomes.append("refused" if why is None else "error")
            continue
        problems = _placement_problems(model, device) + _train_step_problems(model, device)
        if problems:
            failures.append(f"[{label}]\n    " + "\n    ".join(problems))
        outcomes.append("trained" if not problems else "cannot train")
        del model
    if failures:
        counts = {o: outcomes.count(o) for o in ("trained", "refused", "cannot train", "error")}
        raise AssertionError(
            f"{len(failures)} of {len(outcomes)} train requests failed (write-up 002: a model that will be "
            f"trained must not be offloaded); outcomes {counts}:\n  " + "\n  ".join(failures)
        )


def check_offload_inference(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                            deadline_s: float = 30.0, new_tokens: int = 4) -> None:
    """Guards 000 (offload-hang): an offloading inference load returns in time, generates, and its logits are right.

    The ``max_memory`` forces cpu + disk (gpu + cpu on ``cuda:N``). The load returns within ``deadline_s``
    (a hang fails naming the blocked frame, with every thread's stack), ``generate`` makes ``new_tokens``
    tokens as the model loaded whole does, and the logits equal that model's (``torch.testing.assert_close``
    float32 defaults: rtol 1.3e-6, atol 1e-5)."""
    import torch

    request = LoadRequest(checkpoint, purpose="inference", device=device,
                          max_memory=offload_budget(checkpoint, device), offload_folder=Path(workdir) / "offload")
    start = time.monotonic()
    with deadline(deadline_s, f"the offloading inference load of {checkpoint} (max_memory={request.max_memory_dict})"):
        model = call_loader(loader, request).model
    load_s = time.monotonic() - start
    model.eval()
    whole = _plain_model(checkpoint, device)
    ids = _input_ids(whole, device)
    with torch.no_grad(), deadline(deadline_s, "a forward pass of the offloaded model"), \
            phase("forward", f"offloaded and whole, batch {ids.shape[0]} x {ids.shape[1]} tokens"):
        got, want = model(input_ids=ids).logits, whole(input_ids=ids).logits
    try:
        torch.testing.assert_close(got.float().cpu(), want.float().cpu())
    except AssertionError as exc:
        diff = (got.float().cpu() - want.float().cpu()).abs().max().item()
        raise AssertionError(
            f"the offloaded model's logits differ from the model loaded whole: max abs diff {diff:.3g} "
            f"(hf_device_map={getattr(model, 'hf_device_map', None)}).\n{exc}"
        ) from None
    eos = whole.config.eos_token_id
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=eos if isinstance(eos, int) else 0, attention_mask=torch.ones_like(ids[:1]))
    with torch.no_grad(), deadline(deadline_s, f"generate({new_tokens} tokens) on the offloaded model"), \
            phase("generate", f"offloaded and whole, max_new_tokens={new_tokens}"):
        out = model.generate(input_ids=ids[:1], **kwargs)
        expected = whole.generate(input_ids=ids[:1], **kwargs)
    if out.shape[-1] != ids.shape[-1] + new_tokens or not torch.equal(out.cpu(), expected.cpu()):
        raise AssertionError(
            f"generate on the offloaded model gave {out.tolist()}, the model loaded whole {expected.tolist()} "
            f"(load took {load_s:.2f} s)."
        )


def check_load_writes_only_offload_folder(loader: Loader, checkpoint, workdir, *, device: str = "cpu") -> None:
    """Guards 000 (offload-hang): an offloading load writes nothing outside its offload_folder (no temp round-trip).

    ``offload_state_dict=True`` on transformers <= 4.56 silently round-trips every CPU-bound weight through
    the system temp dir. Watches Python's audit events and a temp dir substituted for the system one."""
    workdir = Path(workdir)
    offload_folder = workdir / "offload"
    system_tmp = workdir / "system-tmp"
    system_tmp.mkdir(parents=True, exist_ok=True)
    request = LoadRequest(checkpoint, purpose="inference", device=device,
                          max_memory=offload_budget(checkpoint, device), offload_folder=offload_folder)
    before = os.stat(system_tmp).st_mtime_ns
    with _system_tempdir(system_tmp), record_writes() as writes:
        call_loader(loader, request)
    inside = os.path.realpath(offload_folder) + os.sep
    outside = [w for w in writes if not w.at_import and not (w.path + os.sep).startswith(inside)]
    touched_tmp = os.stat(system_tmp).st_mtime_ns != before
    if outside or touched_tmp:
        in_tmp = [w for w in outside if w.path.startswith(os.path.realpath(system_tmp) + os.sep)]
        shown = "\n  ".join(f"{w.event} {w.path}" for w in outside[:12])
        kinds = [w.event for w in outside]
        summary = ", ".join(f"{k} {kinds.count(k)}" for k in sorted(set(kinds), key=lambda k: (-kinds.count(k), k)))
        raise AssertionError(
            f"the offloading load wrote outside its offload folder {offload_folder}: {len(outside)} write(s) "
            f"({summary}), {len(in_tmp)} of them in the system temp dir (redirected to {system_tmp}); the temp dir "
            f"{'was' if touched_tmp else 'was not'} modified. A silent temporary round-trip of the weights "
            f"(offload_state_dict=True, write-up 000) looks like a hang on a large model.\n  {shown}"
        )


def check_pad_token_set_offline(loader: Loader, checkpoint, workdir, *, device: str = "cpu") -> None:
    """Guards 000 (offload-hang, fix 3): pad token set on model and tokenizer, offline, no second config load.

    For a checkpoint without a pad token, ``model.generation_config.pad_token_id`` and the tokenizer's
    ``pad_token_id`` are set and equal, with no second ``GenerationConfig.from_pretrained`` call and no
    network access (even one the loader swallows). Needs the loader to return ``(model, tokenizer)``."""
    from transformers import GenerationConfig

    request = LoadRequest(checkpoint, purpose="inference", device=device)
    calls: list = []
    with _record_network() as attempts, _spy_classmethod(GenerationConfig, "from_pretrained", calls):
        model, tokenizer = call_loader(loader, request)
    problems = []
    outside = [c for c in calls if not c[1].startswith("transformers.")]
    if outside:
        problems.append(f"GenerationConfig.from_pretrained was called again by the loader "
                        f"({len(outside)} call(s), from {[c[2] for c in outside]})")
    if attempts:
        problems.append(f"{len(attempts)} network access attempt(s): {attempts[:3]}")
    model_pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if model_pad is None:
        problems.append("model.generation_config.pad_token_id is None")
    if tokenizer is None:
        problems.append("the loader returned no tokenizer; return (model, tokenizer)")
    elif tokenizer.pad_token_id is None:
        problems.append("tokenizer.pad_token_id is None")
    elif model_pad is not None and model_pad != tokenizer.pad_token_id:
        problems.append(f"model pad_token_id {model_pad} != tokenizer pad_token_id {tokenizer.pad_token_id}")
    if problems:
        raise AssertionError("pad token not set as write-up 000's fix 3 does:\n  " + "\n  ".join(problems))


def _on_cuda(check: Callable, label: str) -> dict:
    variant = functools.partial(check, device="cuda:0")
    variant.__doc__ = check.__doc__.replace(":", " on cuda:0 (the write-up's own setup):", 1)
    return {"function": variant, "label": label}


# The checks for the conformance registry (pytest_llmload.conformance.Check), with the catalog ids they guard.
# All run isolated, in a child of the test process: each patches process-wide state while the loader runs
# (from_pretrained spies, the socket guard, TMPDIR and an audit hook that cannot be removed), and a load that
# hangs in native code (a blocked shard read) ignores the in-process alarm of ``deadline``; a child can be
# killed at its deadline, with its stacks.
CHECKS = (
    Check(check_train_request_trains, failure="meta-backward", isolated=True),
    Check(check_offload_inference, failure="offload-hang", isolated=True),
    Check(check_load_writes_only_offload_folder, failure="offload-hang", isolated=True),
    Check(check_pad_token_set_offline, failure="offload-hang", isolated=True),
    Check(**_on_cuda(check_train_request_trains, "check_train_request_trains_cuda"), failure="meta-backward",
          needs_gpus=1, isolated=True),
    Check(**_on_cuda(check_offload_inference, "check_offload_inference_cuda"), failure="offload-hang", needs_gpus=1,
          isolated=True),
)

__all__ = ["CHECKS", "TRAIN_VARIANTS", "check_load_writes_only_offload_folder", "check_offload_inference",
           "check_pad_token_set_offline", "check_train_request_trains", "deadline", "offload_budget",
           "record_writes", "thread_stacks"]
