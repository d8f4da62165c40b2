"""The OpenAI-compatible endpoint over an in-process Runtime on a tiny model, called with the `openai` SDK:
answers in the OpenAI shape, recorded turns equal to what the engine sampled, multi-turn chats merged into
one trajectory, rewritten histories kept apart, bad requests refused with one-line JSON errors, and
training steps taken on submitted episodes."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from asyncrl import Runtime
from asyncrl.runtime import TrainingFinished

pytestmark = pytest.mark.slow  # starts a Runtime (trainer, engine) in process

torch.set_num_threads(1)
pytest.importorskip("aiohttp")  # the endpoint's server (the `serve` extra)
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

TOML = """
[model]
path = "{model_dir}"
[model.build_tiny]
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 64
vocab = "0123456789+-?="

[data]
source = "asyncrl.envs.builtin:guess_rows"
max_prompt_len = 48

[rollout]
max_new_tokens = 3

[trainer]
total_steps = 2
prompts_per_step = 2
micro_batch_size = 16
lr = 1e-2
eval_every = 0

[run]
output_dir = "{run_dir}"
save_checkpoint = false
"""

# user turns "?<content>", the model's "=<content><eos>", generation prompt "="; a tool's name goes first
TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}{% endfor %}"
            "{% for m in messages %}{% if m['role'] == 'user' %}?{{ m['content'] }}"
            "{% else %}={{ m['content'] }}<eos>{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}")


def _config(tmp_path, *overrides):
    from asyncrl.config import load_config

    path = tmp_path / "config.toml"
    path.write_text(TOML.format(model_dir=tmp_path / "model", run_dir=tmp_path / "run"))
    return load_config(path, list(overrides))


def _spy(rt: Runtime) -> list[tuple[list[int], object]]:
    """Record every (prompt ids, Completion) the endpoint gets from the engine."""
    seen: list[tuple[list[int], object]] = []
    generate = rt.generate

    async def spy(prompt, **sampling):
        c = await generate(prompt, **sampling)
        seen.append((list(prompt), c))
        return c

    rt.generate = spy  # type: ignore[method-assign]
    return seen


def test_chat_and_completions_answer_in_the_openai_shape_and_record_exactly_what_the_engine_sampled(tmp_path):
    async def main():
        async with Runtime(_config(tmp_path)) as rt:
            seen = _spy(rt)
            server = await rt.serve_openai(chat_template=TEMPLATE)
            assert server.host == "127.0.0.1" and server._runner.addresses[0][0] == "127.0.0.1"
            assert server.url == f"http://127.0.0.1:{server.port}" and server.port > 0
            async with server.episode() as ep:
                client = openai.AsyncOpenAI(base_url=ep.base_url, api_key="unused", max_retries=0)
                assert [m.id for m in (await client.models.list()).data] == ["model"]
                first = [{"role": "user", "content": "12"}]
                r1 = await client.chat.completions.create(model="model", messages=first, logprobs=True, max_tokens=3)
                (p1, c1), = seen
                assert r1.object == "chat.completion" and r1.choices[0].message.role == "assistant"
                assert r1.choices[0].finish_reason == ("length" if c1.finish_reason == "length" else "stop")
                assert rt.codec.decode_raw(p1) == "?12="
                assert r1.choices[0].message.content == rt.decode(c1.response_ids)
                assert [t.logprob for t in r1.choices[0].logprobs.content] == c1.logprobs
                assert (r1.usage.prompt_tokens, r1.usage.completion_tokens) == (4, len(c1.response_ids))
                # the second turn: the agent sends back the SDK's message object and a new user message
                second = [*first, r1.choices[0].message.model_dump(), {"role": "user", "content": "+"}]
                await client.chat.completions.create(model="model", messages=second)
                p2, c2 = seen[1]
                assert p2[: len(p1) + len(c1.response_ids)] == p1 + c1.response_ids  # the sampled ids, as sampled
                assert rt.decode(p2) == f"?12={r1.choices[0].message.content}?+="
                rewritten = [{"role": "user", "content": "3"}]  # a history that continues nothing
                await client.chat.completions.create(model="model", messages=rewritten)
                tools = [{"type": "function", "function": {"name": "7", "parameters": {}}}]
                r4 = await client.chat.completions.create(model="model", messages=rewritten, tools=tools)
                assert rt.codec.decode_raw(seen[3][0]) == "7?3=" and r4.usage.prompt_tokens == 4
                ep.reward = 1.0
            trajs = ep.to_trajectories()
            assert len(trajs) == 3 and [t.turns for t in trajs] == [2, 1, 1]
            merged = trajs[0]
            new = p2[len(p1) + len(c1.response_ids):]
            assert merged.prompt_ids == p1 and merged.response_ids == c1.response_ids + new + c2.response_ids
            assert merged.loss_mask == [True] * len(c1.response_ids) + [False] * len(new) + [True] * len(
                c2.response_ids)
            assert [lp for lp, m in zip(merged.behavior_logprobs, merged.loss_mask) if m] == c1.logprobs + c2.logprobs
            assert merged.versions[: len(c1.versions)] == c1.versions and merged.env_reward == 1.0
            assert trajs[1].prompt_ids == seen[2][0] and trajs[1].response_ids == seen[2][1].response_ids

            async with server.episode() as ep2:  # /v1/completions: text prompts continued by text
                client = openai.AsyncOpenAI(base_url=ep2.base_url, api_key="unused", max_retries=0)
                k1 = await client.completions.create(model="model", prompt="55", logprobs=0, max_tokens=2)
                pk, ck = seen[4]
                assert k1.object == "text_completion" and k1.choices[0].text == rt.decode(ck.response_ids)
                assert k1.choices[0].logprobs.token_logprobs == ck.logprobs and pk == rt.codec.encode("55")
                await client.completions.create(model="model", prompt="55" + k1.choices[0].text + "-", max_tokens=2)
                await client.completions.create(model="model", prompt=[4, 4], max_tokens=2, n=2)
                ep2.reward = 0.0
            trajs = ep2.to_trajectories()
            assert [t.turns for t in trajs] == [2, 1, 1]
            assert trajs[0].loss_mask == [True] * len(ck.response_ids) + [False] + [True] * len(seen[5][1].response_ids)
            assert [t.prompt_ids for t in trajs[1:]] == [[4, 4], [4, 4]]
            assert server.counters["continued"] == 2
            assert await rt.submit([ep, ep2]) is not None

    asyncio.run(asyncio.wait_for(main(), 120))


def test_bad_requests_are_answered_4xx_with_one_line_json_errors(tmp_path):
    async def main():
        async with Runtime(_config(tmp_path)) as rt:
            server = await rt.serve_openai(chat_template=TEMPLATE)
            bare = await rt.serve_openai()  # the tiny tokenizer has no chat template of its own
            ep, closed = server.episode(), server.episode()
            await closed.close()
            msgs = [{"role": "user", "content": "1"}]
            cases = [
                (ep.base_url + "/chat/completions", {"model": "m"}, 400, "missing required field `messages`"),
                (ep.base_url + "/chat/completions", "{not json", 400, "bad request body"),
                (server.url + "/episodes/nope/v1/chat/completions", {"messages": msgs}, 404, "'nope' is not open"),
                (closed.base_url + "/completions", {"prompt": "1"}, 404, "is not open"),
                (server.url + "/v1/chat/completions", {"messages": msgs}, 404, "recorded per episode"),
                (ep.base_url + "/chat/completions", {"messages": msgs, "n": 17}, 400, "n must be between 1 and 16"),
                (ep.base_url + "/chat/completions", {"messages": msgs, "stream": True}, 400, "stream=true"),
                (ep.base_url + "/chat/completions", {"messages": msgs, "temperature": -1}, 400, "temperature"),
                (ep.base_url + "/completions", {"prompt": "1" * 49}, 400, "data.max_prompt_len = 48"),
                (ep.base_url + "/completions", {"prompt": [10**6]}, 400, "prompt token ids"),
                (ep.base_url + "/completions", {"prompt": "1", "echo": True}, 400, "echo"),
                (ep.base_url + "/completions", {"prompt": ""}, 400, "the prompt is empty"),
                (bare.episode().base_url + "/chat/completions", {"messages": msgs}, 400, "no chat template"),
                (ep.base_url + "/embeddings", {"input": "1"}, 404, "Not Found"),
            ]
            async with httpx.AsyncClient() as http:
                for url, body, status, why in cases:
                    content = body if isinstance(body, str) else json.dumps(body)
                    r = await http.post(url, content=content, headers={"content-type": "application/json"})
                    msg = r.json()["error"]["message"]
                    assert (r.status_code, why in msg, "\n" in msg) == (status, True, False), (url, body, msg)
            assert ep.turns == [] and server.counters["refused"] == 12
            client = openai.AsyncOpenAI(base_url=ep.base_url, api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="n must be between"):
                await client.chat.completions.create(model="m", messages=msgs, n=20)
            with pytest.raises(ValueError, match="set ep.reward"):
                await rt.submit([ep])

    asyncio.run(asyncio.wait_for(main(), 120))


async def _guess(base_url: str, target: int) -> float:
    """The guessing game played by plain OpenAI-SDK agent code: one digit per turn, '+'/'-' feedback."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": ""}]
    for _ in range(3):
        r = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
        guess = r.choices[0].message.content
        if guess == str(target):
            return 1.0
        hint = "?" if not guess.isdigit() else ("+" if target > int(guess) else "-")
        messages += [{"role": "assistant", "content": guess}, {"role": "user", "content": hint}]
    return 0.0


