"""/stats's JSON, formatted over several turns of the loop (proxy.admin.pretty_json_async): the
same text as `json.dumps(indent=2, default=str)`, and the loop runs while it is made."""

from __future__ import annotations

import asyncio
import enum
import json

from hypothesis import given, settings, strategies as st

from harness import turns_while
from proxy.admin import pretty_json_async


class Kind(enum.Enum):  # (a value only `default=str` can write)
    A = "a"


leaves = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8)
          | st.just(Kind.A))
values = st.recursive(
    leaves,
    lambda kids: (st.lists(kids, max_size=20) | st.tuples(kids, kids)
                  | st.dictionaries(st.text(max_size=5), kids, max_size=20)
                  | st.dictionaries(st.integers(), kids, max_size=3)),  # (keys json.dumps turns into text)
    max_leaves=80)


@settings(max_examples=200, deadline=None)
@given(values)
def test_the_text_is_json_dumps_text(obj):
    assert asyncio.run(pretty_json_async(obj)) == json.dumps(obj, indent=2, default=str)


def _stats_like(clusters: int) -> dict:
    return {"ready": True, "reloads": {"ok": 1, "failed": 0},
            "clusters": {f"c{i}": {"endpoints": [{"address": f"10.0.0.{j}:9090", "healthy": j != 1,
                                                  "pools": [{"open": j, "idle": 0, "kind": Kind.A}]}
                                                 for j in range(3)],
                                   "retry_budget": {"percent": 20.0, "min_per_second": 10.0}}
                         for i in range(clusters)}}


def test_a_large_page_lets_the_loop_run_while_it_is_formatted():
    """2,000 clusters' worth (~60 ms or more of formatting here), and one list of 200,000
    numbers: other work runs every SLICE (2 ms) of formatting, inside a big list too (before:
    json.dumps held the loop for all of it)."""
    for obj in (_stats_like(2000), {"a": {"b": {"c": list(range(200_000))}}}):
        text, ticks = turns_while(lambda: pretty_json_async(obj))
        assert text == json.dumps(obj, indent=2, default=str)
        assert ticks >= 5, ticks


def test_a_dict_that_grows_while_it_is_formatted_is_no_error():
    """The admin formats a snapshot of its own; should a dict of the server's be in it and gain
    a key between two turns, the text is made at once instead (before: a 500)."""
    live = {f"k{i}": list(range(200)) for i in range(2000)}

    async def grow_meanwhile():
        async def grow():
            await asyncio.sleep(0)
            live["new"] = [-1]
        task = asyncio.ensure_future(grow())
        text = await pretty_json_async({"live": live})
        await task
        return text

    text = asyncio.run(grow_meanwhile())
    assert "new" in live and json.loads(text)["live"] == live
