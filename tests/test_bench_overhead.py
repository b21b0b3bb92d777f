"""bench_overhead's report: ratios against fp32 and the target flags."""

from experiments.bench import overhead as bench_overhead


def _out(step_ratio, compile_ratio):
    rows = []
    for name, sr, cr in (("fp32", 1.0, 1.0), ("qsdp-W8G8", step_ratio, compile_ratio)):
        rows.append(
            {
                "config": name,
                "step_median_s": 0.2 * sr,
                "compile_median_s": 2.0 * cr,
                "step_ratio_vs_fp32": sr,
                "compile_ratio_vs_fp32": cr,
            }
        )
    return {
        "preset": "small",
        "n_params": 3.2e6,
        "batch": 16,
        "seq_len": 128,
        "n_devices": 8,
        "targets": {"step_ratio": 1.15, "compile_ratio": 1.5},
        "rows": rows,
    }


def test_table_flags_missed_targets_only():
    ok = bench_overhead.table(_out(1.1, 1.4))
    assert "over target" not in ok and "qsdp-W8G8" in ok and "1.100" in ok
    missed = bench_overhead.table(_out(1.7, 1.4)).splitlines()
    assert [line for line in missed if "over target" in line] == [
        line for line in missed if line.startswith("qsdp-W8G8")
    ]


def test_bad_arguments_exit_with_usage_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_overhead.parse_args(["--repeats", "0"])
    assert e.value.code == 2
    assert "--repeats must be positive" in capsys.readouterr().err
