"""Fakes shared by the Scorer tests: a buffer that hands out prepared batches and records what the Scorer
accepted and released, and a two-sample trajectory whose response is the text's characters."""

from __future__ import annotations

import asyncio
import json

from asyncrl.messages import Group, Trajectory


class FakeBuffer:
    def __init__(self, batches: list[list[Trajectory]]) -> None:
        self.batches = batches
        self.accepted: list[Group] = []
        self.released: dict[str, list[int]] = {"filtered": [], "failed": []}

    async def get_rollouts(self, max_items: int, timeout: float | None = None, holder=None) -> list[Trajectory]:
        if self.batches:
            return self.batches.pop(0)
        await asyncio.sleep(0.01)
        return []

    async def accept_groups(self, groups: list[Group]) -> None:
        self.accepted.extend(groups)

    async def release_groups(self, group_ids: list[int], reason: str, detail: str = "") -> None:
        self.released[reason].extend(group_ids)


def traj(group_id: int, j: int, text: str, finish_reason: str = "stop", answer: str = "a") -> Trajectory:
    ids = [ord(c) for c in text]
    return Trajectory(seq_id=group_id * 2 + j, group_id=group_id, group_size=2, prompt_ids=[1], response_ids=ids,
                      loss_mask=[True] * len(ids), behavior_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                      min_version=0, max_version=0, finish_reason=finish_reason, truncated=finish_reason == "length",
                      prompt_text=f"p{group_id}", row_json=json.dumps({"answer": answer}).encode())
