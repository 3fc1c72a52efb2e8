"""ZMQ publisher with vLLM 0.33's ``ZmqEventPublisher`` semantics.

- PUB socket: each batch goes out as three frames ``(topic, seq, payload)``: ``seq`` an
  8-byte big-endian counter from 0, ``payload`` the msgpack ``KVEventBatch``
  (``schema.encode_batch``). An endpoint containing ``*`` or ``::``, or an ``ipc://`` /
  ``inproc://`` one, is bound; any other (``tcp://127.0.0.1:5557``) is *connected* to a
  subscriber that binds — vLLM's rule.
- Replay ROUTER socket (optional, always bound): a client sends ``(b"", start_seq)`` with an
  8-byte big-endian start (a DEALER/REQ frame pair); it gets back every buffered batch with
  ``seq >= start_seq`` as ``(b"", topic, seq, payload)``, then the end marker
  ``(b"", b"", seq = -1 (8 bytes, signed), b"")``. The last ``buffer_steps`` batches are
  kept.
- A background thread owns both sockets (ZMQ sockets are not thread-safe): ``publish``
  only enqueues; ``close`` drains the queue, then closes. A full queue blocks the caller
  (backpressure, never a silent drop).

>>> from hybridkv.events import AllBlocksCleared
>>> publisher = ZmqEventPublisher("inproc://doc-events", replay_endpoint="inproc://doc-replay")
>>> publisher.publish([AllBlocksCleared()], ts=1.0)
>>> publisher.close(); publisher.num_published
1
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from hybridkv.errors import ConfigError
from hybridkv.events.schema import KVEvent, KVEventBatch, encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's end-of-sequence marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_TCP_PORT = 65535

__all__ = ["END_SEQ", "ZmqEventPublisher", "check_endpoint", "is_bind_endpoint"]


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest.

    >>> is_bind_endpoint("tcp://*:5557"), is_bind_endpoint("tcp://127.0.0.1:5557")
    (True, False)
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_endpoint(flag: str, endpoint: str) -> str:
    """A ZMQ endpoint ``scheme://address`` with a known scheme, else a one-line error; a
    ``tcp://`` one needs a port in 0–65535 or ``*`` (0 and ``*``: any free port). ZMQ itself
    takes ``tcp://*:99999`` and binds port 34463 (99999 mod 65536).

    >>> check_endpoint("--events", "tcp://*:99999")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --events='tcp://*:99999' is invalid: the port must be \
0-65535 or '*', e.g. tcp://*:5557
    """
    if not endpoint.startswith(ENDPOINT_SCHEMES) or endpoint.split("://", 1)[1] == "":
        raise ConfigError(flag, endpoint, "give a ZMQ endpoint such as tcp://*:5557 (bind) "
                          "or tcp://127.0.0.1:5557 (connect to a subscriber that binds)")
    if endpoint.startswith("tcp://"):
        _, colon, port = endpoint.removeprefix("tcp://").rpartition(":")
        valid = port == "*" or (port.isascii() and port.isdigit() and len(port) <= 5
                                and int(port) <= MAX_TCP_PORT)
        if not colon or not valid:
            raise ConfigError(flag, endpoint, "the port must be 0-65535 or '*', e.g. "
                              "tcp://*:5557")
    return endpoint


class ZmqEventPublisher:
    """Publishes event batches on a PUB socket, with an optional replay ROUTER.

    Args:
        endpoint: PUB endpoint (bound or connected, see the module doc).
        replay_endpoint: ROUTER endpoint for replay requests (bound), or ``None``.
        buffer_steps: batches kept for replay.
        hwm: PUB high-water mark.
        topic: first frame of every message.
        data_parallel_rank: stamped on batches that carry none.

    Raises:
        ConfigError: an endpoint cannot be bound / connected (in use, malformed).
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "",
                 data_parallel_rank: int = 0) -> None:
        self.endpoint = check_endpoint("--events", endpoint)
        self.replay_endpoint = None if replay_endpoint is None else \
            check_endpoint("--events-replay", replay_endpoint)
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.num_published = 0
        """Batches sent (and buffered for replay) so far."""
        self.num_queued = 0
        """Batches handed to ``publish`` so far."""
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._open(self._pub, "--events", self.endpoint, is_bind_endpoint(self.endpoint))
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # a full replay and its end marker always fit (vLLM: 2 * (buffer + 1))
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._open(self._replay, "--events-replay", self.replay_endpoint, True)
        except ConfigError:
            self._close_sockets()
            raise
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket[bytes], flag: str, endpoint: str, bind: bool) -> None:
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as err:
            raise ConfigError(flag, endpoint, f"cannot {'bind' if bind else 'connect'} "
                              f"({err}); pick a free port or another endpoint") from err

    # ----------------------------------------------------------------- producer side
    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> None:
        """Queue one batch (a scheduler step's events; vLLM skips empty steps)."""
        if self._error is not None:
            raise RuntimeError("the event publisher thread failed") from self._error
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=list(events),
                             data_parallel_rank=self.data_parallel_rank)
        self._queue.put(batch)
        self.num_queued += 1

    def wait_sent(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued batch was sent (and is replayable); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.num_published < self.num_queued:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ thread side
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                seq = self.num_published
                payload = encode_batch(batch)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published = seq + 1
        except BaseException as err:  # surfaced on the next publish
            self._error = err

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # malformed request: ignored, as vLLM does
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
