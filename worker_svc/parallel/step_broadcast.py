"""Leader -> follower step broadcast for tensor parallelism, as tensors (never pickles).

A ``StepInput`` packs into one int64 tensor::

    [mode, num_tokens, batch, flags, writes, write_slots,
     input_ids[n], positions[n], out_slots[n], req_rows[b], seq_lens[b], prefix_lens[b],
     write_rows[w], write_starts[w], write_lens[w], write_slots[s]]

(flags bit 0: ``all_logits``; the ``write_*`` part is the step's ``TableWrites``, the radix cache's
prefix slots, w rows and s slots, empty on most steps). Each step costs two broadcasts from rank 0:
the 6-element header (mode, n, b, flags, w, s), then the payload of 3n + 3b + 3w + s values; the
receiver checks that the payload's sizes agree with the header. ``STOP`` is a header alone and ends
a follower's loop; ``KEEPALIVE`` is a header alone that a follower skips (an idle leader sends one
every few seconds, so the process group's collective timeout can be short and still catch a dead or
hung peer while nothing is being generated). Every rank then runs the same forward (collectives
inside the layers) and computes the same gathered logits; only the leader samples.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_svc.forward_batch import ForwardMode, StepInput, TableWrites
from worker_svc.parallel.context import TPContext

HEADER_LEN = 6
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
    writes = step.table_writes or TableWrites([], [], [], torch.empty(0, dtype=torch.int64))
    w, s = len(writes.rows), int(writes.slots.numel())
    if len(writes.starts) != w or len(writes.lens) != w or sum(writes.lens) != s:
        raise ValueError("table writes need one start and length per row, and lengths summing to the slots")

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).to(device="cpu", dtype=torch.int64)

    flags = ALL_LOGITS_FLAG if step.all_logits else 0
    return torch.cat(
        [
            torch.tensor([_MODE_CODES[step.mode], n, b, flags, w, s], dtype=torch.int64),
            flat(step.input_ids),
            flat(step.positions),
            flat(step.out_slots),
            flat(step.req_rows),
            torch.tensor(step.seq_lens, dtype=torch.int64),
            torch.tensor(step.prefix_lens, dtype=torch.int64),
            torch.tensor(writes.rows, dtype=torch.int64),
            torch.tensor(writes.starts, dtype=torch.int64),
            torch.tensor(writes.lens, dtype=torch.int64),
            flat(writes.slots),
        ]
    )


def unpack_step(packed: torch.Tensor, device: torch.device | str = "cpu") -> StepInput | None:
    """Inverse of ``pack_step`` (``None`` for STOP); tensors land on ``device``."""
    packed = packed.to("cpu")
    if packed.numel() < HEADER_LEN:
        raise ValueError(f"step message of {packed.numel()} values is shorter than its {HEADER_LEN}-value header")
    header = [int(v) for v in packed[:HEADER_LEN]]
    if header[0] == STOP_CODE:
        return None
    return _from_payload(header, packed[HEADER_LEN:], device)


def broadcast_keepalive(tp: TPContext) -> None:
    """Leader side: one header-only broadcast the followers skip (1 collective)."""
    if tp.size == 1:
        return
    dev = _comm_device(tp)
    tp.broadcast(_bare_header(KEEPALIVE_CODE, dev))


def _bare_header(code: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([code] + [0] * (HEADER_LEN - 1), dtype=torch.int64, device=device)


def _payload_len(header: list[int]) -> int:
    _, n, b, _, w, s = header
    if min(n, b, w, s) < 0:
        raise ValueError(f"step header has a negative size: {header}")
    return 3 * n + 3 * b + 3 * w + s


def _from_payload(header: list[int], payload: torch.Tensor, device: Any) -> StepInput:
    code, n, b, flags, w, s = header
    if code not in _CODE_MODES:
        raise ValueError(f"unknown step mode code {code}")
    expected = _payload_len(header)
    if payload.numel() != expected:
        raise ValueError(f"step payload has {payload.numel()} values, expected {expected}")
    parts = payload.split([n, n, n, b, b, b, w, w, w, s])
    ids, pos, slots, rows, seq, prefix, w_rows, w_starts, w_lens, w_slots = parts
    writes = None
    if w:
        lens = w_lens.tolist()
        if sum(lens) != s or min(lens) < 0:
            raise ValueError(f"table write lengths {lens} do not add up to the {s} slots sent")
        writes = TableWrites(w_rows.tolist(), w_starts.tolist(), lens, w_slots.to(device).clone())
    return StepInput(
        mode=_CODE_MODES[code],
        input_ids=ids.to(device).clone(),
        positions=pos.to(device).clone(),
        out_slots=slots.to(device).clone(),
        req_rows=rows.to(device).clone(),
        seq_lens=seq.tolist(),
        prefix_lens=prefix.tolist(),
        all_logits=bool(flags & ALL_LOGITS_FLAG),
        table_writes=writes,
    )


def _comm_device(tp: TPContext) -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    # The group's own name, as ProcessGroupCommunicator reads it: also right for a group built outside
    # torch's world map (ranks as threads of one test process), where dist.get_backend refuses.
    backend = tp.group.name() if tp.size > 1 and tp.group is not None else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast_step(tp: TPContext, step: StepInput | None) -> None:
    """Leader side: send ``step`` (or STOP when ``None``) to every follower; 2 collectives (1 for STOP)."""
    if tp.size == 1:
        return
    if not tp.is_leader:
        raise RuntimeError("only the tp leader broadcasts steps")
    dev = _comm_device(tp)
    if step is None:
        tp.broadcast(_bare_header(STOP_CODE, dev))
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
        values = [int(v) for v in header.tolist()]
        if values[0] != KEEPALIVE_CODE:
            break
    if values[0] == STOP_CODE:
        return None
    payload = torch.empty(_payload_len(values), dtype=torch.int64, device=dev)
    tp.broadcast(payload)
    return _from_payload(values, payload.cpu() if dev.type != "cpu" else payload, device)
