"""The whole TOML schema of a run, as msgspec Structs (one section per Struct).

Every field carries a description: the loader (`asyncrl/config/loader.py`) quotes it in error messages so that
each problem reads as "<toml.path>: <what is wrong> — <what the field is / how to fix>".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from asyncrl.config.algo import AlgorithmConfig, RewardConfig, RewardFunctionConfig  # noqa: F401 (re-exported)
from asyncrl.config.lora import LoraConfig  # noqa: F401 (re-exported)
from asyncrl.config.section import Section, _d  # noqa: F401 (re-exported)
from asyncrl.config.trackers import (  # noqa: F401 (re-exported)
    MlflowConfig,
    MlflowSwitch,
    TrackioConfig,
    TrackioSwitch,
    WandbConfig,
    WandbSwitch,
)


class TinyModelConfig(Section):
    """A tiny random-initialised model written to `model.path` when that folder does not exist."""

    arch: Annotated[
        Literal["qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"],
        _d("architecture of the tiny model: dense (qwen2, llama) or a mixture of experts (qwen3_moe, qwen2_moe with "
           "its shared expert, mixtral, olmoe)"),
    ] = "qwen2"
    hidden_size: Annotated[int, _d("hidden size, e.g. 64", ge=8)] = 64
    num_layers: Annotated[int, _d("number of transformer layers", ge=1)] = 2
    num_heads: Annotated[int, _d("attention heads; must divide hidden_size", ge=1)] = 4
    num_kv_heads: Annotated[int, _d("key/value heads; must divide num_heads", ge=1)] = 2
    intermediate_size: Annotated[int, _d("MLP width (each expert's, in a mixture of experts)", ge=8)] = 128
    num_experts: Annotated[int, _d("experts per MoE layer (the MoE architectures only)", ge=2)] = 4
    experts_per_token: Annotated[int, _d("experts each token is routed to, top-k (the MoE architectures only)",
                                         ge=1)] = 2
    vocab: Annotated[
        str,
        _d("characters of the tiny char-level tokenizer (besides special tokens)", min_length=1),
    ] = "0123456789+-*=?, abcdefghijklmnopqrstuvwxyz"
    max_positions: Annotated[int, _d("max_position_embeddings", ge=8)] = 128
    seed: Annotated[int, _d("seed of the random initialisation", ge=0)] = 0
    init_std: Annotated[
        float,
        _d("std of the random weight init (initializer_range); larger gives peakier logits", gt=0),
    ] = 0.02


class ModelConfig(Section):
    """The policy model: a local Hugging Face folder (or a tiny random one built there), and its dtype."""

    path: Annotated[str, _d("local Hugging Face model folder (config.json + safetensors + tokenizer)", min_length=1)]
    build_tiny: TinyModelConfig | None = None  # if set and `path` is missing, write a tiny model there
    lora: LoraConfig | None = None  # if set, train LoRA adapters instead of every weight (docs/lora.md)
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        _d("parameter dtype of the trainer's models and the reference (with trainer.mixed_precision = 'bf16' the "
           "trained models are float32 and the reference bfloat16 whatever this says) and of the engines unless "
           "rollout.dtype is set"),
    ] = "float32"
    gradient_checkpointing: Annotated[
        bool,
        _d("recompute each layer's activations in the backward pass instead of keeping them: less memory for "
           "long sequences, about a third more compute per train step (trainer, critic; HF models that support "
           "it). Generation on the trainer's module (evaluation) is unaffected"),
    ] = False


class DataConfig(Section):
    """Where prompt rows come from and how a row becomes the prompt's tokens (docs/data.md)."""

    path: Annotated[
        str,
        _d("dataset file (.jsonl, .json, .parquet; .csv, .arrow with the datasets extra) or folder (save_to_disk, or "
           "data files named by split; datasets extra); or leave empty and set `source`"),
    ] = ""
    source: Annotated[
        str,
        _d("'pkg.module:function' returning an iterable of rows, called as fn(split=..., seed=...)"),
    ] = ""
    eval_path: Annotated[
        str,
        _d("held-out rows for evaluation, a file or folder like `path` (default: `eval_split` of `path`, or "
           "`source` with split='eval')"),
    ] = ""
    split: Annotated[
        str,
        _d("the split of a `path` folder that holds several (a save_to_disk DatasetDict, or files named by split) "
           "to train on; a single file is one split", min_length=1),
    ] = "train"
    eval_split: Annotated[
        str,
        _d("the split held out for evaluation, read from `eval_path` if set, else from the `path` folder, e.g. "
           "'test'; empty: `eval_path` whole (or its only split)"),
    ] = ""
    prompt_key: Annotated[
        str,
        _d("row field holding the prompt: a string, or a list of chat messages [{role, content}]; a dotted path "
           "reaches a nested field (e.g. 'extra_info.question')", min_length=1),
    ] = "prompt"
    prompt_template: Annotated[
        str,
        _d("if set, the prompt is this text formatted with the row's fields, e.g. '{question}\\nAnswer with a "
           "number.' (dotted paths: '{extra_info.question}'), instead of the `prompt_key` field"),
    ] = ""
    system_prompt: Annotated[
        str,
        _d("if set, a system message put before the prompt's messages (rows whose messages start with a system "
           "message keep theirs)"),
    ] = ""
    chat_template: Annotated[
        Literal["auto", "none"],
        _d("auto: render the prompt's messages with the tokenizer's chat template and its generation prompt when "
           "it has one — except a string prompt that already holds the template's own special tokens (e.g. "
           "<|im_start|>, <|start_header_id|>: rendered upstream by verl/OpenRLHF), which is used as it is, "
           "templated once, without system_prompt (logged once); none, or a tokenizer without one: the "
           "messages' contents joined by newlines"),
    ] = "auto"
    chat_template_kwargs: Annotated[
        dict[str, Any],
        _d("extra keyword arguments for the chat template, e.g. {enable_thinking = false}"),
    ] = {}
    max_prompt_len: Annotated[int, _d("longest prompt in tokens; longer ones are handled by `overlong`", ge=1)] = 256
    overlong: Annotated[
        Literal["error", "filter", "truncate_left"],
        _d("prompts longer than max_prompt_len: error: stop at load naming the rows; filter: leave those rows "
           "out (counted, data/filtered_overlong); truncate_left: keep their last tokens (counted, "
           "data/truncated_prompts)"),
    ] = "error"
    shuffle: Annotated[bool, _d("reshuffle the prompt order every epoch (seeded by run.seed)")] = True


