"""`python -m router.proto [--force]`: make sure the gRPC stubs match inference.proto and the installed
grpc (importing the package already regenerates stale ones); --force regenerates them anyway."""
import sys

from router.proto import GENERATED, build

build(force="--force" in sys.argv[1:])
print("gRPC stubs ready: " + ", ".join(str(p) for p in GENERATED))
