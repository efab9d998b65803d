"""Vocabulary, settings and stash keys: the names the plugin reads, and where a run keeps its choices."""