class RolloutConfig(Section):
    """How the generators sample: the engine, how many generators and groups in flight, sampling settings."""

    engine: Annotated[str, _d("rollout engine name: 'torch' (native), 'vllm' or 'sglang'", min_length=1)] = "torch"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _d("parameter dtype of the generators' engines (each engine runs all three, the torch engine on CPU too); "
           "auto = model.dtype. The weight sync converts the trainer's weights to it once, bucket by bucket. "
           "Evaluation runs on the trainer's own module, in the trainer's dtype"),
    ] = "auto"
    num_generators: Annotated[int, _d("generator actors", ge=1)] = 1
    concurrency: Annotated[int, _d("groups a generator keeps in flight (batched together)", ge=1)] = 16
    group_size: Annotated[int, _d("samples per prompt (GRPO group)", ge=1)] = 8
    seed_groups: Annotated[
        bool,
        _d("sample each group from random streams seeded by (run.seed, group id): its tokens then do not "
           "depend on the batch or the generator, so runs repeat and a resume is exact (single-turn "
           "rollouts; env episodes keep the engine's stream)"),
    ] = False
    temperature: Annotated[float, _d("sampling temperature for training rollouts", gt=0)] = 1.0
    top_p: Annotated[float, _d("nucleus sampling; keep 1.0 for training", gt=0, le=1)] = 1.0
    top_k: Annotated[int, _d("top-k sampling; -1 = off (keep -1 for training)", ge=-1)] = -1
    max_new_tokens: Annotated[int, _d("response length limit in tokens", ge=1)] = 64
    weight_update: Annotated[
        Literal["in_flight", "between_requests"],
        _d("in_flight: new weights land at the next decode step, sequences carry on across versions; "
           "between_requests: finish the groups in flight first"),
    ] = "in_flight"
    kv_on_update: Annotated[
        Literal["recompute", "keep"],
        _d("after an in-flight swap, recompute the KV cache of unfinished sequences (exact) or keep it (a mixture of "
           "versions, recorded on the trajectory)"),
    ] = "recompute"
    lm_head_fp32: Annotated[
        bool,
        _d("on bfloat16 / float16 engine weights (rollout.dtype), the LM head's product in float32 from a float32 "
           "copy of the head: bf16 logits are rounded by up to 1/16 at a real model's scale, so the sampled "
           "distribution is not the trainer's; with trainer.lm_head_fp32 both compute it alike. The native engine's "
           "(vLLM and SGLang compute logits in their own dtype); costs the head's float32 copy (113 MB for "
           "SmolLM2-135M) and its product at float32 speed"),
    ] = True
    stop_token_ids: Annotated[list[int], _d("token ids that end a response besides the model's eos, e.g. [2, 3]")] = []
    stop: Annotated[
        list[str],
        _d("strings that end a response once the decoded text contains them, e.g. [\"\\n\"]"),
    ] = []
    ignore_eos: Annotated[
        bool,
        _d("the model's eos does not end a response: every response runs to max_new_tokens unless a stop token or "
           "string ends it (fixed-length rollouts for throughput experiments)"),
    ] = False


