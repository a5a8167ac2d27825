"""bench_text's latency lines: qtool's median over ORT dynamic per-channel's at each token length and thread
count, with the load the timing ran under (the figure to read on a shared machine)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import bench_text  # noqa: E402


def _result():
    rows = []
    for system, ms in (("qtool", 1.0), ("ort-dyn-channel", 2.0)):
        row = {"system": system}
        for tokens in bench_text.LATENCY_TOKENS:
            for threads in bench_text.LATENCY_THREADS:
                row[f"{tokens}tok_{threads}t_ms"] = ms * tokens / threads
            row[f"{tokens}tok_1t_cpu_ms"] = 0.9 * ms * tokens
        rows.append(row)
    for r in rows:
        for k in [k for k in r if k.endswith("_ms")]:
            r[k.replace("_ms", "_vs_ortdyn")] = round(r[k] / rows[1][k], 2)
    return {"rows": rows, "load_average": "3.0 before, 4.0 after (1-minute)"}


def test_one_ratio_line_per_token_length_and_thread_count():
    lines = bench_text.latency_ratios(_result())
    assert "load average 3.0 before, 4.0 after" in lines[0]
    assert len(lines) == 1 + len(bench_text.LATENCY_TOKENS) * len(bench_text.LATENCY_THREADS)
    assert lines[1].split()[:10] == ["32", "tokens,", "1", "thread:", "0.50", "(32.00", "ms", "vs", "64.00", "ms);"]
    # one thread: its CPU time too, the figure another job's load does not move
    assert lines[1].split()[10:14] == ["CPU", "time", "0.50", "(28.80"]
    assert lines[-1].split()[:5] == ["128", "tokens,", "2", "threads:", "0.50"] and "CPU" not in lines[-1]


def test_no_lines_without_latency():
    r = _result()
    for row in r["rows"]:
        for k in [k for k in row if k.endswith(("_ms", "_vs_ortdyn"))]:
            del row[k]
    assert bench_text.latency_ratios(r) == []
