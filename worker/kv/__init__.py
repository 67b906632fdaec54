"""Where a sequence's K/V live: the block manager of the paged pool (and its sliding-window
slots), the prefix cache that names and reuses full blocks, and the host's LMDB store behind it.

Imports point down: worker.kv reads worker.engine (the pool's arrays) and shared, never
worker.sched or the process modules above it.
"""
