"""The policy's learning-rate schedule (`trainer.lr_scheduler`, `trainer.warmup_steps`).

Place in the dataflow: the Learner builds one scheduler over its AdamW optimizer and steps it after every
optimizer step of a train step (`mini_batches x epochs` of them), skipped ones included, so that the schedule
always spans exactly `total_optimizer_steps` steps and a run's learning rate depends on its step count alone.
The step's metrics carry `trainer/lr`, the rate of its last optimizer step; the scheduler's state goes into
every resumable checkpoint (asyncrl/checkpoints/store.py `scheduler_state`), so a resumed run continues the schedule
where it stopped. The schedules are `transformers.get_scheduler`'s (LambdaLR over plain functions: their state
encodes with msgspec). The critic keeps its constant `critic.lr`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.config.schema import Config, TrainerConfig

if TYPE_CHECKING:  # the config checks import this module: torch only where a scheduler is built
    import torch


def optimizer_steps_per_train_step(trainer: TrainerConfig) -> int:
    return trainer.mini_batches * trainer.epochs


def total_optimizer_steps(trainer: TrainerConfig) -> int:
    """The run's optimizer steps: train steps x mini-batches x epochs (one optimizer step per mini-batch)."""
    return trainer.total_steps * optimizer_steps_per_train_step(trainer)


def build_scheduler(optimizer: torch.optim.Optimizer, trainer: TrainerConfig) -> Any:
    """`trainer.lr_scheduler` over `optimizer` (its lr is trainer.lr), warming up for `trainer.warmup_steps`
    train steps. Sets the optimizer's lr to the schedule's first value (0 at the start of a warmup)."""
    from transformers import get_scheduler

    warmup = trainer.warmup_steps * optimizer_steps_per_train_step(trainer)
    return get_scheduler(trainer.lr_scheduler, optimizer, num_warmup_steps=warmup,
                         num_training_steps=total_optimizer_steps(trainer))


def check_config(cfg: Config) -> list[str]:
    """The schedule's check in `load_config` (asyncrl/config/checks.py): `check_schedule` of [trainer]."""
    return check_schedule(cfg.trainer)


def check_schedule(trainer: TrainerConfig) -> list[str]:
    """Config errors of the schedule fields (asyncrl/config/loader.py runs this with the cross-field checks)."""
    if trainer.warmup_steps == 0:
        return []
    if trainer.lr_scheduler == "constant":
        return [f"trainer.warmup_steps: {trainer.warmup_steps} with trainer.lr_scheduler = 'constant', which has no "
                f"warmup — use lr_scheduler = 'constant_with_warmup' (or 'linear' / 'cosine'), or warmup_steps = 0"]
    if trainer.warmup_steps > trainer.total_steps:
        return [f"trainer.warmup_steps: {trainer.warmup_steps} is longer than the run (trainer.total_steps = "
                f"{trainer.total_steps}) — use at most {trainer.total_steps}, e.g. a tenth of it"]
    return []
