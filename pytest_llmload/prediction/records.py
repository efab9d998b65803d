"""What a runner prediction says, as data: the :class:`Prediction` of one scenario on one runner (its placement per
device against the runner's capacity, what was simulated, the failure it predicts or none), :class:`PredictedFailure`
that carries it out of a scenario, and :func:`bare_record` for a row that planned no map. Made by the scenarios
(:mod:`pytest_llmload.prediction.predict`), read by the rows and the main job as plain records."""

from __future__ import annotations

from typing import NamedTuple, Optional

from pytest_llmload.placement.picture import TIERS, device_order, placement_lines, placement_tiers, tier_of
from pytest_llmload.system.sizes import format_bytes


PREDICTION_PREFIX = "predict_"
DEFAULT_DTYPE = "bfloat16"  # what runs on these runners use; --llmload-dtype changes it


class PredictedFailure(AssertionError):
    """A scenario predicts that the runner would hit ``failure`` (a catalog id, or ``"OOM"``); ``prediction`` is
    the :meth:`Prediction.record` of where the model would go, where the scenario planned one."""

    def __init__(self, failure: str, message: str, prediction: Optional[dict] = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.prediction = prediction

    def __reduce__(self):  # crosses a process boundary (an isolated child) as itself
        return PredictedFailure, (self.failure, str(self), self.prediction)


class DevicePrediction(NamedTuple):
    device: str
    modules: int
    weights: int  # bytes of weights placed there
    peak: int  # the scenario's predicted peak there (load, or a training step)
    capacity: Optional[int]  # None: disk, unbounded here


class Prediction(NamedTuple):
    scenario: str
    runner: str
    model: str
    placement: dict  # {module: device}, from the loader's own from_pretrained arguments
    devices: tuple[DevicePrediction, ...]
    asked: dict  # the placement arguments the loader passed (device_map, max_memory, quantization)
    simulated: tuple[str, ...]
    failure: Optional[str] = None
    reason: str = ""
    seconds: float = 0.0
    at: str = ""  # the loader's line the verdict comes from (its from_pretrained call, or what it did after loading)

    def summary(self) -> str:
        """One line: the verdict's reason, then how many modules and bytes go to each of gpu, cpu and disk, and
        the fullest device against its capacity."""
        if not self.placement and not self.devices:
            return self.reason
        record = self.record()
        sized = [d for d in self.devices if d.capacity]
        fullest = max(sized, key=lambda d: d.peak / d.capacity, default=None)
        fill = "" if fullest is None else (f"; the fullest {fullest.device} {format_bytes(fullest.peak)} of "
                                           f"{format_bytes(fullest.capacity)}")
        return f"{self.reason} [{placement_tiers(record)}{fill}]"

    def table(self) -> str:
        """The verdict, then per tier and per device: the modules, the weights, the predicted peak against the
        capacity, which modules they are; then what was simulated."""
        lines = [f"on {self.runner} with {self.model}, would hit {self.failure}: {self.reason}" if self.failure
                 else f"on {self.runner} with {self.model}, nothing known: {self.reason}"]
        if self.placement or self.devices:
            record = self.record()
            lines += [f"  {placement_tiers(record)}", *(f"  {line}" for line in placement_lines(record))]
        lines += [f"  simulated: {note}" for note in self.simulated]
        return "\n".join(lines)

    def record(self) -> dict:
        """Where the model would go, as plain data (a row's :attr:`~pytest_llmload.reports.row.Row.prediction`,
        ``--json``'s, the HTML report's): per device (``devices``, accelerators first) its modules, weights, peak
        and capacity in bytes; per tier (``tiers``: gpu, cpu, disk) the modules, bytes and devices; per device the
        modules it holds, layers as ranges (``placement``: ``{"cuda:0": "model.embed_tokens, model.layers.0-41"}``);
        and the whole map, module by module (``device_map``)."""
        from pytest_llmload.instruments.device_map_summary import compress_modules

        device_map = {name: device_name(str(where)) for name, where in self.placement.items()}
        held: dict[str, list[str]] = {}
        for name, device in device_map.items():
            held.setdefault(device, []).append(name)
        known = {d.device: {"device": d.device, "tier": tier_of(d.device), **d._asdict()} for d in self.devices}
        unsized = {"weights": None, "peak": None, "capacity": None}  # a map planned without its sizes
        devices = [*known.values(), *({"device": device, "tier": tier_of(device), "modules": len(names), **unsized}
                                      for device, names in held.items() if device not in known)]
        devices.sort(key=lambda d: device_order(d["device"]))
        tiers = {}
        for tier in TIERS:
            there = [d for d in devices if tier_of(d["device"]) == tier]
            weights = [d["weights"] for d in there]
            tiers[tier] = {"modules": sum(d["modules"] for d in there), "devices": len(there),
                           "bytes": None if None in weights else sum(weights)}
        return {"scenario": self.scenario, "runner": self.runner, "model": self.model, "failure": self.failure,
                "reason": self.reason, "tiers": tiers, "devices": devices,
                "placement": {device: compress_modules(names, dash="-") for device, names in
                              sorted(held.items(), key=lambda item: device_order(item[0]))},
                "device_map": device_map, "simulated": list(self.simulated)}


def bare_record(scenario: str, runner: str, model: str, failure: Optional[str], reason: str) -> dict:
    """The :meth:`Prediction.record` of a row that planned no map (Trainer's decision, a placement from_pretrained
    refuses)."""
    return Prediction(scenario, runner, model, {}, (), {}, (), failure, reason).record()


def device_name(where: str) -> str:
    return f"cuda:{where}" if where.isdigit() else where

