"""Paged KV-cache bookkeeping: which blocks each sequence holds, reference counts, a free list,
and prefix caching. A full block is known by a 64-bit hash chained over every token up to its
end; a hit is also checked against the block's own tokens, so sharing wrong keys would take a
64-bit collision of the hash of the tokens before it."""
import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(token_ids, prefix_hash: int | None) -> int:
    h = xxhash.xxh64()
    if prefix_hash is not None:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered: blocks freed longest ago are reused first, so cached prefixes live longest.
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_hit_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks equal to the sequence's leading full blocks. The block holding the
        last token is never taken from the cache: that token must be computed to be sampled from."""
        if not self.enable_prefix_caching:
            return []
        hits, prefix_hash = [], None
        for start in range(0, (len(seq) - 1) // self.block_size * self.block_size, self.block_size):
            tokens = tuple(seq.token_ids[start:start + self.block_size])
            prefix_hash = chain_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def admit(self, seq: Sequence, token_budget: int) -> int:
        """Gives a waiting sequence its cached prefix and blocks for as many further tokens as the
        budget allows. Returns how many tokens to compute now, or 0 (nothing changed) if the
        blocks are not there."""
        hits = self._cached_prefix(seq)
        num_cached = len(hits) * self.block_size
        num_new = min(seq.num_uncomputed_tokens() - num_cached, token_budget)
        new_blocks = self.blocks_needed(num_cached + num_new) - len(hits)
        revived = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        if num_new <= 0 or new_blocks + revived > self.num_free_blocks:
            return 0
        for block_id in hits:
            self._take(block_id)
        self.prefix_cache_hit_blocks += len(hits)
        seq.block_table = hits + [self._allocate() for _ in range(new_blocks)]
        seq.num_computed_tokens = num_cached
        return num_new

    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Adds blocks so that `num_new` more tokens fit; False (nothing changed) if too few are free."""
        missing = self.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_table)
        if missing > self.num_free_blocks:
            return False
        seq.block_table.extend(self._allocate() for _ in range(max(missing, 0)))
        return True

    def trim(self, seq: Sequence) -> None:
        """Gives back the blocks past the sequence's computed tokens (reserved for proposals
        that were rejected); the next step grows the table again as needed."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are reused before the prefix blocks other prompts may share.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []  # a new list, not cleared: steps in flight keep the old one (Scheduler.postprocess)
        seq.num_computed_tokens = 0

    def register_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Makes the blocks that computing tokens [start, end) filled findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for index in range(start // size, end // size):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                continue
            prefix_hash = self.blocks[seq.block_table[index - 1]].hash if index else None
            block.token_ids = tuple(seq.token_ids[index * size:(index + 1) * size])
            block.hash = chain_hash(block.token_ids, prefix_hash)
            self.hash_to_block_id.setdefault(block.hash, block.block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _allocate(self) -> int:
        block_id = next(iter(self.free_block_ids))
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, ()
        self._take(block_id)
        return block_id
