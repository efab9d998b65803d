"""Facts about the machine and process: visible GPUs, the network guard, sizes as max_memory reads them, JSON lines."""
