"""EventSubscriber: the consumer side of ``ZmqEventPublisher`` (and of vLLM's).

SUB socket for live batches (``(topic, seq, payload)``), DEALER socket for vLLM's replay
protocol (send ``(b"", start_seq)``; receive ``(b"", topic, seq, payload)`` … then the
``END_SEQ`` marker). ``receive`` notices a gap in ``seq`` (a slow joiner, a dropped
message) and fills it from the replay endpoint when one is given, so a consumer sees every
batch once, in order.
"""

from __future__ import annotations

import zmq

from hybridkv.events.publisher import END_SEQ, is_bind_endpoint
from hybridkv.events.schema import KVEventBatch, decode_batch


class EventSubscriber:
    """Receives decoded batches with their sequence numbers.

    Args:
        endpoint: where the publisher's PUB socket is (connected unless it is a bind
            endpoint by vLLM's rule, i.e. the publisher connects to us).
        replay_endpoint: the publisher's ROUTER endpoint (connected), or ``None``.
        topic: subscription prefix (``""``: everything).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "") -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if is_bind_endpoint(endpoint) and not endpoint.startswith(("ipc://", "inproc://")):
            self._sub.connect(endpoint.replace("*", "127.0.0.1"))
        elif is_bind_endpoint(endpoint):
            self._sub.connect(endpoint)
        else:
            self._sub.bind(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint.replace("*", "127.0.0.1"))
        self.next_seq = 0
        """The sequence number expected next."""

    def request_replay(self, start_seq: int, timeout_ms: int = 5000,
                       ) -> list[tuple[int, KVEventBatch]]:
        """Every buffered batch from ``start_seq`` on (up to the end marker)."""
        if self._replay is None:
            raise RuntimeError("no replay endpoint")
        self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches: list[tuple[int, KVEventBatch]] = []
        while True:
            if not self._replay.poll(timeout_ms):
                raise TimeoutError(f"no replay answer within {timeout_ms} ms")
            _, _, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload)))

    def receive(self, timeout_ms: int = 1000) -> list[tuple[int, KVEventBatch]]:
        """The next live batch, preceded by any missed ones fetched by replay; ``[]`` when
        nothing arrived within ``timeout_ms``."""
        if not self._sub.poll(timeout_ms):
            return []
        _, seq_bytes, payload = self._sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        batches: list[tuple[int, KVEventBatch]] = []
        if seq > self.next_seq and self._replay is not None:
            batches = [(s, b) for s, b in self.request_replay(self.next_seq) if s < seq]
        if seq >= self.next_seq:
            batches.append((seq, decode_batch(payload)))
            self.next_seq = seq + 1
        return batches

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
