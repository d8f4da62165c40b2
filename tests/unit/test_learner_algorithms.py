"""The algorithm wiring around the pure functions of asyncrl/algorithms: the Learner's critic, reference
KL, entropy bonus, decoupled PPO and off-policy corrections, Safe-RLHF multiplier, ReMax baselines and
DAPO shaping; the Scorer's cost / baseline / reference fields; the Generator's greedy baseline; dynamic
sampling refilling a step; and the config errors of impossible combinations."""

from __future__ import annotations

import asyncio
import json
import math

import msgspec
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.algorithms.advantages import LagrangeMultiplier
from asyncrl.config import ConfigError, config_from_dict
from asyncrl.config.schema import AlgorithmConfig, CriticConfig, TrainerConfig
from asyncrl.messages import Group, Trajectory
from asyncrl.roles.scorer import Scorer
from asyncrl.training.critic import Critic, load_value_model
from asyncrl.training.learner import Learner
from asyncrl.training.reference import ReferencePolicy
from tests.fakes import ThreadRewards

torch.set_num_threads(1)

PAD, VOCAB = 0, 24


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _learner(seed: int = 0, trainer: dict | None = None, **algo) -> Learner:
    extra = {k: algo.pop(k) for k in ("critic", "reference", "lagrange", "max_new_tokens") if k in algo}
    tcfg = TrainerConfig(**{"lr": 1e-2, "grad_clip": 0.0, "micro_batch_size": 64, **(trainer or {})})
    return Learner(_model(seed), algorithm=AlgorithmConfig(**algo), trainer=tcfg, pad_token_id=PAD, **extra)


def _traj(seq_id: int, group_id: int, prompt: list[int], response: list[int], logprobs: list[float],
          reward: float = 0.0, **kw) -> Trajectory:
    n = len(response)
    return Trajectory(seq_id=seq_id, group_id=group_id, group_size=1, prompt_ids=prompt, response_ids=response,
                      loss_mask=[True] * n, behavior_logprobs=logprobs, versions=[0] * n, min_version=0,
                      max_version=0, finish_reason="stop", reward=reward, **kw)


def _samples(learner: Learner, n: int = 8, noise: float = 0.0, seed: int = 0, group: int = 4, **kw) -> list[Trajectory]:
    """n samples in groups of `group`, behaviour logprobs = the learner's own + `noise` * N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (2 + i % 3,), generator=gen).tolist()
        response = torch.randint(1, VOCAB, (1 + i % 4,), generator=gen).tolist()
        lp = torch.tensor(learner.teacher_forced_logprobs(prompt, response, 1.0))
        lp = (lp + noise * torch.randn(len(response), generator=gen)).tolist()
        out.append(_traj(i, i // group, prompt, response, lp, reward=float(i % 2), **kw))
    return out


def _groups(trajs: list[Trajectory]) -> list[Group]:
    return [Group(group_id=0, min_version=0, trajectories=trajs)]


# -- critic ---------------------------------------------------------------------------------------

def test_value_model_loads_from_the_policy_folder_with_a_fresh_scalar_head(tiny_model_dir):
    model = load_value_model(str(tiny_model_dir))
    out = model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long)).logits
    assert out.shape == (1, 3, 1)


def test_ppo_critic_fits_the_returns_and_reports_its_metrics():
    critic = Critic(load_like_critic(), CriticConfig(lr=2e-2, value_clip=0.0), pad_token_id=PAD,
                    micro_batch_size=8)
    learner = _learner(advantage="gae", critic=critic, lam=1.0, whiten_advantages=False)
    trajs = _samples(learner)
    first = learner.update(_groups(trajs))
    for _ in range(6):
        last = learner.update(_groups(trajs))
    for key in ("critic/value_loss", "critic/explained_variance", "critic/vf_clip_frac"):
        assert math.isfinite(last[key]), key
    assert last["critic/value_loss"] < 0.3 * first["critic/value_loss"]
    assert last["critic/explained_variance"] > first["critic/explained_variance"]


def load_like_critic() -> torch.nn.Module:
    """A Qwen2 value model of the test's tiny size (no folder needed)."""
    from transformers import Qwen2ForTokenClassification

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1)
    return Qwen2ForTokenClassification(cfg)


def test_gae_without_a_critic_fails_at_construction():
    with pytest.raises(ValueError, match="critic"):
        _learner(advantage="gae")


# -- KL to a reference, entropy bonus --------------------------------------------------------------

