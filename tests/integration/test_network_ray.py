"""The emulated network in the engine: the real outer-optimizer shell, core and LearnerIslands.

The shell (`orchestrator.actors.remote._OuterShell`, the class the OuterOptimizerActor wraps) runs in this
process on the shared Ray cluster (it puts published fragments in the object store); the two islands
are real LearnerIslands training in threads here, reached through a small stand-in for the actor
handle (the only fake: the same two methods, run on executor threads). Links are configured
directly, slow enough that every delay is a few hundred milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import numpy as np
import pytest
import ray
import torch

from islands.island import LearnerIsland
from islands.model import build_model, model_config
from orchestrator.actors.outer import _OuterShell
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.core.outer_optimizer import OuterOptimizer, OuterSettings
from orchestrator.core.settings import CheckpointSettings
from policies.fragments import plan_fragments
from policies.network import Link, NetworkModel
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REGIONS = {0: "us-east", 1: "eu-west"}
NETWORK = NetworkModel(
    "test-wan", "hub",
    {"hub": Link(math.inf, 0.0), "us-east": Link(16e6, 0.20), "eu-west": Link(8e6, 0.30)},
    emulated=True,
)


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        # A future that runs whether or not it is awaited, like an actor call's ref.
        return asyncio.get_running_loop().run_in_executor(None, self.fn, *args)


class LocalIsland:
    """Stand-in for an IslandActor handle: records what it hands out and when updates arrive."""

    def __init__(self, island: LearnerIsland, answers_status: bool = True) -> None:
        self.island = island
        self.taken: list = []  # submissions in the order the outer optimizer took them
        self.adopted: list[tuple[float, object]] = []  # (arrival wall time, FragmentUpdate)
        self.next_submission = _Method(self._next)
        self.adopt = self  # handle.adopt.remote(update) -> self.remote(update)
        if answers_status:  # what the shell asks at registration (which versions the island holds)
            self.status = _Method(island.status)

    def _next(self, timeout_s: float):
        sub = self.island.next_submission(timeout_s)
        if sub is not None:
            self.taken.append(sub)
        return sub

    def remote(self, update):
        # Arrival is stamped on the shell's event loop, the moment the shell delivers the update.
        self.adopted.append((time.time(), update))
        return asyncio.get_running_loop().run_in_executor(None, self.island.adopt, update)


def fifo_done(items: list[tuple[float, int]], link: Link) -> list[float]:
    """Independent reference for a FIFO link: (ready_at, nbytes) in queue order -> arrival times."""
    free, out = -math.inf, []
    for ready, nbytes in items:
        start = max(ready, free)
        free = start + 8 * nbytes / link.bandwidth_bps
        out.append(free + link.latency_s)
    return out


def make_shell(tmp_path, settings: OuterSettings, network: NetworkModel):
    """A real outer-optimizer shell over the nano model (seed 3, 2 fragments), seeded from checkpoint 0
    as the driver does; returns (shell, model config, plan, training bytes)."""
    cfg = model_config("nano")
    model = build_model(cfg, seed=3)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    tensors, meta = OuterOptimizer(init, plan, settings=settings).state_dict()
    uri = str(tmp_path / "ckpt")
    CheckpointStore(uri).save(0, tensors, {"outer": meta, "epoch": -1, "extra": {}})
    shell = _OuterShell(plan, settings, model.embedding_parameter_names(), CheckpointSettings(uri, every_s=1e9, keep=3),
                        network=network, island_regions=REGIONS)
    data = np.random.default_rng(0).integers(0, 256, size=50_000, dtype=np.uint8)
    return shell, cfg, plan, data


async def run_shell(tmp_path, train_s: float, downlink: str = "none", publish_to: str = "all",
                    downlink_delta: str | None = None, network: NetworkModel = NETWORK, answers_status: bool = True,
                    ) -> tuple[dict, list, list[LocalIsland], list[int], list]:
    # K = 1 and no grace: a round closes the moment its submission reaches the core.
    settings = outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, tau_steps=20.0, max_staleness=10_000,
                                 downlink=downlink, publish_to=publish_to, downlink_delta=downlink_delta)
    shell, cfg, plan, data = make_shell(tmp_path, settings, network)
    inner = inner_from_config(lr=1e-3, warmup_steps=0, batch_size=4, emulated_slowdown=2.0)
    handles = []
    for i in REGIONS:
        spec = spec_from_config(island=i, incarnation=1, pool=REGIONS[i], num_islands=2, model_config=cfg, plan=plan,
                                inner=inner, sync_every_steps=40, seed=3, adoption="overwrite")
        island = LearnerIsland(spec, data, await shell.latest(), resolve=ray.get)
        handles.append(LocalIsland(island, answers_status))
        await shell.register(i, 1, handles[-1])
    for h in handles:
        h.island.start()
    await asyncio.sleep(train_s)  # training time, not a correctness wait
    # ...and on a loaded machine, until each island has sent a few submissions (the checks need them).
    deadline = time.monotonic() + 120
    while min(len(h.taken) for h in handles) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for h in handles:  # islands stop cutting submissions; what they sent is still on the links
        await asyncio.get_running_loop().run_in_executor(None, h.island.stop)
    deadline = time.monotonic() + 60
    while (await shell.status())["in_transit"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    status = await shell.status()
    rounds = list(shell.core.rounds)
    per_param = {"none": 4, "bf16": 2}[downlink]
    fragment_bytes = [sum(t.numel() * per_param for t in shell.core.fragment(p)) for p in range(plan.num_fragments)]
    final_global = [shell.core.fragment(p) for p in range(plan.num_fragments)]
    if downlink_delta is not None:  # what the sender believes each island holds, for the checks
        status["copies"] = {i: [shell.published.copies.copy_of(i, p) for p in range(plan.num_fragments)] for i in REGIONS}
    await shell.stop()
    return status, rounds, handles, fragment_bytes, final_global


def test_links_delay_and_account_exactly_as_configured(ray_cluster, tmp_path):
    status, rounds, handles, fragment_bytes, _ = asyncio.run(run_shell(tmp_path, train_s=4.0))
    assert status["in_transit"] == 0 and status["refusals"] == 0
    assert status["network_emulated"] and status["network"].startswith("EMULATED network test-wan")
    taken = {(s.island, s.seq): s for h in handles for s in h.taken}
    assert all(len(h.taken) >= 3 for h in handles), "each island should have sent several submissions"

    # Uplink: bytes per link = the submissions' own nbytes; each reached the core (its round closed) no
    # earlier than the FIFO reference says: created_at + latency + serialization, queued per link.
    arrival = {}
    for i, h in enumerate(handles):
        link = NETWORK.links[REGIONS[i]]
        assert status["bytes_by_link"][REGIONS[i]]["up"] == sum(s.nbytes for s in h.taken)
        assert status["transfers_by_link"][REGIONS[i]]["up"] == len(h.taken)
        done = fifo_done([(s.created_at, s.nbytes) for s in h.taken], link)
        for s, t in zip(h.taken, done):
            assert t - s.created_at >= link.transfer_s(s.nbytes) - 1e-6 and link.transfer_s(s.nbytes) >= 0.2
            arrival[(s.island, s.seq)] = t
    assert sum(len(r.participants) for r in rounds) == len(taken), "every submission was merged"
    for r in rounds:
        for island, seq in zip(r.participants, r.seqs):
            assert r.wall_time >= arrival[(island, seq)] - 1e-3, (island, seq)

    # Downlink: each island's sender sends the newest waiting version of a fragment, one transfer at a
    # time on its link. So per fragment the versions it delivers increase and end at the final one; each
    # arrives no earlier than its publication plus the link's transfer time, and no two transfers on a
    # link overlap; nothing merged is lost on the way (skipped versions' keys ride on the newer one);
    # bytes are counted per transfer actually sent.
    published = {(r.fragment, r.version): r.wall_time for r in rounds}
    final = {p: max(v for q, v in published if q == p) for p, _ in published}
    merged_keys = {(island, seq) for r in rounds for island, seq in zip(r.participants, r.seqs)}
    for i, h in enumerate(handles):
        link = NETWORK.links[REGIONS[i]]
        got = [(u.fragment, u.version) for _, u in h.adopted]
        assert set(got) <= set(published)
        for p in final:
            versions = [v for q, v in got if q == p]
            assert versions == sorted(set(versions)) and versions[-1] == final[p], (p, versions)
        serial = [8 * fragment_bytes[u.fragment] / link.bandwidth_bps for _, u in h.adopted]
        for k, (t_adopt, u) in enumerate(h.adopted):
            assert t_adopt >= published[(u.fragment, u.version)] + link.transfer_s(fragment_bytes[u.fragment]) - 1e-3
            if k:
                assert t_adopt - h.adopted[k - 1][0] >= serial[k] - 1e-3, "two transfers overlapped on one link"
        assert {(key.island, key.seq) for _, u in h.adopted for key in u.merged} == merged_keys
        assert status["bytes_by_link"][REGIONS[i]]["down"] == sum(fragment_bytes[u.fragment] for _, u in h.adopted)
        assert status["transfers_by_link"][REGIONS[i]]["down"] == len(h.adopted)
    assert status["bytes_down"] == sum(fragment_bytes[u.fragment] for h in handles for _, u in h.adopted)
    assert status["network_wait_s"]["up"] > 0.2 * len(taken)


def test_a_bf16_downlink_halves_the_bytes_and_islands_train_from_the_decoded_global(ray_cluster, tmp_path):
    status, rounds, handles, fragment_bytes, final = asyncio.run(run_shell(tmp_path, train_s=2.0, downlink="bf16"))
    assert status["in_transit"] == 0 and rounds
    for i, h in enumerate(handles):  # 2 bytes per parameter per transfer, every transfer counted
        assert status["bytes_by_link"][REGIONS[i]]["down"] == sum(fragment_bytes[u.fragment] for _, u in h.adopted)
        assert status["bytes_by_link"][REGIONS[i]]["down"] > 0
    # Once the final versions are applied (some may still be queued after the islands stopped), every
    # island's base, what it adopted and measures its outer gradient from, is the final float32 global
    # rounded to bfloat16: the reference is torch's own cast. (Parameters right after an adoption:
    # tests/engine/test_downlink.py; here the islands may have trained on after it.)
    for h in handles:
        h.island.apply_updates()
        assert h.island.fragments.version == [max(r.version for r in rounds if r.fragment == p) for p in range(len(final))]
        for p, tensors in enumerate(final):
            for b, g in zip(h.island.fragments.base[p], tensors):
                assert torch.equal(b, g.to(torch.bfloat16).to(torch.float32))
    assert any(not torch.equal(g, g.to(torch.bfloat16).to(torch.float32)) for frag in final for g in frag), \
        "the global parameters should not all be bf16-exact, or this test could not tell the formats apart"


def test_publishing_to_participants_sends_each_island_only_its_own_rounds(ray_cluster, tmp_path):
    status, rounds, handles, fragment_bytes, _ = asyncio.run(run_shell(tmp_path, train_s=2.0, publish_to="participants"))
    assert status["in_transit"] == 0 and status["refusals"] == 0
    assert all(len(h.taken) >= 3 for h in handles)
    for i, h in enumerate(handles):
        own = [r for r in rounds if i in r.participants]
        others = [r for r in rounds if i not in r.participants]
        assert own and others, "with K = 1 each island should miss some rounds, or this test could not tell"
        got = [(u.fragment, u.version) for _, u in h.adopted]
        # Only versions of rounds it took part in (a busy link may skip one for its own newer round),
        # and every one of its merged submissions reported back to it, no one else's.
        assert set(got) <= {(r.fragment, r.version) for r in own}
        mine = {(i, seq) for r in own for island, seq in zip(r.participants, r.seqs) if island == i}
        assert {(key.island, key.seq) for _, u in h.adopted for key in u.merged} == mine == {(i, s.seq) for s in h.taken}
        assert status["bytes_by_link"][REGIONS[i]]["down"] == sum(fragment_bytes[u.fragment] for _, u in h.adopted)
        assert status["transfers_by_link"][REGIONS[i]]["down"] == len(h.adopted) <= len(own)
        # Its base moved only when its own round came back: the island never saw the others' versions.
        h.island.apply_updates()
        for p in range(len(fragment_bytes)):
            theirs = [r.version for r in own if r.fragment == p]
            assert h.island.fragments.version[p] == (max(theirs) if theirs else 0)


@pytest.mark.parametrize("emulated, seeded", [(True, True), (False, True), (True, False)],
                         ids=["emulated-wan", "no-network", "emulated-wan-unseeded"])
def test_differences_go_down_in_order_and_islands_hold_what_the_sender_tracks(ray_cluster, tmp_path, emulated, seeded):
    network = NETWORK if emulated else NetworkModel("none", "local", {}, emulated=False)
    status, rounds, handles, fragment_bytes, final = asyncio.run(
        run_shell(tmp_path, train_s=2.0, downlink_delta="int4", network=network, answers_status=seeded))
    assert status["in_transit"] == 0 and rounds
    n = [sum(t.numel() for t in frag) for frag in final]
    n_tensors = [len(frag) for frag in final]
    for i, h in enumerate(handles):
        assert h.island.status().state != "failed", h.island.status()
        got = [u for _, u in h.adopted]
        assert got, "each island should have received versions"
        for p in range(len(final)):
            mine = [u for u in got if u.fragment == p]
            # Every island registered holding version 0 from latest(). Asked at registration, it says so,
            # and the sender, remembering version 0 as islands decode it, sends differences from the start;
            # an island that cannot answer gets the whole fragment first. Later: each from the one before.
            assert mine[0].delta_from == (0 if seeded else None)
            for prev, u in zip(mine, mine[1:]):
                assert u.delta_from == prev.version < u.version
        # Bytes as sent: whole float32 first sends, then int4 payload plus one float32 scale per block
        # of 256 (rounded up per tensor).
        whole = sum(fragment_bytes[u.fragment] for u in got if u.delta_from is None)
        diff_max = sum(n[u.fragment] // 2 + n_tensors[u.fragment] + 4 * (n[u.fragment] // 256 + n_tensors[u.fragment])
                       for u in got if u.delta_from is not None)
        diff_min = sum(n[u.fragment] // 2 for u in got if u.delta_from is not None)
        if emulated:  # per region link (without a network every island shares the one local link)
            assert whole + diff_min <= status["bytes_by_link"][REGIONS[i]]["down"] <= whole + diff_max
        # The island applied every link of the chain: its base is exactly the sender's copy.
        h.island.apply_updates()
        for p, held in enumerate(status["copies"][i]):
            version, tensors = held
            assert h.island.fragments.version[p] == version
            for b, c in zip(h.island.fragments.base[p], tensors):
                assert torch.allclose(b, c, rtol=0, atol=1e-6)
        assert h.island.step(), "it trains on from the decoded copy"
    # Differences made the downlink cheaper than whole float32 fragments for the same sends.
    assert 0 < status["bytes_down"] < sum(fragment_bytes[u.fragment] for h in handles for _, u in h.adopted)


def test_a_salvage_takes_its_islands_uplink_and_merges_after_the_slot_came_back(ray_cluster, tmp_path):
    """The shell's salvage path over an EMULATED WAN: island 1 dies with progress in its keeper; a new
    incarnation registers at once (a warm spare); the salvage still arrives, delayed by island 1's
    uplink, is merged, and moves the slot's resume cursor past it."""
    from orchestrator.actors.keeper import ProgressKeeper

    async def body():
        settings = outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, tau_steps=20.0, max_staleness=10_000)
        shell, cfg, plan, data = make_shell(tmp_path, settings, NETWORK)
        keeper = ProgressKeeper("eu-west")
        handles = []
        for i in REGIONS:
            spec = spec_from_config(island=i, incarnation=1, pool=REGIONS[i], num_islands=2, model_config=cfg, plan=plan,
                                    inner=inner_from_config(lr=1e-3, warmup_steps=0, batch_size=4), sync_every_steps=40, seed=3,
                                    salvage_every_steps=5, adoption="overwrite")
            shelve = (lambda step, blob, i=i: keeper.keep(i, 1, step, blob)) if i == 1 else None
            handles.append(LocalIsland(LearnerIsland(spec, data, await shell.latest(), resolve=ray.get, shelve=shelve)))
            await shell.register(i, 1, handles[-1])
        live, dying = handles
        for _ in range(27):  # island 1: cuts at steps 20 (fragment 0); snapshots every 5 steps, the last at 25
            dying.island.step()
        dying.island.wait_shelved()
        await shell.unregister(1)  # it dies; a warm spare is slot 1's incarnation 2 at once
        await shell.register(1, 2, LocalIsland(LearnerIsland(dataclasses.replace(dying.island.spec, incarnation=2),
                                                             data, await shell.latest(), resolve=ray.get)))
        before = (await shell.status())["bytes_by_link"].get("eu-west", {}).get("up", 0)
        t0 = time.time()
        blob = keeper.take(1, 1)

        async def fetched():
            return blob

        got = await shell.salvage(1, 1, [fetched()])
        assert got["step"] == 25 and got["skipped"] == {} and got["tokens"][1] == 25 * dying.island.total_tokens // 27
        assert got["tokens"][0] == 5 * dying.island.total_tokens // 27, "fragment 0 was cut at step 20"
        assert (await shell.status())["in_transit"] >= 2, "the salvage travels island 1's uplink"
        live.island.start()  # the live island's rounds are what the salvaged work joins
        deadline = time.monotonic() + 120
        while {(1, 1, s) for s in got["seqs"]} - {(i, inc, s) for r in shell.core.rounds
                                                   for i, inc, s in zip(r.participants, r.incarnations, r.seqs)}:
            assert time.monotonic() < deadline, "the salvaged submissions were never merged"
            await asyncio.sleep(0.1)
        live.island.stop()
        status = await shell.status()
        keys = {(1, 1, s) for s in got["seqs"]}
        salvaged = [r for r in shell.core.rounds if keys & set(zip(r.participants, r.incarnations, r.seqs))]
        assert min(r.wall_time for r in salvaged) >= t0 + NETWORK.link("eu-west").latency_s
        assert status["bytes_by_link"]["eu-west"]["up"] > before
        assert not [r for r in shell.core.refusals if (r.island, r.incarnation, r.seq) in keys]
        assert (await shell.resume_cursor(1)).batch >= 25, "incarnation 2 would not read the salvaged batches again"
        await shell.stop()

    asyncio.run(body())


