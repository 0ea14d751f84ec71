"""A model of the warp-specialized Hopper forward's synchronisation
(cpp/cuda/sm90/mainloop_fwd_ws.cuh, fwd_ws.cuh, pipeline.cuh), run on the CPU:
the producer thread, the consumer warpgroups (two or three; one agent each,
arriving for its four warps), mbarriers with parity waits, arrival counts and tx bytes,
the ping-pong named barriers (a ring with three warpgroups), TMA copies
completing at random later times.
The producer warp hands out the tiles: each tile's index through one slot
between named barriers (per consumer warpgroup, index full and index empty)
once its Q stage is free, an empty tile's Q stage without Q, and an index past the last ends the
consumers.
Random interleavings over random tile lists (empty tiles, one-block tiles),
2-4 K/V stages, 1-2 Q buffers, 2-3 consumer warpgroups, and the out staging
tiles apart from the rings, over V's stage 0 or over the whole V ring (the
protocol O_OVER_V describes; its MUTATIONS must fail, and main checks that
they do); fails on a deadlock, on a TMA copy landing
in a stage a consumer still reads, on the producer storing an index a
consumer still reads, on a consumer reading a stage that does not hold its
block or tile, and on barriers or named-barrier arrivals left unpaired at the
end. It checks the protocol, not the CUDA code: keep the two in step when
either changes. (Mutations it catches: the producer's empty wait without the
^ 1, V released before its PV GEMM's wait, no final ping-pong sync, Q
released early, an empty tile's full_q not completed, the index-empty sync
left out.)

  python3 tests/gpu/ws_pipeline_model.py [tile lists, default 3000]
(tests/test_pipeline_models.py runs 200 in CI.)"""
import random
import sys

# O_OVER_V: the out staging tiles over V's first stages (FlashAttention-3's
# smem_o over smem_v: the tiles fit beside neither D = 256's rings nor a
# 128 x 176 tile's at D = 128), the protocol the kernel follows there
# (sm90/fwd_ws.cuh, FwdWsSmem::kOOverV). A tile with keys ends, in each
# consumer warpgroup, with a named barrier of every consumer thread (no
# warpgroup still reads V), the stmatrix of O into the warpgroup's part of
# the stages, one thread's TMA store, that thread's wait for the store's read
# and its arrival on barrier_o (one arrival per warpgroup). The producer
# waits on barrier_o before the first V load of each tile with keys but the
# first, for the phase of the last such tile: tiles without keys store their
# zeros with the threads' own stores and do not arrive, so at most one phase
# is pending and the parity wait cannot mistake an old phase for it.
# MUTATIONS: protocols the model must reject (main checks that it does).
MUTATIONS = (
    "no_epilogue_sync",         # a warpgroup writes O while another still reads V
    "no_barrier_o_wait",        # the next tile's V lands on O before the store reads it
    "arrive_before_read",       # barrier_o arrives before the store has read O
    "barrier_o_by_tile_index",  # the parity from the tile index, tiles without keys counted
    "empty_tile_staged",        # a tile without keys stages its zeros over V
)


class MBar:
    def __init__(self, count):
        self.count = count
        self.pending = count
        self.tx = 0
        self.k = 0  # completed phases

    def arrive(self, expect_tx=0):
        self.tx += expect_tx
        self.pending -= 1
        assert self.pending >= 0, "too many arrivals"
        self._maybe_complete()

    def complete_tx(self, n):
        self.tx -= n
        assert self.tx >= 0, "tx underflow"
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.k += 1
            self.pending = self.count

    def ready(self, parity):
        return (self.k % 2) != parity

    def wait(self, parity):  # an agent's wait for the phase of this parity
        while not self.ready(parity):
            yield "block"


class NamedBar:
    def __init__(self, threads):
        self.threads = threads
        self.arrived = 0
        self.gen = 0

    def arrive(self, n):
        self.arrived += n
        assert self.arrived <= self.threads, "named barrier overfull"
        if self.arrived == self.threads:
            self.arrived = 0
            self.gen += 1

    def sync(self, n):  # an agent's bar.sync for n threads
        g = self.gen
        self.arrive(n)
        while self.gen == g:
            yield "block"


