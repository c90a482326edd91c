from hypothesis import given
from hypothesis import strategies as st

from kvgate.cluster.affinity import (
    BLOCK_CHARS,
    AffinityTable,
    ReplicaLoad,
    block_keys,
    prompt_text,
    rank,
    request_keys,
)

DOC = "第五百零九条 当事人应当按照约定全面履行自己的义务。" * 40


def chat(*contents: str) -> dict[str, object]:
    roles = ["system", "user", "assistant", "user"]
    return {
        "model": "m",
        "messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)],
    }


def test_keys_are_chained_over_whole_blocks() -> None:
    text = "x" * (3 * BLOCK_CHARS + 7)
    keys = block_keys(text)
    assert len(keys) == 3  # the tail is not a whole block
    assert block_keys(text[: 2 * BLOCK_CHARS]) == keys[:2]
    other = block_keys("y" + text[1:])
    assert not set(other) & set(keys)  # a first block apart: every key apart


def test_a_shared_document_prefix_shares_keys_across_questions() -> None:
    a = request_keys("/v1/chat/completions", chat(DOC, "第一个问题"))
    b = request_keys("/v1/chat/completions", chat(DOC, "另一个问题"))
    assert len(a) >= 2 and a[:-1] == b[:-1]
    assert request_keys("/v1/chat/completions", chat("short", "q")) == ()
    # Another model, another cache: no shared keys.
    other = {**chat(DOC, "第一个问题"), "model": "n"}
    assert not set(request_keys("/v1/chat/completions", other)) & set(a)


def test_prompt_text_of_each_endpoint() -> None:
    assert prompt_text("/v1/completions", {"model": "m", "prompt": "abc"}).endswith("abc")
    assert prompt_text("/v1/completions", {"prompt": ["p1", "p2"]}).endswith("p1")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert "hi" in prompt_text("/v1/chat/completions", parts)
    assert "inst" in prompt_text("/v1/responses", {"input": "q", "instructions": "inst"})
    assert prompt_text("/v1/models", {}) == ""
    assert prompt_text("/v1/chat/completions", {"messages": "not a list"}) == "\x1dnot a list"
    assert prompt_text("/v1/chat/completions", {"messages": 3}) == ""


def test_rank_follows_the_cache_while_load_allows() -> None:
    table = AffinityTable()
    keys = block_keys(DOC)
    table.record(keys, "b")
    even = [ReplicaLoad("a", 0), ReplicaLoad("b", 3)]
    assert rank(keys, even, table, imbalance=4) == [["b"], ["a"]]
    assert rank(keys[:1], even, table, imbalance=4) == [["b"], ["a"]]  # a prefix of it
    assert rank(keys, [ReplicaLoad("a", 0), ReplicaLoad("b", 5)], table, imbalance=4) == [
        ["a"],
        ["b"],
    ]  # too far behind: load decides
    full = [ReplicaLoad("a", 0), ReplicaLoad("b", 0, kv_usage=0.99)]
    assert rank(keys, full, table) == [["a"], ["b"]]  # equal load: in the order given
    assert rank(block_keys("z" * 2000), even, table) == [["a"], ["b"]]  # nothing cached
    assert rank(keys, [], table) == []
    three = [ReplicaLoad("a", 2), ReplicaLoad("b", 1), ReplicaLoad("c", 2)]
    assert rank(keys, three, table) == [["b"], ["a"], ["c"]]  # the holder, the rest by load
    assert rank((), three, table) == [["b"], ["a"], ["c"]]
    assert rank((), three[::-1], table) == [["b"], ["c"], ["a"]]


def test_the_deepest_holder_wins_and_a_gone_replica_is_forgotten() -> None:
    table = AffinityTable()
    keys = block_keys(DOC)
    table.record(keys[:2], "a")
    table.record(keys, "b")
    assert table.longest(keys, ["a", "b"]) == ("b", len(keys))
    assert table.longest(keys, ["a"]) == ("a", 2)
    table.forget("b")
    assert table.longest(keys, ["a", "b"]) == ("a", 2)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=200), st.integers(1, 20))
def test_the_table_stays_within_capacity(keys: list[int], capacity: int) -> None:
    table = AffinityTable(capacity=capacity, per_key=2)
    for i, key in enumerate(keys):
        table.record([key], f"r{i % 3}")
        assert len(table) <= capacity
    last = keys[-1]
    assert table.longest([last], ["r0", "r1", "r2"])[0] == f"r{(len(keys) - 1) % 3}"
