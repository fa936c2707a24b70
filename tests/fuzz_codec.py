"""`make fuzz`: a million and more inputs through the codec, compiled scanner against pure.

Each input is one of
  scan    bytes for the unframed-message scanner (random, a real message, or one broken in a
          few places; depth limits 64/3/1/0): both scanners, fed the same reads (whole, byte
          by byte or random cuts), agree after every advance (result, error message, pos,
          reach, examined, state), and the outcome does not depend on the reads;
  decode  a stream for one decoder config (every framing x protocol of the codec fixtures,
          auto-detection, "header" reading nested THeader): 1-3 pipelined real messages, most
          broken in a few places, some random bytes, small max_frame_size too. The codec
          invariant: only messages or a ProtocolError, and the same outcomes whether the bytes
          come in one read, byte by byte or cut at random; for unframed configs also the same
          with either scanner; valid pipelined messages decode to exactly themselves.
The checks are tests/test_scanner_compiled.py's (check_scan, check_decode), run here without
Hypothesis's per-example overhead, in one process per CPU.

An input that fails is appended to tests/fuzz_corpus/ (so `make test` fails on it until
fixed) and printed; so is the first input with an outcome the corpus has no input for yet
(its shape: protocol or config, and the result with numbers and names blanked).

    python tests/fuzz_codec.py [--inputs 1000000] [--jobs N] [--seed S] [--no-corpus]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time
import traceback
from collections import Counter

_TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (_TESTS, os.path.join(_TESTS, "gen")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import test_scanner_compiled as t  # noqa: E402
from proxy.codec import scan  # noqa: E402

BATCH = 2_000
DECODE_CONFIGS = list(t.CONFIGS)


def one_input(seed: int):
    """Run one input. Returns (kind, label, signature, corpus file, corpus line)."""
    rnd = random.Random(seed)
    if rnd.random() < 0.5:
        compact, data, pos, max_depth = t.gen_scan_input(rnd)
        line = f"{'compact' if compact else 'binary'} {pos} {max_depth} {data.hex()}"
        # Byte by byte costs a step per byte: every input gets whole and random cuts, a quarter also that.
        outcome = t.check_scan(data, compact, pos, rnd, max_depth, bytewise=rnd.random() < 0.25)
        return "scan", "compact" if compact else "binary", t._scan_sig(compact, outcome[0]), "scan.txt", line
    cid = rnd.choice(DECODE_CONFIGS)
    stream, max_frame_size, expected = t.gen_stream(rnd, cid)
    line = f"{cid} {max_frame_size} {stream.hex()}"
    outcome = t.check_decode(cid, stream, max_frame_size, rnd, expected)
    return "decode", cid, t._decode_sig(cid, outcome), "decode.txt", line


def run_batch(args):
    seed, n = args
    counts = Counter()
    shapes: dict[tuple[str, str], str] = {}
    failures = []
    master = random.Random(seed)
    for _ in range(n):
        s = master.getrandbits(64)
        try:
            kind, label, sig, name, line = one_input(s)
        except Exception:  # noqa: BLE001 - a failed check or a crash: both are findings
            failures.append((s, traceback.format_exc(limit=6)))
            counts["failed"] += 1
            continue
        counts[kind] += 1
        counts[f"{kind}:{label}"] += 1
        key = (name, sig)
        if key not in shapes or len(line) < len(shapes[key]):
            shapes[key] = line
    return counts, shapes, failures


def failing_line(seed: int) -> tuple[str, str]:
    """Regenerate a failed input's corpus line from its seed (the generator is deterministic)."""
    rnd = random.Random(seed)
    if rnd.random() < 0.5:
        compact, data, pos, max_depth = t.gen_scan_input(rnd)
        return "scan.txt", f"{'compact' if compact else 'binary'} {pos} {max_depth} {data.hex()}"
    cid = rnd.choice(DECODE_CONFIGS)
    stream, max_frame_size, _ = t.gen_stream(rnd, cid)
    return "decode.txt", f"{cid} {max_frame_size} {stream.hex()}"


def known_shapes() -> set[tuple[str, str]]:
    known = set()
    for entry in t._read_corpus("scan.txt"):
        compact, data, pos, max_depth = t._scan_entry(entry)
        s = t.PureStructScanner(compact, pos, max_depth)
        known.add(("scan.txt", t._scan_sig(compact, t.attempt(s, data, len(data)))))
    for entry in t._read_corpus("decode.txt"):
        cid, m, h = entry if len(entry) == 3 else (*entry, "")
        out = t.decode([bytes.fromhex(h)], *t.CONFIGS[cid], int(m), t.PureStructScanner)
        known.add(("decode.txt", t._decode_sig(cid, out)))
    return known


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-corpus", action="store_true", help="do not add to tests/fuzz_corpus/")
    args = ap.parse_args()
    if t.CompiledStructScanner is None:
        print("fuzz: the compiled scanner is not built (pip install -e . / make deps)", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    print(f"fuzz: {args.inputs:,} inputs, {args.jobs} processes, seed {seed}, scanner {scan.SCANNER_IMPL}",
          flush=True)
    # Build the fixtures once here; forked workers inherit them.
    t.real_messages()
    for w in t.cf.WIRES:
        t.cf.fixture_list(w)

    master = random.Random(seed)
    batches = []
    left = args.inputs
    while left > 0:
        n = min(BATCH, left)
        batches.append((master.getrandbits(64), n))
        left -= n

    counts = Counter()
    shapes: dict[tuple[str, str], str] = {}
    failures = []
    start = time.monotonic()
    last = start
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.jobs) as pool:
        for c, sh, f in pool.imap_unordered(run_batch, batches):
            counts.update(c)
            for key, line in sh.items():
                if key not in shapes or len(line) < len(shapes[key]):
                    shapes[key] = line
            failures.extend(f)
            now = time.monotonic()
            if now - last >= 30:
                done = counts["scan"] + counts["decode"] + counts["failed"]
                print(f"  {done:,} inputs, {done / (now - start):,.0f}/s, {len(failures)} failed", flush=True)
                last = now
    elapsed = time.monotonic() - start
    done = counts["scan"] + counts["decode"] + counts["failed"]

    print(f"fuzz: {done:,} inputs in {elapsed:,.0f} s ({done / elapsed:,.0f}/s): "
          f"{counts['scan']:,} scanner (both implementations), {counts['decode']:,} decoder streams, "
          f"{len(failures)} failed")
    print("  scanner: " + ", ".join(f"{k[5:]} {v:,}" for k, v in sorted(counts.items()) if k.startswith("scan:")))
    print("  decoder: " + ", ".join(f"{k[7:]} {v:,}" for k, v in sorted(counts.items()) if k.startswith("decode:")))
    print(f"  {len(shapes)} distinct outcome shapes")

    added = 0
    if not args.no_corpus:
        os.makedirs(t.CORPUS, exist_ok=True)
        known = known_shapes()
        new = sorted((k, line) for k, line in shapes.items() if k not in known)
        fails = [failing_line(s) for s, _ in failures[:20]]
        for name in ("scan.txt", "decode.txt"):
            lines = [line for (n, _), line in new if n == name] + [line for n, line in fails if n == name]
            if lines:
                with open(t.CORPUS / name, "a") as fh:
                    fh.writelines(line + "\n" for line in lines)
        added = len(new) + len(fails)
        print(f"  corpus: {added} inputs added to {t.CORPUS} ({len(new)} new outcome shapes, "
              f"{len(fails)} failures)")
    for s, tb in failures[:5]:
        print(f"\nFAILED input (seed {s}):\n{tb}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
