"""PagedAllocator keeps one record per holder (`held`: block table, count, registered blocks) so a
decode looks it up once; `tables`, `num_tokens` and `registered` stay readable as before, read-only.
"""

from __future__ import annotations

import pytest

from varlen.kv import ContiguousAllocator, PagedAllocator
from varlen.kv.paged import Held
from varlen.request import Request
from varlen.sampling_params import SamplingParams


def _decoding(rid: str, prompt: int) -> Request:
    start = 100 * ord(rid)  # its own content: no prefix shared with another holder
    return Request(rid, list(range(start, start + prompt)), SamplingParams(max_tokens=100))


@pytest.mark.parametrize("caching", [False, True])
def test_one_record_per_holder_read_through_the_old_names(caching: bool) -> None:
    kv = PagedAllocator(40, 4, None, enable_prefix_caching=caching)
    a, b = _decoding("a", 6), _decoding("b", 9)
    assert kv.allocate(a, 6) and kv.allocate(b, 9)
    for r in (a, b):
        r.num_computed_tokens = r.num_prompt_tokens
        r.output_token_ids.append(1)
    assert kv.allocate_decodes([a, b], 2) == 2  # a: 7 tokens in its 2 blocks; b: 10, a third block
    assert set(kv.held) == {"a", "b"}
    ha, hb = kv.held["a"], kv.held["b"]
    assert isinstance(ha, Held) and ha.blocks == [0, 1] and ha.count == 7
    assert hb.blocks == [2, 3, 4] and hb.count == 10
    assert ha.registered == (1 if caching else 0) and hb.registered == (2 if caching else 0)
    # The old names read the records: the same table objects, the same counts.
    assert dict(kv.num_tokens) == {"a": 7, "b": 10} and kv.live_tokens == 17
    assert kv.tables["a"] is ha.blocks and kv.block_table(b) is hb.blocks and set(kv.tables) == {"a", "b"}
    assert dict(kv.registered) == {"a": ha.registered, "b": hb.registered}
    kv.free(a)
    assert "a" not in kv.held and "a" not in kv.tables and dict(kv.num_tokens) == {"b": 10} and kv.live_tokens == 10


def test_the_old_names_refuse_writes() -> None:
    # A write would be lost silently otherwise: the pool keeps its counts and tables in `held`.
    kv = PagedAllocator(10, 4, None, enable_prefix_caching=False)
    r = _decoding("r", 5)
    assert kv.allocate(r, 5)
    with pytest.raises(TypeError):
        kv.num_tokens["r"] = 9  # type: ignore[index]
    with pytest.raises(TypeError):
        kv.tables["s"] = [7]  # type: ignore[index]
    assert kv.held["r"].count == 5 and "s" not in kv.held
    other = ContiguousAllocator(10, 4, 40)
    assert other.allocate(r, 5) and dict(other.num_tokens) == {"r": 5}
    with pytest.raises(TypeError):
        other.num_tokens["r"] = 9  # type: ignore[index]


def test_a_holder_without_a_count_is_not_listed() -> None:
    # As before: num_tokens lists a holder once it asked for at least one slot.
    kv = PagedAllocator(10, 4, None, enable_prefix_caching=False)
    r = _decoding("r", 5)
    assert kv.allocate(r, 0)
    assert "r" in kv.held and dict(kv.num_tokens) == {} and kv.live_tokens == 0
