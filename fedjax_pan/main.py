"""Command-line entry point: python -m fedjax_pan.main --config=... --workdir=..."""

import sys


def main(argv=None) -> int:
  print("engine not built yet")
  return 0


if __name__ == "__main__":
  sys.exit(main())
