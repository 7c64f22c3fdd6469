"""KV events: the prefix tree's log of stored and removed pages, its vLLM wire format over ZMQ, and the
exact mirror a router builds from it."""

from __future__ import annotations

import random
import threading
import time

import msgspec
import pytest
import zmq

from hydragen import LLM, SamplingParams
from hydragen.dp.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    to_wire,
)
from hydragen.dp.router import ReplicaState
from hydragen.kv.page_hash import page_hash, page_hashes
from hydragen.kv.radix import PageEvent

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


def tree_hashes(engine) -> set[int]:
    """Every cached page's chained hash, recomputed from the tree's own paths."""
    out = set()
    for node in engine.tree.nodes.values():
        path = []
        while node.parent is not None:
            path.append(node.tokens)
            node = node.parent
        h = None
        for key in reversed(path):
            h = page_hash(h, key)
        out.add(h)
    return out


def test_page_hashes_chain_whole_pages_only():
    a = list(range(100, 150))
    b = a[:32] + [7] * 18
    ha, hb = page_hashes(a, 16), page_hashes(b, 16)
    assert len(ha) == 3 and len(hb) == 3  # 50 tokens: three whole pages, the partial one is not named
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert page_hashes(a[16:], 16)[0] != ha[1]  # the same tokens after another page are another page
    assert all(0 <= h < 2**63 for h in ha)


