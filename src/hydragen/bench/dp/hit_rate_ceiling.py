"""The highest prefix-cache hit rate any router could reach on a workload: its compulsory misses only.

One unbounded cache that every request goes through keeps every page it has ever seen, so the only prompt
tokens it misses are those no earlier request had in front of them (a tenant's system prompt the first
time, each new question). N replicas cannot do better: every replica's cache is at most that cache, and a
router only chooses which one a request meets. Dividing this ceiling by round-robin's hit rate bounds the
"hit rate over round-robin" any router can show on that workload.

Counted as the replicas count (``hydragen_prefix_cache_hit_rate``): whole pages only, and never a prompt's
last token, which every request computes to sample its first output. Requests are taken in arrival order
without service time (session start plus its turns' think times); the order only decides which request
meets a prefix first, not how many misses there are, as long as a chat's turns keep their order.
"""

from __future__ import annotations

from hydragen.bench.dp.chat_tokens import ChatTokens
from hydragen.bench.dp.workload import Workload
from hydragen.kv.page_hash import page_hashes


def hit_rate_ceiling(w: Workload, tokens: ChatTokens, page_size: int = 16) -> float:
    """Prompt tokens an unbounded shared cache would hold / prompt tokens, over ``w``'s requests."""
    order = []
    for s in w.sessions:
        t = s.start_s
        for k, turn in enumerate(s.turns):
            t += turn.delay_s
            order.append((t, s.index, k, s))
    order.sort(key=lambda x: x[:3])
    seen: set[int] = set()
    hit = total = 0
    for _, _, k, s in order:
        prompt, _ = tokens.turn(s, k)
        pages = page_hashes(prompt, page_size)
        cached = 0
        while cached < len(pages) and pages[cached] in seen:
            cached += 1
        hit += min(cached * page_size, len(prompt) - 1)
        total += len(prompt)
        answer, _ = tokens.answer(s, k)
        # what the replica holds once the answer is done: every token but the last has its KV written
        seen.update(page_hashes(prompt + answer[:-1], page_size))
    return hit / total if total else 0.0
