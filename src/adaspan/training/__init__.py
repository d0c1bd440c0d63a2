"""Training a run: the optimisation recipe (``optim``), metrics records (``metrics``,
``recorder``), what is watched in the spans (``watch``), in memory (``memory``) and on disk
(``disk``), the run directory and its checkpoints (``checkpoint``), its one writer (``lock``),
the authors' checkpoints (``official``), a run's tokens (``tokens``), scoring a split
(``evaluate``: the validation of training and ``adaspan evaluate``'s score) and the loop
itself (``train``).

Imports ``attention``, ``model``, ``data``, ``config``, ``runtime`` and ``errors``.
"""
