"""What crosses a process edge packed: the calls whose trajectories or groups travel as one msgpack blob.

Place in the dataflow: `RayProxy` (the caller's side, asyncrl/deploy/actors.py) encodes a call's argument and
decodes its reply here; `RoleActor.call` (the callee's side) decodes the argument and encodes the reply. Ray then
pickles one bytes object instead of walking every Struct with cloudpickle (several times cheaper on both sides;
benchmarks/hub.py). The roles and the buffer take and return typed lists: in one process (the in-process
deployment, the scorers hosted in the buffer's actor) nothing is packed, and no role knows whether its peer
is in another process.

`WIRE` names each packed call: the type of its first argument that travels packed, and the type of its reply
that does (None: as it is).
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncrl.messages import Group, Trajectory

WIRE: dict[str, tuple[Any, Any]] = {  # method: (its first argument's type, its reply's type); None = not packed
    "put_rollouts": (list[Trajectory], None),  # a generator's finished groups, to the buffer
    "get_rollouts": (None, list[Trajectory]),  # a scorer's batch, from the buffer
    "accept_groups": (list[Group], None),  # a scorer's scored groups, to the buffer
    "take_step": (None, list[Group]),  # the trainer's step, from the buffer
}

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(t) for pair in WIRE.values() for t in pair if t is not None}


def encode_args(method: str, args: tuple) -> tuple:
    """The call's positional arguments as they leave this process."""
    arg_type = WIRE.get(method, (None, None))[0]
    if arg_type is None or not args:
        return args
    return (_ENCODER.encode(args[0]), *args[1:])


def decode_args(method: str, args: tuple) -> tuple:
    """The call's positional arguments as the callee takes them."""
    arg_type = WIRE.get(method, (None, None))[0]
    if arg_type is None or not args:
        return args
    return (_DECODERS[arg_type].decode(args[0]), *args[1:])


def packs_reply(method: str) -> bool:
    return WIRE.get(method, (None, None))[1] is not None


def encode_reply(method: str, result: Any) -> Any:
    """The callee's reply as it leaves its process."""
    return _ENCODER.encode(result) if packs_reply(method) else result


def decode_reply(method: str, data: Any) -> Any:
    """The reply as the caller takes it."""
    reply_type = WIRE.get(method, (None, None))[1]
    return data if reply_type is None else _DECODERS[reply_type].decode(data)
