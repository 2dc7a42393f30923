"""python -m harness.gpucheck prepare | run [--out F] [--group formats|families|all] [--only NAME ...]"""
import sys

USAGE = ("usage: python -m harness.gpucheck prepare | run [--out F] [--group formats|families|all] [--only NAME ...]\n"
         "  prepare  (CPU machine) build tiny random-weight bundles of every GPU format and family into build/gpu-check/\n"
         "  run      (GPU machine) AOT cubins without JIT, triton vs torch backends, GPU vs CPU, vs HF")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("prepare", "run"):
        print(USAGE, file=sys.stderr)
        return 2
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "prepare":
        from harness.gpucheck.prepare import main as prepare
        return prepare()
    from harness.gpucheck.run import main as run
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
