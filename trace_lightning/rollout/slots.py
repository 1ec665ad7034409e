"""Continuous batching: a fixed number of decode slots, each given the next waiting prompt as soon as its
sequence ends, so the decode batch stays full when response lengths are long-tailed (RL groups).

Outputs (tokens, logprobs, and the Recorder's routes and records) are indexed by sequence; the KV cache and
everything a decode step feeds the model are indexed by slot. ``slot_seq`` (slots,) says which sequence a
slot holds, and a step gathers that sequence's prompt length, budget and sampling key through it, with the
slot's own step counter: a sequence sees the positions and the noise (a function of its key and step) it
would see in a static batch or alone. The step is device-only like DecodeLoop's, so it can still be captured
and replayed as a CUDA graph: refills run between steps, at a host check (every ``sync_every`` steps, and at
the step where a slot's max_new_tokens runs out, which the host knows without asking), and write only into the
buffers the step reads (in place). The host sync is the same one the static loop makes to see which rows are done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trace_lightning.rollout.cache import KVCache
from trace_lightning.rollout.decode import DecodeLoop, Logits

Prefill = Callable[[list[int], list[int], bool], Tensor]
"""(slots, seqs, fresh) -> logits (k, V) at the last token of each prompt seqs[i], prefilled into cache row
slots[i]; fresh: the cache has never been written (the first fill of every slot)."""


@dataclass
class SlotState:
    """What a step reads or writes. Per sequence: tokens, logprobs (N_seq, N) (the outputs), keys (N_seq, 2),
    lens and max_new (N_seq,). Per slot: slot_seq, step, done (slots,) and last (slots, 1)."""

    tokens: Tensor
    logprobs: Tensor
    keys: Tensor  # (N_seq, 2) sampling keys (sampling.seed_keys)
    lens: Tensor  # (N_seq,) prompt lengths
    max_new: Tensor  # (N_seq,)
    stop: Tensor  # (n_stop,) stop token ids
    n_slots: int

    def __post_init__(self) -> None:
        dev, n = self.tokens.device, self.n_slots
        self.slot_seq = torch.zeros(n, dtype=torch.long, device=dev)  # the sequence each slot holds
        self.step = torch.ones(n, dtype=torch.long, device=dev)  # the step each slot decodes next (>= 1)
        self.done = torch.ones(n, dtype=torch.bool, device=dev)  # an empty slot counts as done
        self.last = torch.zeros(n, 1, dtype=torch.long, device=dev)  # the token fed to each slot's next step

    @classmethod
    def empty(cls, n_seq: int, max_new: int, n_slots: int, n_stop: int, device: torch.device) -> SlotState:
        """Buffers for n_seq sequences of up to max_new tokens in n_slots slots; begin() fills them."""
        def ints(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(ints(n_seq, max_new), torch.zeros(n_seq, max_new, dtype=torch.float32, device=device),
                   ints(n_seq, 2), ints(n_seq), ints(n_seq), ints(n_stop), n_slots)

    def begin(self, keys: Tensor, lens: Tensor, max_new: Tensor, stop: Tensor) -> None:
        """A generate call in these buffers: the sequences' sampling keys, prompt lengths and budgets, the stop ids;
        every slot empty. Everything is copied in, nothing replaced (a captured step reads these tensors)."""
        self.tokens.zero_()
        self.logprobs.zero_()
        for buffer, value in ((self.keys, keys), (self.lens, lens), (self.max_new, max_new), (self.stop, stop)):
            buffer.copy_(value)
        self.slot_seq.zero_()
        self.step.fill_(1)
        self.done.fill_(True)
        self.last.zero_()

    def seat(self, slots: Tensor, seqs: Tensor, tok: Tensor, lp: Tensor) -> None:
        """Slots (k,) take sequences seqs (k,) with their step-0 token and logprob (sampled from the prefill)."""
        self.tokens[seqs, 0], self.logprobs[seqs, 0] = tok, lp
        self.slot_seq[slots] = seqs
        self.step[slots] = 1
        self.done[slots] = torch.isin(tok, self.stop) | (self.max_new[seqs] <= 1)
        self.last[slots, 0] = tok


class SlotLoop(DecodeLoop):
    """Decodes N_seq sequences in ``n_slots`` slots, refilling done slots at every host check."""

    state: SlotState

    def __init__(
        self,
        logits: Logits,
        draw: Callable[..., tuple[Tensor, Tensor]],
        state: SlotState,
        cache: KVCache,
        sync_every: int,
        use_graph: bool,
    ) -> None:
        super().__init__(logits, draw, state, cache, sync_every, use_graph)  # type: ignore[arg-type]
        self.load(lambda slots, seqs, fresh: torch.empty(0), [], [])

    def load(self, prefill: Prefill, lens: list[int], max_new: list[int]) -> None:
        """A generate call: its prompts' prefill, lengths and budgets (host copies), every prompt waiting; the
        counters from zero (a captured graph stays)."""
        self.begin()
        self.prefill, self.lens, self.max_new = prefill, lens, max_new
        self.waiting = deque(range(len(self.lens)))
        self.refills = 0
        n = self.state.n_slots
        # host bounds for the eager loop's attention window: the position each slot writes next, and its last
        self.next_pos, self.last_pos = [0] * n, [0] * n
        self.ends_at = [0] * n  # host: the step before which each slot is done by length at the latest

    def step(self) -> None:
        """One decode step of every slot, device ops only; a done slot runs on (frozen) but writes no output."""
        st = self.state
        seq = st.slot_seq
        lens, max_new = st.lens[seq], st.max_new[seq]  # (slots,)
        positions = torch.minimum(lens + st.step - 1, lens + max_new - 1)[:, None]  # (slots, 1); frozen once full
        tok, lp = self.draw(self.logits(st.last, positions), step=st.step[:, None], keys=st.keys[seq])
        col = st.step.clamp(max=st.tokens.shape[1] - 1)  # a done slot's step may run past the buffer
        live = ~st.done
        st.tokens[seq, col] = torch.where(live, tok, st.tokens[seq, col])
        st.logprobs[seq, col] = torch.where(live, lp, st.logprobs[seq, col])
        st.done |= torch.isin(tok, st.stop) | (max_new <= st.step + 1)
        st.last.copy_(tok[:, None])
        st.step += 1

    def run(self) -> int:  # type: ignore[override]
        """Fill every slot, then decode until every sequence is done -> decode steps run.

        The host checks the done flags every ``sync_every`` steps (for stop tokens) and also at the step where a
        slot is known to reach its max_new_tokens while prompts wait, so a slot ended by its length is refilled
        at once; once no prompt waits, the loop ends without a check when every slot's budget has run out."""
        self._fill(list(range(self.state.n_slots)), at=1, fresh=True)
        i = 0
        while True:
            i += 1
            if not self.waiting and i >= max(self.ends_at):
                return i - 1
            due = i % self.sync_every == 0 or (self.waiting and i >= min(self.ends_at))
            if due and not self._refill(i):
                return i - 1
            self.advance(max(self.next_pos) + 1, capture=i >= 3)
            self.next_pos = [min(p + 1, last) for p, last in zip(self.next_pos, self.last_pos, strict=True)]

    def _refill(self, i: int) -> bool:
        """Host check before step i: give done slots the waiting prompts, in order (again if a new one ends at
        once, e.g. max_new_tokens 1) -> whether any slot is still decoding."""
        self.on_check()
        while True:
            done = self.state.done.tolist()  # the host sync
            free = [s for s, d in enumerate(done) if d][: len(self.waiting)]
            if not free:
                return not all(done)
            self._fill(free, at=i, fresh=False)
            self.refills += len(free)

    def _fill(self, slots: list[int], at: int, fresh: bool) -> None:
        """Prefill the next waiting prompts into `slots` and seat them with their step-0 token, before step `at`."""
        seqs = [self.waiting.popleft() for _ in slots]
        logits = self.prefill(slots, seqs, fresh)
        dev = self.state.tokens.device
        slot_t, seq_t = torch.tensor(slots, device=dev), torch.tensor(seqs, device=dev)
        tok, lp = self.draw(logits, step=0, keys=self.state.keys[seq_t])
        self.state.seat(slot_t, seq_t, tok, lp)
        for s, q in zip(slots, seqs, strict=True):
            self.next_pos[s], self.last_pos[s] = self.lens[q], self.lens[q] + self.max_new[q] - 1
            self.ends_at[s] = at + self.max_new[q] - 1  # the first step before which its budget is spent
