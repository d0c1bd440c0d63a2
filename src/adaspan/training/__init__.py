"""Training a run: precision policy (``precision``), devices and processes (``distributed``),
the optimisation recipe (``optim``), metrics records (``metrics``, ``recorder``), what is
watched in the spans (``watch``), in memory (``memory``) and on disk (``disk``), the run
directory and its checkpoints (``checkpoint``), its one writer (``lock``), the authors'
checkpoints (``official``), a run's tokens (``tokens``), scoring a split (``evaluate``: the
validation of training and ``adaspan evaluate``'s score), the loop itself (``train``) and
spans learned for a frozen Hugging Face model (``retrofit``).

Imports ``attention``, ``model``, ``data``, ``hf``, ``config`` and ``errors``.
"""
