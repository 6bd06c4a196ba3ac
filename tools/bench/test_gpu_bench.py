"""gpu_bench before a device run spends minutes on it: its dry run on CPU (child processes,
estimates, the result file), and the real variants' configs and memory-fit decisions."""

import gpu_bench

H100_GIB, H200_GIB = 79.2, 139.7  # torch.cuda.get_device_properties(0).total_memory / 2**30


def test_dry_run_measures_every_variant_a_cpu_can_run(tmp_path):
    assert gpu_bench.main(["--dry-run", "--steps", "2", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("gpu-*-cpu-dry-run.md")
    lines = result.read_text().splitlines()
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[6:] if line.startswith("| ")}
    assert set(rows) == set(gpu_bench.VARIANTS)
    for name, cells in rows.items():
        if "float8" in name:
            assert cells[0] == "skipped: needs CUDA", cells
        else:  # tokens/s, MFU of the measured matmul peak and both estimates are figures; the loss is
            # a cross-entropy over 2048 tokens
            assert float(cells[0].replace(",", "")) > 0 and float(cells[3].split()[0]) > 0, cells
            assert float(cells[5]) > 0 and float(cells[6]) > 0, cells
            assert 0 < float(cells[8].strip(" |")) < 10, cells
    ratios = [line for line in lines if line.startswith("- ")]
    assert len(ratios) == len(gpu_bench.RATIOS) and float(ratios[0].split()[-1].rstrip("x")) > 0, ratios
    assert ratios[1].endswith("not measured (a variant did not run)"), ratios  # float8 needs CUDA
    assert ratios[2].endswith("not measured (no CUDA memory figures)"), ratios


def test_gpu_variants_are_valid_and_skipped_only_where_they_cannot_fit(tmp_path):
    """The CUDA variants plan as a CUDA job and trace (float8, offload and compile included); the 8B
    one, about 120 GiB with AdamW in fp32, is skipped on an H100 and runs on an H200; every 1B one
    fits both."""
    for name in gpu_bench.VARIANTS:
        estimated = gpu_bench.estimates(gpu_bench.variant_argv(name, 30, tmp_path, dry=False))
        assert estimated["formula_gib"] and estimated["traced_gib"], (name, estimated)
        on_h100, on_h200 = (gpu_bench.skip_reason(name, estimated, gib) for gib in (H100_GIB, H200_GIB))
        assert on_h200 is None, (name, estimated)
        assert (on_h100 is None) == name.startswith("1B"), (name, estimated, on_h100)
