"""The modelled engine's publisher tells when a subscriber's subscription has arrived, so a
process that starts its own node serves only once that node hears the first batch (ZMQ's
slow joiner otherwise loses it, and the last batch of a quiet engine is never a gap)."""

from __future__ import annotations

import zmq

from catsproto.adapters.vllm_events import VllmEventPublisher


def test_wait_subscribed_is_false_alone_and_true_once_a_subscriber_joined(tmp_path):
    ctx = zmq.Context()
    with VllmEventPublisher(f"ipc://{tmp_path}/events", context=ctx) as pub:
        assert pub.wait_subscribed(50) is False  # nobody there
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        try:
            assert pub.wait_subscribed(5000) is True
            seq = pub.publish(1.0, [])
            # once subscribed, the very first batch arrives (no slow-joiner loss)
            assert sub.poll(5000, zmq.POLLIN)
            topic, seq_bytes, _payload = sub.recv_multipart()
            assert topic == b""
            assert int.from_bytes(seq_bytes, "big") == seq == 0
        finally:
            sub.close(linger=0)
    ctx.term()
