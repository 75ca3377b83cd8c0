"""A dense decoder's forward over a static KV cache: the built-in engine's fast path.

It runs the loaded HF model's own modules (projections, norms, MLP, rotary tables), so the
numbers are the model's and a weight update is seen at once, but it replaces HF's cache
and attention plumbing:

- KV cache: one tensor [layers, 2, slots, kv_heads, max_len, head_dim] allocated once. Row
  r of the decode batch is slot r (the generator keeps live sequences in rows 0..n-1).
- Prefill: a group of new sequences, right-padded to the longest, causal attention; their
  keys and values land in their slots at positions 0..len-1 (a padded tail is garbage
  that later decode steps overwrite before any query can see it).
- Fused projections: each layer's q/k/v weights (and gate/up) become views of one buffer
  (`fuse_weights`), so one GEMM computes them; a weight update copied into a view lands in
  the buffer, and nothing is held twice. Projections stored in another form than a plain
  Linear of the model's dtype (`--quantization fp8`: fp8 values with block scales; `int4`:
  packed int4 values and scales; quantized.py) are not fused: each one's own module computes
  its matmul (it dequantises its weight). One that keeps a form derived from its weight
  (int4) is a `SelfPreparing` module: `prepare()` runs before every forward, outside any
  CUDA graph, and updates that form in place after a weight update.
- Decode: one token per row at fixed shapes (batch bucket × length bucket). Grouped
  queries attend as [rows, kv_heads, group, dim], so keys are never repeated per head.
  On CUDA each shape is captured once as a CUDA graph and replayed: a step's ~25 kernels
  per layer launch as one. Graphs hold the addresses of the weights and the cache, so
  anything that moves them (a weight swap, a memory release) must call `drop_graphs`,
  which also forgets the fused buffers (they are rebuilt at the next forward).

Dense Qwen2 / Qwen3 / Llama / Mistral layouts with plain rotary embeddings; anything
else is refused by `unsupported_reason` and served by the HF path (generation.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
LENGTH_BUCKET = 256


@runtime_checkable
class SelfPreparing(Protocol):
    """A projection that computes from a form derived from its weight (quantized.Int4Linear)."""

    def prepare(self) -> None:
        """Bring the derived form up to date with the weight, in place (graphs read it by address)."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run this model, or None."""
    cfg: Any = model.config  # a transformers config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} (fast path: {', '.join(SUPPORTED_TYPES)})"
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"rope type {rope.get('rope_type', rope.get('type'))!r} (fast path: default rotary only)"
    if getattr(cfg, "use_sliding_window", False) or (
            cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)):
        return "sliding-window attention"
    return None


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in the cache, all layers."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8


