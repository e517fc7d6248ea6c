"""Micro-batches in flight: the engine core's step when the executor can run several steps
at once (pipeline parallelism; vLLM's batch queue, ``max_concurrent_batches``).

With ``P`` pipeline stages and one step at a time, each stage idles while the others run
the step. Here the core schedules a new step while earlier ones are still in flight, as
long as there are requests not already in one, up to ``max_concurrent_batches`` (one per
stage); it then waits for the oldest step and updates the scheduler with its output, in
submission order::

    stage 0:  [b1][b2]    [b3][b4]             b3 holds b1's requests again: their next
    stage 1:      [b1][b2]    [b3][b4]         tokens come from b1's output

A request is in at most one step in flight (``Scheduler.in_flight``): its next token, or
its next prompt chunk, needs that step's output. Each micro-batch takes at most
``ceil(min(unfinished requests, max_num_seqs) / max_concurrent_batches)`` requests, so the
running requests are shared out between the steps in flight instead of all going in the
first.

Why freeing blocks while a step is in flight is safe: every stage runs the steps in the
order they were submitted, and only that stage reads and writes its layers' KV cache. A
block freed by an abort (or a finish, or a preemption, which never picks an in-flight
request) and given to another request, or a block shared by a prefix-cache hit while an
in-flight step still fills it, is only touched by a later step, which on every stage runs
after the earlier one is done with it. The output of an aborted request's step is
dropped (``Scheduler.update_from_output`` skips requests it no longer holds).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from pagedllm.core.scheduler import Scheduler
from pagedllm.executor.abstract import Executor
from pagedllm.messages.engine_core import EngineCoreOutputs
from pagedllm.messages.sched_output import SchedulerOutput


class BatchQueue:
    """The steps in flight of one engine core, oldest first.

    Args:
        scheduler: the core's scheduler.
        executor: runs the steps (``execute_model(..., non_block=True)``).
        max_concurrent_batches: steps in flight at most (above 1).
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, max_concurrent_batches: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_concurrent_batches = max_concurrent_batches
        self.batches: deque[tuple[Future, SchedulerOutput]] = deque()
        #: The most steps seen in flight at once (after a submission).
        self.max_batches_in_flight = 0

    def step(self) -> EngineCoreOutputs:
        """Submit new steps while there is room and something to schedule, then wait for the
        oldest step and return what its requests produced; only scheduler stats when
        nothing is in flight or schedulable."""
        scheduler = self.scheduler
        while len(self.batches) < self.max_concurrent_batches and scheduler.has_schedulable_requests():
            scheduler_output = scheduler.schedule(self._micro_batch_size())
            if (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                    and not scheduler_output.kv_transfers and self.batches):
                break  # nothing to run or tell the workers: wait for a step in flight
            self.batches.append((self.executor.execute_model(scheduler_output, non_block=True), scheduler_output))
            self.max_batches_in_flight = max(self.max_batches_in_flight, len(self.batches))
            if scheduler_output.is_empty:
                break
        if not self.batches:
            return EngineCoreOutputs(scheduler_stats=scheduler.make_stats())
        future, scheduler_output = self.batches.popleft()
        outputs = scheduler.update_from_output(scheduler_output, future.result())
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        return outputs

    def _micro_batch_size(self) -> int:
        """Requests one step may take: the unfinished ones (at most ``max_num_seqs``) shared
        out between the steps that can be in flight."""
        scheduler = self.scheduler
        num_reqs = min(scheduler.get_num_unfinished_requests(), scheduler.max_num_seqs)
        return max(1, -(-num_reqs // self.max_concurrent_batches))
