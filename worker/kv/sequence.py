"""One request as the scheduler sees it: its tokens, how many are cached, and which blocks hold them.

Invariants (checked by the scheduler tests):
- `token_ids` = prompt + generated tokens; the prompt part never changes.
- `num_computed_tokens` <= `num_tokens`: tokens [0, num_computed_tokens) have their K/V in the
  blocks of `block_table`. A running sequence between steps has at least one token not yet
  computed (the last sampled one), which is what its next chunk feeds.
- A waiting sequence owns no blocks and has `num_computed_tokens == 0`; preemption restores that.
- Prefix cache: `block_hashes[i]` is the chain hash of full block i (shared.hashing), computed
  lazily; blocks [0, num_named_blocks) of `block_table` are registered under those names.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable

from shared.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # sampled one of params.stop_token_ids
    FINISHED_LENGTH = "length"  # produced params.max_tokens tokens
    FINISHED_ABORTED = "abort"  # cancelled by the client or the service

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED})


class Sequence:
    def __init__(self, seq_id: str, prompt_token_ids: Iterable[int], params: SamplingParams,
                 arrival_time: float, cache_namespace: bytes = b""):
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.arrival_time = arrival_time  # seconds, on whatever clock the caller passes to schedule()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # block ids; block i holds tokens [i*block_size, (i+1)*block_size)
        self.window_start = 0  # window models: first block whose window slot this sequence references
        self.num_preemptions = 0
        self.cache_namespace = cache_namespace  # whose prefix blocks it may reuse (b"": everyone's)
        self.block_hashes: list[bytes] = []
        self.num_named_blocks = 0
        self.num_cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache at admission
        self.ram_blocks = 0  # of those, blocks found in this worker's pool ...
        self.store_blocks = 0  # ... and blocks restored from the host's store
        self.partial_tokens = 0  # ... and tokens copied from the start of a block after them

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_num_tokens(self) -> int:
        """The longest this sequence can become: prompt + max_tokens."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def block_token_ids(self, index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[index * block_size:(index + 1) * block_size])

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
