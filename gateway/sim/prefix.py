"""The simulated prefix cache: vLLM's automatic prefix caching, over 16-token blocks.

A prompt's full blocks are keyed by a hash chain (`gateway.sim.tokens.block_hashes`), so a
block is a hit only when everything before it matches too. When a sequence is scheduled its
longest cached prefix is looked up, and it prefills only the rest; once its prefill is done its
blocks are cached. The capacity is in tokens (whole blocks); the least recently used blocks go
first, a prompt's later blocks before its earlier ones (as vLLM frees them), so a shared prefix
outlives the tails that follow it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.sim.tokens import BLOCK_TOKENS

__all__ = ["PrefixCache"]


class PrefixCache:
    """The cached blocks of one simulated model, least recently used first."""

    __slots__ = ("_blocks", "capacity_blocks")

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = capacity_tokens // BLOCK_TOKENS
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Tokens of the longest cached prefix, marked as just used.

        At least the prompt's last token is computed (it makes the first output token), so a
        prompt that is all cached still prefills its last block, as in vLLM.
        """
        usable = min(len(hashes), (prompt_tokens - 1) // BLOCK_TOKENS)
        blocks = self._blocks
        hit = 0
        while hit < usable and hashes[hit] in blocks:
            hit += 1
        for key in reversed(hashes[:hit]):
            blocks.move_to_end(key)
        return hit * BLOCK_TOKENS

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Cache a prefilled prompt's blocks, evicting the least recently used beyond capacity."""
        blocks = self._blocks
        for key in reversed(hashes):
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
