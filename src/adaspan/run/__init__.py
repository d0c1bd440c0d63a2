"""A run directory and what it holds: the directory as one object, its configuration and
checkpoints (``checkpoint``: ``RunDir``), its one writer (``lock``), its metrics records
(``metrics``), the disk its checkpoints need (``disk``) and its tokens (``tokens``: the
tokenizer, the splits as ids, a converted run's symbols).

Imports ``attention``, ``model``, ``data``, ``config``, ``runtime`` and ``errors``.
"""
