"""Batch -> tensors -> model -> sampler. Owns the model, the KV cache and the per-step metadata."""

from __future__ import annotations

import dataclasses
import logging

import torch

from turnout.layers.attention import AttentionMetadata
from turnout.worker.concurrency import default_max_num_seqs
from turnout.worker.cuda_graphs import maybe_capture
from turnout.worker.group_inputs import group_tables, kv_bytes_line
from turnout.worker.hidden_capture import HiddenCapture
from turnout.worker.kv_sizing import (
    allocate_caches,
    kv_dtype,
    model_cache_layout,
    plan_kv_blocks,
    unique_block_tensors,
)
from turnout.worker.kv_transfer import KVTransfer
from turnout.worker.layer_gate import LayerGatedCaches
from turnout.worker.prompt_logprobs import compute_chunks, merge_rows, prompt_rows
from turnout.worker.rank_memory import RankMemory
from turnout.worker.routed_experts import RoutingRecorder
from turnout.worker.step import RequestFaults, ScheduledRequest, SchedulerOutput
from turnout.worker.step_sampling import StepHandle
from turnout.worker.token_drawer import TokenDrawer

logger = logging.getLogger(__name__)

HIDDEN_STATE_METHODS = ("mtp", "eagle3")  # speculative methods that draft from the target's hidden states


