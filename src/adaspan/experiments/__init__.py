"""Experiments that train and measure: several methods trained and compared on one text
(``compare``), and the demo that trains, samples and reports in one command (``demo``).

Imports every part below it: ``attention``, ``model``, ``data``, ``config``, ``runtime``,
``training``, ``measure``.
"""
