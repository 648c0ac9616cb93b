"""EMULATED wide-area network: per-region links to the outer optimizer's region ("hub").

Pure: numbers in, numbers out; no clock, no Ray. The outer-optimizer shell (orchestrator/actors/remote.py)
asks a `LinkSchedule` when each transfer would finish and delays delivery until then; the
data-parallel baseline asks `NetworkModel.allreduce_s` for the time of each gradient all-reduce.

Topology: a star. Every pool region has one full-duplex link to the hub (the region of the outer
optimizer); the hub's own region gets a fast local link. A link is latency plus bandwidth:
`transfer_s(n) = latency_s + 8 n / bandwidth_bps`. A `LinkSchedule` serializes transfers per link
and direction (FIFO): a link is busy for a transfer's serialization time `8 n / bandwidth`, and the
data arrives `latency` after its last byte left, so back-to-back transfers pipeline like a real
pipe and never overlap on the wire.

Ring all-reduce (data-parallel baseline). For `n` workers each holding `N` bytes, the
bandwidth-optimal ring all-reduce (reduce-scatter then all-gather, each in `n-1` steps of `N/n`
bytes) makes every worker send and receive `2 (n-1)/n * N` bytes in `2 (n-1)` steps, so its time is

    t = 2 (n-1) * alpha + 2 (n-1)/n * 8 N / beta

with `alpha` the per-step latency and `beta` the bandwidth of the slowest hop (Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", J. Parallel Distrib.
Comput. 69(2), 2009; Thakur, Rabenseifner and Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005). In the star every ring hop goes up one worker's link
and down the next one's, so we take `beta` = the slowest participating link and `alpha` = the sum
of the two largest participating link latencies (the worst hop); one worker needs no all-reduce.

Scaling (why and how). Our model is ~10^4-10^5 times smaller than the 12B-parameter model the
Decoupled DiLoCo paper trains across four US regions on 2-5 Gbps links, and one CPU step is not
one TPU-pod step. Emulating the raw links would make communication free. Instead every emulated
scenario is scaled so that communication time / compute time per step for OUR model on this
machine equals that of the reference 12B model on the real links:

- Reference (assumptions, stated): N_ref = 12e9 parameters, gradients and outer gradients sent in
  bf16 (2 bytes per parameter, 24 GB per full model); global batch 2^22 = 4,194,304 tokens per step
  (1,024 sequences of 4,096); 6 N FLOPs per token; 4 regions x 256 TPU v5p chips (459 TFLOP/s bf16
  peak each) at 40% MFU. Step time t_ref = 6 * 12e9 * 2^22 / (1024 * 459e12 * 0.40) = 1.606 s.
- Ring all-reduce of the 24 GB bf16 gradient among the 4 regions over the slowest 2 Gbps link:
  2 * 3/4 * 24e9 * 8 / 2e9 = 144 s (+ 6 hops of ~35 ms), so R = t_comm / t_step = 89.8.
  (For comparison, keeping that all-reduce within one step among 8 regions needs
  2 * 7/8 * 24e9 * 8 / 1.606 s = 209 Gbps; the paper quotes 198 Gbps for data parallelism over
  eight datacenters against 0.84 Gbps for Decoupled DiLoCo.)
- Ours: `model_bytes` = float32 bytes of our parameters (4 per parameter), `local_step_s` = our
  measured inner-step time. Time is dilated by `scale = local_step_s / t_ref` and bytes by
  `byte_scale = (model_bytes / 4) / N_ref` (the parameter ratio, so a bf16 gradient of our model
  stands for the bf16 gradient of the 12B model, and a float32 one costs twice as much, as it would
  there). Each link becomes `bandwidth * byte_scale / scale` and `latency * scale`. Then every
  transfer of `b` bytes of ours takes exactly `scale` times as long as `b / byte_scale` bytes on the
  real link, so t_comm_ours / local_step_s = t_comm_ref / t_ref = R, as required.

Numbers for our default `tiny` model (479k parameters, ~0.12 s per step on this machine) and
the presets are in docs/network.md. Every output of an emulated scenario says "EMULATED".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "Link",
    "NetworkModel",
    "LinkSchedule",
    "SCENARIOS",
    "DIRECTIONS",
    "REF_PARAMS",
    "REF_BYTES_PER_PARAM",
    "REF_STEP_S",
    "build_network",
    "ring_allreduce_s",
    "reference_ratio",
]

# ---------------------------------------------------------------- the 12B reference (see docstring)
REF_PARAMS = 12e9  # parameters of the reference model
REF_BYTES_PER_PARAM = 2  # bf16 gradients / outer gradients on the wire
REF_TOKENS_PER_STEP = 2**22  # 1,024 sequences of 4,096 tokens
REF_CHIPS = 4 * 256  # 4 regions x 256 TPU v5p chips
REF_PEAK_FLOPS = 459e12  # TPU v5p bf16 peak per chip
REF_MFU = 0.40
REF_STEP_S = 6 * REF_PARAMS * REF_TOKENS_PER_STEP / (REF_CHIPS * REF_PEAK_FLOPS * REF_MFU)  # 1.606 s
_OUR_BYTES_PER_PARAM = 4  # model_bytes is float32 parameter bytes

DIRECTIONS = ("up", "down")  # up: island -> hub (submissions); down: hub -> island (fragments)


@dataclass(frozen=True)
class Link:
    """One full-duplex link between a region and the hub: `transfer_s(n) = latency_s + 8 n / bandwidth_bps`."""

    bandwidth_bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ValueError(f"Link bandwidth_bps must be > 0 (math.inf for no limit), got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"Link latency_s must be finite and >= 0, got {self.latency_s}")

    def serialize_s(self, nbytes: int) -> float:
        """Seconds the link is busy putting `nbytes` on the wire: 8 nbytes / bandwidth (0 if unlimited)."""
        return 0.0 if math.isinf(self.bandwidth_bps) else 8.0 * nbytes / self.bandwidth_bps

    def transfer_s(self, nbytes: int) -> float:
        """Seconds from the first byte sent to the last byte received: latency + 8 nbytes / bandwidth."""
        return self.latency_s + self.serialize_s(nbytes)


def ring_allreduce_s(nbytes: int, n: int, *, bandwidth_bps: float, latency_s: float) -> float:
    """Time of a ring all-reduce of `nbytes` per worker among `n` workers (module docstring):
    `2 (n-1) latency_s + 2 (n-1)/n * 8 nbytes / bandwidth_bps`; 0 for one worker."""
    if n < 1:
        raise ValueError(f"an all-reduce needs at least one worker, got n={n}")
    if n == 1:
        return 0.0
    wire = 0.0 if math.isinf(bandwidth_bps) else 2 * (n - 1) / n * 8.0 * nbytes / bandwidth_bps
    return 2 * (n - 1) * latency_s + wire


@dataclass(frozen=True)
class NetworkModel:
    """A star network: `links[region]` joins each region to the hub (the outer optimizer's region).

    Attributes:
        name: the scenario name (`none`, `lan`, `wan-4-regions`, `wan-8-regions`).
        hub: region of the outer optimizer; its own link is a fast local one.
        links: region -> its (already scaled) link to the hub.
        emulated: False only for `none` (no delay at all); every report labels True as EMULATED.
        scale: time dilation applied to every link (our step time / the reference's), 1 for `none`.
        byte_scale: our parameter count / the reference's (bandwidths are multiplied by
            byte_scale / scale); 1 for `none`.
        raw_links: the links before scaling (what the scenario describes), for reports.
        regions: the regions the run's pools use (describe() lists only these; all when empty).
    """

    name: str
    hub: str
    links: dict[str, Link]
    emulated: bool
    scale: float = 1.0
    byte_scale: float = 1.0
    raw_links: dict[str, Link] = field(default_factory=dict)
    regions: tuple[str, ...] = ()

    def link(self, region: str) -> Link:
        """The link of `region`; ValueError naming the known regions if it has none."""
        try:
            return self.links[region]
        except KeyError:
            raise ValueError(
                f"region {region!r} is not in network scenario {self.name!r}; use one of {sorted(self.links)}"
            ) from None

    def transfer_s(self, nbytes: int, region: str) -> float:
        """Seconds to move `nbytes` between `region` and the hub on an idle link (latency + serialization)."""
        return self.link(region).transfer_s(nbytes)

    def allreduce_s(self, nbytes: int, regions: list[str]) -> float:
        """Seconds of one ring all-reduce of `nbytes` per worker, one worker per entry of `regions`.

        `2 (n-1) alpha + 2 (n-1)/n * 8 nbytes / beta` with beta = the slowest participating link and
        alpha = the sum of the two largest participating link latencies (a ring hop goes up one
        worker's link to the hub and down the next one's); see the module docstring for the source.
        """
        n = len(regions)
        if n <= 1:
            return 0.0
        links = [self.link(r) for r in regions]
        beta = min(link.bandwidth_bps for link in links)
        lat = sorted((link.latency_s for link in links), reverse=True)
        return ring_allreduce_s(nbytes, n, bandwidth_bps=beta, latency_s=lat[0] + lat[1])

    @staticmethod
    def allreduce_bytes(nbytes: int, n: int) -> int:
        """Bytes each worker sends (and receives) in one ring all-reduce of `nbytes`: ceil(2 (n-1)/n * nbytes)."""
        if n < 1:
            raise ValueError(f"an all-reduce needs at least one worker, got n={n}")
        return math.ceil(2 * (n - 1) * nbytes / n)

    def describe(self) -> str:
        """One line for logs, summaries and tables; starts with 'EMULATED network' unless scenario none."""
        if not self.emulated:
            return "network none (no emulated delay)"

        def gbps(bps: float) -> str:
            return "inf" if math.isinf(bps) else f"{bps / 1e9:g}"

        raw = self.raw_links or self.links
        shown = sorted(set(self.regions) & set(raw)) if self.regions else sorted(raw)
        parts = ", ".join(
            f"{r} {gbps(raw[r].bandwidth_bps)} Gbps/{raw[r].latency_s * 1e3:g} ms" for r in shown if r != self.hub
        ) or "local links only"
        return (
            f"EMULATED network {self.name} (hub {self.hub}: {parts}), scaled to 12B-parameter comm/compute at "
            f"{self.scale * REF_STEP_S:.3g} s per inner step: time x{self.scale:.4g}, bytes x{self.byte_scale:.3g}"
        )


class LinkSchedule:
    """FIFO serialization per link and direction, with byte and transfer accounting.

    A transfer that is ready at `ready_at` starts when the link (in its direction) is free, keeps it
    busy for its serialization time, and is delivered `latency` after its last byte left. Times are
    in whatever clock the caller uses (the outer-optimizer shell uses time.time(), the clock of
    `Submission.created_at`). Not thread-safe: one owner (the shell's event loop).
    """

    def __init__(self, network: NetworkModel) -> None:
        self.network = network
        self._free_at: dict[tuple[str, str], float] = {}
        self._bytes: dict[tuple[str, str], int] = {}
        self._count: dict[tuple[str, str], int] = {}

    def reserve(self, region: str, direction: str, nbytes: int, ready_at: float) -> float:
        """Queue `nbytes` on `region`'s link in `direction` ('up' or 'down'); returns when they arrive."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        link = self.network.link(region)
        key = (region, direction)
        start = max(ready_at, self._free_at.get(key, -math.inf))
        self._free_at[key] = start + link.serialize_s(nbytes)
        self._bytes[key] = self._bytes.get(key, 0) + int(nbytes)
        self._count[key] = self._count.get(key, 0) + 1
        return start + link.transfer_s(nbytes)

    def account(self, region: str, direction: str, nbytes: int) -> None:
        """Count a transfer without scheduling it (scenario none: bytes are still reported)."""
        key = (region, direction)
        self._bytes[key] = self._bytes.get(key, 0) + int(nbytes)
        self._count[key] = self._count.get(key, 0) + 1

    def counters(self) -> dict[str, dict[str, dict[str, int]]]:
        """Bytes and transfers so far, JSON-safe: what a checkpoint keeps so counting survives a restart."""
        return {"bytes": self.bytes_by_link(), "transfers": self.transfers_by_link()}

    def restore_counters(self, saved: dict) -> None:
        """Go on counting from `saved` (a :meth:`counters` answer); the links' queues start empty.

        Raises ValueError (changing nothing) when `saved` is not such an answer."""
        tables = []
        for name in ("bytes", "transfers"):
            table = saved.get(name) if isinstance(saved, dict) else None
            if not isinstance(table, dict):
                raise ValueError(f"link counters need a {name!r} table of {{region: {{'up': n, 'down': n}}}}, "
                                 f"got {saved!r}; pass what LinkSchedule.counters() returned")
            flat: dict[tuple[str, str], int] = {}
            for region, row in table.items():
                if not isinstance(row, dict) or set(row) != set(DIRECTIONS) or not all(
                        isinstance(v, int) and v >= 0 for v in row.values()):
                    raise ValueError(f"link counters {name!r} for {region!r} must be {{'up': n, 'down': n}} with "
                                     f"counts >= 0, got {row!r}; pass what LinkSchedule.counters() returned")
                flat.update({(region, d): v for d, v in row.items()})
            tables.append(flat)
        self._bytes, self._count = tables

    def bytes_by_link(self) -> dict[str, dict[str, int]]:
        """Bytes moved so far as a plain dict: {region: {'up': bytes, 'down': bytes}}."""
        return self._nested(self._bytes)

    def transfers_by_link(self) -> dict[str, dict[str, int]]:
        """Transfers so far as a plain dict: {region: {'up': count, 'down': count}}."""
        return self._nested(self._count)

    @staticmethod
    def _nested(table: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (region, direction), value in sorted(table.items()):
            out.setdefault(region, {d: 0 for d in DIRECTIONS})[direction] = value
        return out


# ---------------------------------------------------------------- scenarios (raw, unscaled links)
_LOCAL = Link(100e9, 50e-6)  # the hub's own region: datacenter fabric
_GBPS = 1e9

# One-way latencies to the hub (us-central, Iowa), about half the round-trip times public cloud
# inter-region latency dashboards show (Iowa-Virginia ~30 ms RTT, Iowa-Oregon ~40 ms, Iowa-Texas
# ~20 ms, Iowa-Europe ~100-110 ms, Iowa-East Asia ~140 ms, Iowa-India ~220 ms), rounded. The hub is
# us-central because it is the most central US region: it minimizes the worst latency to the others.
_WAN_4 = {
    "us-central": _LOCAL,
    "us-east": Link(5 * _GBPS, 15e-3),
    "us-south": Link(3 * _GBPS, 10e-3),
    "us-west": Link(2 * _GBPS, 20e-3),
}
_WAN_8 = {
    **_WAN_4,
    "eu-west": Link(2 * _GBPS, 50e-3),
    "eu-central": Link(2 * _GBPS, 55e-3),
    "asia-east": Link(2 * _GBPS, 70e-3),
    "asia-south": Link(2 * _GBPS, 110e-3),
}
_LAN_LINK = Link(100 * _GBPS, 50e-6)  # one site, every region name accepted

SCENARIOS = ("none", "lan", "wan-4-regions", "wan-8-regions")
_FIXED = {"wan-4-regions": _WAN_4, "wan-8-regions": _WAN_8}


def reference_ratio(links: dict[str, Link], regions: list[str] | None = None) -> float:
    """R = t_comm / t_step of the 12B reference: the time of a ring all-reduce of its bf16 gradient
    (REF_PARAMS x REF_BYTES_PER_PARAM bytes) among one worker per region of `regions` (default: every
    region of `links`) over the unscaled `links`, divided by REF_STEP_S (module docstring)."""
    names = regions if regions is not None else sorted(links)
    model = NetworkModel("ref", "", dict(links), emulated=True)
    return model.allreduce_s(int(REF_PARAMS * REF_BYTES_PER_PARAM), names) / REF_STEP_S


def build_network(
    scenario: str,
    regions: list[str],
    *,
    model_bytes: int,
    local_step_s: float,
    hub_region: str | None = None,
) -> NetworkModel:
    """The network of `scenario` for pools in `regions`, scaled to our model (module docstring).

    Args:
        scenario: one of SCENARIOS. `none`: no delay (infinite bandwidth, zero latency).
            `lan`: one site, 100 Gbps / 50 us to every region name. `wan-4-regions`: us-central (hub),
            us-east, us-south, us-west at 2-5 Gbps. `wan-8-regions`: those plus eu-west, eu-central,
            asia-east, asia-south at 2 Gbps.
        regions: the pools' regions (island i -> its pool's region); each must be in the scenario.
        model_bytes: float32 bytes of our model's parameters (4 x parameter count).
        local_step_s: our inner-step compute time in seconds (measured).
        hub_region: region of the outer optimizer; None = the scenario's hub (us-central for the
            WANs, the first of `regions` for lan/none).

    Raises:
        ValueError: one line naming an unknown scenario, a region the scenario lacks or a bad number.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown network scenario {scenario!r}; use one of {', '.join(SCENARIOS)}")
    regions = list(dict.fromkeys(regions))
    if not regions:
        raise ValueError("build_network needs at least one pool region")
    if scenario == "none":
        hub = hub_region or regions[0]
        links = {r: Link(math.inf, 0.0) for r in {*regions, hub}}
        return NetworkModel("none", hub, links, emulated=False, regions=tuple(regions))
    if not (model_bytes > 0 and math.isfinite(model_bytes)):
        raise ValueError(f"model_bytes must be > 0 (float32 bytes of the model), got {model_bytes}")
    if not (local_step_s > 0 and math.isfinite(local_step_s)):
        raise ValueError(f"local_step_s must be > 0 seconds (the measured inner-step time), got {local_step_s}")
    if scenario == "lan":
        hub = hub_region or regions[0]
        raw = {r: (_LOCAL if r == hub else _LAN_LINK) for r in {*regions, hub}}
    else:
        raw = dict(_FIXED[scenario])
        hub = hub_region or "us-central"
        missing = [r for r in [*regions, hub] if r not in raw]
        if missing:
            raise ValueError(
                f"region {missing[0]!r} is not in network scenario {scenario!r}; set the pool's region "
                f"(and network.hub_region) to one of {', '.join(sorted(raw))}"
            )
        if hub != "us-central":
            # A different hub keeps each spoke's link; the new hub's region gets the local link and the
            # old hub region takes the link the new hub had (a symmetric swap of the star's centre).
            raw["us-central"], raw[hub] = raw[hub], _LOCAL
    scale = local_step_s / REF_STEP_S
    byte_scale = (model_bytes / _OUR_BYTES_PER_PARAM) / REF_PARAMS
    links = {r: Link(link.bandwidth_bps * byte_scale / scale, link.latency_s * scale) for r, link in raw.items()}
    return NetworkModel(scenario, hub, links, emulated=True, scale=scale, byte_scale=byte_scale, raw_links=raw,
                        regions=tuple(regions))
