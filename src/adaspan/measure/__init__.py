"""What users look at: sampling (``generate``), speed and memory (``bench``), a run's report
and that of ``longeval`` outputs (``report``) and the pages, figures and tables of reports and
comparisons (``page``, ``plots``, ``tables``).

Imports every part below it: ``attention``, ``model``, ``data``, ``config``, ``runtime``,
``training``.
"""
