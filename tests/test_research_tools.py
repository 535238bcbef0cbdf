"""The research probes the GPU runs call (`benchmarks/device_chain/steps*.txt`), run small on
the CPU: a probe that breaks is found here, not after a GPU machine has started for it."""

import json

import pytest

from benchmarks.research import chunk_attention, serve_step_probe, sinks_cost, sinks_pooling


@pytest.fixture
def compiles_anew():
    """No persistent compilation cache: a program another test compiled is compiled again,
    not loaded (its compile is what the test traces)."""
    import jax
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)


def test_serve_step_probe_records_memory_and_writes_hlo(tmp_path, compiles_anew):
    out, hlo = tmp_path / "probe", tmp_path / "hlo"
    assert serve_step_probe.main(["--small", "--max-batch", "2", "--max-len", "64",
                                  "--contexts", "32", "--chunks", "8", "--active", "1",
                                  "--rounds", "1", "--no-direct", "--hlo", str(hlo),
                                  "--layers", "1", "--profile", str(tmp_path / "profile"),
                                  "--compile-profile", str(tmp_path / "compile"),
                                  "--out", str(out)]) == 0
    records = json.loads((tmp_path / "probe.json").read_text())
    assert [r["program"] for r in records] == ["chunk 8", "decode 1"]
    assert [r["layers"] for r in records] == [1, 1]
    from benchmarks.serve_trace import SMALL, build_model
    from cca_jax.kv_cache import cache_bytes, cache_shapes
    cache = cache_bytes(cache_shapes(build_model(SMALL, "cca", 1).config, 2, 64))
    for r in records:       # the donated cache is updated in place: all its bytes aliased
        assert r["memory"]["alias_bytes"] >= cache > 0, (r["memory"], cache)
        assert r["memory"]["remat_ops"] == 0
        assert r["memory"]["compile_s"] > 0
        assert set(r["kernels"]["gaps"]) == {"total_ms", "longest"}   # (no GPU kernels here)
        events = {e["name"]: e["ms"] for e in r["memory"]["compile_events"]}
        assert events.get("backend_compile_and_load", 0) > 0, events   # XLA's compile, traced
        assert not any(name.startswith("$") for name in events)       # no Python frames
        assert r["memory"]["gemm_fusions"] >= r["memory"]["distinct_gemm_fusions"] >= 0
    assert sorted(p.name for p in hlo.iterdir()) == ["32_chunk_8.hlo.gz", "32_decode_1.hlo.gz"]


def test_serve_step_probe_times_each_program_once_per_xla_option_set(tmp_path):
    out = tmp_path / "probe"
    assert serve_step_probe.main(["--small", "--max-batch", "2", "--max-len", "64",
                                  "--contexts", "32", "--chunks", "8", "--active", "1",
                                  "--rounds", "1", "--no-direct", "--layers", "1",
                                  "--variants", "default,no_command_buffer,no_autotune",
                                  "--out", str(out)]) == 0
    records = json.loads((tmp_path / "probe.json").read_text())
    # the untuned variant compiles first: after a tuned one it would run the tuned GEMMs
    assert [(r["program"], r["variant"], r["tokens"]) for r in records] == [
        ("chunk 8", "no_autotune", 8), ("decode 1", "no_autotune", 1),
        ("chunk 8", "default", 8), ("decode 1", "default", 1),
        ("chunk 8", "no_command_buffer", 8), ("decode 1", "no_command_buffer", 1)]
    assert "| 32 | decode 1 | no_command_buffer |" in (tmp_path / "probe.md").read_text()
    with pytest.raises(SystemExit, match="unknown"):
        serve_step_probe.main(["--small", "--variants", "no_graphs",
                               "--out", str(tmp_path / "unknown")])


def test_sinks_cost_pairs_each_round_with_the_no_sink_call(tmp_path):
    out = tmp_path / "sinks"
    sinks_cost.main(["--impls", "xla", "--length", "256", "--hq", "2", "--hkv", "1", "--d",
                     "64", "--s", "64", "--sinks", "0,4", "--modes", "fwd", "--rounds", "3",
                     "--out", str(out)])
    records = {r["sink_tokens"]: r for r in json.loads((tmp_path / "sinks.json").read_text())}
    paired = records[4]["x_no_sinks_paired"]
    assert paired["p10"] <= paired["median"] <= paired["p90"]
    assert records[0]["x_no_sinks_paired"] == dict(median=1.0, p10=1.0, p90=1.0)


