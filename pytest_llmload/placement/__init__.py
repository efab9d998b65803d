"""Where a model goes: transformers' own placement planner, runner profiles and full-size architectures."""
