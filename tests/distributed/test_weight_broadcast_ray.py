"""The weight broadcast between Ray actors over a gloo group changes what the engines compute.

Bit-identical buffers alone do not prove that an engine uses them, so the check is behavioural: after a
real train step (large learning rate and weight decay, so the weights move even when every
reward in the batch is equal) is broadcast to two generator actors,
each engine's logprobs for a fixed sequence equal the trainer's teacher-forced logprobs (fp32, atol 1e-5)
and differ from the version-0 logprobs; every sampled token carries the new version.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.messages import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_broadcast_to_two_generator_actors_makes_engines_match_trainer(ray_cluster, make_config):
    from asyncrl.deploy.launch import RayDeployment

    cfg = make_config("rollout.num_generators=2", "trainer.lr=0.05", "trainer.weight_decay=0.5",
                      "staleness.max_staleness=0", "weight_sync.bucket_mb=0.01")
    d = RayDeployment(cfg)
    d.wait_ready()
    prompt = [1 + i % 10 for i in range(5)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)

    async def scenario():
        await d.setup_weight_sync()
        before = [(await g.generate([prompt], greedy))[0][0] for g in d.generators]
        loops = [asyncio.ensure_future(r.run()) for r in [*d.generators, *d.scorers]]
        await d.trainer.train_step(0)
        stats = await asyncio.gather(d.trainer.send_weights(), *[g.receive_weights() for g in d.generators])
        await d.buffer.publish(1)
        after = [(await g.generate([prompt], greedy))[0][0] for g in d.generators]
        refs = [await d.trainer.teacher_forced_logprobs(c.prompt_ids, c.response_ids, 1.0) for c in after]
        # the version-0 greedy sequence scored by the trainer's new weights
        moved = await d.trainer.teacher_forced_logprobs(before[0].prompt_ids, before[0].response_ids, 1.0)
        for r in [*d.generators, *d.scorers]:
            await r.stop()
        await d.buffer.close()
        await asyncio.wait(loops, timeout=10)
        return before, after, refs, moved, stats

    try:
        before, after, refs, moved, stats = asyncio.run(scenario())
    finally:
        asyncio.run(d.shutdown())

    assert stats[0]["sync/bytes"] > 0 and stats[0]["sync/buckets"] > 1
    assert all(s["sync/bytes"] == stats[0]["sync/bytes"] for s in stats[1:])
    for b in before:
        assert set(b.versions) == {0}
    for comp, ref in zip(after, refs):
        assert set(comp.versions) == {1}
        assert len(ref) == len(comp.logprobs)
        assert max(abs(a - r) for a, r in zip(comp.logprobs, ref)) < 1e-5
    # The update really moved the weights: the version-0 sequence has other logprobs under version 1,
    # so the engines' agreement with the trainer above is agreement with the new weights.
    assert max(abs(a - b) for a, b in zip(moved, before[0].logprobs)) > 1e-4