class CriticConfig(Section):
    """The value model of PPO (`algorithm.advantage = "gae"`): the policy's backbone with a fresh scalar head."""

    path: Annotated[
        str,
        _d("HF model folder the critic starts from (its LM head replaced by a fresh value head); empty = model.path"),
    ] = ""
    lr: Annotated[float, _d("critic AdamW learning rate", gt=0, le=1)] = 1e-4
    value_clip: Annotated[
        float,
        _d("clip of the value update around the values at the start of the step (PPO clipped value loss); "
           "0 = unclipped", ge=0),
    ] = 0.2
    grad_clip: Annotated[float, _d("critic max gradient norm; 0 disables clipping", ge=0)] = 1.0
    weight_decay: Annotated[float, _d("critic AdamW weight decay", ge=0)] = 0.0


class ReferenceConfig(Section):
    """The frozen reference policy of the KL term (`algorithm.kl_mode` reward or loss)."""

    path: Annotated[str, _d("HF model folder of the reference policy; empty = model.path (the initial policy)")] = ""
    where: Annotated[
        Literal["scorer", "trainer"],
        _d("where its logprobs are computed: 'scorer' (off the trainer's critical path, "
           "filled into each trajectory) or 'trainer' (a forward pass at the start of each step)"),
    ] = "scorer"


