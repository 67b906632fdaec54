"""Speculative decoding: draft tokens the model is likely to repeat, verify several per step.

prompt_lookup: the sequence's own earlier n-grams propose what followed them.
archive: n-gram counts of earlier completions of the same model propose their most frequent
continuation (optionally backed by a host-wide LMDB store, archive_store).
speculator: per-sequence draft length and on/off from measured acceptance and step costs.

Pure Python over token ids: the scheduler asks for drafts, the generator verifies them.
"""
