"""CPU decode speed of the lookup-table formats against the default affine one, and of the LUT GEMV's
two kernels (AVX-512 permutes, the portable per-weight lookup): the default model quantized by
`ingot quantize --no-calibration --no-awq --no-gptq` to each --formats entry (the rounding does not
change the speed), then rounds of 64 greedy steps per engine, interleaved; medians of --rounds.

    nice -n 19 python benchmarks/lab/lut_decode.py [--formats lut4:b64,lut4:g128,uint4:32:k] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import ingot.llm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="lut4:b64,lut4:g128,uint4:32:k")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from ingot.backends.cpu import lut_kernels
    from ingot.llm.generate import default_model_path
    from ingot.options import CompileOptions, CpuOptions

    options = CompileOptions(cpu=CpuOptions(threads=args.threads))
    available = lut_kernels.PERMUTE   # the CPU has the permute kernel; the flag is read as each step is made
    engines = {}
    with tempfile.TemporaryDirectory() as folder:
        for fmt in args.formats.split(","):
            out = os.path.join(folder, fmt.replace(":", "_") + ".ingot")
            subprocess.run([sys.executable, "-m", "ingot.cli", "quantize", default_model_path(), "-o", out, "--format", fmt,
                            "--no-calibration", "--no-awq", "--no-gptq", "--no-eval"], check=True, capture_output=True)
            kernels = [True, False] if fmt.startswith("lut") and available else [None]
            for permute in kernels:
                lut_kernels.PERMUTE = available if permute is None else permute
                tag = fmt + {True: " permute", False: " portable", None: ""}[permute]
                engines[tag] = ingot.llm.load(out, options=options)
        lut_kernels.PERMUTE = available
        speeds = {tag: [] for tag in engines}
        for r in range(args.rounds + 1):   # round 0 warms up
            for tag, llm in engines.items():
                list(llm.generate("Tell me about the sea.", max_tokens=args.steps, temperature=0, chat=False))
                if r:
                    speeds[tag].append(llm.stats.decode_tok_s)
    base = statistics.median(speeds[list(speeds)[-1]])
    print(f"# {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}; decode tok/s, medians of {args.rounds}")
    for tag, s in speeds.items():
        print(f"{tag:<22} {statistics.median(s):7.1f}  {statistics.median(s) / base:5.2f}x the last row")


if __name__ == "__main__":
    main()
