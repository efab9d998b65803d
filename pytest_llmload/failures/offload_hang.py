"""offload-hang (write-up 000): ``from_pretrained`` "never returns" after the shards load.

The write-up's loader passed ``device_map="auto"``, ``max_memory``, ``offload_folder`` and
``offload_state_dict=True``, then called ``GenerationConfig.from_pretrained`` again to set the pad token. What
was measured here: transformers <= 4.56 honours ``offload_state_dict`` by writing every CPU-bound weight to a
temporary directory and reading it back, silently (minutes on a 70B model); 4.57 drops the keyword. Its fixes:
no ``offload_state_dict``, the pad token set directly, nothing reaching for the network after the load.

Checks (see :mod:`pytest_llmload.failures.meta_backward` for the calling convention)::

    from pytest_llmload.failures import offload_hang

    @pytest.mark.timeout(60)
    def test_my_loader_offloads(llmload_checkpoint, tmp_path):
        offload_hang.check_offload_inference(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from pytest_llmload.instruments.phases import phase
from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.loader.faults import PAD_TOKEN_FIX
from pytest_llmload.loader.seam import LoaderModelError
from pytest_llmload.instruments.probes import deadline, record_network, record_writes, spy_classmethod, system_tempdir
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.checks.ground_truth import input_ids, offload_budget, plain_model, where_loaded
from pytest_llmload.instruments.device_map_summary import offloaded_parts
from pytest_llmload.system.tracebacks import HANG_SIGNATURES

Loader = Callable[[LoadRequest], Any]

FAILURE = KnownFailure(
    id="offload-hang",
    order=2,
    title="from_pretrained never returns after the shards load (offload_state_dict round-trip)",
    write_up="seeds/000_90648e437c1c073a.txt",
    signatures=HANG_SIGNATURES,
    context=(r"from_pretrained|load_state_dict|offload",),
    root_cause=(
        "With offload_state_dict=True and a budget that offloads, transformers <= 4.56 writes every CPU-bound "
        "weight to a temporary directory and reads it back after the progress bar ends, with no output: "
        "minutes of silence on a 70B model that look like a hang."
    ),
    fix=(
        "Drop offload_state_dict (transformers >= 4.57 ignores it), keep offload_folder only where disk "
        "offload is wanted, and set pad_token_id directly instead of a second GenerationConfig.from_pretrained."
    ),
    occurs="transformers <= 4.56 with device_map + max_memory + offload_folder; any hardware, worst on big models.",
    hang_is_mechanism=True,
)


def check_offload_inference(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                            deadline_s: float = 30.0, new_tokens: int = 4) -> None:
    """Guards 000 (offload-hang): an offloading inference load returns in time, generates, and its logits are right.

    The ``max_memory`` forces cpu + disk (gpu + cpu on ``cuda:N``). The load returns within ``deadline_s``
    (a hang fails naming the blocked frame, with every thread's stack), ``generate`` makes ``new_tokens``
    tokens as the model loaded whole does, and the logits equal that model's (``torch.testing.assert_close``
    defaults for the dtype the loader loads: float32 rtol 1.3e-6, atol 1e-5)."""
    import torch

    request = LoadRequest(checkpoint, purpose="inference", device=device,
                          max_memory=offload_budget(checkpoint, device), offload_folder=Path(workdir) / "offload")
    start = time.monotonic()
    with deadline(deadline_s, f"the offloading inference load of {checkpoint} (max_memory={request.max_memory_dict})"):
        loaded = contract.load(loader, request, check=OFFLOAD_INFERENCE.name,
                               needs=("unquantized",))  # (compared with the checkpoint)
    model, request = loaded.model, loaded.request  # (in the dtype the loader loads)
    load_s = time.monotonic() - start
    if not offloaded_parts(model):
        not_exercised(OFFLOAD_INFERENCE.name, f"loaded the model {where_loaded(model)} under "
                      f"max_memory={request.max_memory}: nothing was offloaded", "the offloaded path")
    model.eval()
    whole = plain_model(checkpoint, device, request.dtype)
    ids = input_ids(whole, device)
    with torch.no_grad(), deadline(deadline_s, "a forward pass of the offloaded model"), \
            phase("forward", f"offloaded and whole, batch {ids.shape[0]} x {ids.shape[1]} tokens"):
        got, want = contract.checkpoint_logits(model(input_ids=ids).logits, request), whole(input_ids=ids).logits
    try:  # with the tolerances of the dtype the model computes in (float32's: rtol 1.3e-6, atol 1e-5)
        torch.testing.assert_close(got.cpu().to(want.dtype), want.cpu())
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


# What this check counts (issue 46): writes of weight data that the load makes outside its offload folder. Weight
# data is a file of a format weights are stored in (accelerate's .dat memmaps, which offload_state_dict's temporary
# round-trip writes, safetensors, torch's .bin/.pt, numpy's .npy), a directory that holds one, or whatever the
# loading libraries' offloading code makes (an offload folder, the round-trip's temporary dir). A compiler's or a
# library's cache is never weight data (torch.compile makes inductor's cache dir in the temp dir).
WEIGHT_SUFFIXES = (".dat", ".safetensors", ".bin", ".pt", ".pth", ".npy", ".ckpt")
OFFLOADING_CODE = ("transformers.modeling_utils", "transformers.integrations.accelerate", "accelerate.utils.offload",
                   "accelerate.utils.modeling", "accelerate.big_modeling", "numpy")
CACHE_CODE = ("torch._inductor", "torch._dynamo", "torch.utils.cpp_extension", "torch.hub", "triton",
              "huggingface_hub", "transformers.dynamic_module_utils")
_CACHE_DIR_VARIABLES = ("XDG_CACHE_HOME", "HF_HOME", "HF_MODULES_CACHE", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR",
                        "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR")


def _in_module(module: str, modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in modules)


def _under(path: str, folder: str) -> bool:
    return (path + os.sep).startswith(os.path.realpath(folder) + os.sep)


def _cache_roots(workdir) -> list[str]:
    """The cache directories of compilers and libraries (their variables, else their defaults under the home), but
    none that holds the check's ``workdir`` (a cache variable pointed at /tmp must not hide the temp dir)."""
    home = os.path.expanduser("~")
    defaults = [os.path.join(home, ".cache"), os.path.join(home, ".triton")]
    roots = [path for path in [os.environ.get(v) for v in _CACHE_DIR_VARIABLES] + defaults if path]
    return [root for root in roots if not _under(os.path.realpath(workdir), root)]


