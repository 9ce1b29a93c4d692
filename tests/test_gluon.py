"""The Hopper backend (Gluon) on the CPU: its modules are generated, deterministic and valid Python; steps it
cannot lower are named by file:line and keep their kernel on the tl path; every generated kernel, those of
specs/ and of tests/specs/, lowers to TTGIR for sm_90 with the installed Triton (warp-specialized, with wgmma
and TMA); a launch off a Hopper GPU is refused with the reason; and the Hopper kernel as a tuning candidate:
the table records the backend that won, and the tl launcher runs the Hopper kernel when its config says so.
Gluon kernels do not run on the CPU (no interpreter): tests/test_gpu.py (`-k gluon`) checks them against
float64 on an H200."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from codagen import api
from codagen.emit.gluon import render_gluon, unlowered
from codagen.primitives import PRIMITIVES
from codagen.runtime import Config, HopperConfig, tile

LOWERED = {p.name for p in PRIMITIVES.values() if "gluon" in p.emitters}  # primitives with a Gluon emitter

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "specs"
TEST_SPECS = REPO / "tests" / "specs"


def _kernels(path: Path) -> list:
    return sorted(((c.kernel, c.types) for c in api.load([path]) if isinstance(c, api.Checked)),
                  key=lambda t: t[0].name)


def test_generated_and_deterministic():
    first = render_gluon(_kernels(SPECS), "codagen build specs/")
    assert first == render_gluon(_kernels(SPECS), "codagen build specs/")
    built = {rel: text for rel, text in api.generate([SPECS]).files.items() if rel.startswith("kernels/gluon/")}
    assert built.keys() == first.keys()
    # the kernels the backend lowers today; a spec change that loses one should be noticed
    assert {"kernels/gluon/matmul.py", "kernels/gluon/out_proj_residual_norm.py"} <= set(first)


def test_valid_python_importing_nothing_at_package_level():
    files = render_gluon(_kernels(SPECS), "codagen build specs/")
    for rel, text in files.items():
        tree = ast.parse(text, filename=rel)
        if rel.endswith("__init__.py"):  # the package must not import the kernels (only Hopper GPUs may)
            assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body)
        else:
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            stem = Path(rel).stem
            assert {f"{stem}_gluon_kernel", f"{stem}_consumer", f"{stem}_epilogue", "launch"} <= names


def test_unlowered_steps_named_and_kept_on_tl():
    kernels = dict((k.name, (k, t)) for k, t in _kernels(TEST_SPECS))
    found = [str(f) for f in unlowered(*kernels["t_select_accumulate"])]
    assert any(line.startswith(f"{TEST_SPECS.relative_to(REPO)}/t_select_accumulate.yaml:")
               and "accumulate: {x: acc, into: acc_tile}: no Gluon lowering of 'accumulate' yet" in line
               and "keeps the tl kernel only" in line for line in found)
    no_gemm = [str(f) for f in unlowered(*dict((k.name, (k, t)) for k, t in _kernels(SPECS))["rmsnorm_stats"])]
    assert no_gemm and all("no GEMM" in line for line in no_gemm)
    files = render_gluon(list(kernels.values()), "codagen build tests/specs/")
    assert "kernels/gluon/t_select_accumulate.py" not in files
    assert "t_select_accumulate keeps" in files["kernels/gluon/__init__.py"]
    assert any("t_select_accumulate.yaml:" in line for line in api.fallbacks(api.load([TEST_SPECS])))


def test_pairs_of_the_accumulator_are_lowered():
    """SwiGLU of the accumulator's pairs: split in registers, its half-width output stored by TMA through the
    first half of an epilogue buffer; RoPE with its frequencies loaded per column."""
    kernels = dict((k.name, (k, t)) for k, t in _kernels(SPECS))
    assert unlowered(*kernels["gate_up_swiglu"]) == [] and unlowered(*kernels["qkv_norm_rope"]) == []
    rope = render_gluon([kernels["qkv_norm_rope"]], "codagen build specs/")["kernels/gluon/qkv_norm_rope.py"]
    assert "freqs_of_columns = tl.load(freqs_ptr + (cols // 2) * stride_freqs_n, mask=col_mask" in rope
    assert "tile.rope_by_columns(z, positions.to(tl.float32), freqs_of_columns, INVERSE=False)" in rope
    source = render_gluon([kernels["gate_up_swiglu"]], "codagen build specs/")["kernels/gluon/gate_up_swiglu.py"]
    assert "yv = tile.swiglu(zv)" in source
    assert "hopper.store_narrow_tile(y_desc, buffers[0], yv, pid_m * BLOCK_M, pid_n * (BLOCK_N // 2)" in source
    assert ("hopper.store_direct(y_ptr, stride_y_m, stride_y_n, yv, pid_m * BLOCK_M, pid_n * (BLOCK_N // 2), M, "
            "N // 2)") in source
    assert "hopper.store_descriptor(y, [config.block_m, slice_n // 2], config)" in source


def test_a_value_cast_to_t_and_stored_is_converted_once(tmp_path):
    """A tile that a cast rounds to T and a store writes in T (either order) is converted once, and the store
    takes the converted tile: the logits (cast, then stored), SwiGLU's gradient (stored, then cast for the
    row dot; a tile of pairs) and CAST_ONE_HOT's d (cast, then stored itself). A cast to another dtype rounds
    alone."""
    kernels = dict((k.name, (k, t)) for k, t in _kernels(SPECS))
    logits = render_gluon([kernels["lm_head_logits"]], "test")["kernels/gluon/lm_head_logits.py"]
    assert "zt, zt_as_t = tile.round_for_store(z, h_desc.dtype)" in logits
    assert "hopper.store_tile(logits_desc, buffers[0], zt_as_t, pid_m * BLOCK_M" in logits
    swiglu = render_gluon([kernels["swiglu_dgrad"]], "test")["kernels/gluon/swiglu_dgrad.py"]
    rounding = ("dz_stored_even, dz_stored_odd, dz_stored_as_t = tile.round_pairs_for_store(dzv_even, dzv_odd, "
                "grad_y_desc.dtype)")
    assert swiglu.count(rounding) == 1 and "tile.round_to(" not in swiglu
    assert swiglu.index(rounding) < swiglu.index("hopper.store_tile(dz_desc, buffers[0], dz_stored_as_t")
    assert "# cast: {x: dzv, dtype: T, out: dz_stored}  (rounded with the store above)" in swiglu
    (tmp_path / "casts_one_hot.yaml").write_text(CAST_ONE_HOT)
    [(k, types)] = _kernels(tmp_path)
    casts = render_gluon([(k, types)], "test")["kernels/gluon/casts_one_hot.py"]
    assert "d_t, d_t_as_t = tile.round_for_store(d, a_desc.dtype)" in casts
    assert "hopper.store_tile(dz_desc, buffers[0], d_t_as_t, pid_m * BLOCK_M" in casts
    assert "d_h = tile.round_to(d_t, tl.float16)" in casts


def test_pairs_loaded_from_memory_are_lowered():
    """The gated activations' backward (swiglu_dgrad, swiglu_bias_dgrad, geglu_dgrad), on 8 column slices of
    the tile by default: each slice's saved pairs cross by TMA whole (2 * its columns) into a buffer twice as
    wide as the slice, and are read as their even and odd columns in the accumulator's layout at the slice's
    width; dz, interleaved again, leaves whole through that buffer, y (N wide) through its first half."""
    kernels = dict((k.name, (k, t)) for k, t in _kernels(SPECS))
    for name in ("swiglu_dgrad", "swiglu_bias_dgrad", "geglu_dgrad"):
        assert unlowered(*kernels[name]) == [], name
    source = render_gluon([kernels["swiglu_dgrad"]], "codagen build specs/")["kernels/gluon/swiglu_dgrad.py"]
    for line in ("EPILOGUE = hopper.Epilogue(buffers=1, inputs=1, columns=2, split=8)",
                 "mbarrier.expect(ready, z_desc.block_type.nbytes)",
                 "hopper.tma_load(z_desc, [first_row, slice_n * (2 * SLICE_N)], ready, buffers[0])",
                 "acc_slice = hopper.column_slice(acc, step_start, in_step, EPILOGUE_SPLIT, SLICE_UNROLL, SLICE)",
                 "z_even, z_odd = hopper.load_pairs(buffers[0], acc_slice)",
                 "dzv_even, dzv_odd = tile.swiglu_bwd_pairs(acc, z_even, z_odd)",
                 "hopper.store_tile(dz_desc, buffers[0], dz_stored_as_t, pid_m * BLOCK_M,",
                 "hopper.store_narrow_tile(y_desc, buffers[0], yv, pid_m * BLOCK_M, pid_n * BLOCK_N, PENDING=0)",
                 "hopper.store_direct(dz_ptr, stride_dz_m, stride_dz_n, dz_stored_as_t, pid_m * BLOCK_M, ",
                 "hopper.store_direct(y_ptr, stride_y_m, stride_y_n, yv, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N)",
                 "hopper.descriptor(z, [config.block_m, 2 * slice_n]),",
                 "hopper.store_descriptor(y, [config.block_m, slice_n], config),",
                 "[CONSUMERS * EPILOGUE_STAGES, BLOCK_M, 2 * (BLOCK_N // EPILOGUE_SPLIT)]"):
        assert line in source, line
    # slice `part` in its stage's buffers, loaded during the mainloop, or once the slice before it there is
    # done: stored, or with direct stores read
    for line in ("slot = CONSUMER * EPILOGUE_STAGES + part % EPILOGUE_STAGES",
                 "mbarrier.wait(inputs_ready.index(slot), (tile_count * LOADS + part // EPILOGUE_STAGES) & 1)",
                 "if not DIRECT_STORES and part + EPILOGUE_STAGES < EPILOGUE_SPLIT:",
                 "if DIRECT_STORES and part + EPILOGUE_STAGES < EPILOGUE_SPLIT:",
                 "slice_n + EPILOGUE_STAGES, SLICE_N)"):
        assert line in source, line
    assert source.count("slice_n + EPILOGUE_STAGES, SLICE_N)") == 2


def test_epilogue_slices_that_tma_cannot_copy_refused():
    """An epilogue slice of pairs is one TMA copy of 2 * block_n / epilogue_split columns: wider than TMA takes
    is refused at the launch, and so are slices too narrow for a gated output's half."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    m = _module("swiglu_dgrad")
    x = torch.randn(40, 24).bfloat16()
    args = (x, torch.randn(24, 16).bfloat16(), torch.randn(40, 32).bfloat16())
    outs = {"dz": torch.empty(40, 32).bfloat16(), "zdz_part": torch.empty(40, 1), "y": torch.empty(40, 16).bfloat16()}
    with pytest.raises(ValueError, match="2 \\* block_n / epilogue_split = 512 columns, more than the 256 a TMA"):
        m.check_launch((*args, *outs.values()), hopper.HopperConfig(block_m=64, block_n=256))
    with pytest.raises(ValueError, match="epilogue slices of 8 columns; they need 16 or more"):
        m.check_launch((*args, *outs.values()), hopper.HopperConfig(block_n=64, epilogue_split=8))
    with pytest.raises(ValueError, match=r"epilogue_stages must be None, or 1, 2, 4 or 8 dividing epilogue_split \(2\)"):
        hopper.HopperConfig(epilogue_split=2, epilogue_stages=4)  # refused when made


