"""Leader -> follower step broadcast for tensor parallelism, as tensors (never pickles).

A ``StepInput`` packs into one int64 tensor::

    [mode, num_tokens, batch, flags, input_ids[n], positions[n], out_slots[n], req_rows[b], seq_lens[b], prefix_lens[b]]

(flags bit 0: ``all_logits``). Each step costs two broadcasts from rank 0: the 4-element header
(mode, n, b, flags), then the payload of
3n + 3b values. ``STOP`` is a header alone and ends a follower's loop; ``KEEPALIVE`` is a header alone
that a follower skips (an idle leader sends one every few seconds, so the process group's collective
timeout can be short and still catch a dead or hung peer while nothing is being generated). Every rank
then runs the same forward (collectives inside the layers) and computes the same gathered logits;
only the leader samples.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from worker_svc.forward_batch import ForwardMode
from worker_svc.runner import FatalStepError, StepInput
from worker_svc.tp import TPContext

HEADER_LEN = 4
ALL_LOGITS_FLAG = 1
_MODE_CODES = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 1}
_CODE_MODES = {code: mode for mode, code in _MODE_CODES.items()}
STOP_CODE = 2
KEEPALIVE_CODE = 3


def pack_step(step: StepInput) -> torch.Tensor:
    """One flat int64 CPU tensor holding the header and every field of ``step``."""
    n, b = int(step.input_ids.numel()), int(step.req_rows.numel())
    if step.positions.numel() != n or step.out_slots.numel() != n:
        raise ValueError("input_ids, positions and out_slots must have one entry per token")
    if len(step.seq_lens) != b or len(step.prefix_lens) != b:
        raise ValueError("req_rows, seq_lens and prefix_lens must have one entry per request")

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).to(device="cpu", dtype=torch.int64)

    return torch.cat(
        [
            torch.tensor([_MODE_CODES[step.mode], n, b, ALL_LOGITS_FLAG if step.all_logits else 0], dtype=torch.int64),
            flat(step.input_ids),
            flat(step.positions),
            flat(step.out_slots),
            flat(step.req_rows),
            torch.tensor(step.seq_lens, dtype=torch.int64),
            torch.tensor(step.prefix_lens, dtype=torch.int64),
        ]
    )


def unpack_step(packed: torch.Tensor, device: torch.device | str = "cpu") -> StepInput | None:
    """Inverse of ``pack_step`` (``None`` for STOP); tensors land on ``device``."""
    packed = packed.to("cpu")
    code, n, b, flags = (int(v) for v in packed[:HEADER_LEN])
    if code == STOP_CODE:
        return None
    return _from_payload(code, n, b, flags, packed[HEADER_LEN:], device)


def broadcast_keepalive(tp: TPContext) -> None:
    """Leader side: one header-only broadcast the followers skip (1 collective)."""
    if tp.size == 1:
        return
    dev = _comm_device(tp)
    dist.broadcast(torch.tensor([KEEPALIVE_CODE, 0, 0, 0], dtype=torch.int64, device=dev), src=0, group=tp.group)


def _from_payload(code: int, n: int, b: int, flags: int, payload: torch.Tensor, device: Any) -> StepInput:
    if code not in _CODE_MODES:
        raise ValueError(f"unknown step mode code {code}")
    if payload.numel() != 3 * n + 3 * b:
        raise ValueError(f"step payload has {payload.numel()} values, expected {3 * n + 3 * b}")
    ids, pos, slots, rows, seq, prefix = payload.split([n, n, n, b, b, b])
    return StepInput(
        mode=_CODE_MODES[code],
        input_ids=ids.to(device).clone(),
        positions=pos.to(device).clone(),
        out_slots=slots.to(device).clone(),
        req_rows=rows.to(device).clone(),
        seq_lens=seq.tolist(),
        prefix_lens=prefix.tolist(),
        all_logits=bool(flags & ALL_LOGITS_FLAG),
    )


def _comm_device(tp: TPContext) -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    backend = dist.get_backend(tp.group) if tp.size > 1 else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast_step(tp: TPContext, step: StepInput | None) -> None:
    """Leader side: send ``step`` (or STOP when ``None``) to every follower; 2 collectives (1 for STOP)."""
    if tp.size == 1:
        return
    if not tp.is_leader:
        raise RuntimeError("only the tp leader broadcasts steps")
    dev = _comm_device(tp)
    if step is None:
        dist.broadcast(torch.tensor([STOP_CODE, 0, 0, 0], dtype=torch.int64, device=dev), src=0, group=tp.group)
        return
    packed = pack_step(step).to(dev)
    dist.broadcast(packed[:HEADER_LEN].contiguous(), src=0, group=tp.group)
    dist.broadcast(packed[HEADER_LEN:].contiguous(), src=0, group=tp.group)


def receive_step(tp: TPContext, device: torch.device | str = "cpu") -> StepInput | None:
    """Follower side: the leader's next step, or ``None`` on STOP (keepalives are skipped)."""
    dev = _comm_device(tp)
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=dev)
    while True:
        dist.broadcast(header, src=0, group=tp.group)
        code, n, b, flags = (int(v) for v in header.tolist())
        if code != KEEPALIVE_CODE:
            break
    if code == STOP_CODE:
        return None
    payload = torch.empty(3 * n + 3 * b, dtype=torch.int64, device=dev)
    dist.broadcast(payload, src=0, group=tp.group)
    return _from_payload(code, n, b, flags, payload.cpu() if dev.type != "cpu" else payload, device)


