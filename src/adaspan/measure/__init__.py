"""What users look at: sampling (``generate``), speed and memory (``bench``), a run's report
and several runs compared (``report``, ``compare``, with their pages, figures and tables:
``page``, ``plots``, ``tables``) and the demo (``demo``).

Imports every part below it: ``attention``, ``model``, ``data``, ``config``, ``training``.
"""