def test_epilogue_stages():
    """A Hopper config's epilogue stages: fewer than its slices shrink the epilogue's buffers in proportion,
    which makes room for operand stages; the tl kernel has none (a table's Hopper choice that falls back to it
    drops them)."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from codagen.runtime import backends

    pairs = hopper.Epilogue(buffers=1, columns=2, split=8)
    whole = hopper.HopperConfig(stages=3, epilogue_split=8)
    streamed = hopper.HopperConfig(stages=3, epilogue_split=8, epilogue_stages=2)
    assert whole.smem_bytes(2, pairs) - streamed.smem_bytes(2, pairs) == 2 * 128 * 2 * 16 * 6 * 2  # 6 slices fewer
    assert dataclasses.replace(streamed, stages=6).smem_bytes(2, pairs) <= hopper.SMEM_LIMIT
    assert whole.meta()["EPILOGUE_STAGES"] == 8 and streamed.meta()["EPILOGUE_STAGES"] == 2
    assert streamed.label() == "128x128x64 s3 g8 r232 epilogue/8 in 2 gluon"
    chosen = HopperConfig(128, 128, 64, stages=6, epilogue_split=8, epilogue_stages=2)
    assert hopper.launch_config(chosen, pairs) == dataclasses.replace(streamed, stages=6) == chosen
    for bad in (3, 16, 0, 2.0):
        with pytest.raises(ValueError, match="HopperConfig: epilogue_stages must be None, or 1, 2, 4 or 8"):
            HopperConfig(epilogue_split=8, epilogue_stages=bad)
    with pytest.raises(TypeError, match="epilogue_stages"):
        Config(epilogue_split=8, epilogue_stages=2)  # the tl kernel has none
    with pytest.raises(ValueError, match=r"dividing epilogue_split \(2\), got 4"):
        HopperConfig(epilogue_split=2, epilogue_stages=4)
    a, b, out = (t.bfloat16() for t in _matmul_args())
    assert backends.or_tl("generated.kernels", "matmul", chosen, (a, b, out)) == Config(
        128, 128, 64, 8, 4, 6, epilogue_split=8)


def test_direct_stores():
    """A Hopper config's direct stores: the buffers that only stores used are not allocated (the tile inputs'
    stay), which makes room for operand stages; the launcher passes no TMA descriptor for outputs; the tl
    kernel has none (it always stores from registers), and a table's Hopper choice that falls back drops it."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from codagen.runtime import backends

    stores_only, pairs = _module("gate_up_swiglu").EPILOGUE, _module("swiglu_dgrad").EPILOGUE
    assert (stores_only.buffers, stores_only.inputs, pairs.buffers, pairs.inputs) == (1, 0, 1, 1)
    assert _module("lm_head_logsumexp").EPILOGUE.buffers == 0  # nothing crosses by TMA in its epilogue
    tma = hopper.HopperConfig(stages=5, epilogue_split=4)
    direct = dataclasses.replace(tma, direct_stores=True)
    assert tma.smem_bytes(2, stores_only) - direct.smem_bytes(2, stores_only) == 2 * 128 * 32 * 4 * 2
    assert dataclasses.replace(direct, stages=6).smem_bytes(2, stores_only) <= hopper.SMEM_LIMIT
    assert tma.smem_bytes(2, pairs) == direct.smem_bytes(2, pairs)  # its buffers hold the pairs it loads
    assert direct.meta()["DIRECT_STORES"] is True and tma.meta()["DIRECT_STORES"] is False
    assert direct.label() == "128x128x64 s5 g8 r232 epilogue/4 direct gluon"
    chosen = HopperConfig(128, 128, 64, stages=5, epilogue_split=4, direct_stores=True)
    assert hopper.launch_config(chosen, stores_only) == direct
    y = torch.empty(64, 32).bfloat16()
    assert hopper.store_descriptor(y, [128, 16], direct) is None
    assert hopper.store_descriptor(y, [128, 16], tma).block_shape == [128, 16]
    with pytest.raises(TypeError, match="direct_stores"):
        Config(direct_stores=True)  # the tl kernels always store from registers
    with pytest.raises(ValueError, match="HopperConfig: direct_stores must be True or False"):
        HopperConfig(direct_stores=1)
    a, b, out = (t.bfloat16() for t in _matmul_args())
    assert backends.or_tl("generated.kernels", "matmul", chosen, (a, b, out)) == Config(
        128, 128, 64, 8, 4, 5, epilogue_split=4)


