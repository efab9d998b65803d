"""This repo's own test configuration. The plugin itself is loaded through its pytest11 entry point."""

pytest_plugins = ["pytester"]
