"""Token sampling, vectorised over the batch.

One call handles a whole step: ``Sampler()(logits [B, V] fp32, rows) -> SampleOutput``. Per-row
work in Python is limited to what is inherently per request (sparse masks, seeded generators);
every dense operation over the vocabulary runs once for the batch, and the expensive ones (penalty
counts, sorting for top-p) only when some row asks for them.

Order (as in vLLM / Hugging Face): bad-token and min_tokens masks -> repetition, presence and
frequency penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.
Log-probabilities are those of the model (log-softmax of the raw logits), reported for the chosen
token and the top ``logprobs`` alternatives.

Host syncs: ``sample`` returns the step's results on the device (``DeviceSample``) without waiting
for them; small per-row parameter tensors go up from pinned memory without blocking. The host
learns the results through ONE copy (``DeviceSample.packed``: tokens, and logprobs when asked for,
in one tensor): blocking in ``__call__``, asynchronous in the executor's overlapped loop
(``backend/engine/overlap.py``). Only penalties (rare; those steps are synchronous anyway, see
``needs_history``) still build their tensors with blocking copies.

Reproducibility: a request with a ``seed`` owns a ``torch.Generator`` seeded once; each step it
draws exactly one row of exponential noise (the Gumbel/exponential-race form of categorical
sampling: ``argmax(p / E)``, ``E ~ Exp(1)``), so its tokens do not depend on what else is batched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from backend.engine.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs about one sequence for one draw."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None   # required when params.seed is set
    guide: object | None = None                # backend.engine.guided.Guide when params.guide is set
    # What the parameters ask of every step, worked out once (the executor keeps one row per request
    # for its life): ``plain`` = greedy argmax and nothing else (no logprobs, masks, bias, penalties
    # or grammar), the whole step's sampling when every row is; ``history``: see needs_history.
    plain: bool = field(init=False)
    history: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.history = needs_history(p)
        self.plain = (p.temperature == 0.0 and not p.logprobs and not p.bad_token_ids and not p.logit_bias
                      and p.min_tokens == 0 and not _has_penalty(p) and self.guide is None)


@dataclass
class DeviceSample:
    """One step's draws, still on the device. ``packed()`` is what goes to the host in one copy;
    ``unpack(host)`` turns that copy into a ``SampleOutput``."""
    tokens: torch.Tensor                     # [B] int64
    logprob_counts: list[int]                # per row: how many top alternatives it asked for
    chosen: torch.Tensor | None = None       # [B] fp32 logprob of the chosen token
    top_vals: torch.Tensor | None = None     # [B, n] fp32
    top_idx: torch.Tensor | None = None      # [B, n] int64

    def packed(self) -> torch.Tensor:
        """Tokens alone (int64), or tokens + logprobs as float64: token ids and fp32 values are
        exact in float64, so one tensor (one transfer) carries everything the host needs."""
        if self.chosen is None:
            return self.tokens
        return torch.cat([self.tokens.double(), self.chosen.double(), self.top_vals.double().flatten(),
                          self.top_idx.double().flatten()])

    def unpack(self, host: torch.Tensor) -> "SampleOutput":
        b = len(self.logprob_counts)
        if self.chosen is None:
            return SampleOutput(host.tolist(), [None] * b)
        vals = host.tolist()
        n = self.top_vals.shape[1]
        tokens = [int(t) for t in vals[:b]]
        chosen = vals[b:2 * b]
        top_vals = vals[2 * b:2 * b + b * n]
        top_idx = vals[2 * b + b * n:]
        result = []
        for i, k in enumerate(self.logprob_counts):
            o = i * n
            result.append((chosen[i], [(int(t), v) for t, v in zip(top_idx[o:o + k], top_vals[o:o + k])])
                          if k > 0 else None)
        return SampleOutput(tokens, result)


@dataclass
class SampleOutput:
    token_ids: list[int]
    # Per row: None, or (chosen token's logprob, [(token, logprob), ...] top-n alternatives).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    # torch seeds are 64-bit signed internally; fold the uint64 range Triton allows into it.
    g.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return g


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        """Sample and wait for the result (one blocking copy)."""
        ds = self.sample(logits, rows)
        return ds.unpack(ds.packed().cpu())

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> DeviceSample:
        """Sample without waiting for the device (see the module's note on host syncs)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per sample row"
        if all(r.plain for r in rows):
            # Greedy and nothing else (the throughput runs' case): no float copy of the logits, the
            # argmax of a bf16 row is that of its exact fp32 values, first index on ties alike.
            return DeviceSample(logits.argmax(dim=-1), [0] * len(rows))
        raw = logits
        logits = logits.float().clone() if self._needs_edit(rows) else logits.float()
        self._apply_bias(logits, rows)
        self._apply_guides(logits, rows)
        self._apply_masks(logits, rows)
        self._apply_penalties(logits, rows)

        greedy = [r.params.temperature == 0.0 for r in rows]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows, greedy)
        counts = [r.params.logprobs for r in rows]
        out = DeviceSample(tokens, counts)
        if any(k > 0 for k in counts):
            lp = raw.float().log_softmax(dim=-1)
            out.chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
            out.top_vals, out.top_idx = lp.topk(max(counts), dim=-1)
        return out

    # -- masks and penalties -----------------------------------------------------------------
    def _needs_edit(self, rows: Sequence[SampleRow]) -> bool:
        return any(self._has_mask(r) or _has_penalty(r.params) or r.params.temperature != 0.0
                   or r.guide is not None for r in rows)

    def _apply_guides(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        """Structured output: each guided row's grammar mask (filled on the host, one small copy)."""
        idx = [i for i, r in enumerate(rows) if r.guide is not None]
        if not idx:
            return
        from backend.engine.guided import apply_bitmask  # only engines that serve guided requests
        words = rows[idx[0]].guide.new_bitmask(len(idx))
        for j, i in enumerate(idx):
            rows[i].guide.fill(words, j)
        if len(idx) == len(rows):
            apply_bitmask(logits, words.to(logits.device))
        else:
            sel = _to_device(idx, logits.device)
            logits[sel] = apply_bitmask(logits[sel], words.to(logits.device))

    def _has_mask(self, r: SampleRow) -> bool:
        p = r.params
        return bool(p.bad_token_ids) or bool(p.logit_bias) or (len(r.output_token_ids) < p.min_tokens)

    def _apply_bias(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        """Add each row's logit_bias (before the masks, so that a forbidden token stays forbidden)."""
        row_idx: list[int] = []
        col_idx: list[int] = []
        vals: list[float] = []
        for i, r in enumerate(rows):
            for tok, val in r.params.logit_bias:
                row_idx.append(i)
                col_idx.append(tok)
                vals.append(float(val))
        if row_idx:
            dev = logits.device
            logits.index_put_((_to_device(row_idx, dev), _to_device(col_idx, dev)),
                              _to_device(vals, dev).to(logits.dtype), accumulate=True)

    def _apply_masks(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        """Forbid bad-word completions and, before ``min_tokens`` are generated, every stop token."""
        row_idx: list[int] = []
        col_idx: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.bad_token_ids:
                history = list(r.prompt_token_ids[-64:]) + list(r.output_token_ids)
                for seq in p.bad_token_ids:
                    # A bad word is forbidden as the token that would complete it.
                    prefix = list(seq[:-1])
                    if not prefix or history[-len(prefix):] == prefix:
                        row_idx.append(i)
                        col_idx.append(seq[-1])
            if len(r.output_token_ids) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                for tok in stops:
                    row_idx.append(i)
                    col_idx.append(tok)
        if row_idx:
            logits[_to_device(row_idx, logits.device), _to_device(col_idx, logits.device)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not idx:
            return
        dev = logits.device
        n, vocab = len(idx), logits.shape[1]
        sub = logits[idx]
        # Output-token counts (presence/frequency) and prompt+output occurrence (repetition).
        out_counts = torch.zeros(n, vocab, device=dev)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        for j, i in enumerate(idx):
            r = rows[i]
            if r.output_token_ids:
                toks = torch.tensor(list(r.output_token_ids), device=dev)
                out_counts[j].index_add_(0, toks, torch.ones(len(toks), device=dev))
            if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
                seen[j, torch.tensor(list(r.prompt_token_ids), device=dev)] = True
        seen |= out_counts > 0
        rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], device=dev).view(-1, 1)
        pres = torch.tensor([rows[i].params.presence_penalty for i in idx], device=dev).view(-1, 1)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], device=dev).view(-1, 1)
        # Repetition (CTRL paper / HF): shrink positive logits, grow negative ones.
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
        logits[idx] = sub

    # -- random sampling ---------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRow], greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        b, vocab = logits.shape
        greedy_t = _to_device(greedy, dev)
        temp = _to_device([r.params.temperature if not g else 1.0 for r, g in zip(rows, greedy)],
                          dev).view(-1, 1)
        argmax = logits.argmax(dim=-1)
        scaled = logits / temp

        top_k = [r.params.top_k for r in rows]
        if any(0 < k < vocab for k in top_k):
            ks = [k if 0 < k < vocab else vocab for k in top_k]
            k_t = _to_device(ks, dev)
            kmax = max(ks)               # from the host list: int(k_t.max()) would wait for the device
            top_vals = scaled.topk(kmax, dim=-1).values
            kth = top_vals.gather(1, (k_t - 1).view(-1, 1))  # value of each row's k-th best token
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))

        top_p = [r.params.top_p for r in rows]
        if any(p < 1.0 for p in top_p):
            p_t = _to_device(top_p, dev).view(-1, 1)
            sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)
            probs_sorted = sorted_vals.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches p: drop a token if the mass BEFORE it does.
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            drop_sorted = mass_before >= p_t
            drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))

        probs = scaled.softmax(dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(p > 0.0 for p in min_p):
            mp_t = _to_device(min_p, dev).view(-1, 1)
            probs = probs.masked_fill(probs < mp_t * probs.max(dim=-1, keepdim=True).values, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            fresh = torch.empty(len(unseeded), vocab, device=dev).exponential_()
            if len(unseeded) == b:
                noise = fresh
            else:
                noise[_to_device(unseeded, dev)] = fresh
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_t, argmax, sampled)



def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor. On CUDA it goes up from pinned memory without blocking:
    ``torch.tensor(values, device="cuda")`` waits for every queued kernel first (a pageable copy),
    which would stall the overlapped loop once per step."""
    t = torch.tensor(values)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def needs_history(p: SamplingParams) -> bool:
    """Rows that read the values of earlier output tokens (bad words, penalties): the overlapped loop
    resolves the previous step's tokens before sampling them (the host does not know them yet)."""
    return bool(p.bad_token_ids) or _has_penalty(p) or p.guide is not None


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
