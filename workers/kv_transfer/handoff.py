"""What travels from prefill to decode besides the KV itself."""
from __future__ import annotations

from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams


@dataclass
class KVHandoff:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Decode side, from its reservation: blocks per decode rank-set (one block table serves every rank
    # of a replica) and how many leading blocks it already holds through its prefix cache (not sent).
    decode_block_ids: list[int] = field(default_factory=list)
    num_decode_hit_blocks: int = 0
    # Prefill side, after the prompt ran: where the prompt's KV is, and the first sampled token.
    prefill_block_ids: list[int] = field(default_factory=list)
    first_token_id: int | None = None
    first_logprob: float | None = None
    first_top_logprobs: list[tuple[int, float]] | None = None
    num_prefill_cached_tokens: int = 0
    # Sampler state: a seeded request draws from (seed, tokens generated so far); penalties read the
    # token history, which the decode side rebuilds from prompt + first token.
    lease_deadline: float = 0.0  # monotonic-clock deadline after which the prefill side frees its blocks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def blocks_to_send(self) -> tuple[list[int], list[int]]:
        """(prefill block ids, decode block ids) of the blocks the decode side does not hold yet."""
        k = self.num_decode_hit_blocks
        count = len(self.prefill_block_ids)
        return self.prefill_block_ids[k:count], self.decode_block_ids[k:count]
