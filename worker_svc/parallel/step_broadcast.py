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

from worker_svc.forward_batch import ForwardMode, StepInput
from worker_svc.parallel.context import TPContext

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
    tp.broadcast(torch.tensor([KEEPALIVE_CODE, 0, 0, 0], dtype=torch.int64, device=dev))


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
        tp.broadcast(torch.tensor([STOP_CODE, 0, 0, 0], dtype=torch.int64, device=dev))
        return
    packed = pack_step(step).to(dev)
    tp.broadcast(packed[:HEADER_LEN].contiguous())
    tp.broadcast(packed[HEADER_LEN:].contiguous())


def receive_step(tp: TPContext, device: torch.device | str = "cpu") -> StepInput | None:
    """Follower side: the leader's next step, or ``None`` on STOP (keepalives are skipped)."""
    dev = _comm_device(tp)
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=dev)
    while True:
        tp.broadcast(header)
        code, n, b, flags = (int(v) for v in header.tolist())
        if code != KEEPALIVE_CODE:
            break
    if code == STOP_CODE:
        return None
    payload = torch.empty(3 * n + 3 * b, dtype=torch.int64, device=dev)
    tp.broadcast(payload)
    return _from_payload(code, n, b, flags, payload.cpu() if dev.type != "cpu" else payload, device)
