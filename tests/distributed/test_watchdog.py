"""watchdog.py: which rank hangs, from what each rank posted, timed by the judging rank's clock (the
real runs: tests/end_to_end/test_fault_tolerance.py)."""
from mingpt.distributed.watchdog import Position, Seen, hang_verdict

TIMEOUT = 60.0


def seen(step: int, phase: str, heard_at: float = 100.0, moved_at: float = 100.0, item: int = 0) -> Seen:
    return Seen(Position(step, phase, item), heartbeat=1, host="node1", pid=4242, heard_at=heard_at,
                moved_at=moved_at)


def test_a_rank_not_heard_from_is_named_with_where_it_was_and_who_waits():
    ranks = {0: seen(401, "backward", moved_at=30), 1: seen(400, "backward", heard_at=30, moved_at=30),
             2: seen(401, "backward", moved_at=30)}
    assert hang_verdict(ranks, now=100.0, timeout_s=TIMEOUT) == (
        "rank 1 (host node1, pid 4242) has not been heard from for 70 s; it was in step 400's backward pass "
        "(gradient sync); rank(s) 0, 2 are waiting for it in step 401's backward pass (gradient sync)")


def test_a_rank_heard_from_but_stuck_behind_the_others_is_named():
    ranks = {0: seen(12, "backward", moved_at=20), 1: seen(12, "data", moved_at=20)}
    assert hang_verdict(ranks, now=100.0, timeout_s=TIMEOUT).startswith(
        "rank 1 (host node1, pid 4242) has not moved for 80 s; it was in step 12's data loading; rank(s) 0 "
        "are waiting for it in step 12's backward pass")


def test_no_verdict_while_everything_moves_within_the_timeout_or_a_snapshot_is_written():
    moving = {0: seen(12, "forward", moved_at=90), 1: seen(12, "backward", moved_at=50)}
    assert hang_verdict(moving, now=100.0, timeout_s=TIMEOUT) is None
    # Rank 0 writes a snapshot alone for minutes; the others wait for it in the next step.
    writing = {0: seen(10, "snapshot", moved_at=-500), 1: seen(11, "backward", moved_at=-400)}
    assert hang_verdict(writing, now=100.0, timeout_s=TIMEOUT) is None
    # A long evaluation moves batch by batch.
    evaluating = {0: seen(85, "evaluation", item=7, moved_at=95),
                  1: seen(85, "evaluation", item=6, moved_at=99)}
    assert hang_verdict(evaluating, now=100.0, timeout_s=TIMEOUT) is None


def test_every_rank_in_one_collective_that_never_completes():
    ranks = {0: seen(7, "backward", moved_at=0), 1: seen(7, "backward", moved_at=10)}
    assert hang_verdict(ranks, now=100.0, timeout_s=TIMEOUT) == (
        "no rank has moved for 90 s: every rank is in step 7's backward pass (gradient sync) (a collective "
        "that never completes)")


def test_a_rank_seen_behind_just_after_a_long_wait_is_not_stuck():
    """After a long save, rank 0 posts its new step before rank 1's next post is read: rank 1 looks
    far behind and long unmoved, but rank 0 moves, so nothing is stuck (this once ended a good run)."""
    ranks = {0: seen(24, "optimizer", moved_at=100), 1: seen(11, "backward", moved_at=92)}
    assert hang_verdict(ranks, now=100.0, timeout_s=4.0) is None


def test_ranks_that_all_compute_or_one_that_compiles_are_not_stuck():
    """A step longer than the timeout on CPU ranks that all keep their cores busy is no collective that
    hangs; nor is a rank compiling (torch.compile's first step, minutes on a CPU). An idle rank behind
    busy ones is still named."""
    busy = {rank: seen(7, "forward", moved_at=0) for rank in (0, 1)}
    for rank in busy.values():
        rank.busy = True
    assert hang_verdict(busy, now=100.0, timeout_s=TIMEOUT) is None
    compiling = {0: seen(1, "compile", moved_at=0), 1: seen(1, "backward", moved_at=0)}
    assert hang_verdict(compiling, now=100.0, timeout_s=TIMEOUT) is None
    busy[1] = seen(6, "data", moved_at=0)
    assert hang_verdict(busy, now=100.0, timeout_s=TIMEOUT).startswith("rank 1 (host node1, pid 4242) has not moved")


def test_torch_compile_s_compilation_is_posted_as_a_phase_of_its_own():
    """torch.compile's callbacks put the rank in the compile phase while it compiles (a backend that
    looks at the position stands in for inductor), and back where it was once done."""
    import torch

    from mingpt.distributed.stragglers import StepClock
    from mingpt.distributed.watchdog import RunWatchdog

    torch._dynamo.reset()  # (it clears the callbacks too)
    watch = RunWatchdog(0, 1, TIMEOUT, ".", lambda: "", StepClock(torch.device("cpu")), compiled=True)
    watch.at("forward", 3)
    phases = []

    def looking_backend(graph, inputs):
        phases.append(watch.position.phase)
        return graph.forward

    compiled = torch.compile(lambda x: x * 2 + 1, backend=looking_backend)
    assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert phases == ["compile"] and watch.position == Position(3, "forward")
    torch._dynamo.reset()