def _is_cache_write(write, cache_roots: list[str]) -> bool:
    """Whether ``write`` (a :class:`~pytest_llmload.instruments.probes.Write`) is a compiler's or a library's cache:
    made by their cache code, under one of ``cache_roots`` (:func:`_cache_roots`), or under inductor's default
    ``<tmp>/torchinductor_<user>``."""
    return (_in_module(write.by, CACHE_CODE) or any(_under(write.path, root) for root in cache_roots)
            or any(part.startswith("torchinductor_") for part in Path(write.path).parts))


def _holds_weight_files(folder: str, limit: int = 200) -> bool:
    """Whether ``folder`` still holds a weight file (one written by native code the audit hook does not see:
    ``torch.save``, safetensors' writer), looking at no more than ``limit`` entries."""
    pending, seen = [folder], 0
    while pending and seen < limit:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            elif entry.name.endswith(WEIGHT_SUFFIXES):
                return True
    return False


def weight_writes(writes, offload_folder, workdir, *, offloaded: bool = True) -> tuple[list, list]:
    """``(counted, not counted)``: of the ``writes`` a load made outside ``offload_folder`` (none made while a module
    was imported), those that are weight data, and the others (caches, logs).

    Where nothing was ``offloaded``, only the weight data the loading libraries' own code wrote counts:
    transformers <= 4.56 honours ``offload_state_dict`` by staging every CPU-bound weight in a temporary dir even
    for a model that ends whole on the cpu (``device_map="auto"`` on a machine without a GPU), write-up 000's silence
    with no offload to show for it; a loader's own copies of its weights (a merged model saved) are not that."""
    outside = [w for w in writes if not w.at_import and not _under(w.path, str(offload_folder))]
    cache_roots = _cache_roots(workdir)  # (read once: the environment and the home do not change meanwhile)
    candidates = [w for w in outside if not _is_cache_write(w, cache_roots)]
    weight_files = {w.path for w in candidates if w.path.endswith(WEIGHT_SUFFIXES)}
    folders = {w.path for w in candidates if w.event in ("os.mkdir", "os.rmdir", "shutil.rmtree")}
    holding = {f for f in folders if any(_under(path, f) for path in weight_files) or _holds_weight_files(f)}
    weight_data = [w for w in candidates if w.path in weight_files or w.path in holding]
    by_offloading_code = [w for w in candidates if _in_module(w.by, OFFLOADING_CODE)]
    counted = ([w for w in candidates if w in weight_data or w in by_offloading_code] if offloaded
               else [w for w in weight_data if w in by_offloading_code])
    return counted, [w for w in outside if w not in counted]