def test_direct_stores_lower_to_ttgir_for_sm90():
    """A Hopper kernel of each epilogue shape that stores tiles by TMA, compiled as far as TTGIR for sm_90 with
    direct stores: its tiles leave by plain stores, no TMA store is made or waited for, and only the tile inputs
    have buffers."""
    names = _one_per_epilogue(_modules_with("hopper.store_direct("))
    assert {"geglu_dgrad", "gate_up_bias_swiglu", "matmul_accumulate"} <= set(names)
    found = _ttgir_each("[hopper.HopperConfig(stages=3, epilogue_split=max(module.EPILOGUE.split, 4) "
                        "if not module.EPILOGUE.column_group else 1, direct_stores=True)]", names)
    for name in names:
        (ttgir,), epilogue = found[name], _module(name).EPILOGUE
        assert "async_tma_copy_local_to_global" not in ttgir and "async_tma_store_wait" not in ttgir, name
        assert "tt.store" in ttgir, name
        loads = "async_tma_copy_global_to_local" in ttgir.split("ttg.warp_specialize")[1].split("partition0")[0]
        assert loads == bool(epilogue.inputs), name  # the consumer's own TMA loads: tile inputs only


def test_slice_loop():
    """A Hopper config's slice loop: its meta and label, refused for the tl kernels and on a whole tile, and
    dropped where a table's Hopper choice falls back to the tl kernel."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from codagen.runtime import backends

    chosen = HopperConfig(128, 128, 64, stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True)
    loop = hopper.launch_config(chosen, _module("swiglu_dgrad").EPILOGUE)
    assert loop == hopper.HopperConfig(stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True)
    assert loop.meta()["SLICE_LOOP"] is True and hopper.HopperConfig().meta()["SLICE_LOOP"] is False
    assert loop.label() == "128x128x64 s6 g8 r232 epilogue/8 in 2 loop gluon"
    with pytest.raises(TypeError, match="slice_loop"):
        Config(epilogue_split=4, slice_loop=True)  # the tl kernels have none
    with pytest.raises(ValueError, match="HopperConfig: slice_loop is for an epilogue_split of 2 or more, got "
                       "epilogue_split 1"):
        HopperConfig(slice_loop=True)
    a, b, out = (t.bfloat16() for t in _matmul_args())
    loop_matmul = HopperConfig(128, 128, 64, stages=5, epilogue_split=4, slice_loop=True)
    assert backends.or_tl("generated.kernels", "matmul", loop_matmul, (a, b, out)) == Config(
        128, 128, 64, 8, 4, 5, epilogue_split=4)


def test_slice_loop_by_steps_of_slices():
    """slice_unroll: slices per step of the slice loop, in the meta and label, 2 or 4 dividing epilogue_split and
    less than it, refused without the loop, and dropped where a table's Hopper choice falls back to the tl
    kernel."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from codagen.runtime import backends

    chosen = HopperConfig(128, 128, 64, stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True,
                          slice_unroll=2)
    by_two = hopper.launch_config(chosen, _module("swiglu_dgrad").EPILOGUE)
    assert by_two == hopper.HopperConfig(stages=6, epilogue_split=8, epilogue_stages=2, slice_loop=True,
                                         slice_unroll=2)
    assert by_two.meta()["SLICE_UNROLL"] == 2 and hopper.HopperConfig().meta()["SLICE_UNROLL"] == 1
    assert by_two.label() == "128x128x64 s6 g8 r232 epilogue/8 in 2 loop by 2 gluon"
    for split, unroll, loop in ((8, 2, False), (8, 3, True), (4, 4, True), (2, 4, True), (8, 8, True)):
        with pytest.raises(ValueError, match=f"slice_unroll is slice_loop's: 2 or 4 slices per step of the loop, "
                           f"dividing epilogue_split \\({split}\\) and less than it, got {unroll} with slice_loop "
                           f"{loop}"):
            HopperConfig(epilogue_split=split, slice_loop=loop, slice_unroll=unroll)
    a, b, out = (t.bfloat16() for t in _matmul_args())
    by_two_matmul = HopperConfig(128, 128, 64, stages=5, epilogue_split=4, slice_loop=True, slice_unroll=2)
    assert backends.or_tl("generated.kernels", "matmul", by_two_matmul, (a, b, out)) == Config(
        128, 128, 64, 8, 4, 5, epilogue_split=4)


