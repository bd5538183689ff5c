"""kvlink's SGLang backend driven through SGLang's KVPoll state machine (tests/sglang/inproc)."""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np
import pytest
import zmq
from conftest import AUX_ITEM, ITEM, LAYERS, PAGES, Pair, Recorder
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError

import kvlink
from kvlink.integrations.sglang import _messages as msgs


def test_chunks_arrive_byte_exact_and_polls_only_move_forward(pair: Pair) -> None:
    src_pages, dst_pages = [4, 5, 6, 9, 40, 41, 7], [10, 11, 12, 13, 90, 3, 100]
    sender, receiver, rec = pair.start(1001, dst_pages, aux_slot=5)
    assert rec.poll() == (KVPoll.WaitingForInput, KVPoll.WaitingForInput)
    sender.init(len(src_pages), aux_index=2)
    # three chunked-prefill chunks, as SGLang's scheduler hands them over
    sender.send(np.array(src_pages[:3], np.int32))
    rec.poll()
    sender.send(np.array(src_pages[3:5], np.int32))
    rec.poll()
    sender.send(np.array(src_pages[5:], np.int32))
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok(src_pages, dst_pages)
    assert np.array_equal(pair.dst_aux[5], pair.src_aux[2])
    assert rec.monotonic(), rec.seen
    assert sender.get_transfer_metric().transfer_total_bytes == len(src_pages) * 2 * LAYERS * ITEM
    # Success sticks after both sides clear, as SGLang's scheduler expects
    sender.clear()
    receiver.clear()
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert 1001 not in pair.decode._arrivals and 1001 not in pair.prefill._sends


def test_decode_is_not_done_before_the_last_chunk(pair: Pair) -> None:
    sender, _receiver, rec = pair.start(1002, [20, 21, 22, 23])
    sender.init(4, aux_index=1)
    sender.send(np.array([0, 1], np.int32))
    # the first chunk's push completes and its notification arrives, but it is not the last
    deadline = time.monotonic() + 5
    while not pair.expected_pages_ok([0, 1], [20, 21]) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert rec.poll()[1] < KVPoll.Success
    sender.send(np.array([2, 3], np.int32))
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok([0, 1, 2, 3], [20, 21, 22, 23])


def test_last_chunk_without_pages_still_carries_aux(pair: Pair) -> None:
    sender, _r, rec = pair.start(1003, [30, 31])
    sender.init(2, aux_index=6)
    sender.send(np.array([50, 51], np.int32))
    # SGLang's sender counts pages: a two-page request ends with that chunk, so an extra empty
    # final send only happens for a zero-page request; send that as a separate room below
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    pair.dst_aux[3] = 0
    sender2, _r2, rec2 = pair.start(1004, [], aux_slot=3)
    sender2.init(0, aux_index=6)
    sender2.send(np.array([], np.int32))
    assert rec2.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert np.array_equal(pair.dst_aux[3], pair.src_aux[6])


def test_a_bad_destination_fails_both_sides_with_the_reason_and_failure_sticks(
        pair: Pair) -> None:
    sender, receiver, rec = pair.start(1005, [10, 10_000])   # page 10000 is outside decode's pool
    sender.init(2, aux_index=0)
    sender.send(np.array([1, 2], np.int32))
    assert rec.until_terminal() == (KVPoll.Failed, KVPoll.Failed)
    for _ in range(3):
        assert rec.poll() == (KVPoll.Failed, KVPoll.Failed)
    assert rec.monotonic()
    with pytest.raises(KVTransferError, match="outside its KV pool"):
        receiver.failure_exception()
    with pytest.raises(KVTransferError, match="outside its KV pool"):
        sender.failure_exception()


def test_decode_abort_fails_prefill(pair: Pair) -> None:
    sender, receiver, rec = pair.start(1006, [1, 2])
    receiver.abort()
    assert rec.until(lambda s, r: s == KVPoll.Failed) == (KVPoll.Failed, KVPoll.Failed)
    sender.init(2, aux_index=0)
    sender.send(np.array([3, 4], np.int32))    # after the abort: nothing is pushed
    assert pair.prefill._sends.get(1006) is None
    with pytest.raises(KVTransferError, match="abort"):
        sender.failure_exception()


