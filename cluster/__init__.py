"""Ray plumbing: placing a replica's ranks, their rendezvous, and the executor that drives them."""