class TrainerConfig(Section):
    """The train steps: batch sizes, optimizer, evaluation, precision and trainer ranks."""

    total_steps: Annotated[int, _d("train steps (policy versions) of the run", ge=1)] = 100
    prompts_per_step: Annotated[int, _d("groups consumed per train step", ge=1)] = 16
    mini_batches: Annotated[
        int,
        _d("optimizer steps per epoch over the step's samples; must divide prompts_per_step*group_size", ge=1),
    ] = 1
    micro_batch_size: Annotated[int, _d("samples per forward/backward (gradient accumulation)", ge=1)] = 64
    max_tokens_per_micro_batch: Annotated[
        int,
        _d("a token budget per forward/backward instead of micro_batch_size (0: off): samples sorted by length "
           "share a micro-batch while samples x longest (prompt + response) stays within it, so padding stays "
           "small when lengths spread; a longer sample runs alone (verl's dynamic batch size)", ge=0),
    ] = 0
    pack_sequences: Annotated[
        bool,
        _d("the policy's forwards (gradient passes, proximal logprobs) run each micro-batch's samples packed into "
           "one row without "
           "padding (position ids per sample; HF's attention keeps them apart): pays with flash-attention's varlen "
           "kernels, not with a dense mask on a CPU (training/logprobs.py)"),
    ] = False
    share_prompts: Annotated[
        bool,
        _d("the policy's forwards (gradient passes, proximal logprobs) compute each prompt once for all of a "
           "micro-batch's samples of it: one row of the prompt then its replies, each reply attending to the prompt "
           "and itself (a custom attention mask, sdpa or eager attention); the same numbers as the padded forward, "
           "~group_size x fewer prompt tokens (training/sharing.py)"),
    ] = False
    logprob_chunk_tokens: Annotated[
        int,
        _d("response tokens per chunk of the LM head fused with the log-softmax (0: the whole head at once): the "
           "trainer's logprobs and entropy never hold more than this many rows of full-vocabulary logits, and the "
           "backward recomputes each chunk's (training/logprobs.py)", ge=0),
    ] = 0
    lm_head_fp32: Annotated[
        bool,
        _d("under mixed_precision = 'bf16', the output layer's product (hidden states x LM head) in float32: "
           "bfloat16 logits are rounded by up to 1/16 at magnitudes 16-32, ~0.03 nats off each token's logprob, "
           "and that rounding biases the policy gradient (TRL's chunked logprob kernel keeps this product in "
           "float32 for the same reason); costs the head's share of the step at float32 speed (training/logprobs.py)"),
    ] = True
    router_aux_loss_coef: Annotated[
        float,
        _d("a mixture-of-experts policy's load-balancing loss, times this coefficient, added to the policy loss "
           "(0: off): the model family's own Switch-Transformer loss (transformers' load_balancing_loss_func, with "
           "the model's experts and top-k) over each micro-batch's tokens, weighted by its share of the step's "
           "sequences; the model's config.json holds the coefficient it was trained with", ge=0),
    ] = 0.0
    epochs: Annotated[int, _d("passes over each step's samples", ge=1)] = 1
    lr: Annotated[float, _d("AdamW learning rate, e.g. 1e-4", gt=0, le=1)] = 1e-4
    lr_scheduler: Annotated[
        Literal["constant", "constant_with_warmup", "linear", "cosine"],
        _d("the policy's learning-rate schedule over the run's optimizer steps (total_steps x mini_batches x "
           "epochs), transformers.get_scheduler's: linear and cosine decay to 0 after the warmup"),
    ] = "constant"
    warmup_steps: Annotated[
        int,
        _d("train steps over which the learning rate rises linearly from 0 to trainer.lr (constant_with_warmup, "
           "linear, cosine)", ge=0),
    ] = 0
    weight_decay: Annotated[float, _d("AdamW weight decay", ge=0)] = 0.0
    betas: Annotated[
        list[float],
        _d("AdamW betas [b1, b2], each in [0, 1)", min_length=2, max_length=2),
    ] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    grad_clip: Annotated[float, _d("max gradient norm; 0 disables clipping", ge=0)] = 1.0
    max_skipped_steps: Annotated[
        int,
        _d("consecutive train steps whose every optimizer step was skipped for a non-finite gradient norm "
           "before the run stops with an error; 0 = never stop", ge=0),
    ] = 3
    eval_every: Annotated[int, _d("held-out evaluation every N steps; 0 disables", ge=0)] = 10
    eval_prompts: Annotated[int, _d("number of held-out prompts per evaluation", ge=1)] = 64
    mixed_precision: Annotated[
        Literal["no", "bf16"],
        _d("bf16: float32 master weights and optimizer state, forward and backward under bfloat16 autocast "
           "(policy and critic; the frozen reference in bfloat16 under the same autocast); no: everything in "
           "model.dtype. Any model.dtype goes with bf16 (float16 included): it then sets only the engines' dtype "
           "when rollout.dtype = 'auto'. Needs bfloat16 on the trainer's device (any CPU; a GPU of the Ampere "
           "generation or newer)"),
    ] = "no"
    compile: Annotated[
        bool,
        _d("train through torch.compile'd forwards (the policy's and the critic's gradient passes; dynamic shapes, "
           "the same parameters and names): the first update compiles, which takes seconds to minutes, after which "
           "a step of a small model is quicker (per-op overhead fused away). Pays on runs of many steps "
           "(benchmarks/README.md, train_step.py); needs a C++ compiler on a CPU trainer"),
    ] = False
    num_ranks: Annotated[
        int,
        _d("trainer processes (Ray actors) training each step together, each on its 1/num_ranks of every "
           "mini-batch; must divide every mini-batch (prompts_per_step*group_size/mini_batches). Ray only", ge=1),
    ] = 1
    parallel: Annotated[
        Literal["ddp", "fsdp2"],
        _d("with num_ranks > 1: ddp (a full replica per rank) or fsdp2 (parameters, gradients and optimizer state "
           "sharded over the ranks; each rank writes its shards of a checkpoint, and rank 0 the HF export and the "
           "evaluation on the gathered weights)"),
    ] = "ddp"


