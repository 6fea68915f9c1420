"""Codec safety: malformed StepPlans are rejected (WireError), never returned."""
import msgspec
import numpy as np
import pytest
from pagedserve.protos import codec, wire
from pagedserve.protos.codec import Codec
from pagedserve.protos.wire import StepPlan, WireError, int32


def plan(**kw):
    base = dict(step_id=1, request_ids=["a", "b"], num_computed_tokens=int32([3, 5]),
                num_new_tokens=int32([1, 2]), do_sample=np.array([1, 1], np.uint8),
                token_ids=int32([7, 8, 9]), positions=int32([3, 5, 6]),
                slot_mapping=np.array([3, 21, 22], np.int64),
                block_table_starts=int32([0, 1]), block_table_lens=int32([1, 0]),
                block_table_ids=int32([4]), copy=np.array([[1, 2]], np.int64))
    base.update(kw)
    return StepPlan(**base)


def roundtrip(msg):
    c = Codec()
    return c.decode([bytes(f) for f in c.encode(msg)])


def test_good_plan_roundtrips():
    got = roundtrip(plan())
    assert got.request_ids == ["a", "b"] and got.slot_mapping.dtype == np.int64
    assert got.copy.shape == (1, 2) and got.token_ids.tolist() == [7, 8, 9]


@pytest.mark.parametrize("kw", [
    dict(num_new_tokens=int32([1, -2])), dict(num_computed_tokens=int32([-1, 5])),
    dict(block_table_starts=int32([-1, 1])), dict(block_table_lens=int32([1, -1])),
    dict(num_new_tokens=np.array([1.0, 2.0], np.float32)),
    dict(slot_mapping=np.array([3, 21, 22], np.float32)),
    dict(block_table_ids=np.array([4.0], np.float32)),
    dict(copy=np.array([[1.0, 2.0]], np.float32)),
    dict(num_new_tokens=int32([1, 3])), dict(do_sample=None),
    dict(do_sample=np.array([1.0, 1.0], np.float32)),
    dict(block_table_ids=int32([4, 5])), dict(block_table_ids=None),
    dict(request_ids=["a", "a"]), dict(copy=np.array([[1, 2], [2, 3]], np.int64)),
    dict(swap_in=np.array([1, 2], np.int64)),
    dict(num_computed_tokens=np.zeros((2, 1), np.int32)),
])
def test_bad_plans_are_rejected(kw):
    with pytest.raises(WireError):
        roundtrip(plan(**kw))


def test_cached_reference_still_checks_frames():
    c = Codec()
    frames = [bytes(f) for f in c.encode(plan())]
    c.decode(frames)  # references now cached
    bad = list(frames)
    bad[1] = bad[1] + b"\0\0\0\0"
    with pytest.raises(WireError):
        c.decode(bad)
    with pytest.raises(WireError):
        c.decode(frames[:1])  # references to a frame that is missing
    bad = list(frames)
    bad[0] = bad[0].replace(b"<i4", b"<f8", 1)
    with pytest.raises(WireError):
        c.decode(bad)
    assert c.decode(frames).step_id == 1


def test_reference_limits():
    c = Codec(max_array_bytes=8)
    with pytest.raises(WireError):
        c.decode([bytes(f) for f in Codec().encode(plan())])
    for ref in [(0, 0, "<i4", [1]), (1, 0, "<i4", [-1]), (1, 0, "<i4", [1, 1, 1, 1]),
                (1, 0, "O", [1]), (1, 4, "<i4", [1]), (1, 8, "<i4", [1]), (1, -8, "<i4", [1]),
                (1, 0, "<i4", [2]), (2, 0, "<i4", [1]), (1, 0, "<i4", [])]:
        ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(ref))
        head = msgspec.msgpack.encode({"type": "plan", "step_id": 1, "request_ids": [],
                                       "token_ids": ext})
        with pytest.raises(WireError):
            Codec().decode([head, b"\0\0\0\0"])


def test_big_endian_and_noncontiguous_arrays_travel_little_endian():
    p = plan(slot_mapping=np.array([3, 21, 22], ">i8"),
             token_ids=np.array([7, 0, 8, 0, 9, 0], np.int32)[::2])
    got = roundtrip(p)
    assert got.slot_mapping.dtype.str == "<i8" and got.slot_mapping.tolist() == [3, 21, 22]
    assert got.token_ids.tolist() == [7, 8, 9]


def test_zmq_frames_and_memoryviews_decode():
    c = Codec()
    frames = c.encode(plan())  # memoryviews of the arrays
    assert c.decode(list(frames)).positions.tolist() == [3, 5, 6]


def test_empty_plan_and_result():
    assert roundtrip(StepPlan(step_id=2)).num_seqs == 0
    r = roundtrip(wire.StepResult(step_id=2, request_ids=["a"], token_ids=int32([5])))
    assert r.token_ids.tolist() == [5]
    with pytest.raises(WireError):
        roundtrip(StepPlan(step_id=2, token_ids=int32([1])))


