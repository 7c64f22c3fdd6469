"""``hydragen bench dp``: its workload generator, the replica simulation (cases worked out by hand) and a
quick end-to-end run through ``hydragen serve --data-parallel-size 2``."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import replace

import pytest

from hydragen.bench.dp.chat_tokens import ChatTokens
from hydragen.bench.dp.hit_rate_ceiling import hit_rate_ceiling
from hydragen.bench.dp.routing import kv_tokens_for, notes
from hydragen.bench.dp.sim.service_times import fit_line
from hydragen.bench.dp.sim.simulation import ServiceModel, SimReplica, Simulation
from hydragen.bench.dp.workload import (
    Session,
    Tenant,
    Turn,
    Workload,
    WorkloadSpec,
    make_workload,
    tokenizer_counter,
)
from hydragen.dp.kv_events import KVEventBatch
from hydragen.kv.page_hash import page_hashes


@pytest.fixture(scope="module")
def tokenizer():
    from hydragen.model.default_model import default_model_path
    from hydragen.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def workload():
    return make_workload(WorkloadSpec(), tokenizer_counter())


def chars(text: str) -> list[int]:
    """A tokenizer with one token per character and one per special token (as the real one has): prompt
    lengths can be worked out by hand, and the template's header is shorter than a page."""
    ids = []
    for i, piece in enumerate(text.split("<|im_start|>")):
        ids += [1] if i else []
        for j, part in enumerate(piece.split("<|im_end|>")):
            ids += ([2] if j else []) + [ord(c) for c in part]
    return ids


def n(text: str) -> int:
    return len(chars(text))


# ---- the workload ---------------------------------------------------------------------------------------
def test_workload_is_a_function_of_its_seed(workload):
    again = make_workload(WorkloadSpec(), tokenizer_counter())
    assert again.tenants == workload.tenants and again.sessions == workload.sessions
    other = make_workload(WorkloadSpec(seed=1), tokenizer_counter())
    assert other.tenants[0].system_prompt != workload.tenants[0].system_prompt
    assert [s.start_s for s in other.sessions] != [s.start_s for s in workload.sessions]


def test_tenants_have_distinct_system_prompts_of_1_to_2k_tokens(workload, tokenizer):
    spec = workload.spec
    assert len(workload.tenants) == spec.tenants == 16
    for t in workload.tenants:
        assert 1024 <= t.system_tokens <= 2048
        assert t.system_tokens == len(tokenizer.encode(t.system_prompt, add_special_tokens=False))
        assert len(set(t.system_prompt.split())) > 150  # text, not one word repeated
    # Distinct from the first KV page on: no two tenants share a cached page.
    first_pages = set()
    for t in workload.tenants:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": t.system_prompt}], False)
        first_pages.add(page_hashes(ids, 16)[0])
    assert len(first_pages) == spec.tenants


def test_prompts_outgrow_one_replicas_cache_and_fit_in_two(workload):
    kv = kv_tokens_for(workload, 1.6)
    total = workload.stats["system_tokens_total"]
    assert total == sum(t.system_tokens for t in workload.tenants)
    assert 1.5 * kv <= total <= 1.7 * kv  # more than one cache holds ...
    assert total < 2 * kv  # ... less than two do
    assert workload.stats["tenants_used"] == 16  # every tenant's prompt is asked for