def test_kl_loss_pulls_the_policy_toward_the_reference_when_rewards_carry_no_signal():
    reference = ReferencePolicy(_model(seed=7), pad_token_id=PAD)
    learner = _learner(kl_mode="loss", kl_coef=1.0, kl_estimator="k3", reference=reference)
    kls = []
    for _ in range(6):
        # the same tokens each step, behaviour logprobs from the current policy; equal rewards: zero
        # advantages, so only the KL term moves the policy
        trajs = [msgspec.structs.replace(t, reward=1.0) for t in _samples(learner, seed=0)]
        kls.append(learner.update(_groups(trajs))["kl/ref_mean"])
    assert kls[0] > 1e-3
    assert kls[-1] < 0.5 * kls[0]


def test_kl_reward_penalty_gives_advantages_even_when_rewards_are_all_equal():
    reference = ReferencePolicy(_model(seed=7), pad_token_id=PAD)
    on = _learner(advantage="reinforce_pp", kl_mode="reward", kl_coef=0.1, kl_estimator="k1", reference=reference)
    off = _learner(advantage="reinforce_pp")
    trajs = [msgspec.structs.replace(t, reward=1.0) for t in _samples(on)]
    assert on.prepare(trajs).advantages.abs().sum() > 0
    assert off.prepare(trajs).advantages.abs().sum() == 0


def test_reference_logprobs_filled_by_the_scorer_are_used_without_a_reference_model():
    learner = _learner(kl_mode="loss")
    trajs = _samples(learner)
    with pytest.raises(ValueError, match="no reference logprobs"):
        learner.prepare(trajs)
    same = [msgspec.structs.replace(t, ref_logprobs=list(t.behavior_logprobs)) for t in trajs]
    assert learner.prepare(same).metrics["kl/ref_mean"] == pytest.approx(0.0, abs=1e-7)
    shifted = [msgspec.structs.replace(t, ref_logprobs=[x - 0.5 for x in t.behavior_logprobs]) for t in trajs]
    # k3 with log(ref/pi) = -0.5 on every token
    assert learner.prepare(shifted).metrics["kl/ref_mean"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5)


def test_entropy_bonus_raises_the_entropy_when_rewards_carry_no_signal():
    learner = _learner(entropy_coef=1.0)
    ents = []
    for step in range(3):
        trajs = [msgspec.structs.replace(t, reward=1.0) for t in _samples(learner, seed=step)]
        ents.append(learner.update(_groups(trajs))["trainer/entropy"])
    assert ents[-1] > ents[0]


# -- off-policy: decoupled PPO, corrections --------------------------------------------------------