def test_three_consumers():
    """A Hopper config with three consumers: 64-row tiles only, 160 registers each (three of 232 would not fit
    the register file), buffers for three, refused for the tl kernels, and dropped where a table's Hopper
    choice falls back to the tl kernel."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from codagen.runtime import backends

    chosen = HopperConfig(64, 128, 64, stages=7, epilogue_split=4, slice_loop=True, consumers=3)
    stores_only = _module("gate_up_swiglu").EPILOGUE
    three = hopper.launch_config(chosen, stores_only)
    assert (three.consumers, three.consumer_regs, three.meta()["CONSUMERS"]) == (3, 160, 3)
    assert three.label() == "64x128x64 s7 g8 r160 epilogue/4 loop c3 gluon"
    two = dataclasses.replace(three, consumers=2, consumer_regs=232)
    assert three.smem_bytes(2, stores_only) - two.smem_bytes(2, stores_only) == 64 * 32 * 4 * 2  # a third's buffers
    with pytest.raises(ValueError, match="consumers must be 2 or 3, each with consumer_regs registers, within the "
                       "512 per thread of a warpgroup .* got 3 consumers of 232"):
        hopper.HopperConfig(block_m=64, consumers=3, consumer_regs=232)
    with pytest.raises(ValueError, match="HopperConfig: consumers must be 2, or 3 with block_m 64 .* got 3 with block_m "
                       "128"):
        HopperConfig(consumers=3)
    with pytest.raises(TypeError, match="consumers"):
        Config(block_m=64, consumers=3)  # the tl kernels have none
    a, b, out = (t.bfloat16() for t in _matmul_args())
    assert backends.or_tl("generated.kernels", "matmul", chosen, (a, b, out)) == Config(
        64, 128, 64, 8, 4, 7, epilogue_split=4)


def test_three_consumers_lower_to_ttgir_for_sm90():
    """A Hopper kernel of each epilogue shape, compiled as far as TTGIR for sm_90 with three consumers of 64-row
    tiles: three consumer partitions and the producer, each consumer waiting for its turn on a barrier of three."""
    names = _one_per_epilogue(_modules_with("_consumer("))
    found = _ttgir_each("[two := hopper.HopperConfig(block_m=64, stages=4), "
                        "dataclasses.replace(two, consumers=3, consumer_regs=160)]", names)
    for name in names:
        two, three = found[name]
        assert "partition1" in two and "partition2" not in two, name  # workers: a consumer, the producer
        assert "partition2" in three and "partition3" not in three, name  # two consumers, the producer
        assert "memdesc<3x1xi64" in three and "memdesc<3x1xi64" not in two, name  # the turn barriers


def test_sigmoid_from_approximate_ptx():
    """SwiGLU's sigmoid, compiled as far as TTGIR for sm_90, is PTX's approximate 2^x and reciprocal
    (tile.sigmoid; the interpreter's tl.sigmoid is tested against float64 under the interpreter, and this one
    on the GPU)."""
    found = _ttgir_each("[hopper.default_config(module.EPILOGUE)]", ["gate_up_swiglu", "swiglu_dgrad"])
    for name, (ttgir,) in found.items():
        assert "ex2.approx.ftz.f32" in ttgir and "rcp.approx.ftz.f32" in ttgir, name


def test_slice_loop_lowers_to_ttgir_for_sm90():
    """A Hopper kernel of each epilogue shape that runs on slices, compiled as far as TTGIR for sm_90 on 4 or 8
    slices with the slice loop: each consumer's epilogue is there once, in a loop of its own, where unrolled it is
    there once per slice, and twice in the loop by steps of 2 slices (counted by its stores)."""
    names = _one_per_epilogue([name for name in _modules_with("_consumer(")
                               if not _module(name).EPILOGUE.column_group])
    assert {"geglu_dgrad", "gate_up_bias_swiglu", "lm_head_logsumexp"} <= set(names)
    found = _ttgir_each("[unrolled := hopper.HopperConfig(stages=3, epilogue_split=max(module.EPILOGUE.split, 4)), "
                        "dataclasses.replace(unrolled, slice_loop=True), "
                        "dataclasses.replace(unrolled, slice_loop=True, slice_unroll=2)]", names)
    for name in names:
        unrolled, loop, by_two = found[name]
        stores = [t.count("tt.store") + t.count("ttng.async_tma_copy_local_to_global")
                  for t in (unrolled, loop, by_two)]
        assert stores[1] > 0 and stores[0] == max(_module(name).EPILOGUE.split, 4) * stores[1], (name, stores)
        assert stores[2] == 2 * stores[1], (name, stores)
        assert loop.count("scf.for") == by_two.count("scf.for") == unrolled.count("scf.for") + 2, name


def test_column_groups_are_lowered():
    """Qwen3's QK-norm: a group value is held over its group's columns in the accumulator's layout
    (hopper.group_reduce), meets tiles as it is, and is stored by the first column of each group; the default
    config's epilogue slices hold whole heads (no slicing at 128 columns)."""
    kernels = dict((k.name, (k, t)) for k, t in _kernels(SPECS))
    assert unlowered(*kernels["qkv_qk_norm_rope"]) == []
    source = render_gluon([kernels["qkv_qk_norm_rope"]], "codagen build specs/")["kernels/gluon/qkv_qk_norm_rope.py"]
    for line in ("EPILOGUE = hopper.Epilogue(buffers=1, column_group=128)",
                 "ss = hopper.group_reduce(zv, tile_mask, GROUP=128, OP=tile.SUMSQ)",
                 "tl.store(head_rstd_ptr + rows[:, None] * stride_head_rstd_m + (cols // 128)[None, :] * "
                 "stride_head_rstd_n,",
                 "rho.to(head_rstd_ptr.dtype.element_ty), mask=tile_mask & (cols % 128 == 0)[None, :])",
                 "gain = rho * wn_qk[None, :]"):
        assert line in source, line
    assert "expand_groups" not in source