def test_sinks_pooling_variants_equal_the_librarys(tmp_path):
    out = tmp_path / "pooling"
    assert sinks_pooling.main(["--small", "--rounds", "2", "--out", str(out)]) == 0
    records = json.loads((tmp_path / "pooling.json").read_text())
    assert {(r["mode"], r["variant"]) for r in records} == {
        (mode, name) for mode in ("fwd", "fwd+bwd")
        for name in ("library", "no_sinks", "slice_concat", "groups_dus")}
    for r in records:
        assert r["max_abs_diff_vs_library"] == (None if r["variant"] == "no_sinks" else 0.0)


def test_kernel_families_sum_names_that_differ_only_in_numbering():
    from benchmarks.research.profile_inference import kernel_families
    by_name = {"gemm_fusion_dot_180": (2, 3_000_000), "gemm_fusion_dot.12": (1, 1_000_000),
               "loop_pad_fusion_63": (4, 2_500_000), "cca_forward_kernel": (1, 500_000),
               "gemm_fusion_dot": (1, 1_000_000)}
    assert kernel_families(by_name, 2) == [
        dict(name="gemm_fusion_dot", count=4, ms=5.0),
        dict(name="loop_pad_fusion", count=4, ms=2.5)]
    assert [f["name"] for f in kernel_families(by_name, 9)][-1] == "cca_forward_kernel"


def test_largest_gaps_name_the_kernels_around_each_idle_stretch():
    from benchmarks.research.profile_inference import largest_gaps
    sequence = [dict(name="a", us=5.0, gap_us=None), dict(name="b", us=1.0, gap_us=2.0),
                dict(name="c", us=1.0, gap_us=-0.5), dict(name="d", us=3.0, gap_us=900.0)]
    gaps = largest_gaps(sequence, 2)
    assert gaps["total_ms"] == 0.902     # overlapping launches (negative gaps) add nothing
    assert gaps["longest"] == [dict(us=900.0, after="c", before="d"),
                               dict(us=2.0, after="a", before="b")]


@pytest.mark.slow   # about 3 min: the Mosaic kernels in the GPU interpreter, 12 calls
def test_chunk_attention_reads_in_place_what_the_sliced_path_reads(tmp_path):
    out = tmp_path / "chunk"
    assert chunk_attention.main(["--small", "--splits", "1", "--rounds", "1",
                                 "--out", str(out)]) == 0
    records = {r["variant"]: r for r in json.loads((tmp_path / "chunk.json").read_text())}
    assert set(records) == {"sliced", "in_place_s1", "default"}
    assert records["in_place_s1"]["row_error_vs_sliced"] == 0.0      # the same kernel's walk
    assert records["default"]["key_splits"] == 4                     # 2 heads x 1 row block
    assert 0 < records["default"]["row_error_vs_sliced"] < 6e-3      # bfloat16 partials


def test_autotune_dedup_probe_counts_distinct_gemm_fusions(tmp_path):
    from benchmarks.research import autotune_dedup_probe as probe
    hlo = "\n".join([
        "%gemm_fusion_dot.1_computation (p0: bf16[8,64], p1: bf16[4,64,64]) -> f32[8,64] {",
        "  %parameter_1 = bf16[4,64,64]{2,1,0} parameter(1), metadata={op_name=\"a\"}",
        "  %slice.7 = bf16[1,64,64]{2,1,0} slice(%parameter_1), slice={[0:1], [0:64], [0:64]}",
        "}",
        "%gemm_fusion_dot.2_computation (p0: bf16[8,64], p1: bf16[4,64,64]) -> f32[8,64] {",
        "  %parameter_1.1 = bf16[4,64,64]{2,1,0} parameter(1), metadata={op_name=\"b\"}",
        "  %slice.9 = bf16[1,64,64]{2,1,0} slice(%parameter_1.1), slice={[1:2], [0:64], [0:64]}",
        "}",
        "%gemm_fusion_dot.3_computation (p0: bf16[8,64], p1: bf16[4,64,64]) -> f32[8,64] {",
        "  %parameter_1.2 = bf16[4,64,64]{2,1,0} parameter(1), metadata={op_name=\"c\"}",
        "  %slice.11 = bf16[1,64,64]{2,1,0} slice(%parameter_1.2), slice={[1:2], [0:64], [0:64]}",
        "}",
        "%fusion.4 (p0: f32[8]) -> f32[8] {",
        "  %x = f32[8]{0} parameter(0)",
        "}"])
    assert probe.gemm_fusions(hlo) == (3, 2)   # layer 1's slice twice: one distinct body
    out = tmp_path / "adp"
    assert probe.main(["--layers", "2", "--hidden", "32", "--inner", "64", "--rows", "4",
                       "--out", str(out)]) == 0
    records = json.loads((tmp_path / "adp.json").read_text())
    # the untuned way first: after a tuned one it would run the tuned GEMMs
    assert [r["way"] for r in records] == ["no_autotune", "stacked", "per_layer", "restacked",
                                           "autotune_1"]
    assert all(r["compile_s"] > 0 and r["ms"] > 0 for r in records)
    assert [r["max_abs_diff_vs_first"] for r in records] == [0.0] * len(records)   # one math


