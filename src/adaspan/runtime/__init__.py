"""Where and how every command runs: the precision policy (``precision``: what ``dtype=auto``
means per job and device) and the devices, processes and threads (``distributed``: the device,
this process's place in a ``torchrun`` job, collectives of host values, torch's CPU threads).

Imports ``config`` and ``errors``.
"""