class BufferConfig(Section):
    """Capacities of the replay buffer's rollout queue and train store (the bounded queues between roles)."""

    rollout_capacity: Annotated[
        int,
        _d("trajectories the rollout queue holds (it queues and hands out whole groups); >= one step's samples",
           ge=1),
    ] = 1024
    train_capacity: Annotated[int, _d("groups the train store holds; >= prompts_per_step", ge=1)] = 256


class WeightSyncConfig(Section):
    """How the trainer's new weights reach the generators after each step."""

    backend: Annotated[
        Literal["auto", "gloo", "nccl", "ipc"],
        _d("how weights reach the generators: gloo (CPU broadcast), nccl (GPU broadcast), ipc (colocated roles "
           "on one device: shared memory, CUDA IPC on a GPU); auto follows the roles' devices and placement"),
    ] = "auto"
    bucket_mb: Annotated[
        float,
        _d("size of one broadcast bucket in MiB: the trainer packs the next bucket while one is on the wire, in two "
           "buffers of this size (fewer, larger buckets: less per-broadcast overhead)", gt=0),
    ] = 256.0
    timeout_s: Annotated[float, _d("timeout of every collective call", gt=0)] = 120.0


class StalenessConfig(Section):
    """How far behind the trainer a trajectory's policy version may be (bounded asynchrony)."""

    max_staleness: Annotated[
        int,
        _d("k: trainer version minus a trajectory's min_version never exceeds this; 0 = on-policy", ge=0),
    ] = 1


class AffinityConfig(Section):
    """Linux CPU ids each role's process may run on (`sched_setaffinity`); empty = not pinned. Used to give
    the critical-path role a core of its own on a small machine, e.g. trainer = [1] and everything else
    [0] on two cores. Ray deployment only (in process, every role shares one process), local clusters for
    `controller`."""

    trainer: Annotated[list[Annotated[int, Meta(ge=0)]], _d("CPUs of the trainer actor")] = []
    generator: Annotated[list[Annotated[int, Meta(ge=0)]], _d("CPUs of every generator actor")] = []
    scorer: Annotated[list[Annotated[int, Meta(ge=0)]], _d("CPUs of every scorer actor")] = []
    buffer: Annotated[list[Annotated[int, Meta(ge=0)]], _d("CPUs of the replay buffer actor")] = []
    controller: Annotated[
        list[Annotated[int, Meta(ge=0)]],
        _d("CPUs of the driver process (the Controller) and of the local Ray cluster it starts"),
    ] = []


_Resources = dict[str, Annotated[float, Meta(gt=0)]]  # Ray resource name -> amount each actor asks for


class ResourcesConfig(Section):
    """Custom Ray resources each actor of a role asks for, e.g. `trainer = {gpu_node = 1}`: the role runs only on
    nodes that offer them (`ray start --resources '{"gpu_node": 1}'`), which pins roles to nodes or node types."""

    trainer: Annotated[
        _Resources,
        _d("custom Ray resources of the trainer actor (each rank), e.g. {gpu_node = 1}"),
    ] = {}
    generator: Annotated[
        _Resources,
        _d("custom Ray resources of every generator actor, e.g. {gpu_node = 1}"),
    ] = {}
    scorer: Annotated[
        _Resources,
        _d("custom Ray resources of every scorer actor, e.g. {gpu_node = 1}"),
    ] = {}
    buffer: Annotated[
        _Resources,
        _d("custom Ray resources of the replay buffer actor, e.g. {gpu_node = 1}"),
    ] = {}


