"""Episode control over HTTP, for agents in another process (`asyncrl serve CONFIG`).

Place in the dataflow: what the embedding API does in Python — `server.episode()`, `ep.reward = r`,
`rt.submit(group)` — as three routes of the same OpenAI-compatible server (`openai_server.py`):

  POST /episodes                     → {"id", "base_url"}: a new recorded episode
  POST /groups {"episodes": [{"id": ..., "reward": r}, ...]}
                                     → closes the episodes (requests in flight are recorded first), sets the
                                       rewards and submits them as one group (rt.submit) → {"group_id": int |
                                       null (too stale: dropped, counted), "trajectories": n}
  GET  /status                       → {"version", "training_done"}

Errors: 400 for a malformed body, an episode without a sampled turn, or one named twice; 404 for an unknown
or closed episode; 409 once training has ended.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from asyncrl.errors import TrainingFinished

log = logging.getLogger(__name__)


class EpisodeReward(msgspec.Struct, kw_only=True):
    id: str
    reward: float


class GroupRequest(msgspec.Struct, kw_only=True):
    episodes: list[EpisodeReward]


def add_routes(app: Any, server: Any) -> None:
    from aiohttp import web

    async def open_episode(request: Any) -> Any:
        ep = server.episode()
        return web.json_response({"id": ep.id, "base_url": ep.base_url})

    async def status(request: Any) -> Any:
        return web.json_response({"version": server.rt.version, "training_done": server.rt.training_done})

    async def submit_group(request: Any) -> Any:
        try:
            req = msgspec.json.decode(await request.read(), type=GroupRequest)
        except msgspec.MsgspecError as exc:
            return server.refuse(400, f"bad request body: {exc}")
        ids = [e.id for e in req.episodes]
        if not ids:
            return server.refuse(400, "a group needs at least one episode")
        if len(set(ids)) != len(ids):
            return server.refuse(400, "an episode is named twice in the group")
        eps = [server.open_episode(i) for i in ids]
        missing = [i for i, ep in zip(ids, eps) if ep is None]
        if missing:
            return server.refuse(404, f"episode {missing[0]!r} is not open (closed, submitted, or never opened by "
                                      f"POST /episodes)", "not_found_error")
        for ep, e in zip(eps, req.episodes):
            await ep.close()
            ep.reward = e.reward
        try:
            trajs = [t for ep in eps for t in ep.to_trajectories()]
            gid = await server.rt.submit(trajs)
        except TrainingFinished as exc:
            return server.refuse(409, str(exc), "conflict_error")
        except ValueError as exc:
            return server.refuse(400, str(exc))
        return web.json_response({"group_id": gid, "trajectories": len(trajs)})

    app.router.add_post("/episodes", open_episode)
    app.router.add_post("/groups", submit_group)
    app.router.add_get("/status", status)
