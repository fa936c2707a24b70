"""/stats's JSON, formatted in pieces (proxy.admin.pretty_json): the same text as
`json.dumps(indent=2, default=str)`, and the loop runs between the pieces."""

from __future__ import annotations

import enum
import json

from hypothesis import given, settings, strategies as st

from harness import turns_while
from proxy.admin import pretty_json, pretty_json_async


class Kind(enum.Enum):  # (a value only `default=str` can write)
    A = "a"


leaves = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8)
          | st.just(Kind.A))
values = st.recursive(
    leaves,
    lambda kids: (st.lists(kids, max_size=20)
                  | st.dictionaries(st.text(max_size=5), kids, max_size=20)
                  | st.dictionaries(st.integers(), kids, max_size=3)),  # (keys json.dumps turns into text)
    max_leaves=80)


@settings(max_examples=300, deadline=None)
@given(values)
def test_the_pieces_joined_are_json_dumps_text(obj):
    assert "".join(pretty_json(obj)) == json.dumps(obj, indent=2, default=str)


def test_big_containers_deep_down_are_split_and_still_the_same_text():
    deep = {"a": {"b": {"c": [{"i": i, "l": list(range(i % 3))} for i in range(200)], "d": {}}},
            "e": [[{"x": {str(i): i for i in range(100)}}]]}
    pieces = list(pretty_json(deep))
    assert "".join(pieces) == json.dumps(deep, indent=2, default=str)
    assert len(pieces) > 200  # (the 200-entry list an entry at a time, and the 100-key dict)


def _stats_like(clusters: int) -> dict:
    return {"ready": True, "reloads": {"ok": 1, "failed": 0},
            "clusters": {f"c{i}": {"endpoints": [{"address": f"10.0.0.{j}:9090", "healthy": j != 1,
                                                  "pools": [{"open": j, "idle": 0, "kind": Kind.A}]}
                                                 for j in range(3)],
                                   "retry_budget": {"percent": 20.0, "min_per_second": 10.0}}
                         for i in range(clusters)}}


def test_a_large_page_lets_the_loop_run_while_it_is_formatted():
    """2,000 clusters' worth (~60 ms or more of formatting here): other work runs between the
    pieces, every SLICE (2 ms) of formatting (before: json.dumps held the loop for all of it)."""
    obj = _stats_like(2000)
    text, ticks = turns_while(lambda: pretty_json_async(obj))
    assert text == json.dumps(obj, indent=2, default=str)
    assert ticks >= 5, ticks


def test_a_live_dict_that_grows_between_pieces_is_no_error():
    live = {f"k{i}": {"n": i} for i in range(20)}
    pieces = pretty_json({"live": live})
    out = [next(pieces) for _ in range(4)]
    live["new"] = {"n": -1}  # (as a counter dict might gain a key while the page is formatted)
    out.extend(pieces)
    assert json.loads("".join(out))["live"] == {f"k{i}": {"n": i} for i in range(20)}