class ClusterConfig(Section):
    """The Ray cluster and what each role asks of it: CPUs, GPUs, placement, affinity, custom resources."""

    address: Annotated[str, _d("existing Ray cluster address; empty = start a local one")] = ""
    num_cpus: Annotated[float, _d("logical CPUs of the local Ray cluster", gt=0)] = 2.0
    object_store_mb: Annotated[int, _d("object store size of the local cluster in MiB", ge=64)] = 256
    dashboard: Annotated[bool, _d("start the Ray dashboard with the local cluster")] = False
    generator_cpus: Annotated[float, _d("logical CPUs each generator actor asks for", ge=0)] = 0.5
    scorer_cpus: Annotated[
        float,
        _d("logical CPUs each scorer actor asks for (scorer_placement = 'actor')", ge=0),
    ] = 0.25
    scorer_placement: Annotated[
        Literal["auto", "actor", "buffer"],
        _d("actor: each scorer is its own actor (process); buffer: the scorers run inside the replay buffer actor's "
           "process and call the buffer without actor calls (light rule rewards: one process and two actor calls per "
           "batch fewer; reward functions still run on worker threads, or worker processes with "
           "reward.isolation = 'process'); auto: buffer for a light reward (no reward.model, no scorer GPU, "
           "resources or affinity, one scorer or reward.isolation = 'process'), else actor"),
    ] = "auto"
    trainer_cpus: Annotated[float, _d("logical CPUs the trainer actor asks for", ge=0)] = 0.5
    buffer_cpus: Annotated[float, _d("logical CPUs the buffer actor asks for", ge=0)] = 0.25
    torch_threads: Annotated[
        Annotated[int, Meta(ge=1)] | Literal["auto"],
        _d("torch intra-op threads per actor; auto: from the cores each role may use — with max_staleness = 0 the "
           "trainer and the generators each get every core (the phases alternate), else the cores are split "
           "between them, and the buffer and scorers get 1 (docs/config.md)"),
    ] = "auto"
    auto_affinity: Annotated[
        bool,
        _d("Ray, local cluster: when the roles overlap (max_staleness >= 1) and want more threads than there are "
           "cores, pin the trainer to cores of its own and the other roles, the Controller and Ray to the rest; "
           "off when [cluster.affinity] names any CPU, on a remote cluster or with GPUs (docs/config.md)"),
    ] = True
    generator_nice: Annotated[
        Annotated[int, Meta(ge=0, le=19)] | Literal["auto"],
        _d("niceness the generator actors run at (0 = the default priority): on a core they share with the buffer, "
           "the scorers and the Controller, whose short replies sit on every step's path, those run as soon as they "
           "wake; auto: 10 where auto_affinity pins the generators beside them, else 0 (docs/config.md)"),
    ] = "auto"
    placement: Annotated[
        Literal["disaggregated", "colocated"],
        _d("disaggregated: trainer and generators on devices of their own, weights broadcast (gloo or NCCL); "
           "colocated: trainer and generators share one device, the engines release their KV cache while the "
           "trainer trains and take the weights without a broadcast (in process: the same tensors; across "
           "processes on a GPU: CUDA IPC) — generation and training then take turns and never overlap in time "
           "(needs rollout.engine = 'torch')"),
    ] = "disaggregated"
    trainer_gpus: Annotated[
        float,
        _d("GPUs the trainer asks Ray for (fractions share one GPU); > 0 puts the trainer (and its critic and "
           "reference) on CUDA, 0 = CPU", ge=0),
    ] = 0.0
    generator_gpus: Annotated[
        float,
        _d("GPUs each generator asks Ray for (fractions share one GPU); > 0 puts its engine on CUDA, 0 = CPU",
           ge=0),
    ] = 0.0
    scorer_gpus: Annotated[
        float,
        _d("GPUs each scorer actor asks for (a reward model, a reference on the scorer); > 0 = CUDA, 0 = CPU",
           ge=0),
    ] = 0.0
    max_restarts: Annotated[
        int,
        _d("Ray runs: a generator or scorer actor that dies is restarted, at most this many times in the run "
           "(the run then stops with an error); 0 = off: a dead actor ends the run. A dead trainer or buffer is "
           "not restarted: the run resumes from its newest checkpoint (run.max_resumes)", ge=0),
    ] = 3
    affinity: AffinityConfig = msgspec.field(default_factory=AffinityConfig)
    resources: ResourcesConfig = msgspec.field(default_factory=ResourcesConfig)
    network_interface: Annotated[
        str,
        _d("network interface the weight-sync group uses between nodes, e.g. 'eth0' (sets GLOO_SOCKET_IFNAME and "
           "NCCL_SOCKET_IFNAME in every actor); empty = the libraries' own choice"),
    ] = ""