def test_a_chunk_from_another_cluster_member_does_not_complete_a_room(pair: Pair) -> None:
    """An admitted agent that is not the room's prefill rank pushes into decode's memory with
    the room's final tag: decode ignores it (the room still waits for its prefill)."""
    sender, _receiver, rec = pair.start(1007, [60, 61])
    with kvlink.Agent("intruder", nics="loopback:1") as other:
        buf = np.ones(ITEM, np.uint8)
        other.register(buf)
        peer = other.add_peer(pair.decode.agent.metadata())
        attempt = pair.decode._arrivals[1007].attempt
        other.push(peer, src=buf, dst="kv0", dst_offset=60 * ITEM,
                   notify=msgs.chunk_tag(1007, attempt, 0, True)).wait(timeout_s=10)
        time.sleep(0.5)
        assert rec.poll()[1] == KVPoll.WaitingForInput
    sender.init(2, aux_index=0)
    sender.send(np.array([8, 9], np.int32))
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok([8, 9], [60, 61])


def test_hostile_control_messages_are_dropped_and_prefill_keeps_serving(pair: Pair) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{pair.prefill.local_ip}:{pair.prefill.rank_port}")
    reg = json.loads(pair.decode.build_receiver_registration_message()[1])
    def room(*frames: bytes) -> list[bytes]:
        return msgs.sign([msgs.ROOM_TAG, *frames], None)

    bad = [
        [b"garbage"],
        [msgs.REG_TAG, b"{not json", b""],
        msgs.sign([msgs.REG_TAG, json.dumps({**reg, "v": 99}).encode()], None),
        msgs.sign([msgs.REG_TAG, json.dumps({**reg, "kv_regions": [1] * 9000}).encode()], None),
        msgs.sign([msgs.REG_TAG, b"x" * (msgs.MAX_REG_BYTES + 1)], None),
        [msgs.REG_TAG, json.dumps(reg).encode(), b"\x01" * 32],   # signed, and we have no key
        room(b"1", b"0", b"s", b"127.0.0.1", b"1", b"\x00" * 3, b"0", b"1", b"0"),
        room(b"-1", b"0", b"s", b"127.0.0.1", b"1", b"", b"0", b"1", b"0"),
        room(b"1", b"0", b"s", b"127.0.0.1", b"99999", b"", b"0", b"1", b"0"),
        room(b"2", b"0", b"s", b"h", b"1", np.array([-5], "<i4").tobytes(), b"0", b"1", b"0"),
        room(b"3", b"0", b"s", b"h", b"1", np.zeros(PAGES + 1, "<i4").tobytes(), b"0", b"1",
             b"0"),
        [b"ABORT", b"4"],
        [b"x" * (msgs.MAX_FRAME_BYTES + 10)],   # over ZMQ's MAXMSGSIZE: the connection drops
    ]
    for frames in bad:
        sock.send_multipart(frames)
    sock.close()
    time.sleep(0.3)
    assert not {1, 2, 3, 4} & set(pair.prefill.transfer_infos)
    assert not {1, 2, 3, 4} & set(pair.prefill.request_status)
    sender, _r, rec = pair.start(1008, [70, 71])
    sender.init(2, aux_index=0)
    sender.send(np.array([12, 13], np.int32))
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok([12, 13], [70, 71])


def test_wrong_cluster_secret_fails_the_request_saying_so(ctx: contextlib.ExitStack) -> None:
    pair = Pair(ctx, prefill_secret="a" * 32, decode_secret="b" * 32, seed=1)
    sender, receiver, rec = pair.start(2001, [1, 2])
    sender.init(2, aux_index=0)
    sender.send(np.array([3, 4], np.int32))
    assert rec.until_terminal() == (KVPoll.Failed, KVPoll.Failed)
    with pytest.raises(KVTransferError, match="secret"):
        receiver.failure_exception()
    assert not pair.expected_pages_ok([3, 4], [1, 2])


def test_same_secret_on_both_sides_works(ctx: contextlib.ExitStack) -> None:
    pair = Pair(ctx, prefill_secret="c" * 32, decode_secret="c" * 32, seed=2)
    sender, _receiver, rec = pair.start(2002, [1, 2, 3])
    sender.init(3, aux_index=0)
    sender.send(np.array([7, 8, 9], np.int32))
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok([7, 8, 9], [1, 2, 3])
    assert np.array_equal(pair.dst_aux[3], pair.src_aux[0])
    assert pair.dst_aux.shape[1] == AUX_ITEM


def test_many_rooms_at_once(pair: Pair) -> None:
    rooms = []
    for i in range(16):
        dst = [100 + i]
        s, _r, rec = pair.start(3000 + i, dst)
        s.init(1, aux_index=0)
        rooms.append((s, rec, i))
    for s, _rec, i in rooms:
        s.send(np.array([i], np.int32))
    for _s, rec, _i in rooms:
        assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok(list(range(16)), [100 + i for i in range(16)])


