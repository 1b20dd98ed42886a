"""The LLaMA family of Hugging Face causal LMs (Llama, Mistral, Qwen2) behind veil's handles,
loaded from a user's checkpoint folder by `veil.models.hf_path`.

The three share one block: ``x + attn(RMSNorm(x))`` with rotary positions (RoPE) on q and k,
then ``x + down(silu(gate(h)) * up(h))`` on ``h = RMSNorm(x)`` (SwiGLU). There is no absolute
position table: `position_table` refuses in one line, `position_embeddings` is zero (as veil's
own `llama-tiny`, `veil.models.llama`).

The SwiGLU expansion is two modules per block, ``gate_proj`` and ``up_proj``, both reading the
MLP input: `mlp_up` gives the gate (the module whose input an attack reads) and `mlp_up_groups`
gives both, so a defense on the expansion (AEGIS channel 3) noises both. The blocks run one by
one with veil's additive causal + padding bias (and the sliding window where the config sets
one), so no mask is built from data-dependent control flow (per-sample gradients need that).
The handles look the modules up in the HF model at each call (peft's wrappers stay visible).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import AttentionHandles, Batch, NoPositionTable, VeilModel, attention_mask, padding_bias


class HFLlamaFamily(VeilModel):
    """LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM behind veil's handles."""

    modality = "text"
    task = "lm"
    causal = True
    absolute_positions = False

    def __init__(self, model: nn.Module, pad_id: int = 0) -> None:
        super().__init__()
        self.hf = model
        self.pad_id = pad_id

    @property
    def _body(self) -> nn.Module:
        return self.hf.model

    @property
    def _layers(self) -> nn.ModuleList:
        return self._body.layers

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self._body.embed_tokens(batch["input_ids"])

    def position_embeddings(self, tok: Tensor) -> Tensor:
        """No absolute positions: zeros, so a transform that moves tokens moves only content."""
        return tok.new_zeros(1, tok.shape[1], tok.shape[2])

    def movable(self, batch: Batch) -> Tensor:
        return batch["attention_mask"].bool() & (batch["input_ids"] != self.pad_id)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return tok + pos

    def _window(self, i: int) -> int | None:
        """The sliding window of block i, or None for full causal attention."""
        cfg = self.hf.config
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if window is None or (types is not None and types[i] != "sliding_attention"):
            return None
        return int(window)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        T = h.shape[1]
        if self.max_positions() < T:
            raise VeilError(
                f"{self.hf.config.model_type}: a sequence of {T} tokens is longer than its {self.max_positions()} positions"
            )
        bias = padding_bias(attention_mask(batch, h), causal=True, dtype=h.dtype)
        pos_ids = torch.arange(T, device=h.device).unsqueeze(0)
        rope = self._body.rotary_emb(h, pos_ids)
        biases: dict[int | None, Tensor] = {None: bias}
        for i, layer in enumerate(self._layers):
            w = self._window(i)
            if w not in biases:
                t = torch.arange(T, device=h.device)
                far = (t[:, None] - t[None, :]) >= w
                biases[w] = bias.masked_fill(far, torch.finfo(h.dtype).min)
            h = layer(h, attention_mask=biases[w], position_ids=pos_ids, position_embeddings=rope)
        return self.hf.lm_head(self._body.norm(h))

    def token_embedding(self) -> nn.Module:
        return self._body.embed_tokens

    def position_table(self) -> nn.Parameter:
        raise NoPositionTable(self.hf.config.model_type, "RoPE rotates queries and keys instead")

    def max_positions(self) -> int:
        return int(self.hf.config.max_position_embeddings)

    def attention_layers(self) -> list[AttentionHandles]:
        return [
            AttentionHandles(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj, b.self_attn.o_proj)
            for b in self._layers
        ]

    def mlp_up(self) -> list[nn.Module]:
        return [b.mlp.gate_proj for b in self._layers]

    def mlp_up_groups(self) -> list[list[nn.Module]]:
        return [[b.mlp.gate_proj, b.mlp.up_proj] for b in self._layers]

    def mlp_down(self) -> list[nn.Module]:
        return [b.mlp.down_proj for b in self._layers]

    def classifier(self) -> nn.Module:
        return self.hf.lm_head

    def layer_input_norms(self) -> list[nn.Module]:
        return [b.input_layernorm for b in self._layers]

    @property
    def width(self) -> int:
        return int(self.hf.config.hidden_size)
