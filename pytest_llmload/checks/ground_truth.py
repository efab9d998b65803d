"""The scenarios the checks share: budgets that offload, the ground truth, and what a loaded model shows.

- :func:`offload_budget`: a ``max_memory`` that sends half of a checkpoint's weights one tier down
- :func:`plain_model`: the checkpoint loaded whole with plain ``from_pretrained``, the ground truth
- :func:`placement_problems`: parameters on meta, on another device, or behind an offloading hook
- :func:`offloaded_parts` / :func:`where_loaded`: whether a model was offloaded at all, and where it is
- :func:`train_step_problems`: one forward and backward; what did not get a finite gradient
- :func:`refusal_problem`: whether an exception is the loader's refusal of a memory budget

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pytest_llmload.instruments.phases import phase
from pytest_llmload.instruments.recorder import track_model
from pytest_llmload.fixes.training_memory import checkpoint_tensors
from pytest_llmload.system import tracebacks


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


# --- models ----------------------------------------------------------------------------------------------


def plain_model(checkpoint, device: str, dtype: str = "float32"):
    """The checkpoint loaded whole on ``device`` with plain ``from_pretrained``: the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_llmload.loader.transformers_compat import dtype_kwarg

    with phase("load", f"{Path(checkpoint).name} whole on {device}, plain from_pretrained") as timed:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, local_files_only=True, device_map={"": device}, **dtype_kwarg(getattr(torch, dtype))
        ).eval()
    track_model(model, checkpoint, timed.seconds)
    return model


def input_ids(model, device: str, batch: int = 2, length: int = 12):
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    return torch.randint(2, vocab, (batch, length), generator=generator).to(device)


def placement_problems(model, device: str) -> list[str]:
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


def train_step_problems(model, device: str) -> list[str]:
    """One forward + backward; every trainable parameter must get a finite gradient on a real device."""
    import torch

    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return ["no parameter requires grad: the returned model cannot train"]
    ids = input_ids(model, device, batch=1, length=8)
    try:
        with phase("train step", f"forward+backward, batch 1 x {ids.shape[-1]} tokens"):
            loss = model(input_ids=ids, labels=ids).loss
            finite_loss = bool(torch.isfinite(loss).all())
            loss.backward()
    except Exception as exc:  # the failure under test: report it with its text (and a known loader fault's fix)
        from pytest_llmload.loader.faults import diagnose, said

        found = diagnose(exc)
        return [f"forward+backward raised {type(exc).__name__}: {exc}{said(found) if found else ''}"]
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


def train_optimizer(parameters: list, lr: float):
    """AdamW as a training script makes it. For float16 weights with no float32 master copy, an eps float16 holds:
    the default 1e-8 rounds to 0 there and the first step turns the weights into nan, where the scripts that train
    so set a larger one."""
    import torch

    half = any(p.dtype == torch.float16 for p in parameters)
    return torch.optim.AdamW(parameters, lr=lr, **({"eps": 1e-3} if half else {}))


def refusal_problem(exc: BaseException) -> Optional[str]:
    """``None`` when ``exc`` is a refusal that names the memory budget, raised by the loader's own code (not from
    inside the loading libraries), else why it is not."""
    text = f"{type(exc).__name__}: {exc}"
    short = text if len(text) < 400 else text[:400] + "..."
    if not any(word in str(exc).lower() for word in ("max_memory", "budget", "memory")):
        return f"raised {short} -- not a refusal that names the memory budget"
    raised_in = tracebacks.frames(exc)[-1:]  # the innermost frame
    if raised_in and tracebacks.is_library(raised_in[0].module):
        return f"raised {short} inside {raised_in[0].module} while loading -- not a refusal before loading"
    return None


def where_loaded(model) -> str:
    """``"whole on cpu"``, or the devices the parameters are on: what a skip reason says the loader did."""
    devices = sorted({str(p.device) for p in model.parameters()})
    return f"whole on {devices[0]}" if len(devices) == 1 else f"on {', '.join(devices)}"
