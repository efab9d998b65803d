"""The conformance checks: plain functions ``check_<name>(loader, checkpoint, workdir)`` that a downstream
repo runs against its own loader. Each raises ``AssertionError`` with the figures when the loader
reproduces a known failure. Grouped by write-up: ``offload``, ``distributed``, ``trainer``.
"""
