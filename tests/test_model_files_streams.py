"""The split of what a worker lacks into transfer streams (plugins/modules/hy3spark_model_files.py split_streams):
every file in exactly one stream, no empty stream, the bytes spread evenly, the order within a stream kept."""

from __future__ import annotations

import random

import pytest
from collection_plugins import plugin

split_streams = plugin("modules", "hy3spark_model_files").split_streams


def _sizes(n: int, seed: int) -> tuple[list[str], dict[str, int]]:
    rng = random.Random(seed)
    need = [f"snapshots/c0ffee/model-{i:05d}.safetensors" for i in range(n)]
    return need, {path: rng.randint(1, 5 << 30) for path in need}


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_every_file_goes_to_exactly_one_stream_and_the_bytes_are_even(streams: int, seed: int) -> None:
    need, sizes = _sizes(40, seed)
    lists = split_streams(need, sizes, streams)
    assert len(lists) == streams
    assert sorted(p for lst in lists for p in lst) == sorted(need)
    loads = [sum(sizes[p] for p in lst) for lst in lists]
    # Longest-first greedy: no stream carries more than the even share plus one file.
    assert max(loads) <= sum(loads) / streams + max(sizes.values())
    for lst in lists:
        assert lst == [p for p in need if p in lst], "a stream keeps the files in the order they were needed"


def test_fewer_files_than_streams_leaves_no_empty_stream() -> None:
    need = ["snapshots/c0ffee/a.safetensors", "refs/main"]
    lists = split_streams(need, {"snapshots/c0ffee/a.safetensors": 10}, 8)
    assert sorted(map(tuple, lists)) == [("refs/main",), ("snapshots/c0ffee/a.safetensors",)]


def test_nothing_needed_is_no_stream_at_all() -> None:
    assert split_streams([], {}, 4) == []


def test_two_equal_shards_and_two_streams_go_one_each() -> None:
    need = ["s/a", "s/b", "trees/c.json"]
    lists = split_streams(need, {"s/a": 100, "s/b": 100}, 2)
    assert sorted(len(lst) for lst in lists) == [1, 2]
    assert all(not ({"s/a", "s/b"} <= set(lst)) for lst in lists), "the two shards must not share a stream"