class FollowerLoop:
    """A follower rank: receive a step, run it, repeat until the leader sends STOP."""

    def __init__(self, runner: Any, tp: TPContext) -> None:
        if tp.is_leader:
            raise ValueError("rank 0 is the leader, not a follower")
        self.runner = runner
        self.tp = tp
        self.steps = 0

    def run(self) -> int:
        """Returns the number of steps run."""
        while (step := receive_step(self.tp, self.runner.device)) is not None:
            self.runner.forward(step)
            self.steps += 1
        return self.steps


class TPGroupFailed(FatalStepError):
    """A tensor-parallel peer died or hung (or a step failed on one rank): the group cannot run steps."""


class LeaderRunner:
    """Wraps the leader's ``ModelRunner``: ``forward`` broadcasts the step, then runs it locally.

    Every other attribute (allocator, request table, config, ...) is the wrapped runner's, so the
    scheduler and ``StaticBatch`` use it unchanged.
    """

    def __init__(self, runner: Any, tp: TPContext) -> None:
        if not tp.is_leader:
            raise ValueError("only rank 0 leads")
        self.runner = runner
        self.tp = tp
        self.stopped = False
        self.broken: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _guarded(self, fn, *args: Any) -> Any:
        """Any failure here leaves the ranks out of step (a peer is gone, or waits in a collective this
        rank will never join), so it breaks the group for good: TPGroupFailed, now and on every call."""
        if self.stopped:
            raise RuntimeError("the followers were already stopped")
        if self.broken is not None:
            raise TPGroupFailed(f"tensor-parallel group is broken: {self.broken!r}")
        try:
            return fn(*args)
        except Exception as exc:
            self.broken = exc
            raise TPGroupFailed(f"tensor-parallel step failed: {exc}") from exc

    def forward(self, step: StepInput) -> torch.Tensor:
        def run() -> torch.Tensor:
            broadcast_step(self.tp, step)
            return self.runner.forward(step)

        return self._guarded(run)

    def keepalive(self) -> None:
        """An idle tick: a header the followers skip, so no collective waits past the group timeout."""
        self._guarded(broadcast_keepalive, self.tp)

    def stop_followers(self) -> None:
        """Send STOP once; the followers' loops return."""
        if not self.stopped:
            self.stopped = True
            broadcast_step(self.tp, None)


def run_follower(
    rank: int,
    size: int,
    init_addr: str,
    engines: list[Any],
    threads: int | None = None,
    timeout_s: float | None = None,
) -> list[int]:
    """Entry point of a follower process: join the group, then for each ``EngineConfig`` in turn build
    this rank's runner and replay the leader's steps until STOP. Returns the steps run per engine."""
    from worker_svc.runner import ModelRunner
    from worker_svc.tp_group import DEFAULT_TIMEOUT_S, destroy_tp, init_tp, rank_device

    if threads:
        torch.set_num_threads(threads)
    tp = init_tp(rank, size, init_addr, engines[0].device, timeout_s or DEFAULT_TIMEOUT_S)
    steps = []
    try:
        for engine in engines:
            device = str(rank_device(engine.device, rank))
            if device != engine.device:
                import dataclasses

                engine = dataclasses.replace(engine, device=device)
            steps.append(FollowerLoop(ModelRunner(engine, tp), tp).run())
    finally:
        destroy_tp(tp)
    return steps


def _spawned_follower(index: int, *args: Any) -> None:
    run_follower(index + 1, *args)


def spawn_followers(
    size: int, init_addr: str, engines: list[Any], threads: int | None = None, timeout_s: float | None = None
) -> Any:
    """Start ranks 1..size-1 as spawned processes (the caller is rank 0); returns the process context
    (``join()`` it after stopping the followers)."""
    import torch.multiprocessing as mp

    return mp.spawn(_spawned_follower, args=(size, init_addr, engines, threads, timeout_s), nprocs=size - 1, join=False)


def join_followers(context: Any, timeout_s: float = 60.0) -> None:
    """Wait for spawned followers to exit (re-raising a follower's error); kill them past ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"tp followers still running after {timeout_s:.0f} s; killed")
