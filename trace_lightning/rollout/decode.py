"""The decode loop as device-only work on static buffers, replayable as one CUDA graph across generate calls.

Each step reads the step counter, derives every row's position from it, runs the forward, samples, and writes
the token, its logprob and the done flags into preallocated tensors, all on the device. That makes the step a
pure function of buffers that live across steps, which is what a CUDA graph replay needs: on CUDA the
engine runs the first steps eagerly (they compile kernels and allocate the record buffers), captures one
step, and replays it, so a step costs one graph launch instead of hundreds of kernel launches. Any capture
failure (an op that syncs with the host, say) falls back to the eager loop, with a warning.

A DecodeSession is those buffers with the cache, the recorder and the captured graph: the engine keeps the last
one and hands it to the next generate call of the same shape (an RL fit's every rollout), which loads its inputs
into the same buffers and replays from its first step, with no eager warm-up and no capture. Weight updates write
into the weights' tensors in place (rollout/convert.py), so the graph reads the new weights.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trace_lightning.model.hooks import QuantHook
from trace_lightning.rollout.cache import KVCache
from trace_lightning.rollout.capture import Recorder

Logits = Callable[[Tensor, Tensor], Tensor]  # (tokens (B, 1), positions (B, 1)) -> next-token logits (B, V)


@dataclass
class DecodeState:
    """Everything a step reads or writes; tokens/logprobs (B, N) are the generate call's outputs."""

    tokens: Tensor
    logprobs: Tensor
    done: Tensor  # (B,) bool
    lens: Tensor  # (B,) prompt lengths
    last_pos: Tensor  # (B,) the last position a row may write
    max_new: Tensor  # (B,)
    stop: Tensor  # (n_stop,) stop token ids

    def __post_init__(self) -> None:
        self.step = torch.ones(1, dtype=torch.long, device=self.tokens.device)  # the step being decoded (>= 1)
        self.last = self.tokens[:, :1].clone()  # (B, 1) the token fed to the next step

    @classmethod
    def empty(cls, batch: int, max_new: int, n_stop: int, device: torch.device) -> DecodeState:
        """Buffers for `batch` sequences of up to `max_new` tokens ending at any of `n_stop` stop ids; begin()
        fills them."""
        def ints(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(ints(batch, max_new), torch.zeros(batch, max_new, dtype=torch.float32, device=device),
                   torch.zeros(batch, dtype=torch.bool, device=device), ints(batch), ints(batch), ints(batch),
                   ints(n_stop))

    def begin(self, first: Tensor, first_logprob: Tensor, lens: Tensor, max_new: Tensor, stop: Tensor) -> None:
        """A generate call in these buffers: the prefill's tokens and logprobs (B,) at column 0, the rows' prompt
        lengths and token budgets (B,), the stop ids; step 1 next. Everything is copied in, nothing replaced."""
        self.tokens.zero_()
        self.logprobs.zero_()
        self.tokens[:, 0], self.logprobs[:, 0] = first, first_logprob
        self.lens.copy_(lens)
        self.max_new.copy_(max_new)
        self.last_pos.copy_(lens + max_new - 1)  # the last position a row may write
        self.stop.copy_(stop)
        self.done.copy_(torch.isin(first, stop) | (max_new <= 1))
        self.step.fill_(1)
        self.last.copy_(first[:, None])


class DecodeLoop:
    """Steps 1 .. N-1 of a generate call, eager or as CUDA graph replays."""

    def __init__(self, logits: Logits, draw: Callable[..., tuple[Tensor, Tensor]], state: DecodeState,
                 cache: KVCache, sync_every: int, use_graph: bool) -> None:
        self.logits, self.draw, self.state, self.cache = logits, draw, state, cache
        self.sync_every, self.use_graph = sync_every, use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_steps = 0
        self.capture_s = 0.0
        """Wall seconds spent capturing the graph in this generate call (0 when a kept session's graph replays)."""
        self.on_check: Callable[[], None] = lambda: None
        """Called at every host check, before the done flags are read (the recorder flushes its ring there)."""

    def step(self) -> None:
        """One decode step, device ops only (the step counter advances on the device)."""
        st = self.state
        positions = torch.minimum(st.lens + (st.step - 1), st.last_pos)[:, None]  # (B, 1); frozen once full
        tok, lp = self.draw(self.logits(st.last, positions), step=st.step)
        st.tokens.index_copy_(1, st.step, tok[:, None])
        st.logprobs.index_copy_(1, st.step, lp[:, None])
        st.done |= torch.isin(tok, st.stop) | (st.max_new <= st.step + 1)
        st.last.copy_(tok[:, None])
        st.step += 1

    def begin(self) -> None:
        """A new generate call on this loop: its counters from zero (a captured graph stays)."""
        self.graph_steps, self.capture_s = 0, 0.0

    def run(self, n_steps: int, visible: Callable[[int], int]) -> int:
        """Decode steps 1 .. n_steps; `visible(i)` is the eager loop's cache window at step i. -> steps run."""
        steps = 0
        for i in range(1, n_steps + 1):
            if i % self.sync_every == 0:
                self.on_check()
                if bool(self.state.done.all()):
                    break
            self.advance(visible(i), capture=i >= 3 and n_steps - i >= 2)
            steps += 1
        return steps

    def advance(self, visible: int, capture: bool) -> None:
        """One step: a graph replay, or an eager step attending over keys 0..visible-1. With `capture` the
        first call captures the graph (steps 1-2 ran eagerly: kernels compiled, record buffers allocated)."""
        if self.graph is None and self.use_graph and capture:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            self.graph_steps += 1
        else:
            self.cache.visible = visible
            self.step()

    def _capture(self) -> None:
        """Capture one step; the graph attends over the whole cache window (the mask hides the unwritten)."""
        self.use_graph = False  # one try per session
        self.cache.visible = self.cache.max_len
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step()
        except Exception as err:  # noqa: BLE001  (capture is an optimisation: fall back to eager steps)
            torch.cuda.synchronize()
            warnings.warn(f"decode step not captured as a CUDA graph ({type(err).__name__}: {err}); running eagerly",
                          RuntimeWarning, stacklevel=3)
            return
        finally:
            self.capture_s += time.perf_counter() - start
        self.graph = graph


@dataclass
class DecodeSession:
    """Everything the decode steps of a generate call read and write, reusable by a later call whose `key` (batch,
    cache length, token budget, record layout, sampling settings) is the same."""

    key: tuple[Any, ...]
    cache: KVCache
    recorder: Recorder
    hook: QuantHook | None
    keys: Tensor
    """(sequences, 2) their sampling keys (rollout/sampling.py), copied in by each call."""
    state: Any
    """DecodeState, or a SlotState (rollout/slots.py) when the call decodes in slots (continuous batching)."""
    loop: DecodeLoop
    """The loop and its captured graph: a DecodeLoop, or its SlotLoop subclass."""
