"""Activation frames of split inference (DESIGN §4.4, §5): one tensor as a safetensors frame, optionally int8.

The device head sends the activation at the cut to the edge tail as the bytes of a safetensors file holding one
tensor, ``activation``, with string metadata in its header (the same strings travel as MQTT 5 user properties):

=============  =========================================================================================
``encoding``   ``float32`` (the values as they are) or ``int8`` (quantised, below)
``dtype``      the activation's dtype before encoding (``float32``)
``shape``      its shape, comma-separated (``1,16,4,4``; empty for a scalar)
``scale``      int8 only: the quantisation step, a decimal float (``repr``, exact)
``zero_point`` int8 only: the int8 code of 0.0, in [-128, 127]
=============  =========================================================================================

int8 is per-tensor affine (asymmetric) quantisation over the tensor's range extended to include 0 (so that 0,
common after a ReLU, is exact): ``scale = (max - min) / 255``, ``zero_point = round(-128 - min / scale)``,
``q = clip(round(x / scale) + zero_point, -128, 127)``, decoded as ``(q - zero_point) * scale``; an element's
error is at most half a step (``scale / 2``), one step where the ends of the range clip. A quarter of the bytes of
float32 on the link.

numpy and safetensors only; no pickle anywhere: the frame is a safetensors header (JSON) and raw little-endian
data, parsed by :func:`decode_activation` without executing anything.
"""

from __future__ import annotations

import json
import math
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

TENSOR = "activation"
FLOAT32, INT8 = "float32", "int8"
MAX_HEADER = 1 << 20  # a frame's JSON header is a few hundred bytes; refuse absurd ones before parsing


def quantize_int8(array: np.ndarray) -> tuple[np.ndarray, float, int]:
    """``(q, scale, zero_point)``: ``array`` as int8 codes (see the module docstring)."""
    import numpy as np

    values = np.asarray(array, dtype=np.float32)
    if values.size and not np.isfinite(values).all():
        raise ValueError("cannot quantise an activation with NaN or infinite values")
    low = min(float(values.min()), 0.0) if values.size else 0.0
    high = max(float(values.max()), 0.0) if values.size else 0.0
    if high == low:  # all zeros: any scale represents them exactly
        return np.zeros(values.shape, dtype=np.int8), 1.0, 0
    scale = (high - low) / 255.0
    zero_point = int(min(127, max(-128, round(-128 - low / scale))))
    codes = np.clip(np.rint(values / scale) + zero_point, -128, 127).astype(np.int8)
    return codes, scale, zero_point


def dequantize_int8(codes: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    import numpy as np

    return ((codes.astype(np.float32) - np.float32(zero_point)) * np.float32(scale)).astype(np.float32)


def encode_activation(array: np.ndarray, quantize: bool = False) -> tuple[bytes, dict[str, str]]:
    """``(frame, metadata)``: ``array`` as a safetensors frame, int8-quantised when ``quantize``; ``metadata`` is
    what the frame's header carries (for MQTT user properties). The activation is taken as float32."""
    import numpy as np
    from safetensors.numpy import save

    values = np.asarray(array, dtype=np.float32)
    if not values.flags.c_contiguous:
        values = np.ascontiguousarray(values)  # (not for 0-d: ascontiguousarray makes those 1-d)
    metadata = {"encoding": INT8 if quantize else FLOAT32, "dtype": FLOAT32, "shape": ",".join(str(d) for d in values.shape)}
    if quantize:
        codes, scale, zero_point = quantize_int8(values)
        metadata.update(scale=repr(scale), zero_point=str(zero_point))
        payload = codes
    else:
        payload = values
    # safetensors cannot hold a 0-d tensor with a shape of its own; the metadata's shape restores it
    return save({TENSOR: payload.reshape(payload.shape or (1,))}, metadata=metadata), metadata


def frame_metadata(frame: bytes) -> dict[str, str]:
    """The metadata strings of a frame's header, read without touching its data (``ValueError`` if malformed)."""
    if len(frame) < 8:
        raise ValueError("not a safetensors frame: shorter than its 8-byte header length")
    (size,) = struct.unpack("<Q", frame[:8])
    if size > MAX_HEADER or 8 + size > len(frame):
        raise ValueError(f"not a safetensors frame: header of {size} bytes in a frame of {len(frame)}")
    try:
        header = json.loads(frame[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a safetensors frame: {exc}") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("the frame carries no activation metadata")
    return metadata


def decode_activation(frame: bytes) -> np.ndarray:
    """The float32 activation of a frame made by :func:`encode_activation` (int8 frames dequantised).
    ``ValueError`` for anything else: not safetensors, missing or inconsistent metadata, wrong dtype or shape."""
    import numpy as np
    from safetensors.numpy import load

    metadata = frame_metadata(frame)
    encoding = metadata.get("encoding")
    if encoding not in (FLOAT32, INT8):
        raise ValueError(f"unknown activation encoding {encoding!r} (float32 or int8)")
    try:
        shape = tuple(int(d) for d in metadata["shape"].split(",")) if metadata.get("shape") else ()
    except (KeyError, ValueError):
        raise ValueError(f"bad activation shape {metadata.get('shape')!r}") from None
    try:
        tensors = load(bytes(frame))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"not a safetensors frame: {exc}") from None
    if set(tensors) != {TENSOR}:
        raise ValueError(f"an activation frame holds one tensor {TENSOR!r}, not {sorted(tensors)}")
    data = tensors[TENSOR]
    if data.size != math.prod(shape):
        raise ValueError(f"the frame's tensor has {data.size} values, its metadata says shape {list(shape)}")
    data = data.reshape(shape)
    if encoding == FLOAT32:
        if data.dtype != np.float32:
            raise ValueError(f"a float32 frame holds {data.dtype}")
        return data
    if data.dtype != np.int8:
        raise ValueError(f"an int8 frame holds {data.dtype}")
    try:
        scale, zero_point = float(metadata["scale"]), int(metadata["zero_point"])
    except (KeyError, ValueError):
        raise ValueError("an int8 frame needs a numeric scale and zero_point") from None
    if not (math.isfinite(scale) and scale > 0) or not -128 <= zero_point <= 127:
        raise ValueError(f"bad int8 parameters: scale {scale}, zero_point {zero_point}")
    return dequantize_int8(data, scale, zero_point)