def test_recorder_catches_a_backward_poll() -> None:
    """The monotonic check itself can fail (a test that cannot fail is a defect)."""
    rec = Recorder(None, None)
    rec.seen = [(1, 1), (2, 2), (1, 2)]
    assert not rec.monotonic()
    rec.seen = [(1, 1), (0, 0), (4, 4)]
    assert not rec.monotonic()
    rec.seen = [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert rec.monotonic()


def test_a_flood_of_registrations_does_not_hold_up_requests(pair: Pair) -> None:
    """Registrations naming agents that cannot be reached: connecting to them runs beside the
    control loop, the queue of them is bounded, and a registered decode's requests go on."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{pair.prefill.local_ip}:{pair.prefill.rank_port}")
    reg = json.loads(pair.decode.build_receiver_registration_message()[1])
    for i in range(300):
        fake = {**reg, "session": f"ghost-{i}",
                "metadata": json.dumps({"kvlink": 1, "name": f"ghost-{i}",
                                        "instance": "00" * 8, "addrs": [["127.0.0.1", 1]],
                                        "keys": {}})}
        sock.send_multipart(msgs.sign([msgs.REG_TAG, json.dumps(fake).encode()], None))
        # and a room from a name that never registered: failed at once, nothing kept
        sock.send_multipart(msgs.sign(msgs.encode_room(msgs.RoomInfo(
            room=50_000 + i, attempt=1, session=f"never-{i}", endpoint="127.0.0.1", port=1,
            dst_pages=np.array([1], np.int32), aux_index=0, required_dst_info_num=1,
            is_dummy=False)), None))
    # a room of the registered decode rank, sent last on the same socket: once prefill has it,
    # it has handled every message before it
    sock.send_multipart(pair.decode.build_receiver_metadata_message(
        bootstrap_room=59_999, required_dst_info_num=1, kv_indices=np.array([1], np.int32),
        aux_index=0, state_indices=None, decode_prefix_len=None, is_dummy=False))
    sock.close()
    # 300 registrations each connect (and fail) in turn: generous on a loaded 2-core host
    deadline = time.monotonic() + 30
    while pair.prefill.request_status.get(59_999) != KVPoll.WaitingForInput:
        assert time.monotonic() < deadline, "prefill never handled the flood"
        time.sleep(0.01)
    sender, _r, rec = pair.start(1009, [80, 81])
    sender.init(2, aux_index=0)
    sender.send(np.array([14, 15], np.int32))
    assert rec.until_terminal() == (KVPoll.Success, KVPoll.Success)
    assert pair.expected_pages_ok([14, 15], [80, 81])
    assert all(pair.prefill.request_status.get(50_000 + i) is None for i in range(300))
    assert not {50_000 + i for i in range(300)} & set(pair.prefill.transfer_infos)


def test_decode_completes_only_with_every_chunk_of_the_current_attempt(pair: Pair) -> None:
    """Notifications fed to decode out of order: the last chunk first, then a gap, then a
    chunk of an earlier attempt of the same room; Success only when the set is complete."""
    sender, receiver, rec = pair.start(1010, [90, 91, 92])
    arrivals = pair.decode._arrivals[1010]
    peer = arrivals.senders[0]

    def note(chunk: int, last: bool, attempt: int = arrivals.attempt) -> kvlink.Notification:
        return kvlink.Notification(peer=peer, tag=msgs.chunk_tag(1010, attempt, chunk, last),
                                   transfer_id=1, op=kvlink.Op.PUSH)

    pair.decode._on_notification(note(2, True))
    pair.decode._on_notification(note(0, False))
    assert rec.poll()[1] == KVPoll.WaitingForInput
    pair.decode._on_notification(note(1, False, attempt=arrivals.attempt ^ 1))   # stale
    assert rec.poll()[1] == KVPoll.WaitingForInput
    pair.decode._on_notification(note(1, False))
    assert rec.poll()[1] == KVPoll.Success
    receiver.clear()
    sender.abort()
    sender.clear()


def test_abort_between_chunks_stops_the_rest_and_acks_once_drained(pair: Pair) -> None:
    sender, receiver, rec = pair.start(1011, [100, 101, 102, 103])
    sender.init(4, aux_index=0)
    sender.send(np.array([20, 21], np.int32))
    pushed = pair.prefill._sends[1011].submitted
    assert pushed == 1
    receiver.abort()
    rec.until(lambda s, r: s == KVPoll.Failed)
    sender.send(np.array([22, 23], np.int32))          # after the abort: not pushed
    assert pair.prefill._sends[1011].submitted == pushed
    deadline = time.monotonic() + 10
    while pair.prefill._staging_outstanding.get(1011, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.prefill._staging_outstanding.get(1011, 0) == 0
    with pytest.raises(KVTransferError, match="abort"):
        sender.failure_exception()