def test_decoupled_ppo_takes_the_ratio_against_the_proximal_policy_not_the_behaviour():
    plain = _learner()
    decoupled = _learner(decoupled=True)
    trajs = _samples(plain, noise=0.5)
    m_plain = plain.update(_groups(trajs))
    m_dec = decoupled.update(_groups(trajs))
    # one mini-batch: the first (only) pass sees the policy the proximal logprobs were computed under
    assert m_dec["trainer/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m_dec["trainer/clip_frac"] == 0.0
    assert abs(m_plain["trainer/ratio_mean"] - 1.0) > 1e-2
    # the ratio distribution proximal / behaviour is logged either way
    assert m_dec["offpolicy/is_ratio_max"] > 1.2 and m_dec["offpolicy/is_ratio_min"] < 0.8


def test_token_mask_drops_exactly_the_tokens_whose_ratio_leaves_the_band():
    learner = _learner(decoupled=True, correction="token_mask", correction_low=0.8, correction_high=1.25)
    trajs = _samples(learner, noise=0.5)
    ratios = torch.cat([torch.tensor(learner.teacher_forced_logprobs(t.prompt_ids, t.response_ids, 1.0))
                        - torch.tensor(t.behavior_logprobs) for t in trajs]).exp()
    outside = float(((ratios < 0.8) | (ratios > 1.25)).float().mean())
    assert 0 < outside < 1
    data = learner.prepare(trajs)
    assert data.metrics["offpolicy/share_masked"] == pytest.approx(outside, abs=1e-6)
    assert int(data.rows["keep"].sum()) == round((1 - outside) * len(ratios))


def test_token_tis_caps_the_weights_and_reports_the_share_clipped():
    learner = _learner(decoupled=True, correction="token_tis", correction_cap=1.1)
    data = learner.prepare(_samples(learner, noise=0.5))
    assert float(data.rows["weights"].max()) <= 1.1 + 1e-6
    assert 0 < data.metrics["offpolicy/share_clipped"] < 1


# -- Safe-RLHF, ReMax, DAPO shaping ----------------------------------------------------------------

def test_safe_rlhf_combines_cost_advantages_and_moves_the_multiplier_by_the_measured_cost():
    lagrange = LagrangeMultiplier(init=0.5, lr=0.2, threshold=0.25)
    learner = _learner(safe_rlhf=True, lagrange=lagrange)
    trajs = _samples(learner)
    costed = [msgspec.structs.replace(t, cost=float(i < 4)) for i, t in enumerate(trajs)]  # mean cost 0.5
    metrics = learner.update(_groups(costed))
    assert metrics["safety/lambda"] == 0.5 and metrics["safety/cost_mean"] == 0.5
    assert metrics["safety/cost_threshold"] == 0.25
    assert metrics["safety/lambda_next"] == pytest.approx(0.5 + 0.2 * (0.5 - 0.25))
    assert lagrange.value == pytest.approx(0.55)
    # the cost changes the advantages: group 0 is all cost 1, group 1 all cost 0 -> only within-group
    # differences matter for grpo, so make costs differ within a group instead
    mixed = [msgspec.structs.replace(t, cost=float(i % 4 < 2)) for i, t in enumerate(trajs)]
    plain = _learner().prepare(trajs).advantages
    assert not torch.allclose(learner.prepare(mixed).advantages, plain)


def test_remax_needs_the_greedy_baseline_and_logs_it():
    learner = _learner(advantage="remax")
    trajs = _samples(learner)
    with pytest.raises(ValueError, match="greedy baseline"):
        learner.prepare(trajs)
    based = [msgspec.structs.replace(t, baseline_reward=0.25) for t in trajs]
    data = learner.prepare(based)
    assert data.metrics["remax/baseline_reward"] == 0.25
    first = data.advantages[0, : len(trajs[0].response_ids)]
    assert torch.allclose(first, torch.full_like(first, trajs[0].reward - 0.25))


def test_overlong_shaping_penalises_long_responses_before_the_estimator():
    learner = _learner(advantage="drgrpo", overlong_buffer=2, overlong_penalty=1.0, max_new_tokens=4)
    trajs = _samples(learner, group=8)  # response lengths 1, 2, 3, 4, ...
    data = learner.prepare(trajs)
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
    want = torch.tensor([t.reward for t in trajs]) - (lengths - 2).clamp(min=0) / 2
    assert torch.allclose(data.rewards, want)
    assert data.metrics["dapo/overlong_share"] == pytest.approx(float((lengths > 2).float().mean()))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_loss_aggregation_trains(agg):
    learner = _learner(loss_agg=agg, max_new_tokens=4, trainer={"mini_batches": 2, "micro_batch_size": 3})
    metrics = learner.update(_groups(_samples(learner)))
    assert math.isfinite(metrics["trainer/loss"]) and metrics["trainer/grad_norm"] > 0


def test_sum_norm_aggregation_without_a_length_fails_at_construction():
    with pytest.raises(ValueError, match="max_new_tokens"):
        _learner(loss_agg="seq-mean-token-sum-norm")


# -- Scorer: cost, ReMax baseline, reference logprobs ----------------------------------------------

class _Buffer:
    def __init__(self) -> None:
        self.accepted: list[Group] = []
        self.released: dict[str, list[int]] = {"filtered": [], "failed": []}

    async def accept_groups(self, groups):
        self.accepted += groups

    async def release_groups(self, ids, reason, detail=""):
        self.released[reason] += ids


def _scored(text: str, gid: int, j: int, baseline: str = "") -> Trajectory:
    ids = [ord(c) for c in text]
    return Trajectory(seq_id=gid * 2 + j, group_id=gid, group_size=2, prompt_ids=[1], response_ids=ids,
                      loss_mask=[True] * len(ids), behavior_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                      min_version=0, max_version=0, finish_reason="stop", prompt_text="p",
                      row_json=json.dumps({"answer": "a"}).encode(),
                      baseline_response_ids=[ord(c) for c in baseline])


def _decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_scorer_fills_costs_and_fails_the_group_whose_cost_function_raises():
    def cost(prompt, completion, **fields):
        if completion == "boom":
            raise RuntimeError("cost bug")
        return float(len(completion) > 1)

    buffer = _Buffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(lambda p, c, **f: float(c == "a"), cost),
                    decode=_decode)
    asyncio.run(scorer.score_batch([_scored("a", 0, 0), _scored("ab", 0, 1), _scored("a", 1, 0),
                                    _scored("boom", 1, 1)]))
    assert [g.group_id for g in buffer.accepted] == [0] and buffer.released["failed"] == [1]
    assert [t.cost for t in buffer.accepted[0].trajectories] == [0.0, 1.0]
    assert scorer.counts["cost_errors"] == 1


