"""A model of the warp-specialized Hopper backward's synchronisation
(cpp/cuda/sm90/bwd_ws.cuh, mainloop_bwd.cuh with kWs, DqHandoff in
epilogue_bwd.cuh), run on the CPU, as ws_pipeline_model.py models the
forward's (whose barrier classes it uses): the producer warp, the dQ warp and
the two MMA warpgroups (one agent each, arriving for their warps), the stage
ring's full and empty mbarriers, the MMA warpgroups' middle-of-step barrier,
the dQ handoff's named barriers and slots, TMA loads and the bulk
reductions' reads of the staging tiles completing at random later times.
Random interleavings over random step counts (0 included), 2-3 stages, with
and without dQ; fails on a deadlock, on a TMA load landing in a stage a
warpgroup still reads, on a warpgroup reading a stage or a dQ post that does
not hold its step, on a dS^T buffer written while the other warpgroup's dQ
GEMM reads it, on a staging tile written while a reduction reads it, and on
barriers or named-barrier arrivals left unpaired at the end. It checks the
protocol, not the CUDA code: keep the two in step when either changes.
(Mutations it catches: the producer's empty wait without the ^ 1, a stage
released before dK's wait, the dQ warp's Empty before its read completes,
the warpgroup's WaitEmpty left out before a later part or after its last, one dS^T buffer.)

  python3 tests/gpu/bwd_ws_pipeline_model.py [cases, default 2000]"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ws_pipeline_model import MBar, NamedBar, interleave  # noqa: E402

END = -1


def run(steps, stages, dq, seed):
    rng = random.Random(seed)
    full = [MBar(1) for _ in range(stages)]
    empty = [MBar(8) for _ in range(stages)]  # the eight MMA warps
    # 1: the MMA warpgroups' middle barrier; 2 + w: Full(w); 4 + w: Empty(w)
    nbar = {1: NamedBar(256), 2: NamedBar(160), 3: NamedBar(160), 4: NamedBar(160),
            5: NamedBar(160)}
    slot = {}     # ("qd", stage) -> step loaded; ("post", w) -> step posted
    busy = {}     # key -> set of readers
    inflight = []  # ("tma", key, step, bar) or ("bulk", w)

    def use(key, who, expect=None):
        if expect is not None:
            assert slot.get(key) == expect, f"{who} reads {key} holding {slot.get(key)}, wants {expect}"
        busy.setdefault(key, set()).add(who)

    def unuse(key, who):
        busy[key].discard(who)

    def write(key, who):
        readers = busy.get(key, set()) - {who}
        assert not readers, f"{who} writes {key} while {readers} read it"

    def producer():
        for s in range(steps):
            st = s % stages
            yield from empty[st].wait(((s // stages) & 1) ^ 1)
            full[st].arrive(expect_tx=1)
            inflight.append(("tma", ("qd", st), s, full[st]))
            yield "step"

    def dq_warp():
        more = True
        while more:
            for w in (0, 1):
                yield from nbar[2 + w].sync(32)
                posted = slot[("post", w)]
                if posted == END:
                    more = False
                    continue
                use(("staging", w), "dq")
                inflight.append(("bulk", w))
                while "dq" in busy[("staging", w)]:  # BulkWaitRead
                    yield "block"
                nbar[4 + w].arrive(32)
                yield "step"

    def mma(w):
        who = f"wg{w}"
        yield from nbar[1].sync(128)  # K and V loaded
        for s in range(steps):
            st = s % stages
            yield from full[st].wait((s // stages) & 1)
            use(("qd", st), who, s)
            yield "step"  # S^T, dP^T, dV issued; P^T, dS^T
            write(("ds", s % 2), who)  # this warpgroup's rows of dS^T
            yield from nbar[1].sync(128)  # both warpgroups' dS^T are in
            use(("ds", s % 2), who)  # the dQ GEMM reads both
            yield "step"  # dQ, dK issued; dQ waited
            unuse(("ds", s % 2), who)
            if dq:
                if s > 0:
                    yield from nbar[4 + w].sync(128)  # the dQ warp read the last part
                write(("staging", w), who)
                slot[("post", w)] = s
                nbar[2 + w].arrive(128)
            yield "step"  # dK waited
            unuse(("qd", st), who)
            for _ in range(4):
                empty[st].arrive()
        if dq:
            if steps > 0:
                yield from nbar[4 + w].sync(128)
            slot[("post", w)] = END
            nbar[2 + w].arrive(128)

    agents = {"p": producer(), "m0": mma(0), "m1": mma(1)}
    if dq:
        agents["q"] = dq_warp()

    def land(item):
        if item[0] == "tma":
            _, key, s, bar = item
            assert not busy.get(key), f"TMA overwrites {key} while read by {busy.get(key)}"
            slot[key] = s
            bar.complete_tx(1)
        else:  # a reduction has read the staging tile
            unuse(("staging", item[1]), "dq")

    interleave(agents, inflight, land, rng, f"steps={steps} stages={stages} dq={dq}")
    assert all(b.arrived == 0 for b in nbar.values()), "unpaired named-barrier arrivals"
    for b in full + empty:
        assert b.pending == b.count and b.tx == 0, "barrier left mid-phase"


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rng = random.Random(1)
    for it in range(n):
        steps = rng.choice([0, 1, 2, 3, 5, 8, 13])
        for stages in (2, 3):
            for dq in (True, False):
                run(steps, stages, dq, seed=it * 10 + stages + 1000 * dq)
    print(f"ok: {n} step counts x stages 2/3 x with and without dQ, no deadlock, no race")


if __name__ == "__main__":
    main()