def test_the_device_chains_name_only_variants_the_probes_have():
    """A chain step that names a variant its probe lacks would stop that probe on the GPU
    machine, after minutes of device time: caught here instead."""
    import pathlib
    import re

    from benchmarks.research import autotune_dedup_probe, decode_compile_probe
    known = {"decode_compile_probe.py": ("--variants", decode_compile_probe.VARIANTS),
             "serve_step_probe.py": ("--variants", serve_step_probe.VARIANTS),
             "autotune_dedup_probe.py": ("--ways", autotune_dedup_probe.WAYS)}
    chains = sorted((pathlib.Path(__file__).parents[1] / "benchmarks/device_chain")
                    .glob("steps*.txt"))
    checked = 0
    for chain in chains:
        for line in chain.read_text().splitlines():
            for script, (flag, names) in known.items():
                match = re.search(rf"{script} .*{flag} ([\w,]+)", line)
                if match:
                    unknown = set(match.group(1).split(",")) - set(names)
                    assert not unknown, (chain.name, line[:60], unknown)
                    checked += 1
    assert checked >= 3


def test_decode_compile_probe_times_the_stacked_and_unstacked_steps(capsys):
    """With `--steps` the probe times the stacked variants on the real weights, then unstacks
    them in place for the `unstacked` variant, whatever order the variants are named in; an
    untuned variant compiles before the tuned ones (after them it would run their GEMMs)."""
    from benchmarks.research import decode_compile_probe as probe

    probe.main(["--shape", "tiny", "--batch", "2", "--max-len", "64", "--steps", "2",
                "--variants", "unstacked,base,no_autotune"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in records] == ["no_autotune", "base", "unstacked"], records
    assert all(r["step_ms"] > 0 for r in records)
    # (on the CPU `base` is `no_autotune`'s program, found compiled: a GPU option)
    assert records[0]["compile_s"] > 0 and records[2]["compile_s"] > 0, records


def test_the_mosaic_forward_is_lowered_once_for_alike_layers(tmp_path):
    """An unrolled chunk (lowered for CUDA on the CPU by `lowering_probe`) lowers the Mosaic
    forward once for the alike layers and once for the last (its last row only) through the
    kernel's own jit; called unjitted, once a layer (the 7B chunk's 23.9 s of host time
    against 3.1 s: benchmarks/results/research/lowering_probe_cpu.md)."""
    from benchmarks.research import lowering_probe
    assert lowering_probe.main(["--layers", "3", "--programs", "chunk64", "--out",
                                str(tmp_path / "lp")]) == 0
    records = json.loads((tmp_path / "lp.json").read_text())
    calls = {r["kernel_jit"]: r["mosaic_calls"] for r in records}
    assert calls == {False: 3, True: 2}, calls
    assert all(r["lower_s"] > 0 and r["module_mb"] > 0 for r in records)


def test_fused_backward_estimate_counts_what_the_kernels_visit(tmp_path):
    """The estimate's counts come from the kernels' visit tables: every kernel visits at
    least the visible scores, and with no slots to visit (a window as long as the row) the
    slot side has nothing to count; fusing saves two of seven products a visited block."""
    from benchmarks.research import fused_backward_estimate as fbe
    r = fbe.estimate(4096, hq=4, hkv=2, head_dim=64, group=16, window=256, backward_ms=10.0)
    assert min(r["dq_visited_x"], r["raw_visited_x"], r["core_visited_x"]) >= 1.0
    assert 5 / 7 - 0.05 < r["five_over_seven"] < 0.8
    no_slots = fbe.estimate(512, hq=2, hkv=2, head_dim=64, group=16, window=512)
    assert no_slots["core_visited_x"] is None and no_slots["raw_visited_x"] >= 1.0
    assert no_slots["five_over_seven"] < 1.0
    fbe.main(["--length", "1024", "--hq", "2", "--hkv", "1", "--head-dim", "64",
              "--window", "256", "--out", str(tmp_path / "e")])
    assert json.loads((tmp_path / "e.json").read_text())[0]["length"] == 1024


def test_call_overhead_loop_runs_every_call(tmp_path):
    """The in-program timing loop must run its forward once per step: a loop XLA may shorten
    (hoisting the call, or computing one element of it) would report a fraction of a call."""
    import jax
    import jax.numpy as jnp

    from benchmarks.research import call_overhead
    counted = []

    def impl(q, k, v, g, s, n):     # a forward whose every call leaves a trace at run time
        jax.debug.callback(lambda: counted.append(1))
        return q * 2 + k.mean() + v.mean()
    looped = call_overhead._looped(impl, 16, 64, calls=5)
    q, k, v = (jnp.full((1, 8, 1, 4), x, jnp.float32) for x in (1.0, 2.0, 3.0))
    out = looped(q, k, v)
    jax.block_until_ready(out)
    assert len(counted) == 5
    want = jnp.zeros_like(q)
    for _ in range(5):      # the same chain of calls, one program each
        q, k, v = (a.at[0, 0, 0, 0].set(want[0, 0, 0, 0]) for a in (q, k, v))
        want = impl(q, k, v, 16, 64, 0)
    assert jnp.array_equal(out, want)
    call_overhead.main(["--impls", "cca_xla", "--length", "256", "--hq", "2", "--hkv", "1",
                        "--d", "64", "--calls", "2", "--rounds", "1",
                        "--out", str(tmp_path / "co")])
    record, = json.loads((tmp_path / "co.json").read_text())
    assert record["in_program_ms"] > 0 and record["back_to_back_ms"] > 0


def test_the_device_chains_name_only_tilings_the_kernels_take():
    """The tilings a chain step sweeps (`--mosaic-tilings` of the decode probe and of the
    forward's, `--backward-tilings` of the backward's) are each a valid config: a misspelt
    field would stop the probe on the GPU machine, after minutes of device time."""
    import pathlib
    import re
    import shlex

    from pallas_kernels.mosaic_gpu.config import mosaic_backward_config, mosaic_config
    from pallas_kernels.mosaic_gpu.decode_config import decode_config
    makers = {"--mosaic-tilings": decode_config, "--backward-tilings": mosaic_backward_config}
    forward_probe = "mosaic_gpu_cca.py"   # its --mosaic-tilings are the forward's
    checked = 0
    for chain in sorted((pathlib.Path(__file__).parents[1] / "benchmarks/device_chain")
                        .glob("steps*.txt")):
        for line in chain.read_text().splitlines():
            if line.startswith("#") or not any(flag in line for flag in makers):
                continue
            for command in re.split(r";|&&|\|", line.split(None, 2)[2]):
                words = shlex.split(command)
                for flag, make in makers.items():
                    if flag == "--mosaic-tilings" and any(w.endswith(forward_probe)
                                                          for w in words):
                        make = mosaic_config
                    if flag in words:
                        for tiling in json.loads(words[words.index(flag) + 1]):
                            make(**tiling)
                            checked += 1
    assert checked >= 5


def test_a_benchmark_never_overwrites_earlier_results(tmp_path):
    """Results already written (committed ones included) stop a benchmark before it
    measures; the last guard refuses a file older than the run and lets the run rewrite
    its own files as it goes."""
    import os

    from benchmarks import sequence_balance
    from benchmarks.measure import check_not_older, write_results
    out = tmp_path / "balance"
    sequence_balance.main(["--length", "4096", "--shards", "2", "--out", str(out)])
    files = [tmp_path / "balance.json", tmp_path / "balance.md"]
    before = [f.read_bytes() for f in files]
    with pytest.raises(SystemExit, match="balance.json already exists"):
        sequence_balance.main(["--length", "8192", "--shards", "2", "--out", str(out)])
    files[0].unlink()
    with pytest.raises(SystemExit, match="balance.md already exists"):
        sequence_balance.main(["--length", "8192", "--shards", "2", "--out", str(out)])
    assert files[1].read_bytes() == before[1]

    old = tmp_path / "old.json"
    old.write_text("[]")
    os.utime(old, (0, 0))
    with pytest.raises(SystemExit, match="written before this run started"):
        write_results(str(tmp_path / "old"), [{"a": 1}], "table\n")
    assert old.read_text() == "[]"
    check_not_older(str(tmp_path / "absent"))
    for n in (1, 2):     # a run rewrites its own results as it goes
        write_results(str(tmp_path / "own"), [{"n": n}], f"{n}\n")
    assert json.loads((tmp_path / "own.json").read_text()) == [{"n": 2}]


def test_the_inference_profile_refuses_a_folder_holding_its_phases(tmp_path):
    """profile_inference writes `<out>/<phase>.json`: a phase already there stops it before
    it builds a model; the phases it does not run may be there."""
    from benchmarks.research import profile_inference
    small = ["--shape", "tiny", "--context", "256", "--steps", "2",
             "--trace-dir", str(tmp_path / "traces")]
    (tmp_path / "prefill.json").write_text("kept")
    with pytest.raises(SystemExit, match="prefill.json already exists"):
        profile_inference.main([*small, "--out", str(tmp_path), "--prefill", "--no-decode"])
    with pytest.raises(SystemExit, match="prefill.json already exists"):
        profile_inference.main([*small, "--out", str(tmp_path), "--prefill"])
    (tmp_path / "decode.json").write_text("kept")
    with pytest.raises(SystemExit, match="decode.json already exists"):
        profile_inference.main([*small, "--out", str(tmp_path)])
    assert {p.read_text() for p in tmp_path.glob("*.json")} == {"kept"}


def test_the_conversion_benchmark_works_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """convert_bench makes a new folder under --workdir for its checkpoints and removes only
    that one: a folder already there (say a user's `1b`) is neither written nor deleted."""
    from benchmarks import convert_bench
    mine = tmp_path / "1b"
    mine.mkdir()
    (mine / "model.safetensors").write_text("the user's")
    monkeypatch.setattr(convert_bench, "RESULTS", tmp_path / "results")
    made = []

    def stop_after_recording(out, size, seed=0):
        made.append(out)
        out.mkdir(parents=True)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(convert_bench, "make_random_checkpoint", stop_after_recording)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        convert_bench.main(["--size", "1b", "--workdir", str(tmp_path)])
    assert made[0].parent.parent == tmp_path and made[0].parent != mine
    assert not made[0].parent.exists()          # its own folder, removed
    assert (mine / "model.safetensors").read_text() == "the user's"


def test_the_stories_experiment_replaces_only_its_own_checkpoints(tmp_path):
    """A fine-tune folder under --work that the experiment did not write stops it before it
    trains; one it wrote (marked beside it) it may replace."""
    from benchmarks import stories_experiment as experiment
    theirs = tmp_path / "ft_cca"
    theirs.mkdir()
    with pytest.raises(SystemExit, match="ft_cca exists and this script did not write it"):
        experiment.fine_tune(tmp_path / "no-checkpoint", {}, None, 1, 1, 1e-3, theirs)
    assert theirs.exists()
    (tmp_path / ("ft_cca" + experiment.FINE_TUNED_MARK)).write_text("{}")
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):   # past the check
        experiment.fine_tune(tmp_path / "no-checkpoint", {}, None, 1, 1, 1e-3, theirs)