def test_cli_build_notes_the_fallbacks(tmp_path):
    spec = tmp_path / "specs" / "accumulated.yaml"
    spec.parent.mkdir()
    spec.write_text("kernel: accumulated\ndoc: A GEMM added into its output.\ngemm: {a: a, b: b, b_layout: nk}\n"
                    "inputs: {a: [M, K], b: [N, K]}\noutputs: {dx: {shape: [M, N], inplace: true}}\n"
                    "epilogue:\n  - accumulate: {x: acc, into: dx}\n")
    run = subprocess.run([sys.executable, "-m", "codagen", "build", "specs/"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert "note: specs/accumulated.yaml:7:5: accumulate: {x: acc, into: dx}: no Gluon lowering of 'accumulate' " \
           "yet" in run.stderr
    assert not (tmp_path / "generated" / "kernels" / "gluon" / "accumulated.py").exists()


def test_lowering_is_one_registry_entry(monkeypatch):
    """A primitive's "gluon" emitter entry is what lowers it: without it, the step is named as a fallback."""
    kernels = {k.name: (k, t) for k, t in _kernels(SPECS)}
    assert not unlowered(*kernels["lm_head_logits"])
    monkeypatch.delitem(PRIMITIVES["select"].emitters, "gluon")
    found = [str(f) for f in unlowered(*kernels["lm_head_logits"])]
    assert len(found) == 1 and "select: {x: zt, index: target, to: target_logit}: no Gluon lowering of 'select' " \
        "yet" in found[0]


_TTGIR = """
import importlib.util, json, sys
sys.path.insert(0, {benchmarks!r})
import gluon_compile
from codagen.runtime import gluon_hopper as hopper
found = {{}}
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("gluon_" + path.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found[path] = gluon_compile.ttgir(module, hopper.default_config(module.EPILOGUE))
print(json.dumps(found))
"""


# casts and one_hot in a kernel the backend lowers (tests/specs/ has them beside steps it does not lower yet)
CAST_ONE_HOT = """\
kernel: casts_one_hot
doc: Logits gradient shape, with casts.
gemm: {a: a, b: b, b_layout: nk}
inputs: {a: [M, K], b: [N, K], target: {shape: [M], dtype: index}}
outputs: {dz: [M, N], rounded: [M, N]}
epilogue:
  - one_hot: {index: target, out: hit}
  - sub: {x: acc, y: hit, out: d}
  - cast: {x: d, dtype: T, out: d_t}
  - cast: {x: d_t, dtype: float16, out: d_h}
  - store: {x: d, to: dz}
  - store: {x: d_h, to: rounded}
"""


# RoPE of pairs loaded from memory, and a tile input N wide read from the first half of a buffer made for pairs
PAIRS_ROPE = """\
kernel: pairs_rope
doc: Rotated saved pairs beside a residual.
gemm: {a: a, b: b, b_layout: nk}
inputs: {a: [M, K], b: [N, K], z: [M, 2*N], r: [M, N], positions: {shape: [M], dtype: index}, freqs: [N]}
outputs: {rotated: [M, 2*N], with_residual: [M, N]}
epilogue:
  - rope_bwd: {x: z, positions: positions, freqs: freqs, out: zr}
  - store: {x: zr, to: rotated}
  - add: {x: acc, y: r, out: s}
  - store: {x: s, to: with_residual}
"""


# every group_reduce op, and group values loaded, stored and meeting rows, columns and tiles (tests/specs/
# t_group_reduce.yaml without its accumulate)
GROUPS = (TEST_SPECS / "t_group_reduce.yaml").read_text().replace("kernel: t_group_reduce", "kernel: groups") \
    .replace("  g_acc: {shape: [M, groups(N)], inplace: true}\n", "") \
    .replace("  - accumulate: {x: gr, into: g_acc}\n", "")


def test_lowers_to_ttgir_for_sm90(tmp_path):
    """Every module the backend generates, for specs/, tests/specs/, CAST_ONE_HOT, PAIRS_ROPE and GROUPS
    (which use every primitive it lowers), compiled by the installed Triton's Gluon as far as TTGIR for sm_90:
    in a subprocess, since the compiler needs Triton's interpreter off."""
    paths = sorted(str(p) for p in (REPO / "generated" / "kernels" / "gluon").glob("*.py") if p.stem != "__init__")
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "casts_one_hot.yaml").write_text(CAST_ONE_HOT)
    (tmp_path / "specs" / "pairs_rope.yaml").write_text(PAIRS_ROPE)
    (tmp_path / "specs" / "groups.yaml").write_text(GROUPS)
    lowered_ops = set()
    rendered = {}
    for k, types in _kernels(TEST_SPECS) + _kernels(tmp_path / "specs"):
        rendered[k.name] = render_gluon([(k, types)], "test")
        for rel, text in rendered[k.name].items():
            if not rel.endswith("__init__.py"):
                (tmp_path / Path(rel).name).write_text(text)
                paths.append(str(tmp_path / Path(rel).name))
                lowered_ops |= {s.op for s in k.steps}
    for k, types in _kernels(SPECS):
        if not unlowered(k, types):
            lowered_ops |= {s.op for s in k.steps}
    assert LOWERED <= lowered_ops, "each primitive with a Gluon emitter is compiled by some kernel here"
    assert "kernels/gluon/groups.py" in rendered["groups"]
    pairs_rope = rendered["pairs_rope"]["kernels/gluon/pairs_rope.py"]
    assert "tile.rope_pairs(z_even, z_odd, positions.to(tl.float32), freqs, INVERSE=True)" in pairs_rope
    assert "r = tile.widen(hopper.view(buffers[1], r_desc).load(SLICE))" in pairs_rope
    assert "hopper.store_narrow_tile(with_residual_desc, buffers[1], s, pid_m * BLOCK_M, pid_n * BLOCK_N" in pairs_rope
    found = _compiled(_TTGIR, paths, TRITON_DEFAULT_FP_FUSION="1")
    assert sorted(found) == sorted(paths)
    for path, ttgir in found.items():
        assert "ttg.warp_specialize" in ttgir, path
        assert "ttng.warp_group_dot" in ttgir, path  # wgmma
        assert "ttng.async_tma_copy_global_to_local" in ttgir, path
        if "hopper.store_tile(" in Path(path).read_text():  # a kernel that stores tiles (not lm_head_logsumexp)
            assert "ttng.async_tma_copy_local_to_global" in ttgir, path


def test_tile_inputs_streamed_through_epilogue_stages():
    """A Hopper kernel of each epilogue shape with tile inputs, compiled as far as TTGIR for sm_90 with 2 epilogue
    stages of its 4 or 8 slices: each consumer allocates buffers for 2 slices, not all, and waits for a slice's
    stores to have read its buffers before each of the later slices loads into them."""
    names = _one_per_epilogue(_modules_with("_load_inputs("))
    assert {"geglu_dgrad", "gemma_norm_dgrad_residual"} <= set(names)
    found = _ttgir_each("[whole := hopper.HopperConfig(stages=3, epilogue_split=max(module.EPILOGUE.split, 4)), "
                        "dataclasses.replace(whole, epilogue_stages=2)]", names)
    for name in names:
        epilogue = _module(name).EPILOGUE
        split = max(epilogue.split, 4)
        whole, streamed = found[name]
        buffers = f"x128x{epilogue.columns * 128 // split}xbf16"
        assert f"memdesc<{2 * split * epilogue.buffers}{buffers}" in whole, name
        assert f"memdesc<{2 * 2 * epilogue.buffers}{buffers}" in streamed, name
        reloads = 2 * (split - 2)  # per consumer, the slices after the first two
        assert streamed.count("async_tma_store_wait") == whole.count("async_tma_store_wait") + reloads, name


_TRANSPOSED_A = """
import importlib, json, re, subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, {benchmarks!r})
import gluon_compile, triton
from codagen.runtime import gluon_hopper as hopper
module = importlib.import_module("generated.kernels.gluon." + sys.argv[1])
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
found = {{}}
for a_km in (False, True):
    compiled = gluon_compile.compile_kernel(module, hopper.default_config(module.EPILOGUE), a_km=a_km)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found[str(a_km)] = sorted(set(re.findall(r"HGMMA[.0-9A-Zx]+ R[0-9]+, gdesc\\[UR[0-9]+\\]([.a-zA-Z]*)", sass)))
print(json.dumps(found))
"""


def test_a_read_in_either_memory_order(monkeypatch):
    """The GEMM's a may have M contiguous (the transpose of a [K, M] tensor, as dz^T in a weight gradient): the
    launcher then addresses its transpose in [BLOCK_K, BLOCK_M] blocks (descriptor_a) and the kernel's MMAs
    read it transposed from shared memory (A_KM; compiled for sm_90: HGMMA's tnspA, and as many); the launch
    checks take it, and still refuse one whose transpose TMA cannot address."""
    found = _compiled(_TRANSPOSED_A, ["out_proj_residual_norm"])
    assert found == {"False": [""], "True": [".tnspA"]}
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    monkeypatch.setattr(hopper, "available", lambda device: True)
    m = _module("matmul")
    config = hopper.default_config(m.EPILOGUE)
    a_t, b = torch.randn(72, 40).bfloat16(), torch.randn(24, 72).bfloat16()  # a = a_t.T: [40, 72], M-contiguous
    a = a_t.T
    assert hopper.mn_major(a) and not hopper.mn_major(a_t)
    desc = hopper.descriptor_a(a, config)
    assert desc.base.data_ptr() == a_t.data_ptr() and list(desc.block_shape) == [config.block_k, config.block_m]
    assert list(hopper.descriptor_a(a_t, config).block_shape) == [config.block_m, config.block_k]
    out = torch.empty(40, 24).bfloat16()
    values = {"a": a, "b": b, "out_tile": out}
    hopper.check("matmul", config, m.EPILOGUE, torch.bfloat16, 72, values, m.TMA_TENSORS, m.POINTER_TENSORS)
    ragged = torch.randn(72, 41).bfloat16().T  # the rows of its transpose 82 bytes apart
    with pytest.raises(ValueError, match="TMA cannot address 'a'"):
        hopper.check("matmul", config, m.EPILOGUE, torch.bfloat16, 72, {**values, "a": ragged}, m.TMA_TENSORS,
                     m.POINTER_TENSORS)


def test_a_base_tma_cannot_address_is_refused_and_planned_apart(monkeypatch):
    """A view at an offset that is no multiple of 16 bytes: the Hopper kernel's checks refuse it (so that a tuning
    table's Hopper choice falls back to the tl kernel, backends.or_tl, rather than fail in the descriptor at
    launch), and the tl launcher's plans key on alignment, so that such a call gets a plan of its own."""
    from codagen import runtime

    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    monkeypatch.setattr(hopper, "available", lambda device: True)
    m = _module("matmul")
    config = hopper.default_config(m.EPILOGUE)
    storage = torch.randn(40 * 72 + 8).bfloat16()
    a, shifted = storage[:40 * 72].view(40, 72), storage[1:40 * 72 + 1].view(40, 72)  # 2 bytes further
    b, out = torch.randn(24, 72).bfloat16(), torch.empty(40, 24).bfloat16()
    values = {"a": a, "b": b, "out_tile": out}
    hopper.check("matmul", config, m.EPILOGUE, torch.bfloat16, 72, values, m.TMA_TENSORS, m.POINTER_TENSORS)
    with pytest.raises(ValueError, match="'a': its base is not 16-byte aligned"):
        hopper.check("matmul", config, m.EPILOGUE, torch.bfloat16, 72, {**values, "a": shifted}, m.TMA_TENSORS,
                     m.POINTER_TENSORS)
    assert runtime.signature((a, b, out), None) != runtime.signature((shifted, b, out), None)
    assert runtime.signature((a, b, out), None) == runtime.signature((a.clone(), b, out), None)


def _modules_with(text: str) -> list[str]:
    """The generated Hopper modules whose source holds `text`, by name."""
    return sorted(p.stem for p in (REPO / "generated" / "kernels" / "gluon").glob("*.py") if text in p.read_text())


def _one_per_epilogue(names: list[str]) -> list[str]:
    """The first of `names` with each shape of epilogue (its EPILOGUE: buffers, tile inputs, scratch, columns,
    slices, column groups): what a config's schedule changes in the module, so that the tests compiling each
    kernel in several configs compile one kernel of each (the epilogue's own code compiles in every module in
    test_lowers_to_ttgir_for_sm90)."""
    first = {}
    for name in names:
        first.setdefault(_module(name).EPILOGUE, name)
    return sorted(first.values())


_TTGIR_EACH = """
import dataclasses, importlib, json, sys
sys.path.insert(0, {benchmarks!r})
import gluon_compile
from codagen.runtime import gluon_hopper as hopper
found = {{}}
for name in sys.argv[1:]:
    module = importlib.import_module("generated.kernels.gluon." + name)
    configs = CONFIGS
    found[name] = [gluon_compile.ttgir(module, config) for config in configs]
print(json.dumps(found))
"""


def _ttgir_each(configs: str, names: list[str]) -> dict:
    """Each named Hopper kernel lowered as far as TTGIR for sm_90 in each of `configs` (an expression of
    `module`, the kernel's module, and `hopper`), as a list by name."""
    return _compiled(_TTGIR_EACH.replace("CONFIGS", configs), names)


def _compiled(script: str, args: list[str], **env) -> dict:
    """What a compiling script (its last line of output, JSON) gives for `args`: run in a subprocess, since
    the compiler needs Triton's interpreter off."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO), **env}
    run = subprocess.run([sys.executable, "-c", script.format(benchmarks=str(REPO / "benchmarks")), *args],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"gluon_{name}", REPO / "generated" / "kernels" / "gluon"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launch_refused_off_hopper():
    m = _module("out_proj_residual_norm")
    y, w, x = torch.randn(33, 40), torch.randn(24, 40), torch.randn(33, 24)
    outs = {"x_out": torch.empty(33, 24), "h": torch.empty(33, 24), "ss": torch.empty(33, 1)}
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        m.launch(y, w, x, torch.randn(24), **outs)
    with pytest.raises(ValueError, match="'wn' must be a torch.Tensor"):
        m.launch(y, w, x, [1.0] * 24, **outs)
    half = {k: v.to(torch.bfloat16) if k != "ss" else v for k, v in outs.items()}
    with pytest.raises(ValueError, match="sm_90 GPU only"):
        m.launch(y.bfloat16(), w.bfloat16(), x.bfloat16(), torch.randn(24).bfloat16(), **half)


# ---- the Hopper kernel as a tuning candidate, and the tl launcher's dispatch to it --------------------------

def test_backend_recorded_in_tables(tmp_path):
    from codagen import tablefile
    from codagen.runtime import autotune, tables
    from codagen.tablefile import entry_of
    from codagen.tune.tables import write_table

    matmul = next(k for k, _ in _kernels(SPECS) if k.name == "matmul")
    chosen = HopperConfig(128, 128, 64, stages=5, group_m=16)
    path = tmp_path / "nvidia-h200" / "matmul.json"
    write_table(path, matmul, "nvidia-h200", "3.6.0", {"32768x2048x2048": {**entry_of(chosen), "ms": 0.4}})
    data = json.loads(path.read_text())
    assert data["shapes"]["32768x2048x2048"]["backend"] == "gluon"
    assert "backend" not in data["shapes"]["32768x2048x2048"]["config"]
    # a table written before the field existed: its configs are the tl kernel's
    del data["shapes"]["32768x2048x2048"]["backend"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    autotune.clear_caches()
    assert tables.entries(str(path), data["fingerprint"], "3.6.0")["32768x2048x2048"] == chosen
    assert tables.entries(str(old), data["fingerprint"], "3.6.0") == {}  # a tl config of no field stages: skipped
    with pytest.raises(ValueError, match="backend must be one of tl, gluon"):
        tablefile.config_of_entry({"backend": "cuda", "config": {}})
    assert HopperConfig(epilogue_split=8).epilogue_n == 16  # the epilogue on slices of 16 columns
    # where the Hopper kernel refuses the arguments, the tl kernel runs with the same slices
    assert HopperConfig(epilogue_split=8).as_tl().epilogue_n == 16


def test_gluon_candidates_only_where_the_hopper_kernel_runs():
    from codagen.tune.candidates import GEMM_CANDIDATES, GLUON_CANDIDATES, CUBLAS_CANDIDATES, candidates, gluon_candidates
    from codagen.tune.harness import other_backends

    kernels = {k.name: k for k, _ in _kernels(SPECS)}
    tiles_and_quarters = tuple(c for c in GLUON_CANDIDATES if c.epilogue_split in (1, 4))
    assert candidates(kernels["matmul"], ("gluon",)) == GEMM_CANDIDATES + CUBLAS_CANDIDATES + tiles_and_quarters
    assert gluon_candidates(kernels["swiglu_dgrad"]) == GLUON_CANDIDATES  # and eighths
    assert candidates(kernels["matmul"]) == GEMM_CANDIDATES + CUBLAS_CANDIDATES
    assert all(type(c) is HopperConfig and c.backend == "gluon" for c in GLUON_CANDIDATES)
    assert all(c.backend == "tl" for c in candidates(kernels["rmsnorm_stats"], ("gluon",)))
    tl_matmul = importlib.import_module("generated.kernels.matmul")
    assert other_backends(tl_matmul, torch.device("cpu")) == ()  # the interpreter runs no Gluon kernel


def test_every_hopper_kernel_has_a_candidate_that_fits():
    """`codagen tune` can pick each Hopper kernel: some Gluon candidate fits its shared memory (the kernels with
    tiles of pairs need 3 stages of BK 64, or 5 of BK 32), and where its default runs the epilogue on slices
    (8 for tiles of pairs, 4 for RoPE), one that fits runs those."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from codagen.tune.candidates import gluon_candidates

    kernels = {k.name: k for k, _ in _kernels(SPECS)}
    for path in sorted((REPO / "generated" / "kernels" / "gluon").glob("*.py")):
        if path.stem == "__init__":
            continue
        epilogue = _module(path.stem).EPILOGUE
        fitting = [c for c in gluon_candidates(kernels[path.stem])
                   if hopper.launch_config(c, epilogue).smem_bytes(2, epilogue) <= hopper.SMEM_LIMIT]
        assert fitting, path.stem
        assert epilogue.split == 1 or epilogue.split in {c.epilogue_split for c in fitting}, path.stem


def _matmul_args():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(37, 24, generator=g), torch.randn(40, 24, generator=g)
    return a, b, torch.full((37, 40), float("nan"))


def test_tl_launcher_dispatches_on_the_configs_backend(monkeypatch):
    from codagen.runtime import backends

    tl_matmul = importlib.import_module("generated.kernels.matmul")
    calls = []
    monkeypatch.setattr(backends, "launch", lambda package, kernel, /, **kw: calls.append((package, kernel, kw)))
    a, b, out = _matmul_args()
    gluon = HopperConfig(64, 64, 32, stages=4)
    tl_matmul.launch(a, b, out_tile=out, config=gluon)
    assert [(p, k, sorted(kw)) for p, k, kw in calls] == [("generated.kernels", "matmul", ["a", "b", "config",
                                                                                        "out_tile"])]
    assert calls[0][2]["a"] is a and calls[0][2]["out_tile"] is out and calls[0][2]["config"] == gluon
    assert torch.isnan(out).all()  # the tl kernel did not run
    tl_matmul.launch(a, b, out_tile=out, config=Config(64, 64, 32, 8, 4, 1))
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), a.double() @ b.double().T, rtol=1e-4, atol=1e-4)


