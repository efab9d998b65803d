"""The shipped regression suite: every check, run against the configured loader.

Run it in any repo with ``pytest --pyargs pytest_llmload.suite --llmload-loader mypkg.loading:load``,
or as the main job: ``python -m pytest_llmload``.
"""
