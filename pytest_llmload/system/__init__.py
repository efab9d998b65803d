"""Facts about the machine and process: visible GPUs, the network guard, sizes as max_memory reads them, JSON lines,
output files opened without following another user's link, and what a traceback's frames are (a library's, ours, the
loader call's) with the deadline texts read back from it."""