def test_result_prompt_scores_roundtrip_and_are_checked():
    """Two requests' prompt scores: 3 tokens with top-2, 2 tokens with none."""
    f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
    scores = dict(prompt_ids=["a#0", "b#0"], prompt_starts=int32([1, 5]),
                  prompt_counts=int32([3, 2]), prompt_ks=int32([2, 0]),
                  prompt_logprobs=f32([-1, -2, -3, -4, -5]),
                  prompt_top_token_ids=int32([7, 8, 7, 9, 1, 2]),
                  prompt_top_logprobs=f32([-0.5, -1, -0.1, -2, -0.3, -0.4]),
                  prompt_ranks=int32([3, 1, 40, 2, 2]))
    r = roundtrip(wire.StepResult(step_id=3, **scores))
    assert r.prompt_ids == ["a#0", "b#0"] and r.prompt_top_token_ids.tolist()[-1] == 2
    assert r.prompt_ranks.tolist() == [3, 1, 40, 2, 2]
    assert roundtrip(wire.StepResult(step_id=3, **{**scores, "prompt_ranks": None})) \
        .prompt_ranks is None  # optional
    for name, bad in [("prompt_logprobs", f32([-1, -2])), ("prompt_top_token_ids", int32([7])),
                      ("prompt_counts", int32([3])), ("prompt_ks", None),
                      ("prompt_ranks", int32([1]))]:
        with pytest.raises(WireError, match=name):
            roundtrip(wire.StepResult(step_id=3, **{**scores, name: bad}))


def test_plan_admitting_many_new_requests_decodes():
    n = 300  # > 27: used to exceed MAX_FRAMES = 64
    sp = wire.SamplingParams()
    news = [wire.NewRequest(request_id=f"r{i}", prompt_token_ids=int32([1, 2, 3]),
                            output_token_ids=int32([]), sampling=sp) for i in range(n)]
    ids = [f"r{i}" for i in range(n)]
    p = StepPlan(step_id=1, new_requests=news, request_ids=ids,
                 num_computed_tokens=int32([0] * n), num_new_tokens=int32([3] * n),
                 do_sample=np.ones(n, np.uint8), token_ids=int32([1, 2, 3] * n),
                 positions=int32([0, 1, 2] * n), slot_mapping=np.arange(3 * n, dtype=np.int64),
                 block_table_starts=int32([0] * n), block_table_lens=int32([1] * n),
                 block_table_ids=int32(range(n)))
    got = roundtrip(p)
    assert len(got.new_requests) == n and got.new_requests[-1].prompt_token_ids.tolist() == [1, 2, 3]
    with pytest.raises(WireError):
        Codec().decode([b""] * (codec.MAX_FRAMES + 1))


def test_small_arrays_share_frame_1_and_large_ones_have_their_own():
    """A plan's small arrays lie in frame 1 (8-byte aligned); an array of OWN_FRAME_BYTES or
    more travels in a frame of its own; every byte of frame 1 belongs to an array."""
    c = Codec()
    frames = c.encode(plan())
    assert len(frames) == 2
    big = np.arange(codec.OWN_FRAME_BYTES // 8 + 1, dtype=np.int64)
    n = len(big)
    p = plan(request_ids=["a"], num_computed_tokens=int32([0]), num_new_tokens=int32([n]),
             do_sample=np.array([1], np.uint8), token_ids=int32(np.arange(n) % 7),
             positions=int32(np.arange(n)), slot_mapping=big,
             block_table_starts=int32([0]), block_table_lens=int32([1]))
    frames = [bytes(f) for f in c.encode(p)]
    assert len(frames) == 3 and len(frames[2]) == big.nbytes  # slot_mapping's own frame
    got = c.decode(frames)
    assert got.slot_mapping.tolist() == big.tolist() and got.positions[-1] == n - 1
    for i, extra in ((1, b"\0" * 8), (2, b"\0" * 8)):  # a byte no array claims
        bad = list(frames)
        bad[i] += extra
        with pytest.raises(WireError, match="array frame"):
            c.decode(bad)
    bad = list(frames)
    bad[2] = bad[2][:-8]
    with pytest.raises(WireError, match="array frame 2"):
        c.decode(bad)
    # a frame no array refers to, after the own frame or after frame 1 alone
    with pytest.raises(WireError, match="hold an array"):
        c.decode([*frames, b"\0" * 8])
    small = [bytes(f) for f in c.encode(plan())]
    with pytest.raises(WireError, match="hold an array"):
        c.decode([*small, b"junk"])
    assert c.decode(frames).slot_mapping.tolist() == big.tolist()  # the codec still decodes


def test_odd_sized_arrays_are_aligned_in_frame_1():
    r = wire.StepResult(step_id=4, request_ids=["a", "b", "c"],
                        token_ids=int32([1, 2, 3]), logprobs=np.array([-1, -2, -3], np.float32),
                        top_counts=int32([1, 0, 1]), top_token_ids=int32([5, 6]),
                        top_logprobs=np.array([-0.5, -0.25], np.float32))
    c = Codec()
    frames = [bytes(f) for f in c.encode(r)]
    # 12-byte arrays at offsets 0, 16 and 32, 8-byte ones at 48 and 56
    assert len(frames) == 2 and len(frames[1]) == 64
    got = c.decode(frames)
    assert got.token_ids.tolist() == [1, 2, 3] and got.top_logprobs.tolist() == [-0.5, -0.25]
    assert {a.ctypes.data % 8 for a in (got.token_ids, got.logprobs, got.top_token_ids)} == {0}