def batch_buckets(num_slots: int) -> list[int]:
    """Decode batch sizes captured: powers of two to 32, then steps of 32 (≤ 12 % padding)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < num_slots]
    sizes += list(range(64 if num_slots > 32 else num_slots, num_slots, 32))
    return sorted(set(sizes + [num_slots]))


class StaticDecoder:
    """Forward passes of `model` over a static cache of `num_slots` × `max_len` tokens. `model`:
    a transformers causal LM of SUPPORTED_TYPES (.config, .model's embed_tokens, layers, norm and
    rotary_emb, .lm_head), read by attribute."""

    def __init__(self, model: Any, num_slots: int, max_len: int, use_graphs: bool) -> None:
        cfg = model.config
        self.model, self.num_slots, self.max_len = model, num_slots, max_len
        self.layers = model.model.layers
        self.num_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.kv_heads
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.buckets = batch_buckets(num_slots)
        self.cache: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # torch.cuda.graph_pool_handle()
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None] | None = None
        self._preparing: list[SelfPreparing] = [
            m for m in model.modules() if isinstance(m, torch.nn.Linear) and isinstance(m, SelfPreparing)]
        with torch.inference_mode():
            positions = torch.arange(max_len, device=self.device).unsqueeze(0)
            cos, sin = model.model.rotary_emb(weight[:1].unsqueeze(0), positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim], in the model's dtype (as HF)
        self.in_tokens = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.in_pos = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self._rows = torch.arange(num_slots, device=self.device)
        self._key_pos = torch.arange(max_len, device=self.device)

    # ---- memory ----
    def cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.numel() * self.cache.element_size()

    def allocate(self) -> None:
        if self.cache is None:
            shape = (len(self.layers), 2, self.num_slots, self.kv_heads, self.max_len, self.head_dim)
            self.cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Free the cache and the graphs (they point into it)."""
        self.drop_graphs()
        self.cache = None

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._fused = None

    def fuse_weights(self) -> None:
        """Make each layer's q/k/v weights (and biases) and gate/up weights views of one
        buffer each (a no-op when they already are); None for a layer whose weights are stored
        in another format (module doc)."""
        fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None] = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            if type(a.q_proj) is not torch.nn.Linear or a.q_proj.weight.dtype != self.dtype:
                fused.append(None)
                continue
            bias = None if a.q_proj.bias is None else _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            fused.append((_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), bias,
                          _fuse([m.gate_proj.weight, m.up_proj.weight])))
        self._fused = fused

    def _ready_weights(self) -> None:
        if self._fused is None:
            self.fuse_weights()
        for module in self._preparing:
            module.prepare()

    def _weights(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """Layer `index`'s fused (qkv weight, qkv bias, gate_up weight), None where not fused:
        _ready_weights first."""
        assert self._fused is not None, "_ready_weights() first"
        return self._fused[index]

    def _allocated(self) -> torch.Tensor:
        assert self.cache is not None, "allocate() first"
        return self.cache

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy the cache rows `src` into `dst` (compaction when sequences leave)."""
        if src:
            s, d = (torch.tensor(x, device=self.device) for x in (src, dst))
            cache = self._allocated()
            cache[:, :, d] = cache[:, :, s]
            self.in_tokens[d] = self.in_tokens[s]
            self.in_pos[d] = self.in_pos[s]

    # ---- forward ----
    def _qkv(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] → q [B, heads, T, dim], k and v [B, kv_heads, T, dim], rotated."""
        a, fused = self.layers[index].self_attn, self._weights(index)
        shape = (*x.shape[:2], -1, self.head_dim)
        if fused is None:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        else:
            kv = self.kv_heads * self.head_dim
            q, k, v = F.linear(x, fused[0], fused[1]).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        if hasattr(a, "q_norm"):  # Qwen3 normalises each head before the rotation
            q, k = _rms_norm(a.q_norm, q), _rms_norm(a.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _finish_layer(self, index: int, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        layer, fused = self.layers[index], self._weights(index)
        x = residual + layer.self_attn.o_proj(attn)
        h = _rms_norm(layer.post_attention_layernorm, x)
        gate, up = (layer.mlp.gate_proj(h), layer.mlp.up_proj(h)) if fused is None \
            else F.linear(h, fused[2]).chunk(2, dim=-1)
        return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def prefill(self, prompts: list[list[int]], first_row: int, all_logits: bool) -> torch.Tensor:
        """Run prompts into slots first_row.. ; returns logits [B, V] at each prompt's last
        token, or [B, T, V] at every position when `all_logits` (prompt scoring)."""
        self._ready_weights()
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        rows = slice(first_row, first_row + len(prompts))
        x = self.model.model.embed_tokens(ids.to(self.device))
        cos, sin = self.cos[:width].unsqueeze(0), self.sin[:width].unsqueeze(0)
        cache = self._allocated()
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(index, _rms_norm(layer.input_layernorm, x), cos, sin)
            cache[index, 0, rows, :, :width] = k
            cache[index, 1, rows, :, :width] = v
            k, v = (t.repeat_interleave(self.group, dim=1) for t in (k, v))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._finish_layer(index, x, attn.transpose(1, 2).reshape(*x.shape[:2], -1))
        x = _rms_norm(self.model.model.norm, x)
        if all_logits:
            return self.model.lm_head(x).float()
        last = x[torch.arange(len(prompts), device=self.device), lens - 1]
        return self.model.lm_head(last).float()

    def _decode(self, batch: int, length: int) -> torch.Tensor:
        """One token per row 0..batch-1 from in_tokens at in_pos; keys up to `length`. → [batch, V]."""
        tokens, pos, rows = self.in_tokens[:batch], self.in_pos[:batch], self._rows[:batch]
        x = self.model.model.embed_tokens(tokens).unsqueeze(1)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        mask = (self._key_pos[:length].unsqueeze(0) <= pos.unsqueeze(1)).view(batch, 1, 1, length)
        cache = self._allocated()
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(index, _rms_norm(layer.input_layernorm, x), cos, sin)
            cache[index, 0, rows, :, pos] = k[:, :, 0]
            cache[index, 1, rows, :, pos] = v[:, :, 0]
            keys = cache[index, 0, :batch, :, :length]
            values = cache[index, 1, :batch, :, :length]
            q = q.reshape(batch, self.kv_heads, self.group, self.head_dim)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = self._finish_layer(index, x, attn.reshape(batch, 1, -1))
        return self.model.lm_head(_rms_norm(self.model.model.norm, x)[:, 0]).float()

    def decode(self, live: int, max_pos: int, fixed: bool = False) -> torch.Tensor:
        """Logits [live, V] of one decode step for rows 0..live-1 (inputs in in_tokens /
        in_pos); `max_pos` is the largest position among them. `fixed`: always the largest
        batch and the whole cache length, so no row's numbers depend on the others."""
        self._ready_weights()
        batch = self.num_slots if fixed else next(b for b in self.buckets if b >= live)
        length = self.max_len if fixed else min(self.max_len, (max_pos // LENGTH_BUCKET + 1) * LENGTH_BUCKET)
        if batch > live:  # padded rows compute garbage into free slots' position 0
            self.in_pos[live:batch] = 0
        if not self.use_graphs:
            return self._decode(batch, length)[:live]
        graph = self._graphs.get((batch, length)) or self._capture(batch, length)
        graph[0].replay()
        return graph[1][:live]

    def _capture(self, batch: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits must not be captured
            self._decode(batch, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._decode(batch, length)
        self._graphs[(batch, length)] = (graph, out)
        return graph, out


def _fuse(params: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding `params` back to back along dim 0, each param now a view of it
    (returned as is when they already are)."""
    first = params[0].data
    rows, size = sum(p.shape[0] for p in params), first.element_size()
    row_bytes = first[0].numel() * size
    if all(p.data.is_contiguous() and p.data.data_ptr() == first.data_ptr() + at * row_bytes
           for p, at in zip(params, _row_offsets(params))) and \
            first.untyped_storage().nbytes() >= first.storage_offset() * size + rows * row_bytes:
        return first.as_strided((rows, *first.shape[1:]), first.stride())
    # Made outside inference mode although the first prefill (in it) fuses: the weights become
    # views of this buffer, and a weight push on a GPU copies into views of them (span copies,
    # packing.py) outside it, which torch refuses for an inference tensor (the loop's first
    # CUDA-IPC push of a Qwen2 model, whose q/k/v biases keep its q/k/v weights apart, failed so)
    with torch.inference_mode(False):
        buf = torch.cat([p.data for p in params])
        for p, piece in zip(params, buf.split([p.shape[0] for p in params])):
            p.data = piece
    return buf


def _row_offsets(params: list[torch.Tensor]) -> list[int]:
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.shape[0]
    return offsets


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (`norm`: HF's, with weight and variance_epsilon) as torch's one fused
    op (HF's takes ~7 kernels), its weight and eps.
    It rounds once where HF rounds twice (the normalised input, then the product)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