@pytest.mark.parametrize("seed", [0, 1])
def test_events_mirror_the_tree_exactly_under_memory_pressure(path, seed):
    """A mirror built only from the events equals the tree after every step, while a small pool evicts,
    preempts and aborts: the router's view of a replica is exact, not approximate."""
    rng = random.Random(seed)
    stems = [[rng.randrange(20, 250) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
    tails = [[rng.randrange(20, 250) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
    prompts = [rng.choice(stems)[: rng.randrange(1, 90)] + tail for tail in tails]
    llm = LLM(path, kv_cache_tokens=16 * 14, page_size=16, max_num_seqs=8)
    eng = llm.engine
    mirror = ReplicaState(approx_capacity=1)
    batches: list[list[PageEvent]] = []
    eng.publish_kv_events(batches.append)
    reqs = [eng.add_request(p, SamplingParams(n=2, max_tokens=10, **GREEDY)) for p in prompts]
    steps, removed = 0, 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 5:
            eng.abort(reqs[3].request_id)
        for events in batches:
            for event in to_wire(events, 16):
                mirror.apply(event)
                removed += isinstance(event, BlockRemoved)
        batches.clear()
        assert mirror.cached == tree_hashes(eng), f"step {steps}"
        assert steps < 3000
    assert removed > 0 and eng.stats.preemptions > 0  # evictions really happened
    eng.reset_prefix_cache()
    for events in batches:
        for event in to_wire(events, 16):
            mirror.apply(event)
    assert mirror.cached == tree_hashes(eng) == set()


def test_a_prompt_is_found_by_its_token_ids(path):
    """The hashes a router computes from a request's token ids are the ones its replica published."""
    llm = LLM(path, kv_cache_tokens=4096, page_size=16)
    mirror = ReplicaState(approx_capacity=1)
    llm.engine.publish_kv_events(lambda events: [mirror.apply(e) for e in to_wire(events, 16)])
    prompt = list(range(30, 30 + 70))
    llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    follow_up = prompt[:64] + [5, 6, 7] * 10
    assert mirror.match_pages(page_hashes(follow_up, 16)) == 4
    assert mirror.match_pages(page_hashes([9] + prompt, 16)) == 0


def test_events_start_with_what_is_already_cached(path):
    llm = LLM(path, kv_cache_tokens=4096, page_size=16)
    llm.generate([list(range(40, 90))], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    got: list[PageEvent] = []
    llm.engine.publish_kv_events(got.extend)
    assert {e.hash for e in got if e.stored} == tree_hashes(llm.engine) and len(got) == 3


def test_wire_format_is_vllms_tagged_arrays():
    events = [
        PageEvent(True, 11, None, tuple(range(4))),
        PageEvent(True, 12, 11, tuple(range(4, 8))),
        PageEvent(True, 21, 5, tuple(range(4))),
        PageEvent(False, 11),
        PageEvent(False, 12),
    ]
    wire = to_wire(events, 4)
    assert wire == [
        BlockStored([11, 12], None, list(range(8)), 4),
        BlockStored([21], 5, list(range(4)), 4),
        BlockRemoved([11, 12]),
    ]
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(1.5, wire + [AllBlocksCleared()], 0)))
    assert raw == [
        1.5,
        [
            ["BlockStored", [11, 12], None, list(range(8)), 4, None, "CPU"],
            ["BlockStored", [21], 5, [0, 1, 2, 3], 4, None, "CPU"],
            ["BlockRemoved", [11, 12], "CPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]


class Batches:
    """A subscriber's ``on_batch`` that tests can wait on."""

    def __init__(self):
        self.got: list[KVEventBatch] = []
        self.arrived = threading.Condition()

    def __call__(self, batch: KVEventBatch) -> None:
        with self.arrived:
            self.got.append(batch)
            self.arrived.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.got) >= count, timeout=timeout)


def test_publisher_to_subscriber_with_replay():
    """A late subscriber gets the batches it missed from the replay socket, in order."""
    pub = KVEventPublisher("tcp://127.0.0.1:0", 4, replay_endpoint="tcp://127.0.0.1:0")
    pub.publish([PageEvent(True, 1, None, (1, 2, 3, 4))])
    pub.publish([PageEvent(True, 2, 1, (5, 6, 7, 8))])
    batches = Batches()
    got = batches.got
    sub = KVEventSubscriber(pub.endpoint, batches, pub.replay_endpoint)
    try:
        # The subscriber joined after two batches; a PUB drops messages until the SUB's connection is up,
        # so removals are sent until one arrives: its sequence number shows the gap, the replay fills it.
        for _ in range(600):
            pub.publish([PageEvent(False, 1)])
            if batches.wait_for(3, timeout=0.1):
                break
        kinds = [type(b.events[0]).__name__ for b in got]
        assert kinds[:2] == ["BlockStored", "BlockStored"] and set(kinds[2:]) == {"BlockRemoved"}, kinds
        assert sub.next_seq == len(got)  # every batch once, in order
    finally:
        sub.close()
        pub.close()


def test_a_subscriber_joining_a_quiet_publisher_catches_up_at_once():
    """No new batch is needed for a late subscriber to learn what a replica cached earlier; batches the
    catch-up delivered that then come again on the SUB socket are dropped, not taken for a restart."""
    pub = KVEventPublisher("tcp://127.0.0.1:0", 4, replay_endpoint="tcp://127.0.0.1:0")
    batches = Batches()
    got = batches.got
    resets: list[int] = []
    sub = None
    try:
        pub.publish([PageEvent(True, 1, None, (1, 2, 3, 4))])
        pub.publish([PageEvent(True, 2, 1, (5, 6, 7, 8))])
        for _ in range(200):  # the publisher's thread sends them; then the replica goes quiet
            if pub.published == 2:
                break
            time.sleep(0.01)
        assert pub.published == 2
        sub = KVEventSubscriber(pub.endpoint, batches, pub.replay_endpoint, lambda: resets.append(len(got)))
        assert batches.wait_for(2, timeout=30) and len(got) == 2, "the catch-up never came"
        assert [e.block_hashes for b in got for e in b.events] == [[1], [2]]
        again = dict(pub._buffer)[1]
        sub.accept(1, again)  # the same batch once more, as the SUB socket may deliver it
        assert len(got) == 2 and resets == [] and sub.next_seq == 2
        pub.publish([PageEvent(False, 2)])  # the next live batch follows on
        assert batches.wait_for(3, timeout=30)
        assert type(got[2].events[0]).__name__ == "BlockRemoved" and sub.next_seq == 3 and resets == []
        # other bytes under an old sequence number: the publisher started again
        sub.accept(0, msgspec.msgpack.encode(KVEventBatch(0.0, [AllBlocksCleared()])))
        assert resets == [3] and sub.next_seq == 1
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_subscriber_sees_a_restarted_publisher():
    encode = msgspec.msgpack.encode
    got, resets = [], []
    sub = KVEventSubscriber("tcp://127.0.0.1:1", got.append, on_reset=lambda: resets.append(len(got)))
    try:
        for seq in (0, 1, 2, 0, 1):
            sub.accept(seq, encode(KVEventBatch(float(seq), [AllBlocksCleared()])))
    finally:
        sub.close()
    assert resets == [3] and len(got) == 5 and sub.next_seq == 2


def test_publisher_refuses_a_taken_address():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(f"tcp://127.0.0.1:{port}", 16)
    finally:
        sock.close()