def test_scorer_costs_episodes_that_bring_their_own_reward():
    # an episode submitted to asyncrl.Runtime carries env_reward; Safe-RLHF still needs its cost
    buffer = _Buffer()
    rewards = ThreadRewards(lambda p, c, **f: 99.0, lambda p, c, **f: float(len(c)))
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=rewards, decode=_decode)
    trajs = [msgspec.structs.replace(_scored(text, 0, j), env_reward=0.5 * j) for j, text in enumerate(["a", "abc"])]
    asyncio.run(scorer.score_batch(trajs))
    assert [(t.reward, t.cost) for t in buffer.accepted[0].trajectories] == [(0.0, 1.0), (0.5, 3.0)]
    plain = _Buffer()  # without a cost function the env reward is taken as it is, nothing decoded
    plain_scorer = Scorer(scorer_id=0, buffer=plain, rewards=ThreadRewards(lambda p, c, **f: 99.0), decode=None)
    asyncio.run(plain_scorer.score_batch([msgspec.structs.replace(_scored("a", 1, j), env_reward=1.0)
                                          for j in range(2)]))
    assert [t.reward for t in plain.accepted[0].trajectories] == [1.0, 1.0]


def test_scorer_scores_the_greedy_baseline_once_per_group_into_every_member():
    calls = []

    def reward(prompt, completion, **fields):
        calls.append(completion)
        return float(completion == "a")

    buffer = _Buffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(reward), decode=_decode)
    asyncio.run(scorer.score_batch([_scored("b", 0, 0, baseline="a"), _scored("a", 0, 1, baseline="a")]))
    assert [t.baseline_reward for t in buffer.accepted[0].trajectories] == [1.0, 1.0]
    assert calls.count("a") == 2 and scorer.counts["baselines_scored"] == 1  # one sample + the baseline


def test_scorer_fills_reference_logprobs_equal_to_a_teacher_forced_forward():
    model = _model(3)
    reference = ReferencePolicy(model, pad_token_id=PAD, micro_batch_size=1)
    learner = Learner(_model(3), algorithm=AlgorithmConfig(), trainer=TrainerConfig(), pad_token_id=PAD)
    buffer = _Buffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(lambda p, c, **f: float(len(c))),
                    decode=lambda ids: "x" * len(ids), reference=reference)
    trajs = [_traj(0, 0, [3, 4], [5, 6, 7], [0.0] * 3), _traj(1, 0, [3], [9], [0.0])]
    trajs = [msgspec.structs.replace(t, group_size=2) for t in trajs]
    asyncio.run(scorer.score_batch(trajs))
    for t in buffer.accepted[0].trajectories:
        want = learner.teacher_forced_logprobs(t.prompt_ids, t.response_ids, 1.0)
        assert t.ref_logprobs == pytest.approx(want, abs=1e-5)


# -- dynamic sampling refills the step -------------------------------------------------------------

def test_dynamic_sampling_drops_zero_variance_groups_and_the_step_is_refilled_to_prompts_per_step():
    from buffers.replay import ReplayBuffer

    async def main() -> list[Group]:
        buffer = ReplayBuffer(prompts_per_step=2, group_size=2, max_staleness=0, rollout_capacity=64, train_capacity=8)
        scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(lambda p, c, **f: float(c == "a")),
                        decode=_decode, filter_zero_variance=True)
        ids = await buffer.admit(2, 0, timeout=1)
        assert ids == [0, 1]
        # group 0 all-correct (zero variance: dropped), group 1 mixed
        await scorer.score_batch([_scored("a", 0, 0), _scored("a", 0, 1), _scored("a", 1, 0), _scored("b", 1, 1)])
        refill = await buffer.admit(2, 0, timeout=1)  # the dropped group's slot came back
        assert refill == [2]
        await scorer.score_batch([_scored("b", 2, 0), _scored("a", 2, 1)])
        return await buffer.take_step(0, timeout=1)

    groups = asyncio.run(main())
    assert [g.group_id for g in groups] == [1, 2]
    assert all(len({t.reward for t in g.trajectories}) > 1 for g in groups)