class ModelRunner:
    def __init__(self, config, platform, ops, loaded, step_publisher=None):
        self.config = config
        self.platform = platform
        self.ops = ops
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.dtype = loaded.dtype
        self.device = next(self.model.parameters()).device
        self.max_model_len = config.max_model_len or loaded.max_model_len
        self.pin_memory = self.device.type == "cuda"  # host tensors pinned: their H2D copies are async
        # Side streams for the copies that need not wait in line: the sampling inputs go up while the
        # forward runs (_upload), the sampled tokens come down while the next step starts (_download).
        # Two streams: an upload queued behind a download would wait for that step's sampler.
        cuda = self.device.type == "cuda"
        self._upload = torch.cuda.Stream(self.device) if cuda else None
        self._download = torch.cuda.Stream(self.device) if cuda else None
        self.block_size = config.block_size
        self.vocab_size = self.hf_config.vocab_size
        # The mp executor's StepPublisher (turnout/executor/multiproc.py): this rank drives the others; None
        # in a world of one.
        self.step_publisher = step_publisher
        if self.device.type == "cpu":
            from turnout.layers.layout import use_k_major_weights

            use_k_major_weights(self.model)  # faster CPU GEMMs for decode-shaped batches (a re-layout of loaded weights)
        # The decode fusions were fixed when the model was built (its fusion plan, turnout/layers/fusion.py).
        logger.info("decode fusions: %s", self.model.plan.describe())
        # The cache's storage dtype (turnout/ops/kv_cache.py): the model's, or float8_e4m3fn (bytes per token halve)
        self.kv_dtype = kv_dtype(self)
        # What each layer stores (turnout/kv/spec.py), declared by the layers: this rank's shard under tensor
        # parallelism (its kv heads), in the order the model takes its caches
        self.cache_layout = model_cache_layout(self.model, self.kv_dtype)
        # several table groups (full and sliding layers, turnout/kv/spec.py: table groups): each layer's; None with one
        self.layer_group = self.cache_layout.layer_group if len(self.cache_layout.table_groups) > 1 else None
        # one state slot per sequence a step may hold, for recurrent layers (none without them)
        self.num_state_slots = (config.max_num_seqs or 256) if self.cache_layout.state_layers else 0
        self.num_blocks = plan_kv_blocks(self)
        # One tuple of tensors per layer, as its spec says: (k, v) [num_blocks, block_size, Hk, D] for attention
        self.kv_caches = allocate_caches(self.cache_layout, self.num_blocks, self.block_size, self.num_state_slots,
                                         self.device, shared=True)
        if config.max_num_seqs is None:  # what the cache holds at max_model_len (turnout/worker/concurrency.py)
            longest = self.cache_layout.max_blocks(self.max_model_len, self.block_size, config.max_num_batched_tokens)
            seqs = default_max_num_seqs(self.num_blocks, self.block_size, longest * self.block_size)
            self.config = config = dataclasses.replace(config, max_num_seqs=min(seqs, self.num_state_slots or seqs))
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB, %s; %s); max_num_seqs %d", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_bytes / 2**30,
                    str(self.kv_dtype).replace("torch.", ""), self.cache_layout.describe(), config.max_num_seqs)
        if self.layer_group is not None:
            logger.info("KV per sequence at max_model_len %d: %s", self.max_model_len,
                        kv_bytes_line(self.cache_layout, self.max_model_len, self.block_size))
        # KV tiers: host caches, swap strategy, start-up measurements for preemption_mode auto (kv_transfer.py)
        self.kv_transfer = KVTransfer(self, config)
        self._swap_gate = None  # this step's swap-ins, passed layer by layer by the next forward
        # the target's hidden states for the drafters that read them (speculative "mtp" / "eagle3"): eager steps
        spec = getattr(config, "speculative", None)
        self.hidden_capture = HiddenCapture(self.model) if spec is not None and spec.method in HIDDEN_STATE_METHODS \
            else None
        self.graphs = maybe_capture(self)  # None: every step runs eagerly
        # Sleep / wake and in-place weight updates of this rank (the RL control plane; collective_rpc reaches it)
        self.memory = RankMemory(self)
        self._side_outputs: list = []  # per-request results of launched steps besides tokens (take_side_outputs)
        self.routing = RoutingRecorder(self.model)  # return_routed_experts (turnout/worker/routed_experts.py)
        # what this rank keeps of each request, and its draws (worker/token_drawer.py)
        self.drawer = TokenDrawer(ops, self.device, self.vocab_size, config.max_num_seqs, self._upload, self._download)

    @property
    def requests(self) -> dict:
        """The requests this rank keeps (req_id -> worker/step_sampling.py CachedRequest)."""
        return self.drawer.requests

    def update_requests(self, step: SchedulerOutput) -> dict[int, BaseException]:
        return self.drawer.update(step)

    @property
    def pdl(self) -> bool:
        """Whether the Triton kernels launch with programmatic dependent launch (the platform says)."""
        return self.platform.pdl_enabled(self.device)

    @property
    def max_num_seqs(self) -> int:
        """The sequences a step may hold: the config's, or the default chosen when the cache was sized."""
        return self.config.max_num_seqs

    @property
    def block_bytes(self) -> int:
        """Bytes one block id stands for: its share of every token layer's cache."""
        return self.cache_layout.block_bytes(self.block_size)

    @property
    def num_kv_heads(self) -> int:
        """This rank's kv heads of the first attention layer (diagnostics; the specs hold each layer's)."""
        return next((s.num_kv_heads for s in self.cache_layout.specs if hasattr(s, "num_kv_heads")), 0)

    # ---- one step --------------------------------------------------------------------------
    def _host(self, x, dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, pin_memory=self.pin_memory)

    def _h2d(self, x, dtype) -> torch.Tensor:
        return self._host(x, dtype).to(self.device, non_blocking=True)

    def _to_device(self, ids, pos, meta):
        dev = self.device
        meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(dev, non_blocking=True) for f in
                                            ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")})
        if meta.group_tables is not None:
            meta.group_tables = tuple((s.to(dev, non_blocking=True), b.to(dev, non_blocking=True))
                                      for s, b in meta.group_tables)
        return ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True), meta

    def prepare_host(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                        list[int]]:
        """Host lists -> (pinned) CPU tensors. Returns ids, positions, metadata and the flat batch rows that
        draw: per entry that samples, its last token's and its drafts' (a lookahead step's ids are
        placeholders: its tokens are the rank's last draws, on the device)."""
        ids, pos, slots, qsl, lens, sample_idx = [], [], [], [0], [], []
        max_blocks = 1
        faults = {}
        for s in scheduled:
            try:
                e_ids, e_slots = self._entry_inputs(s)
            except Exception as e:  # noqa: BLE001 - traced to this request: the engine sends the step again
                faults[s.req_id] = e
                continue
            n = s.num_query_tokens
            ids.extend(e_ids)
            pos.extend(range(s.start, s.start + n))
            slots.extend(e_slots)
            qsl.append(qsl[-1] + n)
            lens.append(s.start + n)
            max_blocks = max(max_blocks, len(s.block_ids[0]))
            if s.sample:
                sample_idx.extend(range(qsl[-1] - 1 - len(s.draft_token_ids), qsl[-1]))
        if faults:
            raise RequestFaults(faults)
        tables = [s.block_ids[0] + [0] * (max_blocks - len(s.block_ids[0])) for s in scheduled]
        t = self._host
        meta = AttentionMetadata(slot_mapping=t(slots, torch.long), block_tables=t(tables, torch.int32),
                                 seq_lens=t(lens, torch.int32), query_start_loc=t(qsl, torch.int32),
                                 max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(lens))),
                                 max_seq_len=max(lens), seq_lens_host=tuple(lens), query_start_loc_host=tuple(qsl))
        if self.layer_group is not None:  # several table groups: theirs too (worker/group_inputs.py)
            meta.group_tables = group_tables(scheduled, self.block_size, max_blocks, t)
            meta.layer_group = self.layer_group
        return t(ids, torch.long), t(pos, torch.long), meta, sample_idx

    def _entry_inputs(self, s: ScheduledRequest) -> tuple[list[int], list[int]]:
        """One scheduled entry's input token ids (its tokens, then its drafts) and KV slots."""
        n, bs, table = s.num_query_tokens, self.block_size, s.block_ids[0]
        if s.token_ids is not None and len(s.token_ids) != s.num_tokens:
            raise ValueError(f"request {s.req_id}: {len(s.token_ids)} token ids for {s.num_tokens} tokens")
        toks = [0] * s.num_tokens if s.token_ids is None else list(s.token_ids)
        return toks + list(s.draft_token_ids), [table[p // bs] * bs + p % bs for p in range(s.start, s.start + n)]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepHandle | None:
        """Run one step; None where nothing draws. ``step.lookahead``: one token per entry, this rank's last
        draws, still on the device: nothing waits for them. ``step.defer_sample`` (a lookahead step with
        grammar lanes): launch the forward only; the handle's ``sample()`` draws it once the previous step's
        tokens are on the host and accepted by the grammars, so the masks are filled while the device runs
        this forward; the logits (a CUDA graph's output buffer) are read before anything else is launched.
        Raises RequestFaults, before any device work of the forward, for the requests whose inputs could
        not be built (their block copies ran already: the engine sends the step again without them)."""
        if step.copy_on_write:
            if self.step_publisher is not None:
                self.step_publisher.copy_blocks(step.copy_on_write)
            mapping = self._h2d(list(step.copy_on_write), torch.long)
            self.ops.copy_blocks(unique_block_tensors(self.kv_caches), mapping)
        if step.swap_in:  # after copy-on-write, before any read of the blocks (kv/tiers.py: the copy order)
            if self.step_publisher is not None:  # every rank holds its shard of the blocks
                self.step_publisher.swap_in(list(step.swap_in))
            self._swap_gate = self.kv_transfer.swap_in(list(step.swap_in))
        if self.hidden_capture is not None:
            self.hidden_capture.forget(step.finished_req_ids)
        faults = self.drawer.update(step)  # after the copies: a step sent again does not repeat them
        if faults:
            raise RequestFaults(faults)
        scheduled, lanes = step.scheduled, step.samples
        input_ids, positions, meta, sample_idx = self.prepare_host(scheduled)
        input_tokens = self.drawer.lookahead_inputs(scheduled) if step.lookahead else None
        gate, self._swap_gate = self._swap_gate, None  # taken once the step is sure to run (no RequestFaults)
        # prompt_logprobs: the rows predicting a prompt token go through compute_logits with the sampled ones
        prompt = prompt_rows(scheduled, self.drawer.requests) if not step.lookahead else None
        logit_idx, sample_at, prompt_at = merge_rows(sample_idx, prompt) if prompt else (sample_idx, None, None)
        want_logits = bool(lanes) or bool(prompt)
        routed = self.routing.wanted(scheduled, self.drawer.requests) if self.routing.blocks else []
        if self.step_publisher is not None:  # the other ranks run the same forward (3: eagerly, as this one)
            self.step_publisher.step(input_ids, positions, meta, logit_idx, int(want_logits) | (2 * bool(routed and
                                     want_logits)), input_tokens)
        if want_logits and not routed and self.graphs is not None and self.graphs.can_run(len(logit_idx), meta):
            # pure decode: replay a CUDA graph
            if gate is not None:  # the graph reads every layer: all the swap-ins first
                gate.finish()
            logits = self.graphs.run(input_tokens if step.lookahead else input_ids, positions, meta)
        else:
            input_ids, positions, meta = self._to_device(input_ids, positions, meta)
            if step.lookahead:
                input_ids = input_tokens.to(torch.long)
            caches = self.kv_caches if gate is None else LayerGatedCaches(self.kv_caches, gate)
            try:
                if routed:
                    with self.routing.record() as got:
                        hidden = self.model(input_ids, positions, caches, meta)
                    self._side_outputs.extend(self.routing.chunks(got, routed))
                else:
                    hidden = self.model(input_ids, positions, caches, meta)
            finally:
                if gate is not None:  # copies issued lazily layer by layer: all of them, also if the forward raised
                    gate.finish()
            if self.hidden_capture is not None:
                self.hidden_capture.record(scheduled)
            if not want_logits:
                return None
            if len(logit_idx) != hidden.shape[0]:  # logit_idx is increasing: equal lengths = every row
                hidden = hidden.index_select(0, self._h2d(logit_idx, torch.long))
            logits = self.model.compute_logits(hidden)
        if prompt:
            self._side_outputs.extend(compute_chunks(logits.index_select(0, self._h2d(prompt_at, torch.long)), prompt))
            if not lanes:
                return None
            logits = logits.index_select(0, self._h2d(sample_at, torch.long))
        # a deferred step's inputs too are built now, with its pending token counted, behind the forward:
        # they are what they would be once that token is appended
        return self.drawer.launch(logits, step, [s for s in scheduled if s.sample])

    def take_side_outputs(self) -> list:
        """What the steps launched since the last call computed for particular requests besides their
        tokens (prompt logprob chunks, turnout/worker/prompt_logprobs.py; routed experts,
        turnout/worker/routed_experts.py), each with ``request_id`` and ``kind``;
        the core hands them to the output processor."""
        out, self._side_outputs = self._side_outputs, []
        return out

    def flush_swaps(self) -> None:
        """Run the swap-ins of a step that ended before its forward (every request in it failed): the
        blocks they fill are registered already, so their copies must land all the same."""
        gate, self._swap_gate = self._swap_gate, None
        if gate is not None:
            gate.finish()

    def swap_out(self, pairs) -> None:
        """Device -> host block copies (swap-outs, evictions to the host tier), before anything else of the
        step (kv/tiers.py)."""
        if self.step_publisher is not None:
            self.step_publisher.swap_out(list(pairs))
        self.kv_transfer.swap_out(list(pairs))
