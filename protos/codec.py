"""Router <-> executor messages (protos/wire.py) as ZeroMQ frames, and back.

Frame 0 is the MessagePack-encoded message; every array inside it travels as a raw
little-endian buffer outside it, referenced from frame 0 by a small msgpack extension
(frame index, byte offset, dtype, shape). Arrays under ``OWN_FRAME_BYTES`` lie back to back
(each at an 8-byte aligned offset) in frame 1, an array of that size or more in a frame of
its own (sent and received without a copy): a message's frames cost ~2.7 us each to send and
as much to receive, and a plan holds a dozen small arrays plus two a new request. Every
reference is checked against the frames; frame 1 must end where its last array ends, and
every frame after it must be some array's own frame (a message with a frame nothing
refers to is malformed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

from .wire import PROTOCOL_VERSION, Message, StepPlan, StepResult, WireError, _Message

# Limits on what a peer may send (DESIGN: limits everywhere).
# A StepPlan takes at most 2 + 11 frames plus 2 per new request (prompt ids, output ids), when
# every array is of OWN_FRAME_BYTES or more, and a step may admit up to max_num_seqs new
# requests: the cap allows 4,096 of them (byte size is capped by the socket's MAXMSGSIZE).
MAX_NEW_REQUESTS_PER_PLAN = 4096
MAX_FRAMES = 2 * MAX_NEW_REQUESTS_PER_PLAN + 64
MAX_ARRAY_DIMS = 3
OWN_FRAME_BYTES = 1 << 16  # an array this large travels in a frame of its own (no copy)
_PACK_FRAME = 1  # the frame the smaller arrays share
_PACK_ALIGN = 8  # their offsets in it (the largest itemsize allowed)
_ARRAY_EXT_CODE = 1
_ALLOWED_DTYPES = {"<i4", "<i8", "<f4", "|u1", "|b1", "<u4"}
_DTYPES = {name: np.dtype(name) for name in _ALLOWED_DTYPES}
_ARRAY_REF_DECODER = msgspec.msgpack.Decoder(tuple[int, int, str, list[int]])
_REF_CACHE_SIZE = 1024  # distinct (frame, offset, dtype, shape) references remembered per Codec
_PADDING = bytes(_PACK_ALIGN)


class Codec:
    """Encodes messages to frames and back. Not thread-safe: one per thread/socket.

    Hot path (every step, both ends): keep per-array work to a dict lookup and one numpy
    call. Array references are parsed and checked once per distinct (frame, offset, dtype,
    shape) and remembered (a bounded cache); a reference that fails a check is never cached.
    """

    def __init__(self, max_array_bytes: int = 1 << 30) -> None:
        self._out_frames: list = []
        self._pack: list = []  # buffers of frame 1 being encoded, padding included
        self._pack_len = 0
        self._in_frames: Sequence = ()
        self._max_array_bytes = max_array_bytes
        self._ext_out: dict[tuple, msgspec.msgpack.Ext] = {}
        self._refs_in: dict[bytes, tuple[int, int, np.dtype, tuple[int, ...], int]] = {}
        self._in_end = 0  # where the arrays read from frame 1 so far end
        self._in_own: set[int] = set()  # own frames (index > 1) the arrays read so far
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(
            Message, ext_hook=self._ext_hook, dec_hook=self._dec_hook
        )

    # encode ------------------------------------------------------------------------------
    def _enc_hook(self, obj):
        if not isinstance(obj, np.ndarray):
            raise NotImplementedError(f"cannot encode {type(obj).__name__}")
        arr = obj
        dtype = arr.dtype.str
        if dtype not in _ALLOWED_DTYPES:
            if arr.dtype.byteorder in "=>":  # big-endian: send little-endian
                arr = arr.astype(arr.dtype.newbyteorder("<"))
                dtype = arr.dtype.str
            if dtype not in _ALLOWED_DTYPES:
                raise WireError(f"dtype {arr.dtype} cannot travel on the wire")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        frames = self._out_frames
        if len(frames) == _PACK_FRAME:
            frames.append(b"")  # frame 1, filled in by encode
        nbytes = arr.nbytes
        if nbytes >= OWN_FRAME_BYTES:
            index, offset = len(frames), 0
            frames.append(arr.data)
        else:
            index, offset = _PACK_FRAME, self._pack_len
            pad = -offset % _PACK_ALIGN
            if pad:
                self._pack.append(_PADDING[:pad])
                offset += pad
            if nbytes:
                self._pack.append(arr.data)
            self._pack_len = offset + nbytes
        key = (index, offset, dtype, arr.shape)
        ext = self._ext_out.get(key)
        if ext is None:
            if len(self._ext_out) >= _REF_CACHE_SIZE:
                self._ext_out.clear()
            ref = msgspec.msgpack.encode((index, offset, dtype, list(arr.shape)))
            ext = self._ext_out[key] = msgspec.msgpack.Ext(_ARRAY_EXT_CODE, ref)
        return ext

    def encode(self, msg: _Message) -> list:
        """Frames ready for ``zmq_io.send_frames`` (or ``send_multipart(copy=False)``)."""
        self._out_frames = [b""]
        try:
            self._out_frames[0] = self._encoder.encode(msg)
            if self._pack:
                self._out_frames[_PACK_FRAME] = b"".join(self._pack)
            return self._out_frames
        finally:
            self._out_frames = []
            self._pack = []
            self._pack_len = 0

    # decode ------------------------------------------------------------------------------
    def _parse_ref(self, key: bytes) -> tuple[int, int, np.dtype, tuple[int, ...], int]:
        try:
            index, offset, dtype, shape = _ARRAY_REF_DECODER.decode(key)
        except msgspec.DecodeError as exc:
            raise WireError(f"bad array reference: {exc}") from None
        if dtype not in _ALLOWED_DTYPES:
            raise WireError(f"array dtype {dtype!r} not allowed")
        if index < 1:
            raise WireError(f"array frame {index} does not exist")
        if len(shape) > MAX_ARRAY_DIMS or any(d < 0 for d in shape):
            raise WireError(f"bad array shape {shape}")
        if offset < 0 or offset % _PACK_ALIGN:
            raise WireError(f"bad array offset {offset}")
        dt = _DTYPES[dtype]
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes > self._max_array_bytes:
            raise WireError(f"array of {nbytes} bytes is over the limit")
        ref = (index, offset, dt, tuple(shape), nbytes)
        if len(self._refs_in) >= _REF_CACHE_SIZE:
            self._refs_in.clear()
        self._refs_in[key] = ref
        return ref

    def _ext_hook(self, code: int, data: memoryview):
        if code != _ARRAY_EXT_CODE:
            raise WireError(f"unknown extension type {code}")
        key = bytes(data)
        ref = self._refs_in.get(key)
        index, offset, dt, shape, nbytes = ref if ref is not None else self._parse_ref(key)
        frames = self._in_frames
        if index >= len(frames):
            raise WireError(f"array frame {index} does not exist")
        buf = frames[index]  # bytes, zmq.Frame (len() is its size in bytes) or memoryview
        size = buf.nbytes if type(buf) is memoryview else len(buf)
        if index == _PACK_FRAME:
            end = offset + nbytes
            if end > size:
                raise WireError(f"array frame {index} has {size} bytes, an array needs "
                                f"[{offset}, {end})")
            if end > self._in_end:
                self._in_end = end
        else:
            if offset or size != nbytes:
                raise WireError(f"array frame {index} has {size} bytes, expected {nbytes}")
            self._in_own.add(index)
        arr = np.frombuffer(buf, dt, nbytes // dt.itemsize, offset)  # (keywords: 2x slower)
        return arr if len(shape) == 1 else arr.reshape(shape)

    @staticmethod
    def _dec_hook(typ, obj):
        if typ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise NotImplementedError

    def decode(self, frames: Sequence) -> Message:
        """Decode and validate one message; raises WireError on anything off."""
        if not frames or len(frames) > MAX_FRAMES:
            raise WireError(f"message with {len(frames)} frames")
        self._in_frames = frames
        self._in_end = 0
        if self._in_own:
            self._in_own = set()
        head = frames[0]
        if type(head) is not bytes and hasattr(head, "buffer"):  # zmq.Frame
            head = head.buffer
        try:
            msg = self._decoder.decode(head)
        except WireError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            raise WireError(f"malformed message: {exc}") from None
        finally:
            self._in_frames = ()
        if len(frames) > _PACK_FRAME:
            pack = frames[_PACK_FRAME]
            size = pack.nbytes if type(pack) is memoryview else len(pack)
            if size != self._in_end:  # no bytes after its last array
                raise WireError(f"array frame {_PACK_FRAME} has {size} bytes, its arrays "
                                f"end at {self._in_end}")
            if len(self._in_own) != len(frames) - _PACK_FRAME - 1:
                raise WireError(f"message of {len(frames)} frames: only "
                                f"{len(self._in_own)} after frame {_PACK_FRAME} hold an array")
        if msg.version != PROTOCOL_VERSION:
            raise WireError(f"protocol version {msg.version}, expected {PROTOCOL_VERSION}")
        if isinstance(msg, (StepPlan, StepResult)):
            msg.validate()
        return msg