# -- config errors ---------------------------------------------------------------------------------

def _config_errors(tiny_model_dir, **sections) -> list[str]:
    raw = {"model": {"path": str(tiny_model_dir)}, "data": {"source": "asyncrl.tasks.digits:first_digit"},
           "reward": {"fn": "prefix_match"}, **sections}
    try:
        config_from_dict(raw)
    except ConfigError as exc:
        return exc.errors
    return []


@pytest.mark.parametrize("sections, path", [
    ({"algorithm": {"safe_rlhf": True}}, "algorithm.safe_rlhf"),
    ({"algorithm": {"correction": "token_tis"}}, "algorithm.correction"),
    ({"algorithm": {"dual_clip": 0.5}}, "algorithm.dual_clip"),
    ({"algorithm": {"advantage": "gaee"}}, "algorithm.advantage"),
    ({"algorithm": {"kl_estimator": "k4"}}, "algorithm.kl_estimator"),
    ({"algorithm": {"overlong_buffer": 64}}, "algorithm.overlong_buffer"),
    ({"algorithm": {"safe_rlhf": True, "advantage": "gae"},
      "reward": {"fn": "prefix_match", "cost_fn": "longer_than_answer"}}, "algorithm.safe_rlhf"),
    ({"reward": {"fn": "prefix_match", "cost_fn": "nope"}}, "reward.cost_fn"),
    ({"algorithm": {"advantage": "gae"}, "critic": {"path": "/nonexistent"}}, "critic.path"),
    ({"reference": {"where": "gpu"}}, "reference.where"),
])
def test_impossible_algorithm_configs_give_one_line_naming_the_toml_path(tiny_model_dir, sections, path):
    errors = _config_errors(tiny_model_dir, **sections)
    assert len(errors) == 1, errors
    assert errors[0].startswith(path + ":") and "\n" not in errors[0]


def test_every_example_config_validates():
    from pathlib import Path

    from asyncrl.config import load_config

    root = Path(__file__).resolve().parents[2] / "examples"
    names = ["ppo", "grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "remax", "safe_rlhf"]
    for name in names:
        cfg = load_config(root / name / "config.toml")
        assert cfg.run.output_dir == f"runs/{name}"


# -- Generator: ReMax greedy baseline --------------------------------------------------------------

def test_generator_attaches_the_greedy_completion_of_each_prompt_to_its_group():
    from asyncrl.data.prompts import Prompt
    from asyncrl.messages import SamplingParams
    from asyncrl.roles.generator import Generator
    from engines.torch_engine import TorchEngine

    class Sink:
        def __init__(self) -> None:
            self.rollouts: list[Trajectory] = []

        async def put_rollouts(self, trajs):
            self.rollouts += trajs

    engine = TorchEngine.from_model(_model(5), eos_token_ids=[2], max_prompt_len=16, seed=0)
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=4)
    rows = iter([{"prompt": "a"}, {"prompt": "b"}])
    sink = Sink()
    gen = Generator(generator_id=0, engine=engine, buffer=sink, prompt_row=lambda gid: next(rows),
                    encode=lambda row: Prompt([ord(row["prompt"]) % VOCAB, 4], row["prompt"]), sampling=sampling,
                    greedy_baseline=True)

    async def main():
        await gen._generate_groups([0, 1], 0)
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
        return await engine.generate([[ord("a") % VOCAB, 4], [ord("b") % VOCAB, 4]], greedy)

    want = asyncio.run(main())
    assert len(sink.rollouts) == 6
    for t in sink.rollouts:
        assert t.baseline_response_ids == want[t.group_id][0].response_ids
        assert t.temperature == 1.0  # the samples themselves are the trained, sampled ones
    assert want[0][0].response_ids  # a non-empty greedy completion


def test_a_failing_greedy_baseline_fails_its_group_once():
    def reward(prompt, completion, **fields):
        if completion == "boom":
            raise RuntimeError("reward bug on the baseline")
        return 1.0

    buffer = _Buffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(reward), decode=_decode)
    asyncio.run(scorer.score_batch([_scored("a", 0, 0, baseline="boom"), _scored("b", 0, 1, baseline="boom")]))
    assert buffer.released["failed"] == [0] and not buffer.accepted
    assert scorer.counts["baseline_errors"] == 1
