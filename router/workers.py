"""Worker groups behind the router: channels, health, load and the routing policies.

Each group is one model replica, reached through its tensor-parallel leader's
`sglang.grpc.scheduler.SglangScheduler`. A background task probes every group each
`probe_interval`: GetLoads every round (cheap; it also proves the process answers), the scheduler's
HealthCheck every `health_every` rounds and on every round while a group is not serving (it runs a
one-token generation when the worker is idle, so it proves the engine works, not just the socket).
A group whose probe fails, or whose Generate fails at the transport level, is NOT_SERVING and gets
no new requests until a probe succeeds again.

Policies (`pick`), over serving groups only:
- least_load: fewest requests in flight on the worker, estimated as the worker's last reported
  running + waiting count corrected by what this router started or finished since that report
  (never below this router's own count); ties go to the lower KV usage, then round robin.
- round_robin: the next serving group in turn.
- prefix: by the groups' prefix caches, as their KV event streams tell them (router/kv_index.py):
  the group holding the longest prefix of the prompt (whole blocks), the least loaded of those on a
  tie; no match, or a match on a group more than `prefix_balance_abs` requests busier than the least
  loaded, goes least_load. While some serving group's stream is not up (it publishes no events, or
  is reconnecting) the policy falls back to rendezvous (highest-random-weight) hashing of the first
  `prefix_tokens` prompt ids: the same prefix goes to the same group while it is healthy, and losing
  a group only moves that group's prefixes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from llmserve.grpc_server import REQUEST_ID_HEADER
from llmserve.logging import get_logger
from llmserve.message_limits import message_size_options
from llmserve.security import ChannelSecurity
from llmserve.v1 import router_pb2 as pb
from router.kv_index import KvMirror, follow, matched_tokens
from router.worker_stream import WorkerCall, WorkerStream

log = get_logger(__name__)

POLICIES = ("least_load", "round_robin", "prefix")
SERVING = pb.WORKER_HEALTH_SERVING
NOT_SERVING = pb.WORKER_HEALTH_NOT_SERVING
UNKNOWN = pb.WORKER_HEALTH_UNKNOWN

CHANNEL_OPTIONS = [
    *message_size_options(),
    # Reconnect quickly after a worker restarts (defaults back off up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass
class WorkerGroup:
    index: int
    address: str
    channel: grpc.aio.Channel
    stub: spb_grpc.SglangSchedulerStub
    health: pb.WorkerHealth = UNKNOWN
    reason: str = "not probed yet"
    load: spb.SchedulerLoad | None = None
    in_flight: int = 0  # this router's requests on the group right now
    in_flight_at_report: int = 0
    last_update: float | None = None  # monotonic time of the latest successful probe
    model_info: spb.GetModelInfoResponse | None = None
    probes: int = 0
    kv: KvMirror | None = None  # its prefix cache, with the prefix policy
    # Its WorkerStream, once a probe found that the leader serves one (and the router uses them).
    stream: WorkerStream | None = None

    def generate(self, request: spb.GenerateRequest, metadata: Sequence[tuple[str, str]], timeout: float | None,
                 client_request_id: str) -> WorkerCall:
        """Start a Generate call on the group: on its WorkerStream if it has one, else a call of its own."""
        if self.stream is not None and self.stream.usable:
            return self.stream.generate(request, client_request_id, timeout)
        return self.stub.Generate(request, metadata=metadata, timeout=timeout)

    def estimated_requests(self) -> int:
        if self.load is None:
            return self.in_flight
        reported = self.load.num_running_reqs + self.load.num_waiting_reqs
        return max(self.in_flight, reported + self.in_flight - self.in_flight_at_report)

    def token_usage(self) -> float:
        return self.load.token_usage if self.load is not None else 0.0

    def to_proto(self) -> pb.WorkerGroup:
        g = pb.WorkerGroup(
            index=self.index, address=self.address, health=self.health,
            seconds_since_update=(time.monotonic() - self.last_update) if self.last_update is not None else -1.0,
        )
        if self.load is not None:
            g.load.CopyFrom(pb.WorkerLoad(
                num_running_requests=self.load.num_running_reqs,
                num_waiting_requests=self.load.num_waiting_reqs,
                num_used_tokens=self.load.num_used_tokens,
                max_total_tokens=self.load.max_total_num_tokens,
                token_usage=self.load.token_usage,
                router_in_flight=self.in_flight,
            ))
        return g


def _not_down(g: WorkerGroup) -> bool:
    return g.health != NOT_SERVING


class NoHealthyGroup(Exception):
    pass


@dataclass
class PoolOptions:
    policy: str = "least_load"
    probe_interval: float = 1.0
    health_every: int = 5
    probe_timeout: float = 5.0
    prefix_tokens: int = 32
    prefix_balance_abs: int = 16
    # Carry a group's requests on one WorkerStream when its leader serves it (router/worker_stream.py).
    worker_stream: bool = True


def _split_load(resp: spb.GetLoadsResponse) -> spb.SchedulerLoad:
    """One SchedulerLoad for the whole group (sums over data-parallel ranks if a worker has several)."""
    if len(resp.loads) == 1:
        return resp.loads[0]
    total = spb.SchedulerLoad()
    for load in resp.loads:
        total.num_running_reqs += load.num_running_reqs
        total.num_waiting_reqs += load.num_waiting_reqs
        total.num_used_tokens += load.num_used_tokens
        total.max_total_num_tokens += load.max_total_num_tokens
    if total.max_total_num_tokens:
        total.token_usage = total.num_used_tokens / total.max_total_num_tokens
    return total


class WorkerPool:
    def __init__(self, addresses: Sequence[str], options: PoolOptions | None = None,
                 on_change: Callable[[], None] | None = None, security: ChannelSecurity = ChannelSecurity()):
        """`security`: TLS and the internal token of the channels to the groups."""
        if not addresses:
            raise ValueError("at least one worker group address is needed")
        self.options = options or PoolOptions()
        if self.options.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.options.policy!r}; choose from {', '.join(POLICIES)}")
        self.groups: list[WorkerGroup] = []
        for i, address in enumerate(addresses):
            channel = security.aio_channel(address, CHANNEL_OPTIONS)
            self.groups.append(WorkerGroup(i, address, channel, spb_grpc.SglangSchedulerStub(channel)))
        self._on_change = on_change or (lambda: None)
        self._rr = itertools.count()
        self._task: asyncio.Task | None = None
        self._round = 0
        self._background: set[asyncio.Task] = set()
        self._kv_tasks: list[asyncio.Task] = []
        if self.options.policy == "prefix":
            for g in self.groups:
                g.kv = KvMirror()

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._probe_loop())
        for g in self.groups:
            if g.kv is not None:
                self._kv_tasks.append(asyncio.ensure_future(
                    follow(g.stub, g.kv, f"{g.index}@{g.address}", functools.partial(_not_down, g))))

    async def close(self) -> None:
        for task in [self._task, *self._kv_tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._background:  # Aborts in flight (e.g. of streams ended by shutdown) get delivered
            await asyncio.wait(list(self._background), timeout=self.options.probe_timeout)
        for g in self.groups:
            if g.stream is not None:
                await g.stream.close()
            await g.channel.close()

    # ---- probing ---------------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.probe_all()
            await asyncio.sleep(max(0.0, self.options.probe_interval - (time.monotonic() - started)))

    async def probe_all(self) -> None:
        self._round += 1
        full = (self._round - 1) % max(1, self.options.health_every) == 0
        await asyncio.gather(*(self._probe(g, full) for g in self.groups))

    async def _probe(self, g: WorkerGroup, full: bool) -> None:
        timeout = self.options.probe_timeout
        try:
            if g.model_info is None:
                g.model_info = await g.stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=timeout)
            in_flight = g.in_flight
            loads = await g.stub.GetLoads(spb.GetLoadsRequest(include=["core"]), timeout=timeout)
            if full or g.health != SERVING:
                check = await g.stub.HealthCheck(spb.HealthCheckRequest(), timeout=timeout)
                if not check.healthy:
                    self.mark(g, NOT_SERVING, f"HealthCheck: {check.message or 'unhealthy'}")
                    return
            if g.health != SERVING and self.options.worker_stream:  # (again) after a restart, say
                await self._find_stream(g, timeout)
        except grpc.aio.AioRpcError as exc:
            self.mark(g, NOT_SERVING, f"probe failed: {exc.code().name}: {exc.details()}")
            return
        except Exception as exc:  # noqa: BLE001 - a probe must never kill the probe loop
            self.mark(g, NOT_SERVING, f"probe failed: {exc!r}")
            return
        g.load = _split_load(loads)
        g.in_flight_at_report = in_flight
        g.last_update = time.monotonic()
        g.probes += 1
        if full or g.health != SERVING:
            self.mark(g, SERVING, "ok")

    async def _find_stream(self, g: WorkerGroup, timeout: float) -> None:
        """Whether the group's leader serves WorkerStream, as its GetServerInfo says (a worker that
        does not answer it, another project's say, gets a call per request)."""
        try:
            info = await g.stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            log.info("no worker stream: GetServerInfo failed", group=g.index, code=exc.code().name)
            return
        served = info.scheduler_info.fields.get("worker_stream")
        if served is not None and served.bool_value:
            if g.stream is None or not g.stream.usable:
                g.stream = WorkerStream(g.channel, f"{g.index}@{g.address}")
                log.info("requests go on the worker stream", group=g.index, address=g.address)
        elif g.stream is not None:
            await g.stream.close()
            g.stream = None
            log.info("worker serves no worker stream: one call per request", group=g.index, address=g.address)

    def mark(self, g: WorkerGroup, health: pb.WorkerHealth, reason: str) -> None:
        changed = g.health != health
        g.health, g.reason = health, reason
        if changed:
            name = pb.WorkerHealth.Name(health)
            if health == SERVING:
                log.info("worker group serving", group=g.index, address=g.address)
            else:
                log.warning("worker group not serving", group=g.index, address=g.address, health=name, reason=reason)
            self._on_change()

    def report_failure(self, g: WorkerGroup, reason: str) -> None:
        """A request on the group failed at the transport level: stop routing to it until a probe
        succeeds."""
        self.mark(g, NOT_SERVING, reason)

    # ---- selection -------------------------------------------------------------------------------

    @property
    def num_serving(self) -> int:
        return sum(g.health == SERVING for g in self.groups)

    def model_info(self) -> spb.GetModelInfoResponse | None:
        infos = [g.model_info for g in self.groups if g.model_info is not None]
        return infos[0] if infos else None

    def context_limit(self) -> int | None:
        """Most tokens one sequence may hold on every group that reported its model info."""
        limits = [min(i.max_context_length, i.max_req_input_len + 1) if i.max_req_input_len else i.max_context_length
                  for g in self.groups if (i := g.model_info) is not None]
        return min(limits) if limits else None

    def pick(self, prompt_ids: Sequence[int], exclude: Set[int] = frozenset()) -> WorkerGroup:
        candidates = [g for g in self.groups if g.health == SERVING and g.index not in exclude]
        if not candidates:
            # Before the first probe round finished, groups are UNKNOWN: better to try them than refuse.
            candidates = [g for g in self.groups if g.health == UNKNOWN and g.index not in exclude]
        if not candidates:
            # The client is told each group's state; the reasons (which name internal addresses)
            # go to the log only.
            log.warning("no healthy worker group", groups={g.index: f"{g.address}: {g.reason}" for g in self.groups})
            states = ", ".join(
                f"group {g.index}: {pb.WorkerHealth.Name(g.health).removeprefix('WORKER_HEALTH_').lower()}"
                for g in self.groups
            )
            raise NoHealthyGroup(f"no healthy worker group ({states})")
        policy = self.options.policy
        if policy == "round_robin" or len(candidates) == 1:
            return candidates[next(self._rr) % len(candidates)]
        if policy == "prefix":
            if all(g.kv is not None and g.kv.live for g in candidates):
                return self._by_cache(prompt_ids, candidates)
            key = b",".join(str(t).encode() for t in prompt_ids[: self.options.prefix_tokens])
            return max(
                candidates, key=lambda g: hashlib.blake2b(key + b"@" + g.address.encode(), digest_size=8).digest()
            )
        return self._least_loaded(candidates)

    def _least_loaded(self, candidates: Sequence[WorkerGroup]) -> WorkerGroup:
        # Rotate the start so ties spread round robin.
        start = next(self._rr) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda g: (g.estimated_requests(), round(g.token_usage(), 2)))

    def _by_cache(self, prompt_ids: Sequence[int], candidates: list[WorkerGroup]) -> WorkerGroup:
        """The group whose cache holds the longest prefix of the prompt (see the module doc)."""
        mirrors = [g.kv for g in candidates if g.kv is not None]
        matched = matched_tokens(prompt_ids, mirrors)
        least = self._least_loaded(candidates)
        best = max(matched)
        if best == 0:
            return least
        chosen = self._least_loaded([g for g, n in zip(candidates, matched, strict=True) if n == best])
        if chosen.estimated_requests() - least.estimated_requests() > self.options.prefix_balance_abs:
            return least
        return chosen

    # ---- aborts ----------------------------------------------------------------------------------

    def abort(self, g: WorkerGroup, request_id: str, reason: str) -> None:
        """Fire-and-forget Abort on the group (the cancelled Generate call aborts too; this makes it
        explicit, and covers a worker that has not noticed the cancellation yet)."""

        async def send() -> None:
            try:
                await g.stub.Abort(
                    spb.AbortRequest(request_id=request_id, reason=reason),
                    timeout=self.options.probe_timeout,
                    metadata=((REQUEST_ID_HEADER, request_id),),
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("abort not delivered", group=g.index, code=exc.code().name)

        task = asyncio.ensure_future(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
