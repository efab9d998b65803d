"""The fix for adapter-on-offloaded (:mod:`pytest_llmload.failures.adapter_on_offloaded`): a PEFT adapter is never
put on a base that ``device_map`` offloaded.

The fix that worked in the field (tloen/alpaca-lora#368): one device, no offload -- load the base whole
(``device_map={"": device}``), then the adapter. :func:`adapter_placement_kwargs` and :func:`put_adapter` do that
honestly: whole on the device when the budget holds it; on an accelerator whose budget cannot, whole on the host,
merge there, and dispatch the *merged* model under the budget (:func:`merge_and_dispatch`); else a clear refusal
before loading (:class:`AdapterBudgetError`). The reference loader (:mod:`.reference_loader`) serves adapters with
them; the refusals carry the failure's id (:data:`TAG`), so a report names the failure.
"""

from __future__ import annotations

import os
from pathlib import Path

from pytest_llmload.loader.request import LoadRequest

# The failure's id: the refusals carry it, and the catalog entry's signatures match it.
TAG = "adapter-on-offloaded"


class AdapterBudgetError(ValueError):
    """A request to put an adapter on a model whose ``max_memory`` cannot hold it on one device, refused
    before loading (an offloaded base cannot take an adapter)."""


def adapter_bytes(adapter_path) -> int:
    """Bytes of an adapter's weights, from its safetensors header (0 when it has none)."""
    from pytest_llmload.fixes.training_memory import _safetensors_header

    path = Path(adapter_path) / "adapter_model.safetensors"
    if not path.is_file():
        return 0
    header = _safetensors_header(path)
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def _weights_bytes(request: LoadRequest) -> int:
    from pytest_llmload.fixes.training_memory import estimate_inference_memory

    return estimate_inference_memory(request, prompt_len=1).rows[0][1]


def _spreads(placement: dict, device: str) -> bool:
    """Whether ``from_pretrained(**placement)`` may put part of the model anywhere but ``device``."""
    device_map = placement.get("device_map")
    if isinstance(device_map, str):
        return True
    if isinstance(device_map, dict):
        return {str(v) for v in device_map.values()} - {device, device.partition(":")[2]} != set()
    return False


def adapter_placement_kwargs(request: LoadRequest, placement: dict | None = None) -> dict:
    """Where the base goes when ``request.adapter_path`` will be put on it: never an offloading spread.

    ``placement`` is what the loader would pass otherwise (the reference loader's ``placement_kwargs``);
    it is returned as is unless it could offload. Then: whole on ``request.device`` when ``max_memory``
    gives it the weights and the adapter (or there is no budget); on ``cuda:N``, whole on the host when the
    budget's ``"cpu"`` holds them (:func:`put_adapter` then merges there and dispatches the merged model under
    the budget); else :class:`AdapterBudgetError`, raised here, before anything is loaded."""
    from pytest_llmload.fixes.training_memory import budget_for_device
    from pytest_llmload.system.sizes import format_bytes

    placement = dict(placement) if placement is not None else {"device_map": {"": request.device}}
    if not _spreads(placement, request.device) and "max_memory" not in placement:
        return placement
    whole = {"device_map": {"": request.device}}
    if request.max_memory is None:
        return whole
    need = _weights_bytes(request) + adapter_bytes(request.adapter_path)
    on_device = budget_for_device(request.max_memory, request.device)
    if on_device is not None and need <= on_device:
        return whole
    on_host = budget_for_device(request.max_memory, "cpu")
    if (request.device != "cpu" and request.purpose == "inference" and request.quantization is None
            and on_host is not None and need <= on_host):
        return {"device_map": {"": "cpu"}}
    raise AdapterBudgetError(
        f"refusing to load {request.model_path} with the adapter {request.adapter_path} on {request.device}: "
        f"base + adapter need {format_bytes(need)} but max_memory={dict(request.max_memory)!r} gives "
        f"{request.device} {format_bytes(on_device) if on_device is not None else 'nothing'}"
        + ("" if request.device == "cpu" else f" and the host {format_bytes(on_host) if on_host else 'nothing'}")
        + f". Offloading the rest would leave the base on 'meta', and a PEFT adapter cannot be put on it "
        f"({TAG}: 'Cannot copy out of meta tensor', or adapter weights left on meta). Raise the budget, or merge "
        "the adapter into the base offline and serve the merged checkpoint with the budget."
    )


def merge_and_dispatch(peft_model, max_memory: dict, offload_folder=None):
    """Merge the adapter into a base held whole on one device, then spread the *merged* model over
    ``max_memory`` with accelerate (what does not fit goes to the cpu, then to ``offload_folder`` on disk).
    An offloaded merged model has no adapter weights left to strand on meta."""
    from accelerate import dispatch_model, infer_auto_device_map

    merged = peft_model.merge_and_unload()
    no_split = list(getattr(merged, "_no_split_modules", None) or [])
    device_map = infer_auto_device_map(merged, max_memory=dict(max_memory), no_split_module_classes=no_split)
    if "disk" in device_map.values() and offload_folder is None:
        raise AdapterBudgetError(
            f"max_memory={dict(max_memory)!r} sends part of the merged model to disk but no offload_folder was "
            "given; pass one (LoadRequest.offload_folder) or raise the budget.")
    return dispatch_model(merged, device_map=device_map,
                          offload_dir=os.fspath(offload_folder) if offload_folder is not None else None)


def put_adapter(model, request: LoadRequest):
    """Put ``request.adapter_path`` on ``model`` (loaded with :func:`adapter_placement_kwargs`).

    Returns the ``PeftModel`` (trainable for ``purpose="train"``); a base that was loaded on the host for a
    ``cuda:N`` request is merged there and dispatched under the budget (:func:`merge_and_dispatch`). Raises
    :class:`AdapterBudgetError` for a base that is already offloaded instead of letting peft fail on it."""
    from peft import PeftModel

    from pytest_llmload.instruments.device_map_summary import offloaded_parts

    offloaded = offloaded_parts(model)
    if offloaded:
        raise AdapterBudgetError(
            f"{TAG}: the base model is offloaded ({'; '.join(offloaded)}); a PEFT adapter put on it fails "
            f"('Cannot copy out of meta tensor') or stays on meta. Load the base with "
            f"adapter_placement_kwargs(request) (max_memory={request.max_memory!r}).")
    peft_model = PeftModel.from_pretrained(model, request.adapter_path, is_trainable=request.purpose == "train")
    on_host = {p.device.type for p in model.parameters()} == {"cpu"} and request.device != "cpu"
    if on_host and request.purpose == "inference" and request.max_memory is not None:
        return merge_and_dispatch(peft_model, request.max_memory_dict, request.offload_folder)
    return peft_model
