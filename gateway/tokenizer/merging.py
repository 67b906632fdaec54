"""The merge step, run by the Rust `tokenizers` package built in memory from the GGUF vocabulary.

Both llama.cpp tokenizers are priority merges over adjacent symbols, which `tokenizers.models.BPE`
runs given a vocabulary and ranked merges (lowest rank first, leftmost first on a tie):

- gpt2: the file's merges, in file order, over byte-level symbols. A byte whose symbol is not in
  the vocabulary stays a symbol of its own (merges do not reach across it) and is then dropped,
  as llama.cpp does; here it becomes DROPPED_BYTE, which Tokenizer.encode filters out.
- llama (SentencePiece): llama.cpp merges any adjacent pair whose concatenation is a token, the
  pair making the highest-scored token first, and spells out a symbol left unmerged as `<0xXX>`
  byte tokens. The same ranking is written as BPE merges: every split of every token into two
  tokens, ordered by the score of the token they make; `byte_fallback` spells the leftovers.
  Tokens of equal score are ordered by id where llama.cpp would take the leftmost pair; scores in
  real vocabularies are distinct for normal tokens, so this only touches special tokens.
"""
from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from shared.errors import TokenizerError
from shared.vocab import Vocab

# Text of the stand-in id (one past the vocabulary) for a byte the vocabulary cannot spell.
DROPPED_BYTE = "\u0000<reame:dropped-byte>"


def build_merger(vocab: Vocab) -> HFTokenizer:
    """A `tokenizers.Tokenizer` that turns pre-split words into ids (no normalizer, no specials)."""
    table = {text: i for i, text in enumerate(vocab.tokens)}
    if len(table) != len(vocab.tokens):
        raise TokenizerError(f"{vocab.source}: the vocabulary has duplicate tokens")
    if vocab.model == "gpt2":
        merges = _file_merges(vocab, table)
        model = models.BPE(vocab={**table, DROPPED_BYTE: len(table)}, merges=merges,
                           unk_token=DROPPED_BYTE, ignore_merges=vocab.ignore_merges)
        merger = HFTokenizer(model)
        # Words arrive as text; this maps their UTF-8 bytes to the GPT-2 byte alphabet, no splitting.
        merger.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return merger
    merges = _score_merges(vocab, table)
    return HFTokenizer(models.BPE(vocab=table, merges=merges, byte_fallback=True))


def _file_merges(vocab: Vocab, table: dict[str, int]) -> list[tuple[str, str]]:
    merges = []
    for line in vocab.merges:
        # llama.cpp splits at the first space after the first character.
        cut = line.find(" ", 1)
        if cut < 0:
            continue
        left, right = line[:cut], line[cut + 1:]
        # tokenizers needs both sides and the result in the vocabulary; llama.cpp would turn a
        # result that is not into dropped bytes, so skipping such a merge is the sane reading.
        if left in table and right in table and left + right in table:
            merges.append((left, right))
    return merges


def _score_merges(vocab: Vocab, table: dict[str, int]) -> list[tuple[str, str]]:
    ranked = []
    scores = vocab.scores
    for token_id, text in enumerate(vocab.tokens):
        for cut in range(1, len(text)):
            left = text[:cut]
            if left in table:
                right = text[cut:]
                if right in table:
                    ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
