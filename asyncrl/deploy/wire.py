"""What the edge between the Controller and a role adds to a call: packing, and the role's window report.

Place in the dataflow: `RayProxy` (the caller's side, asyncrl/deploy/actors.py) encodes a call's argument and
decodes its reply here; `RoleActor.call` (the callee's side) decodes the argument and encodes the reply. Ray then
pickles one bytes object instead of walking every Struct with cloudpickle (several times cheaper on both sides;
benchmarks/hub.py). The roles and the buffer take and return typed lists: in one process (the in-process
deployment, the scorers hosted in the buffer's actor) nothing is packed, and no role knows whether its peer
is in another process.

`WIRE` names each packed call: the type of its first argument that travels packed, and the type of its reply
that does (None: as it is).

Window reports (`REPORTING`): the step pipeline asks the trainer's `send_weights`, each generator's
`receive_weights` and the buffer's `publish` with `report=True` (asyncrl/pipeline.py, `with_reports`); the edge
that hosts the role — the Ray actor (`RoleActor.call`) or the in-process facade (asyncrl/deploy/local.py) — calls
the role without it and attaches the role's `stats()` to the reply (`with_report`): one actor call a role a step
fewer. The roles themselves know nothing of it.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from asyncrl.messages import Group, Trajectory
from asyncrl.telemetry.metrics import REPORT_KEY

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


REPORTING = frozenset({"send_weights", "receive_weights", "publish"})  # replies that may carry the role's report


def wants_report(method: str, kwargs: dict[str, Any]) -> bool:
    """Whether the caller asked this call's reply to carry the role's window report (taken out of `kwargs`)."""
    return bool(kwargs.pop("report", False)) if method in REPORTING else False


async def with_report(role: Any, method: str, result: Any, hosted: Any = ()) -> Any:
    """`result` with `role.stats()` (its window ends here): under REPORT_KEY in a statistics reply (`send_weights`,
    `receive_weights`); as the reply of `publish`, which has none — with the `hosted` scorers' reports beside the
    buffer's, by role ({"buffer": ..., "scorer/<i>": ...}), where the buffer's process hosts scorers."""
    stats = role.stats()
    if inspect.isawaitable(stats):
        stats = await stats
    if method != "publish":
        return {**result, REPORT_KEY: stats}
    if not hosted:
        return stats
    return {"buffer": stats, **{f"scorer/{s.scorer_id}": s.stats() for s in hosted}}
