"""The `[model.lora]` table of the run's TOML schema: train LoRA adapters through `peft` instead of every weight
(asyncrl/training/lora.py); `asyncrl.config.schema` re-exports it."""

from __future__ import annotations

from typing import Annotated, Literal

from asyncrl.config.section import Section, _d


class LoraConfig(Section):
    """LoRA adapters on the policy's linear layers (docs/lora.md): only the adapters train; the generators receive
    the merged weights W + (alpha / rank)·B·A under the base model's names."""

    rank: Annotated[int, _d("LoRA rank r of each adapter (B: out x r, A: r x in), e.g. 8", ge=1)] = 8
    alpha: Annotated[float, _d("LoRA alpha: the adapter's update is scaled by alpha / rank", gt=0)] = 16.0
    dropout: Annotated[
        float,
        _d("dropout on each adapter's input during the gradient passes only (every logprob the loss compares with, "
           "and generation, run without it); 0 = off", ge=0, lt=1),
    ] = 0.0
    target_modules: Annotated[
        Literal["all-linear"] | list[str],
        _d("the linear layers that get adapters, by module name, e.g. ['q_proj', 'v_proj']; 'all-linear' = every "
           "linear layer of the decoder (not the LM head)"),
    ] = "all-linear"