def test_decode_tiling_inference_runs_the_model_with_the_kernels_defaults(tmp_path, monkeypatch):
    """The chains' in-model decode probe: the tiling becomes the decode kernel's defaults
    (checked fields only), and the records carry the command with it."""
    from benchmarks.research import decode_tiling_inference as probe
    from pallas_kernels.mosaic_gpu import decode_config as decode
    monkeypatch.setattr(decode.MosaicDecodeConfig.__new__, "__defaults__",
                        decode.MosaicDecodeConfig.__new__.__defaults__)
    with pytest.raises(ValueError, match="unknown Mosaic GPU decode setting"):
        probe.use_tiling({"edge_mask": True})
    import sys
    monkeypatch.setattr(sys, "argv", [probe.__file__, "--tiling",
                                      '{"edge_masks_only": true, "stages": 3}', "--shape",
                                      "tiny", "--contexts", "256", "--decode-tokens", "2",
                                      "--decode-warmup", "2", "--prefill-runs", "1",
                                      "--out", str(tmp_path / "inf")])
    assert probe.main() == 0     # as the chains run it: the command line is the script's
    assert decode.decode_config() == decode.MosaicDecodeConfig(stages=3, edge_masks_only=True)
    records = json.loads((tmp_path / "inf.json").read_text())
    assert records and all('--tiling {"edge_masks_only": true, "stages": 3}' in r["command"]
                           for r in records)