def interleave(agents, inflight, land, rng, what):
    """Runs the agents (generators yielding "block" when they wait, anything
    else when they progress) in a random order, with the asynchronous copies
    in `inflight` landing (land(item)) at random times, until all are done;
    raises on a deadlock (`what` says which case)."""
    done = set()

    def step(a):  # one step of agent a: whether it progressed
        try:
            return next(agents[a]) != "block"
        except StopIteration:
            done.add(a)
            return True

    blocked_rounds = 0
    while len(done) < len(agents) or inflight:
        progressed = False
        if inflight and rng.random() < 0.4:
            land(inflight.pop(rng.randrange(len(inflight))))
            progressed = True
        choices = [a for a in agents if a not in done]
        rng.shuffle(choices)
        for a in choices[:1]:
            progressed = step(a) or progressed
        if not progressed and not inflight:
            # try all agents once more before declaring deadlock
            any_p = False
            for a in [x for x in agents if x not in done]:
                any_p = step(a) or any_p
            blocked_rounds = 0 if any_p else blocked_rounds + 1
            if blocked_rounds > 50:
                raise RuntimeError(f"deadlock: done={done} {what}")


def run(tiles, stages, seed, qstages=1, nwg=2, o_over_v=0, mutation=None):
    """One tile list. o_over_v: the number of V stages the out staging tiles
    lie over, from stage 0 (the O_OVER_V comment; 0: apart from the rings);
    mutation: one of MUTATIONS."""
    aliased = [("v", s) for s in range(min(o_over_v, stages))]
    rng = random.Random(seed)
    warps = 4 * nwg  # the consumer warps: each empty barrier's arrivals
    full_q = [MBar(1) for _ in range(qstages)]
    empty_q = [MBar(warps) for _ in range(qstages)]
    full_k = [MBar(1) for _ in range(stages)]
    empty_k = [MBar(warps) for _ in range(stages)]
    full_v = [MBar(1) for _ in range(stages)]
    empty_v = [MBar(warps) for _ in range(stages)]
    # 1 + wg: warpgroup wg's turn (ping-pong, a ring of nwg); then index full
    # and index empty per warpgroup (the producer warp and one warpgroup).
    turn = lambda wg: 1 + wg
    full_i = lambda wg: 1 + nwg + wg
    empty_i = lambda wg: 1 + 2 * nwg + wg
    nbar = {turn(wg): NamedBar(256) for wg in range(nwg)}
    nbar.update({full_i(wg): NamedBar(160) for wg in range(nwg)})
    nbar.update({empty_i(wg): NamedBar(160) for wg in range(nwg)})
    epilogue = "epilogue"  # every consumer thread, before O goes over V
    nbar[epilogue] = NamedBar(128 * nwg)
    barrier_o = MBar(nwg)  # each warpgroup's store issuer, once its store has read O
    slot = {}   # ('k', s) -> block id written
    busy = {}   # ('k', s) -> set of wg reading
    inflight = []  # pending TMA: (key, content, bar, bytes)

    def producer():
        kv = 0
        qc = 0
        keyed = 0  # tiles with keys handed out before this one
        for ti in range(len(tiles) + 1):  # the last index ends the consumers
            qs, qph = qc % qstages, (qc // qstages) & 1
            yield from empty_q[qs].wait(qph ^ 1)
            if ti > 0:  # index empty, each warpgroup's
                for wg in range(nwg):
                    yield from nbar[empty_i(wg)].sync(32)
            assert not busy.get("i"), "index stored while read"
            slot["i"] = ti
            for wg in range(nwg):  # index full
                nbar[full_i(wg)].arrive(32)
            if ti == len(tiles):
                for wg in range(nwg):
                    yield from nbar[empty_i(wg)].sync(32)
                return
            nb, ne = tiles[ti]
            if nb >= ne:  # the index alone
                full_q[qs].arrive()
                qc += 1
                continue
            full_q[qs].arrive(expect_tx=1)
            inflight.append((("q", qs), (ti, "q"), full_q[qs], 1))
            qc += 1
            for n in range(nb, ne):
                s, ph = kv % stages, (kv // stages) & 1
                yield from empty_k[s].wait(ph ^ 1)
                full_k[s].arrive(expect_tx=1)
                inflight.append((("k", s), (ti, n), full_k[s], 1))
                yield "step"
                if o_over_v and n == nb and keyed > 0 and mutation != "no_barrier_o_wait":
                    # The last keyed tile's O stored: phase keyed - 1 of barrier_o
                    # (keyed tiles alone arrive, so at most one phase is pending).
                    parity = (ti - 1 if mutation == "barrier_o_by_tile_index" else keyed - 1) & 1
                    yield from barrier_o.wait(parity)
                yield from empty_v[s].wait(ph ^ 1)
                full_v[s].arrive(expect_tx=1)
                inflight.append((("v", s), (ti, n), full_v[s], 1))
                kv += 1
                yield "step"
            keyed += 1

    def use(key, wg, expect):
        assert slot.get(key) == expect, f"wg{wg} reads {key} holding {slot.get(key)}, wants {expect}"
        busy.setdefault(key, set()).add(wg)

    def unuse(key, wg):
        busy[key].discard(wg)

    def store_o(wg, arrive):
        # The warpgroup's stmatrix of O into its part of the V stages, then one
        # thread's TMA store, which reads the part later; that thread waits
        # for the read (cp.async.bulk.wait_group.read) and arrives on barrier_o.
        assert not busy.get(("o", wg)), f"wg{wg} writes O before its last store read it"
        for key in aliased:
            assert not busy.get(key), f"wg{wg} writes O over V {key} while read"
            assert not any(item[0] == key for item in inflight), \
                f"wg{wg} writes O over V {key} while a V load into it is in flight"
            slot[key] = ("o", wg)
        busy[("o", wg)] = {"store"}
        yield "step"
        inflight.append((("store", wg), None, None, 0))
        if arrive:
            if mutation != "arrive_before_read":
                while busy[("o", wg)]:
                    yield "block"
            barrier_o.arrive()

    def consumer(wg):
        kv = 0
        qc = 0
        if wg == nwg - 1:  # Start: warpgroup 0 goes first
            nbar[turn(0)].arrive(128)
        for want in range(len(tiles) + 1):
            qs, qph = qc % qstages, (qc // qstages) & 1
            yield from nbar[full_i(wg)].sync(128)  # index full
            use("i", wg, want)
            ti = slot["i"]
            yield "step"  # the read in flight
            unuse("i", wg)
            nbar[empty_i(wg)].arrive(128)  # index empty
            if ti == len(tiles):
                break
            nb, ne = tiles[ti]
            yield from full_q[qs].wait(qph)
            qc += 1
            if nb >= ne:
                for _ in range(4):
                    empty_q[qs].arrive()
                yield "step"
                if o_over_v and mutation == "empty_tile_staged":
                    yield from store_o(wg, arrive=False)
                continue
            s, ph = kv % stages, (kv // stages) & 1
            yield from full_k[s].wait(ph)
            yield from nbar[turn(wg)].sync(128)  # WaitTurn
            use(("q", qs), wg, (ti, "q"))
            use(("k", s), wg, (ti, nb))
            nbar[turn((wg + 1) % nwg)].arrive(128)  # PassTurn
            yield "step"  # S GEMM runs
            unuse(("k", s), wg)
            for _ in range(4):
                empty_k[s].arrive()
            if nb + 1 == ne:
                unuse(("q", qs), wg)
                for _ in range(4):
                    empty_q[qs].arrive()
            prev = kv
            kv += 1
            for n in range(nb + 1, ne):
                s, ph = kv % stages, (kv // stages) & 1
                ps, pph = prev % stages, (prev // stages) & 1
                yield from full_k[s].wait(ph)
                yield from full_v[ps].wait(pph)
                yield from nbar[turn(wg)].sync(128)  # WaitTurn
                use(("q", qs), wg, (ti, "q"))
                use(("k", s), wg, (ti, n))
                use(("v", ps), wg, (ti, n - 1))
                nbar[turn((wg + 1) % nwg)].arrive(128)  # PassTurn
                yield "step"  # S done
                unuse(("k", s), wg)
                for _ in range(4):
                    empty_k[s].arrive()
                if n + 1 == ne:
                    unuse(("q", qs), wg)
                    for _ in range(4):
                        empty_q[qs].arrive()
                yield "step"  # softmax; PV done
                unuse(("v", ps), wg)
                for _ in range(4):
                    empty_v[ps].arrive()
                prev = kv
                kv += 1
            ps, pph = prev % stages, (prev // stages) & 1
            yield from full_v[ps].wait(pph)
            use(("v", ps), wg, (ti, ne - 1))
            yield "step"
            unuse(("v", ps), wg)
            for _ in range(4):
                empty_v[ps].arrive()
            if o_over_v:
                if mutation != "no_epilogue_sync":
                    yield from nbar[epilogue].sync(128)  # every warpgroup's V reads done
                yield from store_o(wg, arrive=True)
        if wg == 0:  # Finish: takes back the Start's arrival
            yield from nbar[turn(0)].sync(128)

    agents = {"p": producer(), **{f"c{wg}": consumer(wg) for wg in range(nwg)}}

    def land(item):
        key, content, bar, nbytes = item
        if key[0] == "store":  # the TMA store has read the warpgroup's O
            busy[("o", key[1])].clear()
            return
        assert not busy.get(key), f"TMA overwrites {key} while read by {busy.get(key)}"
        if key in aliased:
            reading = [w for w in range(nwg) if busy.get(("o", w))]
            assert not reading, f"V load lands on the O of wg{reading} before its store read it"
        slot[key] = content
        bar.complete_tx(nbytes)

    interleave(agents, inflight, land, rng, f"tiles={tiles}")
    assert all(b.arrived == 0 for b in nbar.values()), "unpaired named-barrier arrivals"
    for b in full_q + empty_q + full_k + empty_k + full_v + empty_v + [barrier_o]:
        assert b.pending == b.count and b.tx == 0, "barrier left mid-phase"


def random_tiles(rng):
    tiles = []
    for _ in range(rng.randrange(1, 7)):
        nb = rng.randrange(0, 4)
        ne = nb + rng.choice([0, 0, 1, 1, 2, 3, 5, 8])
        tiles.append((nb, ne))
    return tiles


def configurations():
    for stages in (2, 3, 4):
        for qstages in (1, 2):
            for nwg in (2, 3):
                for o_over_v in (0, 1, stages):  # apart, over stage 0, over the ring
                    yield stages, qstages, nwg, o_over_v


def check(n):
    """n random tile lists in every configuration: no deadlock, no race."""
    rng = random.Random(1)
    for it in range(n):
        tiles = random_tiles(rng)
        for stages, qstages, nwg, o_over_v in configurations():
            run(tiles, stages, seed=it * 10 + stages + 100000 * qstages + 1000000 * nwg,
                qstages=qstages, nwg=nwg, o_over_v=o_over_v)


def caught(mutation, n=300):
    """Whether the model rejects `mutation` (with O over V) on some of n tile lists."""
    rng = random.Random(2)
    for it in range(n):
        tiles = random_tiles(rng)
        for stages, qstages, nwg, o_over_v in configurations():
            if not o_over_v:
                continue
            try:
                run(tiles, stages, seed=it, qstages=qstages, nwg=nwg, o_over_v=o_over_v,
                    mutation=mutation)
            except (AssertionError, RuntimeError):
                return True
    return False


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    check(n)
    print(f"ok: {n} tile lists x stages 2/3/4 x Q buffers 1/2 x 2/3 consumer warpgroups x "
          "O staged apart / over V's stage 0 / over the V ring, no deadlock, no race")
    missed = [m for m in MUTATIONS if not caught(m)]
    assert not missed, f"mutations the model does not catch: {missed}"
    print(f"ok: the {len(MUTATIONS)} O-over-V mutations caught")


if __name__ == "__main__":
    main()
