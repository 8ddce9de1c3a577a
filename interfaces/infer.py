"""The ``infer`` channel of split inference (DESIGN §4.4, §5): what its MQTT 5 user properties say.

A device's ``head`` worker publishes on ``synergy/v1/devices/{device_id}/infer`` (``topics.DEVICE_INFER``) with
QoS 0: the payload is the activation at the cut as a safetensors frame (``device.tensors``: one tensor, float32
or int8 with scale and zero point in its header), the user properties an :class:`InferRequest`, the response
topic the device's ``infer/reply`` and 1-64 bytes of correlation data. The edge's ``tail`` worker for the task
answers on ``synergy/v1/devices/{device_id}/infer/reply`` with the same correlation data: the model's outputs as
a safetensors file (one tensor per output, their own dtypes) and an :class:`InferReply`, or an empty payload
and the error. A ``probe`` request measures the link: its payload is filler, its answer empty.

QoS 0 on purpose: a lost frame is a request that times out and runs on the device (a fallback), which is what
a late answer would have cost anyway; nothing is queued for a device or an edge that is away.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_CORRELATION_BYTES = 64
MAX_FRAME_BYTES = 8 << 20
"""The largest payload on ``infer`` and ``infer/reply``: an activation, a raw input or a link probe (at most 1 MiB);
the only channel above the envelopes' ``MAX_MESSAGE_BYTES``, so the broker's packet limit follows it."""
MAX_PROPERTY_CHARS = 512
Text = Annotated[str, Field(max_length=MAX_PROPERTY_CHARS)]


class _Properties(BaseModel):
    """A model of user properties: every field travels as one ``(name, str(value))`` pair.

    The values are text, so a number is read from its text; ``nan`` and ``inf`` are refused, as in JSON.
    """

    # unknown properties are someone else's (a broker, a tracer)
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    def pairs(self) -> list[tuple[str, str]]:
        return [(k, str(v)) for k, v in self.model_dump(exclude_none=True).items()]

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, str]] | None) -> Self:
        """The model of a message's user properties; ``ValueError`` naming what is wrong."""
        values: dict[str, str] = {}
        for name, value in pairs or []:
            values.setdefault(name, value)  # the first of a repeated name counts
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ValueError(f"bad {cls.__name__} properties: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


class InferRequest(_Properties):
    """User properties of a request on ``infer``."""

    task_id: str = Field(min_length=1, max_length=64, description="the split_inference task whose tail runs it")
    kind: Literal["infer", "probe"] = "infer"
    cut: str = Field(default="", max_length=256, description="infer: the tensor the activation is (the tail to run), or '<edge>' for the raw input")
    encoding: Text | None = Field(default=None, description="the frame's encoding (float32 | int8), as in its header")
    shape: Text | None = Field(default=None, description="the activation's shape, comma-separated, as in its header")


class InferReply(_Properties):
    """User properties of an answer on ``infer/reply``."""

    status: Literal["ok", "error"]
    error: Text = ""
    tail_ms: float = Field(default=0.0, ge=0, description="the edge's compute time for this request (the link's share is the rest)")
