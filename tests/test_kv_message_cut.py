"""How a KV transfer is cut into messages (workers/kv_transfer/plan.py message_cut): the plain cut, and the ramp
that starts and ends a multi-message transfer on small messages."""
from __future__ import annotations

import pytest

from workers.kv_transfer.plan import message_cut

MB = 1 << 20


def _per_layer(tokens: int) -> int:  # Llama-3.1-8B: K and V, 8 heads x 128, bf16
    return 2 * tokens * 8 * 128 * 2


@pytest.mark.parametrize("tokens", [16, 1024, 2048, 8192, 32768, 131072])
@pytest.mark.parametrize("ramp", [0, 8 * MB, 16 * MB, 64 * MB])
def test_every_layer_once_and_no_message_over_the_plain_size(tokens, ramp):
    cut = message_cut(32, _per_layer(tokens), 256 * MB, ramp_bytes=ramp)
    assert sum(cut) == 32 and all(c >= 1 for c in cut)
    plain = message_cut(32, _per_layer(tokens), 256 * MB)
    assert max(cut) <= max(plain)


def test_plain_cut_is_whole_messages_of_the_largest_size_that_fits():
    assert message_cut(32, _per_layer(8192), 256 * MB) == [8, 8, 8, 8]
    assert message_cut(32, _per_layer(32768), 256 * MB) == [2] * 16
    assert message_cut(30, _per_layer(8192), 256 * MB) == [8, 8, 8, 6]
    assert message_cut(32, _per_layer(1024), 256 * MB, min_messages=4) == [8, 8, 8, 8]
    assert message_cut(3, 10 * MB, 1 * MB) == [1, 1, 1]  # a layer larger than a message still goes whole


def test_ramp_starts_small_doubles_and_mirrors_at_the_end():
    cut = message_cut(32, _per_layer(8192), 256 * MB, ramp_bytes=16 * MB)  # 32 MiB a layer: the ramp starts at one
    assert cut[:4] == [1, 2, 4, 8] and cut[-3:] == [4, 2, 1]
    assert cut[-3:] == cut[:3][::-1]
    cut = message_cut(32, _per_layer(8192), 256 * MB, ramp_bytes=64 * MB)
    assert cut[:3] == [2, 4, 8] and cut[-2:] == [4, 2]


def test_a_transfer_that_fits_one_message_is_not_cut_by_the_ramp():
    # a 2K-token handoff (256 MiB) stays one message: the served default's common case
    assert message_cut(32, _per_layer(2048), 256 * MB, ramp_bytes=16 * MB) == [32]
    assert message_cut(32, _per_layer(1024), 256 * MB, ramp_bytes=16 * MB) == [32]


def test_ramp_leaves_room_for_plain_messages_when_few_layers():
    cut = message_cut(4, 64 * MB, 128 * MB, ramp_bytes=16 * MB)  # plain [2, 2]
    assert sum(cut) == 4 and len(cut) <= 4
