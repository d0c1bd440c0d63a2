"""Text and tokens: corpora as bytes with their splits and batching (``corpora``), enwik8 and
text8 (``download``), generated corpora (``synthetic``), tokenizers (``tokenizer``), and files
written atomically or read without running code (``files``).

Imports only ``errors``.
"""