def _tally(writes) -> str:
    kinds = [w.event for w in writes]
    return ", ".join(f"{k} {kinds.count(k)}" for k in sorted(set(kinds), key=lambda k: (-kinds.count(k), k)))


def check_load_writes_only_offload_folder(loader: Loader, checkpoint, workdir, *, device: str = "cpu") -> None:
    """Guards 000 (offload-hang): an offloading load writes no weight data outside its offload_folder (no temp round-trip).

    ``offload_state_dict=True`` on transformers <= 4.56 silently round-trips every CPU-bound weight through
    the system temp dir. Writes of weight data (weight files, the directories holding them, what the loading
    libraries' offloading code makes) outside the offload folder fail it, seen through Python's audit events and a
    temp dir substituted for the system one; where nothing was offloaded, only the weights from_pretrained itself
    staged count (:func:`weight_writes`), and with none the check is not exercised. A compiler's or a library's
    cache (``torch.compile``'s inductor dir) is not weight data: the row notes it, uncounted."""
    workdir = Path(workdir)
    offload_folder = workdir / "offload"
    system_tmp = workdir / "system-tmp"
    system_tmp.mkdir(parents=True, exist_ok=True)
    request = LoadRequest(checkpoint, purpose="inference", device=device,
                          max_memory=offload_budget(checkpoint, device), offload_folder=offload_folder)
    before = os.stat(system_tmp).st_mtime_ns
    with system_tempdir(system_tmp), record_writes() as writes:
        loaded = contract.load(loader, request, check=WRITES_ONLY_OFFLOAD_FOLDER.name)
    model, request = loaded.model, loaded.request
    offloaded = bool(offloaded_parts(model))  # first: what counts depends on it (weight_writes)
    counted, uncounted = weight_writes(writes, offload_folder, workdir, offloaded=offloaded)
    if not offloaded and not counted:  # no offload, and no staging of the weights by from_pretrained either
        not_exercised(WRITES_ONLY_OFFLOAD_FOLDER.name, f"loaded the model {where_loaded(model)} under "
                      f"max_memory={request.max_memory}: nothing was offloaded", "an offloading load")
    touched_tmp = os.stat(system_tmp).st_mtime_ns != before
    # a temp dir changed by code the audit hook does not see (native code), with no write seen there to explain it
    unseen_in_tmp = offloaded and touched_tmp and not any(_under(w.path, str(system_tmp)) for w in writes)
    if counted or unseen_in_tmp:
        in_tmp = [w for w in counted if _under(w.path, str(system_tmp))]
        shown = "\n  ".join(f"{w.event} {w.path} (by {w.by or '?'})" for w in counted[:12])
        loads = "" if request.dtype == "float32" or getattr(loader, "dtypes", None) else (
            f" (over this check's two loads: asked in float32, then again in the {request.dtype} the loader loads)")
        ended = "" if offloaded else (f", though it ended {where_loaded(model)} with nothing offloaded "
                                      "(from_pretrained staged its weights all the same)")
        raise AssertionError(
            f"the offloading load wrote weight data outside its offload folder {offload_folder}{loads}{ended}: "
            f"{len(counted)} write(s) ({_tally(counted) or 'none seen'}), {len(in_tmp)} of them in the system temp "
            f"dir (redirected to {system_tmp}); the temp dir {'was' if touched_tmp else 'was not'} modified"
            f"{' by code the audit hook does not see' if unseen_in_tmp else ''}. A silent temporary round-trip of "
            f"the weights (offload_state_dict=True, write-up 000) looks like a hang on a large model.\n  {shown}"
        )
    if uncounted:
        writers = sorted({w.by or "?" for w in uncounted})
        contract.note(f"not counted: {len(uncounted)} write(s) outside the offload folder that are not weight data "
                      f"({_tally(uncounted)}; by {', '.join(writers[:3])}), e.g. {uncounted[0].path}")


