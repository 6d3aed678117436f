"""A model of the persistent fp8 prefill kernel's barrier protocol (`prefill_gluon_ws_persist_kernel`,
`PrefillConfig.gluon_persist`): the producer and the two consumer warpgroups walk the same q tiles, and the K/V ring
(`full` / `empty`), the Vt buffers (`vt_full` / `vt_empty`: 2, or 3 with `gluon_vt3`) and the consumers' turns go on
across tiles by ring step (`_ring`). Each partition is a generator that yields the mbarrier condition it waits on
(parity semantics as PTX's try_wait.parity: a fresh barrier passes a wait on parity 1); TMA loads land at random
times; a random scheduler runs whatever may run. A deadlock (nothing may run) or a buffer read that does not hold the
load it should (a refill before every reader is done, or a parity wait that passed a phase early) fails. The code
paths it mirrors: `_produce_fp8_first`, `_produce_fp8_steps`, `_attend` (FP8 1, PERSIST); `run_bf16` the 16-bit
kernel's."""
import random

import pytest


class Bar:
    def __init__(self, count):
        self.count, self.arrived, self.done = count, 0, 0

    def arrive(self):
        self.arrived += 1
        assert self.arrived <= self.count
        if self.arrived == self.count:
            self.arrived, self.done = 0, self.done + 1

    def passes(self, parity):  # mbarrier try_wait.parity: the phase of this parity has completed
        return self.done % 2 != parity


def _ring_bars(S, releases):
    """The K/V ring's barriers, S of each (`full`: the TMA bytes; `empty`: `releases` arrivals free a buffer), and
    the two consumers' turns."""
    return [Bar(1) for _ in range(S)], [Bar(releases) for _ in range(S)], [Bar(1) for _ in range(2)]


def run(tiles, S, seed, prefetch=False, VT=2):
    """`prefetch` (`PrefillConfig.gluon_prefetch`, `_ws_prefetch`): the producer publishes tile i+1's metadata and
    TMAs its q into ring slot (i+1) % 2 (`q_full`, once both consumers have read the slot's tile before: `q_empty`)
    after tile i's first K/V loads and first Vt, before its other steps; a consumer waits for its tile's slot,
    reads it and releases it. `VT`: the Vt buffers (3: `PrefillConfig.gluon_vt3`).
    A tile of n = 0 K/V tiles stands for a program step past the last tile (published, never attended)."""
    rnd = random.Random(seed)
    pending = []  # TMA loads in flight: (load index, slot, the slots, their barriers), K/V or q
    actors = _program("", tiles, S, pending, prefetch, VT=VT)
    _schedule(actors, pending, rnd, ("deadlock", tiles, S, seed))


def run_queue(tiles, S, programs, seed):
    """`gluon_queue` (`_take_tile`): `programs` programs take flat tiles (K/V steps each, 0 a hole in the list) from
    one counter, each producer one take ahead of its consumers (at its publish), until its first take at or past
    the list's end, published as the end (state 2) that stops its consumers. Checks: every tile is attended once,
    by both consumers of the program that took it, every take is distinct, and the last take puts the counter back
    to 0 after every other one."""
    rnd = random.Random(seed)
    pending = []
    queue = {"next": 0, "takes": [], "attended": [], "end": len(tiles) + programs - 1}
    actors = {}
    for p in range(programs):
        actors.update(_program(f"{p}:", tiles, S, pending, True, queue))
    _schedule(actors, pending, rnd, ("deadlock", tiles, S, programs, seed))
    assert sorted(queue["takes"]) == list(range(len(tiles) + programs)), queue["takes"]
    assert queue["next"] == 0, ("counter not reset", queue)
    real = [t for t, n in enumerate(tiles) if n]
    assert sorted(queue["attended"]) == sorted(real * 2), (queue["attended"], tiles)


