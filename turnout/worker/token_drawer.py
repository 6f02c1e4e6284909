"""The rank's drawing of tokens: the requests it keeps between steps (from the step contract's ``NewRequest``,
until their ids come back finished), each step's sampling inputs (one row per position drawn: an entry's
last token and each of its drafts), the draw, and the last draws, which a lookahead step reads as its
inputs while they are still on the device."""

from __future__ import annotations

import dataclasses

import torch

from turnout.layers.sampler import SamplerOutput, sample
from turnout.worker import step_sampling
from turnout.worker.step import ScheduledRequest, SchedulerOutput
from turnout.worker.step_sampling import CachedRequest, StepHandle, build_batch, start_readback


class TokenDrawer:
    def __init__(self, ops, device, vocab_size: int, max_num_seqs: int, upload=None, download=None):
        """``upload`` / ``download``: the runner's side streams (None off CUDA): the sampling inputs go up
        while the forward runs, the draws come down while the next step starts."""
        self.ops, self.device, self.vocab_size, self.max_num_seqs = ops, device, vocab_size, max_num_seqs
        self._upload, self._download = upload, download
        self.pin_memory = device.type == "cuda"
        self.requests: dict[int, CachedRequest] = {}
        self.grammar_stage = None  # made when a grammar lane first draws
        self._last_draws = None  # (req ids, tokens on the device) of the last draw

    def _h2d(self, x, dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, pin_memory=self.pin_memory).to(self.device, non_blocking=True)

    def update(self, step: SchedulerOutput) -> dict[int, BaseException]:
        """Forget the finished requests, keep the new ones; a new one that cannot be kept is a fault of its own."""
        for rid in step.finished_req_ids:
            self.requests.pop(rid, None)
        faults = {}
        for new in step.new_requests:
            try:
                self.requests[new.req_id] = CachedRequest.from_new(new, self.vocab_size)
            except Exception as e:  # noqa: BLE001 - traced to this request: the engine sends the step again
                faults[new.req_id] = e
        return faults

    def lookahead_inputs(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """A lookahead step's input tokens: the last draws of those requests, still on the device."""
        if self._last_draws is None:
            raise RuntimeError("a lookahead step with no draw of one token per request before it")
        last_ids, tokens = self._last_draws
        where = {rid: i for i, rid in enumerate(last_ids)}
        order = [where[s.req_id] for s in scheduled]  # KeyError: the engine asked for a draw that never was
        return tokens if order == list(range(len(last_ids))) else tokens.index_select(0, self._h2d(order, torch.long))

    def launch(self, logits: torch.Tensor, step: SchedulerOutput, sampling: list[ScheduledRequest]) -> StepHandle:
        """Draw a step's ``logits`` (rows: the positions of ``sampling``, the entries that sample, in order)
        for its samples, now or, for a deferred step, when the handle says."""
        first_row = [0]
        for s in sampling:
            first_row.append(first_row[-1] + 1 + len(s.draft_token_ids))
        lanes = step.samples
        batch, faults, drafts = self._inputs(lanes, sampling, first_row, step.want_logprobs, int(step.lookahead))
        handle = StepHandle([smp.req_id for smp in lanes], drafts, faults,
                            draw=lambda ended: self._draw(logits, batch, faults, ended), readback=self.start_readback)
        return handle if step.defer_sample else handle.sample()

    def _inputs(self, lanes, sampling, first_row, want_logprobs: int, pending: int):
        """The sampler's rows: per lane, one for its entry's last token and one per draft of that entry.
        A lane whose inputs cannot be built is left out and reported (req_id -> exception)."""
        picked, vals, rows, row_lanes, faults, drafts = [], [], [], [], {}, []
        for smp in lanes:
            entry = sampling[smp.row] if 0 <= smp.row < len(sampling) else None
            d = list(entry.draft_token_ids) if entry is not None and entry.req_id == smp.req_id else []
            drafts.append(d)
            try:
                if entry is None:
                    raise IndexError(f"sample row {smp.row} of {len(sampling)}")
                req = self.requests[smp.req_id]
                lane_vals = [step_sampling.lane_values(req, smp.num_output_tokens + j) for j in range(len(d) + 1)]
            except Exception as e:  # noqa: BLE001 - traced to this lane's request: it fails alone
                faults[smp.req_id] = e
                continue
            for j, v in enumerate(lane_vals):
                vals.append(v)
                rows.append(first_row[smp.row] + j)
                row_lanes.append((len(picked), j))
            picked.append((req, smp, d))
        if not picked:
            return None, faults, drafts

        def build():
            return build_batch(self._h2d, picked, vals, rows, row_lanes, want_logprobs, pending)

        if self._upload is None:
            return build(), faults, drafts
        # queued behind the forward's own input copies, the sampling inputs' copies overlap the forward
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._upload):
            batch = build()
        main.wait_stream(self._upload)
        for f in dataclasses.fields(batch):  # made on the side stream, read on this one
            t = getattr(batch, f.name)
            if isinstance(t, torch.Tensor):
                t.record_stream(main)
        return batch, faults, drafts

    @torch.inference_mode()
    def _draw(self, logits, batch, faults, ended=frozenset()) -> SamplerOutput:
        """Sample a step's logits. ``ended``: requests of a deferred lookahead that ended since it was
        launched: their grammar rows are dropped (their tokens are discarded; their states may be done)."""
        if batch is None:  # every lane failed
            return SamplerOutput(torch.empty(0, dtype=torch.long, device=self.device), faults=dict(faults))
        if ended and batch.grammars:
            batch.grammars = [(i, g) for i, g in batch.grammars if batch.seq_ids[i] not in ended]
        out = sample(self.ops, logits, batch, self._grammar_stage() if batch.grammars else None)
        out.faults.update(faults)
        ids = [rid for rid in batch.seq_ids if rid not in out.faults]
        # one row per request (no drafts): what a lookahead step reads as its inputs
        self._last_draws = (ids, out.tokens) if len(set(ids)) == len(ids) else None
        return out

    def _grammar_stage(self):
        """The structured-output mask stage (turnout/structured/mask.py), made at the first batch with a
        grammar lane: pinned host rows for the logits' width and the largest batch, copied up once a step."""
        if self.grammar_stage is None:
            from turnout.structured.mask import BitmaskStage

            self.grammar_stage = BitmaskStage(self.vocab_size, self.max_num_seqs, self.device)
        return self.grammar_stage

    def start_readback(self, result: SamplerOutput):
        """The host copy of a step's draws: (host SamplerOutput, event or None where the device is the host)."""
        return start_readback(self.device, self._download, result)
