"""engines.routing: the routers of each MoE family are found, their choices recorded, and replayed exactly:
replaying a forward's own routing changes no bit; a forced routing is what the experts compute with, token by
token, with the router's own weights for those experts (so it trains), also when the backward recomputes the
forward (gradient checkpointing)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.schema import TinyModelConfig
from engines import hf
from engines.routing import ROUTING_DTYPE, Routing, moe_routers, stack_layers

torch.set_num_threads(1)

ARCHS = sorted(hf.MOE_ARCHS)


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf.build_tiny_model(path, TinyModelConfig(arch=request.param, hidden_size=32, num_layers=2, num_heads=4,
                                              num_kv_heads=2, intermediate_size=32, num_experts=4,
                                              experts_per_token=2, init_std=0.2))
    return path


IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _own_routing(model, routing: Routing) -> torch.Tensor:
    with torch.no_grad(), routing.recording() as rec:
        model(IDS)
    (forward,) = stack_layers(rec, len(routing.routers))
    return forward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replaying_a_forwards_own_routing_changes_no_bit(moe_dir, dtype):
    model = hf.load_model(moe_dir, dtype=dtype)
    with torch.no_grad():
        plain = model(IDS).logits
    routing = Routing(model)
    own = _own_routing(model, routing)
    assert own.dtype == ROUTING_DTYPE and own.shape == (IDS.numel(), 2, 2)
    with torch.no_grad(), routing.replaying(own):
        replayed = model(IDS).logits
    assert torch.equal(replayed, plain)
    routing.remove()
    assert all("forward" not in vars(r) for r in moe_routers(model))  # the class's forward again


def test_the_experts_compute_with_the_forced_routing_token_by_token_and_the_router_trains(moe_dir):
    model = hf.load_model(moe_dir).train()
    routing = Routing(model)
    own = _own_routing(model, routing)
    forced = (own + 1) % 4  # every token to other experts
    forced[3] = -1  # position 3 of the first row: no record, the router's own choice
    seen: list[torch.Tensor] = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for e in experts]
    with routing.replaying(forced), routing.recording() as rec:  # the routers' own choices in this forward
        loss = model(IDS).logits.logsumexp(-1).mean()
    for h in hooks:
        h.remove()
    (own_now,) = stack_layers(rec, 2)  # differ from `own` from layer 1 on: the forced layer 0 moved the states
    want = torch.where(forced[:, :, :1] < 0, own_now, forced)
    assert not torch.equal(want, forced) and torch.equal(want[3], own_now[3])
    for layer, indices in enumerate(seen):
        assert torch.equal(indices.to(ROUTING_DTYPE), want[:, layer])
    loss.backward()
    for router in routing.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_under_gradient_checkpointing_gives_the_gradients_of_the_plain_forward(moe_dir):
    grads = []
    for checkpointing in (False, True):
        model = hf.load_model(moe_dir).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        routing = Routing(model)
        forced = (_own_routing(model, routing) + 2) % 4
        with routing.replaying(forced):
            model(IDS).logits.logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bad_routing_and_a_dense_model_get_one_clear_error(moe_dir, tmp_path):
    model = hf.load_model(moe_dir)
    routing = Routing(model)
    with pytest.raises(ValueError, match=r"want \[tokens, 2, 2\]"):
        with routing.replaying(torch.zeros(12, 3, 2, dtype=ROUTING_DTYPE)):
            pass
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\) or -1"):
        with routing.replaying(torch.full((12, 2, 2), 4, dtype=ROUTING_DTYPE)):
            pass
    with pytest.raises(ValueError, match="5 recorded tokens for a forward of 12"):
        with torch.no_grad(), routing.replaying(torch.zeros(5, 2, 2, dtype=ROUTING_DTYPE)):
            model(IDS)
    assert routing.forced is None  # closed by the error
    hf.build_tiny_model(tmp_path, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=32))
    with pytest.raises(ValueError, match="no MoE router"):
        Routing(hf.load_model(tmp_path))