def test_a_registering_island_is_seeded_only_when_it_surely_holds_a_remembered_whole_version(ray_cluster, tmp_path):
    settings = outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, downlink="int8", downlink_delta="int4")
    none = NetworkModel("none", "local", {}, emulated=False)

    async def body():
        from islands.messages import FragmentUpdate

        shell, cfg, plan, data = make_shell(tmp_path, settings, none)
        spec = spec_from_config(island=0, incarnation=1, pool="us-east", num_islands=2, model_config=cfg, plan=plan,
                                inner=inner_from_config(batch_size=4), sync_every_steps=40, seed=3, adoption="overwrite")

        def island(incarnation: int) -> LocalIsland:
            return LocalIsland(LearnerIsland(dataclasses.replace(spec, incarnation=incarnation), data,
                                             latest, resolve=ray.get))

        latest = await shell.latest()
        await shell.register(0, 1, island(1))
        for p in range(plan.num_fragments):  # it holds version 0 as decoded from the int8 whole: seeded
            version, held = shell.published.copies.copy_of(0, p)
            assert version == 0
            assert all(torch.equal(h, d) for h, d in zip(held, shell.published.decoded[p][0]))
        # A difference goes to incarnation 1; what it holds may now differ from any whole version by rounding.
        moved = [t + 0.01 for t in shell.core.fragment(0)]
        shell.published.encode(0, 1, FragmentUpdate(0, 1, []), moved)
        await shell.unregister(0)
        await shell.register(0, 1, island(1))  # the same incarnation again: never seeded
        assert all(shell.published.copies.copy_of(0, p) is None for p in range(plan.num_fragments))
        await shell.register(0, 2, island(2))  # a new incarnation from latest(): seeded again
        assert all(shell.published.copies.copy_of(0, p)[0] == 0 for p in range(plan.num_fragments))
        await shell.stop()

    asyncio.run(body())


