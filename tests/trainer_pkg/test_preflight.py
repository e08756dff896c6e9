"""The network preflight's arithmetic and verdict (trainer_pkg/preflight.py, issue 30), without processes:
bus bandwidth as nccl-tests reports it, the rounds of pairs, the slow node named, the thresholds read
from the environment. The real 2-rank runs are in tests/webapp/test_preflight_from_launcher.py."""

from __future__ import annotations

import itertools

import pytest

from trainer_pkg import preflight
from trainer_pkg.metrics import parse_metric_line


def test_bus_bandwidth_is_nccl_tests_algbw_times_two_n_minus_one_over_n():
    # 256 MiB in 10 ms: algbw 26.84 GB/s; 8 ranks: × 2·7/8 = 1.75.
    algbw, busbw = preflight.bandwidth_gbps(256 << 20, 0.010, 8)
    assert algbw == pytest.approx(26.8435456)
    assert busbw == pytest.approx(26.8435456 * 1.75)
    assert preflight.bandwidth_gbps(10**9, 1.0, 2) == (1.0, 1.0)  # two ranks: busbw = algbw


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
def test_pair_rounds_cover_every_pair_once_in_disjoint_rounds(n):
    rounds = preflight.pair_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        units = [u for p in r for u in p]
        assert len(units) == len(set(units))  # no unit in two pairs of a round
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    assert len(preflight.pair_rounds(40)) == preflight.MAX_PAIR_ROUNDS
    assert preflight.pair_rounds(1) == []


def test_the_node_in_the_slow_pairs_is_named_with_the_arithmetic():
    # 4 nodes: every pair with node 2 at ~3 GB/s, the others at ~40 GB/s.
    pairs = [{"units": [a, b], "ranks": [8 * a, 8 * b], "gbps": 3.0 + a if 2 in (a, b) else 40.0 + a}
             for a, b in itertools.combinations(range(4), 2)]
    figures = {"world_size": 32, "nodes": 4, "backend": "nccl", "busbw_gbps": 12.5, "latency_us": 40.0,
               "sizes": [{"bytes": 256 << 20}], "pairs": pairs}
    names = [f"node {i} (ip-10-0-0-{i})" for i in range(4)]
    assert preflight.slow_unit([(p["units"][0], p["units"][1], p["gbps"]) for p in pairs], 20.0) == 2
    assert preflight.slow_unit([(p["units"][0], p["units"][1], p["gbps"]) for p in pairs], None) == 2
    reason = preflight.verdict(figures, preflight.Limits(min_busbw_gbps=20.0), names)
    assert reason == (
        "Preflight: all-reduce bus bandwidth 12.5 GB/s is below the backend's minimum of 20 GB/s (32 ranks on 4 "
        "nodes, nccl, 256 MiB); node 2 (ip-10-0-0-2) is slow: it is in 3 of the 3 pairs below 20 GB/s "
        "(node 0 (ip-10-0-0-0) ↔ node 2 (ip-10-0-0-2) 3 GB/s, node 1 (ip-10-0-0-1) ↔ node 2 (ip-10-0-0-2) 4 GB/s, "
        "node 2 (ip-10-0-0-2) ↔ node 3 (ip-10-0-0-3) 5 GB/s). The run was stopped before its first step.")
    assert preflight.verdict(figures, preflight.Limits(min_busbw_gbps=2.0, max_latency_us=50.0), names) == ""
    assert "latency 40 µs is above the backend's maximum of 10 µs" in preflight.verdict(
        figures, preflight.Limits(max_latency_us=10.0), names)
    record = preflight.preflight_record(figures, preflight.Limits(min_busbw_gbps=20.0), "why")
    assert [p["gbps"] for p in record["pairs"]][:2] == [3.0, 4.0]  # slowest first
    assert (record["event"], record["ok"], record["reason"], record["min_busbw_gbps"]) == ("preflight", False,
                                                                                          "why", 20.0)


def test_settings_from_the_environment():
    assert not preflight.enabled({}) and not preflight.enabled({preflight.ENABLE_VAR: "0"})
    assert preflight.enabled({preflight.ENABLE_VAR: "1"})
    lim, problems = preflight.limits({preflight.MIN_BUSBW_VAR: "12.5", preflight.MAX_LATENCY_VAR: "200"})
    assert (lim, problems) == (preflight.Limits(12.5, 200.0), [])
    lim, problems = preflight.limits({preflight.MIN_BUSBW_VAR: "fast", preflight.MAX_LATENCY_VAR: "-1"})
    assert lim == preflight.Limits(None, None)
    assert problems == [f"{preflight.MIN_BUSBW_VAR}='fast' is not a positive number: no such limit is applied",
                        f"{preflight.MAX_LATENCY_VAR}='-1' is not a positive number: no such limit is applied"]
    assert preflight.maybe_run(env={preflight.ENABLE_VAR: "0", "WORLD_SIZE": "2"}) is None  # off: nothing


def test_slow_pairs_without_one_node_in_common_are_listed_and_a_failed_check_stops_the_run(monkeypatch, capsys):
    pairs = [{"units": [a, b], "ranks": [a, b], "gbps": 2.0 if (a, b) in ((0, 1), (2, 3)) else 30.0}
             for a, b in itertools.combinations(range(4), 2)]
    figures = {"world_size": 4, "nodes": 4, "backend": "gloo", "busbw_gbps": 25.0, "latency_us": 80.0,
               "sizes": [{"bytes": 32 << 20}], "pairs": pairs}
    names = [f"node {i} (h{i})" for i in range(4)]
    assert preflight.verdict(figures, preflight.Limits(min_busbw_gbps=10.0), names) == (
        "Preflight: 2 of 6 pairs are below 10 GB/s (node 0 (h0) ↔ node 1 (h1) 2 GB/s, node 2 (h2) ↔ node 3 (h3) "
        "2 GB/s). The run was stopped before its first step.")

    def unreachable(backend, env):
        raise RuntimeError("Timed out after 300 s waiting for rank 3")

    monkeypatch.setattr(preflight, "measure", unreachable)
    env = {preflight.ENABLE_VAR: "1", "RANK": "0", "WORLD_SIZE": "4"}
    assert preflight.maybe_run("gloo", env) == preflight.FAILED_EXIT
    reason = ("Preflight: the network check could not complete on rank 0: RuntimeError: Timed out after 300 s "
              "waiting for rank 3. The run was stopped before its first step.")
    records = [line for line in capsys.readouterr().out.splitlines() if line.startswith("TRAINBOARD_METRIC ")]
    [record] = [parse_metric_line(line) for line in records]
    assert (record["event"], record["ok"], record["reason"], record["world_size"]) == ("preflight", False, reason, 4)
