"""The served application: Ray Serve deployments, the OpenAI and gRPC front ends, the `Backend` contract
(router/protocol.py) they are written against, and the app's config (router/config.py)."""