def test_kernel_registers_reads_ptxas_report_per_function():
    """kernel_registers.parse: each entry function's registers, spills and stack from
    ptxas's lines (a function without a spill line has none recorded; a spill warning,
    printed before the function it names, is not the previous function's), and every
    kernel's shared memory from the tilings' own accounting."""
    from benchmarks.research import kernel_registers
    report = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'cca_forward_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for cca_forward_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas warning : Registers are spilled to local memory in function 'cca_dq_mosaic_gpu_kernel', 24 bytes spill stores, 32 bytes spill loads
ptxas info    : Compiling entry function 'cca_dq_mosaic_gpu_kernel' for 'sm_90a'
    16 bytes stack frame, 24 bytes spill stores, 32 bytes spill loads
ptxas info    : Used 232 registers
ptxas info    : Compiling entry function 'cca_decode_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Used 90 registers"""
    got = kernel_registers.parse(report)
    assert [r["function"] for r in got] == ["cca_forward_mosaic_gpu_kernel",
                                           "cca_dq_mosaic_gpu_kernel",
                                           "cca_decode_mosaic_gpu_kernel"]
    assert got[0] == dict(function="cca_forward_mosaic_gpu_kernel", registers=168,
                          stack_bytes=0, spill_store_bytes=0, spill_load_bytes=0)
    assert (got[1]["registers"], got[1]["spill_store_bytes"], got[1]["spill_load_bytes"],
            got[1]["stack_bytes"]) == (232, 24, 32, 16)
    assert got[2] == dict(function="cca_decode_mosaic_gpu_kernel", registers=90)
    smem = kernel_registers.shared_memory()
    assert set(smem) == {"cca_forward", "cca_dq", "cca_dk_dv", "cca_dck_dcv", "cca_decode"}
    assert all(100 < kib <= 227 for kib in smem.values()), smem   # one CTA an SM, each
    persistent = kernel_registers.shared_memory(
        {"persistent": True, "backward_tiling": {"persistent": True}})
    assert persistent["cca_forward"] > smem["cca_forward"]   # O tiles of its own
    assert persistent["cca_decode"] == smem["cca_decode"]