def test_training_steps_follow_submitted_episodes_of_an_openai_sdk_agent(tmp_path):
    async def main():
        async with Runtime(_config(tmp_path)) as rt:
            server = await rt.serve_openai(chat_template=TEMPLATE)

            async def play(target: int):
                async with server.episode() as ep:
                    ep.reward = await _guess(ep.base_url, target)
                return ep

            target = 0
            while rt.version < 2:
                target = (target + 3) % 10
                group = await asyncio.gather(*[play(target) for _ in range(4)])
                assert all(len(ep.to_trajectories()) == 1 for ep in group)  # each chat merged into one
                try:
                    await rt.submit(group, timeout=30)
                except TrainingFinished:  # the second step was taken while this group was played
                    break
            return await asyncio.wait_for(rt.wait_done(), 60), server.counters

    rows, counters = asyncio.run(asyncio.wait_for(main(), 180))
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 2 and train[-1]["buffer/submitted_groups"] >= 4
    assert counters["continued"] > 0 and counters["refused"] == 0


@pytest.mark.parametrize("where", ["in process", "ray"])
def test_asyncrl_serve_trains_on_an_agent_in_another_process_that_speaks_only_http(tmp_path, where):
    """`asyncrl serve` (roles in its process, or with --ray as Ray actors on a local cluster it starts and
    stops) answers an agent that only speaks HTTP, refuses bad submissions, and trains on the good one."""
    import re
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    config = tmp_path / "config.toml"
    config.write_text(TOML.format(model_dir=tmp_path / "model", run_dir=tmp_path / "run"))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)

    async def main():
        err = open(tmp_path / "stderr.log", "w")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asyncrl.cli", "serve", str(config), "--port", "0", "--chat-template",
            str(template), "--set", "trainer.total_steps=1", "--set", "trainer.prompts_per_step=2",
            *(["--ray", "--set", "cluster.num_cpus=2"] if where == "ray" else []),
            cwd=root, stdout=asyncio.subprocess.PIPE, stderr=err)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            url = re.search(r" at (http://127\.0\.0\.1:\d+): ", line).group(1)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                assert (await http.get("/status")).json() == {"version": 0, "training_done": False}

                async def play_group() -> list[dict]:  # two episodes, one chat turn each
                    eps = [(await http.post("/episodes")).json() for _ in range(2)]
                    for ep in eps:
                        client = openai.AsyncOpenAI(base_url=ep["base_url"], api_key="unused", max_retries=0)
                        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
                    return eps

                eps = await play_group()
                bad = await http.post("/groups", json={"episodes": [{"id": "nope", "reward": 1.0}]})
                assert bad.status_code == 404 and "'nope' is not open" in bad.json()["error"]["message"]
                bad = await http.post("/groups", json={"episodes": [{"id": eps[0]["id"]}]})
                assert bad.status_code == 400 and "reward" in bad.json()["error"]["message"]
                ok = await http.post("/groups", json={"episodes": [{"id": e["id"], "reward": r}
                                                                   for e, r in zip(eps, (1.0, 0.0))]})
                assert ok.status_code == 200 and ok.json()["trajectories"] == 2
                assert isinstance(ok.json()["group_id"], int)
                # the step takes two groups (prompts_per_step = 2), so the server is still up: at one group a
                # step, the run could end and the server close before this request
                again = await http.post("/groups", json={"episodes": [{"id": eps[0]["id"], "reward": 1.0}]})
                assert again.status_code == 404  # submitted episodes are closed
                second = await play_group()
                ok = await http.post("/groups", json={"episodes": [{"id": e["id"], "reward": r}
                                                                   for e, r in zip(second, (0.0, 1.0))]})
                assert ok.status_code == 200 and ok.json()["trajectories"] == 2  # the second group: the step
            out = (await asyncio.wait_for(proc.stdout.read(), 120)).decode()
            return await asyncio.wait_for(proc.wait(), 30), out
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            err.close()

    rc, out = asyncio.run(main())
    assert rc == 0 and "run directory:" in out, (tmp_path / "stderr.log").read_text()[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
