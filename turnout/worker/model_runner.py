"""Batch -> tensors -> model -> sampler. Owns the model, the KV cache and the per-step metadata."""

from __future__ import annotations

import dataclasses
import logging

import torch

from turnout.engine.concurrency import default_max_num_seqs
from turnout.worker.cuda_graphs import maybe_capture
from turnout.worker.kv_sizing import allocate_caches, kv_dtype, model_cache_layout, plan_kv_blocks
from turnout.worker.kv_transfer import KVTransfer, LayerGatedCaches
from turnout.worker.prompt_logprobs import compute_chunks, merge_rows, prompt_rows
from turnout.worker.rank_memory import RankMemory
from turnout.worker.routed_experts import RoutingRecorder
from turnout.layers.attention import AttentionMetadata
from turnout.engine.sequence import SequenceFaults
from turnout.layers.sampler import SamplerOutput, SamplingBatch, sample

logger = logging.getLogger(__name__)


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
        # one state slot per sequence a step may hold, for recurrent layers (none without them)
        self.num_state_slots = (config.max_num_seqs or 256) if self.cache_layout.state_layers else 0
        self.num_blocks = plan_kv_blocks(self)
        # One tuple of tensors per layer, as its spec says: (k, v) [num_blocks, block_size, Hk, D] for attention
        self.kv_caches = allocate_caches(self.cache_layout, self.num_blocks, self.block_size, self.num_state_slots,
                                         self.device)
        if config.max_num_seqs is None:  # what the cache holds at max_model_len (turnout/engine/concurrency.py)
            longest = self.cache_layout.max_blocks(self.max_model_len, self.block_size, config.max_num_batched_tokens)
            seqs = default_max_num_seqs(self.num_blocks, self.block_size, longest * self.block_size)
            self.config = config = dataclasses.replace(config, max_num_seqs=min(seqs, self.num_state_slots or seqs))
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB, %s; %s); max_num_seqs %d", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_bytes / 2**30,
                    str(self.kv_dtype).replace("torch.", ""), self.cache_layout.describe(), config.max_num_seqs)
        # KV tiers: host caches, swap strategy, start-up measurements for preemption_mode auto (kv_transfer.py)
        self.kv_transfer = KVTransfer(self, config)
        self._swap_gate = None  # this step's swap-ins, passed layer by layer by the next forward
        self.graphs = maybe_capture(self)  # None: every step runs eagerly
        # Sleep / wake and in-place weight updates of this rank (the RL control plane; collective_rpc reaches it)
        self.memory = RankMemory(self)
        self.grammar_stage = None  # made by _grammar_stage() when a grammar lane first samples
        self._side_outputs: list = []  # per-request results of launched steps besides tokens (take_side_outputs)
        self.routing = RoutingRecorder(self.model)  # return_routed_experts (turnout/worker/routed_experts.py)

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

    def prepare(self, scheduled) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """prepare_host, then one async copy each to the device."""
        ids, pos, meta, sample_idx = self.prepare_host(scheduled)
        return (*self._to_device(ids, pos, meta), sample_idx)

    def _to_device(self, ids, pos, meta):
        dev = self.device
        meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(dev, non_blocking=True) for f in
                                            ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")})
        return ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True), meta

    def prepare_host(self, scheduled, pending: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                        list[int]]:
        """Host lists -> (pinned) CPU tensors. Returns ids, positions, metadata and, per scheduled entry
        that samples, the index of its last token in the flattened batch. ``pending``: a lookahead
        decode step whose input tokens are still on the device (the ids returned are placeholders)."""
        ids, pos, slots, qsl, lens, sample_idx = [], [], [], [0], [], []
        max_blocks = 1
        faults = {}
        for s in scheduled:
            seq, start, n = s.seq, s.start, s.num_tokens
            try:
                e_ids, e_slots = self._entry_inputs(s, pending)
            except Exception as e:  # noqa: BLE001 - traced to this sequence: the core rebuilds the step
                faults[seq.seq_id] = e
                continue
            ids.extend(e_ids)
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(e_slots)
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            max_blocks = max(max_blocks, len(table))
            if s.sample:
                sample_idx.append(qsl[-1] - 1)
        if faults:
            raise SequenceFaults(faults)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
        t = self._host
        meta = AttentionMetadata(slot_mapping=t(slots, torch.long), block_tables=t(tables, torch.int32),
                                 seq_lens=t(lens, torch.int32), query_start_loc=t(qsl, torch.int32),
                                 max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(lens))),
                                 max_seq_len=max(lens))
        return t(ids, torch.long), t(pos, torch.long), meta, sample_idx

    def _entry_inputs(self, s, pending: bool) -> tuple[list[int], list[int]]:
        """One scheduled entry's input token ids and KV slots."""
        seq, start, n, bs = s.seq, s.start, s.num_tokens, self.block_size
        table = seq.block_table
        return ([0] * n if pending else seq.token_ids[start:start + n],
                [table[p // bs] * bs + p % bs for p in range(start, start + n)])

    def _lane_values(self, seq, eos_ids: set[int], pending: int) -> tuple:
        """One lane's sampling inputs, each made to fit its tensor here (admission checked them already;
        this is what keeps a value that slipped through from overflowing a dtype inside the step):
        top_k above the vocabulary is off, seeds are 63-bit, banned and biased ids outside the
        vocabulary are dropped (they must never wrap onto real tokens)."""
        p = seq.params
        vocab = self.vocab_size
        step = seq.num_output_tokens + pending
        banned = ()
        if step < p.min_tokens:
            ids = (set() if p.ignore_eos else eos_ids) | set(p.stop_token_ids)
            banned = sorted(t for t in ids if 0 <= t < vocab)
        top_k = p.top_k if 0 < p.top_k < vocab else 0
        bias = () if not p.logit_bias else tuple((t, float(v)) for t, v in p.logit_bias.items() if 0 <= t < vocab)
        return (float(p.temperature), top_k, float(p.top_p), float(p.min_p), seq.seed % 2**63, step, banned, bias)

    def build_sampling(self, lanes, rows: list[int], eos_ids: set[int], want_logprobs: int,
                       pending: int = 0) -> tuple[SamplingBatch | None, dict[int, BaseException]]:
        """lanes: the sequences drawing a token, with rows[i] the logits row of lane i. ``pending``:
        tokens each lane has drawn that are not in its ``output_token_ids`` yet (a lookahead step).
        A lane whose inputs cannot be built is left out and reported (seq_id -> exception); None when
        no lane is left."""
        vals, faults, kept, kept_rows = [], {}, [], []
        for seq, row in zip(lanes, rows):
            try:
                vals.append(self._lane_values(seq, eos_ids, pending))
            except Exception as e:  # noqa: BLE001 - traced to this lane's request: it fails alone
                faults[seq.seq_id] = e
                continue
            kept.append(seq)
            kept_rows.append(row)
        if not kept:
            return None, faults
        lanes = kept
        ps = [seq.params for seq in lanes]
        temperature, top_k, top_p, min_p, seeds, steps, banned, bias = (list(c) for c in zip(*vals))
        t = self._h2d

        b = SamplingBatch(rows=t(kept_rows, torch.long), temperature=t(temperature, torch.float32),
                          top_k=t(top_k, torch.int32), top_p=t(top_p, torch.float32), min_p=t(min_p, torch.float32),
                          seeds=t(seeds, torch.long), steps=t(steps, torch.long),
                          seq_ids=[seq.seq_id for seq in lanes])
        for i, seq in enumerate(lanes):  # per-request stages on the logits (never in a lookahead step)
            if seq.params.logits_processors:
                b.processors.append((i, list(seq.params.logits_processors), list(seq.output_token_ids)))
            if seq.grammar is not None:
                b.grammars.append((i, seq.grammar))
        if any(p.has_penalties for p in ps):
            if pending:
                raise ValueError("penalties need every drawn token on the host: no lookahead step for them")
            outs = [seq.output_token_ids for seq in lanes]
            prompts = [seq.token_ids[:seq.num_prompt_tokens] for seq in lanes]
            b.output_ids = t(_pad(outs), torch.long)
            b.prompt_ids = t(_pad(prompts), torch.long)
            b.presence = t([p.presence_penalty for p in ps], torch.float32)
            b.frequency = t([p.frequency_penalty for p in ps], torch.float32)
            b.repetition = t([p.repetition_penalty for p in ps], torch.float32)
        if any(banned):
            b.banned = t(_pad([list(x) for x in banned]), torch.long)
        if any(bias):
            width = max(len(x) for x in bias)
            b.bias_ids = t([[i for i, _ in x] + [-1] * (width - len(x)) for x in bias], torch.long)
            b.bias_values = t([[v for _, v in x] + [0.0] * (width - len(x)) for x in bias], torch.float32)
        b.want_logprobs = want_logprobs >= 0
        b.max_logprobs = max(want_logprobs, 0)
        return b, faults

    @torch.inference_mode()
    def execute(self, scheduled, lanes, lane_rows, eos_ids, want_logprobs: int = -1, copy_on_write=(),
                input_tokens: torch.Tensor | None = None, swap_in=(), defer_sample: bool = False):
        """Run one step. lane_rows[i] indexes the scheduled entries that sample (their order).
        ``input_tokens``: a lookahead decode step (one token per scheduled entry): the previous step's
        sampled tokens [n], still on the device, are the inputs; nothing waits for them.
        ``defer_sample`` (a lookahead step with grammar lanes): launch the forward only and return a
        function that samples it. The core calls it once the previous step's tokens are on the host and
        accepted by the grammars, so the masks are filled while the device runs this forward; the logits
        (a CUDA graph's output buffer) are read before anything else is launched."""
        if copy_on_write:
            if self.step_publisher is not None:
                self.step_publisher.copy_blocks(copy_on_write)
            mapping = self._h2d(list(copy_on_write), torch.long)
            self.ops.copy_blocks([c for kv in self.kv_caches for c in kv], mapping)
        if swap_in:  # after copy-on-write, before any read of the blocks (kv/tiers.py: the copy order)
            if self.step_publisher is not None:  # every rank holds its shard of the blocks
                self.step_publisher.swap_in(list(swap_in))
            self._swap_gate = self.kv_transfer.swap_in(list(swap_in))
        pending = input_tokens is not None
        input_ids, positions, meta, sample_idx = self.prepare_host(scheduled, pending)
        gate, self._swap_gate = self._swap_gate, None  # taken once the step is sure to run (no SequenceFaults)
        # prompt_logprobs: the rows predicting a prompt token go through compute_logits with the sampled ones
        prompt = prompt_rows(scheduled) if not pending else None
        logit_idx, sample_at, prompt_at = merge_rows(sample_idx, prompt) if prompt else (sample_idx, None, None)
        want_logits = bool(lanes) or bool(prompt)
        routed = self.routing.wanted(scheduled) if self.routing.blocks else []  # recorded: an eager forward
        if self.step_publisher is not None:  # the other ranks run the same forward (3: eagerly, as this one)
            self.step_publisher.step(input_ids, positions, meta, logit_idx, int(want_logits) | (2 * bool(routed and
                                     want_logits)), input_tokens)
        if want_logits and not routed and self.graphs is not None and self.graphs.can_run(len(logit_idx), meta):
            # pure decode: replay a CUDA graph
            if gate is not None:  # the graph reads every layer: all the swap-ins first
                gate.finish()
            logits = self.graphs.run(input_tokens if pending else input_ids, positions, meta)
        else:
            input_ids, positions, meta = self._to_device(input_ids, positions, meta)
            if pending:
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
        batch, faults = self._sampling_inputs(lanes, lane_rows, eos_ids, want_logprobs, int(pending))
        if defer_sample:
            return lambda: self._draw(logits, batch, faults, lanes)
        return self._draw(logits, batch, faults)

    def _sampling_inputs(self, lanes, lane_rows, eos_ids, want_logprobs: int, pending: int):
        if self._upload is None:
            batch, faults = self.build_sampling(lanes, lane_rows, eos_ids, want_logprobs, pending=pending)
        else:  # queued behind the forward's own input copies, the sampling inputs' copies overlap the forward
            main = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._upload):
                batch, faults = self.build_sampling(lanes, lane_rows, eos_ids, want_logprobs, pending=pending)
            main.wait_stream(self._upload)
            for f in dataclasses.fields(batch) if batch is not None else ():  # made on the side stream, read on this one
                t = getattr(batch, f.name)
                if isinstance(t, torch.Tensor):
                    t.record_stream(main)
        return batch, faults

    @torch.inference_mode()
    def _draw(self, logits, batch, faults, lanes=None):
        """Sample a step's logits. ``lanes``: a deferred lookahead's, whose grammar rows of the lanes that
        ended since it was launched are dropped (their tokens are discarded; their states may be done)."""
        if batch is None:  # every lane failed
            return SamplerOutput(torch.empty(0, dtype=torch.long, device=self.device), faults=faults)
        if lanes is not None and batch.grammars:
            ended = {s.seq_id for s in lanes if s.status.is_finished}
            if ended:
                batch.grammars = [(i, g) for i, g in batch.grammars if batch.seq_ids[i] not in ended]
        out = sample(self.ops, logits, batch, self._grammar_stage() if batch.grammars else None)
        out.faults.update(faults)
        return out

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

    def _grammar_stage(self):
        """The structured-output mask stage (turnout/structured/mask.py), made at the first batch with a
        grammar lane: pinned host rows for the logits' width and the largest batch, copied up once a step."""
        if self.grammar_stage is None:
            from turnout.structured.mask import BitmaskStage

            self.grammar_stage = BitmaskStage(self.vocab_size, self.config.max_num_seqs, self.device)
        return self.grammar_stage


    def start_readback(self, result):
        """Queue the copy of a step's sampler output to pinned host memory on a side stream, after the
        sampler, with an event: neither does a step launched after this one delay reading this one's tokens,
        nor does the copy delay that step.
        Returns (host-side SamplerOutput, event or None where the device is the host)."""
        if self.device.type != "cuda":
            return result, None
        sampled = torch.cuda.Event()
        sampled.record()
        self._download.wait_event(sampled)  # the copy waits for the sampler; the next step does not wait for it
        host = {}
        with torch.cuda.stream(self._download):
            for f in dataclasses.fields(result):
                t = getattr(result, f.name)
                if isinstance(t, torch.Tensor):  # not the faults (host-side already)
                    t.record_stream(self._download)
                    host[f.name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host[f.name].copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._download)
        return dataclasses.replace(result, **host), event


def _pad(rows: list[list[int]]) -> list[list[int]]:
    width = max(1, max(len(r) for r in rows))
    return [r + [-1] * (width - len(r)) for r in rows]
