"""Where a model goes: transformers' own placement planner (:mod:`.planner`), the placement one loader call gets on a
runner profile (:mod:`.planned`), runner profiles and full-size architectures. The predictions and the checks that
simulate GPUs share it."""
