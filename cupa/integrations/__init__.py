"""Adapters that make cupa an attention backend of other frameworks (each imported only when asked).

- :mod:`cupa.integrations.transformers`: an attention implementation for HuggingFace transformers
  (``model.generate`` with a cupa-owned paged cache, and continuous batching).
"""