def check_pad_token_set_offline(loader: Loader, checkpoint, workdir, *, device: str = "cpu") -> None:
    """Guards 000 (offload-hang, fix 3): no second config load, no network, and batched generation works offline.

    Write-up 000's fix 3 is about what happens after the weights load: no second
    ``GenerationConfig.from_pretrained`` (a network reach and a heavy re-initialisation) and nothing else
    reaching for the network, even an attempt the loader swallows. Then a batch of two prompts of different
    lengths, padded with the pad token the loader provided (on the tokenizer, on the generation config, or
    else the EOS token, which a caller passes to ``generate()``), generates offline. How the pad token is
    provided is the loader's choice; the checkpoint has none."""
    import torch
    from transformers import GenerationConfig

    request = LoadRequest(checkpoint, purpose="inference", device=device)
    calls: list = []
    with record_network() as attempts, spy_classmethod(GenerationConfig, "from_pretrained", calls):
        model, tokenizer = contract.load(loader, request, check=PAD_TOKEN_SET_OFFLINE.name)
    problems = []
    outside = [c for c in calls if not c[1].startswith("transformers.")]
    if outside:
        problems.append(f"GenerationConfig.from_pretrained was called again by the loader "
                        f"({len(outside)} call(s), from {[c[2] for c in outside]})")
    if attempts:
        problems.append(f"{len(attempts)} network access attempt(s) while loading: {attempts[:3]}")
    generation_config = getattr(model, "generation_config", None)
    pad = next((p for p in (getattr(tokenizer, "pad_token_id", None), getattr(generation_config, "pad_token_id", None),
                            getattr(generation_config, "eos_token_id", None), model.config.eos_token_id)
                if isinstance(p, int)), 0)
    rows = contract.observe(model).vocab
    if rows is not None and not 0 <= pad < rows:  # a token added to the tokenizer, never to the model's embeddings
        raise LoaderModelError(
            f"the loader's pad token id {pad} is outside its model's {rows} embedding rows: the tokenizer got a token "
            "the model cannot embed (add it with model.resize_token_embeddings(len(tokenizer)) after adding it); "
            "batched generation with it fails whatever the placement (not write-up 000's failure)", fix=PAD_TOKEN_FIX)
    prompts = [[2, 3, 4, 5, 6], [7, 8]]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.eval()
    with record_network() as generate_attempts, torch.no_grad(), phase("generate", "batch of 2, left-padded"):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2,
                             do_sample=False, pad_token_id=pad)
    if generate_attempts:
        problems.append(f"{len(generate_attempts)} network access attempt(s) during generate: {generate_attempts[:3]}")
    if tuple(out.shape) != (2, width + 2):
        problems.append(f"batched generate returned shape {tuple(out.shape)}, expected {(2, width + 2)}")
    if problems:
        raise AssertionError("write-up 000's fix 3 not applied: after loading, the loader reached for the config "
                             "or the network, or generation did not run offline:\n  " + "\n  ".join(problems))


# All isolated: each patches process-wide state while the loader runs (from_pretrained spies, the socket guard,
# TMPDIR and an audit hook that cannot be removed), and a load that hangs in native code (a blocked shard read)
# ignores the in-process alarm of ``deadline``; a child can be killed at its deadline, with its stacks.
OFFLOAD_INFERENCE = Check(check_offload_inference, failure=FAILURE, isolated=True)
WRITES_ONLY_OFFLOAD_FOLDER = Check(check_load_writes_only_offload_folder, failure=FAILURE, isolated=True)
PAD_TOKEN_SET_OFFLINE = Check(check_pad_token_set_offline, failure=FAILURE, isolated=True)
CHECKS = (OFFLOAD_INFERENCE, WRITES_ONLY_OFFLOAD_FOLDER, PAD_TOKEN_SET_OFFLINE, OFFLOAD_INFERENCE.on_gpu())
