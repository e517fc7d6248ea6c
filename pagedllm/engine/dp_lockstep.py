"""``DPLockstep``: the data-parallel engines of ``-dp N --enable-expert-parallel`` step
together (vLLM's "waves"), because every MoE layer of every step is a collective over all of
them (``fused_moe/dp_exchange``).

A wave is a run of lockstep steps. Each engine counts the waves that ended
(``current_wave``: the same number on every engine, since a wave ends by a collective
decision). Inside a wave every engine, at every step::

    sync: all-reduce [has unfinished requests, stop]  (the data-parallel group)
      any stop      -> all leave the loop together (shutdown, or the front end is gone)
      no work       -> the wave ends: current_wave += 1, every engine goes idle
      otherwise     -> an engine with requests steps, one without runs a dummy step
                       (``EngineCore.execute_dummy_batch``: zero tokens through the MoE layers)

An idle engine that gets a request starts the wave it is at and announces it
(``EngineCoreOutputs.start_wave``); the front end (``DPAsyncMPClient``, the coordinator)
passes START_DP_WAVE(wave) to the other engines, which join it. A START for a wave that
already ended is stale and ignored (the request that caused it was served in that wave); one
for the next wave, arriving while this engine still runs the current one, is kept until it
ends. So an engine enters the sync exactly when all others do, and no engine waits for one
that sleeps.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator


class DPLockstep:
    """The wave state of one data-parallel engine (see the module docstring).

    Args:
        group: the data-parallel group (``pagedllm.distributed.get_dp_group``).
        device: where the sync's two flags live (the group backend's device).

    Attributes:
        current_wave: waves that ended so far.
        running: whether this engine is inside a wave (it must then call ``sync`` each step).
    """

    def __init__(self, group: GroupCoordinator, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.current_wave = 0
        self.running = False
        self._next_wave: Optional[int] = None

    def request_added(self) -> Optional[int]:
        """A request arrived: start the current wave if idle; returns the wave to announce to
        the other engines (None: already running)."""
        if self.running:
            return None
        self.running = True
        return self.current_wave

    def start_wave(self, wave: int) -> None:
        """Another engine started ``wave``: join it (ignored if it already ended; kept for
        later when it is the next one and this engine still runs the current one)."""
        if wave < self.current_wave:
            return
        if self.running:
            if wave > self.current_wave:
                self._next_wave = wave
            return
        self.running = True

    def sync(self, has_work: bool, stop: bool) -> tuple[bool, bool]:
        """The collective of one lockstep step: ``(any engine has work, any engine stops)``.
        When none has work and none stops, the wave ends here (``current_wave`` + 1) and this
        engine is idle, unless the next wave was announced meanwhile.

        Raises:
            RuntimeError: the group failed (another engine died).
        """
        flags = self.group.all_reduce(torch.tensor([int(has_work), int(stop)], dtype=torch.int64, device=self.device))
        any_work, any_stop = bool(flags[0].item()), bool(flags[1].item())
        if not any_work and not any_stop:
            self.current_wave += 1
            self.running = self._next_wave == self.current_wave
            self._next_wave = None
        return any_work, any_stop
