"""Instruments a check or a load runs under: phases, memory probes, deadlines, spies, the device-map summary."""
