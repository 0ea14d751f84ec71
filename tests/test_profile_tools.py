"""tests/gpu/ncu_counters.py on a synthetic ncu CSV (the profile itself needs a GPU)."""


def test_ncu_counters_groups_kernel_names_as_ncu_prints_them(tmp_path, capsys, gpu_tool):
  # Names as one H200 profile printed them: ncu dropped jax_flash::cuda:: from
  # some of ours, and kept it (less cuda::) on others.
  names = {
      "1": ("void sm90::FwdWsKernel<__nv_bfloat16, sm90::FwdWsTraits<128, 2>, void, 0>"
            "(sm90::FwdWsArgs)", 10.0),
      "2": ("void jax_flash::BwdPreprocessKernel<__nv_bfloat16, 128>(jax_flash::BwdArgs, bool)",
            2.0),
      "3": ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 7.0),
      "4": ("void cudnn::convert_dq_to_16bits<1>(const void *, void *)", 1.0),
      "5": ("loop_convert_fusion", 100.0),
  }
  rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
  rows += [f'"{i}","{n}","smsp__inst_executed.sum","inst","{v:,.0f}"'
           for i, (n, v) in names.items()]
  path = tmp_path / "ncu.csv"
  path.write_text("==PROF== Connected to process\n" + "\n".join(rows) + "\n")
  counters = gpu_tool("ncu_counters")
  assert [counters.group_of(n) for n, _ in names.values()] == \
      ["jax_flash", "jax_flash", "cudnn", "cudnn", "other"]
  counters.main([str(path)])
  out = capsys.readouterr().out
  assert "other: kernel 5 loop_convert_fusion" in out
  line = next(l for l in out.splitlines() if l.startswith("smsp__inst_executed.sum"))
  assert line.split()[1:] == ["12", "8", "0.667"]
  assert "per kernel" not in out  # no durations in this profile


def test_ncu_counters_gives_each_kernels_share_of_its_sides_time(tmp_path, capsys, gpu_tool):
  durations = {"1": ("void jax_flash::BwdPreprocessKernel<__nv_bfloat16, 128>()", 30.0),
               "2": ("void sm90::BwdKernel<__nv_bfloat16, 128>()", 900.0),
               "3": ("void jax_flash::BwdPostprocessKernel<__nv_bfloat16, 128>()", 70.0),
               "4": ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 950.0),
               "5": ("loop_convert_fusion", 5.0)}
  rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
  rows += [f'"{i}","{n}","gpu__time_duration.sum","nsecond","{v:,.0f}"'
           for i, (n, v) in durations.items()]
  path = tmp_path / "ncu.csv"
  path.write_text("\n".join(rows) + "\n")
  gpu_tool("ncu_counters").main([str(path)])
  out = capsys.readouterr().out
  total = next(l for l in out.splitlines() if l.startswith("gpu__time_duration.sum "))
  assert total.split()[1:] == ["1000", "950", "0.950"]
  shares = [l.split() for l in out.splitlines() if l.startswith("  ")]
  assert [(s[0], s[2]) for s in shares] == [("jax_flash", "3.0%"), ("jax_flash", "90.0%"),
                                            ("jax_flash", "7.0%"), ("cudnn", "100.0%")]


def test_ncu_stalls_mix_sums_executions_per_opcode(tmp_path, capsys, gpu_tool):
  # A source export as `ncu --page source --csv --print-source sass` writes
  # it: the kernel's name, the header, one row per SASS instruction.
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Instructions Executed", "stall_wait"]
  rows = [["0x10", "FMNMX R1, R2, R3, !PT", "5", "800", "5"],
          ["0x20", "@!P0 MUFU.EX2 R4, R4", "9", "600", "9"],
          ["0x30", "FMNMX R5, R1, R6, !PT", "1", "200", "1"],
          ["0x40", "", "0", "0", "0"]]
  path = tmp_path / "source.csv"
  path.write_text("\n".join(",".join(f'"{c}"' for c in r)
                            for r in [["kernel"], header, *rows]) + "\n")
  gpu_tool("ncu_stalls").main([str(path), "--mix"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("1600 warp instructions executed")
  assert lines[1].split()[:2] == ["FMNMX", "1000"]
  assert lines[2].split()[:2] == ["MUFU", "600"]
