"""One FP8-KV paged-decode case for Nsight Compute: `ncu -k regex:paged_decode_kernel --launch-skip 3
--launch-count 1 --section ... python3 -m harness.perf.kernels.decode_ncu --case fp8-b512-ctx1536 --cfg '{...}'`.

The sweep (harness/perf/kernels/sweep.py) says which launch configuration is fastest; this says why:
achieved DRAM bandwidth, occupancy and what the warps wait on, for the configurations named. Each --cfg
(a JSON object of plugins.tuning "paged_decode_fp8" values) runs the case 4 times, eagerly, so ncu can
skip the warm-up launches and profile one.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.perf.kernels.decode_ncu", description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="fp8-b512-ctx1536", help="<kv>-b<batch>-ctx<context> (default %(default)s)")
    ap.add_argument("--cfg", action="append", default=[], help="JSON tuning values; repeat for several")
    a = ap.parse_args(argv)
    import torch

    from harness.perf.kernels.graphed import decode_calls
    from plugins import tuning
    if not torch.cuda.is_available():
        print("decode_ncu: no NVIDIA GPU visible; run on the GPU machine under ncu", file=sys.stderr)
        return 2
    kv, b, c = a.case.split("-")
    calls = decode_calls(int(b[1:]), int(c[3:]), kv, l2_bytes=1)[0]
    for cfg in a.cfg or ["{}"]:
        values = json.loads(cfg)
        with tuning.override("paged_decode_fp8", **values):
            for _ in range(4):
                calls[0]()
            torch.cuda.synchronize()
        print(f"decode_ncu: {a.case} {values} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
