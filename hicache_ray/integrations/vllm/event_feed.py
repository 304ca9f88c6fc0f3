"""A thread that feeds a :class:`~hicache_ray.integrations.vllm.events.VllmJournal` from a
vLLM engine's ZeroMQ KV-event publisher.

vLLM's publisher (``kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
"endpoint": ..., "replay_endpoint": ...}``) sends ``(topic, seq, payload)`` on a PUB
socket, ``seq`` 8 bytes big-endian from 0, and keeps its last ``buffer_steps`` batches for
a ROUTER socket that replays them from a sequence number (ending with seq -1). The feed
subscribes to the PUB socket; when a batch does not follow the last one the journal took
(a subscriber joins after the first batches: ZeroMQ's slow joiner; or the socket dropped
some past its high-water mark), it asks the replay socket for the missing ones. When
there is no replay socket, or it no longer holds them, the journal restarts
(:meth:`VllmJournal.restart`): the engine's blocks are known again as it stores them.

``pyzmq`` is imported when the feed starts (vLLM depends on it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from hicache_ray.integrations.vllm.events import VllmJournal

__all__ = ["VllmEventFeed"]

log = logging.getLogger(__name__)

_END = -1  # the replay's last frame
REPLAY_TIMEOUT_MS = 2000  # a replay not answered by then is given up: the journal restarts


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class VllmEventFeed(threading.Thread):
    """Takes one engine's published batches into ``journal`` until :meth:`stop`.

    Args:
        journal: where the batches go.
        endpoint: the publisher's PUB address (``ipc://...`` or ``tcp://host:port``).
        replay_endpoint: its ROUTER address, or None (a gap restarts the journal).
        topic: the publisher's topic.
    """

    def __init__(
        self,
        journal: VllmJournal,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
    ) -> None:
        super().__init__(name="hicache-vllm-events", daemon=True)
        self.journal = journal
        self._endpoint, self._replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._halt = threading.Event()
        self.connected = threading.Event()  # set once the PUB socket is subscribed

    def run(self) -> None:
        import zmq

        ctx: Any = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self._endpoint)
        self.connected.set()
        try:
            while not self._halt.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("vLLM KV event of %d frames dropped (expected 3)", len(frames))
                    continue
                self._take(_seq(frames[1]), frames[2])
        finally:
            sub.close(linger=0)

    def stop(self) -> None:
        self._halt.set()

    def _take(self, seq: int, payload: bytes) -> None:
        journal = self.journal
        if journal.take(seq, payload):
            return
        if self._replay_endpoint is not None:
            self._replay(journal.last_vllm_seq + 1, seq)
        if not journal.take(seq, payload):
            log.info("vLLM KV events %d..%d lost: the engine's blocks are relearned",
                     journal.last_vllm_seq + 1, seq - 1)  # fmt: skip
            journal.restart(seq)
            journal.take(seq, payload)

    def _replay(self, start: int, upto: int) -> None:
        """Take the batches ``start`` .. ``upto - 1`` from the replay socket."""
        import zmq

        sock: Any = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(REPLAY_TIMEOUT_MS):
                frames = sock.recv_multipart()
                if len(frames) != 4 or _seq(frames[2]) == _END:
                    return
                seq = _seq(frames[2])
                if seq < upto and not self.journal.take(seq, frames[3]):
                    return  # the replay starts past what is missing
        finally:
            sock.close(linger=0)
