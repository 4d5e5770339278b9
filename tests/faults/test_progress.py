"""Progress positions, the hang detector's rules, and the side channels that carry them."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from distkit.faults._channel import announce_failure, peer_failure
from distkit.faults._progress import (
    HangDetector,
    Position,
    Progress,
    describe_stall,
    main_thread_stack,
)
from distkit.strategies._torch_dist import StoreChannel
from distkit.strategies.horovod._channel import HorovodKVChannel

pytestmark = pytest.mark.timeout(60)


def test_progress_positions_order_phases_within_and_across_steps():
    order = ["0:4:checkpoint", "0:4:data", "0:4:forward", "0:4:backward", "0:4:optimizer",
             "0:5:data", "0:9:validation", "1:9:data"]  # fmt: skip
    keys = [Position.decode(text).key for text in order]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert Progress(epoch=1, step=9, phase="data").encode() == "1:9:data"


@pytest.mark.parametrize("text", ["", "a:b:c", "1:2", "-1:2:data", "1:2:data:x"])
def test_progress_garbage_positions_decode_to_none(text):
    assert Position.decode(text) is None


def test_progress_describe_says_where_in_words():
    assert Position(0, 4, "forward").describe() == "epoch 1, step 5 (forward)"
    assert Position(2, 7, "checkpoint").describe() == "epoch 3, saving a checkpoint after step 7"
    assert Position(0, 9, "validation").describe() == "epoch 1, validation"


def test_progress_detector_names_the_rank_behind_once_per_stall():
    detector = HangDetector(threshold=10)
    stuck, waiting = "0:4:forward", "0:4:backward"
    assert detector.observe(0.0, [waiting, stuck]) == []
    assert detector.observe(9.0, [waiting, stuck]) == []  # not yet
    (stall,) = detector.observe(10.5, [waiting, stuck])
    assert (stall.rank, stall.position.phase, stall.ahead.phase) == (1, "forward", "backward")
    assert stall.seconds == pytest.approx(10.5)
    assert detector.observe(30.0, [waiting, stuck]) == []  # said once
    # it moves, then sticks again: a new stall, said again
    assert detector.observe(31.0, [waiting, "0:4:backward"]) == []
    assert detector.observe(32.0, ["0:5:forward", "0:4:backward"]) == []
    (again,) = detector.observe(43.0, ["0:5:forward", "0:4:backward"])
    assert again.rank == 1 and again.position.step == 4


def test_progress_detector_does_not_name_the_rank_that_waited_once_the_stuck_one_moves_on():
    """Rank 1 sleeps in step 4's forward while rank 0 waits in its backward's all-reduce;
    rank 1 is named. When it wakes, both finish step 4 and rank 1 reaches step 5 before rank
    0's main thread has published its own progress (a busy machine, seen in CI): for a
    moment rank 0 shows its old place, unchanged for as long as it waited and behind rank 1.
    It is not stuck, and is not named."""
    detector = HangDetector(threshold=2)
    waiting, stuck = "0:4:backward", "0:4:forward"
    for t in (0.0, 0.5, 1.0, 1.5):
        assert detector.observe(t, [waiting, stuck]) == []
    (stall,) = detector.observe(2.0, [waiting, stuck])
    assert stall.rank == 1
    for t in (2.5, 5.0, 7.5):
        assert detector.observe(t, [waiting, stuck]) == []  # said once
    assert detector.observe(8.0, [waiting, "0:5:backward"]) == []  # rank 0 not yet published
    assert detector.observe(8.25, ["0:5:backward", "0:5:backward"]) == []
    # and a rank that then really stalls behind is named again, once it has not moved for
    # the threshold (since 8.0) and been behind for half of it
    for t in (8.5, 9.0, 9.5):
        assert detector.observe(t, ["0:6:data", "0:5:backward"]) == []
    (again,) = detector.observe(10.0, ["0:6:data", "0:5:backward"])
    assert (again.rank, again.seconds) == (1, 2.0)


def test_progress_detector_is_quiet_when_every_rank_waits_at_the_same_place():
    detector = HangDetector(threshold=1)
    same = ["1:3:validation", "1:3:validation", "1:3:validation"]
    detector.observe(0.0, same)
    assert detector.observe(100.0, same) == []  # a long evaluation is not a hang


def test_progress_detector_ignores_ranks_that_have_not_published():
    detector = HangDetector(threshold=1)
    detector.observe(0.0, ["0:1:data", None])
    assert detector.observe(5.0, ["0:1:data", None]) == []


def test_progress_main_thread_stack_is_readable_from_another_thread():
    seen: list[str] = []
    worker = threading.Thread(target=lambda: seen.append(main_thread_stack()))
    worker.start()
    worker.join()
    assert "test_progress_main_thread_stack_is_readable_from_another_thread" in seen[0]


def test_progress_stall_message_has_the_stack_indented():
    detector = HangDetector(threshold=1)
    detector.observe(0.0, ["0:2:backward", "0:2:data"])
    (stall,) = detector.observe(2.0, ["0:2:backward", "0:2:data"])
    text = describe_stall(stall, 'File "train.py", line 3\n  next(loader)\n')
    first, *rest = text.splitlines()
    assert first.startswith("distkit: rank 1 has made no progress for 2s: it is in epoch 1, ")
    assert rest == ["  rank 1's main thread:", '    File "train.py", line 3', "      next(loader)"]


def test_progress_store_channel_first_notice_wins():
    channel = StoreChannel(dist.HashStore())
    assert peer_failure(channel) is None
    assert channel.get("missing") is None  # never blocks
    assert announce_failure(channel, "rank 1 failed") is True
    assert announce_failure(channel, "rank 0 failed") is False
    assert peer_failure(channel) == "rank 1 failed"
    channel.set("a", "1")
    assert channel.get_many(["a", "b"]) == ["1", None]


def test_progress_horovod_channel_talks_to_horovods_own_kv_server():
    """horovodrun's rendezvous key-value server, run in this process (needs Horovod)."""
    http_server = pytest.importorskip("horovod.runner.http.http_server")
    server = http_server.RendezvousServer(verbose=0)
    port = server.start()
    try:
        env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}  # fmt: skip
        channel = HorovodKVChannel.from_env("distkit-test", env)
        assert channel is not None
        assert channel.get("distkit/failure") is None
        assert channel.set_first("distkit/failure", "rank 1 failed") == "rank 1 failed"
        assert channel.set_first("distkit/failure", "rank 0 failed") == "rank 1 failed"
        channel.set("distkit/progress/0", "0:3:data")
        assert channel.get_many(["distkit/progress/0", "distkit/progress/1"]) == ["0:3:data", None]
        other_scope = HorovodKVChannel.from_env("distkit-other", env)
        assert other_scope is not None and other_scope.get("distkit/failure") is None
    finally:
        server.stop()


def test_progress_horovod_channel_needs_horovodrun_variables():
    assert HorovodKVChannel.from_env("s", {}) is None
    bad_port = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "h", "HOROVOD_GLOO_RENDEZVOUS_PORT": "x"}
    assert HorovodKVChannel.from_env("s", bad_port) is None
