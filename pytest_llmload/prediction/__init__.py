"""Predictions for a runner this machine is not: what the loader under test would do on an 8-GPU node with a 70B
model, worked out on a CPU runner in seconds.

- :mod:`.predict`: the scenarios, each naming the known failure it predicts, run as on each rank of that runner
- :mod:`.records`: what a prediction says (its placement per device against capacity, the failure or none), as data
- :mod:`.interception`: the loader's ``from_pretrained``, dispatch and after-loading calls, seen without loading
- :mod:`.simulated_machine`: the runner simulated in this process (``torch.cuda`` as its, ZeRO-3, the launcher)
- :mod:`.gating`: which predicted rows fail the run
"""
