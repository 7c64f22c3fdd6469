"""KV-cache events on the wire: what a replica's prefix cache stored and removed, in vLLM's format.

A replica publishes a ``KVEventBatch`` after each engine step that changed its prefix tree, over a ZMQ PUB
socket, as vLLM does (``--kv-events-config``): frames ``(topic, sequence number as 8 big-endian bytes,
msgpack payload)``, structs encoded as tagged arrays. A ROUTER socket beside it replays buffered batches
from a sequence number, so a subscriber that joined late or missed messages catches up. Routers that read
vLLM's events (llm-d, Dynamo, our own ``dp.router``) can therefore follow a hydragen replica's cache.

Pages are named by their chained hash (``kv.page_hash``) and carry their token ids, so a consumer can
also rebuild its own keys from tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from hydragen.kv.radix import PageEvent

log = logging.getLogger("hydragen.dp")
MEDIUM = "CPU"
_END = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change of one replica's KV cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(events: list[PageEvent], page_size: int) -> list[KVCacheEvent]:
    """Tree events as vLLM events: a run of stored pages each the child of the one before is one
    ``BlockStored``; consecutive removals are one ``BlockRemoved``."""
    out: list[KVCacheEvent] = []
    for e in events:
        last = out[-1] if out else None
        if e.stored:
            if isinstance(last, BlockStored) and last.block_hashes[-1] == e.parent_hash:
                last.block_hashes.append(e.hash)
                last.token_ids.extend(e.tokens)
            else:
                out.append(BlockStored([e.hash], e.parent_hash, list(e.tokens), page_size))
        elif isinstance(last, BlockRemoved):
            last.block_hashes.append(e.hash)
        else:
            out.append(BlockRemoved([e.hash]))
    return out


class KVEventPublisher:
    """Publishes tree events from a background thread: ``publish`` only queues them (the engine thread
    never waits on the network). ``endpoint`` is bound (``tcp://127.0.0.1:5557``; port 0 picks one, see
    ``.endpoint``)."""

    def __init__(
        self,
        endpoint: str,
        page_size: int,
        replay_endpoint: str | None = None,
        data_parallel_rank: int | None = None,
        buffer_batches: int = 10_000,
        topic: str = "",
    ):
        self.page_size, self.rank, self.topic = page_size, data_parallel_rank, topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self.endpoint = _bind(self._pub, endpoint)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self._seq = 0
        self.published = 0  # batches sent
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[PageEvent]) -> None:
        self._queue.put(events)

    def clear_all(self) -> None:
        """Say the cache was emptied (``AllBlocksCleared``)."""
        self._queue.put([AllBlocksCleared()])

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    item = []
                if item is None:
                    break
                self._serve_replays()
                if not item:
                    continue
                wire = item if isinstance(item[0], KVCacheEvent) else to_wire(item, self.page_size)
                payload = encoder.encode(KVEventBatch(time.time(), wire, self.rank))
                self._pub.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
                self.published += 1
        except Exception:  # never take the engine down: the router then routes without this replica's cache
            log.exception("KV event publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", _END, b""))


class KVEventSubscriber:
    """Follows one publisher from a background thread, calling ``on_batch`` for every batch in order.

    With a replay socket, it first asks for every batch still buffered, so a subscriber that joins a
    replica which has gone quiet still learns what it cached (a PUB socket only sends what comes after the
    connection is up). Batches published during that catch-up may then arrive again on the SUB socket:
    those are recognised by their bytes and dropped. Later, a gap in the sequence numbers (dropped
    messages) is filled from the replay socket; a sequence number below the expected one means the
    publisher started again (a restarted replica): ``on_reset`` is called first. (A restart whose first
    batches were all lost cannot be told from a gap: whoever restarts a replica should also reset its view,
    as the data-parallel front does.)
    """

    def __init__(
        self,
        endpoint: str,
        on_batch: Callable[[KVEventBatch], None],
        replay_endpoint: str | None = None,
        on_reset: Callable[[], None] | None = None,
        topic: str = "",
    ):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.on_batch, self.on_reset = on_batch, on_reset
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0  # the sequence number expected next
        self.received = 0
        self._caught_up: dict[int, bytes] = {}  # batches the catch-up delivered, until the SUB passes them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        try:
            if self.replay_endpoint:
                self._replay_from(0, None, catch_up=True)
            while not self._stop.is_set():
                if not self._sub.poll(50):
                    continue
                _, seq_bytes, payload = self._sub.recv_multipart()
                self.accept(int.from_bytes(seq_bytes, "big"), payload)
        except Exception:
            log.exception("KV event subscriber for %s stopped", self.endpoint)
        finally:
            self._sub.close()

    def accept(self, seq: int, payload: bytes) -> None:
        """One batch as received: a sequence that went back means the publisher started again."""
        if seq < self.next_seq:
            if self._caught_up.pop(seq, None) == payload:
                return  # the catch-up replay delivered it already
            self._caught_up.clear()
            if self.on_reset is not None:
                self.on_reset()
            self.next_seq = 0
        else:
            self._caught_up.clear()
        if seq > self.next_seq and self.replay_endpoint:
            self._replay_from(self.next_seq, seq)
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.on_batch(self._decoder.decode(payload))
        self.next_seq = seq + 1
        self.received += 1

    def _replay_from(self, first: int, before: int | None, catch_up: bool = False) -> None:
        """Deliver the buffered batches from ``first`` up to ``before`` (None: all). On the first catch-up the
        publisher may not be up yet: then its batches arrive live, and a timeout is not worth a warning."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", first.to_bytes(8, "big")))
            while sock.poll(2000):
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    return
                if self.next_seq <= seq and (before is None or seq < before):
                    self._deliver(seq, payload)
                    if catch_up:
                        self._caught_up[seq] = payload
            if not catch_up:
                log.warning("KV event replay from %s timed out", self.replay_endpoint)
        finally:
            sock.close()


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` (port 0 or ``*`` picks a free port) and return the address actually bound."""
    host, _, port = endpoint.rpartition(":")
    if port in ("0", "*"):
        port_n = sock.bind_to_random_port(host)
        return f"{host}:{port_n}"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
