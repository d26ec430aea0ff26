"""Which (mask, plan) of the warpgroup-pair test hangs: plans run in a child process from a start
index, each announced before its launch; a child that stops answering is killed and the next one
starts after the plan it hung on."""
import subprocess, sys, time
if len(sys.argv) > 1:
    import torch
    sys.path.insert(0, "tests")
    from test_native_gpu import one_sided_masks, plans_to_check
    from tessera_diffusers import LogicalMask, build_mask_state, prepare, ops
    from tessera_diffusers.catalog import all_kernels
    from tessera_diffusers.testing import check_against_reference, random_qkv
    tile_kv, stages, start = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    device = torch.device("cuda")
    kernel = next(k for k in all_kernels() if k.family.value == "hopper" and (k.tile_q, k.tile_kv, k.head_dim, k.dtype)
                  == (128, tile_kv, 128, "bf16") and k.stages == stages)
    seq_q, seq_kv = 16 * 64 + 40, 22 * 64 + 9
    q, k, v = random_qkv(1, seq_q, seq_kv, 2, 128, torch.bfloat16, device, seed=11)
    jobs = [(name, b, plan) for name, b in one_sided_masks(device).items() for plan in plans_to_check(kernel, 64, 64)]
    for index in range(start, len(jobs)):
        name, blocks, plan = jobs[index]
        mask = LogicalMask(blocks, 64, 64, seq_q, seq_kv)
        pp = prepare(plan, build_mask_state(mask))
        print("START", index, name, plan.name, flush=True)
        out, lse = ops.run_native(pp, q, k, v, 0.09, True)
        torch.cuda.synchronize()
        print("DONE", check_against_reference(out, lse, q, k, v, mask, 0.09).ok(), flush=True)
    print("END", flush=True)
    sys.exit(0)
import os, select
for tile_kv, stages in [tuple(int(x) for x in c.split(",")) for c in os.environ.get("PROBE", "128,2;64,2;128,3").split(";")]:
    start = 0
    while True:
        proc = subprocess.Popen([sys.executable, __file__, str(tile_kv), str(stages), str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last, ended = None, False
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], float(os.environ.get("PROBE_WAIT", "10")))
            if not ready:
                print(tile_kv, stages, "HANG at", last, flush=True)
                proc.kill(); proc.wait(); time.sleep(2)
                start = int(last.split()[1]) + 1 if last and last.startswith("START") else start + 1
                break
            line = proc.stdout.readline()
            if not line:
                proc.wait(); ended = True; break
            line = line.strip()
            if line.startswith("START"): last = line
            elif line.startswith("DONE"):
                if "False" in line: print(tile_kv, stages, "WRONG", last, flush=True)
            elif line == "END": ended = True
            elif line: print(tile_kv, stages, line[-200:], flush=True)
        if ended: break
    print(tile_kv, stages, "finished", flush=True)