def test_a_restarted_islands_fetch_of_the_model_is_counted_and_delayed_on_its_link(ray_cluster, tmp_path):
    settings = outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, downlink="bf16")

    async def body():
        shell, cfg, plan, data = make_shell(tmp_path, settings, NETWORK)
        whole = sum(2 * t.numel() for p in range(plan.num_fragments) for t in shell.core.fragment(p))  # bf16
        await shell.latest()  # a first start: nothing crosses a link
        assert (await shell.status())["bytes_by_link"] == {}
        t0 = time.time()
        updates = await shell.latest(1)  # island 1 (eu-west) restarted: the model crosses its link
        waited = time.time() - t0
        status = await shell.status()
        assert status["bytes_by_link"] == {"eu-west": {"up": 0, "down": whole}}
        assert status["transfers_by_link"]["eu-west"]["down"] == 1 and status["bytes_down"] == whole
        assert waited >= NETWORK.link("eu-west").transfer_s(whole) - 1e-3 > 0.3
        assert [u.version for u in updates] == [0] * plan.num_fragments
        await shell.stop()

    asyncio.run(body())


def test_link_counters_and_network_waits_survive_an_outer_optimizer_restart(ray_cluster, tmp_path):
    """A restarted shell restores its checkpoint's counts (summary.json reported only what crossed the links
    after the restart), then counts each island's resync fetch on top of them."""
    settings = outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, downlink="bf16")

    async def body():
        shell, cfg, plan, data = make_shell(tmp_path, settings, NETWORK)
        whole = sum(2 * t.numel() for p in range(plan.num_fragments) for t in shell.core.fragment(p))  # bf16
        await shell.latest(0)
        await shell.latest(1)
        before = await shell.status()
        assert before["network_wait_s"]["down"] > 0.5
        await shell.checkpoint()
        await shell.stop()
        # The actor's restart: a new shell over the same checkpoint store.
        again = _OuterShell(plan, settings, build_model(cfg, seed=3).embedding_parameter_names(),
                            CheckpointSettings(str(tmp_path / "ckpt"), every_s=1e9, keep=3), network=NETWORK,
                            island_regions=REGIONS)
        after = await again.status()
        for key in ("bytes_by_link", "transfers_by_link", "bytes_down", "network_wait_s"):
            assert after[key] == before[key], key
        assert after["restored_from"]["step"] == 1 and again.epoch == 1
        await again.latest(1)  # island 1's resync fetch after the restart
        status = await again.status()
        assert status["bytes_by_link"] == {"us-east": {"up": 0, "down": whole}, "eu-west": {"up": 0, "down": 2 * whole}}
        assert status["transfers_by_link"]["eu-west"]["down"] == 2
        await again.stop()

    asyncio.run(body())