def test_gluon_config_refused_off_hopper_and_where_not_lowered():
    from codagen.runtime import backends

    a, b, out = (t.bfloat16() for t in _matmul_args())
    gluon = HopperConfig()
    with pytest.raises(ValueError, match="sm_90 GPU only"):  # the Hopper module's own refusal
        importlib.import_module("generated.kernels.matmul").launch(a, b, out_tile=out, config=gluon)
    # a table's choice falls back to the tl kernel where the Hopper kernel refuses the arguments
    assert backends.or_tl("generated.kernels", "matmul", gluon, (a, b, out)) == Config(num_warps=4, num_stages=4)
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"HopperConfig, the gluon backend's config, but that backend does not lower "
                                         r"this kernel \(generated/kernels/gluon/__init__.py says why\)"):
        importlib.import_module("generated.kernels.rmsnorm_stats").launch(
            x, torch.randn(8), h=torch.empty(5, 8), ss=torch.empty(5, 1), config=gluon)


def test_hopper_config_of_a_launch():
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    epilogue = hopper.Epilogue(buffers=1)
    assert hopper.launch_config(None, epilogue) == hopper.default_config(epilogue)
    assert hopper.HopperConfig is HopperConfig  # the one config type of the Hopper kernel, tables' and launches'
    chosen = HopperConfig(128, 128, 64, stages=5, group_m=16)
    assert hopper.launch_config(chosen, epilogue) is chosen
    split = hopper.launch_config(HopperConfig(128, 128, 64, stages=3, epilogue_split=8), epilogue)
    assert split.epilogue_n == 16
    pairs = hopper.Epilogue(buffers=1, columns=2, split=8)
    assert hopper.default_config(pairs) == hopper.HopperConfig(128, 128, 64, stages=3, epilogue_split=8)
    with pytest.raises(ValueError, match="tl backend given to a Hopper"):
        hopper.launch_config(Config(), epilogue)