def _program(name, tiles, S, pending, prefetch, queue=None, VT=2):
    """One persistent program's three partitions as generators (see the module's docstring), their TMA loads into
    the shared `pending`. `queue` (a dict shared by the programs): `gluon_queue`'s counter instead of the walk over
    every entry of `tiles`. `VT`: the Vt buffers."""
    full, empty, turn = _ring_bars(S, 3)  # K released by each consumer's S, V by the producer's transpose
    vt_full, vt_empty = [Bar(1) for _ in range(VT)], [Bar(2) for _ in range(VT)]
    q_full, q_empty = [Bar(1) for _ in range(2)], [Bar(2) for _ in range(2)]
    slot = [None] * S  # the load index a K/V buffer holds
    vt = [None] * VT  # the load index a Vt buffer holds
    q_info, q_slot = [None] * 2, [None] * 2  # the step (and queue: tile, K/V steps, state) a prefetch slot holds
    bound = len(tiles)

    def take():
        t = queue["next"]
        queue["next"] += 1
        queue["takes"].append(t)
        if t == queue["end"]:
            assert len(queue["takes"]) == queue["end"] + 1, "the reset before another take"
            queue["next"] = 0
        return t

    def publish(i, t=None):
        s = i % 2
        yield lambda: q_empty[s].passes(((i // 2) & 1) ^ 1)
        if queue is not None:
            n = tiles[t] if t < bound else 0
            q_info[s] = (i, t, n, 2 if t >= bound else int(n > 0))
            real = t < bound and n
        else:
            q_info[s] = i
            real = i < len(tiles) and tiles[i]
        if real:
            pending.append((i, s, q_slot, q_full))
        else:
            q_full[s].arrive()  # no tile: the metadata alone

    def walk():
        """The producer's tiles: (step, K/V steps); queue: taken one step ahead, at the publish before."""
        if queue is None:
            yield from enumerate(tiles)
            return
        i = 0
        while cur[0] < bound:
            yield i, tiles[cur[0]]
            i += 1

    cur = [None]

    def producer():
        g0 = 0
        if prefetch:
            if queue is not None:
                cur[0] = take()
            yield from publish(0, cur[0])
        for i, n in walk():
            nxt = None
            for i0 in range(S):
                r = g0 + i0
                if i0 < n:
                    yield lambda r=r: empty[r % S].passes(((r // S) & 1) ^ 1)
                    pending.append((r, r % S, slot, full))
            if prefetch and not n:
                nxt = take() if queue is not None else None
                yield from publish(i + 1, nxt)
            for j in range(n):
                rj = g0 + j
                s = rj % S
                if j >= 1 and j - 1 + S < n:
                    yield lambda rj=rj: empty[(rj - 1) % S].passes(((rj - 1) // S) & 1)
                    pending.append((rj - 1 + S, (rj - 1) % S, slot, full))
                yield lambda rj=rj, s=s: full[s].passes((rj // S) & 1)
                yield lambda rj=rj: vt_empty[rj % VT].passes(((rj // VT) & 1) ^ 1)
                assert slot[s] == rj, ("V read", name, slot[s], rj)
                vt[rj % VT] = rj
                vt_full[rj % VT].arrive()
                empty[s].arrive()
                if prefetch and j == 0:  # the next tile after this one's first Vt
                    nxt = take() if queue is not None else None
                    yield from publish(i + 1, nxt)
            g0 += n
            if queue is not None:
                cur[0] = nxt

    def steps():
        """A consumer's steps: (step, K/V steps, tile); queue: until a slot says the end."""
        if queue is None:
            yield from ((i, n, i) for i, n in enumerate(tiles))
            return
        i = 0
        while True:
            yield i, None, None
            i += 1

    def consumer(w):
        g0 = t0 = 0
        for i, n, t in steps():
            if prefetch:
                yield lambda i=i: q_full[i % 2].passes((i // 2) & 1)
                info = q_info[i % 2]
                if queue is not None:
                    assert info[0] == i, ("q read", name, w, info, i)
                    _, t, n, state = info
                    if state == 2:
                        q_empty[i % 2].arrive()
                        break
                else:
                    assert info == i, ("q read", name, w, q_info, i)
                assert not n or q_slot[i % 2] == i, ("q read", name, w, q_slot, i)
                q_empty[i % 2].arrive()
            if not n:
                continue
            if queue is not None:
                queue["attended"].append(t)
            r0 = g0
            yield lambda r0=r0: full[r0 % S].passes((r0 // S) & 1)
            assert slot[r0 % S] == r0, ("K0 read", name, w, slot[r0 % S], r0)
            yield lambda: True
            assert slot[r0 % S] == r0
            empty[r0 % S].arrive()
            for j in range(n - 1):
                rj = g0 + j
                nxt = (rj + 1) % S
                yield lambda rj=rj, nxt=nxt: full[nxt].passes(((rj + 1) // S) & 1)
                yield lambda rj=rj: vt_full[rj % VT].passes((rj // VT) & 1)
                yield lambda k=t0 + j: turn[w].passes((k & 1) ^ (1 - w))
                assert slot[nxt] == rj + 1 and vt[rj % VT] == rj, ("S/PV issue", name, w, slot[nxt], vt[rj % VT], rj)
                turn[1 - w].arrive()
                yield lambda: True  # the wgmmas run while others move
                assert slot[nxt] == rj + 1, ("S read", name, w)
                empty[nxt].arrive()
                yield lambda: True
                assert vt[rj % VT] == rj, ("PV read", name, w, vt[rj % VT], rj)
                vt_empty[rj % VT].arrive()
            rl = g0 + n - 1
            yield lambda rl=rl: vt_full[rl % VT].passes((rl // VT) & 1)
            assert vt[rl % VT] == rl, ("last PV", name, w, vt[rl % VT], rl)
            vt_empty[rl % VT].arrive()
            g0 += n
            t0 += n - 1

    return {f"{name}p": producer(), f"{name}c0": consumer(0), f"{name}c1": consumer(1)}


def _schedule(actors, pending, rnd, what):
    """Run the partitions' generators (each yields the wait it blocks on) and the TMA completions in a random order
    until all are done: a step of a ready partition, or one pending load (load index, slot, the ring's slots and
    barriers) landing in its slot (the barrier arrives). Nothing ready and nothing in flight is a deadlock (`what`
    names the case)."""
    waits = {k: next(a) for k, a in actors.items()}
    while actors or pending:
        ready = [k for k in actors if waits[k]()]
        choices = ready + (["tma"] if pending else [])
        assert choices, (*what, sorted(actors))
        k = rnd.choice(choices)
        if k == "tma":
            g, s, slots, bars = pending.pop(rnd.randrange(len(pending)))
            slots[s] = g
            bars[s].arrive()
            continue
        try:
            waits[k] = next(actors[k])
        except StopIteration:
            del actors[k], waits[k]


def run_bf16(tiles, S, seed):
    """The 16-bit kernel's protocol (`_produce_tiles`, `_attend` with FP8 0, PERSIST): a 1-warp producer, a K/V
    buffer released by both consumers after their P·V of it (`empty` counts 2), the last one of a tile too."""
    rnd = random.Random(seed)
    full, empty, turn = _ring_bars(S, 2)  # released by both consumers after their P·V
    slot = [None] * S
    pending = []

    def producer():
        g0 = 0
        for n in tiles:
            for j in range(n):
                r = g0 + j
                yield lambda r=r: empty[r % S].passes(((r // S) & 1) ^ 1)
                pending.append((r, r % S, slot, full))
            g0 += n

    def consumer(w):
        g0 = t0 = 0
        for n in tiles:
            yield lambda r0=g0: full[r0 % S].passes((r0 // S) & 1)
            assert slot[g0 % S] == g0, ("K0 read", w)
            for j in range(n - 1):
                rj = g0 + j
                s, nxt = rj % S, (rj + 1) % S
                yield lambda rj=rj, nxt=nxt: full[nxt].passes(((rj + 1) // S) & 1)
                yield lambda k=t0 + j: turn[w].passes((k & 1) ^ (1 - w))
                assert slot[nxt] == rj + 1 and slot[s] == rj, ("S/PV issue", w, slot[nxt], slot[s], rj)
                turn[1 - w].arrive()
                yield lambda: True  # the wgmmas run while others move
                assert slot[nxt] == rj + 1 and slot[s] == rj, ("S/PV read", w)
                empty[s].arrive()
            rl = g0 + n - 1
            assert slot[rl % S] == rl, ("last PV", w)
            empty[rl % S].arrive()
            g0 += n
            t0 += n - 1

    _schedule({"p": producer(), "c0": consumer(0), "c1": consumer(1)}, pending, rnd, ("deadlock", tiles, S, seed))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_persistent_bf16_ring_protocol_never_deadlocks_or_races(stages):
    for seed in range(300):
        rnd = random.Random(seed)
        tiles = [rnd.choice([1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 6))]
        run_bf16(tiles, stages, seed)


@pytest.mark.parametrize("vt", [2, 3], ids=["vt2", "vt3"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_persistent_fp8_ring_protocol_never_deadlocks_or_races(stages, vt):
    for seed in range(300):
        rnd = random.Random(seed)
        tiles = [rnd.choice([1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 6))]
        run(tiles, stages, seed, VT=vt)


@pytest.mark.parametrize("vt", [2, 3], ids=["vt2", "vt3"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_persistent_fp8_prefetch_protocol_never_deadlocks_or_races(stages, vt):
    """`gluon_prefetch`: the q ring of two slots beside the K/V ring, tiles of 1-8 K/V steps and program steps with
    no tile (n = 0) among them; two or three Vt buffers (`gluon_vt3`)."""
    for seed in range(300):
        rnd = random.Random(seed)
        tiles = [rnd.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 6))]
        run(tiles, stages, seed, prefetch=True, VT=vt)


@pytest.mark.parametrize("stages", [2, 3])
def test_persistent_fp8_queue_protocol_never_deadlocks_or_races(stages):
    """`gluon_queue`: 1-4 programs share the counter over a flat list of 0-8 tiles (holes among them, and fewer
    tiles than programs): every tile attended once, by the program that took it, and the counter back at 0."""
    for seed in range(200):
        rnd = random.Random(seed)
        tiles = [rnd.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(0, 8))]
        run_queue(tiles, stages, rnd.randint(1, 4), seed)


def _mutant(old, new):
    """This module's `run` and `run_queue` over a `_program` with `old` replaced by `new` (which must occur)."""
    import inspect

    src = inspect.getsource(_program)
    assert old in src, old
    ns = {"random": random, "Bar": Bar, "_schedule": _schedule, "_ring_bars": _ring_bars}
    exec(src.replace(old, new) + inspect.getsource(run) + inspect.getsource(run_queue), ns)  # noqa: S102
    return ns


def test_the_model_sees_a_lost_end():
    """The queue's check can fail: a producer whose end (state 2) never reaches its slot leaves its consumers
    waiting on it."""
    ns = _mutant("            q_full[s].arrive()  # no tile: the metadata alone",
                 "            q_full[s].arrive() if queue is None or t < bound else None")
    with pytest.raises(AssertionError, match="deadlock"):
        ns["run_queue"]([1, 2, 1], 2, 2, 0)


def test_the_model_sees_an_early_q_refill():
    """The prefetch's check can fail: with the producer not waiting for `q_empty` it overwrites a slot (tile i+2)
    before a consumer has read tile i from it, or the model deadlocks on the counts."""
    ns = _mutant("yield lambda: q_empty[s].passes(((i // 2) & 1) ^ 1)", "yield lambda: True")
    with pytest.raises(AssertionError):
        for seed in range(300):
            ns["run"]([1, 1, 1, 1, 1, 1], 2, seed, prefetch=True)


def test_the_model_sees_a_missing_release():
    """The check can fail: without the last Vt buffer's release after a q tile (the consumers' `PERSIST` arrive at
    the end of `_attend`) the producer waits forever on the next tile's second transpose."""
    ns = _mutant("            vt_empty[rl % VT].arrive()\n", "")
    with pytest.raises(AssertionError, match="deadlock"):
        ns["run"]([3, 2], 2, 0)
