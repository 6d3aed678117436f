"""One module per suite, each exposing `cases(opts) -> Iterator[hpcops.bench.Case]`."""
