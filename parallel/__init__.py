"""Model parallelism with no knowledge of requests: process groups, named collectives, sharded layers."""
