"""Model backends of the native engine: a fast slot-KV-cache forward for Llama/Qwen2, an HF fallback.

Place in the dataflow: `engines.scheduler.Scheduler` (the continuous-batching loop of `TorchEngine`)
drives one backend. Both backends keep one *slot* per running sequence and implement the same contract:

| method | does |
|---|---|
| `capacity(slots, length)` | make room for `slots` sequences of up to `length` tokens (grows, never shrinks) |
| `prefill(contexts, start, repeats, logits)` | run each context once; return the last-position logits [P, V] |
| `decode(tokens)` | one forward of tokens [B] over slots 0..B-1, each at its slot's current length; logits [B, V] |
| `move(src, dst)` | slot `src`'s K/V and length to `dst` (the scheduler keeps the running slots dense) |
| `refresh()` | recompute tables derived from buffers after a weight swap |
| `release()` | drop the K/V cache and every buffer sized by it (the engine sleeps); `capacity` grows it again |

`prefill` writes each context's K/V into `repeats[p]` consecutive slots from `start` (the n samples of a prompt
share one prefill).

`SlotDecoder` (the fast path) computes with the HF module's own parameter tensors — it copies nothing —
so an engine built with `from_model` sees the trainer's optimizer steps and `load_weights` lands in the
very tensors used. It is the standard decoder (RMSNorm, rotary embedding with `rope_theta`, grouped-query
attention, SwiGLU MLP, optional q/k/v/o and MLP biases as in Qwen2, tied or untied LM head) with a
preallocated cache `[layers, slots, kv_heads, max_len, head_dim]` and per-slot lengths:
* prefill right-pads the contexts and runs causal SDPA (padding sits after every real token, so it never
  leaks into them), writing each context's K/V into its slot(s);
* decode writes each new K/V row at its slot's length and attends over the slot's valid prefix through an
  additive mask (none when every slot holds the same number of tokens, e.g. the n samples of a prompt);
  the query heads of one KV head are folded into the query axis, so GQA needs no repeat. On CPU two
  matmuls replace SDPA (cheaper at decode shapes); on accelerators it is SDPA. At decode sizes a step is
  ~200 small ops, so the step is written to allocate little: q|k|v from one matmul, rotated in place,
  each layer's new K/V rows written by one flat-index write per tensor, the o and down projections
  accumulated straight into the residual stream (`addmm_`), SiLU in place;
* a K/V-only prefill (the recompute after a weight swap) stops once the last layer's K/V are written.
* a prefill for logits runs the last layer's attention and MLP at each context's last position only (the
  one hidden state the logits read), its query masked to the context's real positions.
The rotary tables come from HF's own rotary module and the ops follow HF's order, so fp32 logits equal
HF's to float rounding (tests/unit/test_torch_model.py: within 1e-5).

`engines.hf_fallback.HFDecoder` serves every other causal LM (other architectures, rope scaling, sliding
windows) through its own forward; `unsupported_reason` says why a model takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

_FAST_ARCHS = ("llama", "qwen2")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None if `SlotDecoder` computes exactly what `model` computes; otherwise why not."""
    if any(hasattr(m, "base_layer") for m in model.modules()):  # peft's adapter layers wrap the linear ones
        return "adapter layers (peft LoRA): the fast path would compute with the base weights alone"
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    if arch not in _FAST_ARCHS:
        return f"architecture {arch!r} (fast path: {', '.join(_FAST_ARCHS)})"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        return f"rope_scaling type {rope_type!r}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "sliding-window attention layers"
    if getattr(cfg, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        return f"attention implementation {cfg._attn_implementation!r}"
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        return "module layout differs from LlamaForCausalLM"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or hasattr(attn, "q_norm"):
            return "attention layout differs from Llama/Qwen2"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "MLP layout differs from SwiGLU"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen2RMSNorm, op for op (normalise in fp32, scale in the input dtype)."""
    if x.dtype == torch.float32:  # the casts are no-ops: skip their dispatch. The same values, bit for bit
        # (x * x is what pow(2) computes, sum then div_ what mean does), in fewer and in-place ops: at
        # decode sizes the per-op overhead is most of their cost.
        var = torch.sum(x * x, -1, keepdim=True).div_(x.shape[-1])
        return torch.mul(x, var.add_(eps).rsqrt_()).mul_(weight)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on one tensor: x*cos + rotate_half(x)*sin, with rotate_half(x)*sin
    written as roll(x)*[-sin1, sin2] (the same products, bit for bit, in fewer ops)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(signed_sin))


def _functional(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """F.silu for HF's SiLU modules (their forward is exactly F.silu), skipping the module call."""
    if type(act) is torch.nn.SiLU or type(act).__name__ == "SiLUActivation":
        return F.silu
    return act


@dataclass
class _LayerWeights:
    """One decoder layer's parameter tensors (the module's own, or views of a fused copy; see `fuse`)."""

    norm1: torch.Tensor
    eps1: float
    qkv: list[tuple[torch.Tensor, torch.Tensor | None]]  # [(w, b)] fused, or [q, k, v]
    o: tuple[torch.Tensor, torch.Tensor | None]
    norm2: torch.Tensor
    eps2: float
    gate_up: list[tuple[torch.Tensor, torch.Tensor | None]]  # [(w, b)] fused, or [gate, up]
    down: tuple[torch.Tensor, torch.Tensor | None]
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _DecodeStep:
    """Tables of one decode step, shared by every layer."""

    b: int                     # running slots 0..b-1
    width: int                 # cache positions attended: the longest slot's length + 1 (the new token)
    mask: torch.Tensor | None  # additive [B * kv_heads, 1, width]; None when every slot has the same length
    cos: torch.Tensor          # [B, 1, D] rotary table at each slot's position
    sin: torch.Tensor          # [B, 1, D] the same, signed for rotate_half (see `_rotate`)
    kv_rows: torch.Tensor      # [B, kv_heads]: the new token's row in a layer's cache viewed as [rows, D]


def _residual_linear(x: torch.Tensor, h: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """x += F.linear(h, w, b), in place; without a bias the matmul accumulates straight into x (addmm_)."""
    weight, bias = wb
    if bias is None:
        x.addmm_(h, weight.t())
    else:
        x.add_(F.linear(h, weight, bias))


def _wb(mod: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return mod.weight, mod.bias


def _fuse(mods: list[torch.nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Move the weights (and biases) of `mods` into one buffer and point each module's parameter at its
    slice of it (the Parameter objects stay; only their storage moves). One matmul then computes all of
    them, and every in-place write to a parameter (load_weights) is seen by the fused weight."""
    weight = torch.cat([m.weight.data for m in mods])
    bias = None
    if all(m.bias is not None for m in mods):
        bias = torch.cat([m.bias.data for m in mods])
    elif any(m.bias is not None for m in mods):
        return [_wb(m) for m in mods]
    row = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return [(weight, bias)]


def _still_fused(fused: list, mods: tuple) -> bool:
    """True while every parameter of `mods` still lives in the fused buffers `_fuse` made."""
    if len(fused) != 1:
        return False
    weight, bias = fused[0]

    def same(t: torch.Tensor | None, buf: torch.Tensor | None) -> bool:
        return t is None and buf is None or (
            t is not None and buf is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        )

    return all(same(m.weight, weight) and same(m.bias, bias) for m in mods)


class SlotDecoder:
    """Fast forward over the HF module's own weights with a fixed-slot KV cache (see module docstring).

    `fuse=True` (only for a module the engine owns, i.e. loaded from a path) moves q/k/v and gate/up
    weights into fused buffers, the module's parameters becoming views of them: no extra memory, one
    matmul instead of three (two). With `fuse=False` (a shared trainer module) nothing is touched.
    Parameter tensors are looked up again by `refresh()`: replacing a Parameter object (rather than
    writing into it) is seen from the next refresh (the scheduler refreshes after every swap and
    whenever it starts from idle).
    """

    def __init__(
        self, model: torch.nn.Module, device: torch.device, fuse: bool = False, graphs: str = "off",
        fp32_head: bool = False,
    ) -> None:
        if graphs not in ("off", "cuda", "eager"):
            raise ValueError(f"graphs must be 'off', 'cuda' or 'eager', got {graphs!r}")
        if graphs == "cuda" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.device = device
        base = model.model
        attn = base.layers[0].self_attn
        cfg = model.config
        self.head_dim = int(attn.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.scale = float(attn.scaling)
        self.dtype = base.embed_tokens.weight.dtype
        self.num_layers = len(base.layers)
        # fp32_head on lower-precision weights: the logits from a float32 copy of the head, refreshed from the
        # module's head after every swap (`refresh`), so they are not rounded to bf16 (by up to 1/16 at a real
        # model's logit scale); the trainer computes the same product in float32 (trainer.lm_head_fp32)
        self.fp32_head = fp32_head and self.dtype != torch.float32
        self._head32: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._empty_cache()
        # Decode attention: SDPA on accelerators; on CPU two matmuls beat SDPA's kernel at decode shapes.
        self.use_sdpa = device.type != "cpu"
        # Static decode (see `_StaticDecode`): "cuda" captures one CUDA graph per batch bucket and replays it;
        # "eager" runs the same fixed-shape step without capture (tests check it on CPU); "off": dynamic shapes.
        self.graphs = graphs
        self._static: dict[int, _StaticDecode] = {}
        self._static_key: tuple = ()
        self.num_graph_captures = 0
        self._fused: list[tuple[list, list]] = []
        if fuse:
            with torch.no_grad():
                for layer in base.layers:
                    a, m = layer.self_attn, layer.mlp
                    self._fused.append((_fuse([a.q_proj, a.k_proj, a.v_proj]), _fuse([m.gate_proj, m.up_proj])))
        self.refresh()

    # -- cache management ------------------------------------------------------------------------
    def _empty_cache(self) -> None:
        """No slots: an empty K/V cache [layers, 0, kv_heads, 0, head_dim] and empty slot tables."""
        self.slots = self.max_len = 0
        shape = (self.num_layers, 0, self.kv_heads, 0, self.head_dim)  # [layers, slots, kv_heads, max_len, D]
        self.k = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # tokens held per slot
        self._lens: list[int] = []  # the same on the host, so decode needs no device sync
        self._kv_base = torch.zeros((0, self.kv_heads), dtype=torch.long, device=self.device)  # see capacity()

    def release(self) -> None:
        """Drop the cache, the CUDA-graph captures (their private memory pools and static buffers) and the
        rotary tables sized by the cache; the next `capacity` call allocates them again. Only while no slot
        is in use (the scheduler sleeps only when idle)."""
        self._empty_cache()
        self._static.clear()
        self.refresh()  # rotary tables for the empty cache (one position)

    def capacity(self, slots: int, length: int) -> None:
        if slots <= self.slots and length <= self.max_len:
            return
        new_slots, new_len = max(slots, self.slots), max(length, self.max_len)
        shape = (self.num_layers, new_slots, self.kv_heads, new_len, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        k[:, : self.slots, :, : self.max_len] = self.k
        v[:, : self.slots, :, : self.max_len] = self.v
        lengths = torch.zeros(new_slots, dtype=torch.long, device=self.device)
        lengths[: self.slots] = self.lengths
        self.k, self.v, self.lengths = k, v, lengths
        self._lens += [0] * (new_slots - self.slots)
        self.slots, self.max_len = new_slots, new_len
        # row of (slot s, KV head h, position 0) in a layer's cache viewed as [rows, D]; see _DecodeStep
        heads = torch.arange(self.kv_heads, device=self.device)
        self._kv_base = (torch.arange(new_slots, device=self.device)[:, None] * self.kv_heads + heads) * new_len
        self._static.clear()  # they read the old cache
        self.refresh()

    def refresh(self) -> None:
        """Re-read the parameter tensors; rotary tables for every cache position from HF's own rotary
        module (its inv_freq buffer may have been swapped too)."""
        self._weights = [self._layer_weights(i, layer) for i, layer in enumerate(self.model.model.layers)]
        pos = torch.arange(max(self.max_len, 1), device=self.device)
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, pos[None])
        half = self.head_dim // 2
        signed_sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        if getattr(self, "_cos", None) is not None and self._cos.shape == cos[0].shape:
            # the same storage, new values: a captured decode step reads these tables by address (made
            # under inference mode by the scheduler, so written under it)
            with torch.inference_mode():
                self._cos.copy_(cos[0])
                self._signed_sin.copy_(signed_sin)
        else:
            self._cos, self._arange, self._signed_sin = cos[0], pos, signed_sin
        if self.fp32_head:
            self._refresh_head32()
        key = self._addresses()
        if key != self._static_key:  # a Parameter was replaced (not written into): captured steps are stale
            self._static.clear()
            self._static_key = key

    def _refresh_head32(self) -> None:
        """The float32 copy of the LM head (and bias) written in place from the module's, so its address stays."""
        head = self.model.lm_head
        with torch.no_grad():
            if self._head32 is None or self._head32[0].shape != head.weight.shape:
                bias = None if head.bias is None else head.bias.detach().float()
                self._head32 = (head.weight.detach().float(), bias)
                return
            self._head32[0].copy_(head.weight)
            if head.bias is not None and self._head32[1] is not None:
                self._head32[1].copy_(head.bias)

    def _addresses(self) -> tuple:
        """Storage addresses of every tensor a decode step reads (weights, tables, cache)."""
        out: list[int] = [self.k.data_ptr(), self.v.data_ptr(), self._cos.data_ptr(), self._signed_sin.data_ptr()]
        if self._head32 is not None:
            out.append(self._head32[0].data_ptr())
        model = self.model.model
        for t in (model.embed_tokens.weight, model.norm.weight, self.model.lm_head.weight, self.model.lm_head.bias):
            out.append(0 if t is None else t.data_ptr())
        for w in self._weights:
            for t in (w.norm1, w.norm2, *(x for wb in (*w.qkv, w.o, *w.gate_up, w.down) for x in wb)):
                out.append(0 if t is None else t.data_ptr())
        return tuple(out)

    def _layer_weights(self, i: int, layer: torch.nn.Module) -> _LayerWeights:
        a, m = layer.self_attn, layer.mlp
        qkv = [_wb(a.q_proj), _wb(a.k_proj), _wb(a.v_proj)]
        gate_up = [_wb(m.gate_proj), _wb(m.up_proj)]
        if self._fused:  # use a fused buffer only while every parameter still lives in it
            fused_qkv, fused_gate_up = self._fused[i]
            if _still_fused(fused_qkv, (a.q_proj, a.k_proj, a.v_proj)):
                qkv = fused_qkv
            if _still_fused(fused_gate_up, (m.gate_proj, m.up_proj)):
                gate_up = fused_gate_up
        return _LayerWeights(
            norm1=layer.input_layernorm.weight, eps1=layer.input_layernorm.variance_epsilon,
            qkv=qkv, o=_wb(a.o_proj),
            norm2=layer.post_attention_layernorm.weight, eps2=layer.post_attention_layernorm.variance_epsilon,
            gate_up=gate_up, down=_wb(m.down_proj), act=_functional(m.act_fn),
        )

    def move(self, src: int, dst: int) -> None:
        n = self._lens[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = self.lengths[src]
        self._lens[dst] = n

    # -- forwards --------------------------------------------------------------------------------
    def prefill(
        self, contexts: list[list[int]], start: int, repeats: list[int], logits: bool = True
    ) -> torch.Tensor | None:
        hidden = self._prefill_hidden(contexts, start, repeats, kv_only=not logits, last_only=logits)
        return None if hidden is None else self._logits(hidden)

    def _qkv(self, w: _LayerWeights, h: torch.Tensor) -> list[torch.Tensor]:
        if len(w.qkv) == 3:
            return [F.linear(h, *wb) for wb in w.qkv]
        sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        return list(F.linear(h, *w.qkv[0]).split(sizes, dim=-1))

    def _mlp(self, w: _LayerWeights, h: torch.Tensor) -> torch.Tensor:
        if len(w.gate_up) == 2:
            gate, up = (F.linear(h, *wb) for wb in w.gate_up)
        else:
            gate, up = F.linear(h, *w.gate_up[0]).chunk(2, dim=-1)
        return F.linear(w.act(gate).mul_(up), *w.down)

    def _prefill_hidden(
        self, contexts: list[list[int]], start: int, repeats: list[int], kv_only: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor | None:
        """Hidden states [P, S, D] of the right-padded contexts; writes their K/V and slot lengths.
        `kv_only` (a K/V recompute after a weight swap): stop once the last layer's K/V are written, skipping
        its attention and MLP, whose output nothing reads; returns None. `last_only` (a prefill for the first
        sampled token): the last layer's attention and MLP run for each context's last position alone, the
        only hidden state the logits read; returns [P, D]."""
        lens = [len(c) for c in contexts]
        rows, width, total = len(contexts), max(lens), sum(repeats)
        # right padding (id 0): pads come after every real token, so causal attention never sees them
        ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts], dtype=torch.long, device=self.device)
        rep = torch.tensor(repeats, device=self.device) if total != rows else None
        cos, sin = self._cos[:width][None, None], self._signed_sin[:width][None, None]  # [1, 1, S, D]
        x = self.model.model.embed_tokens(ids)
        for i, w in enumerate(self._weights):
            h = _rms_norm(x, w.norm1, w.eps1)
            q, k, v = self._qkv(w, h)
            q = _rotate(q.view(rows, width, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
            self.k[i, start : start + total, :, :width] = k if rep is None else k.repeat_interleave(rep, 0)
            self.v[i, start : start + total, :, :width] = v if rep is None else v.repeat_interleave(rep, 0)
            if kv_only and i == self.num_layers - 1:
                x = None
                break
            if last_only and i == self.num_layers - 1:
                x = self._last_positions(w, x, q, k, v, lens)
                break
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.heads != self.kv_heads
            )
            x = x + F.linear(o.transpose(1, 2).reshape(rows, width, -1), *w.o)
            x = x + self._mlp(w, _rms_norm(x, w.norm2, w.eps2))
        slot_lens = [n for n, r in zip(lens, repeats) for _ in range(r)]
        self.lengths[start : start + total] = torch.tensor(slot_lens, device=self.device)
        self._lens[start : start + total] = slot_lens
        return x

    def _last_positions(self, w: _LayerWeights, x, q, k, v, lens: list[int]) -> torch.Tensor:
        """The last layer at each context's last position: x [P, S, D] (its input), q [P, H, S, hd] and k, v
        [P, kv_heads, S, hd] (rotated) -> hidden [P, D]. The last query sees every real position of its
        context and none of the right padding (the additive mask), which is what causal attention gives it;
        every other position's output would be computed only to be dropped."""
        rows = torch.arange(len(lens), device=self.device)
        last = torch.tensor(lens, device=self.device) - 1
        pad = self._arange[: k.shape[2]] > last[:, None]  # [P, S]: right padding after the last real token
        mask = torch.zeros(pad.shape, dtype=q.dtype, device=self.device).masked_fill_(pad, float("-inf"))
        o = F.scaled_dot_product_attention(
            q[rows, :, last][:, :, None], k, v, attn_mask=mask[:, None, None], scale=self.scale,
            enable_gqa=self.heads != self.kv_heads,
        )
        h = x[rows, last] + F.linear(o.reshape(len(lens), -1), *w.o)
        return h + self._mlp(w, _rms_norm(h, w.norm2, w.eps2))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        if self.graphs != "off":
            logits = self._static_step(b).run(tokens)
        else:
            logits = self._decode_forward(tokens, self._decode_tables(b))
        self.lengths[:b] += 1
        self._lens[:b] = [n + 1 for n in self._lens[:b]]
        return logits

    def _decode_forward(self, tokens: torch.Tensor, step: "_DecodeStep") -> torch.Tensor:
        """Logits of one decode step over slots 0..step.b-1 (writes their new K/V; lengths not advanced)."""
        x = F.embedding(tokens, self.model.model.embed_tokens.weight)
        for i, w in enumerate(self._weights):
            self._decode_layer(i, w, x, step)
        return self._logits(x)

    def _decode_tables(self, b: int) -> "_DecodeStep":
        """Per-step tables shared by all layers (see `_DecodeStep`)."""
        lens = self._lens[:b]
        pos = self.lengths[:b]
        width = max(lens) + 1
        mask = None
        if min(lens) != width - 1:  # slots of different lengths: mask each one's padding
            pad = (self._arange[:width] > pos[:, None]).repeat_interleave(self.kv_heads, 0)
            mask = torch.zeros((b * self.kv_heads, 1, width), dtype=self.dtype, device=self.device)
            mask.masked_fill_(pad[:, None], float("-inf"))
        return _DecodeStep(
            b=b, width=width, mask=mask,
            cos=self._cos.index_select(0, pos)[:, None], sin=self._signed_sin.index_select(0, pos)[:, None],
            kv_rows=self._kv_base[:b] + pos[:, None],
        )

    def _decode_layer(self, i: int, w: _LayerWeights, x: torch.Tensor, step: "_DecodeStep") -> None:
        """One decoder layer over x [B, hidden] (updated in place): the new token's K/V go into the cache."""
        b, kvh, hd, heads = step.b, self.kv_heads, self.head_dim, self.heads
        h = _rms_norm(x, w.norm1, w.eps1)
        if len(w.qkv) == 1:  # fused: q, k and v are column ranges of one output
            qkv = F.linear(h, *w.qkv[0])
        else:
            qkv = torch.cat([F.linear(h, *wb) for wb in w.qkv], dim=-1)
        qk_width = (heads + kvh) * hd
        qk = qkv[:, :qk_width].view(b, heads + kvh, hd)  # q's heads, then k's: rotated together, in place
        half = hd // 2
        rolled = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)  # rotate_half up to its sign (in sin)
        qk.mul_(step.cos).addcmul_(rolled, step.sin)
        # The new K/V row of (slot s, KV head h) is row (s * kv_heads + h) * max_len + pos[s] of the cache.
        kc, vc = self.k[i], self.v[i]
        kc.view(-1, hd).index_put_((step.kv_rows,), qk[:, heads:])
        vc.view(-1, hd).index_put_((step.kv_rows,), qkv[:, qk_width:].view(b, kvh, hd))
        # Query heads h = kv * group + g (HF's repeat_kv order): fold g into the query axis, so each
        # (slot, KV head) pair is one small matmul: [group, D] x [D, W]. q is scaled here, in the copy that
        # makes it contiguous anyway.
        q = torch.mul(qk[:, :heads], self.scale).view(b * kvh, heads // kvh, hd)
        o = self._decode_attention(q, kc[:b, :, : step.width].reshape(b * kvh, step.width, hd),
                                   vc[:b, :, : step.width].reshape(b * kvh, step.width, hd), step.mask)
        _residual_linear(x, o.reshape(b, heads * hd), w.o)
        h = _rms_norm(x, w.norm2, w.eps2)
        if len(w.gate_up) == 2:
            gate, up = (F.linear(h, *wb) for wb in w.gate_up)
        else:
            gate, up = F.linear(h, *w.gate_up[0]).chunk(2, dim=-1)
        if w.act is F.silu:
            act = F.silu(gate, inplace=True).mul_(up)  # gate is this step's own buffer
        else:
            act = w.act(gate).mul_(up)
        _residual_linear(x, act, w.down)

    def _decode_attention(self, q, k, v, mask):
        """q [N, G, D] (already scaled), k and v [N, W, D], mask [N, 1, W] or None (no padding) -> [N, G, D]."""
        if self.use_sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        # On CPU two batched matmuls beat SDPA's kernel at decode shapes (and beat one [H, D] x [D, W * kv_heads]
        # matmul per slot against all its KV heads, masked to each query head's own: fewer, larger matmuls, but
        # kv_heads times the arithmetic). baddbmm adds the mask for free.
        if q.dtype != torch.float32:
            # In bf16/fp16 CPU bmm copies a transposed operand whole (K^T: every cached row of the step, per
            # layer); K q^T reads K as it lies and transposes only the small [N, W, G] result.
            scores = torch.bmm(k, q.transpose(1, 2)).transpose(1, 2)
            scores = scores if mask is None else scores + mask
            return torch.bmm(scores.softmax(-1), v)
        scores = torch.bmm(q, k.transpose(1, 2)) if mask is None else torch.baddbmm(mask, q, k.transpose(1, 2))
        return torch.bmm(scores.softmax(-1), v)

    def _static_step(self, b: int) -> "_StaticDecode":
        """The fixed-shape step for `b` running slots: batch padded to the next power of two (at most the
        slot count), so a handful of captures serve every batch size."""
        rows = min(self.slots, 1 << max(0, b - 1).bit_length())
        step = self._static.get(rows)
        if step is None:
            step = self._static[rows] = _StaticDecode(self, rows, capture=self.graphs == "cuda")
            self.num_graph_captures += self.graphs == "cuda"  # recorded at its first run
        return step

    def forward_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [S, V] at every position of one sequence, through the prefill path (tests use it).
        Overwrites slot 0."""
        self.capacity(max(self.slots, 1), max(self.max_len, len(ids)))
        return self._logits(self._prefill_hidden([ids], 0, [1])[0])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm, head = self.model.model.norm, self.model.lm_head
        normed = _rms_norm(hidden, norm.weight, norm.variance_epsilon)
        if self._head32 is not None:  # fp32_head: float32 logits (the normed states are exact in float32)
            return F.linear(normed.float(), *self._head32)
        return F.linear(normed, head.weight, head.bias)


class _StaticDecode:
    """One decode step at fixed shapes, on buffers of its own: the batch padded to `rows` slots and
    attention over every cache position under a length mask. Every tensor it reads keeps its address from
    step to step (cache, weights, rotary tables, these buffers), which is what a CUDA graph needs: with
    `capture=True` the step is recorded once and each later step is one `replay()` (a tiny model's decode
    step is hundreds of kernel launches, each costing more host time than the kernel takes on the GPU).

    Padded rows (slots b..rows-1, free: running slots are always 0..b-1) decode token 0 at position 0 and
    write their K/V there, which nothing reads; their logits are dropped. Weight swaps copy into the same
    parameter tensors, so a captured graph computes with the new weights; `SlotDecoder` drops its captures
    when the cache is reallocated or a parameter is replaced.
    """

    def __init__(self, dec: SlotDecoder, rows: int, capture: bool) -> None:
        self.dec = dec
        self.rows = rows
        self.capture = capture
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dec.device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dec.device)
        self.graph = None
        self.out: torch.Tensor | None = None

    def _capture(self) -> None:
        """Record the step. Called with this step's real inputs in place: the warm-up runs (on a side
        stream, for the allocator's and cuBLAS's sake) write the very K/V rows the replay then writes again."""
        device = self.dec.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a private memory pool per bucket: graphs replay in any order
            self.out = self._forward()
        self.graph = graph

    def _forward(self) -> torch.Tensor:
        d, rows, width = self.dec, self.rows, self.dec.max_len
        pad = d._arange[:width] > self.pos[:, None]  # [rows, W]: positions after each row's new token
        mask = torch.zeros((rows, d.kv_heads, 1, width), dtype=d.dtype, device=d.device)
        mask.masked_fill_(pad[:, None, None], float("-inf"))
        step = _DecodeStep(
            b=rows, width=width, mask=mask.view(rows * d.kv_heads, 1, width),
            cos=d._cos.index_select(0, self.pos)[:, None], sin=d._signed_sin.index_select(0, self.pos)[:, None],
            kv_rows=d._kv_base[:rows] + self.pos[:, None],
        )
        return d._decode_forward(self.tokens, step)

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, V] for the b running slots (b = len(tokens) <= rows), at their current lengths."""
        b = tokens.shape[0]
        self.tokens[:b].copy_(tokens)
        self.pos[:b].copy_(self.dec.lengths[:b])
        if b < self.rows:
            self.tokens[b:].zero_()
            self.pos[b:].zero_()
        if not self.capture:
            return self._forward()[:b]
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out[:b]
