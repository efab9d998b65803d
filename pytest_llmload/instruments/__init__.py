"""Instruments a check or a load runs under: phases (the record they go to, the heartbeat that reports long ones),
memory probes, deadlines, spies, the device-map summary."""
