"""Runs the model for one scheduled batch: owns the KV pool, builds the step context."""

import torch

from oasiskv.context import SeqAttention, StepContext, set_context
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.kv.blocks import is_contiguous
from oasiskv.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        # [layers, K/V, Hkv, slots, d]; torch.empty: pages are touched only when used.
        self.kv = torch.empty(cfg.num_layers, 2, cfg.num_kv_heads, num_blocks * block_size,
                              cfg.head_dim, dtype=dtype, device=device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv[i, 0], self.kv[i, 1]

    def _token_slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        ids, positions, slots, seqs = [], [], [], []
        row = 0
        for seq, n in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            positions.append(torch.arange(start, end))
            slots.append(self._token_slots(seq.block_table, start, end))
            if is_contiguous(seq.block_table):
                kv_start, kv_slots = seq.block_table[0] * self.block_size, None
            else:
                kv_start, kv_slots = None, self._token_slots(seq.block_table, 0, end).to(
                    self.device)
            seqs.append(SeqAttention(row, row + n, end, kv_start, kv_slots))
            row += n
        ctx = StepContext(slot_mapping=torch.cat(slots).to(self.device), seqs=seqs)
        return (torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device), ctx)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        """Computes K/V for the batch's new tokens; returns logits [S, V] at `sample_rows`
        (last row of each sequence that samples this step)."""
        input_ids, positions, ctx = self.prepare(batch)
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            set_context(None)
        return self.model.compute_logits(hidden[sample_rows]).float()
