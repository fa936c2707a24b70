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


def _big_config(clusters: int):
    from proxy import config

    routes = "".join(f"      - match: {{method: m{i}}}\n        cluster: c{i}\n" for i in range(clusters))
    eps = "".join(f"  - name: c{i}\n    endpoints: [127.0.0.1:{10000 + i}, 127.0.0.1:{20000 + i}]\n"
                  for i in range(clusters))
    return config.loads("listeners:\n  - name: l\n    listen: 127.0.0.1:0\n    routes:\n" + routes
                        + "      - cluster: c0\nclusters:\n" + eps, "big.yaml")


def test_config_text_is_made_once_per_config_off_the_loop():
    """/config for 1,000 clusters (~300 ms of pydantic's dump and json.dumps): made in a thread,
    the loop's longest gap well under that; made once per config in effect (the second request
    takes no thread), and anew for another config. Before: every request made it on the loop
    (the lifecycle hunt: a 250 ms stall of every call per /config poll)."""
    import time

    from proxy.admin import ConfigText

    big, small = _big_config(1000), _big_config(2)
    current = [big]
    made = ConfigText(lambda: current[0])

    async def gaps(make):
        longest, done = 0.0, False

        async def ticker():
            nonlocal longest
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0)
                now = time.perf_counter()
                longest = max(longest, now - last)
                last = now

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        text = await make()
        took = time.perf_counter() - t0
        done = True
        await t
        return text, longest, took

    async def main():
        first = await gaps(made.text)
        again = await gaps(made.text)
        current[0] = small
        other = await made.text()
        return first, again, other

    (text, longest, took), (text2, _, took2), other = asyncio.run(main())
    print(f"first {took * 1000:.0f} ms (longest loop gap {longest * 1000:.1f} ms), again {took2 * 1000:.2f} ms")
    assert text == json.dumps(big.effective(), indent=2, default=str) + "\n"
    assert text2 is text
    assert longest < max(0.1, took / 3), (longest, took)
    assert json.loads(other) == small.effective()