class RunConfig(Section):
    """The run directory, seed, checkpoints, and the limits that stop a run."""

    output_dir: Annotated[str, _d("run directory (config, metrics.jsonl, checkpoint)", min_length=1)] = "runs/default"
    trainer_dir: Annotated[
        str,
        _d("Ray runs: the folder the trainer writes checkpoints and the final export into on its own node (e.g. a "
           "node-local disk); empty = run.output_dir. When the trainer does not see run.output_dir there (another "
           "node without shared storage, or this folder), the driver fetches each checkpoint and the export into "
           "run.output_dir through Ray and ships the checkpoint to resume from back (docs/checkpoints.md)"),
    ] = ""
    seed: Annotated[int, _d("base seed; each generator derives its own", ge=0)] = 0
    log_every: Annotated[int, _d("print a progress line every N steps", ge=1)] = 1
    save_checkpoint: Annotated[bool, _d("write the final weights as an HF folder into RUN_DIR/checkpoint")] = True
    export_dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _d("dtype of the final HF folder's weights (the training weights are not changed); auto = model.dtype, "
           "also when trainer.mixed_precision trains float32 master weights"),
    ] = "auto"
    save_every: Annotated[
        int,
        _d("write a durable checkpoint (weights, optimizer, RNG, the buffer's accepted groups, the gate) into "
           "RUN_DIR/checkpoints every N train steps; 0 = off. Beside run.save_every_s: a checkpoint is written when "
           "either is due, and after the last step when either is on. `asyncrl launch --resume RUN_DIR` continues "
           "from the newest valid one (docs/checkpoints.md)", ge=0),
    ] = 0
    save_every_s: Annotated[
        float,
        _d("write a durable checkpoint once this many seconds of wall time passed since the last one (or since the "
           "run started or resumed) — after the step in progress then, or at most two steps later (the step pipeline "
           "drains first) — and after the last step; 0 = off (with run.save_every = 0 too: no checkpoints at all, "
           "so a dead trainer or a crash cannot be resumed). On by default: a run that dies after an hour loses about "
           "the last 30 minutes at most", ge=0),
    ] = 1800.0
    keep_last: Annotated[
        int, _d("durable checkpoints to keep (the newest valid ones); 0 = keep all", ge=0),
    ] = 2
    max_resumes: Annotated[
        int,
        _d("Ray runs: when the trainer or the buffer actor dies and RUN_DIR/checkpoints holds a valid checkpoint, "
           "start the roles afresh and resume from it, at most this many times in the run; 0 = end the run with the "
           "command that resumes it", ge=0),
    ] = 2
    max_failed_groups_in_a_row: Annotated[
        int,
        _d("end the run with one error quoting the last reasons once this many groups in a row failed or were "
           "filtered and none was trained on (a reward that always raises, rows without reward.answer_key, ...); "
           "0 = never", ge=0),
    ] = 200
    no_progress_timeout_s: Annotated[
        float,
        _d("end the run with one error once no group was accepted for training and no step taken for this many "
           "seconds; 0 = never", ge=0),
    ] = 0.0
    role_timeout_s: Annotated[
        float,
        _d("a role whose event loop does not run for this long (a synchronous call in an env step, a reward "
           "function holding the interpreter lock), or whose process does not answer, ends the run with one error "
           "naming it, where it is blocked and what it began last", gt=0),
    ] = 60.0


