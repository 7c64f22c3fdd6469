"""What one tokenizer per thread costs, against one tokenizer behind a lock (docs/serving.md, "Threads").

    python scripts/tokenizer_threads.py [--threads 8] [--prompts 64]

On the embedded model's tokenizer: the time and resident memory of one more thread's copy, and the time
to encode and chat-template a batch of prompts from N threads at once, each on its own copy (what hydragen
does) or all through one tokenizer behind a lock.
"""

from __future__ import annotations

import argparse
import copy
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hydragen.model.default_model import default_model_path
from hydragen.model.tokenizer import load_tokenizer


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path())
    hf = tok._first  # the loading thread's fast tokenizer
    before = rss_mb()
    t0 = time.perf_counter()
    copies = [copy.deepcopy(hf) for _ in range(8)]
    per_copy_ms = (time.perf_counter() - t0) / 8 * 1000
    per_copy_mb = (rss_mb() - before) / 8
    del copies
    prompts = [f"Tell me about the history of shared prefixes, part {i}. " * 20 for i in range(args.prompts)]
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]

    def work(encode) -> None:
        for p in prompts:
            encode(p)

    lock = threading.Lock()

    def own(p: str) -> None:
        tok.encode(p)
        tok.apply_chat_template(chat + [{"role": "user", "content": p}])

    def locked(p: str) -> None:  # the same calls, one thread at a time
        with lock:
            own(p)

    results = {}
    with ThreadPoolExecutor(args.threads) as pool:  # one pool, as the server's: each thread copies once
        list(pool.map(lambda _: own("warm up"), range(4 * args.threads)))
        for name, fn in (("one copy per thread", own), ("one tokenizer, a lock", locked)):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                list(pool.map(lambda _, fn=fn: work(fn), range(args.threads)))
                best = min(best, time.perf_counter() - t0)
            results[name] = best
    print(f"a thread's copy: {per_copy_ms:.1f} ms to make, {per_copy_mb:.1f} MB resident")
    for name, seconds in results.items():
        n = args.threads * args.prompts
        print(f"{name}: {n} prompts from {args.threads} threads in {seconds:.3f} s ({n / seconds:.0f}/s)")


if __name__ == "__main__":
    main()
