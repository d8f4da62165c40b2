"""Buffers between the roles: bounded rollout queue, grouping by prompt, staleness gate, and the
`ReplayBuffer` that composes them inside one async actor (plain asyncio here; no Ray)."""

from buffers.gate import RELEASE_REASONS, AdmissionGate
from buffers.grouping import GroupAssembler
from buffers.queue import BoundedQueue, QueueClosed, Signal
from buffers.replay import ReplayBuffer

__all__ = [
    "RELEASE_REASONS",
    "AdmissionGate",
    "BoundedQueue",
    "GroupAssembler",
    "QueueClosed",
    "ReplayBuffer",
    "Signal",
]