def test_many_users_poisson_arrivals_and_client_settings():
    w = make_workload(WorkloadSpec(sessions=3000, rate=2.0, system_tokens=(20, 40)), lambda t: len(t.split()))
    gaps = [b.start_s - a.start_s for a, b in zip(w.sessions, w.sessions[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.08)  # Poisson at 2/s: exponential gaps
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.12)
    assert w.stats["distinct_users"] > 300  # of 16 x 24
    turns = [t for s in w.sessions for t in s.turns]
    assert {t.max_tokens for t in turns} == {32, 64, 128, 256}
    assert any(t.temperature == 0 for t in turns) and any(t.temperature > 0 for t in turns)
    assert all((t.seed is None) == (t.temperature == 0) for t in turns)
    assert {t.top_p for t in turns} == {0.9, 0.95, 1.0}
    with_stop = [t for t in turns if t.stop]
    assert 0.35 < len(with_stop) / len(turns) < 0.65
    body = with_stop[0].sampling()
    assert body["stop"] == list(with_stop[0].stop) and body["max_tokens"] == with_stop[0].max_tokens


def test_a_chats_next_turn_extends_the_previous_prompt_with_the_answer(workload, tokenizer):
    multi = [s for s in workload.sessions if len(s.turns) >= 3]
    assert workload.stats["multi_turn_sessions"] >= len(workload.sessions) / 3 and multi
    s = multi[0]
    answers = ["Sure, here is how returns work.", "1. Pack it. 2. Ship it."]
    prompts = [tokenizer.apply_chat_template(workload.messages(s, k, answers[:k])) for k in range(3)]
    for k in (1, 2):
        msgs = workload.messages(s, k, answers[:k])
        assert msgs[: 2 * k] == workload.messages(s, k - 1, answers[: k - 1])
        assert msgs[2 * k :] == [
            {"role": "assistant", "content": answers[k - 1]},
            {"role": "user", "content": s.turns[k].question},
        ]
        # token ids too: the previous prompt (ending in the assistant's header) is a prefix
        assert prompts[k][: len(prompts[k - 1])] == prompts[k - 1]
        assert len(prompts[k]) > len(prompts[k - 1]) + 5
    with pytest.raises(ValueError, match="needs the 2 earlier answers"):
        workload.messages(s, 2, answers[:1])


def test_bad_workload_specs_are_refused():
    for bad in (dict(tenants=0), dict(rate=0), dict(continue_p=1.0), dict(system_tokens=(10, 5))):
        with pytest.raises(ValueError):
            make_workload(WorkloadSpec(**bad), len)


# ---- the simulation -------------------------------------------------------------------------------------
SERVICE = ServiceModel(prefill_token_s=0.001, decode_step_s=0.01, decode_seq_s=0.0)


def hand_workload(order: str, gap_s: float = 100.0, turns: int = 1, system: int = 200) -> Workload:
    """Tenants A and B (system prompts of ``system`` characters) and one single-user session per letter
    of ``order``, ``gap_s`` apart: questions differ from their first character."""
    tenants = tuple(
        Tenant(i, name, "x", (name * system)[:system], system) for i, name in enumerate(("A", "B"))
    )
    sessions = tuple(
        Session(i, "AB".index(c), i, 1.0 + i * gap_s,
                tuple(Turn(f"{i}-{k}?", 0.5, 8, 0.0, 1.0, None, None) for k in range(turns)))
        for i, c in enumerate(order)
    )  # fmt: skip
    spec = replace(WorkloadSpec(), tenants=2, sessions=len(order))
    return Workload(spec, tenants, sessions)


def simulate(w: Workload, policy: str, kv_tokens: int, replicas: int = 2, answer: int = 8) -> Simulation:
    sim = Simulation(w, ChatTokens(w, chars, lambda m: answer), replicas, policy, SERVICE, kv_tokens)
    sim.figures_ = sim.run()
    return sim


def test_cache_routing_gives_each_tenant_its_own_replica_and_round_robin_thrashes():
    w = hand_workload("AABBAABBAA", system=240)
    block = n("<|im_start|>system\n") + 240 + n("<|im_end|>\n<|im_start|>user\n")  # shared per tenant
    prompt = block + n("0-0?<|im_end|>\n<|im_start|>assistant\n")
    kv = (prompt + 8 + 15) // 16 * 16  # one request fills the cache: it evicts all the other tenant has
    assert prompt + 8 < 2 * block
    cache = simulate(w, "cache", kv)
    by_tenant = {}
    for r in cache.requests:
        by_tenant.setdefault(r.session.tenant, set()).add(r.replica)
    assert by_tenant == {0: {0}, 1: {1}}
    shared = block // 16 * 16  # whole pages of the shared part
    hits = [r.cached_tokens for r in sorted(cache.requests, key=lambda r: r.arrival)]
    assert hits == [0, shared, 0, shared, shared, shared, shared, shared, shared, shared]
    f = cache.figures_
    assert f["hit_rate"] == pytest.approx(8 * shared / sum(len(r.prompt) for r in cache.requests))
    # A hit computes only the rest of its prompt: time to first token is that many tokens at 1 ms each.
    second = sorted(cache.requests, key=lambda r: r.arrival)[1]
    assert second.first_token - second.arrival == pytest.approx((len(second.prompt) - shared) * 0.001)
    # Round-robin sends A, A, B, B, ... to replicas 0, 1, 0, 1: every request evicts the other tenant.
    rr = simulate(w, "round-robin", kv)
    assert [r.replica for r in sorted(rr.requests, key=lambda r: r.arrival)] == [0, 1] * 5
    assert rr.figures_["hit_rate"] == 0.0
    assert rr.figures_["prefill_tokens"] == sum(len(r.prompt) for r in rr.requests)


def test_the_hit_rate_ceiling_counts_only_first_sightings_and_bounds_every_policy():
    w = hand_workload("AABBAABBAA", system=240)
    block = n("<|im_start|>system\n") + 240 + n("<|im_end|>\n<|im_start|>user\n")
    prompt = block + n("0-0?<|im_end|>\n<|im_start|>assistant\n")
    tokens = ChatTokens(w, chars, lambda m: 8)
    total = sum(len(tokens.turn(s, 0)[0]) for s in w.sessions)
    # each tenant's first request misses everything; the other 8 find the tenant's shared pages
    assert hit_rate_ceiling(w, tokens) == pytest.approx(8 * (block // 16 * 16) / total)
    kv = (prompt + 8 + 15) // 16 * 16  # the cache test's size: round-robin thrashes, cache routing does not
    for policy in ("round-robin", "cache"):
        assert simulate(w, policy, kv).figures_["hit_rate"] <= hit_rate_ceiling(w, tokens) + 1e-12
    # chats: a later turn finds its whole previous context (prompt and answer but its last token)
    w = hand_workload("ABAB", gap_s=100.0, turns=3)
    tokens = ChatTokens(w, chars, lambda m: 8)
    sim = simulate(w, "cache", 4096)  # every turn routed to its history, nothing evicted: the ceiling
    assert sim.figures_["hit_rate"] == pytest.approx(hit_rate_ceiling(w, tokens))


def test_a_chat_stays_on_the_replica_holding_its_history():
    w = hand_workload("ABAB", gap_s=100.0, turns=3)
    sim = simulate(w, "cache", 4096)
    for s in w.sessions:
        assert len({r.replica for r in sim.requests if r.session is s}) == 1
    later = [r for r in sim.requests if r.turn > 0]
    # every later turn finds its whole previous context cached (prompt + answer, whole pages)
    for r in later:
        prev = next(x for x in sim.requests if x.session is r.session and x.turn == r.turn - 1)
        assert r.cached_tokens == (len(prev.prompt) + 8 - 1) // 16 * 16


def test_chat_tokens_extend_the_previous_turn():
    w = hand_workload("AB", turns=2)
    tokens = ChatTokens(w, chars, lambda m: 5)
    first, _ = tokens.turn(w.sessions[0], 0)
    second, text = tokens.turn(w.sessions[0], 1)
    answer, _ = tokens.answer(w.sessions[0], 0)
    assert second[: len(first) + 5] == first + answer and text.startswith("<|im_start|>system\nAAAA")


def test_a_prefix_in_flight_is_computed_once():
    """Two requests of one tenant at once on one replica: the second waits for the first's pages."""
    w = hand_workload("AA", gap_s=0.0, system=1200)  # three prompt chunks: the second arrives mid-prefill
    sim = simulate(w, "cache", 4096, replicas=1)
    first, second = sorted(sim.requests, key=lambda r: r.session.index)
    shared = second.cached_tokens
    assert shared == (n("<|im_start|>system\n") + 1200 + n("<|im_end|>\n<|im_start|>user\n")) // 16 * 16
    assert sim.figures_["prefill_tokens"] == len(first.prompt) + len(second.prompt) - shared
    assert second.first_token >= first.first_token  # it could not start before the shared pages existed


def test_pages_run_short_requests_are_preempted_and_all_finish():
    w = hand_workload("AABBAABBAABB", gap_s=0.0)
    sim = simulate(w, "round-robin", 24 * 16, answer=40)  # 24 pages: one request at a time
    assert sim.figures_["requests"] == 12
    for rep in sim.replicas:
        rep.kv.check([])  # nothing held: every page free or idle in the tree, the counts right
        assert rep.kv.usage()["used"] == rep.kv.usage()["cached"] == rep.kv.idle


def test_a_request_larger_than_the_cache_fails_alone():
    """As the engine does: a context the whole cache cannot hold ends in an error, its chat stops there,
    and the other requests are served."""
    w = hand_workload("AB", gap_s=0.0, turns=2)
    sim = simulate(w, "cache", 20 * 16, replicas=1, answer=60)  # a turn fits; turn 2 (with turn 1) cannot
    f = sim.figures_
    assert f["failed"] == 2 and f["requests"] == 2  # each chat's second turn
    assert all(r.failed == (r.turn == 1) for r in sim.requests)
    assert sim.router.snapshot()[0]["in_flight"] == 0


def test_the_routers_view_follows_each_replicas_cache_through_its_events(workload, tokenizer):
    """A scaled-down real workload: the router, fed only the simulated replicas' KV events, holds exactly
    the pages each cache holds at the end."""
    spec = replace(workload.spec, tenants=6, sessions=30, rate=2.0, system_tokens=(200, 400))
    small = make_workload(spec, tokenizer_counter())
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    kv = kv_tokens_for(small, 1.6)
    for policy in ("cache", "approx", "least-loaded"):
        sim = Simulation(small, ChatTokens(small, encode, lambda m: m // 2), 2, policy, SERVICE, kv)
        f = sim.run()
        assert f["requests"] == small.requests
        for state, rep in zip(sim.router.replicas, sim.replicas, strict=True):
            assert state.cached == {node.hash for node in rep.kv.tree.nodes.values()}


def checked(monkeypatch) -> Counter:
    """Check every simulated replica's KV manager (``KVManager.check``: refcounts, idle count, tree paths,
    one writer per page in flight) after every step; counts the checks, the preemptions and the times a
    request waited on pages another one was computing."""
    seen: Counter = Counter()
    finish_step, preempt, work = SimReplica.finish_step, SimReplica.preempt, SimReplica._work

    def finish_and_check(self, work, now):
        ended = finish_step(self, work, now)
        self.kv.check([r.table for r in self.running])
        seen["checks"] += 1
        return ended

    def counted_preempt(self, r):
        seen["preemptions"] += 1
        preempt(self, r)

    def counted_work(self, r):
        seen["waits"] += not self.kv.ready(r.table)
        return work(self, r)

    monkeypatch.setattr(SimReplica, "finish_step", finish_and_check)
    monkeypatch.setattr(SimReplica, "preempt", counted_preempt)
    monkeypatch.setattr(SimReplica, "_work", counted_work)
    return seen


def test_each_replica_is_the_real_kv_manager_and_its_invariants_hold_every_step(monkeypatch):
    """Waits on pages in flight, preemptions and evictions, all through the engine's KV manager."""
    seen = checked(monkeypatch)
    w = hand_workload("AABBAABBAABB", gap_s=0.05, turns=2, system=700)  # two prompt chunks: a tenant's
    sim = simulate(w, "cache", 64 * 16, answer=40)  # next request waits; 64 pages: a few requests at a time
    assert seen["checks"] > 100 and seen["preemptions"] > 0 and seen["waits"] > 0
    assert sim.figures_["requests"] == 24 and sim.figures_["failed"] == 0
    for rep in sim.replicas:
        rep.kv.check([])  # nothing held at the end
        assert rep.kv.pool.num_pages == 64 and rep.kv.usage()["used"] == len(rep.kv.tree) > 0


def test_generated_pages_are_cached_and_published_as_they_are_computed(monkeypatch):
    """As the engine publishes a sequence's full pages after each step: the router hears of an answer's
    pages while it is still being generated, not only when the request ends."""
    w = hand_workload("A", system=40)
    seen = []  # (pages the router knows, the request still running) after each step
    finish_step = SimReplica.finish_step

    def finish_and_look(self, work, now):
        ended = finish_step(self, work, now)
        sim.router.apply(self.index, KVEventBatch(now, self.take_events(), self.index))
        seen.append((len(sim.router.replicas[self.index].cached), bool(self.running)))
        return ended

    monkeypatch.setattr(SimReplica, "finish_step", finish_and_look)
    sim = Simulation(w, ChatTokens(w, chars, lambda m: 64), 1, "cache", SERVICE, 4096)
    sim.run()
    (r,) = sim.requests
    running = [pages for pages, still in seen if still]
    prompt_pages = len(r.prompt) // 16
    assert running[0] == prompt_pages  # after its prefill: the prompt's full pages
    assert running[-1] == (len(r.prompt) + 64 - 2) // 16  # its last step: every full page computed
    assert running[-1] > prompt_pages
    assert sim.router.replicas[0].cached == {node.hash for node in sim.replicas[0].kv.tree.nodes.values()}


def test_a_replica_flushes_its_events_when_a_step_ends():
    """As the engine: a step's changes (its admissions included) reach the router after its forward."""
    w = hand_workload("A", system=40)
    sim = Simulation(w, ChatTokens(w, chars, lambda m: 8), 1, "cache", SERVICE, 4096)
    batches = []
    apply = sim.router.apply
    sim.router.apply = lambda i, batch: (batches.append(batch), apply(i, batch))
    sim.run()
    (r,) = sim.requests
    prefill_s = len(r.prompt) * SERVICE.prefill_token_s
    assert batches[0].ts == pytest.approx(r.arrival + prefill_s) == pytest.approx(r.first_token)
    assert [e.block_hashes for e in batches[0].events] == [page_hashes(r.prompt, 16)]  # stored at admission


def test_a_prompt_of_whole_pages_seen_before_still_computes_its_last_page():
    """The same prompt twice, 240 tokens (15 whole pages): the second finds 14 cached, never the page of its
    last token, whose forward gives the logits to sample from (a match of all 15 would leave it nothing to
    compute and it would never run)."""
    turn = Turn("q" * 11, 0.5, 8, 0.0, 1.0, None, None)
    tenants = (Tenant(0, "A", "x", "A" * 200, 200),)
    sessions = tuple(Session(i, 0, 0, 1.0 + i * 100, (turn,)) for i in range(2))
    w = Workload(replace(WorkloadSpec(), tenants=1, sessions=2), tenants, sessions)
    sim = simulate(w, "cache", 4096, replicas=1)
    first, second = sim.requests
    assert len(first.prompt) == 240 and second.prompt == first.prompt
    assert sim.figures_["requests"] == 2 and [first.cached_tokens, second.cached_tokens] == [0, 224]


def test_requests_ending_in_one_step_are_released_newest_first(monkeypatch):
    """As ``Scheduler.remove``: the newest lets go first, so its pages are the least recently used."""
    released = []
    release = SimReplica._release

    def recorded(self, r):
        released.append(r.session.index)
        release(self, r)

    monkeypatch.setattr(SimReplica, "_release", recorded)
    w = hand_workload("ABA", gap_s=0.0, system=40)  # the first alone, the other two in the next step
    sim = simulate(w, "cache", 4096, replicas=1)
    first, second, third = sorted(sim.requests, key=lambda r: r.session.index)
    assert first.done < second.done == third.done
    assert released == [0, 2, 1]


def test_service_model_and_line_fit():
    assert SERVICE.step_s(100, 0) == pytest.approx(0.1)
    assert SERVICE.step_s(0, 3) == pytest.approx(0.01)
    assert fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert fit_line([2.0], [4.0]) == (0.0, 2.0)


# ---- end to end ------------------------------------------------------------------------------------------
def test_bench_dp_quick_end_to_end(tmp_path, capsys):
    """Two replicas behind the front (one policy: each one costs a start of both replicas), the
    calibration, the simulation at 2 and 4 replicas, every plot, and --replot from the JSON."""
    from hydragen import cli

    out = tmp_path / "dp"
    assert cli.main(["bench", "dp", "--quick", "--policies", "cache", "--out", str(out)]) == 0
    data = json.loads((out / "dp.json").read_text())
    assert data["quick"] and [r["policy"] for r in data["rows"]] == ["cache"]
    row = data["rows"][0]
    done, sent = map(int, row["requests"].split("/"))
    assert row["errors"] == 0 and done == sent == 8
    assert row["output_tok_s"] > 0 and 0 <= row["hit_rate"] <= 1 and row["prompt_tokens"] > 0
    assert sum(int(x) for x in row["per_replica"].split("/")) == done
    # the router saw the replicas' KV events: later turns of a chat were routed on a cached match
    assert "cache" in row["routed_because"] and "no-match" in row["routed_because"]
    assert {r["turn"] for r in row["records"]} == {0, 1} and all(r["ttft"] > 0 for r in row["records"])
    sim = json.loads((out / "dp_sim.json").read_text())
    assert {(r["replicas"], r["policy"]) for r in sim["rows"]} == {
        (n, p) for n in (2, 4) for p in ("round-robin", "least-loaded", "approx", "cache")
    }
    assert data["params"]["calibration"]["service"]["prefill_token_s"] > 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(
        ["dp_hit_rate.png", "dp_throughput.png", "dp_ttft.png", "dp_sim_hit_rate.png", "dp_sim_balance.png",
         "dp_sim_ttft_p99.png", "dp_sim_throughput.png", "dp_sim_bound.png"]
    )  # fmt: skip
    assert "QUICK RUN" in capsys.readouterr().out
    for p in out.glob("*.png"):
        p.unlink()
    assert cli.main(["bench", "dp", "--replot", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == pngs


def test_the_table_compares_every_policy_with_round_robin():
    rows = [
        {"policy": "round-robin", "output_tok_s": 40.0, "hit_rate": 0.4, "errors": 0},
        {
            "policy": "cache",
            "output_tok_s": 70.0,
            "hit_rate": 0.8,
            "errors": 2,
            "error_samples": ["APIError: x"],
        },
    ]
    text = notes(rows)
    assert "cache vs round-robin: 1.75x throughput, 2.00x hit rate" in text
    assert "cache: 2 failed requests, e.g. APIError: x" in text
    assert "ceiling" not in text
    assert "none can exceed 2.25x round-robin's hit rate" in notes(rows, ceiling=0.9)
