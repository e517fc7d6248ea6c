"""``DPLockstep``'s waves, one engine against a scripted group: a request starts and announces
the current wave; a START for an ended wave is ignored, one for the next wave, arriving while
the current one runs, is kept; a sync with no work anywhere ends the wave."""

from __future__ import annotations

import torch

from pagedllm.engine.dp_lockstep import DPLockstep


class _ScriptedGroup:
    """A group whose all-reduce adds the other engines' flags given by ``others``."""

    def __init__(self) -> None:
        self.others = [0, 0]
        self.calls = 0

    def all_reduce(self, flags: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return flags + torch.tensor(self.others)


def _lockstep() -> tuple[DPLockstep, _ScriptedGroup]:
    group = _ScriptedGroup()
    return DPLockstep(group, torch.device("cpu")), group  # type: ignore[arg-type]


def test_a_request_starts_and_announces_the_wave_which_ends_when_no_engine_has_work():
    lockstep, group = _lockstep()
    assert lockstep.request_added() == 0 and lockstep.running
    assert lockstep.request_added() is None  # already running: nothing to announce
    assert lockstep.sync(True, False) == (True, False)
    group.others = [1, 0]  # another engine still works: this one runs a dummy step
    assert lockstep.sync(False, False) == (True, False) and lockstep.running
    group.others = [0, 0]
    assert lockstep.sync(False, False) == (False, False)
    assert not lockstep.running and lockstep.current_wave == 1 and group.calls == 3
    assert lockstep.request_added() == 1


def test_stale_and_early_start_messages():
    lockstep, _ = _lockstep()
    lockstep.start_wave(0)
    assert lockstep.running
    lockstep.sync(False, False)  # wave 0 ends
    lockstep.start_wave(0)  # stale: its request was served in wave 0
    assert not lockstep.running
    lockstep.start_wave(1)
    assert lockstep.running and lockstep.current_wave == 1
    lockstep.start_wave(2)  # the next wave, announced before this engine saw wave 1 end
    lockstep.sync(False, False)
    assert lockstep.current_wave == 2 and lockstep.running  # joins it at once


def test_a_stop_anywhere_is_seen_by_every_engine():
    lockstep, group = _lockstep()
    lockstep.request_added()
    group.others = [1, 1]
    assert lockstep.sync(True, False) == (True, True)
    assert lockstep.current_wave == 0
