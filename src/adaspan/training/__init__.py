"""Training a run: precision policy (``precision``), devices and processes (``distributed``),
the optimisation recipe (``optim``), metrics records (``metrics``, ``recorder``), what is
watched in the spans (``watch``) and in memory (``memory``), the run directory and its
checkpoints (``checkpoint``), the authors' checkpoints (``official``), a run's tokens
(``tokens``), scoring a split (``evaluate``: the validation of training and ``adaspan
evaluate``'s score) and the loop itself (``train``).

Imports ``attention``, ``model``, ``data``, ``config`` and ``errors``.
"""