@triton.jit
def _ropes(x_ptr, pos_ptr, freqs_ptr, by_pair_ptr, by_column_ptr, INVERSE: tl.constexpr):
    """RoPE of a 16x32 tile both ways: frequencies per pair (tile.rope) and per column (tile.rope_by_columns)."""
    rows, cols, pairs = tl.arange(0, 16), tl.arange(0, 32), tl.arange(0, 16)
    x = tl.load(x_ptr + rows[:, None] * 32 + cols[None, :])
    pos = tl.load(pos_ptr + rows).to(tl.float32)
    tl.store(by_pair_ptr + rows[:, None] * 32 + cols[None, :], tile.rope(x, pos, tl.load(freqs_ptr + pairs), INVERSE))
    tl.store(by_column_ptr + rows[:, None] * 32 + cols[None, :],
             tile.rope_by_columns(x, pos, tl.load(freqs_ptr + cols // 2), INVERSE))


def test_rope_by_columns_is_rope():
    """The Hopper kernels' RoPE (frequencies per column, angles split as the tile is) against the tl kernels'
    (frequencies per pair), forward and inverse, under the interpreter on fresh random data."""
    x, freqs = torch.randn(16, 32), torch.rand(16)
    positions = torch.randint(0, 4096, (16,))
    for inverse in (False, True):
        by_pair, by_column = torch.empty_like(x), torch.empty_like(x)
        _ropes[(1,)](x, positions, freqs, by_pair, by_column, inverse)
        assert torch.equal(by_pair, by_column)
        assert not torch.equal(by_pair, x)


@triton.jit
def _column_slices(x_ptr, out_ptr, PARTS: tl.constexpr):
    """Each of the PARTS column slices of a 16x64 tile (tile.column_slice) stored in its place."""
    rows, cols = tl.arange(0, 16), tl.arange(0, 64)
    x = tl.load(x_ptr + rows[:, None] * 64 + cols[None, :])
    width: tl.constexpr = 64 // PARTS
    for part in tl.static_range(PARTS):
        slice_cols = part * width + tl.arange(0, width)
        tl.store(out_ptr + rows[:, None] * 64 + slice_cols[None, :], tile.column_slice(x, part, PARTS))


def test_column_slices_up_to_eight():
    """The epilogue's column slices (1, 2, 4 or 8 of a tile; the Hopper kernels' pairs take 8), under the
    interpreter on fresh random data: together they are the tile, each in its place."""
    x = torch.randn(16, 64)
    for parts in (1, 2, 4, 8):
        out = torch.full_like(x, float("nan"))
        _column_slices[(1,)](x, out, parts)
        assert torch.equal(out, x), parts


def test_every_hopper_launch_plan_takes_the_buffers_its_tl_twin_allocates(monkeypatch):
    """Each Hopper kernel's launch checks (shapes, partial-reduction widths per epilogue slice, column groups, TMA
    alignment) accept the arguments the tuner and the GPU tests draw for its default configuration, as if on a
    Hopper GPU: a mismatch there would refuse every launch on the GPU."""
    from codagen.runtime import gluon_hopper as hopper
    from codagen.tune import harness
    from codagen.tune.shapes import Shape

    monkeypatch.setattr(hopper, "available", lambda device: True)
    kernels = {c.kernel.name: c.kernel for c in api.load([SPECS]) if isinstance(c, api.Checked)}
    names = sorted(p.stem for p in (REPO / "generated" / "kernels" / "gluon").glob("*.py") if p.stem != "__init__")
    assert names
    for name in names:
        module = importlib.import_module(f"generated.kernels.gluon.{name}")
        config = hopper.launch_config(None, module.EPILOGUE)
        shape = Shape(300, 1024, 256)  # M ragged; N and K as TMA needs them (16-byte rows), whole groups of 128
        args = harness.make_inputs(kernels[name], module, shape, torch.device("cpu"))
        args.update(harness.new_outputs(kernels[name], module, shape, config, torch.device("cpu")))
        module.check_launch(tuple(args[d.name] for d in module.DECLS), config)


def test_descriptors_share_their_layout():
    """A TMA descriptor's shared-memory layout is made once per block shape and dtype (most of a descriptor's
    host time), and is the layout Gluon makes for that block."""
    hopper = pytest.importorskip("codagen.runtime.gluon_hopper")
    from triton.experimental.gluon import language as gl

    a, b = torch.empty(256, 128, dtype=torch.bfloat16), torch.empty(512, 64, dtype=torch.bfloat16)
    da, db = hopper.descriptor(a, [128, 64]), hopper.descriptor(b, [128, 64])
    assert da.layout is db.layout
    assert da.layout == gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16)
    assert hopper.descriptor(a.half(), [128, 64]).layout == gl.NVMMASharedLayout.get_default_for([128, 64],
                                                                                                  gl.float16)
    assert (list(da.shape), list(da.strides), list(da.block_shape)) == ([256, 128], [128, 1], [128, 64])
