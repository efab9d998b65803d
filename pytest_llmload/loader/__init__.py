"""The seam a user codes against: the request, choosing/importing/calling a loader, tiny checkpoints, transformers bridges."""
