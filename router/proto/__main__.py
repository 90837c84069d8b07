"""`python -m router.proto`: (re)generate the gRPC stubs from inference.proto now."""
from router.proto import GENERATED, build

build(force=True)
print("wrote " + ", ".join(str(p) for p in GENERATED))