def test_mosaic_modules_compares_two_trees_kernel_by_kernel(capsys, tmp_path):
    """This tree against itself: every kernel identical, both texts written. Summaries that
    differ: the loops counted as a multiset (a moved loop is still the same loop), the op
    counts' deltas."""
    import pathlib

    from benchmarks.research import mosaic_modules as probe
    repo = str(pathlib.Path(__file__).parents[1])
    out = tmp_path / "modules"
    assert probe.main(["--against", repo, "--d", "64", "--hq", "2", "--hkv", "1",
                       "--length", "256", "--slots", "32", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == ["cca_forward: identical"]
    old_text, new_text = ((out / f"{tree}_cca_forward.mlir").read_text()
                          for tree in ("old", "new"))
    assert old_text == new_text and old_text.startswith("module @cca_forward")
    assert "loc(" not in old_text
    with pytest.raises(SystemExit, match="exists"):    # never over an earlier run's texts
        probe.main(["--against", repo, "--out", str(out)])
    old = {"sha256": "a", "loops": ["x", "y", "z"], "ops": {"arith.addi": 3, "scf.for": 3}}
    moved = {"sha256": "b", "loops": ["y", "z", "x"], "ops": {"arith.addi": 3, "scf.for": 3}}
    assert probe.compare(old, moved) == ("3 of its 3 wgmma loops as in the old tree's 3 "
                                         "(reordered); ops the same counts")
    changed = {"sha256": "c", "loops": ["x", "w"], "ops": {"arith.addi": 5}}
    assert probe.compare(old, changed) == ("1 of its 2 wgmma loops as in the old tree's 3; "
                                           "ops arith.addi +2, scf.for -3")
    text = ("module @k {\n  %0 = scf.for %i = %a to %b step %c iter_args(%x = %y) -> f32 {\n"
            "    %1 = nvvm.wgmma.mma_async %x\n    scf.yield %1\n  }\n"
            "  %2 = scf.for %j = %a to %b step %c iter_args(%u = %w) -> f32 {\n"
            "    %3 = nvvm.wgmma.mma_async %u\n    scf.yield %3\n  }\n}\n")
    loops = probe.wgmma_loops(text)
    assert len(loops) == 2 and loops[0] == loops[1]   # SSA names do not count
    assert probe.module_name(text) == "k"