class LoggingConfig(Section):
    """Where a run's metrics go besides metrics.jsonl (always written), and the live console view."""

    live: Annotated[
        Literal["auto"] | bool,
        _d("live console view (progress, reward, staleness, busy shares, ETA): 'auto' = on when stdout is a terminal, "
           "or true/false"),
    ] = "auto"
    trace: Annotated[
        bool,
        _d("write the Perfetto/Chrome timeline <run_dir>/trace.json (open it in ui.perfetto.dev)"),
    ] = True
    tensorboard: Annotated[
        bool,
        _d("also write TensorBoard scalars to <run_dir>/tensorboard (needs: pip install 'asyncrl[loggers]')"),
    ] = False
    wandb: WandbSwitch = None
    wandb_project: Annotated[
        str | None,
        _d("older spelling of [logging.wandb] project, read with `wandb = true`"),
    ] = None
    mlflow: MlflowSwitch = None
    trackio: TrackioSwitch = None
    rollouts_every: Annotated[int, _d("every N train steps, write the step's trained samples (prompt, completion, "
                                      "reward and its components, versions, finish reason) to <run_dir>/rollouts."
                                      "jsonl, and at each evaluation its held-out completions; 0 = neither", ge=0)] = 10
    rollouts_shown: Annotated[int, _d("of those samples, how many the console shows", ge=0)] = 2

    def __post_init__(self) -> None:
        # `wandb = true` -> the table of defaults, `false` -> None (asyncrl/config/trackers.py); the older
        # `wandb_project` goes into the table it meant, so the resolved config spells it one way.
        if self.wandb is True:
            self.wandb = WandbConfig(project=self.wandb_project or "asyncrl")
            self.wandb_project = None
        elif self.wandb is False or self.wandb is None:
            self.wandb, self.wandb_project = None, None
        elif self.wandb_project == self.wandb.project:
            self.wandb_project = None
        # (a table and a different wandb_project both given: asyncrl/config/loader.py reports it)
        for name, section in (("mlflow", MlflowConfig), ("trackio", TrackioConfig)):
            value = getattr(self, name)
            if isinstance(value, bool):
                setattr(self, name, section() if value else None)


class EnvConfig(Section):
    """Multi-turn environment episodes instead of single completions (docs/envs.md)."""

    env: Annotated[
        str,
        _d("built-in environment ('first_digit', 'tool_arith', 'guess') or 'pkg.module:Class' with async reset(row) "
           "and step(action)", min_length=1),
    ]
    kwargs: Annotated[dict[str, Any], _d("keyword arguments for the environment class, e.g. {max_guesses = 4}")] = {}
    max_turns: Annotated[int, _d("model turns per episode; reaching it ends the episode (truncated)", ge=1)] = 8
    max_episode_tokens: Annotated[int, _d("response tokens per episode, model and environment together", ge=1)] = 64
    step_timeout_s: Annotated[
        float,
        _d("a reset or step taking longer ends the episode with an error (counted)", gt=0),
    ] = 10.0
    chat_template: Annotated[
        Literal["auto", "none", "strict", "concat"],
        _d("auto: the tokenizer's chat template if it is append-only, else per-message concatenation, "
           "none without one; none: plain append; strict: the template, failing on a turn that is not append-only; "
           "concat: per-message rendering"),
    ] = "auto"
    on_step_error: Annotated[
        Literal["keep", "fail"],
        _d("an env step that raises, hangs or returns garbage ends the episode; keep: train on it with the reward so "
           "far; fail: fail its group (slots returned)"),
    ] = "keep"


class Config(Section):
    """An asyncrl run: one table per section; only [model] is required, every other key has a default."""

    model: ModelConfig
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    reference: ReferenceConfig = msgspec.field(default_factory=ReferenceConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    env: EnvConfig | None = None  # set: generators play environment episodes (asyncrl/envs)

    @property
    def samples_per_step(self) -> int:
        return self.trainer.prompts_per_step * self.rollout.group_size
