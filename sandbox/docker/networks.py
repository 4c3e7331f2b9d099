"""A run's networks on the engine: its internal network (and egressd's outgoing one), picked and made."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
from collections.abc import Iterable, Mapping
from typing import ClassVar, Generic, Self

from ..backend import (
    SandboxError,
)
from .config import (
    API_TIMEOUT_S,
    DEFAULT_DOCKER_RANGE,
    FALLBACK_DOCKER_RANGE,
    LABEL_RUN,
    DockerPlan,
    PlanT,
    RunPlan,
    choose_subnets,
    network_config,
    resource_labels,
)
from .engine import DockerEngine, DockerUnavailable, clean_leftovers, engine_errors, owner_token
from .fence import Fence, FenceError, clean_leftover_fences

# -- a run's networks --------------------------------------------------------------


class DockerRun:
    """Everything one run creates on the engine, found by its label; ``destroy`` removes it all."""

    def __init__(self, engine: DockerEngine, run_key: str, labels: Mapping[str, str] = {}) -> None:
        self.engine = engine
        self.run_key = run_key
        self.labels = dict(labels)  # extra labels (tests mark theirs); the run's own are added
        self.owner = owner_token()
        self._destroyed = False

    def labels_for(self, role: str) -> dict[str, str]:
        return resource_labels(self.run_key, role, self.owner, self.labels)

    async def destroy(self) -> None:
        """Remove every container, network and volume labelled with this run (idempotent)."""
        if self._destroyed:
            return
        self._destroyed = True
        with contextlib.suppress(DockerUnavailable):
            await clean_leftovers(self.engine, everything_of=self.run_key)
            return
        # One more try, each resource on its own: a failure must not keep the rest.
        containers, networks, volumes = await self.engine.labelled(f"{LABEL_RUN}={self.run_key}")
        for c in containers:
            with contextlib.suppress(DockerUnavailable):
                await self.engine.remove_container(c["Id"])
        for n in networks:
            with contextlib.suppress(DockerUnavailable):
                await self.engine.remove_network(n["Name"])
        for v in volumes:
            with contextlib.suppress(DockerUnavailable):
                await self.engine.remove_volume(v["Name"])


class _RunNetworks(DockerRun, Generic[PlanT]):
    """A run with networks of its own (``plan``): ``create`` picks free subnets and makes them."""

    SUBNETS: ClassVar[int]

    def __init__(self, engine: DockerEngine, plan: PlanT, labels: Mapping[str, str] = {}) -> None:
        super().__init__(engine, plan.run_key, labels)
        self.plan = plan
        self.note = ""  # set when the networks are not where they were asked for
        self.fence: Fence | None = None  # the internal bridge fenced off the host, once it is made

    @classmethod
    def _plan(cls, run_key: str, subnets: list[ipaddress.IPv4Network]) -> PlanT:
        raise NotImplementedError

    async def _build(self) -> None:
        raise NotImplementedError

    @classmethod
    async def create(
        cls,
        engine: DockerEngine,
        *,
        pool: str = DEFAULT_DOCKER_RANGE,
        labels: Mapping[str, str] = {},
        avoid: Iterable[ipaddress.IPv4Network] = (),
        attempts: int = 8,
    ) -> Self:
        """Pick free /28s and create the networks (retrying a subnet another run just took).

        ``avoid``: ranges to keep clear of besides the engine's networks and
        the host's routes (e.g. addresses a running egressd still binds to a
        run). An engine that refuses link-local subnets gets carrier-grade NAT
        ones (``FALLBACK_DOCKER_RANGE``) instead, when the pool is the
        default; ``note`` then says so.
        """
        last = ""
        note = ""
        avoid = list(avoid)
        await clean_leftover_fences()
        for attempt in range(attempts):
            # A retry means another run took our pick between our look and our create: wait a
            # moment and reach further in, so runs starting together stop choosing alike.
            skip = 0 if attempt == 0 else secrets.randbelow(16 * attempt)
            if attempt:
                await asyncio.sleep(0.05 + secrets.randbelow(200) / 1000)
            try:
                subnets = choose_subnets(pool, [*await engine.taken_subnets(), *avoid], count=cls.SUBNETS, skip=skip)
            except ValueError as exc:
                raise SandboxError(f"cannot plan the run's networks: {exc}") from None
            net = cls(engine, cls._plan(secrets.token_hex(4), subnets), labels)
            try:
                await net._build()
                # Before any container joins the internal network: a host address inside it refuses the run.
                net.fence = await Fence.install(net.plan)
                net.note = note
                return net
            except FenceError:
                await net.destroy()
                raise
            except DockerUnavailable as exc:
                await net.destroy()
                last = str(exc)
                if "overlap" in last or "Pool" in last:
                    continue
                if pool != DEFAULT_DOCKER_RANGE:
                    raise
                note = (f"the Docker Engine refused the link-local subnets of {pool} ({last}); "
                        f"using carrier-grade NAT subnets of {FALLBACK_DOCKER_RANGE} instead")
                pool = FALLBACK_DOCKER_RANGE
        raise SandboxError(f"cannot create the run's networks: {last}")

    async def _create_network(self, name: str, subnet: ipaddress.IPv4Network, *, internal: bool) -> None:
        bridge = self.plan.bridge if internal else None
        with engine_errors("cannot create the run's networks"):
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.engine.client.networks.create(
                    network_config(name, subnet, internal=internal, labels=self.labels_for("network"), bridge=bridge))

    async def destroy(self) -> None:
        """Remove the run's containers and networks, then the fence (no container is left to need it)."""
        try:
            await super().destroy()
        finally:
            if self.fence is not None:
                await self.fence.remove()


class DockerRunNetwork(_RunNetworks[DockerPlan]):
    """A run with egressd of its own: its internal and outgoing networks."""

    SUBNETS = 2

    @classmethod
    def _plan(cls, run_key: str, subnets: list[ipaddress.IPv4Network]) -> DockerPlan:
        internal, outgoing = subnets
        return DockerPlan(run_key, internal, outgoing)

    async def _build(self) -> None:
        p = self.plan
        await self._create_network(p.internal_name, p.internal, internal=True)
        await self._create_network(p.outgoing_name, p.outgoing, internal=False)


class SharedEgressdNetwork(_RunNetworks[RunPlan]):
    """A run of a running egressd (``--connect``): an internal network of its own.

    ``attach`` connects egressd's container to it at ``plan.egressd_ip`` for
    the run's lifetime; ``destroy`` disconnects it and removes the network
    (so does ``clean_leftovers`` after a crash: the network carries the run's
    labels, egressd's container does not and stays).
    """

    SUBNETS = 1

    @classmethod
    def _plan(cls, run_key: str, subnets: list[ipaddress.IPv4Network]) -> RunPlan:
        return RunPlan(run_key, subnets[0])

    async def _build(self) -> None:
        await self._create_network(self.plan.internal_name, self.plan.internal, internal=True)

    async def attach(self, container_id: str) -> None:
        await self.engine.attach(self.plan.internal_name, container_id, str(self.plan.egressd_ip))
