"""bench.py's command line: a count out of range, no number, or an unknown dtype is one line and exit 2,
before any run."""

import pytest

import bench


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0", "--variants", "bare"], "argument --repeats: must be >= 1, not 0"),  # was an IndexError
    (["--warmup", "-1", "--steps", "2"], "argument --warmup: must be >= 0, not -1"),
    (["--peer", "--seq_len", "0"], "argument --seq_len: must be >= 1, not 0"),
    (["--peer", "--nprocs", "1,0"], "argument --nprocs: must be >= 1, not 0"),
    (["--peer", "--long_context", "--seqs", "8192,"], "argument --seqs: '' is not a whole number"),
    (["--peer", "--dtypes", "float32,fp16"], "argument --dtypes: 'fp16' is not a dtype; choose from float32, bfloat16"),
    (["--profile", "--dtypes", "bfloat16,"], "argument --dtypes: '' is not a dtype; choose from float32, bfloat16"),
])
def test_a_count_out_of_range_or_an_unknown_dtype_is_one_line_before_any_run(capsys, monkeypatch, argv, message):
    def ran(*args, **kwargs):
        raise AssertionError("a benchmark ran")
    for run in ("_child", "run_peer", "run_long_context", "run_profile"):
        monkeypatch.setattr(bench, run, ran)
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(f": error: {message}") and "Traceback" not in err, err
