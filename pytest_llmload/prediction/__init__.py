"""Predictions for a runner this machine is not: what the loader under test would do on an 8-GPU node with a 70B
model, worked out on a CPU runner in seconds.

- :mod:`.profiles`: runner profiles (devices, memory per device, host memory, disk), shipped and user-written
- :mod:`.architectures`: real architectures at full size (public configs), built on meta, no weights
- :mod:`.planner`: the placement ``from_pretrained`` would choose there (transformers' own decision)
- :mod:`.predict`: the loader run as on each rank of that runner, its ``from_pretrained`` intercepted, and the
  known failure each check's scenario would meet there
"""
