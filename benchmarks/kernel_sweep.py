"""Per-kernel sweep on a GPU: host overhead of one op call, then every Llama kernel in a few configurations,
checked against the float64 reference on NaN-prefilled outputs and timed by CUDA-graph replay against the
cuBLAS GEMM of the same shape. Results: benchmarks/results/h200-kernels.md. Run: python benchmarks/kernel_sweep.py
"""
import cProfile, pstats, importlib, sys, time, torch, triton, io
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from codagen import api, reference, runtime
from codagen.runtime import Config
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
checked = {c.kernel.name: c.kernel for c in api.load(["specs/"]) if hasattr(c, "kernel")}
def make_args(mod, Mm, N, K):
    sz = {"M": Mm, "N": N, "K": K, "N/2": N // 2, "2*N": 2 * N}
    args = {}
    for d in mod.DECLS:
        if d.output: continue
        shape = [sz[x] for x in d.dims]
        if d.dtype == "index": args[d.name] = torch.randint(0, N, shape, device="cuda")
        elif d.dtype == "float32": args[d.name] = (torch.rand(shape, device="cuda") + 0.5) if shape else torch.tensor(1.3, device="cuda")
        else: args[d.name] = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / (K ** 0.25 if "K" in d.dims else 1)
    return args
def outs_for(mod, k, Mm, N, K, cfg, fill=None):
    sz = {"M": Mm, "N": N, "K": K, "N/2": N // 2, "2*N": 2 * N, "tiles(N)": triton.cdiv(N, cfg.block_n), "tiles(M)": triton.cdiv(Mm, cfg.block_m)}
    return {o.name: torch.full([sz[d.value] for d in o.dims], float("nan") if fill is None else fill, device="cuda",
            dtype=torch.float32 if o.dtype.value == "float32" else torch.bfloat16) for o in k.outputs}
def graph_ms(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    return triton.testing.do_bench(lambda: g.replay(), return_mode="median") / reps
# 1. host overhead profile
mod = importlib.import_module("generated.kernels.out_proj_residual_norm"); k = checked["out_proj_residual_norm"]
args = make_args(mod, 16384, 2048, 2048); op = mod.out_proj_residual_norm
op(*args.values()); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(100): op(*args.values())
pr.disable(); torch.cuda.synchronize()
st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(18); print(st.getvalue()[-5000:])
cfg = runtime.pick_config(k.name, mod.SHA256, mod.TUNING, 16384, 2048, 2048, torch.device("cuda"))
o = outs_for(mod, k, 16384, 2048, 2048, cfg, 0.0)
for name, f in (("op", lambda: op(*args.values())), ("launch", lambda: mod.launch(*args.values(), **o, config=cfg))):
    f(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(100): f()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"host {name}: {1e6*(t1-t0)/100:.0f} us per call")
# 2. graph-timed configs (pure GPU time)
shapes = {"matmul": (16384, 2048, 2048), "out_proj_residual_norm": (16384, 2048, 2048), "gate_up_swiglu": (16384, 16384, 2048),
          "qkv_norm_rope": (16384, 3072, 2048), "swiglu_dgrad": (16384, 8192, 2048), "norm_dgrad_residual": (16384, 2048, 16384),
          "lm_head_logsumexp": (16384, 128256, 2048), "lm_head_ce_grad": (8192, 128256, 2048)}
configs = {"p128x128": Config(128, 128, 64, 8, 8, 3), "t128x256p": Config(128, 256, 64, 8, 8, 3, True, True),
           "t128x128": Config(128, 128, 64, 8, 8, 4, False, True), "t128x128p": Config(128, 128, 64, 8, 8, 4, True, True),
           "t128x64": Config(128, 64, 64, 8, 4, 4, False, True), "t64x128": Config(64, 128, 64, 8, 4, 4, False, True),
           "t128x128w4": Config(128, 128, 64, 8, 4, 4, False, True), "t64x64": Config(64, 64, 64, 8, 4, 4, False, True)}
for name, (Mm, N, K) in shapes.items():
    mod = importlib.import_module(f"generated.kernels.{name}"); k = checked[name]
    args = make_args(mod, Mm, N, K)
    a, b = args[k.gemm.a], args[k.gemm.b]; bb = b.T if k.gemm.b_layout.value == "nk" else b
    t_mm = graph_ms(lambda: a @ bb)
    line = f"{name:22s} {Mm}x{N}x{K} cuBLAS {t_mm:.3f} |"
    Ms = 1061
    small = {d.name: (args[d.name][:Ms] if d.dims and d.dims[0] == "M" else args[d.name]) for d in mod.DECLS if not d.output}
    for cname, cfg in configs.items():
        try:
            oc = outs_for(mod, k, Ms, N, K, cfg)
            mod.launch(*small.values(), **oc, config=cfg)
            ref = reference.run(k, small, cfg.block_m, cfg.block_n)
            err = max(((oc[n].double() - ref[n]).norm() / ref[n].norm()).item() for n in oc)
            of = outs_for(mod, k, Mm, N, K, cfg, 0.0)
            t = graph_ms(lambda: mod.launch(*args.values(), **of, config=cfg))
            line += f" {cname} {t/t_mm:.2f}x{'' if err < 2e-2 else ' ERR%.0e' % err} |"
        except Exception as e:
            line += f" {cname} FAIL {type(e).__name__} |"
    print(line, flush=True)
